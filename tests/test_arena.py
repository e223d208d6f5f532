"""Read arenas (kdn.server.arena, kdn.client.shm.LeasedArena): same-host reads of RAM-tier
entries handed out as leased ranges of a sealed shared memfd. The arena on its own (leases,
eviction, stamps, seals), then over a real server: what a reader gets back, writes into the
tensors a read returned, reads racing overwrites and evictions of a tiny arena, tenancy."""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.received import Fetched
from kdn.codec.format import header_size
from kdn.errors import Corrupt
from kdn.layout import Expected
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, Arena, Arenas
from kdn.server.config import ConfigError
from tests.helpers import (
    churn,
    count_staging_copies,
    leased_small_entries,
    random_kv,
    uniform_layout,
)
from tests.helpers import copy_into as _copy
from tests.helpers import numbered_key as _key
from tests.helpers import raw_entry as _value

LAYOUT = uniform_layout()


@pytest.fixture(autouse=True)
def _small_entries_leased(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests lease small entries (``tests.helpers.leased_small_entries``)."""
    leased_small_entries(monkeypatch)


# -- the arena alone ----------------------------------------------------------------------------


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena("t", 8 * PAGE)
    yield a
    a.close()


def test_a_lease_copies_once_and_reads_again_without_a_copy(arena: Arena) -> None:
    value = _value(random_kv(LAYOUT, 20, seed=1))
    fills: list[int] = []

    def fill(dst: memoryview, v: bytes | memoryview) -> None:
        fills.append(len(v))
        dst[:] = v

    one = arena.lease(b"k", value, 7, fill)
    two = arena.lease(b"k", value, 7, fill)
    assert one is two and one is not None and one.leases == 2 and fills == [len(value)]
    assert bytes(arena.array[one.offset : one.offset + one.length]) == value
    assert one.start % PAGE == 0 and one.size % PAGE == 0
    assert (one.offset + header_size(value)) % 64 == 0  # its first frame: tensors view it
    arena.release(one)
    arena.release(one)
    with pytest.raises(Corrupt, match="no lease"):
        arena.release(one)


def test_another_value_of_the_key_is_copied_and_the_held_one_kept_whole(arena: Arena) -> None:
    old, new = _value(random_kv(LAYOUT, 20, seed=1)), _value(random_kv(LAYOUT, 20, seed=2))
    held = arena.lease(b"k", old, 1, _copy)
    fresh = arena.lease(b"k", new, 2, _copy)  # the key was written again: a new stamp
    assert held is not None and fresh is not None and held is not fresh
    assert not held.indexed and fresh.indexed
    assert bytes(arena.array[held.offset : held.offset + held.length]) == old
    used = arena.used_bytes
    arena.release(held)  # its last lease: its pages are free again
    assert arena.used_bytes == used - held.size
    arena.drop(b"k")  # deleted: not handed out again, freed once released
    assert arena.lease(b"k", new, 2, _copy) is not fresh
    arena.release(fresh)


def test_the_least_recently_read_unheld_entries_make_room_and_held_ones_never(
        arena: Arena) -> None:
    values = [_value(random_kv(LAYOUT, 20, seed=i)) for i in range(3)]
    assert 2 * PAGE < len(values[0]) + 64 <= 3 * PAGE  # three pages each, eight in the arena
    a = arena.lease(b"a", values[0], 1, _copy)
    b = arena.lease(b"b", values[1], 1, _copy)
    assert a is not None and b is not None
    assert arena.lease(b"c", values[2], 1, _copy) is None  # both held: no room
    assert arena.full == 1
    arena.release(a)
    c = arena.lease(b"c", values[2], 1, _copy)  # a goes (unheld), b stays
    assert c is not None and not a.indexed and b.indexed
    assert bytes(arena.array[b.offset : b.offset + b.length]) == values[1]
    assert arena.lease(b"big", b"x" * (9 * PAGE), 1, _copy) is None  # larger than the arena


def test_a_fill_that_fails_its_check_gives_the_pages_back(arena: Arena) -> None:
    def bad(dst: memoryview, v: bytes | memoryview) -> None:
        raise Corrupt("frame 0: checksum mismatch")

    value = _value(random_kv(LAYOUT, 20))
    with pytest.raises(Corrupt):
        arena.lease(b"k", value, 1, bad)
    assert arena.used_bytes == 0 and arena.lease(b"k", value, 1, _copy) is not None


def test_the_arena_is_sealed_against_everyone_but_the_server(arena: Arena) -> None:
    fd = os.open(f"/proc/self/fd/{arena.fd}", os.O_RDWR)  # what a client could get
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, arena.size)  # shared and writable
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, arena.size // 2)
        private = mmap.mmap(fd, arena.size, flags=mmap.MAP_PRIVATE)
        private[0] = 0xFF  # copy-on-write: stays in this mapping
        assert arena.array[0] != 0xFF or private[0] == arena.array[0]
        arena.array[PAGE] = 3  # the server's own mapping still writes
        assert private[PAGE] == 3
        private.close()
    finally:
        os.close(fd)


def test_an_arena_faults_its_pages_in_off_the_read_path_and_keeps_what_fills_wrote() -> None:
    """``Arena._warm``: the memfd's pages are all allocated soon after the arena is made
    (``st_blocks``), and entries filled while it warms read back exactly as written."""
    a = Arena("warm", 64 << 20)
    try:
        values = [_value(random_kv(LAYOUT, 20 + i, seed=40 + i)) for i in range(6)]
        slots = [a.lease(_key(400 + i), v, 1, _copy) for i, v in enumerate(values)]
        assert a.warmed.wait(30)
        assert os.fstat(a.fd).st_blocks * 512 >= a.size
        for slot, v in zip(slots, values):
            assert slot is not None
            assert bytes(a.array[slot.offset:slot.offset + slot.length]) == v
    finally:
        a.close()


def test_an_arena_closed_while_it_warms_stops_warming() -> None:
    a = Arena("closing", 256 << 20)
    a.close()
    assert not a.warmed.wait(1)


def test_arenas_are_per_tenant_and_off_at_zero() -> None:
    arenas = Arenas(4 * PAGE)
    try:
        a, b = arenas.get("a"), arenas.get("b")
        assert a is not None and b is not None and a is arenas.get("a") and a is not b
        assert os.fstat(a.fd).st_ino != os.fstat(b.fd).st_ino
    finally:
        arenas.close()
    assert Arenas(0).get("a") is None
    with pytest.raises(ConfigError, match="shm_arena_bytes"):
        ServerConfig(shm_arena_bytes=-1)


# -- over a real server -------------------------------------------------------------------------


@pytest.fixture
def tiny(server_config: ServerConfig) -> Iterator[ServerThread]:
    """A server whose arenas hold two small entries (three pages each)."""
    with ServerThread(dataclasses.replace(server_config, shm_arena_bytes=7 * PAGE)) as st:
        yield st


def _counters(c: Client) -> dict[str, int]:
    return dict(c.stats().counters)


def test_same_host_reads_are_leased_and_equal_what_was_stored(server: ServerThread) -> None:
    kv, big = random_kv(LAYOUT, 40, seed=3), random_kv(LAYOUT, 400, seed=4)
    with Client(server.address, timeout_s=30, shm_bytes=64 << 10, keep_leases_bytes=0) as c:
        c.store(_key(1), kv, mode="raw")
        c.store(_key(2), big, mode="raw")  # larger than the client's segment
        first = c.retrieve(_key(1), layout=LAYOUT)
        assert first is not None and first.equal(kv)
        assert c.dataplane.same_host.arena is not None
        again = c.retrieve_many([_key(1), _key(2)])
        assert again[0] is not None and again[0].equal(kv)
        assert again[1] is not None and again[1].equal(big)  # leased whole, not streamed
        n = _counters(c)
        assert n["arena.fills"] == 2 and n["arena.hits"] >= 1 and n.get("retrieve.hit", 0) == 0
        got = c.fetch(_key(1))
        with Client(server.address, timeout_s=30, shm_bytes=0) as remote:
            streamed = remote.fetch(_key(1))
        assert got is not None and got.tier == "ram" and got.checked and streamed is not None
        assert got.parts.to_bytes() == streamed.parts.to_bytes()  # the stored bytes, as stored
        del first, again, got
        c.fetch_many([_key(3)])  # the next call gives the leases back
        assert _counters(c)["arena.released"] >= 3


def test_writes_into_returned_tensors_stay_with_the_reader(tiny: ServerThread) -> None:
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(4)]
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as c, \
            Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as other:
        for i, kv in enumerate(values):
            c.store(_key(i), kv, mode="raw")
        for round_ in range(3):
            for i, kv in enumerate(values):  # four entries through room for two: pages reused
                got = c.retrieve(_key(i), layout=LAYOUT)
                assert got is not None and got.equal(kv), (round_, i)
                seen = other.retrieve(_key(i), layout=LAYOUT)
                for k, v in got.layers:  # the reader scribbles over what it was given
                    k.fill_(7.0)
                    v.mul_(-3)
                assert seen is not None and seen.equal(kv)  # another reader never sees it
                del got, seen
        assert _counters(c)["arena.fills"] >= 8  # entries really went and came back
        one = c.retrieve(_key(0), layout=LAYOUT)
        two = c.retrieve(_key(0), layout=LAYOUT)  # the same entry while the first is held
        assert one is not None and two is not None
        one.layers[0][0].fill_(5.0)
        assert two.equal(values[0]) and not one.equal(values[0])  # results never alias
        three = c.retrieve(_key(0), layout=LAYOUT)
        assert three is not None and three.equal(values[0])


def test_held_entries_are_not_evicted_and_the_rest_is_copied(tiny: ServerThread) -> None:
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(3)]
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as c:
        for i, kv in enumerate(values):
            c.store(_key(i), kv, mode="raw")
        held = [c.retrieve(_key(i), layout=LAYOUT) for i in range(2)]  # the arena is full
        third = c.retrieve(_key(2), layout=LAYOUT)  # copied into the segment instead
        assert third is not None and third.equal(values[2])
        assert _counters(c)["arena.full"] >= 1
        c.store(_key(0), values[2], mode="raw")  # overwritten while held
        now = c.retrieve(_key(0), layout=LAYOUT)
        assert now is not None and now.equal(values[2])
        assert all(h is not None and h.equal(v) for h, v in zip(held, values[:2]))


def test_a_detached_client_gives_its_leases_back(tiny: ServerThread) -> None:
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(3)]
    arenas = tiny.server.servicer.arenas
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as c:
        for i, kv in enumerate(values):
            c.store(_key(i), kv, mode="raw")
        held = [c.retrieve(_key(i), layout=LAYOUT) for i in range(2)]
    assert held[0] is not None and held[0].equal(values[0])  # views outlive the client
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as d:
        got = d.retrieve(_key(2), layout=LAYOUT)
        assert got is not None and got.equal(values[2])
        assert arenas.counters()["arena.full"] == 0  # the closed client's two were freed


def _reuse_the_arena(st: ServerThread, values: list[KVCache]) -> None:
    """Another client stores ``values`` over keys 0.. and reads them twice: every page of a
    tiny arena (two entries) is written again."""
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as d:
        for i, kv in enumerate(values):
            d.store(_key(i), kv, mode="raw")
        for _ in range(2):
            for i, kv in enumerate(values):
                got = d.retrieve(_key(i), layout=LAYOUT)
                assert got is not None and got.equal(kv)
                del got


def test_what_a_closed_client_read_stays_as_it_was_read(tiny: ServerThread) -> None:
    """Raw entries read on the server's host view the read arena in place; a client that
    closes gives its leases back and the server writes other entries into those pages: what
    the caller still holds (tensors, a Fetched, its own writes into them) stays as read."""
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(5)]
    arenas = tiny.server.servicer.arenas
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as c:
        for i, kv in enumerate(values[:2]):
            c.store(_key(i), kv, mode="raw")
        got = c.retrieve(_key(0), layout=LAYOUT)
        held = c.fetch(_key(1))
        assert got is not None and held is not None
        arena = c.dataplane.same_host.arena
        assert arena is not None
        start = arena.array.ctypes.data
        assert start <= got.layers[1][0].data_ptr() < start + arena.size  # viewed in place
        got.layers[0][0].fill_(7.0)  # the caller's own write
        read = [(k.clone(), v.clone()) for k, v in got.layers]
    _reuse_the_arena(tiny, values[2:])
    assert arenas.counters()["arena.full"] == 0  # the closed client's leases were given back
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(got.layers, read))
    assert codec.decode(held.parts.to_bytes()).equal(values[1])


def test_a_closed_clients_read_only_views_stay_as_they_were_read(
        tiny: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read bound for a GPU views the server's pages read-only (registered with CUDA where
    one exists: faked here); at close they are swapped for a copy, still read-only. Where that
    can not be done, the client keeps its leases (its segment stays attached)."""
    from kdn.client import forked
    from kdn.client.shm import LeasedArena

    monkeypatch.setattr(LeasedArena, "register_with_cuda", lambda self: True)
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(5)]
    segments = tiny.server.servicer.segments
    for swapped in (True, False):
        if not swapped:
            monkeypatch.setattr(forked, "own_pages", lambda *args, **kwargs: False)
        with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as c:
            c.store(_key(0), values[0], mode="raw")
            bound = c.dataplane.get_many("default", [_key(0)], Expected(), None,
                                         pinned=True)[0]
            assert isinstance(bound, Fetched) and bound.container is not None
            assert bound.container.readonly
            read = bytes(bound.container)
            seg = c.dataplane.same_host.segment()[0]
        assert len(segments) == (0 if swapped else 1)  # Detached, or still attached
        _reuse_the_arena(tiny, values[2:] if swapped else values[3:4])
        assert bytes(bound.container) == read and bound.container.readonly
        assert codec.decode(bound.parts.to_bytes()).equal(values[0])
        if not swapped:
            seg.close()  # what the process's exit would do: the server reaps it
            assert segments.reap() == 1


