"""KDNEngine's loads against a real in-process server: a load that stalls has a deadline of its
own (and, once late, is left out for a while; so is a caller's own wait, and neither stores
its sound blocks again), a block gone between the lookup and the load leaves the blocks
before it reused, a client without a deadline works, and no KV of a prompt outlives its
request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn import keys
from kdn.client import Client
from kdn.engine import EngineConfig, Generation, KDNEngine
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _model, _Tok

IDS = [int(x) for x in torch.randint(1, 256, (100,), generator=torch.Generator().manual_seed(5))]
SLOW = 2000
"""Bytes/s a stalling server sends: the 3 blocks (73 KB) would take 37 s."""


def _server(tmp_path: Path, egress: int = 0) -> ServerThread:
    return ServerThread(ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0,
                                     ram_bytes=256 << 20, egress_bytes_per_s=egress))


def _engine(c: Client, **kw: Any) -> KDNEngine:
    return KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                     EngineConfig(chunk_tokens=32, encodings=(("raw", ""),), **kw))


def _stored(eng: KDNEngine) -> Generation:
    got = eng.generate(IDS, max_new_tokens=4)
    assert got.store_thread is not None
    got.store_thread.join(60)
    return got


def _within(seconds: float, call: Any) -> Any:
    """``call()``'s result, failing the test where it takes longer than ``seconds`` (the call
    is left running on a daemon thread)."""
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.setdefault("r", call()), daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still running after {seconds} s"
    return out["r"]


def test_a_load_that_stalls_is_abandoned_at_its_deadline(tmp_path: Path) -> None:
    """The server answers the lookup, then sends the blocks at 2 KB/s: the request costs the
    load's deadline (here lookup_timeout_s, 0.5 s), not the 37 s the blocks take nor the
    client's 30 s, and the prompt is computed whole."""
    with _server(tmp_path, SLOW) as st, Client(st.address, timeout_s=30, shm_bytes=0) as c:
        eng = _engine(c, lookup_timeout_s=0.5, calibrate=False)
        first = _stored(eng)
        t0 = time.monotonic()
        got = _within(8, lambda: eng.generate(IDS, max_new_tokens=4, force="raw"))
        assert time.monotonic() - t0 < 5
        t = got.timings
        assert t.decision == "recompute" and t.reused_tokens == 0
        # the engine's wait for layer 0 and the data path's own deadline end together: either
        # may say so first
        assert (t.load_error.startswith("DeadlineExceeded: layer 0 of the 3 blocks loaded")
                and "deadline of 0.5 s" in t.load_error
                or t.load_error.startswith("DeadlineExceeded: the data path did not bring an "
                                           "entry within the call's deadline")), t.load_error
        assert got.token_ids == first.token_ids
        assert eng._request.acquire(blocking=False)  # noqa: SLF001  (nothing holds the engine)
        eng._request.release()  # noqa: SLF001
        again = _within(8, lambda: eng.generate(IDS, max_new_tokens=4, force="recompute"))
        assert again.token_ids == first.token_ids


def test_a_load_past_its_deadline_leaves_its_encoding_out_for_a_while(tmp_path: Path) -> None:
    """The controller chose the hit (its link prior is fast), the link is slow: the late load
    is a failure to the controller, so the next requests compute the prompt without waiting
    for the same load to miss its deadline again (each paid the deadline and a prefill)."""
    with _server(tmp_path, SLOW) as st, Client(st.address, timeout_s=30, shm_bytes=0) as c:
        eng = _engine(c, lookup_timeout_s=0.5, calibrate=False)
        first = _stored(eng)
        late = _within(8, lambda: eng.generate(IDS, max_new_tokens=4)).timings
        assert late.load_error.startswith("DeadlineExceeded"), late.load_error
        for _ in range(2):
            got = _within(8, lambda: eng.generate(IDS, max_new_tokens=4))
            t = got.timings
            assert (t.decision, t.load_error) == ("recompute", ""), t
            assert got.token_ids == first.token_ids
        assert eng.controller.counts["raw"] == 0  # the late load counts as a recompute
        assert eng.controller.counts["recompute"] == 4


