"""Regions of the client's shared segment named in a call the server did not answer in time
are not used again: a server that stalls (SIGSTOP) and then goes on may still read or write
them (a read's answer; a store it had begun: one it had not is dropped, its client gone), so
reusing one for the next entry of the same size would store that entry's bytes under the
first key (or land another read's bytes in a region being read). A real
`kdn serve` process (``tests.test_stopped_server.Served``) and a client on its host."""

from __future__ import annotations

import gc
import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn.client import Client
from kdn.errors import DeadlineExceeded
from kdn.transport.regions import RegionAllocator
from tests.helpers import eventually, random_kv, uniform_layout
from tests.test_stopped_server import Served

LAY = uniform_layout(layers=2, heads=2, dim=8)


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _same(a: object, b: object) -> bool:
    return all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(a.layers, b.layers)  # type: ignore[attr-defined]
               for x, y in ((ka, kb), (va, vb)))


@pytest.mark.parametrize("call", ["store", "store_many", "store_async"])
def test_a_store_the_server_did_not_answer_keeps_its_region(served: Served, call: str) -> None:
    """``store`` sends a staged entry by its region, ``store_many`` of several pipelines
    them, ``store_async`` sends one and reads its answer later."""
    first, second = random_kv(LAY, 16, seed=1), random_kv(LAY, 16, seed=2)  # the same size
    with Client(served.address, timeout_s=1.0) as c:
        c.store(_key("warm"), random_kv(LAY, 16, seed=3), mode="raw")  # the segment attached
        served.stop()
        try:  # both requests wait in the stopped server's socket, unanswered
            for key, kv in ((_key("first"), first), (_key("second"), second)):
                with pytest.raises(DeadlineExceeded):
                    if call == "store":
                        c.store(key, kv, mode="raw")
                    elif call == "store_async":  # its answer read by result()
                        c.store_async(key, kv, mode="raw").result()
                    else:  # several: pipelined
                        c.store_many([(key, kv), (bytes(31) + key[:1], kv)], mode="raw")
        finally:
            served.resume()
        # the server finds its client gone and drops the stores (``kdn.server.door.hung_up``);
        # one it had begun before it stopped may land: with its own bytes, never another's
        assert eventually(lambda: c.lookup([_key("warm")]).infos[0].present, timeout=10)
        for key, kv in ((_key("first"), first), (_key("second"), second)):
            got = c.retrieve(key)
            assert got is None or _same(got, kv), "another entry's bytes under the key"
        c.store(_key("third"), first, mode="raw")  # the segment serves on
        assert _same(c.retrieve(_key("third")), first)


def test_a_read_the_server_did_not_answer_keeps_its_region(served: Served) -> None:
    """A read names a region the server writes the entry into: one left unanswered is not
    given to the next call, whose bytes the stalled server's late write would overwrite (a
    store sent next: the entry read would be stored under the new key)."""
    a, c_kv = random_kv(LAY, 1024, seed=4), random_kv(LAY, 1024, seed=5)  # 128 KiB: not inline
    with Client(served.address, timeout_s=1.0) as c:
        c.store(_key("a"), a, mode="raw")
        served.stop()
        try:  # the read, then the store, wait in the stopped server's socket
            with pytest.raises(DeadlineExceeded):
                c.retrieve(_key("a"))
            with pytest.raises(DeadlineExceeded):
                c.store(_key("c"), c_kv, mode="raw")
        finally:
            served.resume()
        assert eventually(lambda: c.lookup([_key("a")]).infos[0].present, timeout=10)
        got = c.retrieve(_key("c"))  # dropped (its client was gone), or with its own bytes
        assert got is None or _same(got, c_kv), "the entry read stored under the new key"
        c.store(_key("c"), c_kv, mode="raw")
        assert _same(c.retrieve(_key("c")), c_kv) and _same(c.retrieve(_key("a")), a)


@pytest.mark.parametrize("closed_first", [False, True], ids=["open", "closed-first"])
def test_a_staged_store_async_left_unanswered_keeps_its_region(served: Served,
                                                                closed_first: bool) -> None:
    """A staged entry's ``store_async`` names its region: it is not given to the next staged
    entry while the store is unanswered (the caller closed the entry meanwhile), and is
    retired once the store goes unanswered: the entry closed, never stored again."""
    with Client(served.address, timeout_s=1.0) as c:
        c.store(_key("warm"), random_kv(LAY, 16, seed=3), mode="raw")  # the segment attached
        seg, _ = c.dataplane.segment()
        assert seg is not None and c.dataplane.server_seals
        st = c.stage(LAY, 64)
        at = st.offset
        served.stop()
        try:
            pending = c.store_async(_key("first"), st)
            if closed_first:
                st.close()
                gc.collect()
                with c.stage(LAY, 64) as other:  # the store above still names the region
                    assert other.offset != at
            with pytest.raises(DeadlineExceeded):
                pending.result()
        finally:
            served.resume()
        assert st.closed and seg.regions.retired_bytes() >= st.nbytes
        gc.collect()
        with c.stage(LAY, 64) as other:  # a late copy of the first store reads its own bytes
            assert other.offset != at


