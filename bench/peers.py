"""kdn next to its peers: LMCache's standalone server and Mooncake Store, same workloads, one run.

    python -m bench.peers [--quick] [--out bench/results/peers.json]
        [--peer-lib-path DIR[:DIR...]]             # libibverbs & co. for Mooncake (see below)
        [--kdn-client-opts "shm_bytes=0"] [--kdn-client-opts ""]   # one kdn column per flag
        [--kdn-server-args ""] [--kdn-server-args "--prefault-bytes 0"]  # one kdn server each
        [--fill-gib 1.5]                           # 0: the old best case (reused memory)
        [--systems lmcache,mooncake,kdn]

Not part of CI and not imported by tests: a program a person runs on one machine. Every system
runs on 127.0.0.1 with RAM only, as its own server process(es) next to this driving process,
which holds each system's client; the systems take turns within each run (the order rotates per
run) so that all of them see the same machine. Workloads (Llama-3-8B-shaped fp16 KV, random:
32 layers x 8 KV heads x 128 channels, 128 KiB per token):

- put / get of one entry at 1, 16 and 256 MiB (``count`` distinct keys per run, one call each;
  GB/s = bytes / summed call time, checks and releases between calls untimed);
- 64 x 1 MiB batch put / batch get (each system's batch call where it has one, else a loop),
  ``BATCH_CALLS`` (3) puts, each read back, per run (GB/s = their bytes / their summed time:
  one ~20 ms call alone says more about the machine's moment than about the system);
- 4 KiB get latency (one layer, one token) of 500 distinct keys, stored first, then each read
  once in a random order.

As a cache that fills sees them: every put (of every route, run and workload) goes to a key
no put used before, and what a system stored is kept until the next run would take it past
``--fill-gib`` (default ``FILL_GIB``: a quarter of kdn's RAM tier), only then deleted
(untimed); so puts land in memory no entry used before, as in a cache filling up. LMCache's
server has no delete: it keeps everything. ``--fill-gib 0`` is the old best case (every
route's entries deleted after its run: later puts land in memory earlier ones freed).

Each row is the best of 3 runs (``gb_s``) with the median (``median_gb_s``) and every run's
figure (``runs``); ``p50_ms``/``p99_ms`` are per-call latencies over all runs. ``memcpy`` rows
(one single-threaded copy of the same bytes, ``np.copyto``) are the machine's limit for one
copy.

How each system is driven:

- **LMCache 0.5.6**: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` and its remote
  connector (``LMCServerConnector``, the ``lm://`` backend) with its own ``LocalCPUBackend``
  allocating the received objects. Its put only sends, so a put run ends with one ``exists``
  round trip (the server handles a connection's commands in order). It has no batch call
  (``support_batched_put/get`` are False): batches are a loop, as its storage manager does.
- **Mooncake Store 0.3.13** (TCP): ``mooncake_master`` + a storage process
  (``mooncake_client``, 3 GB segment) and ``MooncakeDistributedStore`` here with no segment of
  its own, so bytes cross to the storage process. Two APIs: ``put``/``get`` (bytes) and
  ``put_from``/``get_into`` with registered buffers; batches ``put_batch``/``get_batch`` and
  ``batch_put_from``/``batch_get_into``. Its transfer listeners bind every interface on random
  ports (not configurable); every peer address used here is 127.0.0.1.
- **kdn**: ``python -m kdn serve`` (RAM tier only; one server per ``--kdn-server-args``) and
  ``kdn.client.Client``: ``store(KVCache)`` / ``store_many(KVCache)`` (the documented API:
  a user's tensors, encoded ``raw`` by the call) beside ``encode_parts+store`` /
  ``encode_parts+store_many`` (encode, then store the parts: what ``store(KVCache)`` did
  before it wrote into the segment), and with pre-encoded
  ``raw`` parts: ``store``, ``fetch`` (undecoded container; through the shared segment these
  are views of the segment, not yet copied into the caller's memory, unlike the peers' gets)
  and ``retrieve`` (decoded into tensors, the like of LMCache's get and Mooncake's get_into);
  batches through ``store_many``/``fetch_many`` when the client has them, else a loop of single
  calls; and ``store (staged)`` / ``store_many (staged)`` (``Client.stage``: entries filled in
  place in the shared segment once, as Mooncake's registered buffers are, stored by where they
  lie, the server making their checksums on its copy; one staged entry per key up to 128 MiB of
  them, beyond that reused); and ``store_async`` (sent without waiting for the answer, as
  LMCache's put is; a run ends with ``flush``, as LMCache's with its ``exists``), of encoded
  and of staged entries, single and as a loop for the batch. ``--kdn-client-opts``
  (repeatable, ``k=v,k=v``) are ``Client`` keyword arguments, one kdn column per flag (e.g.
  ``shm_bytes=0`` for a remote client: the network data path, or with ``data_path=false`` the
  gRPC stream only; ``""`` for defaults).

Installing the peers (a scratch venv, never the project's .venv; commands used on this machine,
Python 3.11, CPU torch 2.13):

    python3.11 -m venv /work/peers-venv && P=/work/peers-venv/bin/pip
    $P install torch==2.13.0 && $P install -e '.[bench]'    # kdn, its model extra (LMCache
        # imports transformers; kdn reads range-coded entries with constriction), CPU torch
    $P install --no-deps lmcache==0.5.6 mooncake-transfer-engine-non-cuda==0.3.13
    $P install --no-deps cachetools numba llvmlite py-cpuinfo aiohttp aiohappyeyeballs \\
        aiosignal attrs frozenlist multidict propcache yarl msgspec pyzmq blake3 aiofile \\
        aiofiles caio nvtx sortedcontainers requests urllib3 idna charset-normalizer certifi \\
        psutil cryptography cffi pycparser
    $P install --no-deps nvidia-cuda-runtime-cu12   # Mooncake's store.so links libcudart.so.12
    L=/work/peers-libs && mkdir -p $L && cd $L && apt-get update && \\
        apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 && \\
        for f in *.deb; do dpkg -x "$f" root; done       # libibverbs, needed even for TCP
    cd /work/main && /work/peers-venv/bin/python -m bench.peers \\
        --peer-lib-path $L/root/usr/lib/x86_64-linux-gnu:$L/root/lib/x86_64-linux-gnu \\
        --kdn-client-opts shm_bytes=0 --kdn-client-opts ""

``--peer-lib-path`` (and the libcudart folder of nvidia-cuda-runtime-cu12, found by itself)
go onto ``LD_LIBRARY_PATH`` by re-executing this program once. ``LMCACHE_TRACK_USAGE=false``
is set here (LMCache reports usage by default). Run from the repository root, never from
inside LMCache's package folder (its ``logging.py`` shadows the standard library's). A system
that is not installed or does not start is skipped with a line saying why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    HOST,
    arg_parser,
    figure,
    free_port,
    median,
    percentile,
    port_open,
    print_table,
    process,
    save_figure,
    timed,
    wait_until,
    write_json,
)
from bench.common import (
    kdn_server as common_kdn_server,
)
from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec.format import EncodedParts, build_header, parse_header
from kdn.layout import KVLayout, LayerLayout

MIB = 1 << 20
BATCH_CALLS = 3
"""Batch calls (put, then gets) per route and run (``batch_run``)."""
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
HIDDEN = KV_HEADS * HEAD_DIM
TOKEN_BYTES = 2 * LAYERS * HIDDEN * 2  # K and V of every layer, fp16: 128 KiB
STAGED_BYTES = 128 * MIB
"""Bytes of staged entries kdn fills per size (one per entry up to this; beyond, entry i
stores staged entry i modulo their number)."""
LAYER_TOKEN_BYTES = 2 * HIDDEN * 2  # K and V of one layer and token: 4 KiB
MODEL = "llama-3-8b-shape"
KDN_RAM_GIB = 6
"""kdn's RAM tier in this benchmark."""
FILL_GIB = 1.5
"""GiB each system keeps before its entries are deleted, by default: a quarter of kdn's RAM
tier (half of Mooncake's segment); puts up to there land in memory no entry used before."""


