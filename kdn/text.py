"""Texts given to kdn, checked and tokenized the same way at every entry point.

* ``check_text(text, what)``: a ``str`` that UTF-8 can encode, else InvalidArgument naming
  ``what`` and the first character it cannot encode. A lone surrogate (``"\\ud800"``, or the
  ``"\\udcff"`` Python makes of a byte that is not UTF-8 in a command-line argument or a file
  name) is such a character; tokenizers refuse it deep inside with a TypeError.
* ``check_texts(texts, what)``: several texts (a list, a tuple, any iterable that is not
  itself a text), each checked by ``check_text``; a single ``str`` or ``bytes`` is refused, not
  taken as a sequence of one-character texts.
* ``tokenize(tokenizer, text, what, literal=...)``: the checked text's token ids, never with
  special tokens added. Special tokens written out in the text (``"<|im_start|>"``) are the
  tokenizer's special tokens by default, as a Hugging Face tokenizer parses them: a prompt
  that spells out its chat template means it. With ``literal`` they are plain text (the
  characters ``<``, ``|``, ...): what untrusted text (a RAG document, a question) is, so it can
  not open a chat turn of its own. A Hugging Face fast tokenizer keeps that choice as state
  of its backend, set by each call and read by the encode that follows it (without the GIL),
  so calls of one tokenizer are taken one at a time: threads sharing a tokenizer (an ask
  during an ingest) never see each other's choice.
* ``template_ids(tokenizer, template, field, value, what)``: a trusted template with an
  untrusted value put in place of ``field``: the template's special tokens are parsed, the
  value's are literal. Equal to ``tokenize(template.replace(field, value))`` wherever the
  value spells out no special token (a tokenizer splits a text at its special tokens and
  tokenizes the pieces between them alone, which is what this does).

kdn does not normalize text (no NFC, no newline or BOM changes): a key names token ids, and
"é" (U+00E9) and "e" + U+0301 are different ids, so different KV and different keys.

This module imports no torch: ``kdn.keys`` uses it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kdn.errors import InvalidArgument


def check_text(text: object, what: str) -> str:
    """``text`` when it is a ``str`` UTF-8 can encode; InvalidArgument naming ``what``, the
    character and its position otherwise."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid Unicode text: {text[exc.start:exc.end]!r} at character "
            f"{exc.start} is a lone surrogate, which UTF-8 cannot encode (a byte that is not "
            "UTF-8, decoded with errors='surrogateescape'?)") from None
    return text


def check_texts(texts: object, what: str, each: str = "text") -> list[str]:
    """``texts`` as a list of texts that ``check_text`` takes, the i-th named ``f"{each} {i}"``
    when it is not; InvalidArgument naming ``what`` for one ``str`` or ``bytes`` in place of
    several (each character would be one) or for anything that is not a collection."""
    if isinstance(texts, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what} must be a list of texts, got one "
                              f"{type(texts).__name__}: [{each}] for a single {each}")
    try:
        got = list(texts)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"{what} must be a list of texts, got "
                              f"{type(texts).__name__}") from None
    return [check_text(t, f"{each} {i}") for i, t in enumerate(got)]


def special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens written out, longest first ([] where it has none): those
    it lists in ``all_special_tokens`` and every added token it marks special, which a Hugging
    Face tokenizer parses out of a text too (Llama-3 lists only bos and eos, not
    ``<|start_header_id|>``)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found |= {getattr(t, "content", None) for t in added.values() if getattr(t, "special", False)}
    return sorted({t for t in found if isinstance(t, str) and t}, key=len, reverse=True)


_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()
_SHARED_LOCK = threading.Lock()  # for a tokenizer that takes no weak reference


def _lock_of(tokenizer: Any) -> threading.Lock:
    """The lock that takes ``tokenizer``'s calls one at a time (module docstring)."""
    with _LOCKS_LOCK:
        try:
            return _LOCKS.setdefault(tokenizer, threading.Lock())
        except TypeError:  # no weak reference to it, or unhashable
            return _SHARED_LOCK


def tokenize(tokenizer: Any, text: str, what: str, *, literal: bool = False) -> list[int]:
    """Token ids of ``text`` (checked by ``check_text``), no special tokens added; with
    ``literal`` special tokens written in it are plain text (module docstring)."""
    check_text(text, what)
    # a tokenizer of no special tokens (a plain callable) parses none and may not take the flag
    split = literal and bool(special_tokens(tokenizer))
    with _lock_of(tokenizer):
        if split:
            ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


def template_ids(tokenizer: Any, template: str, field: str, value: str, what: str) -> list[int]:
    """Token ids of ``template`` with ``value`` in place of every ``field``: the template's
    special tokens parsed, ``value``'s literal (module docstring)."""
    check_text(value, what)
    specials = special_tokens(tokenizer)
    ids: list[int] = []
    rest = template
    while rest:
        # the next special token of the template, outside the field
        at, token = min(((rest.find(t), t) for t in specials if t in rest),
                        key=lambda found: (found[0], -len(found[1])), default=(len(rest), ""))
        piece = rest[:at].replace(field, value)
        if piece:
            ids += tokenize(tokenizer, piece, what, literal=True)
        if token:
            ids += tokenize(tokenizer, token, "the template")
        rest = rest[at + len(token):]
    return ids
