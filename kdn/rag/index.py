"""What a RAG state folder persists: the ingest manifest and the chunk embeddings.

    <state>/manifest.json                 owner, settings, document id -> hash -> chunk keys,
                                          retired keys, the embeddings generation, whether a
                                          re-encode is under way
    <state>/embeddings-<gen>.safetensors  "vectors" [chunks, dim] float32; metadata "keys" (hex)
    <state>/.lock                         held (``state_lock``) by the one ingest or rm writing it

A write commits in one step: the embeddings go to a new file (``embeddings_name`` of the next
generation), then the manifest, naming that generation, replaces the old one (temporary file,
fsync, rename); the older generation's file is removed after. A reader or a crash sees the
old manifest with its own embeddings or the new one with its own, never a mix. No pickle
anywhere: JSON and safetensors only.

``Manifest.owner`` is the state's own identity (random, made by its first ingest): the salt of
its chunk keys, so two states never share a kdn entry (``kdn.rag.knowledge``). A manifest of
format 1 (written before states had one) loads as ``shared``: its keys are unsalted and may be
other states' too. ``retired`` lists keys the state stored and no longer references: deleted
from kdn after the commit that dropped them (then a commit stops listing them), and by the next
write when a crash came between.

A commit a crash stopped leaves its temporary files (``write_atomic``'s ``.<name>.<random>``);
the next commit removes them with the replaced generations (``remove_other_embeddings``).

``VectorIndex`` holds one unit-norm row per distinct chunk key; ``search`` ranks by dot product
(cosine similarity of normalized embeddings). It has one writer; readers search an
``IndexView`` of it (the rows of one commit, taken in one step).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch loads with the first index, so `kdn rag` checks run before it
    import torch

from kdn.errors import Corrupt, InvalidArgument, KDNError, Status
from kdn.names import KEY_BYTES

MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.safetensors"
"""The embeddings of generation 0 (every state of manifest format 1)."""
LOCK = ".lock"
FORMAT = 2
SHARED_FORMAT = 1
"""Manifests without an owner: their chunk keys are unsalted (``Manifest.shared``)."""
_OWNER_RE = re.compile(r"[0-9a-f]{32}")
_KEY_RE = re.compile(f"[0-9a-f]{{{2 * KEY_BYTES}}}")
_EMBEDDINGS_RE = re.compile(r"embeddings(-[1-9][0-9]*)?\.safetensors")
_TEMP_RE = re.compile(r"\.(manifest\.json|embeddings(-[1-9][0-9]*)?\.safetensors)\.[a-z0-9_]+")
"""``write_atomic``'s temporary files (``tempfile.mkstemp``'s prefix + random suffix)."""


def embeddings_name(generation: int) -> str:
    """The embeddings file of a manifest generation."""
    return EMBEDDINGS if generation == 0 else f"embeddings-{generation}.safetensors"


def remove_other_embeddings(state: Path, generation: int) -> None:
    """Remove the embeddings files of every generation but ``generation`` (the committed one;
    the others are a replaced generation or one whose commit a crash stopped), and the
    temporary files of writes a crash stopped (``write_atomic``'s). Only the writer holding
    the state's lock calls it."""
    keep = embeddings_name(generation)
    for f in state.iterdir():
        if f.name != keep and (_EMBEDDINGS_RE.fullmatch(f.name) or _TEMP_RE.fullmatch(f.name)):
            f.unlink(missing_ok=True)


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
    """``kdn.model.embed.Embedder`` or anything with its ``embed``: texts -> [n, dim] unit rows;
    ``name`` (a str) and ``dim`` (an int), where it has them, identify it (``embedder_name``)."""

    def embed(self, texts: list[str]) -> torch.Tensor: ...


DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
"""The name of the embedder a knowledge base makes when given none (``kdn.model.embed``'s
``MINILM_NAME``, not imported here: it loads transformers)."""


def embedder_name(embedder: object | None) -> str:
    """What a state records of the embedder of its embeddings: its ``name`` where it has one,
    else its class's module and name; None is the default embedder."""
    if embedder is None:
        return DEFAULT_EMBEDDER
    name = getattr(embedder, "name", None)
    if isinstance(name, str) and name:
        return name
    return f"{type(embedder).__module__}.{type(embedder).__qualname__}"


def manifest_stamp(state: Path) -> tuple[int, int, int] | None:
    """The identity of the state's manifest file (inode, size, modification time), None when
    there is none: a commit replaces the file (``write_atomic``), so another stamp is another
    commit."""
    try:
        st = (state / MANIFEST).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new file, never a mix;
    an OSError (a full disk) names ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not exc.filename:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
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
    embedder: str = ""
    """The embedder of the state's embeddings (``embedder_name``): another one is refused.
    "" in a state written before kdn recorded it (one of the embeddings' dimension is taken)."""
    config: str = ""
    """The layout fingerprint with no weights named (``RagEngine.config_fingerprint``), and
    ``weights`` the weights id ``layout`` names: together they tell another checkpoint of one
    config, or one kdn named otherwise, from another model. "" in a state written before kdn
    recorded them."""
    weights: str = ""


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
    owner: str = ""
    """The state's identity (32 hex digits), the salt of its chunk keys; "" until its first
    ingest, and in a shared state."""
    shared: bool = False
    """Written as format 1: the chunk keys are unsalted, so other states may hold them too."""
    retired: set[str] = field(default_factory=set)
    """Keys this state stored and no longer references, to delete from kdn."""
    generation: int = 0
    """The embeddings file that goes with this manifest (``embeddings_name``)."""
    reencoding: bool = False
    """An ingest to another codec mode or level began storing (under the same keys) and has
    not completed: kdn may hold either encoding of any chunk, so the next ingest stores every
    document again whatever its settings."""

    @property
    def salt(self) -> str:
        """What the state's chunk keys are salted with (``kdn.keys.chunk_key``)."""
        return self.owner

    @classmethod
    def load(cls, state: Path) -> Manifest:
        path = state / MANIFEST
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON object expected, not {type(raw).__name__}")
            if raw.get("format") not in (FORMAT, SHARED_FORMAT):
                raise Corrupt(f"{path}: unknown manifest format {raw.get('format')!r} (this "
                              f"kdn reads {SHARED_FORMAT} and {FORMAT}; a newer kdn wrote it?)")
            settings = Settings(**_fields(raw["settings"], Settings, "settings")) \
                if raw.get("settings") is not None else None
            docs = {
                doc_id: DocEntry(**_fields(d, DocEntry, f"document {doc_id!r}", chunks=[
                    ChunkEntry(**_fields(c, ChunkEntry, f"a chunk of {doc_id!r}"))
                    for c in _of(d, "chunks", list, f"document {doc_id!r}")]))
                for doc_id, d in _of(raw, "documents", dict, "the manifest").items()
            }
            for doc_id, d in docs.items():
                _check_keys([c.key for c in d.chunks], f"document {doc_id!r}")
            if raw["format"] == SHARED_FORMAT:
                return cls(settings, docs, shared=True)
            owner = _of(raw, "owner", str, "the manifest")
            if owner and not _OWNER_RE.fullmatch(owner):
                raise ValueError(f"owner {owner!r} is not 32 lowercase hex digits")
            shared = _of(raw, "shared", bool, "the manifest")
            retired = _of(raw, "retired", list, "the manifest")
            if not all(isinstance(k, str) for k in retired):
                raise TypeError("retired holds a key that is not a string")
            _check_keys(retired, "retired")
            generation = _of(raw, "generation", int, "the manifest")
            if generation < 0:
                raise ValueError(f"generation {generation} is negative")
            if docs and not owner and not shared:
                raise ValueError("documents but neither an owner nor shared keys")
            reencoding = raw.get("reencoding", False)  # absent before kdn recorded it
            if not isinstance(reencoding, bool):
                raise TypeError(f"reencoding is {reencoding!r}, not bool")
        except (KeyError, TypeError, ValueError) as exc:
            raise Corrupt(f"{path}: malformed manifest: {exc}") from None
        except RecursionError:
            raise Corrupt(f"{path}: malformed manifest: nested too deeply") from None
        return cls(settings, docs, owner, shared, set(retired), generation, reencoding)

    def save(self, state: Path) -> None:
        doc = {"format": FORMAT, "owner": self.owner, "shared": self.shared,
               "generation": self.generation, "retired": sorted(self.retired),
               "reencoding": self.reencoding,
               "settings": asdict(self.settings) if self.settings else None,
               "documents": {k: asdict(v) for k, v in sorted(self.documents.items())}}
        write_atomic(state / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode())

    def keys(self) -> set[str]:
        """Every chunk key referenced by a document."""
        return {c.key for d in self.documents.values() for c in d.chunks}


_TYPES = {"str": str, "int": int}


def _check_keys(keys: Iterable[str], what: str) -> None:
    """ValueError naming ``what`` unless every key is a chunk key's hex (lowercase)."""
    for key in keys:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"{what}: key {key[:80]!r} is not {2 * KEY_BYTES} lowercase hex "
                             "digits")