def payload(size: int, seed: int = 0) -> torch.Tensor:
    """Random fp16 KV of ``size`` bytes in LMCache's KV_2LTD order; whole tokens of all 32 layers
    from 128 KiB up, else tokens of one layer."""
    layers = LAYERS if size >= TOKEN_BYTES else 1
    tokens = size // (TOKEN_BYTES if layers == LAYERS else LAYER_TOKEN_BYTES)
    assert tokens * 2 * layers * HIDDEN * 2 == size, size
    g = torch.Generator().manual_seed(seed)
    # kv: [2 (K, V), layers, tokens, kv_heads * head_dim]
    return torch.randn(2, layers, tokens, HIDDEN, generator=g).half()


# -- what every system offers -------------------------------------------------------------------


@dataclass
class Route:
    """One way to put entries and read them back. Single routes: ``put(i)`` stores entry i and
    each of ``gets`` reads entry i; batch routes: ``put(base, n)`` stores entries base..base+n-1
    in one batch and each get ``(base, n)`` returns all n. ``flush`` waits until every put
    landed, ``check(i, got)`` says whether a result holds entry i's payload (batch routes:
    ``check(base, gots)``), ``release`` frees it, ``clear`` drops what the system stored."""

    put_api: str
    put: Callable[..., object]
    gets: dict[str, Callable[..., Any]]
    check: Callable[[int, Any], bool]
    release: Callable[[Any], None] = lambda got: None
    flush: Callable[[], None] = lambda: None
    clear: Callable[[], None] = lambda: None


class System:
    """A store under test: ``load`` readies ``count`` entries of one payload (entry ``i`` of
    any ``i`` below ``slots`` under a key of its own, its payload entry ``i % count``'s),
    ``routes`` and ``batch_routes`` are the routes that move them, ``close`` stops what it
    started. ``kept``: bytes stored since the last ``clear`` (a filling run clears only past
    ``fill_bytes``); ``next_index``: the first entry no put used yet."""

    name = ""
    kept = 0
    next_index = 0
    workload = 0
    """Which of the run's workloads is loaded (part of every key: no workload reads
    another's entries)."""

    def load(self, kv: torch.Tensor, count: int, slots: int) -> None:
        raise NotImplementedError

    def routes(self) -> list[Route]:
        raise NotImplementedError

    def batch_routes(self) -> list[Route]:
        return []

    def unload(self) -> None:
        """Drop what ``load`` prepared."""

    def close(self) -> None:
        """Stop servers and clients."""


# -- LMCache ------------------------------------------------------------------------------------


def lmcache_server(stack: ExitStack, tmp: Path) -> int:
    """Start ``python -m lmcache.v1.server`` (its RAM backend); its port once it accepts."""
    import lmcache.v1.server  # noqa: F401  (installed? else this system is skipped)

    port = free_port()
    srv = stack.enter_context(process(
        [sys.executable, "-m", "lmcache.v1.server", HOST, str(port), "cpu"],
        tmp / "lmcache-server.log"))
    wait_until(lambda: port_open(port), "lmcache server", srv)
    return port


