"""What vLLM's scheduler tells the kdn connector's worker to save, and the worker does: chunks
two requests of one step computed are stored once, and metadata it can not follow is a
counted failure, never an error in the forward pass (vLLM's classes and the replay of
``tests.test_vllm``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn import keys
from kdn.client import Client
from kdn.server import ServerThread
from kdn.server.app import build_store
from kdn.server.config import ServerConfig
from tests import test_vllm as base  # skipped with it where vLLM is not installed
from tests.helpers import random_kv
from tests.test_vllm import BLOCK, BLOCKS, CHUNK, LAYERS, answered, both, fp16_replay, prompt

kdn_server = base.kdn_server


def test_metadata_the_worker_can_not_follow_is_a_failure_not_an_error(
        kdn_server: ServerThread) -> None:
    """A LoadSpec with block ids outside the cache (negative ones too), a block table shorter
    than its tokens, or no keys for this rank: its blocks are reported failed (vLLM recomputes
    them), nothing is written or counted loaded, nothing is raised into the forward pass. A
    SaveSpec of blocks outside the cache, or one whose store fails on the saver thread: logged
    and counted in save_errors, nothing raised, nothing stored."""
    from kdn.integrations.vllm_meta import KDNConnectorMetadata, LoadSpec, SaveSpec

    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        p = prompt(13, 41)
        assert answered(rp, rp.new_request("seed", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        chain = [keys.variant_key(k, "raw") for k in keys.prefix_keys(p, s.layout, "vllm", CHUNK)]
        free = rp.free[:4]  # blocks no request holds

        def step(meta: KDNConnectorMetadata) -> set[int]:
            w.bind_connector_metadata(meta)
            try:
                w.start_load_kv(None)  # type: ignore[arg-type]
                for name in LAYERS:
                    w.wait_for_layer_load(name)
                    w.save_kv_layer(name, rp.kv[name], None)  # type: ignore[arg-type]
                w.wait_for_save()
                return w.get_block_ids_with_load_errors()
            finally:
                w.clear_connector_metadata()

        loads = {
            "past the cache": ([chain[:1]], CHUNK, [BLOCKS - 1, BLOCKS]),
            "negative": ([chain[:1]], CHUNK, [-1, free[0]]),
            "short table": ([chain[:2]], 2 * CHUNK, free[:3]),
            "no keys for this rank": ([], CHUNK, free[:2]),
        }
        before = {n: t.clone() for n, t in rp.kv.items()}
        for what, (ks, end, ids) in loads.items():
            failed = step(KDNConnectorMetadata(loads=[LoadSpec("x", ks, 0, 0, end, ids)]))
            assert failed == set(ids), what
        assert all(torch.equal(rp.kv[n].view(torch.int16), t.view(torch.int16))
                   for n, t in before.items())
        assert w.worker.stats.blocks_loaded == 0

        other = keys.prefix_keys(prompt(14, 41), s.layout, "vllm", CHUNK)
        saved = w.worker.stats.chunks_saved
        for n, spec in enumerate([SaveSpec("y", [other[:1]], 0, [BLOCKS + 1, BLOCKS + 2]),
                                  SaveSpec("y", [other[:1]], 0, [-2, free[0]]),
                                  SaveSpec("y", [[b"not a key"]], 0, free[:2])], start=1):
            assert not step(KDNConnectorMetadata(saves=[spec]))
            w.worker.wait_saves(30)  # raises what the saver thread raised
            assert w.worker.stats.save_errors == n
        assert w.worker.stats.chunks_saved == saved
        with Client(kdn_server.address) as c:
            assert not c.lookup([keys.variant_key(other[0], "raw")], namespace="vllm"
                                ).infos[0].present
    finally:
        s.shutdown()
        w.shutdown()


def test_a_chunk_two_requests_of_one_step_save_is_stored_once(kdn_server: ServerThread) -> None:
    """Two requests of one step that computed the same chunk (the same prefix, each in blocks
    of its own) save it as one entry; the step's other chunks are saved with it, and nothing
    is counted a save error (a store_many naming a key twice is refused whole)."""
    from kdn.integrations.vllm_meta import KDNConnectorMetadata, SaveSpec

    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        shared, alone = (keys.prefix_keys(prompt(seed, 2 * CHUNK), s.layout, "vllm", CHUNK)
                         for seed in (21, 22))
        per = CHUNK // rp.block_size  # blocks a chunk
        free = rp.free[: 3 * per]
        meta = KDNConnectorMetadata(saves=[
            SaveSpec("a", [shared[:1]], 0, free[:per]),
            SaveSpec("b", [shared[:1]], 0, free[per : 2 * per]),
            SaveSpec("c", [alone[:1]], 0, free[2 * per :])])
        w.bind_connector_metadata(meta)
        try:
            for name in LAYERS:
                w.save_kv_layer(name, rp.kv[name], None)  # type: ignore[arg-type]
            w.wait_for_save()
        finally:
            w.clear_connector_metadata()
        w.worker.wait_saves(30)
        assert w.worker.stats.save_errors == 0
        assert w.worker.stats.chunks_saved == 2
        with Client(kdn_server.address) as c:
            got = c.lookup([keys.variant_key(k, "raw") for k in (shared[0], alone[0])],
                           namespace="vllm").infos
        assert [i.present for i in got] == [True, True]
    finally:
        s.shutdown()
        w.shutdown()


def test_no_chunk_of_a_step_whose_load_failed_is_stored(kdn_server: ServerThread) -> None:
    """R hits three stored chunks, and the second is gone by the time it loads: that step's
    forward attends to blocks the failed load left unwritten, so the chunks it computes for R
    (and for any request sharing those blocks) are not stored; vLLM recomputes R, and the
    scheduler's mend stores them then, right."""
    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        a = prompt(31, 5 * CHUNK + 1)
        r = a[: 3 * CHUNK] + prompt(32, 2 * CHUNK + 1)
        assert answered(rp, rp.new_request("seed", a)) == 0
        rp.step()
        w.worker.wait_saves(30)
        assert answered(rp, rp.new_request("R", r)) == 3 * CHUNK
        chain = [keys.variant_key(k, "raw") for k in keys.prefix_keys(r, s.layout, "vllm",
                                                                       CHUNK)]
        with Client(kdn_server.address) as c:
            assert c.delete(chain[1], namespace="vllm")  # evicted between lookup and load
            failed = rp.step()
            w.worker.wait_saves(30)
            assert failed  # vLLM is told, and recomputes
            present = [i.present for i in c.lookup(chain[3:5], namespace="vllm").infos]
        assert present == [False, False]
        assert w.worker.stats.save_errors == 0  # left out, not failed
    finally:
        s.shutdown()
        w.shutdown()