def test_retired_ranges_never_come_back() -> None:
    r = RegionAllocator(0, 1 << 12)
    at = r.alloc(1024)
    assert at == 0
    r.retire(at, 1024)
    assert r.retired_bytes() == 1024 and r.free_bytes() == (1 << 12) - 1024
    assert r.alloc(1024) == 1024  # not the retired range
    assert r.alloc(3 << 10) is None and r.reclaim() == 0 and r.retired_bytes() == 1024


def test_retired_ranges_come_back_once_their_process_is_gone() -> None:
    """A range retired ``until`` a process is gone is free again once it is, asked when an
    allocation finds no room (each ``until`` asked once a reclaim), and not before."""
    r = RegionAllocator(0, 4 << 10)
    gone = {"a": False, "b": False}
    asked: list[str] = []

    def until(name: str) -> Any:
        return lambda: asked.append(name) or gone[name]

    a, b = until("a"), until("b")
    for at in range(4):  # four ranges of 1 KiB: two retired for "a", one for "b", one for good
        assert r.alloc(1024) == at * 1024
    r.retire(0, 1024, a)
    r.retire(1024, 1024, a)
    r.retire(2048, 1024, b)
    r.retire(3072, 1024)
    assert r.alloc(1024) is None and sorted(asked) == ["a", "b"]  # asked, both still there
    gone["a"] = True
    assert r.alloc(2048) == 0 and r.retired_bytes() == 2048  # "a"'s two, merged, and only those
    assert r.alloc_largest(1024) is None  # "b" still runs
    gone["b"] = True
    assert r.alloc_largest(4096) == (2048, 1024) and r.retired_bytes() == 1024


@pytest.mark.parametrize("arena", ["0", "16MiB"], ids=["no-arena", "arena"])
def test_regions_left_to_a_server_come_back_once_it_has_exited(
        tmp_path: Path, arena: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions named in calls a stopped server never answered stay retired while it could
    still act on them (stopped: it may go on), and come back once it has exited and a new
    server took its place (the client attaches its segment again). The server is watched
    through the read arena's connection where it keeps one, else through one made to ask."""
    from kdn.client import samehost

    made: list[int] = []  # sockets the same-host path opens
    watches: list[int] = []  # of them, those its watch of the server opened

    class _Sockets:
        def __getattr__(self, name: str) -> Any:
            return getattr(socket, name)

        def socket(self, *args: Any) -> socket.socket:
            made.append(args[0])
            return socket.socket(*args)

    def watch(path: samehost.SameHostPath, *args: Any) -> Any:
        before = len(made)
        try:
            return real(path, *args)
        finally:
            watches.append(len(made) - before)

    real = samehost.SameHostPath._watch  # noqa: SLF001
    monkeypatch.setattr(samehost, "socket", _Sockets())
    monkeypatch.setattr(samehost.SameHostPath, "_watch", watch)
    served = Served(tmp_path / "a", arena=arena)
    try:  # (closed again on the way out however the test ends: close is idempotent)
        with Client(served.address, timeout_s=1.0) as c:
            c.store(_key("warm"), random_kv(LAY, 16, seed=3), mode="raw")  # the segment attached
            seg, _ = c.dataplane.segment()
            assert seg is not None and seg.server_gone is not None
            # the watch asks over the arena's kept connection, else over one of its own
            assert watches == [0 if arena != "0" else 1], (watches, made)
            size = seg.regions.free_bytes()
            served.stop()
            try:
                for i in range(3):
                    with pytest.raises(DeadlineExceeded):
                        c.store(_key(f"lost {i}"), random_kv(LAY, 1024, seed=i), mode="raw")
                gc.collect()  # the staged entries' views, kept by the errors' tracebacks
                retired = seg.regions.retired_bytes()
                assert retired >= 3 * 2 * 2 * 1024 * 16 * 2  # three entries' tensors at least
                assert seg.regions.reclaim() == 0  # stopped, not gone: they stay out of use
            finally:
                served.close()  # SIGCONT then SIGTERM: it may serve them on its way out
            again = Served(tmp_path / "b", port=served.port, arena=arena)
            try:
                assert c.retrieve(_key("warm")) is None  # a new server: the segment attached again
                assert seg.regions.retired_bytes() == 0
                assert seg.regions.free_bytes() == size
                c.store(_key("after"), random_kv(LAY, 16, seed=5), mode="raw")
                assert c.retrieve(_key("after")) is not None
            finally:
                again.close()
    finally:
        served.close()
