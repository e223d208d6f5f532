"""A client that outlives its server: ``kdn serve`` restarted on the same address (and data
directory) under a live client, on each path the client may take: the same-host default
(shared segment, fast path, read arena), the network data path (no segment) and plain gRPC.

The client must come back by itself, within its default retry policy: its first calls after
the new server answers store and read correctly (the segment attached again, the fast path and
the data path opened again, the channel reconnected), and a fetch of an absent key is a miss,
never an error about the old server's segment or ticket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn import keys
from kdn.client import Client, Retry
from kdn.errors import KDNError, Unavailable
from kdn.server import ServerConfig, ServerThread
from tests.helpers import without_directory

from .helpers import numbered_key, random_kv, uniform_layout

RECOVERY_S = 2.0
"""A client made before the restart stores and reads correctly within this of the new server
answering."""

PATHS: dict[str, dict[str, Any]] = {
    "same_host": {},  # the default for a loopback address
    "network": {"shm_bytes": 0},
    "grpc": {"shm_bytes": 0, "data_path": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, port: int) -> ServerConfig:
    return ServerConfig(port=port, data_dir=tmp_path / "data", ram_bytes=64 << 20,
                        disk_bytes=256 << 20, shutdown_grace_s=0.5)


def _counters(st: ServerThread) -> dict[str, int]:
    assert st.server is not None
    return dict(st.server.servicer.counters)


def _check_path(path: str, c: Client, st: ServerThread) -> None:
    """The client's calls went the way its options say, on the server ``st``."""
    got = _counters(st)
    if path == "same_host":
        assert c.dataplane.attached and c.dataplane.same_host.fast
        assert got.get("fast.GetMany", 0) >= 1 and got.get("fast.PutMany", 0) >= 1
    elif path == "network":
        assert not c.dataplane.attached and c.dataplane.net() is not None
        assert got.get("net.GetMany", 0) >= 1 and got.get("net.PutMany", 0) >= 1
    else:
        assert not c.dataplane.direct
        assert not any(k.startswith(("net.", "fast.")) for k in got)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[[], ServerThread]]:
    """Start a server on a fixed port; each call stops the running one (if any) and starts
    another on the same port and data directory."""
    port = _free_port()
    running: list[ServerThread] = []

    def restart() -> ServerThread:
        if running:
            running.pop().stop()
        running.append(ServerThread(_config(tmp_path, port)).start())
        return running[-1]

    yield restart
    for st in running:
        st.stop()


def _recovered(c: Client, lay: Any, tag: int) -> float:
    """Seconds until ``c`` stored and read back an entry after a restart, its first call a
    fetch of an absent key (a miss)."""
    kv = random_kv(lay, 16, seed=tag)
    key = keys.chunk_key([tag, 7], lay)
    started = time.monotonic()
    assert c.fetch(numbered_key(900 + tag)) is None
    c.store(key, kv, mode="raw")
    got = c.retrieve(key, layout=lay)
    took = time.monotonic() - started
    assert got is not None and got.equal(kv)
    hit = c.fetch(key)
    assert hit is not None
    return took


@pytest.mark.parametrize("path", list(PATHS))
def test_client_survives_server_restart(path: str,
                                        restartable: Callable[[], ServerThread]) -> None:
    st = restartable()
    lay = uniform_layout()
    with Client(st.address, **PATHS[path]) as c:
        _recovered(c, lay, 1)
        _check_path(path, c, st)
        for round_ in (2, 3):  # twice: the path made again after the first restart goes too
            st = restartable()
            took = _recovered(c, lay, round_)
            assert took < RECOVERY_S, f"{path}: {took:.2f} s to recover"
            _check_path(path, c, st)


@pytest.mark.parametrize("path", list(PATHS))
def test_batches_after_restart(path: str, restartable: Callable[[], ServerThread]) -> None:
    """store_many / fetch_many / store_async of a client made before the restart."""
    st = restartable()
    lay = uniform_layout()
    kvs = [random_kv(lay, 8, seed=i) for i in range(4)]
    names = [numbered_key(i) for i in range(4)]
    with Client(st.address, **PATHS[path]) as c:
        c.store_many(list(zip(names, kvs)), mode="raw")
        assert all(f is not None for f in c.fetch_many(names))
        st = restartable()
        assert c.fetch_many([numbered_key(50), numbered_key(51)]) == [None, None]
        c.store_many(list(zip(names[:2], kvs[:2])), mode="raw")
        c.store_async(names[2], kvs[2], mode="raw").result()
        back = c.retrieve_many(names[:3], layout=lay)
        assert all(b is not None and b.equal(kv) for b, kv in zip(back, kvs))
        _check_path(path, c, st)


