"""kdn's vLLM connector against vLLM 0.33.0's own classes: loaded by vLLM's connector factory
from its module path, driven through vLLM's scheduler/worker call sequence
(``tests.vllm_replay``) against a real kdn server on loopback.

Skipped when vllm is not installed (``scripts/bootstrap.sh test`` installs it).
"""

from __future__ import annotations

import inspect
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config infers a platform
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kdn import keys  # noqa: E402
from kdn.client import Client  # noqa: E402
from kdn.errors import ConfigError, InvalidLayout, KDNError  # noqa: E402
from kdn.integrations.vllm import KDNConnector, KDNConnectorConfig  # noqa: E402
from kdn.integrations.vllm_worker import block_runs  # noqa: E402
from kdn.server import ServerThread  # noqa: E402
from kdn.server.app import build_store  # noqa: E402
from kdn.server.config import ServerConfig  # noqa: E402
from tests.helpers import eventually, make_certs, random_kv, uniform_layout  # noqa: E402
from tests.vllm_replay import Replay  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
BLOCK, HEADS, DIM, BLOCKS = 4, 2, 16, 96
CHUNK = 8  # two blocks per kdn entry

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def cache_config(dtype: torch.dtype = torch.float16, spec: Any = None) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                     dtype=dtype)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def vllm_config(address: str, tp_size: int = 1, **extra: Any) -> VllmConfig:
    settings = {"address": address, "chunk_tokens": CHUNK, "timeout_s": 10.0, **extra}
    return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                      kv_transfer_config=KVTransferConfig(
        kv_connector="KDNConnector", kv_connector_module_path="kdn.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=settings))


def both(address: str, dtype: torch.dtype = torch.float16, **extra: Any
         ) -> tuple[KDNConnector, KDNConnector]:
    """The scheduler's and a worker's connector, each made by vLLM's factory."""
    cfg = vllm_config(address, **extra)
    kcc = cache_config(dtype)
    s = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    assert isinstance(s, KDNConnector) and isinstance(w, KDNConnector)
    return s, w


@pytest.fixture
def kdn_server(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20,
                       disk_bytes=0, shutdown_grace_s=1.0)
    with ServerThread(cfg) as st:
        yield st


def fp16_replay(scheduler: Any, workers: Any) -> Replay:
    """A replay of this file's cache shape in fp16 on the CPU."""
    return Replay(scheduler, workers, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK,
                  heads=HEADS, head_dim=DIM, dtype=torch.float16)


def answered(replay: Replay, request: Any, **kw: Any) -> int:
    """Admit ``request``: the first ask answers None (lookup started), then a number."""
    first = replay.admit(request, **kw)
    assert first is None, "the first ask must not wait for the server"
    got: list[int | None] = [None]

    def ready() -> bool:
        got[0] = replay.admit(request, **kw)
        return got[0] is not None

    assert eventually(ready, timeout=10)
    assert got[0] is not None
    return got[0]


# -- loading by module path -------------------------------------------------------------------


def test_vllms_factory_loads_the_connector_by_module_path(kdn_server: ServerThread) -> None:
    cfg = vllm_config(kdn_server.address)
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KDNConnector
    s, w = both(kdn_server.address)
    try:
        assert isinstance(s, KVConnectorBase_V1) and isinstance(w, KVConnectorBase_V1)
        assert s.role == KVConnectorRole.SCHEDULER and w.role == KVConnectorRole.WORKER
        assert s.scheduler is not None and s.worker is None
        assert w.worker is not None and w.scheduler is None
        assert not inspect.isabstract(KDNConnector)
        # every abstract method of vLLM's base class is KDNConnector's own
        abstract = KVConnectorBase_V1.__abstractmethods__
        assert abstract and all(name in KDNConnector.__dict__ for name in abstract), abstract
    finally:
        s.shutdown()
        w.shutdown()


def test_bad_settings_and_unsupported_caches_are_refused(kdn_server: ServerThread) -> None:
    addr = kdn_server.address
    with pytest.raises(ConfigError, match="unknown kdn connector settings.*chunk_size"):
        KDNConnectorConfig.from_extra({"chunk_size": 8})
    for extra in ("127.0.0.1:50051", 5, ["address"], [["address", "10.0.0.1:1"]]):
        with pytest.raises(ConfigError, match="kdn's settings are a JSON object"):
            KDNConnectorConfig.from_extra(extra)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="unknown codec mode 'zip'"):
        KDNConnectorConfig.from_extra({"encodings": ["zip"]})
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        KDNConnectorConfig.from_extra({"chunk_tokens": 0})
    cfg_ = KDNConnectorConfig.from_extra({"encodings": ["lossless", "kdn-default"]})
    assert cfg_.encodings == ("lossless", "kdn-default")  # JSON lists become tuples
    assert KDNConnectorConfig.from_extra({"encodings": "raw"}).encodings == ("raw",)
    # a mode alone is its default level, named as the keys name it
    assert KDNConnectorConfig.from_extra({"encodings": ["kdn", "int8"]}).encodings == (
        "kdn-default", "int8")
    with pytest.raises(ValueError, match=r"tp \(1, 3\) does not fit tensor_parallel_size 1"):
        KDNConnector(vllm_config(addr, tp=[1, 3]), KVConnectorRole.WORKER, cache_config())
    cfg = vllm_config(addr)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                dtype=torch.float16, sliding_window=64)
    with pytest.raises(NotImplementedError, match="full-attention"):
        KDNConnector(cfg, KVConnectorRole.WORKER, cache_config(spec=sliding))
    with pytest.raises(InvalidLayout, match="unsupported dtype"):
        KDNConnector(cfg, KVConnectorRole.WORKER, cache_config(torch.float8_e4m3fn))
    with pytest.raises(ConfigError, match="chunk_tokens 2 is less than one vLLM block of 4"):
        KDNConnector(vllm_config(addr, chunk_tokens=2), KVConnectorRole.WORKER, cache_config())
    for cp in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        cp_cfg = vllm_config(addr)
        setattr(cp_cfg.parallel_config, cp, 2)  # (vLLM's own CP checks need a GPU)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(NotImplementedError, match=f"context parallelism.*{cp} 2"):
                KDNConnector(cp_cfg, role, cache_config())
    s, w = both(addr)
    try:
        with pytest.raises(InvalidLayout, match="KV cache of shape"):
            w.register_kv_caches({n: torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM + 1,
                                                 dtype=torch.float16) for n in LAYERS})
        with pytest.raises(InvalidLayout, match="no KV cache for layers"):
            w.register_kv_caches({LAYERS[0]: torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM)})
        with pytest.raises(RuntimeError, match="scheduler-side call on the worker"):
            w.build_connector_meta(None)  # type: ignore[arg-type]
    finally:
        s.shutdown()
        w.shutdown()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name,value,says", [
    ("timeout_s", NAN, "a finite number"), ("timeout_s", INF, "a finite number"),
    ("timeout_s", 0, "> 0"), ("timeout_s", "30", "a finite number"),
    ("prefill_tok_s", NAN, "a finite number"), ("prefill_tok_s", -INF, "a finite number"),
    ("prefill_tok_s", -1.0, "> 0"),
    ("lookup_threads", 1.5, "a whole number"), ("lookup_threads", 0, ">= 1"),
    ("chunk_tokens", "256", "a whole number"), ("chunk_tokens", True, "a whole number"),
    ("chunk_tokens", 1.5, "a whole number"), ("chunk_tokens", 256.0, "a whole number"),
    ("local_bytes", -1, ">= 0"), ("shm_bytes", 0.5, "a whole number"),
    ("save_backlog_bytes", 0, ">= 1"), ("lookup_timeout_s", 0, "> 0"),
    # a day at most: 1e10 s overflowed gRPC's and threading's clocks (every lookup failed at
    # once, every layer's wait raised); 2**63 bytes an off_t
    ("timeout_s", 1e10, "at most 86400"), ("lookup_timeout_s", 1e10, "at most 86400"),
    ("shm_bytes", 2**63, "at most 9223372036854775807"),
])
def test_numeric_settings_are_checked_at_construction(name: str, value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be {re.escape(says)}, got "):
        KDNConnectorConfig.from_extra({name: value})


@pytest.mark.parametrize("extra, says", [
    ({"tp": [0]}, "tp must be (rank, size)"), ({"tp": [2, 2]}, "tp must be (rank, size)"),
    ({"salt": 5}, "salt must be a string"), ({"weights_id": None}, "weights_id must be a string"),
    ({"address": 50051}, "address must be a string"),
    ({"allow_recompute": "yes"}, "allow_recompute must be true or false"),
    ({"encodings": [1]}, "encodings must be a list of encoding names"),
    ({"encodings": ["lz4"]}, "encodings: 'lz4': unknown codec mode"),
    ({"ttl_s": -1}, "ttl_s must be >= 0"), ({"ttl_s": "60"}, "ttl_s must be a whole number"),
    ({"namespace": "a/b"}, "namespace: namespace 'a/b' is malformed"),
    ({"chunk_tokens": 2**40}, "chunk_tokens must be <= 65536"),
])
def test_other_settings_are_checked_at_construction(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        KDNConnectorConfig.from_extra(extra)
    assert KDNConnectorConfig.from_extra({"tp": [1, 2], "encodings": "raw"}).tp == (1, 2)


def test_tls_files_turn_tls_on_and_must_exist(server: ServerThread, tmp_path: Path) -> None:
    """tls_cert/tls_key without tls_ca meant a plaintext channel: any of the three turns TLS
    on (the system's roots without tls_ca, as ``kdn admin``); a missing file is refused."""
    certs = make_certs(tmp_path)
    cfg = KDNConnectorConfig.from_extra({"address": server.address, "timeout_s": 5.0,
                                         "tls_cert": str(certs["client.crt"]),
                                         "tls_key": str(certs["client.key"])})
    lay = uniform_layout(layers=2, heads=2, dim=8)
    with cfg.client() as c, pytest.raises(KDNError):  # TLS to the plaintext server fails
        c.store(keys.chunk_key([1], lay), random_kv(lay, 4))
    with Client(server.address) as c:
        assert c.stats().tiers[0].entries == 0
    for extra, says in (({"tls_ca": str(tmp_path / "none.crt")}, "tls_ca: no such file"),
                        ({"tls_key": str(certs["client.key"])}, "tls_cert and tls_key")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            KDNConnectorConfig.from_extra(extra)


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(5, 0, 3), (2, 3, 2), (9, 5, 1)]
    assert block_runs([4, 4]) == [(4, 0, 1), (4, 1, 1)]


# -- the replay ----------------------------------------------------------------------------------


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 1000, (n,), generator=g)]


