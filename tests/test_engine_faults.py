"""KDNEngine when loading its prefix fails (a tiny random Llama, a real server): the request is
computed whole and gives the full prefill's output, the failure is reported in its timings, and
the blocks are stored again, so the next request hits. A block written under the engine's key
with another shape is refused before any of it is decoded."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdn import keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.stream import LayerStream
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import Corrupt, LayoutMismatch, TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import count_decoders
from tests.test_engine_devices import _model, _Tok

IDS = [int(x) for x in torch.randint(1, 256, (100,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[KDNEngine]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        eng = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                        EngineConfig(chunk_tokens=32, encodings=(("raw", ""),)))
        first = eng.generate(IDS, max_new_tokens=6)  # blocks 0..2 stored
        assert first.store_thread is not None
        first.store_thread.join(60)
        yield eng


def _full(engine: KDNEngine) -> list[int]:
    return engine.generate(IDS, max_new_tokens=6, force="recompute").token_ids


def _healed(engine: KDNEngine, got: object) -> None:
    """The blocks were stored again: the next request reuses them, to the same output."""
    assert got.store_thread is not None  # type: ignore[attr-defined]
    got.store_thread.join(60)  # type: ignore[attr-defined]
    again = engine.generate(IDS, max_new_tokens=6, force="raw")
    assert again.timings.reused_tokens == 96 and not again.timings.load_error
    assert again.token_ids == _full(engine)


def _counted_as_recompute(engine: KDNEngine, before: dict[str, int]) -> None:
    """The request whose raw load failed counts as a recompute, as its timings say, not as
    a raw hit (the controller counted its choice when it made it)."""
    assert engine.controller.counts["raw"] == before.get("raw", 0)
    assert engine.controller.counts["recompute"] == before.get("recompute", 0) + 1


def test_a_block_of_another_shape_is_refused_and_stored_again(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    key = keys.variant_key(engine._chain(IDS)[1], "raw")  # noqa: SLF001
    wide = [(torch.randn(2, 5000, 16), torch.randn(2, 5000, 16)) for _ in range(3)]
    engine.client.store(key, KVCache(engine.layout, wide), mode="raw")  # a neighbour's write
    made = count_decoders(monkeypatch)
    counts = dict(engine.controller.counts)
    got = engine.generate(IDS, max_new_tokens=6, force="raw")
    assert 5000 not in made  # refused before a decoder was made for it
    assert got.timings.decision == "recompute" and got.timings.reused_tokens == 0
    _counted_as_recompute(engine, counts)
    assert "holds 5000 tokens, caller expects 32" in got.timings.load_error
    assert got.token_ids == _full(engine)
    _healed(engine, got)


def test_a_load_failing_midway_is_computed_whole(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    wait = LayerStream.wait_for_layer

    def damaged(self: LayerStream, i: int, *args: object, **kwargs: object) -> object:
        if i == 1:  # found as layer 1 is decoded, after layer 0 was used
            raise Corrupt("frame 1 checksum mismatch")
        return wait(self, i, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LayerStream, "wait_for_layer", damaged)
    predictions, counts = engine.controller.ttft_error, dict(engine.controller.counts)
    got = engine.generate(IDS, max_new_tokens=6, force="raw")
    monkeypatch.undo()
    assert got.timings.decision == "recompute" and got.timings.reused_tokens == 0
    _counted_as_recompute(engine, counts)
    assert got.timings.load_error == "Corrupt: frame 1 checksum mismatch"
    assert got.timings.computed_tokens == len(IDS)
    assert engine.controller.ttft_error == predictions  # a failed load teaches nothing
    assert got.token_ids == _full(engine)
    _healed(engine, got)


def test_an_unreachable_server_is_computed_around(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def down(*args: object, **kwargs: object) -> object:
        raise ConnectionError("server went away")

    monkeypatch.setattr(engine.client, "retrieve_streams", down)
    got = engine.generate(IDS, max_new_tokens=6, force="raw")
    monkeypatch.undo()
    assert got.timings.decision == "recompute" and got.timings.reused_tokens == 0
    assert got.timings.load_error == "ConnectionError: server went away"
    assert got.token_ids == _full(engine)


def test_a_stopped_server_is_computed_around(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=30) as c:
        eng = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                        EngineConfig(chunk_tokens=32, encodings=(("raw", ""),)))
        first = eng.generate(IDS, max_new_tokens=6)
        assert first.store_thread is not None
        first.store_thread.join(60)
        assert eng.matched_tokens(IDS) == 96
        st.stop()
        got = eng.generate(IDS, max_new_tokens=6)
        assert got.timings.decision == "recompute" and got.timings.reused_tokens == 0
        assert got.timings.load_error.startswith("Unavailable: ")
        assert got.token_ids == first.token_ids
        assert got.store_thread is None  # nothing to store to
        assert eng.matched_tokens(IDS) == 0


def test_a_stopped_server_is_one_warning_not_one_per_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every request to a stopped server logged a WARNING (an engine at 100 requests a second:
    100 lines a second for as long as the outage lasts); now the first, the others at DEBUG."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=64 << 20)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=30) as c:
        eng = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                        EngineConfig(chunk_tokens=32, encodings=(("raw", ""),)))
        assert eng.matched_tokens(IDS) == 0  # answered: nothing to say
        st.stop()
        with caplog.at_level(logging.DEBUG, logger="kdn.engine"):
            for _ in range(10):
                assert eng.generate(IDS, max_new_tokens=1).timings.decision == "recompute"
                assert eng.matched_tokens(IDS) == 0
        ours = [r for r in caplog.records if r.name.startswith("kdn.")]
        warned = [r for r in ours if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "UNAVAILABLE" in warned[0].getMessage()
        assert sum(r.levelno == logging.DEBUG and "lookup failed" in r.getMessage()
                   for r in ours) >= 19  # the others, at DEBUG


def test_a_server_that_never_answers_costs_a_request_the_lookup_deadline() -> None:
    """A black hole (a socket that takes connections and never answers): neither the new
    engine, its calibration nor the request waits the client's 5 s deadline, and the prompt is
    computed whole."""
    from tests.test_engine_models import _prefilled

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    try:
        with Client(f"127.0.0.1:{hole.getsockname()[1]}", timeout_s=5) as c:
            t0 = time.monotonic()
            model = _model(torch.float32, "cpu")
            eng = KDNEngine(model, _Tok(), c,  # the default encodings: asks how it links
                            EngineConfig(chunk_tokens=32, lookup_timeout_s=0.3))
            got = eng.generate(IDS, max_new_tokens=6)  # calibrates first: probe not tried
            assert eng.matched_tokens(IDS) == 0
            assert time.monotonic() - t0 < 4.5
        assert got.timings.load_error.split(":")[0] in ("DeadlineExceeded", "Unavailable")
        assert got.timings.reused_tokens == 0 and got.store_thread is None
        assert got.token_ids == _prefilled(model, IDS, 6)
    finally:
        hole.close()


def test_the_models_own_error_is_not_taken_for_a_load_failure(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    forward = engine.model.forward

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.model, "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(IDS, max_new_tokens=6, force="raw")
    monkeypatch.setattr(engine.model, "forward", forward)


@pytest.mark.parametrize("error", [TooLarge("the entries decode to 1.0 GiB, more than device "
                                            "cuda:0 has free now"),
                                   Corrupt("frame 1 checksum mismatch")])
def test_a_load_too_large_for_here_leaves_the_encoding_out_but_keeps_its_blocks(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """A load refused as TooLarge (the device, or the host, short of room for it) is computed
    whole and its encoding left out for a while, as any failed load; its blocks, which nothing
    is wrong with, are not stored again (a damaged one is)."""
    failures: list[str] = []
    rewrites: list[str] = []
    observe, start = engine.controller.observe_failure, engine._saver.start  # noqa: SLF001

    def refuse(*args: object, **kwargs: object) -> object:
        raise error

    monkeypatch.setattr(engine.client, "retrieve_streams", refuse)
    monkeypatch.setattr(engine.controller, "observe_failure",
                        lambda enc, *a: failures.append(enc) or observe(enc, *a))
    monkeypatch.setattr(engine._saver, "start",  # noqa: SLF001  (a[3]: rewrite)
                        lambda *a, **kw: rewrites.append(a[3]) or start(*a, **kw))
    got = engine.generate(IDS, max_new_tokens=6, force="raw")
    monkeypatch.undo()
    assert got.timings.decision == "recompute" and got.timings.reused_tokens == 0
    assert got.timings.load_error.startswith(type(error).__name__)
    assert got.token_ids == _full(engine)
    assert failures == ["raw"]
    assert rewrites == ["" if isinstance(error, TooLarge) else "raw"]


def test_a_block_failing_through_the_connector_protocol_is_stored_again(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine wrapping kdn drives the protocol itself: start_load, wait_for_layer until one
    fails, then the whole prompt's KV to save_layer. Every block is stored again (the bad one
    mended), the controller learns the failure, and later layers raise it again."""
    from kdn.model import hf

    chain = [keys.variant_key(k, "raw") for k in engine._chain(IDS)]  # noqa: SLF001
    block0 = engine.client.retrieve(chain[0], layout=engine.layout)
    engine.client.store(chain[1], block0, mode="raw")  # block 1's key holds block 0's KV
    failures: list[str] = []
    observe = engine.controller.observe_failure
    monkeypatch.setattr(engine.controller, "observe_failure",
                        lambda enc, *a: failures.append(enc) or observe(enc, *a))
    assert engine.start_load(IDS, force="raw") == 96
    with pytest.raises(LayoutMismatch, match="holds the KV of tokens 0..32"):
        engine.wait_for_layer(0)
    with pytest.raises(LayoutMismatch, match="holds the KV of tokens 0..32"):
        engine.wait_for_layer(1)
    assert failures == ["raw"]
    kv, _ = hf.prefill(engine.model, IDS, engine.layout)
    for i, (k, v) in enumerate(kv.layers):
        engine.save_layer(i, k, v)
    engine.wait_for_save(60)
    engine.finish()
    assert engine.start_load(IDS, force="raw") == 96
    for i in range(engine.layout.num_layers):
        engine.wait_for_layer(i)  # every block loads: the bad one was stored again
    engine.finish()


