"""A `kdn serve` process that is stopped (SIGSTOP: a hung host, a partition that drops
packets; the kernel still takes its connections, nothing answers) under a client on its host.
A call on the same-host fast path costs one deadline (the client's ``timeout_s``, or the
caller's ``deadline_within``), not a second one by gRPC, and the path is used again once the
server answers; an engine whose server stops after its lookup computes the prompt after the
load's deadline; closing a client costs at most ``CLOSE_S``; no thread raises."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn import keys
from kdn.client import Client
from kdn.client.dataplane import CLOSE_S
from kdn.client.deadline import deadline_within
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import DeadlineExceeded
from tests.helpers import random_kv, sigstop, uniform_layout
from tests.redis_servers import free_port
from tests.test_engine_devices import _model, _Tok
from tests.test_restart import _wait_serving

LAY = uniform_layout(layers=2, heads=2, dim=8)
KV = random_kv(LAY, 4)
SHARED_POOLS = ("kdn-codec", "kdn-recv")  # process-wide (kdn.pools), not a client's


class Served:
    """A `kdn serve` subprocess without a read arena (every read is a call on the fast
    path; ``arena``: its size where it has one), stopped with ``stopped()`` and let go on
    again however the block ends."""

    def __init__(self, tmp: Path, port: int | None = None, arena: str = "0") -> None:
        port = port or free_port()  # (a port: a server started again where one was)
        self.port = port
        self.address = f"127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kdn", "serve", "--port", str(port), "--ram-bytes", "64MiB",
             "--shm-arena-bytes", arena, "--data-dir", str(tmp / "data")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_serving(self.address, self.proc)

    def stop(self) -> None:
        sigstop(self.proc.pid)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("serve"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def raised(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """What any thread raised and did not catch during the test."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def _costs(fn: Any) -> tuple[float, BaseException | None]:
    t = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what it raised is the caller's to check
        return time.monotonic() - t, exc
    return time.monotonic() - t, None


def test_a_fast_path_call_to_a_stopped_server_costs_one_deadline(
        served: Served, raised: list[BaseException | None]) -> None:
    timeout = 1.5
    with Client(served.address, timeout_s=timeout) as c:
        stored = keys.chunk_key([1, 1], LAY)
        c.store(stored, KV)
        assert c.dataplane.same_host.fast
        served.stop()
        try:
            for what, call in (("read", lambda: c.retrieve(keys.chunk_key([1, 2], LAY))),
                               ("store", lambda: c.store(keys.chunk_key([1, 3], LAY), KV))):
                took, exc = _costs(call)
                assert isinstance(exc, DeadlineExceeded), (what, exc, took)
                # one deadline; a second one by gRPC after it would take 2 * timeout
                assert timeout * 0.9 < took < timeout * 1.5, (what, took)
            took, exc = _costs(lambda: c.retrieve_many([stored]))
            assert isinstance(exc, DeadlineExceeded) and took < timeout * 1.5, (took, exc)
        finally:
            served.resume()
        assert c.dataplane.same_host.fast  # the path stays: used again now that it answers
        got = c.retrieve(stored)
        assert got is not None and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                       for a, b in zip(got.layers, KV.layers))
    assert raised == []


def test_deadline_within_ends_a_fast_path_call(served: Served) -> None:
    with Client(served.address, timeout_s=5.0) as c:
        c.store(keys.chunk_key([2, 1], LAY), KV)
        served.stop()
        try:
            with deadline_within(0.5):
                took, exc = _costs(lambda: c.retrieve_many([keys.chunk_key([2, 2], LAY)]))
        finally:
            served.resume()
    assert isinstance(exc, DeadlineExceeded), exc
    assert took < 1.5, took  # not the client's timeout_s (twice: fast path, then gRPC)


