"""KDNEngine's stores back outlive the request but not the wait for them: ``close()`` (and
leaving ``with``) joins them within a bound, and a process that exits right after
``generate`` still stores its blocks (the exit hook), without the hook keeping engines alive."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdn import keys
from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _model, _Tok

ROOT = Path(__file__).resolve().parent.parent
IDS = [int(x) for x in torch.randint(1, 256, (100,), generator=torch.Generator().manual_seed(5))]
CONFIG = EngineConfig(chunk_tokens=32, encodings=(("lossless", ""),), calibrate=False)

CHILD = """
import sys, time, torch
from kdn import keys
from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from tests.test_engine_devices import _model, _Tok
from tests.test_engine_store_back import CONFIG, IDS

client = Client(sys.argv[1])
store = client.store
def slow(*args, **kwargs):
    time.sleep(0.1)  # the blocks are still being stored when the script ends
    return store(*args, **kwargs)
client.store = slow
g = KDNEngine(_model(torch.float32, "cpu"), _Tok(), client, CONFIG).generate(IDS, 1)
print("storing at exit:", g.store_thread.is_alive())
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st:
        yield st


def test_a_process_that_exits_after_generate_keeps_its_blocks(server: ServerThread) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, server.address], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "storing at exit: True" in done.stdout
    with Client(server.address) as c:
        assert KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, CONFIG).matched_tokens(IDS) \
            == 96


def test_close_waits_for_the_stores_within_its_bound(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(server.address) as c:
        store, release = c.store, threading.Event()

        def held(*args: object, **kwargs: object) -> object:
            release.wait(30)
            return store(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(c, "store", held)
        with KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, CONFIG) as engine:
            g = engine.generate(IDS, max_new_tokens=1)
            t0 = time.monotonic()
            assert not engine.close(timeout=0.2)  # a store hangs: close gives up in time
            assert time.monotonic() - t0 < 5 and g.store_thread is not None
            assert g.store_thread.is_alive()
            release.set()
        assert not g.store_thread.is_alive()  # leaving ``with`` joined it
        assert engine.matched_tokens(IDS) == 96
        assert engine.close()  # nothing left


def test_an_engine_with_stores_behind_it_is_not_kept_alive(server: ServerThread) -> None:
    with Client(server.address) as c:
        engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, CONFIG)
        engine.generate(IDS, max_new_tokens=1)
        assert engine.close()
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        assert gone() is None


def test_blocks_computed_over_a_lossy_prefix_are_stored_in_lossy_encodings_only(
        server: ServerThread) -> None:
    """After a kdn-default hit of A, the blocks of B computed over that approximate KV are not
    the model's exact KV: they go into kdn-default only, so a raw hit stays exact (they were
    stored as raw too, and a later raw hit gave other tokens than recomputing)."""
    from kdn import keys

    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(1, 256, (n,), generator=gen).tolist() for n in (64, 64, 40))
    config = EngineConfig(chunk_tokens=16, encodings=(("kdn", "default"), ("raw", "")),
                          calibrate=False)
    with Client(server.address) as client:
        engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), client, config)
        engine.generate(a + [1], max_new_tokens=1, force="recompute")
        engine.close()
        hit = engine.generate(a + b + [1], max_new_tokens=1, force="kdn-default")
        engine.close()
        assert hit.timings.reused_tokens == 64
        chain = keys.prefix_keys(a + b, engine.layout, engine.namespace, 16)
        present = client.lookup([keys.variant_key(k, enc) for k in chain[4:]
                                 for enc in ("raw", "kdn-default")],
                                namespace=engine.namespace).infos
        assert [i.present for i in present] == [False, True] * 4  # B: lossy copies only
        ref = engine.generate(a + b + c, max_new_tokens=8, force="recompute").token_ids
        engine.close()  # its blocks stored
        raw = engine.generate(a + b + c, max_new_tokens=8, force="raw")
        engine.close()
    assert raw.timings.reused_tokens == 160  # every block: the recompute stored them exactly
    assert raw.token_ids == ref


