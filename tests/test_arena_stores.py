"""Same-host stores kept in the read arena (kdn.server.arena.Arena.reserve/publish): a PutMany
entry is copied out of the client's segment straight into its tenant's arena and the RAM tier
keeps it there, so its first same-host read copies nothing. The arena alone (a reserved slot's
lease follows the view, half the arena at most), then over a real server: reads equal what was
stored without a fill, an overwrite or delete while a reader holds the old entry leaves it
whole, the slot goes back with the RAM value, remote reads and TTL entries work, a damaged
entry is refused with its slot given back, and thousands of reads racing same-host overwrites
through a small arena each return one stored version, whole."""

from __future__ import annotations

import gc

import pytest

from kdn import codec
from kdn.client import Client
from kdn.codec.format import Header
from kdn.errors import InvalidArgument
from kdn.options import StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, Arena
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key as _key
from tests.helpers import random_kv, read_while_churned, uniform_layout, without_directory
from tests.helpers import raw_entry as _value

LAYOUT = uniform_layout()


@pytest.fixture(autouse=True)
def _not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads as they go for an entry the read arena's directory does not list
    (``tests/test_directory.py`` covers listed ones)."""
    without_directory(monkeypatch)



def _never(dst: memoryview, value: bytes | memoryview) -> None:
    raise AssertionError("an entry published in the arena was copied again")


def test_a_reserved_slot_is_held_by_its_view_and_read_without_a_fill(arena: Arena) -> None:
    value = _value(random_kv(LAYOUT, 20, seed=1))
    got = arena.reserve(len(value), codec.format.header_size(value))
    assert got is not None
    slot, view = got
    view[:] = value
    stored = view.toreadonly()  # what the RAM tier keeps
    del view, got
    arena.publish(slot, b"k", 5)
    assert arena.stored_bytes == len(value) and slot.leases == 1
    read = arena.lease(b"k", stored, 5, _never)
    assert read is slot and slot.leases == 2
    assert bytes(arena.array[slot.offset : slot.offset + slot.length]) == value
    arena.release(slot)
    del stored
    gc.collect()
    assert arena.stored_bytes == 0 and slot.leases == 0 and slot.indexed  # a cached copy now
    arena.drop(b"k")
    assert arena.used_bytes == 0


def test_reserved_slots_take_half_the_arena_at_most() -> None:
    arena = Arena("t", 64 * PAGE)
    held = []
    while (got := arena.reserve(4 * PAGE, 64)) is not None:  # five pages a slot: room for 12
        held.append(got)
    assert arena.stored_bytes <= arena.size // 2 < arena.stored_bytes + 4 * PAGE
    held.clear()
    gc.collect()
    assert arena.stored_bytes == 0 and arena.used_bytes == 0  # unpublished: freed
    arena.close()


# -- over a real server -------------------------------------------------------------------------


def _counters(c: Client) -> dict[str, int]:
    return dict(c.stats().counters)


def _arena(server: ServerThread) -> Arena:
    arenas = server.server.servicer.arenas  # type: ignore[union-attr]
    return next(iter(arenas._by_tenant.values()))


def test_the_first_read_of_a_same_host_store_copies_nothing(server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 400, seed=i) for i in range(3)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c, \
            Client(server.address, timeout_s=30, shm_bytes=0) as remote:
        for i, kv in enumerate(kvs):
            c.store(_key(i), kv, mode="raw")
        arena = _arena(server)
        assert arena.stored_bytes > 0
        before = _counters(c)
        got = c.retrieve_many([_key(i) for i in range(3)], layout=LAYOUT)
        assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
        after = _counters(c)
        assert after["arena.fills"] == before.get("arena.fills", 0)  # no copy into the arena
        assert after["arena.hits"] >= before.get("arena.hits", 0) + 3
        far = remote.retrieve(_key(1), layout=LAYOUT)  # a remote read of the arena's bytes
        assert far is not None and far.equal(kvs[1])


def test_an_overwrite_or_delete_leaves_a_held_entry_whole_and_frees_its_slot_after(
        server: ServerThread) -> None:
    old, new = random_kv(LAYOUT, 400, seed=1), random_kv(LAYOUT, 400, seed=2)
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20, keep_leases_bytes=0) as c:
        c.store(_key(1), old, mode="raw")
        arena = _arena(server)
        one = arena.stored_bytes
        held = c.fetch(_key(1), layout=LAYOUT)  # a view of the arena slot, leased
        c.store(_key(1), new, mode="raw")
        got = c.retrieve(_key(1), layout=LAYOUT)
        assert got is not None and got.equal(new)
        assert held is not None and codec.decode(held.parts.to_bytes()).equal(old)
        gc.collect()
        assert arena.stored_bytes == one  # the old value left the RAM tier: its slot too
        c.delete(_key(1))
        gc.collect()
        assert arena.stored_bytes == 0 and c.retrieve(_key(1)) is None
        del held, got
        c.fetch_many([_key(9)])  # gives the leases back
        gc.collect()
        assert arena.used_bytes == 0


def test_entries_with_a_time_to_live_live_in_the_arena_too(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 400, seed=3)
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        c.store(_key(2), kv, mode="raw", options=StoreOptions(ttl_s=60))
        fills = _counters(c).get("arena.fills", 0)
        got = c.retrieve(_key(2), layout=LAYOUT)
        assert got is not None and got.equal(kv) and _counters(c)["arena.fills"] == fills
        arena = c.dataplane.same_host.arena
        assert arena is not None and arena.kept_bytes == 0


def test_a_damaged_entry_is_refused_and_its_slot_given_back(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 400, seed=4)
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        c.store(_key(3), kv, mode="raw")
        arena = _arena(server)
        stored, used = arena.stored_bytes, arena.used_bytes
        seg, seg_id = c.dataplane.segment()
        data = bytearray(codec.encode_parts(random_kv(LAYOUT, 400, seed=5), "raw").to_bytes())
        data[-10] ^= 0x01  # a flipped bit in the last frame
        at = seg.regions.alloc(len(data))
        seg.write(at, bytes(data))
        req = pb.PutManyRequest(namespace="default", segment_id=seg_id)
        item = req.items.add(key=_key(3))
        item.region.offset, item.region.length = at, len(data)
        with pytest.raises(InvalidArgument, match="corrupt"):
            c.dataplane._put(req, None)
        seg.regions.free(at, len(data))
        gc.collect()
        assert arena.stored_bytes == stored and arena.used_bytes == used  # given back
        got = c.retrieve(_key(3), layout=LAYOUT)
        assert got is not None and got.equal(kv)  # the stored entry untouched


def test_a_batchs_later_entries_are_copied_on_the_copy_thread_and_checked_in_order(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A same-host PutMany large enough to share copies its later entries on the copy thread
    while the call's own copies the earlier ones (each checked on the thread that copied it):
    all stored when sound; a damaged entry, a region outside the segment among the later
    ones or an unknown durability among either refuses the whole call by its index, stores
    none of it, leaves the stored value and gives every slot back."""
    import threading

    import kdn.server.putmany as putmany

    monkeypatch.setattr(putmany, "PARALLEL_PUT_BYTES", 1)  # every batch of two or more shares
    threads: set[str] = set()
    real = putmany.copy_checked

    def seen(dst: memoryview, value: bytes | memoryview, **kw: object) -> Header:
        threads.add(threading.current_thread().name)
        return real(dst, value, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(putmany, "copy_checked", seen)
    kvs = [random_kv(LAYOUT, 300, seed=40 + i) for i in range(4)]
    with Client(server.address, timeout_s=30, shm_bytes=8 << 20, keep_leases_bytes=0) as c:
        c.store(_key(40), kvs[0], mode="raw")
        arena = _arena(server)
        stored, used = arena.stored_bytes, arena.used_bytes
        seg, seg_id = c.dataplane.segment()

        def call(damage: int | None = None, outside: int | None = None,
                 durability: int | None = None) -> pb.PutManyRequest:
            req = pb.PutManyRequest(namespace="default", segment_id=seg_id)
            for i, kv in enumerate(kvs):
                data = bytearray(codec.encode_parts(kv, "raw").to_bytes())
                if i == damage:
                    data[-10] ^= 0x01
                at = seg.regions.alloc(len(data))
                assert at is not None
                seg.write(at, bytes(data))
                item = req.items.add(key=_key(40 + i))
                if i == durability:
                    item.options.durability = 99
                item.region.offset = seg.size if i == outside else at
                item.region.length = len(data)
            return req

        def free(req: pb.PutManyRequest) -> None:
            for item in req.items:
                if item.region.offset < seg.size:
                    seg.regions.free(item.region.offset, item.region.length)

        for damage, outside, durability, match in (
                (3, None, None, "item 3: corrupt"), (None, 2, None, "item 2: region"),
                (None, None, 3, "item 3: unknown durability 99"),
                (None, None, 1, "item 1: unknown durability 99")):
            threads.clear()
            req = call(damage, outside, durability)
            with pytest.raises(InvalidArgument, match=match):
                c.dataplane._put(req, None)
            free(req)
            assert any(t.startswith("kdn-copy") for t in threads), threads
            gc.collect()
            assert arena.stored_bytes == stored and arena.used_bytes == used
            assert [i.present for i in c.lookup([_key(41), _key(42), _key(43)]).infos] == \
                [False] * 3
            got = c.retrieve(_key(40), layout=LAYOUT)
            assert got is not None and got.equal(kvs[0])
        threads.clear()
        req = call()
        c.dataplane._put(req, None)
        free(req)
        assert any(t.startswith("kdn-copy") for t in threads), threads
        for i, kv in enumerate(kvs):
            got = c.retrieve(_key(40 + i), layout=LAYOUT)
            assert got is not None and got.equal(kv)


def test_reads_racing_same_host_overwrites_of_a_small_arena_return_one_version_whole(
        server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of reads (kept leases, leases, copies) while a same-host writer overwrites
    and deletes the key, its entries stored into an arena with room for a few of them, and
    another reader pushes other entries through it: every read is one stored version, whole,
    though the reader writes into every tensor it gets."""
    import dataclasses
    import threading

    versions = [random_kv(LAYOUT, 160, seed=s) for s in range(3)]  # ~80 KB: stored in the arena
    fillers = [random_kv(LAYOUT, 160, seed=10 + s) for s in range(3)]
    config = dataclasses.replace(server_config, shm_arena_bytes=160 * PAGE)
    real, reserved = Arena.reserve, [0]

    def counted(self: Arena, length: int, head: int) -> object:
        got = real(self, length, head)
        reserved[0] += got is not None
        return got

    monkeypatch.setattr(Arena, "reserve", counted)
    with ServerThread(config) as st, \
            Client(st.address, timeout_s=30, shm_bytes=4 << 20) as writer, \
            Client(st.address, timeout_s=30, shm_bytes=4 << 20) as reader, \
            Client(st.address, timeout_s=30, shm_bytes=4 << 20) as pusher, \
            Client(st.address, timeout_s=30, shm_bytes=0) as remote:
        writer.store(_key(9), versions[0], mode="raw")
        for i, kv in enumerate(fillers):  # not in the arena: read into it by the pusher
            remote.store(_key(20 + i), kv, mode="raw")
        assert _arena(st).stored_bytes > 0
        stop = threading.Event()
        wrong: list[int] = []

        def push() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                got = pusher.retrieve(_key(20 + i % 3), layout=LAYOUT)
                if got is None or not got.equal(fillers[i % 3]):
                    wrong.append(i)

        thread = threading.Thread(target=push)
        thread.start()
        try:
            seen = read_while_churned(writer, reader, _key(9), versions, 2000, LAYOUT,
                                      touch=True)
        finally:
            stop.set()
            thread.join()
        fills = _counters(reader)["arena.fills"]
    assert not wrong and len(set(seen)) >= 3 and fills > 100 and reserved[0] > 100
