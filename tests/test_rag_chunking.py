"""Chunking a RAG document (``kdn.rag.corpus.chunk_document``): paragraphs packed, long ones
cut at sentences, run-on text cut into windows between characters (never inside a character's
combining marks or an emoji sequence, unless that "character" is longer than a window), so
nothing is lost, split or added."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidArgument
from kdn.rag import Document, chunk_document
from kdn.rag.corpus import CHUNK_END, paragraphs, sentences
from tests.test_rag import CharTokenizer


def test_chunking_packs_paragraphs_and_splits_long_ones() -> None:
    tok = CharTokenizer()
    para = " ".join(f"Sentence number {i} is here." for i in range(12))  # ~330 chars
    text = "Short one.\n\nShort two.\n\n" + para + "\n\n" + "x" * 200
    chunks = chunk_document(Document("d", text), tok, target_tokens=64, max_tokens=96)
    assert chunks[0].text == "Short one.\n\nShort two.\n\nSentence number 0 is here." + CHUNK_END
    assert all(c.tokens <= 96 + 2 for c in chunks), [c.tokens for c in chunks]
    assert all(c.text.endswith(CHUNK_END) for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(list(c.ids) == tok(c.text)["input_ids"] for c in chunks)
    # every sentence of the long paragraph lands whole in one chunk
    for s in sentences(para):
        assert sum(s in c.text for c in chunks) == 1, s
    # the run-on 200-character "sentence" is cut into windows, nothing lost
    assert "".join(c.text for c in chunks).count("x") == 200
    assert paragraphs("a\n\n\n b \n  \nc") == ["a", "b", "c"]
    assert sentences('He said "Go." Then left. 3 more.') == ['He said "Go."', "Then left.",
                                                            "3 more."]
    with pytest.raises(InvalidArgument):
        chunk_document(Document("d", "x"), tok, target_tokens=64, max_tokens=32)


class ByteTokenizer:
    """One token per UTF-8 byte, as a byte-level BPE's rarest characters: a window of ids can
    end inside a character, and decoding it alone gives U+FFFD."""

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_cjk_emoji_and_combining_marks_are_chunked_whole() -> None:
    assert sentences("他来了。她走了！好吗？「是。」然后 Then.") == [
        "他来了。", "她走了！", "好吗？", "「是。」", "然后 Then."]
    tok = ByteTokenizer()
    for text in ("华沙是波兰的首都和最大城市。它位于维斯瓦河畔。" * 40,  # sentences
                 "华沙是波兰的首都和最大城市" * 40,  # one run-on "sentence": windows
                 "🙂🚀🎉👍🏽👨\u200d👩\u200d👧" * 40, "e\u0301a\u0308o\u0302" * 200):
        chunks = chunk_document(Document("d", text), tok, target_tokens=64, max_tokens=96)
        pieces = [c.text.removesuffix(CHUNK_END) for c in chunks]
        assert "".join(pieces) == text, "a character was lost, split or added"
        assert all(c.tokens <= 96 + 2 for c in chunks), [c.tokens for c in chunks]
        for p in pieces:
            assert "\ufffd" not in p
            assert not p[0].startswith(("\u0301", "\u0308", "\u0302", "\u200d", "🏽"))
            assert not p.endswith("\u200d")


def test_a_cluster_longer_than_a_chunk_is_cut_inside_it() -> None:
    """Letters chained by zero-width joiners, or a letter under thousands of combining marks,
    are one "cluster" by the joiner rule: no character people read, yet each was one chunk of
    any length (26,999 tokens, past the model's context, with max_tokens 96)."""
    tok = ByteTokenizer()
    for text in ("\u200d".join("abcdefghij" * 100), "a" + "\u0301" * 1500):
        chunks = chunk_document(Document("d", text), tok, target_tokens=64, max_tokens=96)
        assert len(chunks) > 10
        assert all(c.tokens <= 96 + 2 for c in chunks), [c.tokens for c in chunks]
        assert "".join(c.text.removesuffix(CHUNK_END) for c in chunks) == text
