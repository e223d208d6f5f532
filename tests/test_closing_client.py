"""A Client closed while other threads call it: their calls fail with Closed, kdn's error of a
closed client, on every path (gRPC, the same-host fast path, the network data path, a stream of
frames cut by the close). gRPC's own ValueError ("Cannot invoke RPC on closed channel!")
escaped, a call cut off in flight was KDNError CANCELLED, a store through the segment was
NotFound ("no attached segment"), and a read waiting on its network data path connection
waited for its whole deadline. A same-host client dropped without close() closes its
segment's descriptors (and its read arena's), so the server reaps the segment: they stayed
open, the segment attached and counted against the tenant's for the process's life; so did
one whose thread left a store_async unanswered (the store held its path, and the thread's
finalizer its unanswered stores): that store fails Unavailable. Stores another thread sent
asynchronously that the server answered before close() read their answers (they failed
Unavailable, "the fast path closed before the store ... was answered", the answers unread
in the socket), whether that thread reads them after the close or ends first."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from typing import Any

import pytest

from kdn.client import Client
from kdn.errors import Closed, Unavailable
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import eventually, numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()


def test_a_call_whose_channel_closes_as_it_begins_is_closed(server: ServerThread) -> None:
    c = Client(server.address, timeout_s=30, shm_bytes=0, data_path=False)

    def closing() -> Any:  # close() on another thread, between the check and the call
        c.close()
        return c.rpc.stub.Lookup(pb.LookupRequest(keys=[numbered_key(1)]), timeout=5)

    with pytest.raises(Closed, match="closed"):
        c.rpc.call(closing)


@pytest.mark.parametrize("options", [dict(shm_bytes=0, data_path=False), dict(shm_bytes=8 << 20),
                                     dict(shm_bytes=0)], ids=["grpc", "same-host", "network"])
def test_calls_cut_by_close_on_another_thread_raise_closed(
        server: ServerThread, options: dict[str, Any]) -> None:
    kv = random_kv(LAYOUT, 64, seed=1)
    other: list[str] = []
    closed = 0
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        c = Client(server.address, timeout_s=20, **options)
        c.store(numbered_key(1), kv, mode="raw")
        stop = threading.Event()

        def work(j: int, c: Client = c, stop: threading.Event = stop) -> None:
            nonlocal closed
            calls = [lambda: c.lookup([numbered_key(1)]),
                     lambda: c.fetch_many([numbered_key(1), numbered_key(2)]),
                     lambda: c.store(numbered_key(3), kv, mode="raw"),
                     lambda: c.retrieve_stream(numbered_key(1), layout=LAYOUT).result(),  # type: ignore[union-attr]
                     lambda: c.store_many([(numbered_key(5), kv), (numbered_key(6), kv)],
                                          mode="raw")]
            while not stop.is_set():
                try:
                    calls[j]()
                except Closed:
                    closed += 1
                except Exception as exc:  # noqa: BLE001 - what the test is about
                    other.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work, args=(j,)) for j in range(5)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        started = time.monotonic()
        c.close()
        time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join()
        assert time.monotonic() - started < 5, "a call waited past the close"
    assert not other, other[:3]
    assert closed


def _fds_settle(most: int, wait_s: float = 5.0) -> int:
    """This process's open descriptors once at most ``most`` (or ``wait_s`` passed): the
    in-process server's threads close their ends of a dropped client's connections a moment
    after the client let them go."""
    end = time.monotonic() + wait_s
    while (n := len(os.listdir("/proc/self/fd"))) > most and time.monotonic() < end:
        time.sleep(0.05)
    return n


def test_a_same_host_client_dropped_unclosed_gives_its_segment_back(server: ServerThread) -> None:
    segments = server.server.servicer.segments
    kv = random_kv(LAYOUT, 16, seed=2)
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(4):
        c = Client(server.address, timeout_s=30, shm_bytes=1 << 20)
        c.store(numbered_key(i), kv, mode="raw")
        assert c.retrieve(numbered_key(i), layout=LAYOUT) is not None  # the arena mapped
        assert c.dataplane.attached
        del c
        gc.collect()
    segments.reap()
    assert len(segments) == 0
    assert _fds_settle(fds + 2) <= fds + 2


def test_a_killed_same_host_clients_segment_is_detached_when_its_connections_close(
        server: ServerThread) -> None:
    """A client killed (SIGKILL: no Detach, no close) leaves its segment mapped by the server,
    its pages and its arena leases held; it is detached once its fast-path connections close
    (the kernel closes them as the process dies), not only at some later client's Attach."""
    segments = server.server.servicer.segments
    kv = random_kv(LAYOUT, 16, seed=4)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a client of its own, killed while it holds the segment
        try:
            c = Client(server.address, timeout_s=10, shm_bytes=1 << 20)
            c.store(numbered_key(1), kv, mode="raw")
            got = c.retrieve(numbered_key(1), layout=LAYOUT)  # a lease of the arena held
            os.write(w, b"1" if got is not None and c.dataplane.attached else b"0")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"1" and len(segments) == 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    assert eventually(lambda: len(segments) == 0), "the killed client's segment stayed"