def run_replay(address: str, dtype: torch.dtype, encoding: str, device: str,
               kv_first: bool = True, cross_layer: bool = False) -> None:
    s, w = both(address, dtype, encodings=[encoding])
    assert s.scheduler is not None and w.worker is not None
    rp = Replay(s, w, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                head_dim=DIM, dtype=dtype, device=device, kv_first=kv_first,
                shuffle=kv_first, cross_layer=cross_layer)
    try:
        p, p2 = prompt(1, 41), prompt(6, 33)  # 5 and 4 full chunks, + 1 token
        # two first requests compute their prompts and save their chunks
        assert answered(rp, rp.new_request("seed", p)) == 0
        assert answered(rp, rp.new_request("seed2", p2)) == 0
        rp.step()
        w.worker.wait_saves(30)
        assert w.worker.stats.chunks_saved == 5 + 4

        # five requests at once: a full hit, a partial hit, a miss (chunked over two steps),
        # a hit with a chunk evicted between lookup and load, a hit behind a local prefix hit
        q = prompt(2, 35)
        reqs = {
            "full": rp.new_request("full", p),
            "partial": rp.new_request("partial", p[:16] + prompt(3, 20)),
            "miss": rp.new_request("miss", q),
            "evicted": rp.new_request("evicted", p2[:24] + prompt(4, 10)),
            "local": rp.new_request("local", p[:32] + prompt(5, 5)),
        }
        local = rp.reqs["seed"].block_ids[:2]  # vLLM's own cache holds the first 8 tokens
        assert [r is None for r in (rp.admit(reqs["local"], local_blocks=local),)] == [True]
        for rid in ("full", "partial", "miss", "evicted"):
            assert rp.admit(reqs[rid]) is None  # every first ask: "later"
        got = {}
        for rid, r in reqs.items():
            kw = {"local_blocks": local} if rid == "local" else {}
            assert eventually(lambda r=r, kw=kw: rp.ask(r, 8 if kw else 0) is not None, 10)
            got[rid] = rp.admit(r, **kw)
        assert got == {"full": 40, "partial": 16, "miss": 0, "evicted": 24, "local": 24}
        # evict chunk 1 of "evicted" after the lookup counted it
        chain = keys.prefix_keys(p2[:24], s.layout, "vllm", CHUNK)
        with Client(address) as admin:
            assert admin.delete(keys.variant_key(chain[1], s.encodings[0]), namespace="vllm")
        failed = rp.step(budget={"miss": 16})
        ev = rp.reqs["evicted"].block_ids
        assert failed == {ev[2], ev[3]}  # reported, not raised
        rp.step()  # the rest of "miss", the recompute of "evicted"
        w.worker.wait_saves(30)

        # a preemption: "miss" loses its blocks, is asked about again and loads back what it
        # saved, into new blocks
        rp.preempt("miss")
        assert answered(rp, reqs["miss"], resumed=True) == 32
        rp.step()
        w.worker.wait_saves(30)

        for rid in ["seed", "seed2", *reqs]:
            r = rp.reqs[rid]
            assert r.computed == len(r.prompt), rid
            have, want = rp.blocks_of(rid), rp.want(rid)
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), rid
        assert rp.failed == {ev[2], ev[3]}
        st = w.worker.stats
        assert st.blocks_failed == 2 and st.save_errors == 0
        assert st.blocks_loaded == (40 + 16 + 24 - 8 + 24 + 32) // BLOCK
        # the stored chunks are kdn entries kdn's own client reads back: chunk 3 of the prompt
        with Client(address) as c:
            kv = c.retrieve(keys.variant_key(keys.prefix_keys(p, s.layout, "vllm", CHUNK)[3],
                                             s.encodings[0]), namespace="vllm",
                            layout=s.layout)
            assert kv is not None and kv.start_position == 24
            for i in range(len(LAYERS)):
                want = rp.expected(p, i, 24, 32).cpu()  # [2, T, H, D]
                assert torch.equal(kv.layers[i][0].transpose(0, 1).view(torch.int16),
                                   want[0].view(torch.int16))
    finally:
        s.shutdown()
        w.shutdown()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("encoding", ["lossless", "raw"])