class LMCache(System):
    """LMCache's remote connector (``lm://``) to its standalone server, as shipped: neither
    side sets TCP_NODELAY."""

    name = "lmcache"

    def __init__(self, port: int) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self._key, self._fmt = CacheEngineKey, MemoryFormat.KV_2LTD
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False,
                                                max_local_cpu_size=2.0)
        md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.float16,
                             kv_shape=(LAYERS, 2, 256, KV_HEADS, HEAD_DIM))
        self.backend = LocalCPUBackend(cfg, md)
        self.loop = asyncio.new_event_loop()
        self.conn = LMCServerConnector(HOST, port, self.loop, self.backend)
        self.objs: list[Any] = []

    def load(self, kv: torch.Tensor, count: int, slots: int) -> None:
        self.kv, self.count = kv, count
        obj = self.backend.allocate(kv.shape, kv.dtype, self._fmt)
        obj.tensor.copy_(kv)
        self.objs = [obj]
        base = self.workload * 10**12 + kv.numel() * 100_000
        self.keys = [self._key(MODEL, 1, 0, base + i, torch.float16) for i in range(slots)]

    def unload(self) -> None:
        for o in self.objs:
            o.ref_count_down()
        self.objs = []

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _put(self, i: int) -> None:
        self._run(self.conn.put(self.keys[i], self.objs[0]))

    def _get(self, i: int) -> Any:
        got = self._run(self.conn.get(self.keys[i]))
        if got is None:
            raise RuntimeError(f"lmcache: miss on {self.keys[i].to_string()}")
        return got

    def _flush(self) -> None:
        if not self._run(self.conn.exists(self.keys[self.next_index - 1])):
            raise RuntimeError("lmcache: last put not stored")

    def _clear(self) -> None:
        pass  # its server offers no delete: entries stay (its memory is not bounded either)

    def _putn(self, base: int, n: int) -> None:
        if self.conn.support_batched_put():
            self._run(self.conn.batched_put(self.keys[base:base + n], self.objs * n))
        else:
            for i in range(base, base + n):
                self._put(i)

    def _getn(self, base: int, n: int) -> list[Any]:
        if self.conn.support_batched_get():
            return list(self._run(self.conn.batched_get(self.keys[base:base + n])))
        return [self._get(i) for i in range(base, base + n)]

    def _check(self, i: int, got: Any) -> bool:
        return bool(torch.equal(got.tensor, self.kv))

    @staticmethod
    def _release(got: Any) -> None:
        got.ref_count_down()

    def _release_all(self, gots: list[Any]) -> None:
        for g in gots:
            self._release(g)

    def routes(self) -> list[Route]:
        return [Route("connector put", self._put, {"connector get": self._get}, self._check,
                      self._release, self._flush)]

    def batch_routes(self) -> list[Route]:
        batched = self.conn.support_batched_put() and self.conn.support_batched_get()
        return [Route("batched_put" if batched else "connector put (loop)", self._putn,
                      {"batched_get" if batched else "connector get (loop)": self._getn},
                      lambda n, gots: all(self._check(i, g) for i, g in enumerate(gots)),
                      self._release_all,
                      self._flush)]

    def close(self) -> None:
        self.unload()
        self._run(self.conn.close())
        self.loop.close()


# -- Mooncake Store -----------------------------------------------------------------------------