def _of(obj: Any, name: str, kind: type, what: str) -> Any:
    """``obj[name]`` when ``obj`` is an object and it a ``kind``, else TypeError naming it."""
    if not isinstance(obj, dict):
        raise TypeError(f"{what} is {type(obj).__name__}, not an object")
    value = obj[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
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
    """One unit-norm embedding per chunk key; top-k by cosine similarity. Rows live in a
    buffer in host memory (float32 on the CPU, whatever torch's default device and the
    embedder's) that grows by doubling, so adding a corpus document by document copies each
    row a bounded number of times."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim
        self._keys: list[str] = []
        self._row: dict[str, int] = {}
        self._buffer = _host(0, dim)  # [capacity, dim]; the first len(self) rows used

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._row

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    @property
    def _vectors(self) -> torch.Tensor:
        return self._buffer[:len(self._keys)]  # [chunks, dim]

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
            self._buffer = _host(0, self.dim)
        if vectors.shape[1] != self.dim:
            raise InvalidArgument(f"vectors have dim {vectors.shape[1]}, the index {self.dim}")
        new: list[tuple[str, torch.Tensor]] = []
        for key, vec in zip(keys, vectors):
            if key in self._row:
                self._buffer[self._row[key]] = vec
            else:
                self._row[key] = len(self._keys) + len(new)
                new.append((key, vec))
        if new:
            used, need = len(self._keys), len(self._keys) + len(new)
            if need > self._buffer.shape[0]:
                grown = _host(max(need, 2 * self._buffer.shape[0], 64), self.dim)
                grown[:used] = self._buffer[:used]
                self._buffer = grown
            self._buffer[used:need] = torch.stack([v for _, v in new])
            self._keys.extend(k for k, _ in new)

    def retain(self, keys: Iterable[str]) -> None:
        """Drop every row whose key is not in ``keys``."""
        import torch

        wanted = set(keys)
        keep = [k for k in self._keys if k in wanted]
        rows = torch.tensor([self._row[k] for k in keep], dtype=torch.long, device="cpu")
        self._buffer = self._vectors[rows] if keep else _host(0, self.dim)
        self._keys = keep
        self._row = {k: i for i, k in enumerate(keep)}

    def search(self, query: torch.Tensor, k: int) -> list[tuple[str, float]]:
        """The ``k`` keys most similar to ``query`` ([dim], on any device), best first, with
        their scores."""
        return self.view().search(query, k)

    def view(self) -> IndexView:
        """The rows as they are now, for readers while this index changes (``IndexView``)."""
        return IndexView(tuple(self._keys), self._vectors)

    def save(self, state: Path, generation: int = 0) -> None:
        """Write the index as the embeddings of ``generation`` (``embeddings_name``)."""
        from safetensors.torch import save

        data = save({"vectors": self._vectors.contiguous()},
                    metadata={"keys": json.dumps(self._keys), "dim": str(self.dim)})
        write_atomic(state / embeddings_name(generation), data)

    @classmethod
    def load(cls, state: Path, generation: int = 0) -> VectorIndex | None:
        """The embeddings of ``generation``, or None when there is no such file."""
        from safetensors import safe_open

        path = state / embeddings_name(generation)
        index = cls()
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta: dict[str, Any] = f.metadata() or {}
                vectors = f.get_tensor("vectors")
            keys = json.loads(meta["keys"])
            index.dim = int(meta.get("dim", vectors.shape[-1]))
        except Exception as exc:  # safetensors raises its own error types
            raise Corrupt(f"{path}: unreadable embeddings: {exc}") from None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise Corrupt(f"{path}: malformed embeddings: keys is not a list of strings")
        try:
            _check_keys(keys, "embeddings")
        except ValueError as exc:
            raise Corrupt(f"{path}: malformed embeddings: {exc}") from None
        if len(set(keys)) != len(keys):
            raise Corrupt(f"{path}: malformed embeddings: a key is listed twice")
        if vectors.dim() != 2 or len(keys) != vectors.shape[0]:
            raise Corrupt(f"{path}: {len(keys)} keys but vectors of shape "
                          f"{list(vectors.shape)} (one row per key expected)")
        index.add(keys, vectors)
        return index


@dataclass(frozen=True)
class IndexView:
    """A ``VectorIndex``'s rows as they were when taken: searched by readers while a writer
    adds rows to the index and drops others (an added row lands past the view's rows or in a
    new buffer, a dropped one leaves the view's buffer as it was), so a score always goes
    with its own key, and only the keys of the view are ranked."""

    keys: tuple[str, ...]
    vectors: torch.Tensor  # [len(keys), dim], float32 on the host

    def __len__(self) -> int:
        return len(self.keys)

    def search(self, query: torch.Tensor, k: int) -> list[tuple[str, float]]:
        """The ``k`` keys most similar to ``query`` ([dim], on any device), best first, with
        their scores."""
        import torch

        if not self.keys or k <= 0:
            return []
        if query.numel() != self.vectors.shape[1]:
            raise Corrupt(f"a {query.numel()}-dim query, but the state's embeddings are "
                          f"{self.vectors.shape[1]}-dim: they come from another embedder")
        scores = self.vectors @ query.detach().to("cpu", torch.float32).reshape(-1)  # [chunks]
        top = torch.topk(scores, min(k, len(self.keys)))
        return [(self.keys[int(i)], float(s)) for s, i in zip(top.values, top.indices)]


def _host(rows: int, dim: int) -> torch.Tensor:
    """An uninitialised [rows, dim] float32 buffer in host memory."""
    import torch

    return torch.empty(rows, dim, dtype=torch.float32, device="cpu")