def test_leases_of_a_client_that_exited_are_freed_when_the_arena_is_full(
        tiny: ServerThread) -> None:
    import subprocess
    import sys

    values = [random_kv(LAYOUT, 20, seed=i) for i in range(3)]
    with Client(tiny.address, timeout_s=30) as c:
        for i, kv in enumerate(values):
            c.store(_key(i), kv, mode="raw")
    code = ("import os; from kdn.client import Client; from tests.helpers import uniform_layout\n"
            "from kdn.client import dataplane; dataplane.SMALL_ENTRY_BYTES = 0  # leased\n"
            f"c = Client({tiny.address!r}, shm_bytes=1 << 20)\n"
            "held = [c.retrieve(bytes([i, 0, 0, 0]) * 8, layout=uniform_layout()) "
            "for i in range(2)]\n"
            "assert all(h is not None for h in held) and c.dataplane.same_host.arena is not None\n"
            "os._exit(0)  # holding both leases: no release, no Detach\n")
    root = Path(__file__).resolve().parents[1]
    arenas = tiny.server.servicer.arenas
    with Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as d:
        assert d.dataplane.attached  # before the other client exits (an Attach reaps too)
        subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
        assert arenas.counters()["arena.fills"] == 2  # the arena is full of the dead client's
        got = d.retrieve(_key(2), layout=LAYOUT)
        assert got is not None and got.equal(values[2])
        n = _counters(d)
    # reaped as its connections closed (``FastPath.ended``), or else when the arena was full
    assert n["arena.fills"] == 3 and n["arena.full"] <= 1