class Mooncake(System):
    name = "mooncake"

    def __init__(self, stack: ExitStack, tmp: Path) -> None:
        from mooncake.store import MooncakeDistributedStore

        spec = importlib.util.find_spec("mooncake")
        assert spec is not None and spec.submodule_search_locations
        bins = Path(list(spec.submodule_search_locations)[0])
        rpc = free_port()
        master = stack.enter_context(process(
            [str(bins / "mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={rpc}",
             "--enable_http_metadata_server=false", f"--metrics_host={HOST}",
             f"--metrics_port={free_port()}"], tmp / "mooncake-master.log"))
        wait_until(lambda: port_open(rpc), "mooncake_master", master)
        storage = stack.enter_context(process(
            [str(bins / "mooncake_client"), f"--host={HOST}", f"--port={free_port()}",
             "--global_segment_size=3 GB", "--metadata_server=P2PHANDSHAKE",
             f"--master_server_address={HOST}:{rpc}", "--protocol=tcp"],
            tmp / "mooncake-storage.log"))
        self.store = MooncakeDistributedStore()
        rc = self.store.setup({"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE",
                               "global_segment_size": 0, "local_buffer_size": 1 << 30,
                               "protocol": "tcp", "master_server_addr": f"{HOST}:{rpc}"})
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        stack.callback(self.store.close)
        probe = np.zeros(64, np.uint8)
        # ready once the storage process has mounted its segment: a put finds room
        wait_until(lambda: self.store.put("kdn-bench-probe", probe) == 0,
                   "mooncake storage process", storage)
        self.store.remove("kdn-bench-probe", True)
        self.registered: list[np.ndarray] = []

    def load(self, kv: torch.Tensor, count: int, slots: int) -> None:
        self.size, self.count = kv.numel() * 2, count
        self.flat = kv.view(-1).view(torch.uint8).numpy()  # the bytes API reads it
        self.expected = self.flat.tobytes()
        # registered buffers: one source slot and one destination slot per entry
        self.src = np.tile(self.flat, count)
        self.dst = np.zeros_like(self.src)
        for a in (self.src, self.dst):
            if self.store.register_buffer(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("mooncake: register_buffer failed")
            self.registered.append(a)
        self.keys = [f"{MODEL}-{self.workload}-{self.size}-{i}" for i in range(slots)]

    def unload(self) -> None:
        for a in self.registered:
            self.store.unregister_buffer(a.ctypes.data)
        self.registered = []

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"mooncake {what} returned {rc}")

    def _clear(self) -> None:
        self.store.remove_all(True)

    def _ptr(self, a: np.ndarray, i: int) -> int:
        return int(a.ctypes.data) + i % self.count * self.size

    def _slot(self, a: np.ndarray, i: int) -> np.ndarray:
        j = i % self.count
        return a[j * self.size:(j + 1) * self.size]

    def _get_into(self, i: int) -> np.ndarray:
        n = self.store.get_into(self.keys[i], self._ptr(self.dst, i), self.size)
        if n != self.size:
            raise RuntimeError(f"mooncake get_into returned {n}")
        return self._slot(self.dst, i)

    def _batch_get_into(self, base: int, n: int) -> list[np.ndarray]:
        got = self.store.batch_get_into(self.keys[base:base + n],
                                        [self._ptr(self.dst, i) for i in range(n)],
                                        [self.size] * n)
        if any(x != self.size for x in got):
            raise RuntimeError(f"mooncake batch_get_into returned {got[:4]}...")
        return [self._slot(self.dst, i) for i in range(n)]

    def _check(self, i: int, got: Any) -> bool:
        return bytes(got) == self.expected

    def routes(self) -> list[Route]:
        s = self.store
        return [
            Route("put", lambda i: self._ok(s.put(self.keys[i], self.flat), "put"),
                  {"get": lambda i: s.get(self.keys[i])}, self._check, clear=self._clear),
            Route("put_from", lambda i: self._ok(
                s.put_from(self.keys[i], self._ptr(self.src, i), self.size), "put_from"),
                {"get_into": self._get_into}, self._check, clear=self._clear),
        ]

    def batch_routes(self) -> list[Route]:
        s = self.store

        def put_batch(base: int, n: int) -> None:
            self._ok(s.put_batch(self.keys[base:base + n], [self.flat] * n), "put_batch")

        def batch_put_from(base: int, n: int) -> None:
            rcs = s.batch_put_from(self.keys[base:base + n],
                                   [self._ptr(self.src, i) for i in range(n)], [self.size] * n)
            if any(rcs):
                raise RuntimeError(f"mooncake batch_put_from returned {rcs[:4]}...")

        def check(n: int, gots: list[Any]) -> bool:
            return all(self._check(i, g) for i, g in enumerate(gots))

        return [
            Route("put_batch", put_batch,
                  {"get_batch": lambda base, n: s.get_batch(self.keys[base:base + n])},
                  check, clear=self._clear),
            Route("batch_put_from", batch_put_from, {"batch_get_into": self._batch_get_into},
                  check, clear=self._clear),
        ]

    def close(self) -> None:
        self.unload()


# -- kdn ----------------------------------------------------------------------------------------


def parse_opts(text: str) -> dict[str, Any]:
    """``"shm_bytes=0,local_bytes=268435456"`` as Client keyword arguments."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = item.partition("=")
        val: Any = v
        if v.lower() in ("true", "false", "none"):
            val = {"true": True, "false": False, "none": None}[v.lower()]
        else:
            for cast in (int, float):
                try:
                    val = cast(v)
                    break
                except ValueError:
                    pass
        out[k.strip()] = val
    return out


@contextmanager
def kdn_server(tmp: Path, extra: list[str]) -> Iterator[str]:
    with common_kdn_server(tmp / f"kdn-{free_port()}", "--ram-bytes", f"{KDN_RAM_GIB}GiB",
                           "--max-message-bytes", str(256 * MIB),
                           "--max-entry-bytes", str(1 << 30), *extra) as address:
        yield address


def llama_layout(layers: int) -> KVLayout:
    return KVLayout(MODEL, tuple(LayerLayout(KV_HEADS, HEAD_DIM, HEAD_DIM)
                                 for _ in range(layers)), head_dim=HEAD_DIM)


class Kdn(System):
    """kdn through ``kdn.client.Client(**opts)``; single calls, and the batch calls where the
    client has them (``store_many``/``fetch_many``), else a loop of single calls."""

    def __init__(self, address: str, opts: dict[str, Any], tag: int,
                 layers_per_frame: int, server_args: str = "") -> None:
        label = ",".join(f"{k}={v}" for k, v in opts.items())
        self.name = (f"kdn[{label}]" if label else "kdn") + \
            (f"{{{server_args.strip()}}}" if server_args.strip() else "")
        self.tag, self.layers_per_frame = tag, layers_per_frame
        self.client = Client(address, max_message_bytes=256 * MIB, **opts)
        self.staged: list[Any] = []
        self.earlier: list[bytes] = []  # keys of earlier workloads

    def load(self, kv: torch.Tensor, count: int, slots: int) -> None:
        _, layers, tokens, _ = kv.shape
        self.layout = llama_layout(layers)
        # K, V per layer: [kv_heads, tokens, head_dim], from kv[0 or 1, layer]: [tokens, hidden]
        def head_major(t: torch.Tensor) -> torch.Tensor:
            return t.view(tokens, KV_HEADS, HEAD_DIM).transpose(0, 1).contiguous()

        self.kv = KVCache(self.layout, [(head_major(kv[0, layer]), head_major(kv[1, layer]))
                                        for layer in range(layers)])
        self.parts = codec.encode_parts(self.kv, "raw", layers_per_frame=self.layers_per_frame)
        self.frames = b"".join(self.parts.frames)
        # each key's entry its own: the same KV at position i (as chunks of a user's prompts
        # differ), so no header is the same twice and none is parsed from a memo of it; the
        # frames (their sums do not depend on the position) are shared, not copied
        entry = parse_header(self.parts.header).entry
        self.parts_at = []
        for i in range(slots):
            entry.start_position = i
            self.parts_at.append(EncodedParts(build_header(entry), self.parts.frames))
        # the KVCache a user hands over, at each position (the tensors shared)
        self.kv_at = [dataclasses.replace(self.kv, start_position=i) for i in range(slots)]
        self.earlier += getattr(self, "keys", [])  # what ``_clear`` deletes too
        self.keys = [keys.chunk_key([self.tag, self.workload, kv.numel(), i], self.layout)
                     for i in range(slots)]
        for st in self.staged:
            st.close()
        self.staged = []
        if hasattr(self.client, "stage"):  # filled once, as Mooncake's registered buffers are
            for i in range(max(1, min(count, STAGED_BYTES // max(1, self.parts.nbytes)))):
                st = self.client.stage(self.layout, tokens, start_position=i)
                for (k, v), (a, b) in zip(st.layers, self.kv.layers):
                    k.copy_(a)
                    v.copy_(b)
                self.staged.append(st)

    def unload(self) -> None:
        for st in self.staged:
            st.close()
        self.staged = []

    # the small functions a faster client path slots into
    def put_one(self, i: int) -> None:
        self.client.store(self.keys[i], self.parts_at[i])

    def put_kv(self, i: int) -> None:
        """The documented API: a KVCache, encoded (``raw``) by the store."""
        self.client.store(self.keys[i], self.kv_at[i], mode="raw")

    def put_encode_then_store(self, i: int) -> None:
        """What ``store(KVCache)`` did before it wrote into the segment: encode, then store."""
        self.client.store(self.keys[i], codec.encode_parts(self.kv_at[i], "raw",
                                                           layers_per_frame=0, wire=True))

    def put_staged(self, i: int) -> None:
        self.client.store(self.keys[i], self.staged[i % len(self.staged)])

    def put_async(self, i: int) -> None:
        self.client.store_async(self.keys[i], self.parts_at[i])

    def put_async_staged(self, i: int) -> None:
        self.client.store_async(self.keys[i], self.staged[i % len(self.staged)])

    def put_async_loop(self, base: int, n: int, staged: bool) -> None:
        for i in range(base, base + n):
            self.put_async_staged(i) if staged else self.put_async(i)

    def put_staged_batch(self, base: int, n: int) -> None:
        self.client.store_many([(self.keys[base + i], self.staged[i % len(self.staged)])
                                for i in range(n)])

    def get_one(self, i: int) -> Any:
        return self.client.fetch(self.keys[i], layout=self.layout)

    def put_batch(self, base: int, n: int) -> None:
        self.client.store_many(list(zip(self.keys[base:base + n],
                                        self.parts_at[base:base + n])))

    def put_kv_batch(self, base: int, n: int) -> None:
        self.client.store_many(list(zip(self.keys[base:base + n], self.kv_at[base:base + n])),
                               mode="raw")

    def put_encode_then_store_batch(self, base: int, n: int) -> None:
        self.client.store_many([(self.keys[i], codec.encode_parts(
            self.kv_at[i], "raw", layers_per_frame=0, wire=True)) for i in range(base, base + n)])

    def get_batch(self, base: int, n: int) -> list[Any]:
        return list(self.client.fetch_many(self.keys[base:base + n], layout=self.layout))

    def retrieve_one(self, i: int) -> Any:
        return self.client.retrieve(self.keys[i], layout=self.layout)

    def _check(self, i: int, got: Any) -> bool:
        if isinstance(got, KVCache):
            return got.start_position == i and got.equal(
                dataclasses.replace(self.kv, start_position=i))
        return (got is not None and bytes(got.parts.header) == self.parts_at[i].header
                and b"".join(bytes(f) for f in got.parts.frames) == self.frames)

    def _clear(self) -> None:
        gone = self.earlier + self.keys[:self.next_index]
        for at in range(0, len(gone), 1000):
            self.client.delete(gone[at:at + 1000])
        self.earlier = []

    def routes(self) -> list[Route]:
        out = [Route("store", self.put_one, {"fetch": self.get_one,
                                             "retrieve": self.retrieve_one},
                     self._check, clear=self._clear),
               Route("store(KVCache)", self.put_kv, {}, self._check, clear=self._clear),
               Route("encode_parts+store", self.put_encode_then_store, {}, self._check,
                     clear=self._clear)]
        if self.staged:
            out.append(Route("store (staged)", self.put_staged, {}, self._check,
                             clear=self._clear))
        out.append(Route("store_async", self.put_async, {}, self._check,
                         flush=self.client.flush, clear=self._clear))
        if self.staged:
            out.append(Route("store_async (staged)", self.put_async_staged, {},
                             self._check, flush=self.client.flush, clear=self._clear))
        return out

    def batch_routes(self) -> list[Route]:
        gets: dict[str, Callable[..., Any]] = {
            "fetch_many": self.get_batch,
            "retrieve_many": lambda base, n: self.client.retrieve_many(
                self.keys[base:base + n], layout=self.layout)}

        def check(base: int, gots: list[Any]) -> bool:
            return all(self._check(base + j, g) for j, g in enumerate(gots))

        out = [Route("store_many", self.put_batch, gets, check, clear=self._clear),
               Route("store_many(KVCache)", self.put_kv_batch, {}, check, clear=self._clear),
               Route("encode_parts+store_many", self.put_encode_then_store_batch, {}, check,
                     clear=self._clear)]
        if self.staged:
            out.append(Route("store_many (staged)", self.put_staged_batch, {},
                             lambda n, gots: True, clear=self._clear))
        out.append(Route("store_async (loop)", lambda base, n: self.put_async_loop(
            base, n, False), {}, lambda n, gots: True, flush=self.client.flush,
            clear=self._clear))
        if self.staged:
            out.append(Route("store_async (staged, loop)",
                             lambda base, n: self.put_async_loop(base, n, True), {},
                             lambda n, gots: True, flush=self.client.flush,
                             clear=self._clear))
        return out

    def close(self) -> None:
        self.client.close()


# -- measuring ----------------------------------------------------------------------------------


@dataclass
class Series:
    """What one (system, api, op, size) measured over the runs."""

    system: str
    api: str
    op: str
    size: int
    count: int
    gbs: list[float] = field(default_factory=list)
    lat: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"system": self.system, "api": self.api, "op": self.op,
                "size_mib": self.size / MIB, "count": self.count,
                "gb_s": max(self.gbs) if self.gbs else None,
                "median_gb_s": median(self.gbs) if self.gbs else None,
                "p50_ms": percentile(self.lat, 50) * 1e3, "p99_ms": percentile(self.lat, 99) * 1e3,
                "runs": [round(x, 4) for x in self.gbs]}


class Recorder:
    def __init__(self) -> None:
        self.series: dict[tuple[str, str, str, int], Series] = {}

    def get(self, system: str, api: str, op: str, size: int, count: int) -> Series:
        k = (system, api, op, size)
        if k not in self.series:
            self.series[k] = Series(system, api, op, size, count)
        return self.series[k]


def call_each(fn: Callable[[int], Any], count: int, check: Callable[[int, Any], bool],
              release: Callable[[Any], None], what: str) -> list[float]:
    """Seconds of ``fn(i)`` for each entry; results are checked and released between calls,
    outside the timed part."""
    lat = []
    for i in range(count):
        t = time.perf_counter()
        got = fn(i)
        lat.append(time.perf_counter() - t)
        if not check(i, got):
            raise RuntimeError(f"{what}: entry {i} came back different")
        release(got)
        del got
    return lat


@dataclass(frozen=True)
class Fill:
    """How a run treats what it stored."""

    bytes: int
    """Bytes a system keeps before its entries are deleted (the share of kdn's RAM tier a
    filling cache reaches); 0: every route's entries are deleted after its run (the old
    best case: later puts land in memory freed by earlier ones)."""


def room_for(system: System, nbytes: int, fill: Fill) -> None:
    """Before a put run of ``nbytes``: delete what ``system`` kept when the run would take it
    past ``fill.bytes`` (untimed); the run's keys are new either way."""
    if fill.bytes and system.kept + nbytes > fill.bytes and system.kept:
        system.routes()[0].clear()
        system.kept = 0


