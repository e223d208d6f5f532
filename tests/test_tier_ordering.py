"""An acknowledged write is never undone by what the hierarchy does around it (RAM + LMDB):
a read in flight does not promote the older value over it (nor bring back a deleted one), a
read of an expired disk entry does not delete a newer put, and a lower tier that does not take
an overwrite (it refuses it, or is down with its queue full) never serves its older copy."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import TieredStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = TieredStore([RamTier(1 << 20), LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)],
                    queue_entries=1)
    yield s
    s.close()


def _paused_read(store: TieredStore, during: Callable[[], object]) -> Any:
    """``store.get(b"k")`` whose disk read returns what it read only after ``during`` ran
    (a write acknowledged while the read is in flight)."""
    disk = store.tiers[1]
    read, wrote = threading.Event(), threading.Event()
    real = disk.get_stamped

    def slow(key: bytes, framed: bool = False) -> Any:
        got = real(key, framed)
        read.set()
        wrote.wait(10)
        return got

    disk.get_stamped = slow  # type: ignore[method-assign]
    out: list[Any] = []
    reader = threading.Thread(target=lambda: out.append(store.get(b"k")))
    reader.start()
    assert read.wait(10)
    during()
    wrote.set()
    reader.join(10)
    disk.get_stamped = real  # type: ignore[method-assign]
    return out[0]


def test_a_read_in_flight_does_not_promote_the_older_value(store: TieredStore) -> None:
    ram, disk = store.tiers
    store.put(b"k", b"v1")
    ram.delete(b"k")  # on disk only, as after an eviction
    got = _paused_read(store, lambda: store.put(b"k", b"v2"))
    assert got.value == b"v1"  # read before the write: either answer is the reader's to see
    assert store.get(b"k").value == b"v2"  # type: ignore[union-attr]
    assert ram.get(b"k") == b"v2" and disk.get(b"k") == b"v2"
    assert store.counters["promotions_skipped"] == 1


def test_a_read_begun_during_an_overwrite_does_not_promote_the_older_value(
        store: TieredStore) -> None:
    """The read starts once the put began (its generation raised) but before the new value
    reached RAM, finds the older copy on disk, and promotes only after the put was
    acknowledged: the put is under way throughout, so that promotion is refused."""
    ram, disk = store.tiers
    store.put(b"k", b"v1")
    ram.delete(b"k")  # on disk only, as after an eviction
    read, acked = threading.Event(), threading.Event()
    real_get, real_put = disk.get_stamped, ram.put
    out: list[Any] = []

    def slow_get(key: bytes, framed: bool = False) -> Any:
        got = real_get(key, framed)
        read.set()
        acked.wait(10)
        return got

    def put_after_read(key: bytes, value: Any, **kw: Any) -> None:
        if value == b"v2":  # the writer, its put under way: a read arrives now
            reader.start()
            assert read.wait(10)
        real_put(key, value, **kw)

    reader = threading.Thread(target=lambda: out.append(store.get(b"k")))
    disk.get_stamped = slow_get  # type: ignore[method-assign]
    ram.put = put_after_read  # type: ignore[method-assign]
    try:
        store.put(b"k", b"v2")
    finally:
        acked.set()
        reader.join(10)
        disk.get_stamped, ram.put = real_get, real_put  # type: ignore[method-assign]
    assert out[0].value == b"v1"  # read before the value landed: the reader's to see
    assert ram.get(b"k") == b"v2" and store.get(b"k").value == b"v2"  # type: ignore[union-attr]
    assert store.counters["promotions_skipped"] == 1


def test_a_read_during_a_delete_is_not_served_a_copy_older_than_the_queued_one(
        tmp_path: Path) -> None:
    """A delete of a key whose newer value waits in the disk's write queue: a read while the
    disk's (older) copy is being deleted misses, never gets that older copy."""
    from kdn.options import Durability
    from kdn.store.locks import KeyLocks

    s = TieredStore([RamTier(1 << 20), LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)])
    ram, disk = s.tiers
    locks = KeyLocks()
    other = next(k for k in (b"o%d" % i for i in range(100))
                 if locks.stripe(k) is not locks.stripe(b"k"))
    busy, release = threading.Event(), threading.Event()
    real_put, real_delete = disk.put, disk.delete
    seen: list[Any] = []

    def slow_put(key: bytes, value: bytes, **kw: Any) -> None:
        if key == other:  # the queue's writer is held on another key (another stripe)
            busy.set()
            release.wait(10)
        real_put(key, value, **kw)

    def read_first(key: bytes) -> bool:
        reader = threading.Thread(target=lambda: seen.append(s.get(b"k")))
        reader.start()
        reader.join(10)
        return real_delete(key)

    try:
        s.put(b"k", b"v1")
        disk.put = slow_put  # type: ignore[method-assign]
        s.put(other, b"o", durability=Durability.MEMORY)
        assert busy.wait(10)
        s.put(b"k", b"v2", durability=Durability.MEMORY)  # queued for the disk
        disk.delete = read_first  # type: ignore[method-assign]
        assert s.delete(b"k")
        assert seen == [None] and ram.get(b"k") is None and s.get(b"k") is None
        release.set()
        assert s.flush(10) and disk.get(b"k") is None
    finally:
        release.set()
        disk.put, disk.delete = real_put, real_delete  # type: ignore[method-assign]
        s.close()