def test_replay_of_concurrent_requests_round_trips_bit_for_bit(
        kdn_server: ServerThread, dtype: torch.dtype, encoding: str) -> None:
    run_replay(kdn_server.address, dtype, encoding, "cpu")


def test_replay_with_blocks_first_cache_layout(kdn_server: ServerThread) -> None:
    """FlashInfer's and Triton's ``[blocks, 2, B, H, D]`` per-layer layout, with each request's
    blocks consecutive (loads copy into slices of the cache)."""
    run_replay(kdn_server.address, torch.bfloat16, "lossless", "cpu", kv_first=False)


def test_replay_with_a_cross_layer_cache(kdn_server: ServerThread) -> None:
    """vLLM's cross-layer allocation: one ``[blocks, L, 2, B, H, D]`` buffer whose per-layer
    caches are strided views."""
    run_replay(kdn_server.address, torch.float16, "raw", "cpu", cross_layer=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("encoding", ["lossless", "raw"])
def test_replay_on_cuda_paged_tensors(kdn_server: ServerThread, dtype: torch.dtype,
                                      encoding: str) -> None:
    run_replay(kdn_server.address, dtype, encoding, "cuda")


def test_tensor_parallel_ranks_store_and_load_their_own_shards(
        kdn_server: ServerThread) -> None:
    """Two TP ranks: each worker saves and loads its own heads under its own keys; the
    scheduler counts a chunk as a hit only when every rank holds it."""
    addr, kcc = kdn_server.address, cache_config()
    s = KVConnectorFactory.create_connector(vllm_config(addr, 2), KVConnectorRole.SCHEDULER,
                                            kcc)
    ws = [KVConnectorFactory.create_connector(vllm_config(addr, 2, tp=[r, 2]),
                                              KVConnectorRole.WORKER, kcc) for r in (0, 1)]
    rp = fp16_replay(s, ws)
    try:
        p = prompt(9, 33)  # 4 full chunks + 1 token
        assert answered(rp, rp.new_request("seed", p)) == 0
        rp.step()
        for w in ws:
            assert isinstance(w, KDNConnector) and w.worker is not None
            w.worker.wait_saves(30)
            assert w.worker.stats.chunks_saved == 4
        assert answered(rp, rp.new_request("hit", p)) == 32
        rp.step()
        # chunk 2 lost by rank 1 alone: the hit ends before it, for both ranks
        chain1 = keys.prefix_keys(p, ws[1].layout, "vllm", CHUNK, tp=(1, 2))
        with Client(addr) as admin:
            assert admin.delete(chain1[2], namespace="vllm")
        assert answered(rp, rp.new_request("short", p)) == 16
        rp.step()
        for rid in ("seed", "hit", "short"):
            for rank in (0, 1):
                rp.rank = rank
                assert torch.equal(rp.blocks_of(rid).view(torch.int16),
                                   rp.want(rid).view(torch.int16)), (rid, rank)
        rp.rank = 0
        assert not torch.equal(rp.tables[0], rp.tables[1])  # the ranks' shards differ
        assert not rp.failed
    finally:
        s.shutdown()
        for w in ws:
            w.shutdown()


# -- the scheduler never waits on the server -------------------------------------------------


def test_lookup_answers_later_while_the_server_is_slow(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20, disk_bytes=0,
                       shutdown_grace_s=1.0)
    store = build_store(cfg)
    gate, asked, answered_ = threading.Event(), threading.Event(), threading.Event()
    real = store.lookup

    def slow_lookup(skeys: Any) -> Any:  # the server's tier lookup, held until released
        asked.set()
        gate.wait(30)
        out = real(skeys)
        answered_.set()
        return out

    store.lookup = slow_lookup  # type: ignore[method-assign]
    with ServerThread(cfg, store) as st:
        s, w = both(st.address)
        try:
            req = Replay.new_request(None, "r", prompt(7, 30))  # type: ignore[arg-type]
            took = []
            for _ in range(3):
                t0 = time.perf_counter()
                n, load_async = s.get_num_new_matched_tokens(req, 0)
                took.append(time.perf_counter() - t0)
                assert n is None and load_async is False
            assert asked.wait(10)  # the lookup reached the server, which has not answered
            assert not answered_.is_set()
            n, _ = s.get_num_new_matched_tokens(req, 0)
            assert n is None and not answered_.is_set()
            gate.set()
            assert eventually(lambda: s.get_num_new_matched_tokens(req, 0)[0] == 0, 10)
            assert answered_.is_set()
            print(f"get_num_new_matched_tokens while the server is held: "
                  f"{[round(t * 1e6) for t in took]} us")
        finally:
            gate.set()
            s.shutdown()
            w.shutdown()


def test_an_unreachable_server_is_a_miss_not_an_error(kdn_server: ServerThread) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    s, w = both(dead, timeout_s=0.5, shm_bytes=0)
    try:
        req = Replay.new_request(None, "r", prompt(8, 30))  # type: ignore[arg-type]
        assert s.get_num_new_matched_tokens(req, 0)[0] is None
        assert eventually(lambda: s.get_num_new_matched_tokens(req, 0)[0] == 0, 30)
    finally:
        s.shutdown()
        w.shutdown()


def test_a_request_whose_lookup_failed_is_still_saved(tmp_path: Path) -> None:
    """The server fails the first request's lookup (a blip: UNAVAILABLE past the client's
    retries): that request gets no hit, but its chunks are saved once computed, so the next
    request of the prompt loads them."""
    from kdn.errors import TierUnavailable

    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20, disk_bytes=0,
                       shutdown_grace_s=1.0)
    store = build_store(cfg)
    down = threading.Event()
    real = store.lookup

    def blipping_lookup(skeys: Any) -> Any:
        if down.is_set():
            raise TierUnavailable("restarting")
        return real(skeys)

    store.lookup = blipping_lookup  # type: ignore[method-assign]
    with ServerThread(cfg, store) as st:
        s, w = both(st.address, encodings=["raw"])
        assert w.worker is not None
        rp = fp16_replay(s, w)
        try:
            p = prompt(12, 41)  # 5 full chunks + 1 token
            down.set()
            assert answered(rp, rp.new_request("blip", p)) == 0
            down.clear()
            rp.step()
            w.worker.wait_saves(30)
            assert w.worker.stats.chunks_saved == 5 and w.worker.stats.save_errors == 0
            assert answered(rp, rp.new_request("again", p)) == 40
            assert not rp.step()
            have, want = rp.blocks_of("again"), rp.want("again")
            assert torch.equal(have.view(torch.int16), want.view(torch.int16))
        finally:
            s.shutdown()
            w.shutdown()