@pytest.mark.parametrize("path", list(PATHS))
def test_store_async_first_after_restart(path: str,
                                         restartable: Callable[[], ServerThread],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An asynchronous store as the first call after the restart: its connection is the old
    server's (closed while idle), and it is stored all the same, answered without error."""
    without_directory(monkeypatch)  # its reads are calls: they check the path taken
    st = restartable()
    lay = uniform_layout()
    kv = random_kv(lay, 8, seed=5)
    with Client(st.address, **PATHS[path]) as c:
        c.store_async(numbered_key(1), kv, mode="raw").result()
        st = restartable()
        c.store_async(numbered_key(2), kv, mode="raw").result()
        c.flush()
        got = c.retrieve(numbered_key(2), layout=lay)
        assert got is not None and got.equal(kv)
        _check_path(path, c, st)


@pytest.mark.parametrize("path", list(PATHS))
def test_recovers_after_an_outage_with_calls(path: str,
                                             restartable: Callable[[], ServerThread]) -> None:
    """An engine that keeps calling while the server is down for a few seconds (each call
    UNAVAILABLE): once the new server answers, the client is back within ``RECOVERY_S``
    (the channel's reconnection backoff must not outgrow it)."""
    st = restartable()
    lay = uniform_layout()
    with Client(st.address, **PATHS[path]) as c:
        assert c.fetch(numbered_key(1)) is None
        st.stop()
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            with pytest.raises(Unavailable):
                c.fetch(numbered_key(1))
            time.sleep(0.05)
        st = restartable()
        took = _recovered(c, lay, 6)
        assert took < RECOVERY_S, f"{path}: {took:.2f} s to recover"
        _check_path(path, c, st)


def test_fetch_while_down_is_unavailable_then_recovers(
        restartable: Callable[[], ServerThread]) -> None:
    """While no server answers a call fails UNAVAILABLE (typed), and the client still comes
    back once one does."""
    st = restartable()
    lay = uniform_layout()
    with Client(st.address) as c:
        assert c.fetch(numbered_key(1)) is None
        st.stop()
        with pytest.raises(Unavailable):
            c.fetch(numbered_key(1))
        with pytest.raises(Unavailable):
            c.store(numbered_key(2), random_kv(lay, 8), mode="raw")
        st = restartable()
        assert _recovered(c, lay, 4) < RECOVERY_S
        _check_path("same_host", c, st)


def test_kept_leases_not_read_after_restart(restartable: Callable[[], ServerThread]) -> None:
    """A same-host client holding kept leases of the old server reads the new server's
    values (the old arena's words mean nothing any more)."""
    st = restartable()
    lay = uniform_layout()
    key = numbered_key(3)
    old, new = random_kv(lay, 8, seed=1), random_kv(lay, 8, seed=2)
    with Client(st.address, keep_leases_bytes=64 << 20) as c:
        c.store(key, old, mode="raw")
        for _ in range(2):
            got = c.retrieve(key, layout=lay)
            assert got is not None and got.equal(old)
        st = restartable()
        with Client(st.address, shm_bytes=0) as other:
            other.store(key, new, mode="raw")
        got = c.retrieve(key, layout=lay)
        assert got is not None and got.equal(new)


# -- a real ``kdn serve`` process ---------------------------------------------------------------


def _serve(tmp_path: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(
        [sys.executable, "-m", "kdn", "serve", "--port", str(port), "--ram-bytes", "64MiB",
         "--data-dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_serving(address: str, proc: subprocess.Popen[str]) -> None:
    """Until a fresh client's Health call is answered (a fresh channel each try: no backoff of
    its own delays it)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with Client(address, timeout_s=1, shm_bytes=0, data_path=False,
                        retry=Retry(retries=0)) as probe:
                if probe.health() == "SERVING":
                    return
        except KDNError:
            time.sleep(0.05)
    raise AssertionError(f"kdn serve at {address} did not answer")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("path", list(PATHS))
def test_kdn_serve_restarted_under_a_live_client(tmp_path: Path, path: str,
                                                 how: signal.Signals) -> None:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    lay = uniform_layout()
    proc = _serve(tmp_path, port)
    try:
        _wait_serving(address, proc)
        with Client(address, **PATHS[path]) as c:
            _recovered(c, lay, 1)
            proc.send_signal(how)
            proc.wait(30)
            proc = _serve(tmp_path, port)
            _wait_serving(address, proc)
            took = _recovered(c, lay, 2)
            assert took < RECOVERY_S, f"{path}: {took:.2f} s to recover"
            if path == "same_host":
                assert c.dataplane.attached and c.dataplane.same_host.fast
            elif path == "network":
                assert c.dataplane.net() is not None
    finally:
        proc.kill()
        proc.wait(30)