def test_a_read_in_flight_does_not_bring_back_a_deleted_entry(store: TieredStore) -> None:
    ram, _ = store.tiers
    store.put(b"k", b"v1")
    ram.delete(b"k")
    _paused_read(store, lambda: store.delete(b"k"))
    assert store.get(b"k") is None and ram.get(b"k") is None


def test_an_expired_disk_entry_read_leaves_a_newer_put(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
    try:
        disk.put(b"k", b"old", ttl_s=1e-6)
        real = disk._write  # noqa: SLF001
        armed = [True]

        def put_first(body: Any, need: int) -> int:  # the put lands between the read and
            if armed[0]:  # its clean-up of the expired entry
                armed[0] = False
                disk.put(b"k", b"new")
            return real(body, need)

        monkeypatch.setattr(disk, "_write", put_first)
        assert disk.get(b"k") is None  # the expired one
        assert not armed[0] and disk.get(b"k") == b"new"
    finally:
        disk.close()


def test_a_refused_overwrite_drops_the_tiers_older_copy(tmp_path: Path) -> None:
    store = TieredStore([RamTier(4 << 20), LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)])
    try:
        ram, disk = store.tiers
        store.put(b"k", b"v1")
        big = b"v2" * (1 << 20)  # over the disk tier's budget: refused there
        assert store.put(b"k", big) == "ram"
        assert disk.get(b"k") is None  # not left to be served after an eviction
        ram.delete(b"k")
        assert store.get(b"k") is None
        assert store.counters["disk.write_dropped"] == 1
    finally:
        store.close()


def test_an_overwrite_dropped_while_the_tier_is_down_deletes_its_copy_later(
        store: TieredStore) -> None:
    ram, disk = store.tiers
    store.put(b"k", b"v1")
    store.put(b"gone", b"g1")
    store.mark_down("disk", "test")
    store.put(b"x", b"x1")  # queued for the disk (a queue of one)
    store.put(b"k", b"v2")  # the queue is full: dropped, a delete queued instead
    assert store.delete(b"gone")
    ram.delete(b"k")
    assert store.get(b"k") is None and store.get(b"gone") is None  # the disk's hidden
    store.probe()  # the disk answers again: the queue lands
    assert store.flush(10)
    assert disk.get(b"k") is None and disk.get(b"gone") is None and disk.get(b"x") == b"x1"
    assert store.counters["disk.write_dropped"] == 1


def test_promotions_that_evict_each_others_keys_do_not_deadlock(tmp_path: Path) -> None:
    """Readers promote disk hits into a RAM tier too small for them, so each promotion evicts
    (and demotes) keys whose locks other promotions hold: every read still ends."""
    s = TieredStore([RamTier(64 << 10), LmdbTier(tmp_path / "lmdb", capacity_bytes=16 << 20)])
    try:
        ks = [b"k%03d" % i for i in range(200)]
        for k in ks:
            s.put(k, k * 1000)  # 4 KB each: RAM holds 16 of them
        done = []

        def read(offset: int) -> None:
            for n in range(600):
                k = ks[(offset + 7 * n) % len(ks)]
                assert s.get(k).value == k * 1000  # type: ignore[union-attr]
            done.append(offset)

        readers = [threading.Thread(target=read, args=(o,), daemon=True) for o in (0, 1, 2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert sorted(done) == [0, 1, 2]
        assert s.counters["promotions"] > 100
    finally:
        s.close()


def test_an_overwrite_no_tier_takes_leaves_the_previous_value(tmp_path: Path) -> None:
    """Refused by every tier (too large for each): the store fails, and the previous value
    is still served from every tier that held it (only a tier that refused a value another
    tier took drops its older copy). The error names each tier's refusal and budget."""
    from kdn.errors import TooLarge

    s = TieredStore([RamTier(1 << 20), LmdbTier(tmp_path / "lmdb", capacity_bytes=3 << 19)])
    try:
        ram, disk = s.tiers
        s.put(b"k", b"v1")
        with pytest.raises(TooLarge, match=r"no tier accepted the entry: it is larger than each "
                           r"takes \(ram: .*1048576-byte budget; disk: .*1572864-byte budget\)"):
            s.put(b"k", b"v2" * (1 << 20))
        assert ram.get(b"k") == b"v1" and disk.get(b"k") == b"v1"
        assert s.get(b"k").value == b"v1"  # type: ignore[union-attr]
    finally:
        s.close()
