"""What a RAG state folder persists: the ingest manifest and the chunk embeddings.

    <state>/manifest.json            settings + document id -> content hash -> chunk keys
    <state>/embeddings.safetensors   "vectors" [chunks, dim] float32; metadata "keys" (hex)
    <state>/.lock                    held (``state_lock``) by the one ingest or rm writing it

Both files are written atomically (temporary file, fsync, rename), embeddings first, so a crash
leaves at worst a manifest naming chunks without a vector (re-embedded on the next ingest, no
model call) or documents missing from the manifest (re-chunked; their KV, already in kdn, is
found by a Lookup and not recomputed). No pickle anywhere: JSON and safetensors only.

``VectorIndex`` holds one unit-norm row per distinct chunk key; ``search`` ranks by dot product
(cosine similarity of normalized embeddings).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch loads with the first index, so `kdn rag` checks run before it
    import torch

from kdn.errors import Corrupt, InvalidArgument, KDNError, Status

MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.safetensors"
LOCK = ".lock"
FORMAT = 1


class StateLocked(KDNError, status=Status.FAILED_PRECONDITION):
    """Another ingest or rm is writing the state folder."""


@contextmanager
def state_lock(state: Path) -> Iterator[None]:
    """Hold ``<state>/.lock`` exclusively (``fcntl.flock``) without waiting: StateLocked when
    another writer holds it. The lock goes with the process, so a killed writer leaves none."""
    import fcntl

    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateLocked(f"another kdn rag command holds {state} (an ingest or rm is "
                              "writing it); run this one when it has finished") from None
        yield
    finally:
        os.close(fd)


class Embedder(Protocol):
    """``kdn.model.embed.Embedder`` or anything with its ``embed``: texts -> [n, dim] unit rows."""

    def embed(self, texts: list[str]) -> torch.Tensor: ...


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- manifest -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What a stored chunk's key and encoding depend on; a change re-ingests every document."""

    layout: str
    """Layout fingerprint (covers the model)."""
    namespace: str
    target_tokens: int
    max_tokens: int
    mode: str
    level: str


@dataclass(frozen=True)
class ChunkEntry:
    key: str
    """Hex chunk key (``kdn.keys.chunk_key`` of the chunk's ids)."""
    tokens: int
    text: str
    stored_bytes: int = 0


@dataclass
class DocEntry:
    sha256: str
    source: str
    """The corpus (folder or file, resolved) the document came from."""
    chunks: list[ChunkEntry] = field(default_factory=list)