@pytest.mark.parametrize("path", ["same-host", "network-path", "grpc"])
def test_deadline_within_ends_a_new_clients_first_calls(served: Served, path: str) -> None:
    """A client's first call attaches (the segment, the network data path's ticket): that
    call, and the lookups and gRPC reads and stores beside it, end by ``deadline_within`` too,
    not after the client's ``timeout_s``."""
    opts: dict[str, Any] = {"same-host": {}, "network-path": {"shm_bytes": 0},
                            "grpc": {"shm_bytes": 0, "data_path": False}}[path]
    key = keys.chunk_key([4, len(path)], LAY)
    with Client(served.address, timeout_s=6.0, **opts) as c:
        assert c.lookup([key]).infos[0].present is False  # the channel is up
        served.stop()
        try:
            for what, call in (("read", lambda: c.retrieve_many([key])),
                               ("lookup", lambda: c.lookup([key])),
                               ("stream", lambda: c.fetch(key)),
                               ("store", lambda: c.store(key, KV))):
                with deadline_within(0.5):
                    took, exc = _costs(call)
                assert isinstance(exc, DeadlineExceeded), (what, exc)
                assert took < 1.5, (what, took)  # not the client's 6 s
        finally:
            served.resume()
        c.store(key, KV)  # the client goes on once the server answers
        assert c.retrieve(key) is not None


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "network-path"])
def test_closing_a_client_of_a_stopped_server_is_bounded(
        served: Served, raised: list[BaseException | None], shm: bool) -> None:
    before = {t.ident for t in threading.enumerate()}
    c = Client(served.address, timeout_s=5.0, **({} if shm else {"shm_bytes": 0}))
    key = keys.chunk_key([3, int(shm)], LAY)
    c.store(key, KV)
    assert c.retrieve_many([key])[0] is not None  # the segment, or the ticket, is held
    served.stop()
    try:
        took, exc = _costs(c.close)
    finally:
        served.resume()
    assert exc is None
    assert took < CLOSE_S + 1.0, took  # not timeout_s per call given back
    left = [t.name for t in threading.enumerate()
            if t.ident not in before and not t.name.startswith(SHARED_POOLS)]
    assert left == []
    assert raised == []


def test_an_engine_whose_server_stops_after_its_lookup_computes_after_the_load_deadline(
        served: Served, raised: list[BaseException | None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [int(x) for x in torch.randint(1, 256, (100,),
                                         generator=torch.Generator().manual_seed(9))]
    with Client(served.address, timeout_s=10.0) as c:
        eng = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                        EngineConfig(chunk_tokens=32, encodings=(("raw", ""),),
                                     lookup_timeout_s=1.0))
        first = eng.generate(ids, max_new_tokens=4)  # blocks 0..2 stored
        assert first.store_thread is not None
        first.store_thread.join(30)
        looked_up = c.lookup

        def lookup_then_stop(*args: Any, **kw: Any) -> Any:
            out = looked_up(*args, **kw)
            served.stop()  # the server stalls between the lookup and the load
            return out

        monkeypatch.setattr(c, "lookup", lookup_then_stop)
        try:
            t = time.monotonic()
            got = eng.generate(ids, max_new_tokens=4)
            took = time.monotonic() - t
            if got.store_thread is not None:  # its lookup fails after lookup_timeout_s
                got.store_thread.join(30)
                assert not got.store_thread.is_alive()
        finally:
            served.resume()
        eng.close()
    assert got.timings.load_error.startswith("DeadlineExceeded"), got.timings.load_error
    assert got.token_ids == first.token_ids
    assert took < 5.0, took  # the load's deadline (~1 s), not the client's 10 s (twice)
    assert raised == []


def test_a_grpc_call_past_its_deadline_names_timeout_s(served: Served) -> None:
    """A gRPC call the stopped server never answers fails DeadlineExceeded naming the
    client's ``timeout_s`` (gRPC's own text was only 'Deadline Exceeded': nothing said which
    setting to raise)."""
    with Client(served.address, timeout_s=0.75, shm_bytes=0, data_path=False) as c:
        c.lookup([keys.chunk_key([3, 1], LAY)])  # connected while it answers
        served.stop()
        try:
            for call in (lambda: c.lookup([keys.chunk_key([3, 2], LAY)]),
                         lambda: c.store(keys.chunk_key([3, 3], LAY), KV)):
                _, exc = _costs(call)
                assert isinstance(exc, DeadlineExceeded), exc
                assert "timeout_s=0.75 s" in str(exc), exc
            with deadline_within(0.3):  # sooner than timeout_s: the caller's, not timeout_s
                _, exc = _costs(lambda: c.lookup([keys.chunk_key([3, 4], LAY)]))
            assert isinstance(exc, DeadlineExceeded), exc
            assert "deadline of the call around it" in str(exc) and "timeout_s" not in str(
                exc), exc
        finally:
            served.resume()
