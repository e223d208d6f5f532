"""RAG on kdn: chunks' KV prefilled once and stored in kdn, blended with each question.

Two layers:

* ``RagEngine`` — the drop-in part for an existing RAG pipeline that already retrieves text::

      engine = RagEngine(model, tokenizer, Client(addr))
      answer = engine.answer("Who ...?", ["chunk text 1", "chunk text 2"])
      answer.text, answer.timings.ttft_s

  Lifecycle of ``answer(question, chunks)``: each chunk is tokenized alone and keyed
  (``kdn.keys.chunk_key``); every chunk's Retrieve stream starts at once; a chunk that kdn does
  not hold is prefilled alone now; ``kdn.blend.blend`` composes ``head | chunk 1 | ... |
  chunk n | tail(question)`` layer by layer while later layers still arrive (selective
  recompute, ``blend_ratio``); greedy decoding from the blended KV gives the answer; chunks
  that were missing are stored last (after the answer, off the TTFT path).

* ``KnowledgeBase`` — a corpus ingested into kdn plus a retrieval index, persisted in a state
  folder (``kdn.rag.index``)::

      kb = KnowledgeBase(engine, Path(".kdn-rag"))
      kb.ingest("docs/")          # resumable, idempotent; returns an IngestReport
      kb.ask("Who ...?")          # retrieve top-k, fetch KV, blend, generate

  Lifecycle of ``ingest(source)``: load and chunk the documents (``kdn.rag.corpus``); a
  document whose text and settings are unchanged and whose chunks kdn still holds (one batched
  Lookup) is skipped without touching the model; for the others each chunk kdn does not hold is
  prefilled alone and stored, each new chunk is embedded, the manifest entry is replaced, and
  the document's old chunk keys that no document references any more are deleted from kdn. A
  document that left the corpus has its unshared chunk keys deleted. State is flushed
  (embeddings, then manifest) every ``flush_s`` seconds and at the end, so an interrupted
  ingest resumes where it stopped.

A chunk key shared by two documents (identical chunk text) is deleted only when no document
references it any more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.chunks import ChunkConnector
from kdn.cache import KVCache
from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.keys import check_namespace, chunk_key
from kdn.model import hf
from kdn.rag.corpus import Chunk, Document, Tokenizer, chunk_document, chunk_ids, load_corpus
from kdn.rag.index import (
    ChunkEntry,
    DocEntry,
    Embedder,
    Manifest,
    Settings,
    VectorIndex,
    state_lock,
)

PLAIN_HEAD = "Answer the question using the documents below.\n\n"
PLAIN_TAIL = "Question: {question}\nAnswer:"
_DOCS, _QUESTION = "\x00kdn-docs\x00", "\x00kdn-question\x00"
LOOKUP_BATCH = 512


@dataclass(frozen=True)
class RagConfig:
    top_k: int = 4
    """Chunks retrieved per question."""
    target_tokens: int = 256
    """Chunk size the splitter aims for."""
    max_tokens: int = 384
    """No chunk is longer (except by the tokens joining its sentences adds)."""
    namespace: str = "rag"
    """kdn namespace of the chunk entries."""
    mode: str = "lossless"
    """Codec mode chunks are stored in (``lossless`` keeps the model's exact KV)."""
    level: str = ""
    """Codec level for lossy modes (``kdn``: e.g. ``l2``)."""
    blend_ratio: float = 0.15
    """Fraction of cached chunk tokens the blender recomputes."""
    select_layer: int = 1
    """Layer whose K/V deviation picks the recomputed tokens (when ``query_share`` < 1)."""
    query_share: float = 0.0
    """Share of the recompute budget picked by the question's attention (1: ``kdn.blend``'s
    default rule); 0 selects by K/V deviation alone (CacheBlend). RAG defaults to 0: with
    short chunks the question rule's first pass is a larger share of the work (bench/README.md,
    rag)."""
    max_new_tokens: int = 32
    head: str | None = None
    """Prompt text before the chunks; None: the tokenizer's chat template (or a plain one)."""
    tail: str | None = None
    """Prompt text after the chunks, ``{question}`` replaced; None: as ``head``."""
    flush_s: float = 5.0
    """Seconds between state flushes during an ingest."""

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.top_k < 1:
            raise InvalidArgument(f"top_k must be >= 1, got {self.top_k}")
        if not 8 <= self.target_tokens <= self.max_tokens:
            raise InvalidArgument(f"need 8 <= target_tokens <= max_tokens, got "
                                  f"{self.target_tokens}, {self.max_tokens}")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if (self.head is None) != (self.tail is None):
            raise InvalidArgument("set both head and tail, or neither")
        if self.tail is not None and "{question}" not in self.tail:
            raise InvalidArgument("tail must contain {question}")
        self.blend_config()  # validates

    def blend_config(self) -> BlendConfig:
        return BlendConfig(ratio=self.blend_ratio, select_layer=self.select_layer,
                           query_share=self.query_share)


@dataclass
class AskTimings:
    retrieval_s: float = 0.0
    """Embedding the question and ranking the chunks (KnowledgeBase.ask only)."""
    fetch_s: float = 0.0
    """Opening the Retrieve streams plus waiting for layers the blend needed before they came."""
    prefill_missing_s: float = 0.0
    """Prefilling chunks kdn did not hold."""
    blend_s: float = 0.0
    """Blend compute (selective recompute), without the fetch waits."""
    ttft_s: float = 0.0
    """Question to first token: retrieval + fetch + missing prefill + blend."""
    generate_s: float = 0.0
    """Greedy decoding after the first token."""
    store_s: float = 0.0
    """Storing missing chunks after the answer."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    missing_chunks: int = 0
    dropped_chunks: int = 0
    """The last (lowest-ranked) chunks left out so the prompt and the answer fit the model's
    context."""

    @property
    def compute_s(self) -> float:
        """Model compute on the request path: missing prefill + blend + decoding."""
        return self.prefill_missing_s + self.blend_s + self.generate_s


@dataclass(frozen=True)
class Source:
    key: str
    text: str
    doc_id: str = ""
    chunk_index: int = -1
    score: float = float("nan")


@dataclass
class Prepared:
    """A prompt's blended KV and first-token logits, ready to decode."""

    kv: KVCache
    logits: torch.Tensor
    missing: list[ChunkConnector]
    """Chunks kdn did not hold, computed for this prompt; stored by ``RagEngine.finish``."""
    timings: AskTimings
    first_token: int = -1
    """The first generated token (known when TTFT is taken)."""
    used: int = 0
    """How many of the chunks (the first ones) the prompt holds; the others did not fit."""


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    sources: list[Source]
    timings: AskTimings
    first_token: int = -1
    """The first generated token (known when TTFT is taken)."""


@dataclass
class IngestReport:
    documents: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0
    chunks: int = 0
    """Chunks of the corpus after the ingest."""
    computed: int = 0
    """Chunks prefilled and stored by this ingest."""
    reused: int = 0
    """Chunks of changed documents that kdn already held."""
    tokens: int = 0
    """Tokens in the corpus's chunks."""
    computed_tokens: int = 0
    stored_bytes: int = 0
    """Bytes kdn holds for the corpus's chunks (this ingest's writes and earlier ones)."""
    deleted: int = 0
    """kdn entries deleted (chunks of changed or removed documents no document uses)."""
    embed_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0

    def summary(self) -> str:
        mib = self.stored_bytes / (1 << 20)
        return (f"{self.documents} documents ({self.changed} changed, {self.unchanged} unchanged,"
                f" {self.removed} removed); {self.chunks} chunks, {self.tokens} tokens; computed "
                f"{self.computed} chunks ({self.computed_tokens} tokens), reused {self.reused}; "
                f"deleted {self.deleted} entries; kdn holds {mib:.1f} MiB for the corpus; "
                f"{self.total_s:.1f} s "
                f"(prefill {self.prefill_s:.1f}, store {self.store_s:.1f}, embed "
                f"{self.embed_s:.1f})")


def prompt_template(tokenizer: Any) -> tuple[str, str]:
    """(head, tail) around the chunks from the tokenizer's chat template, or a plain pair."""
    content = f"{PLAIN_HEAD}{_DOCS}Question: {_QUESTION}\nAnswer with a few words."
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # no chat template (base models, test tokenizers)
        return PLAIN_HEAD, PLAIN_TAIL
    if not isinstance(text, str) or text.count(_DOCS) != 1 or text.count(_QUESTION) != 1:
        return PLAIN_HEAD, PLAIN_TAIL
    head, tail = text.split(_DOCS)
    return head, tail.replace(_QUESTION, "{question}")


def stop_ids(tokenizer: Any) -> set[int]:
    """Token ids that end an answer: EOS and the chat end-of-turn token where there is one."""
    out = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        if name in vocab:
            out.add(int(vocab[name]))
    return out


class RagEngine:
    """Answer a question over given chunk texts with their KV from kdn (module docstring)."""

    def __init__(self, model: Any, tokenizer: Tokenizer, client: Client,
                 config: RagConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.client = client
        self.config = config or RagConfig()
        self.layout = hf.model_layout(model)
        if self.config.head is not None and self.config.tail is not None:
            self.head, self.tail = self.config.head, self.config.tail
        else:
            self.head, self.tail = prompt_template(tokenizer)
        self.head_ids = chunk_ids(tokenizer, self.head)
        self.stop = stop_ids(tokenizer)

    # -- chunks ---------------------------------------------------------------------------------

    def key(self, ids: Sequence[int]) -> bytes:
        return chunk_key(ids, self.layout, self.config.namespace)

    def prefill(self, ids: Sequence[int]) -> KVCache:
        """KV of a chunk prefilled alone from position 0."""
        return hf.prefill(self.model, ids, self.layout)[0]

    def connector(self) -> ChunkConnector:
        cfg = self.config
        return ChunkConnector(self.client, self.layout, cfg.namespace, mode=cfg.mode,
                              level=cfg.level, device=hf.model_device(self.model))

    def store(self, key: bytes, kv: KVCache) -> int:
        """Store a chunk's KV; the bytes kdn holds for it."""
        resp = self.client.store(key, kv, mode=self.config.mode, level=self.config.level,
                                 namespace=self.config.namespace)
        return int(resp.stored_bytes)

    def present(self, keys: Sequence[bytes]) -> list[int]:
        """Stored size of each key, -1 where kdn does not hold it (batched Lookups)."""
        out: list[int] = []
        for i in range(0, len(keys), LOOKUP_BATCH):
            res = self.client.lookup(keys[i : i + LOOKUP_BATCH], namespace=self.config.namespace)
            out.extend(info.size_bytes if info.present else -1 for info in res.infos)
        return out

    def ensure(self, chunks: Sequence[str]) -> int:
        """Prefill and store the chunks kdn does not hold; how many were computed."""
        ids = [chunk_ids(self.tokenizer, c) for c in chunks]
        keys = [self.key(i) for i in ids]
        computed = 0
        for k, i, size in zip(keys, ids, self.present(keys)):
            if size < 0:
                self.store(k, self.prefill(i))
                computed += 1
        return computed

    # -- answering ------------------------------------------------------------------------------

    def fitting(self, question: str, chunks: Sequence[str],
                max_new_tokens: int | None = None) -> int:
        """How many of ``chunks`` (ranked, best first) fit the model's context together with
        the head, the question and ``max_new_tokens``; InvalidArgument when not even one."""
        _, context = hf.prompt_limits(self.model)
        if context is None:
            return len(chunks)
        tail = len(chunk_ids(self.tokenizer, self.tail.replace("{question}", question)))
        room = context - len(self.head_ids) - tail - (max_new_tokens or self.config.max_new_tokens)
        used = 0
        for c in chunks:
            room -= len(chunk_ids(self.tokenizer, c))
            if room < 0:
                break
            used += 1
        if chunks and not used:
            first = len(chunk_ids(self.tokenizer, chunks[0]))
            raise InvalidArgument(
                f"the prompt does not fit the model's context of {context} tokens even with one "
                f"chunk: head {len(self.head_ids)} + chunk {first} + question and tail {tail} + "
                f"{max_new_tokens or self.config.max_new_tokens} new tokens; ask a shorter "
                "question or fewer new tokens")
        return used

    def prepare(self, question: str, chunks: Sequence[str],
                max_new_tokens: int | None = None) -> Prepared:
        """Fetch (or compute) the chunks' KV and blend it with the question: first-token state.
        The last chunks that do not fit the model's context with ``max_new_tokens`` are left
        out (``fitting``; ``Prepared.used``, ``AskTimings.dropped_chunks``)."""
        cfg = self.config
        t = AskTimings()
        t0 = time.perf_counter()
        used = self.fitting(question, chunks, max_new_tokens)
        t.dropped_chunks = len(chunks) - used
        chunks = chunks[:used]
        ids = [chunk_ids(self.tokenizer, c) for c in chunks]
        chunks_kv = [self.connector() for _ in ids]
        loaded = [c.start_load(i) for c, i in zip(chunks_kv, ids)]
        t.fetch_s = time.perf_counter() - t0
        missing: list[ChunkConnector] = []
        tp = time.perf_counter()
        for c, i, n in zip(chunks_kv, ids, loaded):
            if not n:
                for layer, (k, v) in enumerate(self.prefill(i).layers):
                    c.save_layer(layer, k, v)
                missing.append(c)
        t.prefill_missing_s = time.perf_counter() - tp
        tail_ids = chunk_ids(self.tokenizer, self.tail.replace("{question}", question))
        pieces = [Piece(self.head_ids)] + [Piece(i, c) for i, c in zip(ids, chunks_kv)] + [
            Piece(tail_ids)]
        result = blend(self.model, pieces, cfg.blend_config())
        first = int(result.logits.argmax())  # the first token is known (a sync on a GPU)
        t.fetch_s += result.timings.wait_s
        t.blend_s = result.timings.total_s - result.timings.wait_s
        t.ttft_s = time.perf_counter() - t0
        t.prompt_tokens = sum(len(p.ids) for p in pieces)
        t.cached_tokens = result.timings.cached_tokens
        t.recomputed_tokens = result.timings.recomputed_tokens
        t.missing_chunks = len(missing)
        return Prepared(result.kv, result.logits, missing, t, first, used)

    def finish(self, prepared: Prepared, sources: list[Source],
               max_new_tokens: int | None = None) -> Answer:
        """Decode the answer from a prepared prompt, then store the chunks that were missing."""
        t = prepared.timings
        tg = time.perf_counter()
        decoder = hf.CacheDecoder(self.model, hf.to_transformers(prepared.kv))
        out = hf.greedy(decoder, prepared.logits, max_new_tokens or self.config.max_new_tokens,
                        self.stop)
        t.generate_s = time.perf_counter() - tg
        ts = time.perf_counter()
        for chunk in prepared.missing:
            chunk.wait_for_save()
        t.store_s = time.perf_counter() - ts
        text = self.tokenizer.decode([x for x in out if x not in self.stop],
                                     skip_special_tokens=True).strip()
        return Answer(text, out, sources, t)

    def answer(self, question: str, chunks: Sequence[str],
               max_new_tokens: int | None = None) -> Answer:
        """Answer ``question`` from the given chunk texts (see the module docstring)."""
        if not chunks:
            raise InvalidArgument("answer needs at least one chunk")
        prepared = self.prepare(question, chunks, max_new_tokens)
        sources = [Source(self.key(chunk_ids(self.tokenizer, c)).hex(), c)
                   for c in chunks[:prepared.used]]
        return self.finish(prepared, sources, max_new_tokens)


class KnowledgeBase:
    """A corpus ingested into kdn with a persisted retrieval index (module docstring).

    One state folder may hold several corpora (folders or files); each document remembers the
    corpus it came from (its ``source``), and its id is its path relative to that folder. When
    an ingest lists an id that another source holds:

    * the other source still has it on disk (a folder: the file ``<source>/<id>``; a JSONL or
      text file: the file exists): two corpora share a name, and the ingest is refused
      (InvalidArgument naming both) before anything changes;
    * it does not (the folder was renamed or moved, or the file moved from it to here): the
      document now belongs to this corpus; and when the other source is gone from disk
      altogether, a prune removes its documents this corpus does not list too (a moved
      folder's deleted files).

    Documents given as a list (``ingest([Document, ...])``, source ``api``) replace any id and
    are taken over by any corpus that lists their id.
    """

    def __init__(self, engine: RagEngine, state: Path | str,
                 embedder: Embedder | None = None) -> None:
        self.engine = engine
        self.state = Path(state)
        self._embedder = embedder
        cfg = engine.config
        self.settings = Settings(engine.layout.fingerprint, cfg.namespace, cfg.target_tokens,
                                 cfg.max_tokens, cfg.mode, cfg.level)
        self._by_key: dict[str, tuple[str, ChunkEntry]] = {}
        self._writers = 0
        self._load()

    def _load(self) -> None:
        self.manifest = Manifest.load(self.state)
        self.index = VectorIndex.load(self.state)
        self._reindex()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the state folder's lock and work on its state as on disk now (another process
        may have written it since this one loaded it); reentrant (ingest's prune removes)."""
        if self._writers:
            self._writers += 1
            try:
                yield
            finally:
                self._writers -= 1
            return
        with state_lock(self.state):
            self._writers = 1
            try:
                self._load()
                yield
            finally:
                self._writers = 0

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            from kdn.model.embed import Embedder as MiniLM

            self._embedder = MiniLM()
        return self._embedder

    def _reindex(self) -> None:
        self._by_key = {}
        for doc_id, d in sorted(self.manifest.documents.items()):
            for c in d.chunks:
                self._by_key.setdefault(c.key, (doc_id, c))

    def _flush(self) -> None:
        self.index.save(self.state)
        self.manifest.save(self.state)

    def _delete_unreferenced(self, keys: set[str]) -> int:
        stale = sorted(keys - self.manifest.keys())
        if not stale:
            return 0
        self.engine.client.delete([bytes.fromhex(k) for k in stale],
                                  namespace=self.engine.config.namespace)
        return len(stale)

    # -- ingest ---------------------------------------------------------------------------------

    def ingest(self, source: Path | str | Sequence[Document], *, prune: bool | None = None,
               progress: bool = False) -> IngestReport:
        """Bring kdn and the index in line with ``source`` (see the module docstring).

        ``prune``: documents of the same source that are gone are removed (default: yes for a
        folder or file, no for a list of ``Document``s, which adds or updates only).
        The state folder is locked from loading to the last flush (``StateLocked``: another
        ingest or rm holds it).
        """
        with self._writing():
            return self._ingest(source, prune, progress)

    def _ingest(self, source: Path | str | Sequence[Document], prune: bool | None,
                progress: bool) -> IngestReport:
        t0 = time.perf_counter()
        rep = IngestReport()
        if isinstance(source, (str, Path)):
            docs, origin = load_corpus(source), str(Path(source).resolve())
        else:
            docs, origin = list(source), "api"
        if prune is None:
            prune = origin != "api"
        self._check_settings()
        old = self.manifest.settings
        same_settings = old == self.settings
        # a new codec mode or level: every chunk is encoded and stored again
        reencode = old is not None and (old.mode, old.level) != (self.settings.mode,
                                                                   self.settings.level)
        self.manifest.settings = self.settings
        rep.documents = len(docs)
        moved_from = self._claim(docs, origin)

        # documents whose text, settings and stored chunks are all unchanged are skipped
        candidates = [d for d in docs if same_settings and d.id in self.manifest.documents
                      and self.manifest.documents[d.id].sha256 == d.sha256]
        keys = sorted({c.key for d in candidates for c in self.manifest.documents[d.id].chunks})
        held = dict(zip(keys, self.engine.present([bytes.fromhex(k) for k in keys])))
        unchanged = {d.id for d in candidates
                     if all(held[c.key] >= 0 for c in self.manifest.documents[d.id].chunks)}
        changed = [d for d in docs if d.id not in unchanged]
        rep.unchanged, rep.changed = len(unchanged), len(changed)

        chunked = [(d, chunk_document(d, self.engine.tokenizer, self.settings.target_tokens,
                                      self.settings.max_tokens)) for d in changed]
        new_keys = [self.engine.key(c.ids) for _, cs in chunked for c in cs]
        sizes = {} if reencode else dict(zip(new_keys, self.engine.present(new_keys)))
        todo = len({k for k in new_keys if sizes.get(k, -1) < 0})
        bar = _progress(todo, progress)
        last_flush = time.perf_counter()
        for doc, chunks in chunked:
            entries = [self._ingest_chunk(c, sizes, rep, bar) for c in chunks]
            self._embed_missing(entries, rep)
            before = self.manifest.documents.get(doc.id)
            self.manifest.documents[doc.id] = DocEntry(doc.sha256, origin, entries)
            if before is not None:
                rep.deleted += self._delete_unreferenced({c.key for c in before.chunks})
            if time.perf_counter() - last_flush > self.engine.config.flush_s:
                self._flush()
                last_flush = time.perf_counter()
        bar(0, done=True)

        if prune:
            present = {d.id for d in docs}
            gone = [i for i, d in self.manifest.documents.items() if i not in present
                    and (d.source == origin or d.source in moved_from)]
            rep.removed = len(gone)
            rep.deleted += self.remove(gone, flush=False)
        listed = {d.id for d in docs}
        self._embed_missing([c for i, d in self.manifest.documents.items() if i in listed
                             for c in d.chunks], rep)
        self.index.retain(self.manifest.keys())
        self._flush()
        self._reindex()
        counted: set[str] = set()
        for d in docs:
            for c in self.manifest.documents[d.id].chunks:
                rep.chunks += 1
                rep.tokens += c.tokens
                if c.key not in counted:
                    counted.add(c.key)
                    rep.stored_bytes += max(c.stored_bytes, held.get(c.key, 0))
        rep.total_s = time.perf_counter() - t0
        return rep

    def _claim(self, docs: Sequence[Document], origin: str) -> set[str]:
        """Make ``origin`` the source of every listed document the manifest holds (a corpus
        folder renamed or moved keeps its documents), or InvalidArgument when another source
        still holds one of them (the class docstring's rule); the earlier sources that no
        longer exist on disk, whose unlisted documents a prune removes too."""
        if origin == "api":
            return set()
        taken = [(d.id, e) for d in docs if (e := self.manifest.documents.get(d.id)) is not None
                 and e.source not in (origin, "api")]
        clash = [(i, e.source) for i, e in taken if _holds(Path(e.source), i)]
        if clash:
            doc_id, other = clash[0]
            more = f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""
            raise InvalidArgument(
                f"{doc_id}{more}: {origin} and {other} both have a document of this id (a path "
                f"relative to its folder) and {self.state} holds {other}'s; ingest one of them "
                f"into another --state folder, or `kdn rag rm {doc_id}` first")
        moved_from: set[str] = set()
        for _, entry in taken:
            if not Path(entry.source).exists():
                moved_from.add(entry.source)
            entry.source = origin
        return moved_from

    def _check_settings(self) -> None:
        old = self.manifest.settings
        if old is None:
            return
        new = self.settings
        differ = []
        if old.layout != new.layout:
            differ.append(f"model (layout {old.layout[:12]} there, {new.layout[:12]} here: "
                          "not the same model or weights)")
        if old.namespace != new.namespace:
            differ.append(f"namespace ({old.namespace!r} there, {new.namespace!r} here)")
        if differ:
            raise InvalidArgument(f"{self.state} holds a corpus ingested with another "
                                  f"{' and another '.join(differ)}; use the model and namespace "
                                  "it was ingested with, or another state folder")

    def _ingest_chunk(self, chunk: Chunk, sizes: dict[bytes, int], rep: IngestReport,
                      bar: Callable[..., None]) -> ChunkEntry:
        key = self.engine.key(chunk.ids)
        size = sizes.get(key, -1)
        if size >= 0:
            rep.reused += 1
        else:
            tp = time.perf_counter()
            kv = self.engine.prefill(chunk.ids)
            ts = time.perf_counter()
            size = self.engine.store(key, kv)
            rep.prefill_s += ts - tp
            rep.store_s += time.perf_counter() - ts
            rep.computed += 1
            rep.computed_tokens += chunk.tokens
            sizes[key] = size
            bar(1)
        return ChunkEntry(key.hex(), chunk.tokens, chunk.text, size)

    def _embed_missing(self, entries: list[ChunkEntry], rep: IngestReport) -> None:
        todo: dict[str, str] = {}
        for c in entries:
            if c.key not in self.index and c.key not in todo:
                todo[c.key] = c.text
        if not todo:
            return
        te = time.perf_counter()
        self.index.add(list(todo), self.embedder.embed(list(todo.values())))
        rep.embed_s += time.perf_counter() - te

    def remove(self, doc_ids: Sequence[str], *, flush: bool = True) -> int:
        """Forget documents; delete their chunks' kdn entries no other document uses (the
        state folder locked as by ``ingest``)."""
        with self._writing():
            return self._remove(doc_ids, flush)

    def _remove(self, doc_ids: Sequence[str], flush: bool) -> int:
        self._check_settings()  # another model's keys are not the entries to delete
        old: set[str] = set()
        for doc_id in doc_ids:
            d = self.manifest.documents.pop(doc_id, None)
            if d is not None:
                old.update(c.key for c in d.chunks)
        deleted = self._delete_unreferenced(old)
        if flush:
            self.index.retain(self.manifest.keys())
            self._flush()
            self._reindex()
        return deleted

    # -- asking ---------------------------------------------------------------------------------

    def retrieve(self, question: str, k: int | None = None) -> list[Source]:
        """The top-k chunks for ``question``, best first."""
        self._check_settings()  # another model would recompute and store every chunk anew
        qv = self.embedder.embed([question])[0]
        out = []
        for key, score in self.index.search(qv, k or self.engine.config.top_k):
            if key in self._by_key:
                doc_id, c = self._by_key[key]
                out.append(Source(key, c.text, doc_id, self._position(doc_id, key), score))
        return out

    def _position(self, doc_id: str, key: str) -> int:
        return next(i for i, c in enumerate(self.manifest.documents[doc_id].chunks)
                    if c.key == key)

    def ask(self, question: str, k: int | None = None,
            max_new_tokens: int | None = None) -> Answer:
        """Retrieve, fetch the chunks' KV (computing missing ones), blend, generate."""
        t0 = time.perf_counter()
        sources = self.retrieve(question, k)
        if not sources:
            raise InvalidArgument("the knowledge base is empty: ingest a corpus first")
        retrieval_s = time.perf_counter() - t0
        prepared = self.engine.prepare(question, [s.text for s in sources], max_new_tokens)
        prepared.timings.retrieval_s = retrieval_s
        prepared.timings.ttft_s += retrieval_s
        return self.engine.finish(prepared, sources[:prepared.used], max_new_tokens)


def _holds(source: Path, doc_id: str) -> bool:
    """Whether a corpus on disk still has the document ``doc_id``: a folder its file, a file
    (JSONL or text) by existing."""
    return (source / doc_id).is_file() if source.is_dir() else source.is_file()


def _progress(total: int, enabled: bool) -> Callable[..., None]:
    """A tqdm bar over the chunks to compute (on stderr), or a no-op."""
    if not enabled or total == 0:
        return lambda n=1, done=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="chunk", desc="prefill+store", dynamic_ncols=True)

    def update(n: int = 1, done: bool = False) -> None:
        if n:
            bar.update(n)
        if done:
            bar.close()

    return update
