"""A RAG corpus: documents read from a folder or a JSONL file, split into token-sized chunks.

Lifecycle:

1. ``load_corpus(path)`` reads the documents: every ``.txt``/``.md``/``.markdown``/``.rst``
   file under a folder (hidden files and folders skipped; the document id is the path
   relative to the folder, with ``/``), or every line (ended by ``\n``; a U+2028 is text) of a
   ``.jsonl`` file (``{"id": .., "text": ..}``; ``id``, a string or a whole number, defaults
   to ``<line number>`` when absent or null; ``title`` is prepended when present).
2. ``chunk_document(doc, tokenizer, target, limit)`` packs the document's paragraphs (blank-line
   separated) into chunks of about ``target`` tokens. A paragraph longer than ``target`` is
   split into sentences (after ``.!?`` and a space, or after ``。！？``), a sentence longer
   than ``limit`` into windows of at most ``target`` tokens, cut in the text between two
   characters (at a space where there is one near, never inside a character's combining marks
   or an emoji sequence unless that "character" is longer than a window: ``_cut``), so no
   character is lost or split. A chunk closes
   when the next unit would take it past ``target``, so a chunk passes ``limit`` tokens only
   by the few tokens that joining its units adds.
3. Each ``Chunk`` carries its text (ending in a blank line, so the next prompt piece starts on
   a fresh paragraph) and the token ids of that text tokenized alone: the ids the chunk's KV is
   prefilled from, and hashed into its key. A document is untrusted text: special tokens
   written in it (``"<|im_start|>"``) are tokenized as plain characters (``kdn.text``), so a
   document can not open a chat turn in the prompt it is blended into.

Files are read as UTF-8 with their line ends made ``\n``; a byte order mark at the start is not
part of the text (a file saved with one and without one are the same document). Document ids
and texts must be valid Unicode (no lone surrogates: a file name that is not UTF-8 gives one),
else InvalidArgument naming them.

A document's ``sha256`` covers its text only; the ingest manifest compares it to find
unchanged documents.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kdn.errors import InvalidArgument
from kdn.text import check_text, tokenize

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
CHUNK_END = "\n\n"
_PARAGRAPH_RE = re.compile(r"\n[ \t]*\n+")
_SENTENCE_RE = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_CJK_END = "。！？｡"  # ideographic full stop, fullwidth ! and ?, halfwidth ideographic stop
_CJK_CLOSE = "」』）〕】》〉”’\"')"
_CJK_SENTENCE_RE = re.compile(f"(?:(?<=[{_CJK_END}])|(?<=[{_CJK_END}][{_CJK_CLOSE}]))"
                              f"(?=[^{_CJK_CLOSE}])")


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the RAG code uses."""

    def __call__(self, text: str, *, add_special_tokens: bool = ...,
                 split_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class Document:
    id: str
    """Stable name: path relative to the corpus folder, or the JSONL ``id``."""
    text: str

    def __post_init__(self) -> None:
        check_text(self.id, f"document id {self.id!r}")
        check_text(self.text, f"the text of document {self.id!r}")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Chunk:
    doc_id: str
    index: int
    """Position of the chunk in its document."""
    text: str
    ids: tuple[int, ...]
    """Token ids of ``text`` tokenized alone (no special tokens)."""

    @property
    def tokens(self) -> int:
        return len(self.ids)


def load_corpus(path: Path | str) -> list[Document]:
    """The documents of a folder of text/markdown files or of a JSONL file, sorted by id. A
    folder's links that lead outside it are skipped; a file that is not UTF-8 text is
    InvalidArgument naming it."""
    root = Path(path)
    if root.is_dir():
        docs = []
        inside = root.resolve()
        for f in sorted(root.rglob("*")):
            rel = f.relative_to(root)
            if any(part.startswith(".") for part in rel.parts):
                continue
            if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES \
                    and f.resolve().is_relative_to(inside):
                docs.append(Document(rel.as_posix(), _text(f)))
        return docs
    if root.is_file() and root.suffix.lower() in (".jsonl", ".ndjson"):
        return _load_jsonl(root)
    if root.is_file() and root.suffix.lower() in TEXT_SUFFIXES:
        return [Document(root.name, _text(root))]
    raise InvalidArgument(f"{root}: expected a folder, a .jsonl file or a text file")


def _text(f: Path) -> str:
    """The UTF-8 text of ``f``, without the byte order mark it may start with, its line ends
    ``\n`` (as Python's text mode reads ``\r\n`` and ``\r``)."""
    data = f.read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{f}: not UTF-8 text (byte {bom + exc.start}: "
                              f"{exc.object[exc.start:exc.start + 1]!r}); convert it or leave "
                              "it out") from None


def _load_jsonl(path: Path) -> list[Document]:
    docs: dict[str, Document] = {}
    # lines end at "\n" only: U+2028, U+2029 and U+0085 (str.splitlines' too) may stand
    # unescaped in a JSON string
    for n, line in enumerate(_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{path}:{n}: not JSON: {exc}") from None
        except ValueError as exc:  # a number past Python's digits limit
            raise InvalidArgument(f"{path}:{n}: a value that can not be read: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise InvalidArgument(f"{path}:{n}: expected an object with a string 'text'")
        try:
            "".join(v for k in ("id", "title", "text")
                    if isinstance(v := row.get(k), str)).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"{path}:{n}: not UTF-8 text ({exc.reason} "
                                  f"{exc.object[exc.start:exc.end]!r}: a lone surrogate "
                                  "escape); fix or leave out the line") from None
        got = row.get("id")
        if got is None:  # absent or null: the line number
            got = n
        elif isinstance(got, bool) or not isinstance(got, (str, int)):
            raise InvalidArgument(f"{path}:{n}: 'id' must be a string or a whole "
                                  f"number (or left out: the line number), got {got!r}")
        doc_id = str(got)
        if doc_id in docs:
            raise InvalidArgument(f"{path}:{n}: duplicate id {doc_id!r}")
        title = row.get("title")
        text = f"{title}\n\n{row['text']}" if isinstance(title, str) and title else row["text"]
        docs[doc_id] = Document(doc_id, text)
    return sorted(docs.values(), key=lambda d: d.id)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace-trimmed, empty ones dropped."""
    return [p.strip() for p in _PARAGRAPH_RE.split(text.replace("\r\n", "\n")) if p.strip()]


def sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph (split after ``.!?`` and a space before a capital, digit or
    quote, and after ``。！？｡`` and their closing quotes)."""
    return [s.strip() for part in _SENTENCE_RE.split(paragraph)
            for s in _CJK_SENTENCE_RE.split(part) if s.strip()]


def _joiner(before: str) -> str:
    """What joins a sentence to the one ``before`` it: nothing after a CJK one, else a space."""
    return "" if before.rstrip(_CJK_CLOSE)[-1:] in tuple(_CJK_END) else " "


def _inside_cluster(text: str, i: int) -> bool:
    """Whether a cut before ``text[i]`` would split a user-perceived character: a combining
    mark, a variation selector, an emoji skin tone or tag, or either side of a zero-width
    joiner."""
    c, prev = text[i], text[i - 1]
    return (unicodedata.category(c) in ("Mn", "Me", "Mc") or c == "\u200d" or prev == "\u200d"
            or "\ufe00" <= c <= "\ufe0f" or "\U0001f3fb" <= c <= "\U0001f3ff"
            or "\U000e0020" <= c <= "\U000e007f")


def _windows(sentence: str, tokenizer: Tokenizer, target: int,
             total: int) -> list[tuple[str, int, str]]:
    """(text, tokens, joiner) of the pieces of a ``total``-token run-on sentence, each at most
    ``target`` tokens, cut between characters (``_cut``):
    at the last space in the window's second half where there is one (the joiner a space),
    else between clusters (the joiner empty). Tokenizes about twice the sentence in all."""
    per_token = len(sentence) / max(1, total)  # characters per token, to guess each cut
    out: list[tuple[str, int, str]] = []
    rest, joiner = sentence, ""
    while rest:
        cut, sep = _cut(rest, max(1, int(target * per_token)))
        while cut > 1:
            n = len(_ids(tokenizer, rest[:cut]))
            if n <= target:
                break
            smaller, smaller_sep = _cut(rest, max(1, min(cut - 1, int(cut * target / n))))
            if smaller >= cut:  # one cluster longer than a window
                break
            cut, sep = smaller, smaller_sep
        piece = rest[:cut].rstrip()
        out.append((piece, len(_ids(tokenizer, piece)), joiner))
        rest, joiner = rest[cut:].lstrip(), sep
    return out


def _cut(text: str, cut: int) -> tuple[int, str]:
    """Where to cut ``text`` at or before ``cut``, and the joiner that restores the text there:
    between clusters, or at ``cut`` inside a cluster longer than ``cut`` characters (no
    character people read is: it takes letters chained by zero-width joiners, or thousands of
    stacked combining marks, which must not make one chunk past the model's context)."""
    if cut >= len(text):
        return len(text), ""
    space = max(text.rfind(" ", cut // 2, cut), text.rfind("\n", cut // 2, cut))
    if space > 0:
        return space + 1, " "
    i = cut
    while i > 0 and _inside_cluster(text, i):
        i -= 1
    return (i if i > 0 else cut), ""  # a "cluster" as long as a window is cut inside


def chunk_ids(tokenizer: Tokenizer, text: str, what: str = "a chunk") -> list[int]:
    """Token ids of a chunk's text tokenized alone, special tokens written in it as plain text
    (``kdn.text.tokenize``, literal): what its KV is prefilled from."""
    return tokenize(tokenizer, text, what, literal=True)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return chunk_ids(tokenizer, text)


def _units(text: str, tokenizer: Tokenizer, target: int, limit: int) -> list[tuple[str, int, str]]:
    """(text, tokens, separator before it) of each packing unit, in order."""
    out: list[tuple[str, int, str]] = []
    for para in paragraphs(text):
        n = len(_ids(tokenizer, para))
        if n <= target:
            out.append((para, n, "\n\n"))
            continue
        before = ""
        for sent in sentences(para):
            sep = _joiner(before) if before else "\n\n"
            before = sent
            ids = _ids(tokenizer, sent)
            if len(ids) <= limit:
                out.append((sent, len(ids), sep))
                continue
            for w, (piece, n, joiner) in enumerate(_windows(sent, tokenizer, target, len(ids))):
                out.append((piece, n, sep if w == 0 else joiner))  # a run-on "sentence"
    return out


def chunk_limit(target_tokens: int, max_tokens: int | None = None) -> int:
    """The hard limit of chunks of about ``target_tokens``: ``max_tokens``, or with None 1.5x
    the target; InvalidArgument unless 8 <= target <= limit (``RagConfig`` and ``kdn rag
    ingest`` check their sizes with it)."""
    limit = max_tokens if max_tokens is not None else target_tokens + target_tokens // 2
    if not 8 <= target_tokens <= limit:
        raise InvalidArgument(f"need 8 <= target_tokens <= max_tokens, got {target_tokens}, "
                              f"{limit}")
    return limit


def chunk_document(doc: Document, tokenizer: Tokenizer, target_tokens: int = 256,
                   max_tokens: int | None = None) -> list[Chunk]:
    """Split ``doc`` on paragraph, then sentence boundaries into chunks of ~``target_tokens``."""
    limit = chunk_limit(target_tokens, max_tokens)
    texts: list[str] = []
    cur, cur_tokens = "", 0
    for unit, n, sep in _units(doc.text, tokenizer, target_tokens, limit):
        if cur and cur_tokens + n > target_tokens:
            texts.append(cur)
            cur, cur_tokens = "", 0
        cur = unit if not cur else cur + sep + unit
        cur_tokens += n + (1 if cur_tokens else 0)
    if cur:
        texts.append(cur)
    chunks: list[Chunk] = []
    for text in texts:
        chunks.append(Chunk(doc.id, len(chunks), text + CHUNK_END,
                            tuple(_ids(tokenizer, text + CHUNK_END))))
    return chunks