def test_a_stalled_load_leaves_another_engine_on_the_same_model_alone(
        engine: KDNEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines share one model, in two threads: A's load stalls after layer 0 (its layer
    hooks stay on the shared decoder layers for all of its forward) while B serves another
    prompt. B's forward neither waits for A's layers nor fails with A's failure."""
    other = [7] * 120
    with Client(engine.client.address) as c:
        b = KDNEngine(engine.model, _Tok(), c, EngineConfig(
            chunk_tokens=32, encodings=(("raw", ""),), calibrate=False))
        want = b.generate(other, max_new_tokens=2, force="recompute").token_ids
        inside, released = threading.Event(), threading.Event()
        wait = LayerStream.wait_for_layer

        def stalled(self: LayerStream, i: int, *args: object, **kwargs: object) -> object:
            if i >= 1:  # A's forward is past layer 0: its hooks are on the layers
                inside.set()
                released.wait(5)
                raise TimeoutError(f"layer {i} not ready")
            return wait(self, i, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(LayerStream, "wait_for_layer", stalled)
        out: dict[str, object] = {}
        a = threading.Thread(target=lambda: out.setdefault(
            "a", engine.generate(IDS, max_new_tokens=6, force="raw")), daemon=True)
        a.start()
        assert inside.wait(10)
        try:
            t0 = time.monotonic()
            got = b.generate(other, max_new_tokens=2, force="recompute")
            assert time.monotonic() - t0 < 2.5  # not A's load's wait
        finally:
            released.set()
            a.join(30)
        monkeypatch.undo()
    assert got.token_ids == want and not got.timings.load_error
    t = out["a"].timings  # type: ignore[attr-defined]
    assert t.decision == "recompute" and t.reused_tokens == 0
    assert t.load_error.startswith("DeadlineExceeded: layer 1 of the 3 blocks loaded"), \
        t.load_error
    assert out["a"].token_ids == _full(engine)  # type: ignore[attr-defined]
