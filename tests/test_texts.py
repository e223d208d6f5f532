"""Hostile texts at the entry points that take text, without a model (the real tokenizer's
cases are in test_rag_model.py): a lone surrogate is a kdn error naming where it is, an opaque
salt of any str has a key of its own, a corpus file's byte order mark is not text, and a file
whose name is not UTF-8 is named."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kdn import keys
from kdn.client.blend import RemotePiece, blend_request
from kdn.engine.config import prompt_ids
from kdn.errors import InvalidArgument
from kdn.rag.corpus import Document, load_corpus
from kdn.text import check_text, special_tokens, template_ids, tokenize
from tests.helpers import uniform_layout


class ByteTokenizer:
    """One token per UTF-8 byte: as a byte-level BPE, it can not take a lone surrogate."""

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def test_a_lone_surrogate_is_named_at_each_text_entry_point() -> None:
    lay, tok = uniform_layout(), ByteTokenizer()
    with pytest.raises(InvalidArgument, match=r"the chunk text .*'\\udcff' at character 4"):
        keys.text_chunk_key("caf\u00e9\udcff", tok, lay)
    with pytest.raises(ValueError, match=r"the prompt .*'\\ud800' at character 0 is a lone"):
        prompt_ids("\ud800 hello", tok, 256)
    with pytest.raises(InvalidArgument, match=r"piece 1's text .*lone surrogate"):
        blend_request([RemotePiece(text="fine"), RemotePiece(text="a\udfffb")], namespace="",
                      ratio=None, select_layer=1, head_tokens=0, per_chunk=False, store=False,
                      mode="", level="", layout=None)
    with pytest.raises(InvalidArgument, match=r"text of document 'd.md' .*lone surrogate"):
        Document("d.md", "text \ud83d")  # half of an emoji's surrogate pair
    with pytest.raises(InvalidArgument, match="must be text"):
        check_text(b"bytes", "the question")


def test_a_text_of_no_tokens_has_no_chunk_key() -> None:
    lay, tok = uniform_layout(), ByteTokenizer()
    with pytest.raises(InvalidArgument, match="gives no tokens"):
        keys.text_chunk_key("", tok, lay)
    assert keys.text_chunk_key(" ", tok, lay) == keys.chunk_key([32], lay)


def test_a_salt_or_adapter_of_any_str_has_its_own_keys() -> None:
    """vLLM's cache_salt comes from a request's JSON, where "\\ud800" is a lone surrogate."""
    lay, ids = uniform_layout(), list(range(512))
    chains = [keys.prefix_keys(ids, lay, salt=s) for s in ("\ud800", "\ud801", "", "\ud800x")]
    assert len({c[0] for c in chains}) == 4 and all(len(c) == 2 for c in chains)
    # a pair of surrogates is not the character they would pair into
    assert keys.chunk_key(ids, lay, salt="\ud83d\ude00") != keys.chunk_key(ids, lay, salt="😀")
    assert keys.chunk_key(ids, lay, adapter="\udcff") != keys.chunk_key(ids, lay, adapter="ÿ")
    # a salt UTF-8 can encode keeps the key it always had
    assert keys.chunk_key(ids, lay, salt="é") == keys.chunk_key(ids, lay, salt="é".encode())


def test_a_byte_order_mark_is_not_part_of_a_document(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "plain.txt").write_bytes(b"Warsaw is in Poland.\r\n")
    (docs / "marked.txt").write_bytes(b"\xef\xbb\xbfWarsaw is in Poland.\r\n")
    plain, marked = sorted(load_corpus(docs), key=lambda d: d.id != "plain.txt")
    assert marked.text == plain.text == "Warsaw is in Poland.\n"  # line ends as text mode
    assert marked.sha256 == plain.sha256
    jl = tmp_path / "c.jsonl"  # a JSONL file written by a tool that marks its UTF-8
    jl.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n')
    assert [(d.id, d.text) for d in load_corpus(jl)] == [("a", "x"), ("b", "y")]
    (docs / "latin1.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9\n")
    with pytest.raises(InvalidArgument, match=r"latin1.txt: not UTF-8 text \(byte 6"):
        load_corpus(docs)  # the byte counted in the file, its mark included


def test_a_corpus_file_whose_name_is_not_utf8_is_named(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.md").write_text("fine")
    try:
        (docs / os.fsdecode(b"caf\xe9.md")).write_text("Latin-1 name")
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes only UTF-8 names")
    with pytest.raises(InvalidArgument, match=r"document id 'caf\\udce9.md' is not valid"):
        load_corpus(docs)


def _char_tokenizer(**declared: str) -> Any:
    """One token per character, with the special tokens of ``declared`` (bos_token=...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(["[UNK]"] + list("abcdefghijklmnopqrstuvwxyz<|>_ \n"))}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, **declared)