def test_reads_racing_overwrites_and_evictions_of_a_tiny_arena_return_whole_entries(
        tiny: ServerThread) -> None:
    """Thousands of reads while the key is overwritten and deleted and other keys push its
    copies out of a two-entry arena; every read is one stored version, whole, also though
    the reader writes into every tensor it gets (the pages are its own then)."""
    versions = [random_kv(LAYOUT, 20, seed=s) for s in range(3)]
    fillers = [random_kv(LAYOUT, 20, seed=10 + s) for s in range(3)]
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []
    with Client(tiny.address, timeout_s=30) as writer, \
            Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as reader, \
            Client(tiny.address, timeout_s=30, shm_bytes=1 << 20) as pusher:
        writer.store(_key(9), versions[0], mode="raw")
        for i, kv in enumerate(fillers):
            writer.store(_key(20 + i), kv, mode="raw")


        def push() -> None:  # other entries through the arena: the key's copy is evicted
            i = 0
            while not stop.is_set():
                i += 1
                got = pusher.retrieve(_key(20 + i % 3), layout=LAYOUT)
                if got is None or not got.equal(fillers[i % 3]):
                    errors.append("a filler read came back wrong")

        threads = [threading.Thread(target=churn, args=(writer, _key(9), versions, stop)),
                   threading.Thread(target=push)]
        for t in threads:
            t.start()
        try:
            for _ in range(2000):
                got = reader.retrieve(_key(9), layout=LAYOUT)
                if got is None:
                    seen.append(-1)
                    continue
                match = [j for j, v in enumerate(versions) if got.equal(v)]
                if len(match) != 1:
                    detail = [[j for j, v in enumerate(versions) if t.equal(v.layers[n][m])]
                              for n, layer in enumerate(got.layers)
                              for m, t in enumerate(layer)]
                    errors.append(f"a read mixed versions: {detail}")
                    break
                seen.append(match[0])
                got.layers[0][0].add_(1)  # changes of the reader's own
        finally:
            stop.set()
            for t in threads:
                t.join()
        n = _counters(reader)
    assert not errors
    assert len(set(seen)) >= 3
    assert n["arena.fills"] > 100  # copies really came and went: the pages were reused