@dataclass
class Manifest:
    settings: Settings | None = None
    documents: dict[str, DocEntry] = field(default_factory=dict)

    @classmethod
    def load(cls, state: Path) -> Manifest:
        path = state / MANIFEST
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON object expected, not {type(raw).__name__}")
            if raw.get("format") != FORMAT:
                raise Corrupt(f"{path}: unknown manifest format {raw.get('format')!r}")
            settings = Settings(**_fields(raw["settings"], Settings, "settings")) \
                if raw.get("settings") is not None else None
            docs = {
                doc_id: DocEntry(**_fields(d, DocEntry, f"document {doc_id!r}", chunks=[
                    ChunkEntry(**_fields(c, ChunkEntry, f"a chunk of {doc_id!r}"))
                    for c in _of(d, "chunks", list, f"document {doc_id!r}")]))
                for doc_id, d in _of(raw, "documents", dict, "the manifest").items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise Corrupt(f"{path}: malformed manifest: {exc}") from None
        return cls(settings, docs)

    def save(self, state: Path) -> None:
        doc = {"format": FORMAT,
               "settings": asdict(self.settings) if self.settings else None,
               "documents": {k: asdict(v) for k, v in sorted(self.documents.items())}}
        write_atomic(state / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode())

    def keys(self, exclude: str | None = None) -> set[str]:
        """Every chunk key referenced by a document (other than ``exclude``)."""
        return {c.key for doc_id, d in self.documents.items() if doc_id != exclude
                for c in d.chunks}

    def chunk(self, key: str) -> tuple[str, ChunkEntry] | None:
        """(document id, entry) of the first document holding ``key``."""
        for doc_id, d in self.documents.items():
            for c in d.chunks:
                if c.key == key:
                    return doc_id, c
        return None


_TYPES = {"str": str, "int": int}


def _of(obj: Any, name: str, kind: type, what: str) -> Any:
    """``obj[name]`` when ``obj`` is an object and it a ``kind``, else TypeError naming it."""
    if not isinstance(obj, dict):
        raise TypeError(f"{what} is {type(obj).__name__}, not an object")
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{what}: {name} is {value!r}, not {kind.__name__}")
    return value


def _fields(obj: Any, cls: type, what: str, **given: Any) -> dict[str, Any]:
    """The str and int fields of dataclass ``cls`` read from the JSON object ``obj``, each
    checked (TypeError naming it), plus ``given``; an unknown field is a TypeError too."""
    if not isinstance(obj, dict):
        raise TypeError(f"{what} is {type(obj).__name__}, not an object")
    out = dict(given)
    for f in fields(cls):
        kind = _TYPES.get(str(f.type))
        if kind is not None and (f.name in obj or f.default is MISSING):
            out[f.name] = _of(obj, f.name, kind, what)
    if unknown := set(obj) - {f.name for f in fields(cls)}:
        raise TypeError(f"{what}: unknown fields {sorted(unknown)}")
    return out


# -- embeddings -----------------------------------------------------------------------------


class VectorIndex:
    """One unit-norm embedding per chunk key; top-k by cosine similarity."""

    def __init__(self, dim: int = 0) -> None:
        import torch

        self.dim = dim
        self._keys: list[str] = []
        self._row: dict[str, int] = {}
        self._vectors = torch.empty(0, dim)  # [chunks, dim]

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._row

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def add(self, keys: Sequence[str], vectors: torch.Tensor) -> None:
        """Add or replace the rows of ``keys`` (``vectors``: [len(keys), dim])."""
        import torch

        if len(keys) != vectors.shape[0]:
            raise InvalidArgument(f"{len(keys)} keys but {vectors.shape[0]} vectors")
        if not len(keys):
            return
        vectors = vectors.detach().to("cpu", torch.float32)
        if not len(self._keys):
            self.dim = int(vectors.shape[1])
            self._vectors = torch.empty(0, self.dim)
        if vectors.shape[1] != self.dim:
            raise InvalidArgument(f"vectors have dim {vectors.shape[1]}, the index {self.dim}")
        new: list[tuple[str, torch.Tensor]] = []
        for key, vec in zip(keys, vectors):
            if key in self._row:
                self._vectors[self._row[key]] = vec
            else:
                self._row[key] = len(self._keys) + len(new)
                new.append((key, vec))
        if new:
            self._keys.extend(k for k, _ in new)
            self._vectors = torch.cat([self._vectors, torch.stack([v for _, v in new])])

    def retain(self, keys: Iterable[str]) -> None:
        """Drop every row whose key is not in ``keys``."""
        import torch

        wanted = set(keys)
        keep = [k for k in self._keys if k in wanted]
        rows = torch.tensor([self._row[k] for k in keep], dtype=torch.long)
        self._vectors = self._vectors[rows] if keep else torch.empty(0, self.dim)
        self._keys = keep
        self._row = {k: i for i, k in enumerate(keep)}

    def search(self, query: torch.Tensor, k: int) -> list[tuple[str, float]]:
        """The ``k`` keys most similar to ``query`` ([dim]), best first, with their scores."""
        import torch

        if not len(self._keys) or k <= 0:
            return []
        scores = self._vectors @ query.to(torch.float32).reshape(-1)  # [chunks]
        top = torch.topk(scores, min(k, len(self._keys)))
        return [(self._keys[int(i)], float(s)) for s, i in zip(top.values, top.indices)]

    def save(self, state: Path) -> None:
        from safetensors.torch import save

        data = save({"vectors": self._vectors.contiguous()},
                    metadata={"keys": json.dumps(self._keys), "dim": str(self.dim)})
        write_atomic(state / EMBEDDINGS, data)

    @classmethod
    def load(cls, state: Path) -> VectorIndex:
        from safetensors import safe_open

        path = state / EMBEDDINGS
        index = cls()
        if not path.exists():
            return index
        try:
            with safe_open(str(path), framework="pt") as f:
                meta: dict[str, Any] = f.metadata() or {}
                vectors = f.get_tensor("vectors")
            keys = json.loads(meta["keys"])
            index.dim = int(meta.get("dim", vectors.shape[1]))
        except Exception as exc:  # safetensors raises its own error types
            raise Corrupt(f"{path}: unreadable embeddings: {exc}") from None
        if len(keys) != vectors.shape[0]:
            raise Corrupt(f"{path}: {len(keys)} keys but {vectors.shape[0]} vectors")
        index.add(keys, vectors)
        return index