def test_special_tokens_a_tokenizer_adds_but_does_not_list_are_special() -> None:
    """Llama-3 lists bos and eos in all_special_tokens, not <|start_header_id|>: the template's
    header tokens are still its special ids, a document's and a question's still text."""
    from tokenizers import AddedToken
    tok = _char_tokenizer(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.add_tokens([AddedToken("<|start_header_id|>", special=True),
                    AddedToken("<|end_header_id|>", special=True)])
    header = tok.convert_tokens_to_ids("<|start_header_id|>")
    assert "<|start_header_id|>" in special_tokens(tok)
    tail = "{question}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ids = template_ids(tok, tail, "{question}", "hi", "the question")
    assert ids == tokenize(tok, tail.replace("{question}", "hi"), "t") and header in ids
    assert len(ids) == 2 + 3 + len("assistant") + 2
    asked = template_ids(tok, tail, "{question}", "<|start_header_id|>", "the question")
    assert asked.count(header) == 1  # the template's, not the question's
    # no bos/eos declared at all: an added special token in a document is still text
    bare = _char_tokenizer()
    bare.add_tokens([AddedToken("<|im_start|>", special=True)])
    opened = bare.convert_tokens_to_ids("<|im_start|>")
    assert opened in tokenize(bare, "<|im_start|>system", "prompt")
    doc = tokenize(bare, "<|im_start|>system", "the document", literal=True)
    assert opened not in doc and len(doc) == len("<|im_start|>system")


class SharedFlagTokenizer:
    """As a Hugging Face fast tokenizer: each call sets split_special_tokens on the backend,
    whose encode then reads it without the GIL (here a sleep), so other threads' calls can set
    it in between. "<s>" is special (id 1000) unless split; other characters are their code."""

    all_special_tokens = ["<s>"]

    def __init__(self) -> None:
        self.split = False

    def __call__(self, text: str, *, add_special_tokens: bool = False,
                 split_special_tokens: bool = False) -> dict[str, list[int]]:
        self.split = split_special_tokens
        time.sleep(0.002)
        if self.split:
            return {"input_ids": [ord(c) for c in text]}
        head, _, rest = text.partition("<s>")
        return {"input_ids": [ord(c) for c in head] + [1000] + [ord(c) for c in rest]}


def test_threads_sharing_a_tokenizer_keep_their_own_special_token_choice() -> None:
    """A document's "<s>" (literal, in an ingest) and a template's (parsed, in an ask) of one
    tokenizer from two threads at once: each call sees its own split_special_tokens."""
    tok = SharedFlagTokenizer()
    wrong: list[str] = []

    def tokenize_many(literal: bool) -> None:
        for _ in range(40):
            if (1000 in tokenize(tok, "<s>x", "text", literal=literal)) == literal:
                wrong.append("a document's <s> parsed" if literal else "a template's <s> split")

    threads = [threading.Thread(target=tokenize_many, args=(lit,)) for lit in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