def test_tenants_get_their_own_arena(tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  a: {api_keys: [key-a]}\n  b: {api_keys: [key-b]}\n")
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth))
    ka, kb = random_kv(LAYOUT, 8, seed=1), random_kv(LAYOUT, 8, seed=2)
    with ServerThread(cfg) as st, \
            Client(st.address, api_key="key-a", shm_bytes=1 << 20) as a, \
            Client(st.address, api_key="key-b", shm_bytes=1 << 20) as b:
        a.store(_key(1), ka, mode="raw")
        b.store(_key(1), kb, mode="raw")  # the same key name, each tenant's own value
        ga, gb = a.retrieve(_key(1), layout=LAYOUT), b.retrieve(_key(1), layout=LAYOUT)
        assert ga is not None and ga.equal(ka) and gb is not None and gb.equal(kb)
        arena_a, arena_b = a.dataplane.same_host.arena, b.dataplane.same_host.arena
        assert arena_a is not None and arena_b is not None
        assert arena_a.inode != arena_b.inode  # two memfds: a maps none of b's pages
        assert not np.array_equal(arena_a.array[: arena_a.size],
                                  arena_b.array[: arena_b.size])


def test_a_server_without_arenas_copies_into_the_segment(server_config: ServerConfig) -> None:
    kv = random_kv(LAYOUT, 8, seed=5)
    with ServerThread(dataclasses.replace(server_config, shm_arena_bytes=0)) as st, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c:
        c.store(_key(1), kv, mode="raw")
        got = c.retrieve(_key(1), layout=LAYOUT)
        assert got is not None and got.equal(kv)
        assert c.dataplane.attached and c.dataplane.same_host.arena is None
        assert _counters(c).get("arena.fills", 0) == 0


