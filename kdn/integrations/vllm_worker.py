"""The worker half of kdn's vLLM connector (``kdn.integrations.vllm``): vLLM's paged KV cache
in and out of kdn.

Lifecycle, once per step (the model runner's calls):

1. ``register(kv_caches)`` (once): vLLM's per-layer cache tensors. Each is, in logical order,
   ``[2, num_blocks, B, H, D]`` (K and V first: FlashAttention) or ``[num_blocks, 2, B, H, D]``
   (FlashInfer, Triton), with any strides (HND layouts, and the cross-layer allocation whose
   per-layer tensors are views of one buffer, are strided views of these shapes).
2. ``start_load(loads)``: one Retrieve stream per chunk to load, all started at once through
   the client (same-host segment, in-process tier or network: the client's own choice); a miss,
   or a ``LoadSpec`` this worker can not place (no keys for its rank, too few block ids for its
   tokens, ids outside the cache), marks the chunk's blocks failed.
3. ``wait_for_layer(name)``: layer i of every loading chunk, ``k: [H, C, D]``, is cut to the
   tokens to place, joined, and scattered into the cache as ``[blocks, B, H, D]`` by block id on
   the cache's device. A stream that fails marks its chunk's blocks failed (vLLM recomputes
   them); nothing is raised into the forward pass.
4. ``save_layer(name, kv, saves)``: the blocks of the chunks to save are gathered
   (``[blocks, B, H, D]``, a copy: vLLM may reuse the blocks once the step is over); on a GPU
   they are copied to pinned host memory on a side stream, after the compute that wrote them.
   A ``SaveSpec`` this worker can not gather (as for loads) is dropped, logged and counted in
   ``save_errors``.
5. ``end_step()`` (vLLM's ``wait_for_save``): layers the model did not wait for are placed,
   the step's streams are let go, and the gathered chunks are handed to a background thread
   that encodes them in every configured encoding and stores those kdn lacks (a failure there
   is logged and counted in ``save_errors``, never raised). While the server is slow, at most
   ``SAVE_BACKLOG_STEPS`` steps and ``save_backlog_bytes`` of gathered KV wait for it; a step's
   saves past that are dropped (counted in ``save_errors``, a warning at most every
   ``SHED_WARN_S``).
6. ``take_failed()``: block ids that failed to load since the last call.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kdn import keys
from kdn.cache import KVCache, to_pinned_host
from kdn.client import Client, LayerStream
from kdn.codec.catalog import EXACT_MODES
from kdn.errors import InvalidLayout, LayoutMismatch
from kdn.integrations.vllm_meta import KDNConnectorConfig, LoadSpec, PagedShape, SaveSpec
from kdn.options import StoreOptions

log = logging.getLogger(__name__)

SAVE_BACKLOG_STEPS = 8
"""Steps whose saves may wait for the saver thread (each holds its gathered KV)."""
SHED_WARN_S = 10.0
"""Seconds between warnings of saves dropped past the backlog."""


@dataclass
class _Piece:
    """The part of one loading chunk that goes into the cache."""

    req_id: str
    stream: LayerStream
    first: int
    """First token of the chunk to place (0..C)."""
    last: int
    block_ids: list[int]
    runs: list[tuple[int, int, int]]
    """(first block id, first block of the piece, blocks) of each run of consecutive ids."""
    index: torch.Tensor | None
    """The block ids on a GPU, when they are not one run (one scatter kernel)."""
    ok: bool = True
    at: int = 0
    """The position of the chunk's first token: where its stored KV must start."""
    checked: bool = False


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``ids`` as runs of consecutive block ids: (first id, position in ``ids``, length)."""
    runs: list[tuple[int, int, int]] = []
    for j, b in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == b:
            start, at, count = runs[-1]
            runs[-1] = (start, at, count + 1)
        else:
            runs.append((b, j, 1))
    return runs


@dataclass
class WorkerStats:
    blocks_loaded: int = 0
    blocks_failed: int = 0
    chunks_saved: int = 0
    chunks_skipped: int = 0
    """Chunks a save found already stored."""
    save_errors: int = 0


class WorkerSide:
    """Loads into and saves out of vLLM's paged cache (module docstring)."""

    def __init__(self, shape: PagedShape, config: KDNConnectorConfig, client: Client,
                 rank: int, *, own_client: bool = True) -> None:
        self.shape = shape
        self.client = client
        self.rank = rank
        self.layout = shape.layout
        self.config = config
        self._own_client = own_client
        self.index = {name: i for i, name in enumerate(shape.layer_names)}
        self.kv: list[torch.Tensor] = []
        self.kv_first = True
        self.device = torch.device("cpu")
        self.num_blocks = 0
        self.stats = WorkerStats()
        self._pieces: list[_Piece] = []
        self._placed: set[int] = set()
        self._failed: set[int] = set()
        self._step_failed: tuple[set[str], set[int]] = (set(), set())
        """The requests and blocks whose loads failed this step: its forward read blocks that
        hold no KV of theirs."""
        self._gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._save_ids: torch.Tensor | None = None
        self._saving: list[SaveSpec] = []
        """The step's saves that ``save_layer`` gathers (those it can)."""
        self._save_runs: list[tuple[int, int, int]] = []
        self._copies: Any = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kdn-vllm-save")
        self._saves: list[Future[None]] = []
        self._backlog = 0  # bytes of gathered KV handed to the saver and not yet stored
        self._shed = 0  # steps' saves dropped since the last warning
        self._shed_warned = 0.0
        self._lock = threading.Lock()
        self._options = StoreOptions(ttl_s=self.config.ttl_s)

    # -- the cache --------------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.index if n not in kv_caches]
        if missing:
            raise InvalidLayout(f"vLLM registered no KV cache for layers {missing}")
        lay, b = self.layout, self.shape.block_size
        heads, d = lay.layers[0].kv_heads, lay.head_dim
        tensors = [kv_caches[n] for n in self.index]
        first = tensors[0]
        if first.dim() != 5 or tuple(first.shape[2:]) != (b, heads, d):
            raise InvalidLayout(f"KV cache of shape {tuple(first.shape)}: kdn reads "
                                f"[2, blocks, {b}, {heads}, {d}] or [blocks, 2, {b}, {heads}, "
                                f"{d}]")
        kv_first = first.shape[0] == 2
        if not kv_first and first.shape[1] != 2:
            raise InvalidLayout(f"KV cache of shape {tuple(first.shape)} has no K/V axis of 2")
        for name, t in zip(self.index, tensors):
            if t.shape != first.shape or t.dtype != lay.dtype.torch or t.device != first.device:
                raise InvalidLayout(f"layer {name}: KV cache {tuple(t.shape)} {t.dtype} on "
                                    f"{t.device}, layer 0: {tuple(first.shape)} "
                                    f"{lay.dtype.torch} on {first.device}")
        self.kv, self.kv_first, self.device = tensors, kv_first, first.device
        self.num_blocks = int(self._kv_of(first)[0].shape[0])
        if self.device.type == "cuda":
            self._copies = torch.cuda.Stream(self.device)

    def _kv_of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's cache, each ``[blocks, B, H, D]`` (views)."""
        return (t[0], t[1]) if self.kv_first else (t[:, 0], t[:, 1])

    def _need_cache(self) -> None:
        if not self.kv:
            raise RuntimeError("register_kv_caches() first: no KV cache is registered")

    # -- loads ------------------------------------------------------------------------------------

    def start_load(self, loads: list[LoadSpec]) -> None:
        self._release()
        if not loads:
            return
        self._need_cache()
        c, b = self.shape.chunk_tokens, self.shape.block_size
        for spec in loads:
            why = self._unplaceable(spec)
            if why:  # a bug upstream; vLLM recomputes what it named
                log.warning("kdn: load of request %s refused: %s", spec.req_id, why)
                end = -(-max(0, spec.end_token) // b)
                self._fail(spec.block_ids[max(0, spec.start_token) // b : end], spec.req_id)
                continue
            ks = spec.keys_by_rank[self.rank]
            spans = []
            for j in range(len(ks)):
                lo = (spec.first_chunk + j) * c
                t0, t1 = max(spec.start_token, lo), min(spec.end_token, lo + c)
                spans.append((t0 - lo, t1 - lo, spec.block_ids[t0 // b : t1 // b]))
            try:
                streams: list[LayerStream | None] = self.client.retrieve_streams(
                    ks, namespace=self.config.namespace, layout=self.layout, tokens=c,
                    device=self.device)
            except Exception as exc:  # unreachable, refused: every block of it recomputed
                log.warning("kdn: load of request %s failed: %s", spec.req_id, exc)
                streams = [None] * len(ks)
            for j, (stream, (first, last, ids)) in enumerate(zip(streams, spans)):
                if stream is None:
                    self._fail(ids, spec.req_id)
                elif ids:
                    runs = block_runs(ids)
                    index = (torch.tensor(ids).to(self.device)
                             if len(runs) > 1 and self.device.type == "cuda" else None)
                    self._pieces.append(_Piece(spec.req_id, stream, first, last, ids, runs,
                                               index, at=(spec.first_chunk + j) * c))

    def _unplaceable(self, spec: LoadSpec) -> str:
        """Why ``spec`` can not be placed into this worker's cache ("": it can)."""
        c, b = self.shape.chunk_tokens, self.shape.block_size
        if not 0 <= self.rank < len(spec.keys_by_rank):
            return f"no keys for TP rank {self.rank}"
        n = len(spec.keys_by_rank[self.rank])
        lo, hi = spec.first_chunk * c, (spec.first_chunk + n) * c
        if (not 0 <= lo <= spec.start_token < spec.end_token <= hi or spec.start_token % b
                or spec.end_token % b):
            return (f"tokens [{spec.start_token}, {spec.end_token}) are not whole blocks of "
                    f"its {n} chunks from token {lo}")
        return self._bad_ids(spec.block_ids, spec.end_token // b,
                             spec.block_ids[spec.start_token // b : spec.end_token // b])

    def _bad_ids(self, ids: list[int], need: int, used: list[int]) -> str:
        """Why a block table ``ids`` that must hold ``need`` ids, of which ``used`` are read
        or written, does not fit the cache ("": it does)."""
        if len(ids) < need:
            return f"{len(ids)} block ids where {need} are needed"
        out = [i for i in used if not 0 <= i < self.num_blocks]
        return f"block ids {out[:4]} outside [0, {self.num_blocks})" if out else ""

    def _fail(self, ids: list[int], req_id: str) -> None:
        if ids:
            self._step_failed[0].add(req_id)
            self._step_failed[1].update(ids)
        self._failed.update(ids)
        self.stats.blocks_failed += len(ids)

    def wait_for_layer(self, name: str) -> None:
        i = self.index.get(name)
        if i is None or i in self._placed or not self._pieces:
            return
        self._placed.add(i)
        on = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        kc, vc = self._kv_of(self.kv[i])  # [blocks, B, H, D] each
        b = self.shape.block_size
        for p in self._pieces:
            if not p.ok:
                continue
            try:
                k, v = p.stream.wait_for_layer(i, self.config.timeout_s, stream=on)
                if not p.checked and p.stream.start_position != p.at:  # another chunk's KV
                    raise LayoutMismatch(f"the chunk at token {p.at} was answered with the KV "
                                         f"of tokens from {p.stream.start_position}")
                p.checked = True
            except Exception as exc:  # damaged, cut off, timed out: this chunk is recomputed
                log.warning("kdn: chunk of request %s failed at layer %d: %s", p.req_id, i, exc)
                p.ok = False
                self._fail(p.block_ids, p.req_id)
                continue
            n = len(p.block_ids)
            for src, dst in ((k, kc), (v, vc)):
                # [H, T, D] -> [n, B, H, D] as a view: one strided copy into the blocks
                blocks = src[:, p.first : p.last].unflatten(1, (n, b)).permute(1, 2, 0, 3)
                if p.index is not None:
                    dst[p.index] = blocks
                else:  # on a CPU, slice copies per run: indexed copies of fp16 are ~20x slower
                    for start, at, count in p.runs:
                        dst[start : start + count].copy_(blocks[at : at + count])

    def _release(self) -> None:
        """The step's loads are over: layers not waited for are placed, streams let go."""
        if self._pieces:
            for name, i in self.index.items():
                if i not in self._placed:
                    self.wait_for_layer(name)
            for p in self._pieces:
                if p.ok:
                    self.stats.blocks_loaded += len(p.block_ids)
                p.stream.cancel()
        self._pieces, self._placed = [], set()

    def preempted(self, req_ids: set[str]) -> None:
        """Requests preempted before this step: their blocks may be reused now. Loads live
        within one step and saves hold copies, so only loads still open are dropped."""
        for p in self._pieces:
            if p.req_id in req_ids and p.ok:
                p.ok = False
                p.stream.cancel()

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- saves ------------------------------------------------------------------------------------

    def save_layer(self, name: str, kv_layer: torch.Tensor, saves: list[SaveSpec]) -> None:
        i = self.index.get(name)
        if i is None or not saves:
            return
        if self._save_ids is None:  # the step's first layer
            self._saving = [s for s in saves if self._gatherable(s)]
            ids = [bid for s in self._saving for bid in s.block_ids]
            self._save_runs = block_runs(ids)
            self._save_ids = torch.tensor(ids, dtype=torch.long).to(kv_layer.device)
        if not self._saving:
            return
        k, v = self._kv_of(kv_layer)
        if kv_layer.device.type == "cuda":
            gk, gv = k[self._save_ids], v[self._save_ids]  # [blocks, B, H, D], copies
        else:  # on a CPU, slices joined: indexed copies of fp16 are ~20x slower
            gk = torch.cat([k[b : b + n] for b, _, n in self._save_runs])
            gv = torch.cat([v[b : b + n] for b, _, n in self._save_runs])
        if self._copies is not None:
            gk, gv = to_pinned_host((gk, gv), self._copies)
        self._gathered[i] = (gk, gv)

    def _gatherable(self, spec: SaveSpec) -> bool:
        """Whether the blocks of ``spec`` can be gathered (logged and counted when not)."""
        if not 0 <= self.rank < len(spec.keys_by_rank):
            why = f"no keys for TP rank {self.rank}"
        else:
            n, per = len(spec.keys_by_rank[self.rank]), self.shape.blocks_per_chunk
            why = self._bad_ids(spec.block_ids, n * per, spec.block_ids)
            if not why and (len(spec.block_ids) != n * per or spec.first_chunk < 0):
                why = (f"{len(spec.block_ids)} block ids for {n} chunks from chunk "
                       f"{spec.first_chunk}")
        if why:
            self._save_failed("kdn: save of request %s refused: %s", spec.req_id, why)
        return not why

    def _save_failed(self, msg: str, *args: object) -> None:
        log.warning(msg, *args)
        with self._lock:  # also counted on the saver thread
            self.stats.save_errors += 1

    def forget(self, keys_by_rank: list[list[bytes]]) -> None:
        """Delete this rank's chunks of ``keys_by_rank`` in every encoding, on the saver
        thread after the saves handed to it before (``KDNConnectorMetadata.forget``)."""
        if self.rank >= len(keys_by_rank) or not keys_by_rank[self.rank]:
            return
        doomed = [keys.variant_key(k, e) for k in keys_by_rank[self.rank]
                  for e in self.shape.encodings]
        with self._lock:
            self._saves.append(self._saver.submit(self._delete, doomed))

    def _delete(self, doomed: list[bytes]) -> None:
        try:
            self.client.delete(doomed, namespace=self.config.namespace)
            log.info("kdn: %d chunks that may hold KV computed over a failed load were "
                     "deleted", len(doomed))
        except Exception as exc:  # best effort, as saves
            self._save_failed("kdn: deleting %d chunks computed over a failed load failed: "
                              "%s", len(doomed), exc)

    def end_step(self, saves: list[SaveSpec] | None = None) -> None:
        """vLLM's ``wait_for_save``: the step's loads end, its saves go to the background."""
        self._release()
        gathered, self._gathered, self._save_ids = self._gathered, {}, None
        saving, self._saving = self._saving, []
        (requests, blocks), self._step_failed = self._step_failed, (set(), set())
        if not gathered or saves is None:
            return
        dropped = {s.req_id for s in saving if s.req_id in requests
                   or blocks & set(s.attended or s.block_ids)}
        if dropped:  # computed over blocks a failed load left unwritten: wrong KV. vLLM
            # recomputes them (and the scheduler's mend stores them then); so for a request
            # that attended over those blocks through vLLM's prefix cache: not stored, also
            # where it ends before a recompute (aborted)
            log.info("kdn: the loads of requests %s failed this step; their saves are not "
                     "stored", sorted(dropped))
        if len(gathered) != self.layout.num_layers:
            log.warning("kdn: %d of %d layers saved this step; chunks not stored",
                        len(gathered), self.layout.num_layers)
            return
        ready = None
        if self._copies is not None:
            ready = torch.cuda.Event()
            ready.record(self._copies)
        layers = [gathered[i] for i in range(self.layout.num_layers)]
        size = sum(k.nbytes + v.nbytes for k, v in layers)
        with self._lock:
            self._saves = [f for f in self._saves if not f.done()]
            if self._saves and (len(self._saves) >= SAVE_BACKLOG_STEPS or self._backlog
                                + size > self.config.save_backlog_bytes):
                self._shed_step(saving, size)
                return
            self._backlog += size
            self._saves.append(self._saver.submit(self._store, saving, layers, ready,
                                                  dropped, size))

    def _shed_step(self, saving: list[SaveSpec], size: int) -> None:
        """The step's saves dropped: the saver is behind (a slow server). Call with the lock."""
        self.stats.save_errors += 1
        self._shed += 1
        now = time.monotonic()
        if now - self._shed_warned >= SHED_WARN_S:
            log.warning("kdn: the saves of %d steps were dropped (the latest: requests %s, "
                        "%d bytes): the server is slow, %d steps (%d bytes) still wait for it "
                        "(at most %d steps and save_backlog_bytes %d)", self._shed,
                        sorted({s.req_id for s in saving}), size, len(self._saves),
                        self._backlog, SAVE_BACKLOG_STEPS, self.config.save_backlog_bytes)
            self._shed, self._shed_warned = 0, now

    def _store(self, saves: list[SaveSpec], layers: list[tuple[torch.Tensor, torch.Tensor]],
               ready: Any, dropped: set[str], size: int = 0) -> None:
        """The saver thread's work: nothing is raised (a failed save is a later miss)."""
        try:
            self._store_chunks(saves, layers, ready, dropped)
        except Exception as exc:
            self._save_failed("kdn: saving the chunks of requests %s failed: %s",
                              sorted({s.req_id for s in saves}), exc)
        finally:
            with self._lock:
                self._backlog -= size

    def _store_chunks(self, saves: list[SaveSpec], layers: list[tuple[torch.Tensor, torch.Tensor]],
                      ready: Any, dropped: set[str]) -> None:
        """The chunks of ``saves`` (their blocks gathered in ``layers``, in order), but
        those of requests ``dropped``."""
        if ready is not None:
            ready.synchronize()
        c, b = self.shape.chunk_tokens, self.shape.block_size
        per = c // b
        heads, d = self.layout.layers[0].kv_heads, self.layout.head_dim
        row = 0
        items: list[tuple[int, bytes, KVCache]] = []
        mend: set[int] = set()  # chunks stored even where kdn holds them
        approximate: set[int] = set()  # chunks computed over a lossy load: no exact encoding
        for s in saves:
            if s.req_id in dropped:
                row += len(s.block_ids)
                continue
            for j, base in enumerate(s.keys_by_rank[self.rank]):
                r = row + j * per
                kv = [(k[r : r + per].reshape(c, heads, d).transpose(0, 1),  # [H, C, D]
                       v[r : r + per].reshape(c, heads, d).transpose(0, 1)) for k, v in layers]
                items.append((s.first_chunk + j, base, KVCache(self.layout, kv,
                                                               start_position=(s.first_chunk
                                                                               + j) * c)))
                if s.mend:
                    mend.add(len(items) - 1)
                if not s.exact:
                    approximate.add(len(items) - 1)
            row += len(s.block_ids)
        ns = self.config.namespace
        for enc in self.shape.encodings:
            mode, _, level = enc.partition("-")
            first: dict[bytes, int] = {}  # a chunk two requests of one step save: stored once
            todo: list[tuple[bytes, KVCache]] = []
            fix: set[bytes] = set()
            for j, (_, base, entry) in enumerate(items):
                if j in approximate and mode in EXACT_MODES:
                    continue
                key = keys.variant_key(base, enc)
                if first.setdefault(key, j) == j:
                    todo.append((key, entry))
                if j in mend:
                    fix.add(key)
            try:
                present = self.client.lookup([k for k, _ in todo], namespace=ns).infos
                todo_new = [t for t, info in zip(todo, present) if not info.present or t[0] in fix]
                self.stats.chunks_skipped += len(todo) - len(todo_new)
                if todo_new:
                    self.client.store_many(todo_new, mode=mode, level=level, namespace=ns,
                                           options=self._options)
                    self.stats.chunks_saved += len(todo_new)
            except Exception as exc:  # best effort: a failed save is a later miss
                self._save_failed("kdn: saving %d chunks (%s) failed: %s", len(todo), enc, exc)

    def wait_saves(self, timeout: float | None = None) -> None:
        """Block until the saves handed off so far are stored (or failed)."""
        with self._lock:
            pending = list(self._saves)
        for f in pending:
            f.result(timeout)

    def close(self) -> None:
        self._release()
        self._saver.shutdown(wait=True)
        if self._own_client:
            self.client.close()