def test_a_server_that_stops_during_a_store_back_drops_the_rest_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """The server stops after the store-back's lookup: the first store finds it gone, and the
    request's other blocks are dropped with one warning, not each tried in turn."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=64 << 20,
                       shutdown_grace_s=0.2)
    st = ServerThread(cfg).start()
    try:
        with Client(st.address, timeout_s=5) as c:
            engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, dataclasses.replace(
                CONFIG, chunk_tokens=4))
            assert engine.generate(IDS[:8], max_new_tokens=1).store_thread is not None
            assert engine.close(30)
            looked_up, calls = c.lookup, []

            def lookup_then_stop(*args: object, **kw: object) -> object:
                out = looked_up(*args, **kw)  # type: ignore[arg-type]
                calls.append(1)
                if len(calls) == 2:  # the store-back's lookup (after the request's)
                    st.stop()
                return out

            monkeypatch.setattr(c, "lookup", lookup_then_stop)
            caplog.clear()
            engine.generate(IDS, max_new_tokens=1)  # 23 blocks to store
            t0 = time.monotonic()
            assert engine.close(20) and time.monotonic() - t0 < 10
    finally:
        st.stop()
    store_back = [r.getMessage() for r in caplog.records if r.name == "kdn.engine.store_back"]
    assert len(store_back) == 1, store_back
    assert "the request's 22 other stores are dropped" in store_back[0]


def test_a_client_closed_during_a_store_back_drops_the_rest_with_one_warning(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The client is closed as the first block is stored: that store is refused Closed, and
    the request's other blocks are dropped with one warning (each was tried, and warned)."""
    c = Client(server.address, timeout_s=5)
    engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, dataclasses.replace(
        CONFIG, chunk_tokens=4))
    store = c.store

    def close_then_store(*args: object, **kw: object) -> object:
        c.close()
        return store(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(c, "store", close_then_store)
    caplog.clear()
    engine.generate(IDS, max_new_tokens=1)  # 25 blocks to store
    assert engine.close(20)
    store_back = [r.getMessage() for r in caplog.records if r.name == "kdn.engine.store_back"]
    assert len(store_back) == 1, store_back
    assert "the client was closed, so the request's 24 other stores are dropped" in store_back[0]


def test_blocks_past_the_tenants_quota_are_refused_once_per_encoding(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant whose quota holds no block: the first block of each encoding is refused
    (TooLarge), and its encoding's other blocks are not sent, one warning each."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  t: {api_keys: [key-t], quota_bytes: 1000}\n")
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", disk_bytes=0, ram_bytes=64 << 20,
                       auth_file=str(auth))
    with ServerThread(cfg) as st, Client(st.address, timeout_s=5, api_key="key-t") as c:
        engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, dataclasses.replace(
            CONFIG, chunk_tokens=4, encodings=(("raw", ""), ("lossless", ""))))
        caplog.clear()
        engine.generate(IDS, max_new_tokens=1)  # 25 blocks in each encoding
        assert engine.close(20)
    store_back = [r.getMessage() for r in caplog.records if r.name == "kdn.engine.store_back"]
    assert len(store_back) == 2, store_back
    assert all("quota" in m and "other blocks in" in m for m in store_back), store_back


def test_blocks_the_server_lost_are_stored_back_though_the_in_process_tier_holds_them(
        server: ServerThread) -> None:
    """A's client keeps copies in its in-process tier; the server loses the blocks (deleted
    through B). A computing the prompt again stores them back for B: the local copies serve
    no other process (they counted as present, and nothing was stored)."""
    with Client(server.address, local_bytes=16 << 20) as a, Client(server.address) as b:
        ea, eb = (KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, CONFIG) for c in (a, b))
        ea.generate(IDS, max_new_tokens=1)
        assert ea.close(30) and eb.matched_tokens(IDS) == 96
        chain = keys.prefix_keys(IDS, eb.layout, eb.namespace, CONFIG.chunk_tokens)
        stored = [keys.variant_key(k, "lossless") for k in chain]
        assert b.delete(stored) == 3
        assert [i.tier for i in a.lookup(stored).infos] == ["inproc"] * 3
        assert not any(i.present for i in a.lookup(stored, server_only=True).infos)
        assert eb.matched_tokens(IDS) == 0 and ea.matched_tokens(IDS) == 96  # A's local copies
        ea.generate(IDS, max_new_tokens=1, force="recompute")
        assert ea.close(30)
        assert eb.matched_tokens(IDS) == 96
