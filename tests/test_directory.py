"""The read arena's directory (kdn.transport.directory): small entries a same-host client reads
with no call. The table alone (listing, dropping, full sets, torn reads), then over a real
server: reads make no call yet never return a value the server no longer holds (overwrites,
deletes, racing writers), entries with a time to live and other layouts go to the server,
tenants and namespaces stay apart, a server that went away is not read from."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kdn import codec
from kdn.client import Client, Retry, dataplane
from kdn.client.admin import AdminClient
from kdn.client.shm import LeasedArena
from kdn.errors import KDNError, LayoutMismatch
from kdn.options import StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, Arena
from kdn.transport import directory
from tests.helpers import copy_into as _copy
from tests.helpers import numbered_key as _key
from tests.helpers import random_kv, read_while_churned, uniform_layout
from tests.helpers import raw_entry as _value

LAYOUT = uniform_layout()
ARENA_BYTES = 4 << 20


# -- the table alone ----------------------------------------------------------------------------


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena("t", ARENA_BYTES)
    yield a
    a.close()


def _find(arena: Arena, namespace: str, key: bytes) -> bytes | None:
    """A client's read of ``arena``'s directory (through its own read-only mapping)."""
    geo = directory.read_geometry(arena.array.view(np.uint64), arena.size)
    assert geo is not None
    got = directory.find(arena.array.view(np.uint64), arena.array, *geo,
                         directory.tag(namespace, key), arena.size)
    return None if got is None else bytes(got[0])


def _skey(namespace: str, key: bytes) -> bytes:
    return f"{namespace}/{key.hex()}".encode()


def _listed(arena: Arena, namespace: str, key: bytes, value: bytes, stamp: int = 1) -> None:
    slot = arena.lease(_skey(namespace, key), value, stamp, _copy)
    assert slot is not None and arena.enlist(slot)
    arena.release(slot)


def test_a_listed_entry_is_found_whole_and_a_dropped_one_is_not(arena: Arena) -> None:
    one, two = _value(random_kv(LAYOUT, 20, seed=1)), _value(random_kv(LAYOUT, 20, seed=2))
    _listed(arena, "ns", b"a" * 32, one)
    _listed(arena, "ns", b"b" * 32, two)
    assert _find(arena, "ns", b"a" * 32) == one and _find(arena, "ns", b"b" * 32) == two
    assert _find(arena, "other", b"a" * 32) is None  # the namespace is part of the name
    assert _find(arena, "ns", b"c" * 32) is None
    arena.drop(_skey("ns", b"a" * 32))  # written again or deleted: gone before the call answers
    assert _find(arena, "ns", b"a" * 32) is None and _find(arena, "ns", b"b" * 32) == two
    _listed(arena, "ns", b"b" * 32, one, stamp=2)  # a new value replaces the old one's bucket
    assert _find(arena, "ns", b"b" * 32) == one


def test_a_full_set_lists_the_newest_and_a_large_entry_is_never_listed(arena: Arena) -> None:
    geo = directory.read_geometry(arena.array.view(np.uint64), arena.size)
    assert geo is not None
    sets = geo[1]
    same_set: list[bytes] = []  # keys whose names fall into one set
    i = 0
    while len(same_set) < directory.WAYS + 2:
        k = i.to_bytes(32, "little")
        if directory.tag("ns", k)[0] % sets == 0:
            same_set.append(k)
        i += 1
    values = [_value(random_kv(LAYOUT, 4, seed=j)) for j in range(len(same_set))]
    for k, v in zip(same_set, values):
        _listed(arena, "ns", k, v)
    found = [_find(arena, "ns", k) for k in same_set]
    assert sum(f is not None for f in found) == directory.WAYS  # a set holds WAYS buckets
    assert found[-1] == values[-1]  # the newest is listed
    assert all(f is None or f == v for f, v in zip(found, values))  # never another's bytes
    big = _value(random_kv(LAYOUT, 2000, seed=9))  # 64 KiB and more: leased, never copied
    assert len(big) >= 64 << 10
    slot = arena.lease(_skey("ns", b"z" * 32), big, 1, _copy)
    assert slot is not None and not arena.enlist(slot)
    assert _find(arena, "ns", b"z" * 32) is None


def test_an_entry_whose_slot_changes_while_it_is_copied_is_not_returned(arena: Arena) -> None:
    """The reader checks the slot's word before and after it copies: a slot dropped (and its
    pages reused) between the two is never handed out, torn or stale."""
    value = _value(random_kv(LAYOUT, 20, seed=3))
    _listed(arena, "ns", b"a" * 32, value)
    words = arena.array.view(np.uint64)
    geo = directory.read_geometry(words, arena.size)
    assert geo is not None

    class Racing:
        """The arena's bytes, dropping the entry as the reader copies them."""

        def __getitem__(self, index: slice) -> np.ndarray:
            out = arena.array[index].copy()
            arena.drop(_skey("ns", b"a" * 32))
            return out

    got = directory.find(words, Racing(), *geo, directory.tag("ns", b"a" * 32), arena.size)
    assert got is None and _find(arena, "ns", b"a" * 32) is None