def after_put(system: System, route: Route, nbytes: int, fill: Fill) -> None:
    system.kept += nbytes
    if not fill.bytes:
        route.clear()
        system.kept = 0


def one_run(system: System, rec: Recorder, size: int, count: int, fill: Fill) -> None:
    """Put ``count`` new entries through every path of ``system``, each read back by every get
    of its route."""
    for p in system.routes():
        room_for(system, size * count, fill)
        base = system.next_index
        system.next_index += count
        lat = call_each(lambda i: p.put(base + i), count,  # noqa: B023
                        lambda i, got: True, lambda _: None, f"{system.name} put")
        t = time.perf_counter()
        p.flush()
        s = rec.get(system.name, p.put_api, "put", size, count)
        s.gbs.append(size * count / (sum(lat) + time.perf_counter() - t) / 1e9)
        s.lat += lat
        for api, get in p.gets.items():
            lat = call_each(lambda i: get(base + i), count,  # noqa: B023
                            lambda i, got: p.check(base + i, got),  # noqa: B023
                            p.release, f"{system.name} {api}")
            s = rec.get(system.name, api, "get", size, count)
            s.gbs.append(size * count / sum(lat) / 1e9)
            s.lat += lat
        after_put(system, p, size * count, fill)


def batch_run(system: System, rec: Recorder, size: int, count: int, fill: Fill) -> None:
    """Each batch route ``BATCH_CALLS`` times over (a put of new keys, its gets); a run's
    figure is all their bytes over all their seconds, as a single-entry run sums its
    ``count`` calls (one ~20 ms call alone says more about the VM's moment than about the
    system)."""
    for p in system.batch_routes():
        put_s: list[float] = []
        get_s: dict[str, list[float]] = {api: [] for api in p.gets}
        for _ in range(BATCH_CALLS):
            room_for(system, size * count, fill)
            base = system.next_index
            system.next_index += count
            t = time.perf_counter()
            p.put(base, count)
            p.flush()
            put_s.append(time.perf_counter() - t)
            for api, get in p.gets.items():
                t = time.perf_counter()
                gots = get(base, count)
                get_s[api].append(time.perf_counter() - t)
                if not p.check(base, gots):
                    raise RuntimeError(f"{system.name} {api}: a batch entry came back different")
                p.release(gots)
                del gots
            after_put(system, p, size * count, fill)
        for op, api, secs in [("batch_put", p.put_api, put_s),
                              *(("batch_get", api, xs) for api, xs in get_s.items())]:
            s = rec.get(system.name, api, op, size, count)
            s.gbs.append(size * count * len(secs) / sum(secs) / 1e9)
            s.lat += secs