@pytest.mark.parametrize("shm_bytes", [1 << 20, 0], ids=["same-host", "network"])
def test_a_client_dropped_with_a_store_unanswered_is_let_go(server: ServerThread,
                                                            shm_bytes: int) -> None:
    segments = server.server.servicer.segments
    kv = random_kv(LAYOUT, 16, seed=3)
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    left = []
    for i in range(3):
        c = Client(server.address, timeout_s=30, shm_bytes=shm_bytes)
        c.store(numbered_key(i), kv, mode="raw")  # (the network path: its connection opened)
        left.append(c.store_async(numbered_key(10 + i), kv, mode="raw"))  # not answered yet
        assert not left[-1].done()
        dropped = weakref.ref(c)
        del c
        gc.collect()
        assert dropped() is None, "a dropped client was kept by its unanswered store"
    segments.reap()
    assert len(segments) == 0
    assert _fds_settle(fds + 2) <= fds + 2  # (the server's threads close their ends after)
    for p in left:
        with pytest.raises(Unavailable):
            p.result()


@pytest.mark.parametrize("shm_bytes", [8 << 20, 0], ids=["same-host", "network"])
def test_stores_answered_before_close_read_their_answers(server: ServerThread,
                                                          shm_bytes: int) -> None:
    kv = random_kv(LAYOUT, 64, seed=4)
    c = Client(server.address, timeout_s=10, shm_bytes=shm_bytes)
    closed = threading.Event()
    kept: list[Any] = []
    got: list[str] = []

    def send(first: int, read: bool) -> None:
        c.store(numbered_key(first), kv, mode="raw")  # (the network path: its connection)
        pending = [c.store_async(numbered_key(first + 1 + i), kv, mode="raw") for i in range(3)]
        closed.wait(10)
        if not read:  # the thread ends: its stores are read as it goes
            kept.extend(pending)
            return
        for p in pending:
            try:
                p.result()
                got.append("ok")
            except Exception as exc:  # noqa: BLE001 - what the test is about
                got.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=send, args=(30, True)),
               threading.Thread(target=send, args=(40, False))]
    for t in threads:
        t.start()
    keys = [numbered_key(f + 1 + i) for f in (30, 40) for i in range(3)]
    with Client(server.address, shm_bytes=0, data_path=False) as v:
        end = time.monotonic() + 5
        while not all(i.present for i in v.lookup(keys).infos) and time.monotonic() < end:
            time.sleep(0.02)
    time.sleep(0.2)  # stored: their answers are sent, unread in the sockets
    c.close()
    closed.set()
    for t in threads:
        t.join()
    end = time.monotonic() + 5
    while not all(p.done() for p in kept) and time.monotonic() < end:
        time.sleep(0.01)
    for p in kept:
        try:
            p.result()
            got.append("ok")
        except Exception as exc:  # noqa: BLE001
            got.append(f"{type(exc).__name__}: {exc}")
    assert got == ["ok"] * 6