def test_a_header_that_does_not_fit_the_arena_gives_no_directory() -> None:
    words = np.zeros(PAGE // 8, dtype=np.uint64)
    assert directory.read_geometry(words, PAGE) is None  # no magic
    words[directory.HEADER_MAGIC] = directory.MAGIC
    words[directory.HEADER_OFFSET], words[directory.HEADER_SETS] = PAGE, 16
    assert directory.read_geometry(words, PAGE) is None  # past its end
    words[directory.HEADER_SETS] = 3
    assert directory.read_geometry(words, 1 << 20) is None  # not a power of two
    words[directory.HEADER_SETS] = 4
    assert directory.read_geometry(words, 1 << 20) == (PAGE // 8, 4)


def test_a_small_arena_keeps_no_directory() -> None:
    a = Arena("t", 8 * PAGE)
    try:
        assert directory.read_geometry(a.array.view(np.uint64), a.size) is None
        value = _value(random_kv(LAYOUT, 4, seed=1))
        slot = a.lease(b"ns/" + b"00" * 32, value, 1, _copy)
        assert slot is not None and not a.enlist(slot)  # all its pages stay for entries
    finally:
        a.close()


# -- over a real server -------------------------------------------------------------------------


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return dataclasses.replace(server_config, shm_arena_bytes=ARENA_BYTES)


@pytest.fixture
def st(config: ServerConfig) -> Iterator[ServerThread]:
    with ServerThread(config) as s:
        yield s


def _calls(c: Client) -> int:
    n = dict(c.stats().counters)
    return int(n.get("getmany.hit", 0)) + int(n.get("getmany.miss", 0))


def _arena(c: Client) -> LeasedArena:
    arena = c.dataplane.same_host.arena
    assert arena is not None
    return arena


def test_a_small_entry_is_read_without_a_call_the_first_time(st: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 20, seed=i) for i in range(6)]
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as writer, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        assert reader.fetch(_key(99)) is None  # attached: the tenant's arena is made
        for i, kv in enumerate(kvs):
            writer.store(_key(i), kv, mode="raw")
        before = _calls(reader)
        for i, kv in enumerate(kvs):  # another client's entries, never read before
            got = reader.retrieve(_key(i), layout=LAYOUT)
            assert got is not None and got.equal(kv)
        batch = reader.retrieve_many([_key(i) for i in range(6)], layout=LAYOUT)
        assert all(g is not None and g.equal(kv) for g, kv in zip(batch, kvs))
        fetched = reader.fetch(_key(0), layout=LAYOUT)
        assert fetched is not None and codec.decode(fetched.parts.to_bytes()).equal(kvs[0])
        assert _calls(reader) == before and _arena(reader).found == 13  # not one call
        with pytest.raises(LayoutMismatch):  # another layout asked for: the server answers
            reader.retrieve(_key(0), layout=uniform_layout(layers=3))
        assert reader.retrieve(_key(50), layout=LAYOUT) is None  # not stored: asked


def test_an_entry_stored_before_the_arena_was_made_is_listed_by_its_first_read(
        st: ServerThread) -> None:
    kv = random_kv(LAYOUT, 20, seed=4)
    with Client(st.address, timeout_s=30, shm_bytes=0) as remote:
        remote.store(_key(1), kv, mode="raw")  # no same-host client yet: no arena
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c:
        first = c.retrieve(_key(1), layout=LAYOUT)  # asked (inline), and listed
        assert first is not None and first.equal(kv) and _arena(c).found == 0
        calls = _calls(c)
        again = c.retrieve(_key(1), layout=LAYOUT)
        assert again is not None and again.equal(kv)
        assert _calls(c) == calls and _arena(c).found == 1


def test_every_read_after_a_write_or_delete_sees_it(st: ServerThread) -> None:
    versions = [random_kv(LAYOUT, 20, seed=i) for i in range(3)]
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as writer, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        assert reader.fetch(_key(99)) is None
        for round_ in range(6):
            v = versions[round_ % 3]
            writer.store(_key(1), v, mode="raw")
            got = reader.retrieve(_key(1), layout=LAYOUT)
            assert got is not None and got.equal(v)
        writer.delete(_key(1))
        assert reader.retrieve(_key(1), layout=LAYOUT) is None
        assert _arena(reader).found >= 5


def test_reads_racing_writes_and_deletes_return_one_version_whole(st: ServerThread) -> None:
    versions = [random_kv(LAYOUT, 20, seed=i) for i in range(4)]
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as writer, \
            Client(st.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        assert reader.fetch(_key(99)) is None
        seen = read_while_churned(writer, reader, _key(2), versions, 400, LAYOUT, touch=True)
        assert len(set(seen) - {-1}) >= 2 and _arena(reader).found > 0


def test_an_entry_with_a_time_to_live_is_not_listed(st: ServerThread) -> None:
    kv = random_kv(LAYOUT, 20, seed=5)
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c:
        assert c.fetch(_key(99)) is None
        c.store(_key(3), kv, mode="raw", options=StoreOptions(ttl_s=60))
        for _ in range(3):
            got = c.retrieve(_key(3), layout=LAYOUT)
            assert got is not None and got.equal(kv)
        assert _arena(c).found == 0  # its expiry would pass unseen: asked each time


def test_tenants_and_namespaces_read_only_their_own(tmp_path: Path, config: ServerConfig
                                                    ) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  a: {api_keys: [key-a]}\n  b: {api_keys: [key-b]}\n")
    auth.chmod(0o600)
    ka, kb, kn = (random_kv(LAYOUT, 8, seed=i) for i in range(3))
    with ServerThread(dataclasses.replace(config, auth_file=str(auth))) as s, \
            Client(s.address, api_key="key-a", shm_bytes=1 << 20) as a, \
            Client(s.address, api_key="key-b", shm_bytes=1 << 20) as b:
        assert a.fetch(_key(99)) is None and b.fetch(_key(99)) is None
        a.store(_key(1), ka, mode="raw")
        a.store(_key(1), kn, mode="raw", namespace="other")
        assert b.retrieve(_key(1), layout=LAYOUT) is None  # a's entry: not b's to find
        b.store(_key(1), kb, mode="raw")
        ga, gb = a.retrieve(_key(1), layout=LAYOUT), b.retrieve(_key(1), layout=LAYOUT)
        gn = a.retrieve(_key(1), layout=LAYOUT, namespace="other")
        assert ga is not None and ga.equal(ka) and gb is not None and gb.equal(kb)
        assert gn is not None and gn.equal(kn)
        assert _arena(a).found == 2 and _arena(b).found == 1


def test_a_server_that_went_away_is_not_read_from(config: ServerConfig) -> None:
    """A server that exits leaves its arena mapped with the last directory it wrote: the
    client must ask (and fail) rather than answer from it."""
    kv = random_kv(LAYOUT, 20, seed=7)
    s = ServerThread(config).start()
    try:
        c = Client(s.address, timeout_s=5, shm_bytes=1 << 20, retry=Retry(retries=0))
        assert c.fetch(_key(99)) is None
        c.store(_key(6), kv, mode="raw")
        got = c.retrieve(_key(6), layout=LAYOUT)
        assert got is not None and got.equal(kv) and _arena(c).found == 1
        arena = _arena(c)
    finally:
        s.stop()
    time.sleep(0.2)
    try:
        got = c.retrieve(_key(6), layout=LAYOUT)
    except KDNError:
        got = None  # asked the server, which is gone
    assert got is None and arena.found == 1
    c.close()


def test_reads_from_the_directory_are_counted_by_the_server(
        st: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server never sees a read from the directory; the client reports them: with its next
    GetMany, in a call of its own once ``REPORT_READS`` wait, and when it closes. Each is a
    hit of the RAM tier (kdn_tier_hits_total: they were not, and the RAM hit ratio of a
    same-host workload read 0), and no reading of the store's read time."""
    monkeypatch.setattr(dataplane, "REPORT_READS", 4)
    kvs = [random_kv(LAYOUT, 20, seed=i) for i in range(4)]

    def listed_reads() -> int:
        assert st.server is not None
        return int(dict(st.server.servicer.counters).get("arena.listed_reads", 0))

    def ram() -> tuple[int, int]:  # the RAM tier's hits, and readings of its read time
        assert st.server is not None
        hits = next(t.hits for t in st.server.store.stats() if t.name == "ram")
        times = st.server.servicer.usage.reads.data.get("ram")
        return hits, int(times[-1]) if times else 0

    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as writer:
        for i, kv in enumerate(kvs):
            writer.store(_key(i), kv, mode="raw")
        reader = Client(st.address, timeout_s=30, shm_bytes=1 << 20)
        before = ram()
        assert reader.fetch(_key(99)) is None  # attached, then the entries listed
        for i, kv in enumerate(kvs):
            writer.store(_key(i), kv, mode="raw")
        for i in range(3):
            assert reader.retrieve(_key(i), layout=LAYOUT) is not None
        assert listed_reads() == 0  # not reported yet
        assert reader.retrieve(_key(3), layout=LAYOUT) is not None
        assert listed_reads() == 4  # four waiting: a call of their own
        assert reader.retrieve(_key(0), layout=LAYOUT) is not None
        assert reader.fetch(_key(98)) is None  # a call: the read rides on it
        assert listed_reads() == 5
        assert reader.retrieve(_key(1), layout=LAYOUT) is not None
        assert _arena(reader).found == 6
        reader.close()  # and what is left goes when the client closes
        assert listed_reads() == 6
        assert st.server is not None  # each counted as a hit served (no other read hit)
        assert dict(st.server.servicer.counters).get("getmany.hit", 0) == 6
        assert ram() == (before[0] + 6, before[1])


def test_an_import_over_a_listed_entry_is_what_the_next_read_sees(
        st: ServerThread, tmp_path: Path) -> None:
    old, new = random_kv(LAYOUT, 20, seed=1), random_kv(LAYOUT, 20, seed=2)
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c, AdminClient(st.address) as admin:
        assert c.fetch(_key(99)) is None
        c.store(_key(1), old, mode="raw")
        admin.export_to(tmp_path / "old.kdnx")
        c.store(_key(1), new, mode="raw")
        got = c.retrieve(_key(1), layout=LAYOUT)
        assert got is not None and got.equal(new) and _arena(c).found == 1  # listed
        assert admin.import_from(tmp_path / "old.kdnx").imported >= 1
        again = c.retrieve(_key(1), layout=LAYOUT)
        assert again is not None and again.equal(old)


def test_where_stores_may_be_seen_out_of_order_every_read_asks(
        st: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory, "ORDERED_STORES", False)
    kv = random_kv(LAYOUT, 20, seed=6)
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c:
        assert c.fetch(_key(99)) is None
        c.store(_key(1), kv, mode="raw")
        calls = _calls(c)
        for _ in range(2):
            got = c.retrieve(_key(1), layout=LAYOUT)
            assert got is not None and got.equal(kv)
        assert not _arena(c).has_directory and _arena(c).found == 0 and _calls(c) == calls + 2


def test_made_up_reports_count_nothing(st: ServerThread) -> None:
    """A report naming generations the tenant's arena never listed (or that a client of
    another tenant could not have read) counts no hit and stores nothing."""
    from kdn.v1 import kdn_pb2 as pb

    kv = random_kv(LAYOUT, 20, seed=8)
    with Client(st.address, timeout_s=30, shm_bytes=1 << 20) as c:
        assert c.fetch(_key(99)) is None
        c.store(_key(1), kv, mode="raw")
        assert st.server is not None
        before = dict(st.server.servicer.counters).get("getmany.hit", 0)
        seg_id = c.dataplane.segment()[1]
        c.dataplane._get(pb.GetManyRequest(segment_id=seg_id, lease=True,  # noqa: SLF001
                                           read_listed=[1, 2, (1 << 64) - 1]), None)
        n = dict(st.server.servicer.counters)
        assert n.get("getmany.hit", 0) == before and n["arena.listed_reads"] == 3
        got = c.retrieve(_key(1), layout=LAYOUT)  # what was stored is still there, whole
        assert got is not None and got.equal(kv)