def latency_run(system: System, rec: Recorder, gets: int, seed: int) -> None:
    """4 KiB gets of distinct keys: per get api, ``gets`` + 50 new entries stored (untimed),
    50 of them read untimed, then the others each read once in a random order (no api reads
    a key another read before: a client that keeps what it read answers it without a
    call)."""
    size = 4096
    for p in system.routes():
        for api, get in p.gets.items():
            base = system.next_index
            system.next_index += gets + 50
            for i in range(base, base + gets + 50):
                p.put(i)
            p.flush()
            order = list(range(base + 50, base + 50 + gets))
            random.Random(seed).shuffle(order)
            call_each(lambda i: get(base + i), 50,  # noqa: B023
                      lambda i, got: p.check(base + i, got),  # noqa: B023
                      p.release, f"{system.name} {api} 4 KiB")  # noqa: B023
            lat = []
            for i in order:
                t = time.perf_counter()
                got = get(i)
                lat.append(time.perf_counter() - t)
                if not p.check(i, got):
                    raise RuntimeError(f"{system.name} {api}: 4 KiB entry {i} came back "
                                       "different")
                p.release(got)
                del got
            s = rec.get(system.name, api, "get_4k", size, gets)
            s.lat += lat
        if p.gets:
            p.clear()
            system.kept = 0


def rotate(xs: list[System], r: int) -> list[System]:
    return xs[r % len(xs):] + xs[:r % len(xs)] if xs else xs


def guarded(systems: list[System], failed: dict[str, str], fn: Callable[[System], None]) -> None:
    for s in systems:
        if s.name in failed:
            continue
        try:
            fn(s)
        except Exception as err:  # one system's failure must not lose the others' numbers
            failed[s.name] = f"{type(err).__name__}: {err}"
            print(f"!! {s.name} failed: {failed[s.name]}", flush=True)


def copy_seconds(kv: torch.Tensor, repeat: int) -> list[float]:
    """The limit: one single-threaded copy of the same bytes into a preallocated buffer."""
    src = kv.view(-1).view(torch.uint8).numpy()
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), repeat)