def test_without_encodings_the_connector_stores_what_pays_off_where_it_runs() -> None:
    """``encodings`` left out: ``raw`` on a GPU beside kdn (or with the in-process tier),
    ``kdn-default`` and ``raw`` across a network, ``lossless`` on a CPU; the scheduler and
    every worker derive the same list from the same settings."""
    from kdn.integrations.vllm_meta import default_connector_encodings

    here = KDNConnectorConfig.from_extra({"address": "127.0.0.1:50051"})
    assert here.encodings == ()
    far = KDNConnectorConfig.from_extra({"address": "10.1.2.3:50051"})
    no_segment = KDNConnectorConfig.from_extra({"address": "127.0.0.1:50051", "shm_bytes": 0})
    local = KDNConnectorConfig.from_extra({"address": "10.1.2.3:50051",
                                           "local_bytes": 1 << 30})
    assert default_connector_encodings(here, "cuda") == ("raw",)
    assert default_connector_encodings(local, "cuda") == ("raw",)
    assert default_connector_encodings(far, "cuda") == ("kdn-default", "raw")
    assert default_connector_encodings(no_segment, "cuda") == ("kdn-default", "raw")
    assert default_connector_encodings(here, "cpu") == ("lossless",)
    given = KDNConnectorConfig.from_extra({"address": "10.1.2.3:50051", "encodings": ["int8"]})
    assert given.encodings == ("int8",)


