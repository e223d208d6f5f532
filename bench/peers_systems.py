"""The stores ``bench.peers`` drives, behind one interface: the workload's shape (Llama-3-8B
fp16 KV) and its payloads, ``Route`` (one way to put entries and read them back) and
``System`` (a store under test), and the peers: LMCache's standalone server through its remote
connector, and Mooncake Store (master, storage process, ``MooncakeDistributedStore``).
kdn's ``System`` is ``bench.peers_kdn``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import HOST, free_port, port_open, process, wait_until

MIB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
HIDDEN = KV_HEADS * HEAD_DIM
TOKEN_BYTES = 2 * LAYERS * HIDDEN * 2  # K and V of every layer, fp16: 128 KiB
LAYER_TOKEN_BYTES = 2 * HIDDEN * 2  # K and V of one layer and token: 4 KiB
MODEL = "llama-3-8b-shape"


def payload(size: int, seed: int = 0) -> torch.Tensor:
    """Random fp16 KV of ``size`` bytes in LMCache's KV_2LTD order; whole tokens of all 32 layers
    from 128 KiB up, else tokens of one layer."""
    layers = LAYERS if size >= TOKEN_BYTES else 1
    tokens = size // (TOKEN_BYTES if layers == LAYERS else LAYER_TOKEN_BYTES)
    assert tokens * 2 * layers * HIDDEN * 2 == size, size
    g = torch.Generator().manual_seed(seed)
    # kv: [2 (K, V), layers, tokens, kv_heads * head_dim]
    return torch.randn(2, layers, tokens, HIDDEN, generator=g).half()


# -- what every system offers ----------------------------------------------------------------------


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


# -- LMCache ---------------------------------------------------------------------------------------


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


# -- Mooncake Store --------------------------------------------------------------------------------


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