def test_a_callers_own_wait_running_out_is_late_and_stores_nothing_again(
        tmp_path: Path) -> None:
    """Through the connector protocol a caller's ``wait_for_layer(i, timeout=...)`` runs out
    (the link is slow, the blocks sound): the load is over, as at the engine's own deadline,
    and the caller computes and saves the whole prompt; the blocks, present and intact, are
    not stored again."""
    from kdn.model import hf

    with _server(tmp_path, SLOW) as st, Client(st.address, timeout_s=30, shm_bytes=0) as c:
        eng = _engine(c, lookup_timeout_s=5.0, calibrate=False)
        _stored(eng)
        stores = c.stats().counters.get("store.ok", 0)
        assert eng.start_load(IDS, force="raw") == 96
        for i in (0, 1):  # the second call raises the first's failure again
            with pytest.raises(TimeoutError, match="layer 0 not ready after 0.05 s"):
                eng.wait_for_layer(i, timeout=0.05)
        kv, _ = hf.prefill(eng.model, IDS, eng.layout)
        for i, (k, v) in enumerate(kv.layers):
            eng.save_layer(i, k, v)
        eng.wait_for_save(60)
        eng.finish()
        assert c.stats().counters.get("store.ok", 0) == stores
        assert eng._timings.decision == "recompute"  # noqa: SLF001
        assert eng.controller.counts["raw"] == 0


def test_a_load_the_server_never_answers_is_abandoned_at_its_deadline(
        tmp_path: Path) -> None:
    """The server answers the lookup, then hangs on the read (its GetMany never answers): the
    request costs the load's deadline, not the client's 30 s."""
    with _server(tmp_path) as st, Client(st.address, timeout_s=30, shm_bytes=0) as c:
        eng = _engine(c, lookup_timeout_s=0.5, calibrate=False)
        first = _stored(eng)
        reads = st.server.servicer.reads
        hung = threading.Event()
        get_sent = reads.get_sent

        def hanging(*a: Any, **k: Any) -> Any:
            hung.wait(30)
            return get_sent(*a, **k)

        reads.get_sent = hanging
        try:
            t0 = time.monotonic()
            got = _within(8, lambda: eng.generate(IDS, max_new_tokens=4, force="raw"))
            assert time.monotonic() - t0 < 5
        finally:
            hung.set()
        t = got.timings
        assert t.decision == "recompute" and t.reused_tokens == 0
        assert t.load_error.startswith("DeadlineExceeded: the network data path did not "
                                       "answer within the call's deadline")
        assert got.token_ids == first.token_ids


def test_a_block_gone_before_the_load_leaves_the_blocks_before_it_reused(
        tmp_path: Path) -> None:
    with _server(tmp_path) as st, Client(st.address, shm_bytes=0) as c, \
            Client(st.address) as other:
        eng = _engine(c)
        first = _stored(eng)
        chain = eng._chain(IDS)  # noqa: SLF001
        choose = eng.controller.choose

        def evicting(block: int) -> Any:
            def choose_then_evict(*a: Any, **k: Any) -> Any:
                d = choose(*a, **k)
                other.delete(keys.variant_key(chain[block], "raw"), namespace=eng.namespace)
                return d
            return choose_then_evict

        eng.controller.choose = evicting(2)  # type: ignore[method-assign]
        got = eng.generate(IDS, max_new_tokens=4, force="raw")
        t = got.timings
        assert (t.decision, t.reused_tokens, t.computed_tokens) == ("raw", 64, 36)
        assert not t.load_error and got.token_ids == first.token_ids
        assert got.store_thread is not None
        got.store_thread.join(60)
        assert eng.matched_tokens(IDS) == 96  # the missing block stored again

        eng.controller.choose = evicting(0)  # type: ignore[method-assign]
        counts = dict(eng.controller.counts)
        got = eng.generate(IDS, max_new_tokens=4, force="raw")
        t = got.timings
        assert (t.decision, t.reused_tokens) == ("recompute", 0)
        assert t.load_error == ("NotFound: block 0 of 3 went missing between the lookup and "
                                "the load")
        assert eng.controller.counts["recompute"] == counts.get("recompute", 0) + 1
        assert eng.controller.counts["raw"] == counts["raw"]
        assert got.token_ids == first.token_ids


def test_a_client_without_a_deadline_serves_the_engine(tmp_path: Path) -> None:
    with _server(tmp_path) as st, Client(st.address, timeout_s=None) as c:
        eng = _engine(c)
        first = _stored(eng)
        # a hit, whatever the controller makes of a tiny model's prefill on a loaded host
        got = eng.generate(IDS, max_new_tokens=4, force="raw")
        assert got.timings.reused_tokens == 96 and not got.timings.load_error
        assert got.token_ids == first.token_ids


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[KDNEngine]:
    with _server(tmp_path) as st, Client(st.address) as c:
        yield _engine(c)


def test_no_kv_of_a_prompt_outlives_its_request(engine: KDNEngine) -> None:
    got = engine.generate(IDS, max_new_tokens=4)
    assert got.store_thread is not None
    assert not engine._saved  # noqa: SLF001  (the store thread holds them, not the engine)
    got.store_thread.join(60)
