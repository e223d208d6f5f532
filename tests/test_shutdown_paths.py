"""A graceful stop lets calls in flight on the same-host fast path and on the network data path
finish within ``shutdown_grace_s``, as gRPC's do: a store running when the stop begins is
answered OK and is there after a restart (they were cut at once: the client heard
UNAVAILABLE, and the entry was sometimes stored all the same). Real server, real client; the
server's PutMany handler is slowed so that the stop surely meets it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kdn import keys
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread, fastpath, netpath
from kdn.transport.wire import FAST_PUT_MANY

from .helpers import random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=8, dim=64)


@pytest.mark.parametrize("path", ["fast", "net"])
def test_a_store_in_flight_on_a_data_path_is_answered_through_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    begun = threading.Event()
    if path == "net":
        real_put = netpath.put_streamed

        def slow_put(*args: Any, **kw: Any) -> Any:
            begun.set()
            time.sleep(0.8)  # the stop begins meanwhile
            return real_put(*args, **kw)

        monkeypatch.setattr(netpath, "put_streamed", slow_put)
    else:
        real_handle = fastpath.FastPath._handle

        def slow_handle(self: fastpath.FastPath, op: int, body: bytes, conn: Any) -> bytes:
            if op == FAST_PUT_MANY:
                begun.set()
                time.sleep(0.8)
            return real_handle(self, op, body, conn)

        monkeypatch.setattr(fastpath.FastPath, "_handle", slow_handle)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", shutdown_grace_s=20.0)
    kv = random_kv(LAYOUT, 256, seed=3)
    key = keys.chunk_key([3, 3], LAYOUT)
    st = ServerThread(cfg).start()
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (begun.wait(20), st.stop(), stopped.set()))
    stopper.start()
    try:
        with Client(st.address, shm_bytes=None if path == "fast" else 0) as c:
            c.store(key, kv, mode="raw")  # answered OK although the stop began under it
        assert begun.is_set(), f"the store did not travel on the {path} path"
    finally:
        begun.set()
        stopper.join(60)
    assert stopped.is_set()
    with ServerThread(cfg) as again, Client(again.address) as c:
        back = c.retrieve(key)
        assert back is not None and back.equal(kv)


def test_a_stopped_path_takes_no_new_call_and_drains_at_once(tmp_path: Path) -> None:
    """``stop_accepting`` closes the idle connections (a same-host client hears the exit);
    ``drain`` with nothing in flight answers True at once."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", shutdown_grace_s=5.0)
    with ServerThread(cfg) as st, Client(st.address) as c:
        kv = random_kv(LAYOUT, 16, seed=1)
        key = keys.chunk_key([1], LAYOUT)
        c.store(key, kv, mode="raw")
        fast = st.server.fast_path
        assert fast is not None
        fast.stop_accepting()
        t = time.monotonic()
        assert fast.drain(5.0) and time.monotonic() - t < 1.0
