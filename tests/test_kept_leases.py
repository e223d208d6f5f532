"""Kept leases (kdn.server.arena, kdn.client.shm.LeasedArena.keep/reuse): a same-host client
reads an entry again from the lease it already holds, without a call, while the arena's word
for the slot still holds the slot's generation. The arena's words on their own, then over a
real server: repeat reads make no call, every read after a write or delete sees it (another
client's too), reads racing writes return one stored version whole, writes into returned
tensors never show in the next read, entries with a time to live and evicted ones ask again,
the kept bytes stay bounded and their leases go back, a lease answered with a word outside
the arena is not kept, and a server that went away is not read from."""

from __future__ import annotations

import time

import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import LayoutMismatch
from kdn.layout import Expected
from kdn.options import StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, WORD, Arena
from tests.helpers import copy_into as _copy
from tests.helpers import leased_small_entries, random_kv, read_while_churned, uniform_layout
from tests.helpers import numbered_key as _key
from tests.helpers import raw_entry as _value

LAYOUT = uniform_layout()


@pytest.fixture(autouse=True)
def _small_entries_leased(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests lease small entries (``tests.helpers.leased_small_entries``)."""
    leased_small_entries(monkeypatch)


def _word(arena: Arena, at: int) -> int:
    return int(arena.array[at : at + WORD].view("<u8")[0])


# -- the arena's words --------------------------------------------------------------------------


def test_a_slot_holds_its_generation_while_indexed_and_zero_once_dropped(arena: Arena) -> None:
    old, new = _value(random_kv(LAYOUT, 20, seed=1)), _value(random_kv(LAYOUT, 20, seed=2))
    one = arena.lease(b"k", old, 1, _copy)
    other = arena.lease(b"j", new, 1, _copy)
    assert one is not None and other is not None and one.generation != other.generation
    assert _word(arena, one.start) == one.generation and one.start + WORD <= one.offset
    assert bytes(arena.array[one.offset : one.offset + one.length]) == old
    two = arena.lease(b"k", new, 2, _copy)  # another value of the key: the old copy's word goes
    assert two is not None and two is not one and _word(arena, one.start) == 0
    assert _word(arena, two.start) == two.generation
    assert bytes(arena.array[one.offset : one.offset + one.length]) == old  # held: whole
    arena.drop(b"k")
    assert _word(arena, two.start) == 0 and _word(arena, other.start) == other.generation


# -- over a real server -------------------------------------------------------------------------


def _hits(c: Client) -> int:
    return int(dict(c.stats().counters).get("getmany.hit", 0))


def test_a_repeat_read_is_answered_from_the_kept_lease_without_a_call(
        server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 40, seed=3)
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as c:
        c.store(_key(1), kv, mode="raw")
        first = c.retrieve(_key(1), layout=LAYOUT)
        arena = c.dataplane.same_host.arena
        assert first is not None and first.equal(kv) and arena is not None
        calls = _hits(c)
        for _ in range(20):
            got = c.retrieve(_key(1), layout=LAYOUT)
            assert got is not None and got.equal(kv)
            fetched = c.fetch(_key(1), layout=LAYOUT)
            assert fetched is not None and fetched.checked
            assert codec.decode(fetched.parts.to_bytes()).equal(kv)
        assert _hits(c) == calls and arena.reused == 40  # not one call
        bound = c.dataplane.get_many("default", [_key(1)], Expected.of(LAYOUT), None,
                                     pinned=True)[0]  # a GPU-bound read of a kept lease
        assert bound is not None and codec.decode(bound.parts.to_bytes()).equal(kv)
        with pytest.raises(LayoutMismatch):  # another layout asked for: the server answers
            c.retrieve(_key(1), layout=uniform_layout(layers=3))


def test_a_read_whose_value_is_overwritten_while_it_is_copied_is_not_kept(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena copy of the old value lands after the write answered: the read itself may
    return the old value (it began first), but the next read must ask and see the new one."""
    import kdn.server.batch as batch

    old, new = random_kv(LAYOUT, 20, seed=1), random_kv(LAYOUT, 20, seed=2)
    real = batch.copy_checked
    with Client(server.address, timeout_s=30, shm_bytes=0) as writer, \
            Client(server.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        writer.store(_key(8), old, mode="raw")
        armed = [True]

        def copy_then_overwrite(dst: memoryview, value: bytes | memoryview, **kw: object
                                ) -> None:
            real(dst, value, **kw)  # type: ignore[arg-type]
            if armed[0]:  # the fill into the arena is done, its answer not yet given
                armed[0] = False
                writer.store(_key(8), new, mode="raw")

        monkeypatch.setattr(batch, "copy_checked", copy_then_overwrite)
        first = reader.retrieve(_key(8), layout=LAYOUT)
        assert not armed[0] and first is not None and first.equal(old)
        for _ in range(3):
            got = reader.retrieve(_key(8), layout=LAYOUT)
            assert got is not None and got.equal(new)


def test_every_read_after_a_write_or_delete_sees_it(server: ServerThread) -> None:
    """Read-your-writes, and another client's writes once they were answered: a thousand
    stores and deletes, each followed by reads of the one client and of the other."""
    versions = [random_kv(LAYOUT, 20, seed=s) for s in range(3)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as a, \
            Client(server.address, timeout_s=30, shm_bytes=4 << 20) as b:
        for i in range(1000):
            writer = a if i % 2 else b
            if i % 5 == 4:
                writer.delete(_key(7))
                want = None
            else:
                want = versions[i % 3]
                writer.store(_key(7), want, mode="raw")
            for reader in (a, b, a):  # the second read of a: from its kept lease
                got = reader.retrieve(_key(7), layout=LAYOUT)
                if want is None:
                    assert got is None, i
                else:
                    assert got is not None and got.equal(want), i
        assert a.dataplane.same_host.arena is not None and a.dataplane.same_host.arena.reused >= 700


def test_reads_from_kept_leases_racing_writes_return_one_version_whole(
        server: ServerThread) -> None:
    versions = [random_kv(LAYOUT, 20, seed=s) for s in range(3)]
    with Client(server.address, timeout_s=30) as writer, \
            Client(server.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        writer.store(_key(9), versions[0], mode="raw")
        seen = read_while_churned(writer, reader, _key(9), versions, 3000, LAYOUT, touch=True)
        reused = reader.dataplane.same_host.arena.reused  # type: ignore[union-attr]
    assert len(set(seen)) >= 3 and reused > 0


def test_writes_into_a_read_never_show_in_the_next_read_of_the_kept_lease(
        server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 40, seed=4)
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as c:
        c.store(_key(2), kv, mode="raw")
        for _ in range(5):
            got = c.retrieve(_key(2), layout=LAYOUT)
            assert got is not None and got.equal(kv)
            for k, v in got.layers:
                k.fill_(7.0)
                v.zero_()
            held = c.retrieve(_key(2), layout=LAYOUT)  # while the first is alive: a copy
            assert held is not None and held.equal(kv)
            del got, held
        assert c.dataplane.same_host.arena is not None and c.dataplane.same_host.arena.reused >= 9


def test_entries_with_a_time_to_live_and_evicted_ones_are_asked_for_again(
        server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 20, seed=5)
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as c, \
            AdminClient(server.address, timeout_s=30) as admin:
        c.store(_key(3), kv, mode="raw", options=StoreOptions(ttl_s=60))
        for _ in range(3):
            got = c.retrieve(_key(3), layout=LAYOUT)
            assert got is not None and got.equal(kv)
        arena = c.dataplane.same_host.arena
        assert arena is not None and arena.reused == 0 and arena.kept_bytes == 0
        c.store(_key(4), kv, mode="raw")
        assert c.retrieve(_key(4), layout=LAYOUT) is not None and arena.kept_bytes > 0
        assert admin.evict([_key(4)], tier="ram") == 1  # still on disk: read from there
        calls = _hits(c)
        got = c.retrieve(_key(4), layout=LAYOUT)
        assert got is not None and got.equal(kv) and _hits(c) == calls + 1


def test_kept_leases_stay_within_their_bytes_and_go_back(server: ServerThread) -> None:
    values = [random_kv(LAYOUT, 20, seed=i) for i in range(12)]
    arenas = server.server.servicer.arenas  # type: ignore[union-attr]
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as probe:
        size = probe.store(_key(0), values[0], mode="raw").stored_bytes
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20,
                keep_leases_bytes=3 * size) as c:
        for i, kv in enumerate(values):
            c.store(_key(i), kv, mode="raw")
            assert c.retrieve(_key(i), layout=LAYOUT) is not None
        arena = c.dataplane.same_host.arena
        assert arena is not None and arena.kept_bytes == 3 * size and len(arena._kept) == 3
        c.fetch_many([_key(99)])  # carries the leases given back
        held = [s for a in arenas._by_tenant.values() for s in a._index.values() if s.leases]
        assert len(held) == 3  # the three most recent, kept; the rest went back
        calls = _hits(c)
        assert all(c.retrieve(_key(i), layout=LAYOUT) is not None for i in (9, 10, 11))
        assert _hits(c) == calls
    time.sleep(0.1)
    held = [s for a in arenas._by_tenant.values() for s in a._index.values() if s.leases]
    assert not held  # detached: every lease went back


def test_a_lease_whose_word_lies_outside_the_arena_is_not_kept(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 20, seed=6)
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as c:
        c.store(_key(5), kv, mode="raw")
        assert c.retrieve(_key(5), layout=LAYOUT) is not None
        arena = c.dataplane.same_host.arena
        assert arena is not None
        kept = next(iter(arena._kept.values()))
        for at in (arena.size, arena.size - 4, kept.word * WORD + 3, kept.offset + 8):
            arena.keep("bad", kept.lease, kept.offset, kept.length, at, kept.generation, "ram")
            assert "bad" not in arena._kept, at
        arena.keep("bad", kept.lease, kept.offset, arena.size, kept.word * WORD,
                   kept.generation, "ram")  # an entry running past the arena
        assert "bad" not in arena._kept
        got = c.retrieve(_key(5), layout=LAYOUT)
        assert got is not None and got.equal(kv)


def test_kept_leases_of_a_server_that_went_away_are_not_read(
        server_config: ServerConfig) -> None:
    """A server that exits (its connections close) leaves its arena mapped in the client with
    the last words it wrote: the client must not answer from them any more."""
    from kdn.client import Retry
    from kdn.errors import KDNError

    kv = random_kv(LAYOUT, 20, seed=7)
    st = ServerThread(server_config).start()
    try:
        c = Client(st.address, timeout_s=5, shm_bytes=1 << 20, retry=Retry(retries=0))
        c.store(_key(6), kv, mode="raw")
        assert c.retrieve(_key(6), layout=LAYOUT) is not None
        arena = c.dataplane.same_host.arena
        assert arena is not None and arena.kept_bytes > 0 and c.dataplane.same_host.server_alive()
    finally:
        st.stop()
    time.sleep(0.2)
    assert not c.dataplane.same_host.server_alive()
    try:
        got = c.retrieve(_key(6), layout=LAYOUT)
    except KDNError:
        got = None  # asked the server, which is gone
    assert got is None and arena.kept_bytes == 0 and arena.reused == 0
    c.close()


def test_a_full_arena_asks_clients_for_the_leases_they_keep(
        server_config: ServerConfig) -> None:
    """One client keeps leases on every entry a small arena holds; another's read finds no
    room (it is copied through its segment) and raises the arena's pressure word; the first
    client's next read gives its kept leases back, and the other's next read is leased."""
    import dataclasses

    values = [random_kv(LAYOUT, 20, seed=i) for i in range(3)]
    config = dataclasses.replace(server_config, shm_arena_bytes=7 * PAGE)  # header + 2 entries
    with ServerThread(config) as st, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20, keep_leases_bytes=1 << 20) as a, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20) as b:
        for i, kv in enumerate(values):
            a.store(_key(i), kv, mode="raw")
        for i in range(2):
            got = a.retrieve(_key(i), layout=LAYOUT)
            assert got is not None and got.equal(values[i])
        arena = a.dataplane.same_host.arena
        assert arena is not None and len(arena._kept) == 2 and not arena.pressed()
        got = b.retrieve(_key(2), layout=LAYOUT)  # no room: through b's segment
        assert got is not None and got.equal(values[2])
        assert _counters(b)["arena.full"] >= 1 and arena.pressed()
        again = a.retrieve(_key(0), layout=LAYOUT)  # gives its kept leases back, asks
        assert again is not None and again.equal(values[0]) and len(arena._kept) <= 1
        del got, again
        fills = _counters(b)["arena.fills"]
        got = b.retrieve(_key(2), layout=LAYOUT)
        assert got is not None and got.equal(values[2])
        assert _counters(b)["arena.fills"] == fills + 1  # leased now: there was room


def _counters(c: Client) -> dict[str, int]:
    return dict(c.stats().counters)
