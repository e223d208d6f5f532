"""kdn as SGLang's L3 KV storage: ``KDNHiCacheStorage``, a HiCache storage backend.

SGLang's hierarchical cache keeps KV in GPU memory (L1), a host-memory pool (L2) and a
pluggable storage backend (L3). The backend is a key -> page store: SGLang names each page of
``page_size`` tokens by a hash chained over the pages before it, and moves pages between its
host pool and the backend. Load this backend with

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kdn", "module_path": "kdn.integrations.sglang",
          "class_name": "KDNHiCacheStorage", "interface_v1": 1,
          "kdn": {"address": "127.0.0.1:50051"}}'

(``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1``/``batch_set_v1``; the
``"kdn"`` object is ``KDNBackendConfig``, ``kdn.integrations.sglang_config``.)

Lifecycle, as SGLang drives it:

1. ``StorageBackendFactory`` constructs the class with the ``HiCacheStorageConfig`` (model
   name, TP/PP rank, MLA flag, the extra-config), then calls ``register_mem_pool_host(pool)``
   with the host KV pool: from then on the page shape (layers, heads, head dim, dtype, page
   size) is known, and with it the kdn layout and the keys.
2. Prefetch (a background thread): ``batch_exists(keys)`` gives how many leading pages are
   stored, then ``batch_get_v1(keys, host_indices)`` reads them into the host pool at those
   token slots (``batch_get``/``get`` in SGLang's older, copying path).
3. Backup (another thread): ``batch_set_v1(keys, host_indices)`` writes pages of the host pool.
4. ``get_stats()`` (when SGLang's storage metrics are on), ``clear()``, ``close()``.

No call raises into SGLang: a failed one is counted and logged, a WARNING for the first of its
kind then one a minute (``kdn.ratelog.Outage``: a server down fails every batch), and one INFO
line when the server answers a lookup again.

Design: one kdn entry per page. SGLang asks about, reads and writes pages one key at a time
and in any grouping (a later request may share only the first pages of an earlier batch, and
eviction on either side drops single pages), so an entry holding a group of pages would need a
second index from page key to group and partial reads of groups. Per-page entries keep kdn's
own semantics (one key, one whole checked entry, a miss is a miss) and the per-call cost is
paid per batch instead: a batch of pages is one ``lookup`` (existence), one ``fetch_many``
(GetMany) per worker chunk, or one ``store_many`` (PutMany) per chunk, through the client's
shared segment when the server is on the same host; chunks run on ``workers`` threads, so
decoding one chunk overlaps the server copying the next.

Pages and their codec (``kdn.integrations.sglang_pages.HostPages``, built by
``register_mem_pool_host``): a page is stored as a kdn ``KVCache`` of ``page_size`` tokens (K
and V ``[heads, tokens, head_dim]`` per layer), encoded with the configured codec mode
(``raw`` by default: the page's own bytes, bit-exact, read back with no decode; ``lossless`` is
bit-exact too and a little smaller, but its host zstd decode made a first read ~11× slower than
``raw``'s in ``bench.sglang``; ``int8`` ≈ 0.52× the bytes of fp16; ``kdn`` levels smaller still).
The stored bytes do not depend on the host pool's memory layout (``layer_first``, ``page_first``,
``page_first_direct`` are all read and written), so engines with different layouts share pages.
Keys are ``kdn.keys.page_key`` over SGLang's page hash, the layout (model, layer count, heads,
head dim, dtype), the page size, the TP and PP shard, and the configured adapter id and salt,
made per codec encoding by ``kdn.keys.variant_key`` (``lossless``: the page key itself).

Supported: MHA host pools (``MHATokenToKVPoolHost``: one ``kv_buffer`` holding K and V) of
float16, bfloat16 or float32. MLA pools keep one latent vector per token (no K/V pair) and
index pages through the DCP shard mapping: they are refused at construction, as are the v2
calls' extra pools (Mamba, SWA, indexer: reported as absent, so SGLang falls back to its own
computation for them).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kdn import keys
from kdn.client.admin import AdminClient
from kdn.delivery import encoding_name
from kdn.errors import KDNError
from kdn.integrations.sglang_config import KDNBackendConfig
from kdn.integrations.sglang_pages import LAYOUTS, HostPages
from kdn.layout import KVLayout
from kdn.options import StoreOptions
from kdn.ratelog import Outage

__all__ = ["LAYOUTS", "MIN_CHUNK_PAGES", "KDNBackendConfig", "KDNHiCacheStorage", "KDNStats"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIN_CHUNK_PAGES = 8
"""A batch is split into at most ``workers`` chunks of at least this many pages."""
MAX_UNREADABLE = 4096
"""Keys of stored pages that did not read back, remembered so that a write replaces them (the
oldest are forgotten first)."""


@dataclass
class KDNStats:
    """Counters since the backend started."""

    hits: int = 0
    """Pages asked for by a read (get, batch_get, batch_get_v1/v2) and delivered."""
    misses: int = 0
    """Pages asked for by a read and not stored (or not readable)."""
    bytes_read: int = 0
    """Page bytes delivered into the host pool or target tensors."""
    bytes_written: int = 0
    """Page bytes of the pages stored."""
    stored_bytes: int = 0
    """Encoded bytes of those pages as kdn holds them (``bytes_written`` x the codec's ratio)."""
    pages_written: int = 0
    pages_skipped: int = 0
    """Pages a write found already stored (not encoded or sent again)."""
    errors: int = 0
    """Calls that failed (server unreachable, a page that did not decode...)."""


@dataclass
class _Window:
    """What SGLang's storage metrics want since its last ``get_stats``."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class KDNHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over a kdn server (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None, *,
                 client: AdminClient | None = None) -> None:
        if storage_config.is_mla_model:
            raise NotImplementedError(
                "kdn's HiCache backend stores MHA pages; MLA host pools are not supported")
        if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
            raise NotImplementedError(
                "kdn's HiCache backend does not support context-parallel page shards")
        self.storage_config = storage_config
        self.config = KDNBackendConfig.from_extra(storage_config.extra_config)
        self.model_name = storage_config.model_name or ""
        self.tp = (storage_config.tp_rank, storage_config.tp_size)
        self.pp = (storage_config.pp_rank, storage_config.pp_size)
        cfg = self.config
        self.client: AdminClient = client or AdminClient(
            cfg.address, timeout_s=cfg.timeout_s, namespace=cfg.namespace,
            api_key=cfg.api_key or os.environ.get("KDN_API_KEY") or None, tls=cfg.tls(),
            shm_bytes=cfg.shm_bytes, local_bytes=cfg.local_bytes,
            insecure=cfg.insecure or None)
        self._own_client = client is None
        self.options = StoreOptions(ttl_s=cfg.ttl_s)
        self.layout: KVLayout | None = None
        self.page_size = 0
        self._pages: HostPages | None = None
        self._workers = ThreadPoolExecutor(cfg.workers, thread_name_prefix="kdn-hicache")
        self._lock = threading.Lock()
        self._stats = KDNStats()
        self._window = _Window()
        self._unreadable: dict[bytes, None] = {}  # kdn keys, oldest first (MAX_UNREADABLE)
        self._outage = Outage(logger, "kdn: the server answers again")  # failures throttled

    # -- the host pool ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host KV pool: its page shape fixes the kdn layout and the keys."""
        cfg = self.config
        pages = HostPages(mem_pool_host, model_name=self.model_name, weights_id=cfg.weights_id,
                          mode=cfg.mode, level=cfg.level,
                          scope=keys.scope_tag(cfg.adapter, cfg.salt))
        self.layout = pages.layout
        self.page_size = pages.page_size
        self._pages = pages
        self.mem_pool_host = mem_pool_host

    def _need_pages(self) -> HostPages:
        if self._pages is None:
            raise RuntimeError("register_mem_pool_host() first: the page shape is not known")
        return self._pages

    def _layout(self) -> KVLayout:
        return self._need_pages().layout

    # -- keys -----------------------------------------------------------------------------------

    def kdn_key(self, key: str) -> bytes:
        """The kdn key of SGLang's page ``key`` for this model, shard, page size and codec.
        The encoding is keyed as kdn's engine keys it (``keys.variant_key``: ``lossless``
        pages keep the plain page key), so an engine never reads another's lossy pages as its
        own exact ones, nor skips storing its own because a lossy copy is there."""
        cfg = self.config
        page = keys.page_key(key, self._layout(), cfg.namespace, page_tokens=self.page_size,
                             adapter=cfg.adapter, tp=self.tp, pp=self.pp, salt=cfg.salt)
        return keys.variant_key(page, encoding_name(cfg.mode, cfg.level))

    def kdn_keys(self, keys_: Sequence[str]) -> list[bytes]:
        return [self.kdn_key(k) for k in keys_]

    def _kdn_prefix(self, keys_: Sequence[str]) -> list[bytes]:
        """The kdn keys of ``keys_`` up to the first one ``page_key`` refuses (not str or
        bytes, not UTF-8, empty): that one is logged and counted as an error, and it and the
        keys after it are misses."""
        out = []
        for k in keys_:
            try:
                out.append(self.kdn_key(k))
            except KDNError as err:
                logger.warning("kdn: page key %.80r refused: %s", k, err)
                self._count(errors=1)
                break
        return out

    # -- pages <-> entries ----------------------------------------------------------------------

    def _chunks(self, n: int) -> list[range]:
        """Spans of a batch of ``n`` pages, one per worker call."""
        k = max(1, min(self.config.workers, n // MIN_CHUNK_PAGES))
        step = math.ceil(n / k) if n else 1
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    def _concurrently(self, fn: Callable[[range], T], n: int) -> list[T]:
        spans = self._chunks(n)
        if len(spans) <= 1:
            return [fn(s) for s in spans]
        return list(self._workers.map(fn, spans))

    def _read(self, keys_: Sequence[str], pages: Callable[[int], torch.Tensor]) -> list[bool]:
        """Read pages ``keys_`` into the page views ``pages(j)``; per page: found and placed."""
        if not keys_:
            return []
        start = time.perf_counter()
        try:
            kdn = self.kdn_keys(keys_)
        except Exception:
            logger.exception("kdn: reading %d pages failed", len(keys_))
            self._count(errors=1, misses=len(keys_))
            return [False] * len(keys_)

        def chunk(span: range) -> list[bool]:
            # no layout asked of the server: it would fail the whole call for one entry of
            # another shape; place() checks each page's tokens and layout on its own
            try:
                got = self.client.fetch_many([kdn[j] for j in span])
            except KDNError as err:
                self._outage.failed("kdn: fetching %d pages failed: %s", len(span), err,
                                    kind=("fetch", type(err).__name__))
                self._count(errors=1)
                return [False] * len(span)
            out = []
            for j, g in zip(span, got):
                ok = False
                if g is not None:
                    try:
                        self._need_pages().place(g, pages(j))
                        ok = True
                    except Exception as err:  # a damaged entry, a wrong target: this page
                        logger.warning("kdn: page %s not usable: %s", keys_[j], err)
                        self._count(errors=1)
                        if isinstance(err, KDNError):  # the entry's fault, not the target's
                            self._unreadable_mark(kdn[j], True)
                    if ok:
                        self._unreadable_mark(kdn[j], False)
                out.append(ok)
            return out

        done = [ok for part in self._concurrently(chunk, len(keys_)) for ok in part]
        hits = sum(done)
        nbytes = hits * self.page_bytes
        self._count(hits=hits, misses=len(done) - hits, bytes_read=nbytes)
        self._record("prefetch", len(keys_), nbytes, time.perf_counter() - start)
        return done

    def _write(self, keys_: Sequence[str], pages: Callable[[int], torch.Tensor]) -> list[bool]:
        """Store pages ``keys_`` from the page views ``pages(j)`` (those already stored are not
        sent again, a page named twice is sent once); per page: stored."""
        if not keys_:
            return []
        start = time.perf_counter()
        try:
            kdn = self.kdn_keys(keys_)
            present = [i.present and not self._is_unreadable(k)
                       for k, i in zip(kdn, self.client.lookup(kdn).infos)]
        except Exception as err:  # a KDNError (server down...) is routine: no traceback
            self._outage.failed("kdn: storing %d pages failed: %s", len(keys_), err,
                                kind=("store", type(err).__name__),
                                exc_info=not isinstance(err, KDNError))
            self._count(errors=1)
            return [False] * len(keys_)
        first: dict[bytes, int] = {}  # a page named twice in one batch is stored once
        todo = [j for j, p in enumerate(present)
                if not p and first.setdefault(kdn[j], j) == j]

        def chunk(span: range) -> list[tuple[int, bool]]:
            idx = [todo[t] for t in span]
            try:
                enc = [self._need_pages().encode(pages(j)) for j in idx]
                self.client.store_many([(kdn[j], e) for j, e in zip(idx, enc)],
                                       options=self.options)
            except Exception as err:  # encode or store: no page of this chunk is stored
                self._outage.failed("kdn: storing %d pages failed: %s", len(idx), err,
                                    kind=("store", type(err).__name__))
                self._count(errors=1)
                return [(j, False) for j in idx]
            self._count(stored_bytes=sum(e.nbytes for e in enc))
            for j in idx:
                self._unreadable_mark(kdn[j], False)
            return [(j, True) for j in idx]

        done = list(present)
        for part in self._concurrently(chunk, len(todo)):
            for j, ok in part:
                done[j] = ok
        for j, k in enumerate(kdn):
            if not present[j]:
                done[j] = done[first[k]]
        stored = sum(1 for j in todo if done[j])
        nbytes = stored * self.page_bytes
        self._count(pages_written=stored, pages_skipped=len(keys_) - len(todo),
                    bytes_written=nbytes)
        self._record("backup", len(keys_), nbytes, time.perf_counter() - start)
        return done

    def _unreadable_mark(self, key: bytes, bad: bool) -> None:
        """Remember (``bad``) or forget that the page stored under kdn ``key`` did not read
        back (another shape, damaged): such a page counts as absent to ``batch_exists`` and
        to a write, which stores it again instead of skipping a key that is there."""
        with self._lock:
            if not bad:
                self._unreadable.pop(key, None)
                return
            self._unreadable[key] = None
            if len(self._unreadable) > MAX_UNREADABLE:
                del self._unreadable[next(iter(self._unreadable))]

    def _is_unreadable(self, key: bytes) -> bool:
        with self._lock:
            return key in self._unreadable

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in the host pool (K and V, every layer)."""
        return self._need_pages().page_bytes

    def _host_pages(self, n: int, host_indices: torch.Tensor) -> list[int | None] | None:
        """First token slot of each of ``n`` pages in ``host_indices`` (None when its size is
        not ``n`` pages); a page whose slots are not ``page_size`` consecutive ones from a
        multiple of ``page_size`` within the host pool is None (logged)."""
        p = self.page_size
        if host_indices is None or host_indices.numel() != n * p:
            logger.error("kdn: %s host indices for %d pages of %d tokens",
                         None if host_indices is None else host_indices.numel(), n, p)
            return None
        idx = host_indices.reshape(n, p).to("cpu", torch.int64)  # [pages, P]
        first = idx[:, 0]
        ok = (idx == first[:, None] + torch.arange(p)).all(1) & (first % p == 0) & \
            (first >= 0) & (first + p <= self._need_pages().slots)
        bad = (~ok).nonzero().flatten().tolist()
        if bad:
            logger.error("kdn: %d of %d pages' host indices are not %d consecutive slots from "
                         "a page boundary within the host pool of %d slots (page %d: %s)",
                         len(bad), n, p, self._need_pages().slots, bad[0],
                         idx[bad[0]].tolist())
            self._count(errors=1)
        return [int(f) if good else None for f, good in zip(first.tolist(), ok.tolist())]

    def _pool_io(self, keys_: list[str], starts: list[int | None],
                 io: Callable[[Sequence[str], Callable[[int], torch.Tensor]], list[bool]]
                 ) -> list[bool]:
        """``io`` (``_read`` or ``_write``) over the pages at ``starts`` in the host pool;
        False for a page without a valid start (``_host_pages``)."""
        pages = self._need_pages()
        good = [(j, s) for j, s in enumerate(starts) if s is not None]
        got = io([keys_[j] for j, _ in good], lambda t: pages.pool_page(good[t][1]))
        out = [False] * len(keys_)
        for (j, _), ok in zip(good, got):
            out[j] = ok
        return out

    # -- the zero-copy interface (v1) -----------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages ``keys`` into the host pool at ``host_indices`` (page j at slots
        ``host_indices[j * page_size:(j + 1) * page_size]``); per page: found and read."""
        pages = self._pages
        if pages is None:
            logger.error("kdn: batch_get_v1 before register_mem_pool_host")
            return [False] * len(keys)
        starts = self._host_pages(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)
        return self._pool_io(keys, starts, self._read)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; per page: stored."""
        pages = self._pages
        if pages is None:
            logger.error("kdn: batch_set_v1 before register_mem_pool_host")
            return [False] * len(keys)
        starts = self._host_pages(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)
        return self._pool_io(keys, starts, self._write)

    # -- the pool-transfer interface (v2): the KV pool ------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        """Longest stored prefix of KV pages. Extra pools (Mamba, SWA, ...) are not stored
        here: a request that needs one gets no usable prefix."""
        kv = self.batch_exists(keys)
        needs_other = any(t.name != PoolName.KV for t in pool_transfers or [])
        restorable = [] if needs_other else list(range(1, kv + 1))
        return PoolTransferResult(restorable[-1] if restorable else 0,
                                  {PoolName.KV: kv} if kv else {}, restorable)

    def _transfers(self, transfers: list[PoolTransfer], io: Callable[..., list[bool]]
                   ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            ks = list(t.keys or [])
            if t.name != PoolName.KV:
                out[t.name] = [False] * len(ks)
                continue
            out[t.name] = io(ks, t.host_indices)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """``batch_get_v1`` for the KV pool's transfer; other pools read nothing."""
        return self._transfers(transfers, self.batch_get_v1)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """``batch_set_v1`` for the KV pool's transfer; other pools store nothing."""
        return self._transfers(transfers, self.batch_set_v1)

    # -- the copying interface (flat page tensors in the pool's order) --------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """Page ``key`` as a flat tensor in the host pool's page order, written into
        ``target_location`` when given; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        pages = self._pages
        if pages is None:
            logger.error("kdn: batch_get before register_mem_pool_host")
            return [None] * len(keys)
        targets = list(target_locations or [None] * len(keys))
        if len(targets) != len(keys):
            logger.error("kdn: batch_get of %d keys with %d target locations", len(keys),
                         len(targets))
            return [None] * len(keys)
        flats = [t if t is not None else pages.new_flat_page() for t in targets]
        done = self._read(keys, lambda j: pages.flat_page(flats[j]))
        return [f if ok else None for f, ok in zip(flats, done)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store the flat page tensor ``value`` (the host pool's page order) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        host = self._pages
        if host is None or values is None or len(values) != len(keys):
            logger.error("kdn: batch_set needs a registered host pool and one value per key")
            return False
        try:
            pages = [host.flat_page(v.reshape(-1)) for v in values]
        except ValueError as err:
            logger.error("kdn: batch_set: %s", err)
            return False
        return all(self._write(keys, lambda j: pages[j]))

    # -- existence ------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> int:
        """How many leading pages of ``keys`` are stored (one Lookup); a page that did not
        read back, or a key that is refused, ends the prefix. Never raises into SGLang."""
        if not keys or self._pages is None:
            return 0
        try:
            kdn = self._kdn_prefix(keys)
            if not kdn:
                return 0
            hits = self.client.lookup(kdn, prefix_chain=True).prefix_hits
            self._outage.answered()
            return next((j for j in range(hits) if self._is_unreadable(kdn[j])), hits)
        except Exception as err:  # raised into SGLang, it would end the prefetch thread
            self._outage.failed("kdn: lookup of %d pages failed: %s", len(keys), err,
                                kind=("lookup", type(err).__name__),
                                exc_info=not isinstance(err, KDNError))
            self._count(errors=1)
            return 0

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> bool:
        """Delete every page of this model, adapter and salt in the namespace (all shards, like
        HiCacheFile's clear of its whole folder): engines with another adapter or salt keep
        theirs, told apart by the scope in the stored model name (``HostPages``). The pages
        the client's in-process tier holds go too, also those the server evicted already."""
        if self.layout is None:
            return True
        layout = self.layout
        if self.client.local is not None:
            self.client.local.discard_where(
                self.config.namespace, lambda h: h.layout.model_fingerprint
                == layout.model_fingerprint and h.layout.model_name == layout.model_name)
        try:
            found = [e.key for e in self.client.ls(
                namespace=self.config.namespace, model=self.layout.model_fingerprint)
                if e.model_name == self.layout.model_name]
            for i in range(0, len(found), 1024):
                self.client.delete(found[i : i + 1024])
            return True
        except KDNError as err:
            logger.error("kdn: clear failed: %s", err)
            return False

    def stats(self) -> KDNStats:
        """A copy of the counters."""
        with self._lock:
            return KDNStats(**asdict(self._stats))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last ``get_stats`` (pages and
        GB/s per batch), carrying the counters of ``stats()`` as attributes (``hits``,
        ``misses``, ``bytes_read``...); ``stats()`` itself where SGLang's metrics module can
        not be imported."""
        with self._lock:
            window, self._window = self._window, _Window()
        snap = self.stats()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return snap
        m = StorageMetrics()
        m.prefetch_pgs.extend(window.prefetch_pgs)
        m.backup_pgs.extend(window.backup_pgs)
        m.prefetch_bandwidth.extend(window.prefetch_bandwidth)
        m.backup_bandwidth.extend(window.backup_bandwidth)
        for name, value in asdict(snap).items():
            setattr(m, name, value)
        return m

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        if self._own_client:
            self.client.close()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One batch of ``kind`` (prefetch or backup) for SGLang's storage metrics."""
        if not self.storage_config.enable_storage_metrics:
            return
        with self._lock:
            getattr(self._window, f"{kind}_pgs").append(pages)
            getattr(self._window, f"{kind}_bandwidth").append(nbytes / max(seconds, 1e-9) / 1e9)
