"""A client's per-thread data path connections (kdn.client.perthread) against a real server:
a client shared by short-lived threads holds a connection per live thread, each closed when
its thread ends (on the network data path and on the same-host fast path), and a connection
the server refuses for its per-ticket limit sends that call by gRPC instead of failing it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from kdn.client import Client
from kdn.server import ServerThread, netpath
from tests.helpers import eventually, numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()
KV = random_kv(LAYOUT, 16, seed=1)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _calls(c: Client, i: int) -> list[Callable[[], object]]:
    """One call of each kind the data path carries, for thread ``i``."""
    return [
        lambda: c.store(numbered_key(i), KV, mode="raw"),
        lambda: c.retrieve(numbered_key(0), layout=LAYOUT),
        lambda: c.retrieve_many([numbered_key(0), numbered_key(1)], layout=LAYOUT),
        lambda: c.store_async(numbered_key(i), KV, mode="raw").result(),
    ]


def _in_thread(call: Callable[[], object]) -> BaseException | None:
    """``call`` on a thread of its own, joined; what it raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported by the test's thread
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return failed[0] if failed else None


@pytest.mark.parametrize("shm_bytes", [0, 1 << 20], ids=["network", "same-host"])
def test_short_lived_threads_leave_no_connection_behind(server: ServerThread,
                                                        shm_bytes: int) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=shm_bytes) as c:
        c.store(numbered_key(0), KV, mode="raw")
        c.store(numbered_key(1), KV, mode="raw")
        assert (c.dataplane.net() is not None) == (shm_bytes == 0)
        before = _fds()  # this thread's connection included
        for i in range(2, 102):  # one after another: more threads than a ticket's 64
            failed = _in_thread(_calls(c, i)[i % 4])
            assert failed is None, (i, failed)
        assert eventually(lambda: _fds() <= before + 4), (before, _fds())
        stored = [i for i in range(2, 102) if i % 4 in (0, 3)]
        got = c.retrieve_many([numbered_key(i) for i in stored], layout=LAYOUT)
        assert all(g is not None and g.equal(KV) for g in got)
    if shm_bytes == 0:
        assert server.server.net_path is not None
        assert eventually(lambda: not server.server.net_path._per_owner)  # type: ignore


def test_a_connection_past_the_tickets_limit_sends_its_calls_by_grpc(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netpath.NetPath, "max_per_owner", 2)
    with Client(server.address, timeout_s=30, shm_bytes=0) as c:
        c.store(numbered_key(0), KV, mode="raw")  # this thread holds one of the two
        c.store(numbered_key(1), KV, mode="raw")
        net = c.dataplane.net()
        assert net is not None
        started = threading.Barrier(4)
        failed: list[BaseException] = []

        def work(i: int) -> None:
            try:
                started.wait(timeout=30)  # all live at once: one more than the server admits
                for call in _calls(c, 10 + i):
                    call()
                started.wait(timeout=30)  # none ends (and gives its connection back) early
            except BaseException as exc:  # reported by the test's thread
                failed.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        got = c.retrieve_many([numbered_key(10 + i) for i in range(4)], layout=LAYOUT)
        assert all(g is not None and g.equal(KV) for g in got)
        assert c.dataplane.net() is net  # the path stays for the calls it admits
        refusals = server.server.servicer.counters.get("net.RESOURCE_EXHAUSTED", 0)
        assert refusals >= 3  # three threads were refused a connection, at least once each


@pytest.mark.parametrize("shm_bytes", [0, 4 << 20], ids=["network", "same-host"])
def test_a_thread_that_ends_with_unanswered_stores_has_them_settled(
        server: ServerThread, shm_bytes: int) -> None:
    """Their answers were never read: each PendingStore stayed unanswered for good (result()
    elsewhere refused), the in-process tier counted its key's write as in flight for ever,
    and on the same-host path its region of the segment was never freed."""
    with Client(server.address, timeout_s=30, shm_bytes=shm_bytes, local_bytes=8 << 20) as c:
        c.store(numbered_key(0), KV, mode="raw")
        seg = c.dataplane.segment()[0]
        free = seg.regions.free_bytes() if seg is not None else 0
        pending: list[object] = []

        def sends() -> None:
            c.store(numbered_key(1), KV, mode="raw")  # the thread's connection opened
            pending.extend(c.store_async(numbered_key(10 + i), KV, mode="raw")
                           for i in range(3))

        for _ in range(2):
            assert _in_thread(sends) is None
        assert eventually(lambda: all(p.done() for p in pending))  # type: ignore[attr-defined]
        assert all(p.result().stored_bytes > 0 for p in pending)  # type: ignore[attr-defined]
        assert not c.local._writing
        if seg is not None:
            assert eventually(lambda: seg.regions.free_bytes() == free)
        assert c.retrieve(numbered_key(10), layout=LAYOUT) is not None
        assert c.lookup([numbered_key(10)]).infos[0].in_process  # kept, as a store is