def test_a_chunk_answered_with_another_positions_kv_is_recomputed(
        kdn_server: ServerThread) -> None:
    """Chunk 1's key holds chunk 0's entry (the same shape, the KV of other positions: a
    fault, or a server not to be trusted): its blocks are reported failed (vLLM recomputes
    them), the other chunks load, and nothing of it reaches the cache as chunk 1's."""
    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        p = prompt(41, 5 * CHUNK + 1)
        assert answered(rp, rp.new_request("seed", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        chain = [keys.variant_key(k, "raw") for k in keys.prefix_keys(p, s.layout, "vllm",
                                                                       CHUNK)]
        with Client(kdn_server.address) as c:
            first = c.fetch(chain[0], namespace="vllm")
            assert first is not None
            c.store(chain[1], first.parts, namespace="vllm")
        assert answered(rp, rp.new_request("r", p)) == 5 * CHUNK
        ids = rp.reqs["r"].block_ids
        per = CHUNK // rp.block_size
        assert rp.step() == set(ids[per : 2 * per])
        assert w.worker.stats.blocks_loaded == 4 * per
    finally:
        s.shutdown()
        w.shutdown()


def test_chunks_computed_over_a_lossy_load_are_stored_in_lossy_encodings_only(
        kdn_server: ServerThread) -> None:
    """R loads its first three chunks as kdn-default: the chunks it computes over them hold an
    approximation of the model's KV, so they are stored as kdn-default only; raw keeps exact
    KV (they were stored as raw too, and a later raw hit carried the approximation on)."""
    s, w = both(kdn_server.address, encodings=["kdn-default", "raw"], allow_recompute=False)
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        a = prompt(41, 5 * CHUNK + 1)
        r = a[: 3 * CHUNK] + prompt(42, 2 * CHUNK + 1)
        assert answered(rp, rp.new_request("seed", a)) == 0
        rp.step()
        w.worker.wait_saves(30)
        chain = keys.prefix_keys(r, s.layout, "vllm", CHUNK)
        with Client(kdn_server.address) as c:
            for k in chain[:3]:  # only the lossy copies of the shared prefix are left
                assert c.delete(keys.variant_key(k, "raw"), namespace="vllm")
            assert answered(rp, rp.new_request("R", r)) == 3 * CHUNK
            assert not rp.step()
            w.worker.wait_saves(30)
            got = c.lookup([keys.variant_key(k, e) for k in chain[3:5]
                            for e in ("raw", "kdn-default")], namespace="vllm").infos
        assert [i.present for i in got] == [False, True, False, True]
        assert w.worker.stats.save_errors == 0
    finally:
        s.shutdown()
        w.shutdown()


def _raw_held(server: ServerThread, side: Any, ids: list[int]) -> list[bool]:
    """Whether each chunk of prompt ``ids`` is stored as ``raw`` (``side``: the scheduler side,
    whose layout the keys are of)."""
    with Client(server.address) as c:
        infos = c.lookup([keys.variant_key(k, "raw")
                          for k in keys.prefix_keys(ids, side.layout, "vllm", CHUNK)],
                         namespace="vllm").infos
    return [i.present for i in infos]


def _stored_as_int8(server: ServerThread, ids: list[int]) -> None:
    """The chunks of prompt ``ids`` stored as int8 only, by another engine."""
    seeding, sw = both(server.address, encodings=["int8"])
    seed = fp16_replay(seeding, sw)
    try:
        assert answered(seed, seed.new_request("seed", ids)) == 0
        seed.step()
        assert sw.worker is not None
        sw.worker.wait_saves(30)
    finally:
        seeding.shutdown()
        sw.shutdown()


def test_blocks_shared_from_a_lossy_load_are_stored_in_lossy_encodings_only(
        kdn_server: ServerThread) -> None:
    """A loads its prefix as int8; B shares those blocks through vLLM's prefix cache and loads
    nothing itself: the chunks it saves (those copied from A's blocks and those computed over
    them) are stored as int8 only, raw keeps exact KV (B's saves went to raw as exact). A
    block vLLM later hands out anew is exact again."""
    p = prompt(45, 5 * CHUNK + 1)
    _stored_as_int8(kdn_server, p)
    s, w = both(kdn_server.address, encodings=["int8", "raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        assert answered(rp, rp.new_request("A", p)) == 5 * CHUNK
        rp.step()
        shared = rp.reqs["A"].block_ids[: 4 * CHUNK // BLOCK]
        b = p[: 4 * CHUNK] + prompt(46, CHUNK + 1)
        assert answered(rp, rp.new_request("B", b), local_blocks=shared) == 0
        rp.step()
        w.worker.wait_saves(30)
        chain = keys.prefix_keys(b, s.layout, "vllm", CHUNK)
        with Client(kdn_server.address) as c:
            got = c.lookup([keys.variant_key(k, e) for k in chain for e in ("raw", "int8")],
                           namespace="vllm").infos
        assert [i.present for i in got] == [False, True] * 5
        # blocks handed out anew to an exact request hold exact KV again
        for rid in ("A", "B"):
            done = rp.reqs.pop(rid)
            s.request_finished(done.request, done.block_ids)
            rp.free.extend(blk for blk in done.block_ids if blk not in rp.free)
        rp.free.sort(key=lambda blk: blk not in shared)  # A's lossy blocks first
        q = prompt(47, 5 * CHUNK + 1)
        assert answered(rp, rp.new_request("C", q)) == 0
        assert set(shared) <= set(rp.reqs["C"].block_ids)
        rp.step()
        w.worker.wait_saves(30)
        assert all(_raw_held(kdn_server, s, q))
    finally:
        s.shutdown()
        w.shutdown()


def test_a_lossy_load_leaves_the_exact_blocks_it_shares_exact(kdn_server: ServerThread) -> None:
    """A computes its prompt exactly; B shares A's first two chunks through vLLM's prefix
    cache and loads three more as int8; C shares only A's two exact chunks and computes the
    rest: C's chunks are stored as raw too (B's lossy load marked A's shared blocks lossy,
    so C saved to int8 only)."""
    p = prompt(48, 5 * CHUNK + 1)
    b = p[: 2 * CHUNK] + prompt(49, 3 * CHUNK + 1)
    c = p[: 2 * CHUNK] + prompt(50, 3 * CHUNK + 1)
    _stored_as_int8(kdn_server, b)  # B's chunks as int8 only, from another engine
    s, w = both(kdn_server.address, encodings=["int8", "raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        with Client(kdn_server.address) as cl:  # A's two chunks: computed by A, not loaded
            for k in keys.prefix_keys(b, s.layout, "vllm", CHUNK)[:2]:
                cl.delete(keys.variant_key(k, "int8"), namespace="vllm")
        assert answered(rp, rp.new_request("A", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        shared = rp.reqs["A"].block_ids[: 2 * CHUNK // BLOCK]
        assert answered(rp, rp.new_request("B", b), local_blocks=shared) == 3 * CHUNK
        rp.step()
        w.worker.wait_saves(30)
        assert answered(rp, rp.new_request("C", c), local_blocks=shared) == 0
        rp.step()
        w.worker.wait_saves(30)
        held = _raw_held(kdn_server, s, c)
        assert all(held[2:5]), held
    finally:
        s.shutdown()
        w.shutdown()


def test_chunks_that_attended_over_a_failed_load_are_not_stored(
        kdn_server: ServerThread) -> None:
    """B computes its chunks 4 and 5 over blocks vLLM's prefix cache shares with A, which loads
    them from kdn this step; A's chunk 2 fails to load, so B's new KV is wrong too, and is not
    stored (only A's saves were dropped: B, aborted before vLLM recomputed it, left wrong
    chunks that a later request D with B's prompt loaded as a clean hit)."""
    from tests.test_vllm import BLOCK, DIM, HEADS
    from tests.vllm_replay import Replay, Req

    class Attending(Replay):
        """New tokens' KV depends on the KV they attend to: over a wrong prefix it is -9."""

        def _write(self, r: Req, layer: int, lo: int, hi: int) -> None:
            k, v = self._kv(self.layers[layer])
            have = [k[r.block_ids[p // BLOCK], p % BLOCK] for p in range(lo)]
            if lo and not torch.equal(torch.stack(have),
                                      self.expected(r.prompt, layer, 0, lo)[0]):
                for p in range(lo, hi):
                    k[r.block_ids[p // BLOCK], p % BLOCK] = -9.0
                    v[r.block_ids[p // BLOCK], p % BLOCK] = -9.0
                return
            super()._write(r, layer, lo, hi)

    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = Attending(s, w, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                   head_dim=DIM, dtype=torch.float16)
    try:
        p = prompt(51, 4 * CHUNK + 1)
        assert answered(rp, rp.new_request("seed", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        rp.reqs.pop("seed")
        s.scheduler.finished("seed")
        assert answered(rp, rp.new_request("A", p[: 4 * CHUNK] + prompt(52, 5))) == 4 * CHUNK
        b_prompt = p[: 4 * CHUNK] + prompt(53, 2 * CHUNK + 1)
        b = rp.new_request("B", b_prompt)
        per = CHUNK // BLOCK
        assert answered(rp, b, local_blocks=rp.reqs["A"].block_ids[: 4 * per]) == 0
        chain = keys.prefix_keys(p, s.layout, "vllm", CHUNK)
        with Client(kdn_server.address) as c:  # A's chunk 2: another shape under its key
            c.store(keys.variant_key(chain[2], "raw"),
                    random_kv(s.layout, 3 * CHUNK), mode="raw", namespace="vllm")
            assert rp.step()  # A's load failed
            w.worker.wait_saves(30)
            b_chain = keys.prefix_keys(b_prompt, s.layout, "vllm", CHUNK)
            got = c.lookup([keys.variant_key(k, "raw") for k in b_chain[4:6]],
                           namespace="vllm").infos
        assert [i.present for i in got] == [False, False]
    finally:
        s.shutdown()
        w.shutdown()


def test_chunks_saved_over_another_ranks_failed_load_are_forgotten_when_the_request_ends(
        kdn_server: ServerThread) -> None:
    """TP 2: rank 1 fails to load A's chunk 2 (evicted since the lookup); the attention's
    all-reduce makes A's new KV of that step wrong on rank 0 too, which rank 0, knowing only
    its own loads, stores. A ends before vLLM recomputes it: the scheduler has every rank
    delete those chunks, so a later request stores them right (rank 0 kept its wrong chunks
    4 and 5 as present, and a third request loaded them as a clean hit)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.test_vllm import BLOCK, DIM, HEADS, cache_config, vllm_config
    from tests.vllm_replay import Replay, Req

    class Reduced(Replay):
        """The requests in ``poisoned`` compute wrong KV (-9) on every rank this step."""

        poisoned: set[str] = set()

        def _write(self, r: Req, layer: int, lo: int, hi: int) -> None:
            if r.request.request_id not in self.poisoned:
                return super()._write(r, layer, lo, hi)
            k, v = self._kv(self.layers[layer])
            for p in range(lo, hi):
                k[r.block_ids[p // BLOCK], p % BLOCK] = -9.0
                v[r.block_ids[p // BLOCK], p % BLOCK] = -9.0

    addr, kcc = kdn_server.address, cache_config()
    s = KVConnectorFactory.create_connector(vllm_config(addr, 2, encodings=["raw"]),
                                            KVConnectorRole.SCHEDULER, kcc)
    ws = [KVConnectorFactory.create_connector(vllm_config(addr, 2, encodings=["raw"],
                                                          tp=[r, 2]),
                                              KVConnectorRole.WORKER, kcc) for r in (0, 1)]
    rp = Reduced(s, ws, layers=LAYERS, blocks=BLOCKS, block_size=BLOCK, heads=HEADS,
                 head_dim=DIM, dtype=torch.float16)

    def step() -> set[int]:
        failed = rp.step()
        for w in ws:
            w.worker.wait_saves(30)
        return failed

    try:
        p = prompt(61, 4 * CHUNK + 1)
        assert answered(rp, rp.new_request("seed", p)) == 0
        step()
        pa = p[: 4 * CHUNK] + prompt(62, 2 * CHUNK + 1)  # loads chunks 0-3, computes 4, 5
        a = rp.new_request("A", pa)
        assert answered(rp, a) == 4 * CHUNK
        chain1 = keys.prefix_keys(p, s.layout, "vllm", CHUNK, tp=(1, 2))
        with Client(addr) as c:
            assert c.delete(keys.variant_key(chain1[2], "raw"), namespace="vllm")
        rp.poisoned = {"A"}
        assert step()  # rank 1's load failed
        rp.poisoned = set()
        s.request_finished(a, rp.reqs["A"].block_ids)  # A ends before its recompute
        rp.free.extend(rp.reqs.pop("A").block_ids)
        assert answered(rp, rp.new_request("C", pa)) == 2 * CHUNK
        step()
        assert answered(rp, rp.new_request("E", pa)) == 6 * CHUNK
        step()
        for rank in (0, 1):
            rp.rank = rank
            have, want = rp.blocks_of("E"), rp.want("E")
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), rank
    finally:
        s.shutdown()
        for w in ws:
            w.shutdown()


def test_a_request_preempted_and_resumed_in_one_step_saves_its_later_chunks(
        kdn_server: ServerThread) -> None:
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts a request between steps
    and the next step resumes it, listing it as preempted too: its new block table is kept,
    and the chunks it computes then are saved (the preemption was applied after the resume,
    its table left empty, and none of its later chunks was stored)."""
    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        p = prompt(61, 5 * CHUNK + 1)
        assert answered(rp, rp.new_request("a", p)) == 0
        rp.step(budget={"a": CHUNK + CHUNK // 2})  # chunk 0 saved
        w.worker.wait_saves(30)
        rp.preempt("a")
        assert answered(rp, rp.reqs["a"].request, resumed=True) == CHUNK
        rp.step()
        w.worker.wait_saves(30)
        assert _raw_held(kdn_server, s, p) == [True] * 5
    finally:
        s.shutdown()
        w.shutdown()


def test_a_connector_cache_reset_loads_nothing_stored_before_it(
        kdn_server: ServerThread) -> None:
    """vLLM's reset_prefix_cache(reset_connector=True), after a weight update: reset_cache
    says True only because nothing stored before is loaded again (it returned the base's
    None, which vLLM counts as done, and the old weights' KV went on being loaded); what is
    computed after the reset is stored and hit under the new keys."""
    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None and s.scheduler is not None
    rp = fp16_replay(s, w)
    try:
        p = prompt(71, 5 * CHUNK + 1)
        assert answered(rp, rp.new_request("before", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        assert answered(rp, rp.new_request("hit", p)) == 5 * CHUNK
        rp.step()
        assert s.reset_cache() is True
        assert not s.scheduler._tracked and not s.scheduler.pending()
        assert answered(rp, rp.new_request("after", p)) == 0
        rp.step()
        w.worker.wait_saves(30)
        assert answered(rp, rp.new_request("again", p)) == 5 * CHUNK
    finally:
        s.shutdown()
        w.shutdown()


@pytest.mark.parametrize("cap,extra,stored", [
    ("bytes", {"save_backlog_bytes": 5000}, 1),  # one step's chunk is 3072 bytes
    ("steps", {}, 8),  # vllm_worker.SAVE_BACKLOG_STEPS
])
def test_saves_past_the_backlog_are_dropped_while_the_server_is_slow(
        tmp_path: Path, cap: str, extra: dict[str, Any], stored: int) -> None:
    """The server holds every call of the saver: each step's gathered KV waited, the backlog
    grew without end. Past save_backlog_bytes, or 8 steps waiting, a step's saves are dropped
    and counted in save_errors; once the server answers, the waiting ones are stored and the
    next step saves again."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20, disk_bytes=0,
                       shutdown_grace_s=1.0)
    store = build_store(cfg)
    gate = threading.Event()
    gate.set()
    real = store.lookup

    def held(skeys: Any) -> Any:
        assert gate.wait(30)
        return real(skeys)

    store.lookup = held  # type: ignore[method-assign]
    with ServerThread(cfg, store) as st:
        s, w = both(st.address, encodings=["raw"], **extra)
        assert w.worker is not None
        rp = fp16_replay(s, w)
        try:
            prompts = [prompt(80 + i, CHUNK + 1) for i in range(11)]
            for i, p in enumerate(prompts):
                assert answered(rp, rp.new_request(f"r{i}", p)) == 0
            gate.clear()
            for i in range(10):  # one request's chunk completes per step
                rp.step(budget={f"r{j}": CHUNK + 1 if j == i else 0 for j in range(11)})
            assert w.worker.stats.save_errors == 10 - stored
            gate.set()
            w.worker.wait_saves(30)
            rp.step()  # r10's chunk
            w.worker.wait_saves(30)
            with Client(st.address) as c:
                got = c.lookup([keys.variant_key(keys.prefix_keys(p, s.layout, "vllm", CHUNK)[0],
                                                 "raw") for p in prompts], namespace="vllm").infos
            assert [i.present for i in got] == [True] * stored + [False] * (10 - stored) + [True]
            assert w.worker.stats.save_errors == 10 - stored
        finally:
            gate.set()
            s.shutdown()
            w.shutdown()