def measure(systems: list[System], sizes: list[tuple[int, int]], batch: int, gets: int,
            runs: int, failed: dict[str, str], fill: Fill) -> list[dict[str, Any]]:
    rec = Recorder()
    routes = 8  # the most put routes a system has (each run of each takes new keys)
    for size, count in sizes:
        kv = payload(size, seed=size)
        ser = rec.get("memcpy", "np.copyto", "copy", size, 1)
        ser.lat = copy_seconds(kv, 10)
        ser.gbs = [size / x / 1e9 for x in ser.lat]
        for s in systems:
            s.next_index, s.workload = 0, s.workload + 1
        guarded(systems, failed, lambda s: s.load(kv, count, count * runs * routes))  # noqa: B023
        for r in range(runs):
            guarded(rotate(systems, r), failed,
                    lambda s: one_run(s, rec, size, count, fill))  # noqa: B023
            print(f"{size // MIB} MiB run {r + 1}/{runs} done", flush=True)
        guarded(systems, failed, lambda s: s.unload())
    kv = payload(MIB, seed=1)
    for s in systems:
        s.next_index, s.workload = 0, s.workload + 1
    guarded(systems, failed, lambda s: s.load(kv, batch, batch * runs * routes * BATCH_CALLS))
    for r in range(runs):
        guarded(rotate(systems, r), failed, lambda s: batch_run(s, rec, MIB, batch, fill))
        print(f"batch run {r + 1}/{runs} done", flush=True)
    guarded(systems, failed, lambda s: s.unload())
    guarded(systems, failed, lambda s: s.routes()[0].clear())  # before the small entries
    kv = payload(4096, seed=2)
    for s in systems:
        s.next_index, s.kept, s.workload = 0, 0, s.workload + 1
    guarded(systems, failed, lambda s: s.load(kv, 1, (gets + 50) * routes))
    guarded(systems, failed, lambda s: latency_run(s, rec, gets, seed=3))
    guarded(systems, failed, lambda s: s.unload())
    return [x.row() for x in rec.series.values()]


# -- report -------------------------------------------------------------------------------------


NARROW = {"put": ("store(KVCache)",), "batch_put": ("store_many(KVCache)",),
          "get_4k": ("retrieve",)}