def test_a_chunk_that_fails_to_load_is_saved_again(kdn_server: ServerThread) -> None:
    """A chunk written under its key with another shape is refused before it is decoded
    (``tokens=``): its blocks are recomputed, and the chunks from it on are saved again, so
    the next request of the prompt loads every chunk, bit for bit."""
    from tests.helpers import random_kv

    s, w = both(kdn_server.address, encodings=["raw"])
    assert s.scheduler is not None and w.worker is not None
    rp = fp16_replay(s, w)
    try:
        p = prompt(11, 41)  # 5 full chunks + 1 token
        assert answered(rp, rp.new_request("first", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        chain = keys.prefix_keys(p, s.layout, "vllm", CHUNK)
        with Client(kdn_server.address) as other:  # a neighbour's write under chunk 2's key
            other.store(keys.variant_key(chain[2], "raw"), random_kv(s.layout, 3 * CHUNK),
                        mode="raw", namespace="vllm")
        assert answered(rp, rp.new_request("second", p)) == 40
        failed = rp.step()
        assert failed and failed <= set(rp.reqs["second"].block_ids)
        rp.step()  # the recompute
        w.worker.wait_saves(30)
        assert answered(rp, rp.new_request("third", p)) == 40
        assert not rp.step()  # every chunk loads
        for rid in ("second", "third"):
            have, want = rp.blocks_of(rid), rp.want(rid)
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), rid
    finally:
        s.shutdown()
        w.shutdown()