def test_a_read_bound_for_a_gpu_views_the_servers_pages_read_only(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leased entry bound for a CUDA device is viewed through the arena's shared read-only
    mapping (registered with CUDA where one exists: faked here), not the copy-on-write one:
    the bytes are the server's, nothing can write them, a copy to the device reads them in
    place, and the lease goes back when the view dies."""
    from kdn.client.shm import LeasedArena

    monkeypatch.setattr(LeasedArena, "register_with_cuda", lambda self: True)
    kv = random_kv(LAYOUT, 40, seed=5)
    with Client(server.address, timeout_s=30, shm_bytes=64 << 10, keep_leases_bytes=0) as c:
        c.store(_key(1), kv, mode="raw")
        plain = c.dataplane.get_many("default", [_key(1)], Expected(), None)[0]
        bound = c.dataplane.get_many("default", [_key(1)], Expected(), None, pinned=True)[0]
        assert plain is not None and bound is not None
        assert not plain.container.readonly and bound.container.readonly  # type: ignore[union-attr]
        assert bytes(bound.container) == bytes(plain.container)  # type: ignore[arg-type]
        arena = c.dataplane.same_host.arena
        assert arena is not None
        base = np.frombuffer(bound.container, dtype=np.uint8)  # type: ignore[arg-type]
        assert arena._source.ctypes.data <= base.ctypes.data < arena._source.ctypes.data \
            + arena.size  # the shared mapping's own pages, not a copy
        got = c.retrieve(_key(1), layout=LAYOUT)  # a CPU read still gets writable tensors
        assert got is not None and got.equal(kv)
        got.layers[0][0].fill_(1.0)
        released = _counters(c).get("arena.released", 0)
        del plain, bound, base, got
        c.fetch_many([_key(9)])
        assert _counters(c)["arena.released"] >= released + 2


@pytest.mark.gpu
def test_a_gpu_read_of_a_leased_entry_copies_from_the_registered_arena(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kv = random_kv(LAYOUT, 40, seed=6)
    with Client(server.address, timeout_s=30, shm_bytes=64 << 10) as c:
        c.store(_key(1), kv, mode="raw")
        staged = count_staging_copies(monkeypatch)
        back = c.retrieve(_key(1), layout=LAYOUT, device="cuda")
        assert back is not None and all(k.is_cuda and v.is_cuda for k, v in back.layers)
        assert back.to("cpu").equal(kv)
        arena = c.dataplane.same_host.arena
        assert arena is not None and arena.register_with_cuda()
        assert _counters(c)["arena.fills"] >= 1 and not staged  # read where the server wrote it