"""Workloads summarised also for one kdn api alone: the stores a user's KVCache takes
(encoding included), the get that hands back tensors."""


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kdn system and workload: its best api next to the best peer's (ratio > 1: kdn ahead;
    for get_4k the ratio is best peer p50 / kdn p50); and for the ``NARROW`` apis alone."""
    out = []
    work = sorted({(r["op"], r["size_mib"]) for r in rows if r["system"] != "memcpy"})
    kdns = sorted({r["system"] for r in rows if r["system"].startswith("kdn")})
    for op, mib in work:
        sel = [r for r in rows if r["op"] == op and r["size_mib"] == mib]
        peers = [r for r in sel if not r["system"].startswith("kdn")]
        for k, only in [(k, only) for k in kdns for only in ("", *NARROW.get(op, ()))]:
            mine = [r for r in sel if r["system"] == k and (not only or r["api"] == only)]
            if not mine or not peers:
                continue
            if op == "get_4k":
                a = min(mine, key=lambda r: r["p50_ms"])
                b = min(peers, key=lambda r: r["p50_ms"])
                ratio = b["p50_ms"] / a["p50_ms"]
                mine_v, peer_v = a["p50_ms"], b["p50_ms"]
            else:
                a = max(mine, key=lambda r: r["gb_s"])
                b = max(peers, key=lambda r: r["gb_s"])
                ratio = a["gb_s"] / b["gb_s"]
                mine_v, peer_v = a["gb_s"], b["gb_s"]
            out.append({"kdn": k, "op": op + (f" [{only}]" if only else ""), "size_mib": mib,
                        "kdn_api": a["api"],
                        "kdn_value": mine_v, "best_peer": f"{b['system']} {b['api']}",
                        "peer_value": peer_v, "kdn_vs_best_peer": ratio})
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (ax, ax2) = figure(13, 5, ncols=2)
    work = [(op, mib) for op in ("put", "get", "batch_put", "batch_get")
            for mib in sorted({r["size_mib"] for r in rows if r["op"] == op})]
    systems = list(dict.fromkeys(r["system"] for r in rows if r["op"] != "copy"))
    width = 0.8 / max(1, len(systems))
    for j, sysname in enumerate(systems):
        best = []
        for op, mib in work:
            sel = [r["gb_s"] for r in rows if r["system"] == sysname and r["op"] == op
                   and r["size_mib"] == mib]
            best.append(max(sel) if sel else 0.0)
        ax.bar([i + j * width for i in range(len(work))], best, width, label=sysname)
    counts = {(r["op"], r["size_mib"]): r["count"] for r in rows}
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(work))],
                  [f"{op}\n{mib:g} MiB" + (f" x{counts[op, mib]}" if op.startswith("batch")
                                           else "") for op, mib in work], fontsize=7)
    ax.set_ylabel("GB/s of fp16 KV (each system's best api)")
    ax.set_title("put / get throughput, loopback, RAM only")
    ax.legend(fontsize=7)
    lat = [r for r in rows if r["op"] == "get_4k"]
    names = [f"{r['system']}\n{r['api']}" for r in lat]
    ax2.bar(range(len(lat)), [r["p50_ms"] for r in lat], 0.4, label="p50")
    ax2.bar([i + 0.4 for i in range(len(lat))], [r["p99_ms"] for r in lat], 0.4, label="p99")
    ax2.set_xticks([i + 0.2 for i in range(len(lat))], names, fontsize=6, rotation=30)
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log scale)")
    ax2.set_title("4 KiB get latency")
    ax2.legend(fontsize=7)
    save_figure(fig, path)


# -- main ---------------------------------------------------------------------------------------


def library_path(extra: str) -> str:
    """LD_LIBRARY_PATH with ``extra`` and nvidia-cuda-runtime-cu12's libcudart folder."""
    dirs = [d for d in extra.split(":") if d]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "cuda_runtime" / "lib"
        if lib.is_dir():
            dirs.append(str(lib))
    have = os.environ.get("LD_LIBRARY_PATH", "")
    return ":".join([d for d in dirs if d not in have.split(":")] + ([have] if have else []))


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes of the machine used, those this process and its reaped
    children used) so far: their growth over a run says how much else ran meanwhile."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    t = os.times()
    return ((sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + t.children_user + t.children_system)


def wait_quiet(limit_s: float, cores: float = 0.15, window_s: float = 10.0) -> None:
    """On a shared machine: wait (at most ``limit_s``) for a ``window_s`` in which the rest of
    the machine used under ``cores`` CPUs."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        a = busy_seconds()
        time.sleep(window_s)
        b = busy_seconds()
        used = ((b[0] - a[0]) - (b[1] - a[1])) / window_s
        if used < cores:
            return
        print(f"waiting for a quiet machine: others use {used:.2f} cores", flush=True)
    print(f"no quiet {window_s:.0f} s within {limit_s:.0f} s: measuring anyway", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "peers", "1 and 16 MiB, 16 x 1 MiB batch, 200 gets, 2 runs")
    ap.add_argument("--peer-lib-path", default="",
                    help="folders with libibverbs.so.1 & co. for Mooncake (colon-separated)")
    ap.add_argument("--kdn-client-opts", action="append", default=None,
                    help="Client keyword arguments k=v,k=v; repeat for several kdn columns")
    ap.add_argument("--kdn-server-args", action="append", default=None,
                    help="extra `kdn serve` flags; repeat for one kdn server (and its "
                         "columns) per flag set")
    ap.add_argument("--fill-gib", type=float, default=FILL_GIB,
                    help="GiB each system keeps before its entries are deleted (a cache "
                         "filling up to that share of kdn's RAM tier); 0 = delete after "
                         "every route's run (the old best case, reused memory)")
    ap.add_argument("--kdn-layers-per-frame", type=int, default=0,
                    help="layers per frame of the stored entries "
                         "(0: frames of ~256 KiB, as Client.store makes them)")
    ap.add_argument("--systems", default="lmcache,mooncake,kdn")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for other processes to go quiet")
    args = sys.argv[1:] if argv is None else argv
    ns = ap.parse_args(args)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    lib = library_path(ns.peer_lib_path)
    if lib != os.environ.get("LD_LIBRARY_PATH", "") and "KDN_PEERS_REEXEC" not in os.environ:
        # the dynamic loader reads LD_LIBRARY_PATH at start only: start again with it
        env = {**os.environ, "LD_LIBRARY_PATH": lib, "KDN_PEERS_REEXEC": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "bench.peers", *args], env)
    quick = ns.quick
    sizes = [(MIB, 8), (16 * MIB, 2)] if quick else [(MIB, 64), (16 * MIB, 8), (256 * MIB, 2)]
    batch, gets = (16, 200) if quick else (64, 500)
    runs = ns.runs or (2 if quick else 3)
    wanted = set(ns.systems.split(","))
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    if ns.wait_quiet > 0:
        wait_quiet(ns.wait_quiet)
    busy_before, t_before = busy_seconds(), time.time()
    with tempfile.TemporaryDirectory(prefix="kdn-peers-") as tmpdir, ExitStack() as stack:
        tmp = Path(tmpdir)
        systems: list[System] = []
        starts: list[tuple[str, Callable[[], list[System]]]] = [
            ("lmcache", lambda: [LMCache(lmcache_server(stack, tmp))]),
            ("mooncake", lambda: [Mooncake(stack, tmp)])]
        for name, start in starts:
            if name not in wanted:
                continue
            try:
                for system in start():
                    stack.callback(system.close)
                    systems.append(system)
                    print(f"{system.name}: started", flush=True)
            except Exception as err:
                skipped[name] = f"{type(err).__name__}: {err}".splitlines()[0]
                print(f"-- {name} skipped: {skipped[name]}", flush=True)
        if "kdn" in wanted:
            tag = 0
            for server_args in ns.kdn_server_args or [""]:
                address = stack.enter_context(kdn_server(tmp, shlex.split(server_args)))
                for text in ns.kdn_client_opts or [""]:
                    k = Kdn(address, parse_opts(text), tag, ns.kdn_layers_per_frame,
                            server_args)
                    tag += 1
                    stack.callback(k.close)
                    systems.append(k)
                    print(f"{k.name}: started", flush=True)
        fill = Fill(int(ns.fill_gib * (1 << 30)))
        rows = measure(systems, sizes, batch, gets, runs, failed, fill)
        for name, why in failed.items():
            skipped[name] = f"failed during the run: {why}"
    busy_after = busy_seconds()  # after the servers were stopped and reaped
    others_s = (busy_after[0] - busy_before[0]) - (busy_after[1] - busy_before[1])
    wall_s = time.time() - t_before
    cols = ["system", "api", "op", "size_mib", "count", "gb_s", "median_gb_s", "p50_ms",
            "p99_ms"]
    print_table([{k: ("" if v is None else v) for k, v in r.items()} for r in rows], cols)
    summ = summary(rows)
    if summ:
        print()
        print_table(summ, ["kdn", "op", "size_mib", "kdn_api", "kdn_value", "best_peer",
                           "peer_value", "kdn_vs_best_peer"])
    for name, why in skipped.items():
        print(f"-- {name} skipped: {why}")
    print(f"wall {wall_s:.0f} s; other processes on this machine used {others_s:.0f} CPU-s "
          f"meanwhile ({others_s / wall_s:.2f} cores on average)")
    write_json(ns.out, "peers", rows, runs=runs, summary=summ, skipped=skipped,
               kdn_client_opts=ns.kdn_client_opts or [""],
               kdn_server_args=ns.kdn_server_args or [""], fill_gib=ns.fill_gib,
               kdn_ram_gib=KDN_RAM_GIB,
               kdn_layers_per_frame=ns.kdn_layers_per_frame,
               wall_s=wall_s, other_processes_cpu_s=others_s,
               payload="Llama-3-8B-shaped fp16 KV (32 layers x 8 KV heads x 128), random; "
                       "4 KiB = one layer, one token",
               note="loopback, RAM only, systems take turns in each run; gb_s best of runs; "
                    "get_4k p50/p99 over all gets; summary ratio > 1 means kdn ahead; kdn fetch "
                    "through the shared segment returns views of the segment (no copy into the "
                    "caller's memory), retrieve decodes into tensors")
    plot(rows, ns.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
