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
  that were missing are stored last (after the answer, off the TTFT path; one kdn refuses then,
  full or gone, is logged and counted in ``AskTimings.store_failed``, the answer kept).
  Chunks and the question are untrusted text: special tokens written in them are tokenized as
  plain characters, while the head's and tail's (the chat template's) are the tokenizer's own
  (``kdn.text``); a chunk or question that is not valid Unicode, or a chunk of no tokens, is
  InvalidArgument naming it.

* ``KnowledgeBase`` — a corpus ingested into kdn plus a retrieval index, persisted in a state
  folder (``kdn.rag.index``)::

      kb = KnowledgeBase(engine, Path(".kdn-rag"))
      kb.ingest("docs/")          # resumable, idempotent; returns an IngestReport
      kb.ask("Who ...?")          # retrieve top-k, fetch KV, blend, generate

  Lifecycle of ``ingest(source)``: load and chunk the documents (``kdn.rag.corpus``); a
  document whose text and settings are unchanged and whose chunks kdn still holds (one batched
  Lookup) is skipped without touching the model; for the others each chunk kdn does not hold is
  prefilled alone and stored, each new chunk is embedded, and the manifest entry is replaced.
  The state is committed at the end (and every ``flush_s`` seconds while the settings stay
  the same); after each commit the chunk keys no document references any more (the old
  chunks of changed documents, the chunks of documents that left the corpus) are deleted from
  kdn. An interrupted ingest leaves the last commit, and a rerun resumes it
  (``kdn.rag.knowledge``).

A chunk key shared by two documents of a state (identical chunk text) is deleted only when no
document references it any more; a knowledge base salts its keys with its state's own id, so
no other state holds them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.chunks import ChunkConnector
from kdn.cache import KVCache
from kdn.checks import seconds, share, whole
from kdn.client import Client
from kdn.codec.catalog import check_codec, default_level
from kdn.errors import Closed, DeadlineExceeded, InvalidArgument, KDNError, Unavailable
from kdn.keys import check_namespace, chunk_key
from kdn.model import hf
from kdn.rag.corpus import Tokenizer, chunk_ids, chunk_limit
from kdn.text import check_texts, template_ids, tokenize

PLAIN_HEAD = "Answer the question using the documents below.\n\n"
PLAIN_TAIL = "Question: {question}\nAnswer:"
_DOCS, _QUESTION = "\x00kdn-docs\x00", "\x00kdn-question\x00"
LOOKUP_BATCH = 512

log = logging.getLogger(__name__)


def check_count(name: str, value: object, hint: str = "") -> None:
    """InvalidArgument naming ``name`` unless ``value`` is a whole number >= 1 (not a bool)."""
    whole(name, value, 1, hint)


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
    """Codec level of modes that have several (``kdn``: ``high``, ``small``...; "" is the
    mode's default, ``kdn``'s ``default``, which ``level`` then holds)."""
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
        if not self.level:
            object.__setattr__(self, "level", default_level(self.mode))
        check_codec(self.mode, self.level)  # InvalidArgument naming the mode or level
        for name in ("top_k", "target_tokens", "max_tokens", "max_new_tokens"):
            check_count(name, getattr(self, name))
        chunk_limit(self.target_tokens, self.max_tokens)
        if (self.head is None) != (self.tail is None):
            raise InvalidArgument("set both head and tail, or neither")
        if self.tail is not None and "{question}" not in self.tail:
            raise InvalidArgument("tail must contain {question}")
        share("blend_ratio", self.blend_ratio)  # BlendConfig's ``ratio``, named as here
        seconds("flush_s", self.flush_s)
        self.blend_config()  # validates the rest

    def new_tokens(self, max_new_tokens: int | None) -> int:
        """Tokens a request generates at most: ``max_new_tokens``, or with None this config's
        (``check_count``: 0, 2.5 or True are not taken for it)."""
        if max_new_tokens is None:
            return self.max_new_tokens
        check_count("max_new_tokens", max_new_tokens, " (None: RagConfig.max_new_tokens)")
        return max_new_tokens

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
    store_failed: int = 0
    """Missing chunks that were not stored after the answer (kdn refused them or was gone):
    the answer stands, and the next ask computes them again."""
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
        self.weights_id = hf.default_weights_id(model)
        self.layout = hf.model_layout(model, weights_id=self.weights_id)
        # its layout with no weights named: the model's config and KV layout alone
        self.config_fingerprint = hf.model_layout(model, weights_id="").fingerprint
        if self.config.head is not None and self.config.tail is not None:
            self.head, self.tail = self.config.head, self.config.tail
        else:
            self.head, self.tail = prompt_template(tokenizer)
        self.head_ids = tokenize(tokenizer, self.head, "the prompt head")
        self.stop = stop_ids(tokenizer)

    def former_layouts(self) -> set[str]:
        """Layout fingerprints older kdn gave this model (``hf.former_weights_ids``)."""
        return {hf.model_layout(self.model, weights_id=w).fingerprint
                for w in hf.former_weights_ids(self.model)}

    # -- chunks ---------------------------------------------------------------------------------

    def key(self, ids: Sequence[int], salt: str = "") -> bytes:
        """A chunk's key; ``salt``: a knowledge base's owner id (its keys are its own)."""
        return chunk_key(ids, self.layout, self.config.namespace, salt=salt)

    def chunk_ids(self, chunks: Sequence[str]) -> list[list[int]]:
        """Each chunk's token ids (``kdn.rag.corpus.chunk_ids``); InvalidArgument naming the
        first chunk that is not valid Unicode or gives no tokens (there is no KV of nothing)."""
        out = []
        for i, c in enumerate(check_texts(chunks, "chunks", "chunk")):
            ids = chunk_ids(self.tokenizer, c, f"chunk {i}")
            if not ids:
                raise InvalidArgument(f"chunk {i} ({c!r}) gives no tokens: give chunks of text")
            out.append(ids)
        return out

    def check_chunk_size(self) -> None:
        """InvalidArgument unless a chunk of ``max_tokens`` fits the model's context with the
        head, the tail (an empty question) and one new token: an ingest of chunks that can
        not is refused before it prefills any, as no ask could use them."""
        _, context = hf.prompt_limits(self.model)
        if context is None:
            return
        frame = len(self.head_ids) + len(self.tail_ids("")) + 1
        if self.config.max_tokens + frame > context:
            raise InvalidArgument(
                f"chunks of up to {self.config.max_tokens} tokens (target_tokens "
                f"{self.config.target_tokens}, max_tokens {self.config.max_tokens}; "
                "--chunk-tokens and --max-chunk-tokens) do not fit the model's context of "
                f"{context} tokens with the prompt's head and tail ({frame - 1} tokens) and one "
                f"new token: make chunks of at most {max(context - frame, 0)} tokens")

    def tail_ids(self, question: str) -> list[int]:
        """Token ids of the tail with ``question`` in it (its special tokens as plain text)."""
        return template_ids(self.tokenizer, self.tail, "{question}", question, "the question")

    def prefill(self, ids: Sequence[int]) -> KVCache:
        """KV of a chunk prefilled alone from position 0."""
        return hf.prefill(self.model, ids, self.layout)[0]

    def connector(self, salt: str = "") -> ChunkConnector:
        cfg = self.config
        return ChunkConnector(self.client, self.layout, cfg.namespace, mode=cfg.mode,
                              level=cfg.level, device=hf.model_device(self.model), salt=salt)

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
        ids = self.chunk_ids(chunks)
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
        chunks = check_texts(chunks, "chunks", "chunk")
        new = self.config.new_tokens(max_new_tokens)
        _, context = hf.prompt_limits(self.model)
        if context is None:
            return len(chunks)
        tail = len(self.tail_ids(question))
        room = context - len(self.head_ids) - tail - new
        used = 0
        for ids in self.chunk_ids(chunks):
            room -= len(ids)
            if room < 0:
                break
            used += 1
        if chunks and not used:
            first = len(chunk_ids(self.tokenizer, chunks[0]))
            raise InvalidArgument(
                f"the prompt does not fit the model's context of {context} tokens even with one "
                f"chunk: head {len(self.head_ids)} + chunk {first} + question and tail {tail} + "
                f"{new} new tokens; ask a shorter "
                "question or fewer new tokens")
        return used

    def prepare(self, question: str, chunks: Sequence[str],
                max_new_tokens: int | None = None, *, salt: str = "") -> Prepared:
        """Fetch (or compute) the chunks' KV and blend it with the question: first-token state.
        The last chunks that do not fit the model's context with ``max_new_tokens`` are left
        out (``fitting``; ``Prepared.used``, ``AskTimings.dropped_chunks``). ``salt``: as
        ``key``'s."""
        cfg = self.config
        chunks = check_texts(chunks, "chunks", "chunk")  # (one str: each character a chunk)
        t = AskTimings()
        t0 = time.perf_counter()
        used = self.fitting(question, chunks, max_new_tokens)
        t.dropped_chunks = len(chunks) - used
        chunks = chunks[:used]
        ids = self.chunk_ids(chunks)
        chunks_kv = [self.connector(salt) for _ in ids]
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
        tail_ids = self.tail_ids(question)
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
        out = hf.greedy(decoder, prepared.logits, self.config.new_tokens(max_new_tokens),
                        self.stop)
        t.generate_s = time.perf_counter() - tg
        store_back(prepared.missing, t)
        text = self.tokenizer.decode([x for x in out if x not in self.stop],
                                     skip_special_tokens=True).strip()
        return Answer(text, out, sources, t)

    def answer(self, question: str, chunks: Sequence[str],
               max_new_tokens: int | None = None) -> Answer:
        """Answer ``question`` from the given chunk texts (see the module docstring)."""
        if isinstance(chunks, Sequence) and not chunks:
            raise InvalidArgument("answer needs at least one chunk")
        prepared = self.prepare(question, chunks, max_new_tokens)
        sources = [Source(self.key(chunk_ids(self.tokenizer, c)).hex(), c)
                   for c in chunks[:prepared.used]]
        return self.finish(prepared, sources, max_new_tokens)


def store_back(chunks: Sequence[ChunkConnector], t: AskTimings) -> None:
    """Store the chunks an ask computed, after its answer: a cache fill, so a chunk kdn does
    not take (full, over a quota, gone) is counted in ``t.store_failed`` and logged once, never
    raised. Once the server is unreachable the rest are not tried (each would wait for it)."""
    ts = time.perf_counter()
    error: KDNError | None = None
    for i, chunk in enumerate(chunks):
        try:
            chunk.wait_for_save()
        except KDNError as exc:
            error = exc
            if isinstance(exc, (Unavailable, DeadlineExceeded, Closed)):
                t.store_failed += len(chunks) - i
                break
            t.store_failed += 1
    t.store_s = time.perf_counter() - ts
    if error is not None:
        log.warning("%d of %d computed chunks were not stored in kdn (%s); the answer stands, "
                    "and the next ask computes them again", t.store_failed, len(chunks), error)