def test_streams_cut_by_close_on_the_network_path_raise_closed(server: ServerThread) -> None:
    """Entries still landing on the network data path when the client closed raised
    Unavailable ("the data path connection dropped inside an entry (Bad file descriptor)"),
    where gRPC's streams raise Closed."""
    layout = uniform_layout(layers=8, heads=8, dim=64)
    keys = [numbered_key(10 + i) for i in range(4)]
    with Client(server.address, timeout_s=30) as c:
        c.store_many([(k, random_kv(layout, 256, seed=i)) for i, k in enumerate(keys)],
                     mode="raw")
    seen: list[str] = []
    for _ in range(4):
        c = Client(server.address, timeout_s=20, shm_bytes=0)
        c.retrieve(keys[0])  # (the data path opened)
        streams = c.retrieve_streams(keys, layout=layout)
        c.close()
        for s in streams:
            assert s is not None
            try:
                s.result(timeout=10)
            except Closed:
                seen.append("Closed")
            except Exception as exc:  # noqa: BLE001 - what the test is about
                seen.append(f"{type(exc).__name__}: {exc}")
    assert all(s == "Closed" for s in seen), seen[:3]
    assert seen  # (some were cut short)


def test_close_leaves_another_live_threads_connection_to_it(server: ServerThread) -> None:
    """close() closed every thread's data-path connection: under a thread inside a call,
    the descriptor's number could go to a connection opened meanwhile (the server's, in this
    process), and the call read there until its deadline (20 s, now and then under load).
    Another live thread's connection is only shut down; that thread closes it."""
    kv = random_kv(LAYOUT, 16, seed=5)
    c = Client(server.address, timeout_s=20, shm_bytes=0)
    c.store(numbered_key(1), kv, mode="raw")
    used, go_on, seen = threading.Event(), threading.Event(), []

    def worker() -> None:
        c.fetch_many([numbered_key(1)])  # (its connection opened)
        used.set()
        go_on.wait(10)
        try:
            c.fetch_many([numbered_key(1)])
        except Closed:
            seen.append("Closed")

    t = threading.Thread(target=worker)
    t.start()
    assert used.wait(10)
    net = c.dataplane.network._net
    assert net is not None
    theirs = [h.conn for h in list(net.threads._held.values()) if h.thread is t]  # noqa: SLF001
    assert len(theirs) == 1 and theirs[0] is not None
    c.close()
    assert theirs[0].fileno() != -1  # shut down, not closed: its number stays its own
    assert theirs[0].recv(1) == b""  # (shut down: a read ends at once)
    go_on.set()
    t.join(10)
    assert seen == ["Closed"]
    assert theirs[0].fileno() == -1  # closed by its thread


def test_a_write_cut_by_close_says_its_outcome_is_unknown(server: ServerThread) -> None:
    """A store cut short by close() on another thread raised the plain Closed of a closed
    client, although the server may have stored it (it had): it says the outcome is unknown."""
    kv = random_kv(uniform_layout(layers=8, heads=8, dim=128), 512, seed=2)  # 16 MiB
    delay, cut = 0.005, []
    end = time.monotonic() + 5
    while not cut and time.monotonic() < end:
        c = Client(server.address, timeout_s=20)
        c.lookup([numbered_key(7)])  # (the data paths opened)
        raised: list[str] = []

        def store(c: Client = c, raised: list[str] = raised) -> None:
            try:
                c.store(numbered_key(7), kv, mode="raw")
            except Closed as exc:
                raised.append(str(exc))

        t = threading.Thread(target=store)
        t.start()
        time.sleep(delay)
        c.close()
        t.join()
        delay = delay * 0.7 if not raised else delay * 1.3  # (stored before the close: sooner)
        # refused before it began (plain), or cut short: the server may have it
        cut = [m for m in raised if "cut short" in m]
        assert all(m.endswith("make a new Client") or "may or may not" in m for m in raised)
    assert cut and "may or may not have reached the server" in cut[0]
