"""The hierarchy's policies on RAM + LMDB: promotion, write-through / write-behind, durability,
demotion, pins, TTL, byte budgets, corruption handling; plus the same through a real server."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kdn import keys
from kdn.client import Client
from kdn.errors import (
    Corrupt,
    InvalidArgument,
    TierUnavailable,
)
from kdn.options import StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import Durability, Hit, TieredStore, WritePolicy
from tests.helpers import eventually, random_kv, uniform_layout, without_directory


def entry(n: int, seed: int = 0) -> bytes:
    """A self-checking value: xxh64 of the payload, then the payload."""
    payload = os.urandom(n) if seed == 0 else bytes([seed % 256]) * n
    return xxhash.xxh64_digest(payload) + payload


def check(value: bytes) -> None:
    if len(value) < 8 or xxhash.xxh64_digest(value[8:]) != value[:8]:
        raise Corrupt("checksum mismatch")


def damage(value: bytes) -> bytes:
    return value[:20] + bytes([value[20] ^ 0xFF]) + value[21:]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., TieredStore]]:
    made: list[TieredStore] = []

    def build(ram: int = 1 << 20, disk: int = 8 << 20, **kw: object) -> TieredStore:
        store = TieredStore([RamTier(ram), LmdbTier(tmp_path / "lmdb", capacity_bytes=disk)],
                            verify=check, **kw)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield build
    for s in made:
        s.close()


def test_write_through_and_promotion_keeps_ttl(make: Callable[..., TieredStore]) -> None:
    store = make()
    ram, disk = store.tiers
    v = entry(1000)
    assert store.put(b"k", v, ttl_s=60) == "ram"
    assert disk.get(b"k") == v  # write-through: on disk before put returned
    ram.delete(b"k")
    hit = store.get(b"k")
    assert hit is not None and hit.tier == "disk" and hit.value == v
    assert ram.get(b"k") == v  # promoted
    ttl = ram.ttl_remaining(b"k")
    assert ttl is not None and 50 < ttl <= 60
    assert store.get(b"k").tier == "ram"  # type: ignore[union-attr]
    assert store.counters["promotions"] == 1


def test_write_behind_serves_pending_and_flushes_on_close(tmp_path: Path) -> None:
    ram = RamTier(64 << 10)  # small: most entries leave RAM while still queued
    store = TieredStore([ram, LmdbTier(tmp_path / "l", capacity_bytes=64 << 20)], verify=check,
                        write_policy=WritePolicy.WRITE_BEHIND, queue_entries=10_000,
                        queue_bytes=64 << 20)
    values = {b"wb/%d" % i: entry(5000) for i in range(200)}
    for k, v in values.items():
        store.put(k, v)
    for k, v in values.items():  # queued or on disk: always readable
        hit = store.get(k)
        assert hit is not None and hit.value == v
    store.close()  # graceful shutdown flushes the queue
    disk = LmdbTier(tmp_path / "l", capacity_bytes=64 << 20)
    try:
        assert all(disk.get(k) == v for k, v in values.items())
    finally:
        disk.close()


def test_durability_disk_under_write_behind(make: Callable[..., TieredStore]) -> None:
    store = make(write_policy=WritePolicy.WRITE_BEHIND)
    disk = store.tiers[1]
    v = entry(2000)
    store.put(b"d", v, durability=Durability.DISK)
    assert disk.get(b"d") == v  # on disk when put returned, not merely queued
    with pytest.raises(InvalidArgument, match="SHARED needs a redis tier"):
        store.put(b"s", v, durability=Durability.SHARED)


def test_memory_durability_under_write_through_is_queued(make: Callable[..., TieredStore]) -> None:
    store = make()
    v = entry(100)
    store.put(b"m", v, durability=Durability.MEMORY)
    assert store.flush(5)
    assert store.tiers[1].get(b"m") == v


def test_ram_eviction_demotes_instead_of_dropping(make: Callable[..., TieredStore]) -> None:
    store = make(ram=40_000)
    ram, disk = store.tiers
    only_ram = {b"r/%d" % i: entry(9000) for i in range(4)}
    for k, v in only_ram.items():
        ram.put(k, v)  # behind the hierarchy's back: only RAM holds these
    for i in range(6):
        store.put(b"new/%d" % i, entry(9000))
    assert store.flush(5)
    assert store.counters["demotions"] >= 4
    for k, v in only_ram.items():
        assert not ram.contains(k) and disk.get(k) == v


def test_a_delete_between_an_eviction_and_its_demotion_is_not_undone(
        make: Callable[..., TieredStore]) -> None:
    """RAM evicts K; K is deleted (acknowledged) before the eviction's demotion runs: the
    demotion sees the key's generation moved and writes nothing back."""
    store = make(ram=20_000)
    ram, disk = store.tiers
    ram.put(b"K", entry(9000))  # only RAM holds it: its eviction is demoted
    demote, evicted, go = ram.on_evict, threading.Event(), threading.Event()
    assert demote is not None

    def held(*args: object) -> None:  # the demotion, called once the delete is done
        evicted.set()
        go.wait(5)
        demote(*args)  # type: ignore[arg-type]

    ram.on_evict = held
    t = threading.Thread(target=store.put, args=(b"X", entry(15_000)))
    t.start()
    assert evicted.wait(5)
    store.delete(b"K")
    go.set()
    t.join()
    assert store.flush(5)
    assert store.get(b"K") is None and not disk.contains(b"K")


def test_no_demotion_when_disabled(make: Callable[..., TieredStore]) -> None:
    store = make(ram=40_000, demote=False)
    ram, disk = store.tiers
    ram.put(b"gone", entry(9000))
    for i in range(6):
        store.put(b"new/%d" % i, entry(9000))
    assert store.get(b"gone") is None and not disk.contains(b"gone")


def test_pinned_entries_are_never_evicted(make: Callable[..., TieredStore]) -> None:
    store = make(ram=60_000, disk=60_000)
    ram, disk = store.tiers
    pinned = entry(10_000)
    store.put(b"pin", pinned, pin=True)
    for i in range(30):
        store.put(b"f/%d" % i, entry(10_000))
    assert ram.get(b"pin") == pinned and disk.get(b"pin") == pinned
    assert ram.stats().evictions > 0 and disk.stats().evictions > 0
    store.unpin(b"pin")
    for i in range(30, 40):
        store.put(b"f/%d" % i, entry(10_000))
    assert not ram.contains(b"pin") and not disk.contains(b"pin")


def test_ttl_per_entry_and_default(make: Callable[..., TieredStore]) -> None:
    store = make(default_ttl_s=30)
    store.put(b"t", entry(100), ttl_s=0.3)
    store.put(b"d", entry(100))
    assert store.get(b"t") is not None
    assert eventually(lambda: store.get(b"t") is None)
    assert not store.lookup([b"t"])[0].present
    ttl = store.tiers[1].ttl_remaining(b"d")
    assert ttl is not None and 20 < ttl <= 30


def test_gc_sweeps_expired_entries_out_of_the_disk_tier(tmp_path: Path) -> None:
    """An expired disk entry is in no listing and has no size, yet holds its bytes until a
    read of its key: the sweep (``kdn admin gc``) finds it in the meta table and frees them;
    a live entry, and one put again since it expired, stay."""
    disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=8 << 20)
    try:
        disk.put(b"old", b"x" * 1000, ttl_s=0.05)
        disk.put(b"again", b"y" * 100, ttl_s=0.05)
        disk.put(b"live", b"z" * 10)
        time.sleep(0.1)
        disk.put(b"again", b"w" * 50)
        assert sorted(disk.keys()) == [b"again", b"live"]
        assert disk.stats().bytes == 3 + 1000 + 5 + 50 + 4 + 10
        assert disk.sweep_expired() == (1, 1003)
        assert (disk.stats().entries, disk.stats().bytes) == (2, 5 + 50 + 4 + 10)
        assert disk.sweep_expired() == (0, 0)
    finally:
        disk.close()


def test_disk_budget_is_approximate_lru(make: Callable[..., TieredStore]) -> None:
    store = make(ram=20_000, disk=100_000)
    disk = store.tiers[1]
    store.put(b"hot", entry(10_000))
    for i in range(20):
        store.put(b"c/%d" % i, entry(10_000))
        disk.get(b"hot")  # reads refresh its access stamp
    st = disk.stats()
    assert st.bytes <= 100_000 and st.evictions >= 10
    assert disk.contains(b"hot")
    assert not disk.contains(b"c/0")


def test_corrupt_lower_copy_is_removed_and_never_served(make: Callable[..., TieredStore]) -> None:
    store = make()
    ram, disk = store.tiers
    good = entry(3000)
    disk.put(b"bad", damage(good))
    assert store.get(b"bad") is None
    assert not disk.contains(b"bad")
    assert store.counters["corrupt"] == 1 and disk.stats().corrupt == 1


def test_corrupt_ram_copy_falls_back_to_good_disk_copy(make: Callable[..., TieredStore]) -> None:
    store = make()
    ram, disk = store.tiers
    good = entry(3000)
    store.put(b"k", good)
    ram.put(b"k", damage(good))  # bit rot in RAM
    hit = store.get(b"k")
    assert hit is not None and hit.value == good and hit.tier == "disk"
    assert ram.get(b"k") == good  # repaired by promotion
    assert store.counters["corrupt"] == 1


def _counting_store(tmp_path: Path) -> tuple[TieredStore, RamTier, LmdbTier, list[bytes]]:
    """RAM over disk, and the values its ``verify`` hashed."""
    checked: list[bytes] = []

    def counting(value: bytes) -> None:
        checked.append(value)
        check(value)

    ram, disk = RamTier(1 << 20), LmdbTier(tmp_path / "l", capacity_bytes=8 << 20)
    return TieredStore([ram, disk], verify=counting), ram, disk, checked


def test_a_ram_value_is_hashed_once_and_a_new_write_is_checked_again(tmp_path: Path) -> None:
    store, ram, disk, checked = _counting_store(tmp_path)
    try:
        good = entry(3000)
        store.put(b"k", good)
        for _ in range(3):
            assert store.get(b"k") == Hit(good, "ram")
        assert len(checked) == 1  # the same immutable value: checked on its first read only
        ram.put(b"k", damage(good))  # a new value under the key: a new stamp
        hit = store.get(b"k")
        assert hit is not None and hit.value == good and hit.tier == "disk"
        assert store.counters["corrupt"] == 1 and len(checked) == 3
    finally:
        store.close()


def test_a_read_from_memory_answers_only_for_ram_values_checked_already(tmp_path: Path) -> None:
    """``get_in_memory`` (what an event loop may call): a RAM value whose stamp was verified;
    None before its first checked read, for a new value under the key, a key only on disk,
    a miss (counted once, by ``get``) and a store without a RAM tier."""
    ram, disk = RamTier(1 << 20), LmdbTier(tmp_path / "l", capacity_bytes=8 << 20)
    store = TieredStore([ram, disk], verify=check)
    try:
        good = entry(3000)
        store.put(b"k", good)
        assert store.get_in_memory(b"k") is None  # never checked: ``get`` hashes it first
        assert store.get(b"k") == Hit(good, "ram")
        assert store.get_in_memory(b"k") == Hit(good, "ram")
        ram.put(b"k", damage(good))  # another value: another stamp, not checked
        assert store.get_in_memory(b"k") is None
        got = store.get(b"k")  # the damaged copy found and repaired from disk
        assert got is not None and got.value == good and store.counters["corrupt"] == 1
        ram.delete(b"k")
        assert store.get_in_memory(b"k") is None  # on disk only
        misses = ram.counters.misses
        assert store.get_in_memory(b"none") is None and ram.counters.misses == misses
        assert TieredStore([disk], verify=check).get_in_memory(b"k") is None  # no RAM tier
    finally:
        store.close()


def test_one_read_of_a_value_not_checked_yet_counts_one_ram_hit(tmp_path: Path) -> None:
    """A server's read asks ``get_in_memory`` and then ``get``: where the RAM value was not
    checked yet (promoted from disk, or its stamp dropped from the memo) the probe counts no
    hit, so each read adds one to the RAM tier's hits."""
    ram, disk = RamTier(1 << 20), LmdbTier(tmp_path / "l", capacity_bytes=8 << 20)
    store = TieredStore([ram, disk], verify=check)
    try:
        good = entry(3000)
        store.put(b"k", good)
        ram.delete(b"k")  # evicted from RAM, still on disk
        assert store.get(b"k") == Hit(good, "disk")  # promoted into RAM
        for _ in range(3):  # unchecked, then checked by ``get``, then answered from memory
            hits = ram.counters.hits
            assert (store.get_in_memory(b"k") or store.get(b"k")) == Hit(good, "ram")
            assert ram.counters.hits == hits + 1
    finally:
        store.close()


def test_a_value_put_as_verified_is_not_hashed_on_its_first_read(tmp_path: Path) -> None:
    store, ram, disk, checked = _counting_store(tmp_path)
    try:
        good = entry(3000)
        store.put(b"v", good, verified=True)  # checked by the caller (a Store stream)
        assert store.get_in_memory(b"v") == Hit(good, "ram")
        assert store.get(b"v") == Hit(good, "ram") and checked == []
        store.put(b"u", good)  # not said to be checked: hashed on its first read
        assert store.get_in_memory(b"u") is None
        assert store.get(b"u") == Hit(good, "ram") and len(checked) == 1
        ram.put(b"v", damage(good))  # another value under the key: not trusted
        assert store.get_in_memory(b"v") is None
        got = store.get(b"v")
        assert got is not None and got.value == good and store.counters["corrupt"] == 1
        assert TieredStore([disk], verify=check).put(b"w", good, verified=True) == "disk"
    finally:
        store.close()


def test_checked_stamps_stay_as_many_as_the_ram_tier_holds() -> None:
    """A server storing new keys for weeks: the stamps of values RAM evicted are swept out, so
    the memo of checked stamps stays near what the RAM tier holds, not one per key ever stored;
    the values RAM still holds stay answered from memory without a hash."""
    ram = RamTier(64 << 10)  # ~60 entries of 1 KiB
    store = TieredStore([ram], verify=check)
    try:
        value = entry(1000)
        written = [i.to_bytes(4, "little") * 8 for i in range(25_000)]
        for key in written:
            store.put(key, value, verified=True)
        kept = sum(store._checked.stamp("ram", k) is not None for k in written)  # noqa: SLF001
        held = sum(ram.contains(k) for k in written)
        assert 0 < held < 100
        assert kept <= len(written) // 10, f"{kept} stamps kept for {held} entries held"
        assert store.get_in_memory(written[-1]) == Hit(value, "ram")
    finally:
        store.close()


def test_an_entry_no_tier_took_while_one_is_down_is_unavailable(
        make: Callable[..., TieredStore], tmp_path: Path) -> None:
    """An entry too large for RAM while the disk tier, which may hold it, does not answer
    (its directory deleted): the store fails as UNAVAILABLE naming the disk tier, not as an
    internal error, and leaves nothing queued for it."""
    store = make(ram=4096)
    shutil.rmtree(tmp_path / "lmdb")
    for key in (b"big1", b"big2"):  # the first finds the disk gone, the second finds it down
        with pytest.raises(TierUnavailable, match="the disk tier does not answer now"):
            store.put(key, entry(10_000))
    assert not store.is_up("disk") and store.queue_depth()["disk"] == 0


def test_lookup_and_delete(make: Callable[..., TieredStore]) -> None:
    store = make()
    store.put(b"a", entry(10))
    store.tiers[0].delete(b"a")
    store.put(b"b", entry(20))
    got = store.lookup([b"a", b"b", b"c"])
    assert [(p.present, p.tier, p.size) for p in got] == [
        (True, "disk", 18), (True, "ram", 28), (False, "", 0)]
    assert store.delete(b"a") and not store.delete(b"c")
    assert store.get(b"a") is None


def test_a_read_in_a_deletes_window_does_not_bring_the_entry_back(
        make: Callable[..., TieredStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that begins once the delete has taken the RAM copy, and finds the disk copy
    before it goes, promotes it into RAM: the delete takes that copy too, and no later read
    serves the deleted entry."""
    store = make()
    ram, disk = store.tiers
    store.put(b"a", entry(100))
    gone = disk.delete
    readers: list[threading.Thread] = []

    def delete_with_a_read_first(key: bytes) -> bool:
        reader = threading.Thread(target=store.get, args=(key,))
        reader.start()
        readers.append(reader)
        assert eventually(lambda: ram.contains(key))  # promoted (its stripe step waits)
        return gone(key)

    monkeypatch.setattr(disk, "delete", delete_with_a_read_first)
    assert store.delete(b"a")
    readers[0].join(10)
    assert store.get(b"a") is None and not ram.contains(b"a")


# -- through the server ------------------------------------------------------------------------


def test_server_durability_and_corrupt_disk_entry(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    without_directory(monkeypatch)  # the arena's listed copy is the value as stored, intact:
    # what is checked here is the read of the damaged disk copy once RAM lost it
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=64 << 20, disk_bytes=64 << 20,
                       write_policy=WritePolicy.WRITE_BEHIND, shutdown_grace_s=2)
    lay = uniform_layout()
    kv = random_kv(lay, 16)
    key = keys.chunk_key([9, 9], lay)
    with ServerThread(cfg) as st, Client(st.address) as c:
        c.store(key, kv, options=StoreOptions(durability=Durability.DISK))
        store = st.server.store  # type: ignore[union-attr]
        skey = keys.store_key("", "default", key)
        disk = store.tiers[1]
        assert disk.contains(skey)
        value = disk.get(skey)
        assert value is not None
        store.tiers[0].delete(skey)
        disk.put(skey, damage(value))
        assert c.retrieve(key) is None  # a damaged entry is a miss, never served
        assert c.stats().counters["store.corrupt"] == 1
        with pytest.raises(InvalidArgument, match="SHARED needs a tier this server does not have"):
            c.store(key, kv, options=StoreOptions(durability=Durability.SHARED))


def test_write_behind_flushes_on_server_stop(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=64 << 20, disk_bytes=64 << 20,
                       write_policy=WritePolicy.WRITE_BEHIND, shutdown_grace_s=2)
    lay = uniform_layout()
    stored = {}
    with ServerThread(cfg) as st, Client(st.address) as c:
        for i in range(20):
            key = keys.chunk_key([i], lay)
            kv = random_kv(lay, 8, seed=i)
            c.store(key, kv)
            stored[key] = kv
    cfg2 = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=64 << 20,
                        disk_bytes=64 << 20)
    with ServerThread(cfg2) as st, Client(st.address) as c:
        for key, kv in stored.items():
            back = c.retrieve(key)
            assert back is not None and back.equal(kv)


def test_ram_keeps_a_read_only_byte_view_and_copies_anything_else() -> None:
    ram = RamTier(1 << 20)
    backing = bytearray(entry(100))
    view = memoryview(bytes(backing))  # read-only
    ram.put(b"v", view)
    assert ram.get(b"v") is view  # kept as it is: no copy
    ram.put(b"w", memoryview(backing))  # writable: the caller could change it later
    got = ram.get(b"w")
    backing[10] ^= 0xFF
    assert isinstance(got, bytes) and got != bytes(backing)


def test_write_times_are_recorded_and_old_meta_records_still_read(tmp_path: Path) -> None:
    import struct
    import time

    disk = LmdbTier(tmp_path / "db", capacity_bytes=1 << 20)
    ram = RamTier(1 << 20)
    before = time.time()
    for t in (disk, ram):
        t.put(b"k", b"v" * 10)
        t.put(b"old", b"w" * 10)
        written = t.written_at(b"k")
        assert written is not None and before <= written <= time.time()
        assert t.written_at(b"absent") is None
    # a meta record written before write times were kept (24 bytes) reads as "unknown"
    with disk.env.begin(write=True) as txn:
        size, expiry, stamp, _ = struct.unpack("<QdQd", txn.get(b"old", db=disk.meta))
        txn.put(b"old", struct.pack("<QdQ", size, expiry, stamp), db=disk.meta)
    assert disk.get(b"old") == b"w" * 10 and disk.written_at(b"old") is None
    assert disk.delete(b"old") and disk.get(b"old") is None
    disk.close()


def test_a_promotion_keeps_the_age_of_the_copy_it_came_from(
        make: Callable[..., TieredStore]) -> None:
    """A hit on disk promoted into RAM keeps the disk copy's write time; one whose write time
    no tier recorded (an old meta record) stays unknown there, not the time of the read."""
    import struct

    store = make()
    ram, disk = store.tiers
    assert isinstance(disk, LmdbTier)
    long_ago = time.time() - 1000
    for key, written in ((b"dated", (long_ago,)), (b"undated", ())):
        store.put(key, entry(100))
        with disk.env.begin(write=True) as txn:  # its write time, or none (24 bytes)
            size, expiry, stamp, _ = struct.unpack("<QdQd", txn.get(key, db=disk.meta))
            txn.put(key, struct.pack("<QdQ" + "d" * len(written), size, expiry, stamp,
                                     *written), db=disk.meta)
        ram.delete(key)
        hit = store.get(key)
        assert hit is not None and hit.tier == "disk" and ram.contains(key)  # promoted
    assert ram.written_at(b"dated") == disk.written_at(b"dated") == long_ago
    assert ram.written_at(b"undated") is None and disk.written_at(b"undated") is None
    assert store.counters["promotions"] == 2
    store.put(b"dated", entry(100))  # a write is dated now again
    assert time.time() - (ram.written_at(b"dated") or 0) < 60


def test_disk_values_larger_than_one_record_are_split_and_joined(tmp_path: Path) -> None:
    """LMDB holds at most 4 GiB - 1 per record: bigger values are split into records of
    ``part_bytes`` (small here), read back whole, and every record goes with the entry."""
    disk = LmdbTier(tmp_path / "db", capacity_bytes=1 << 20, part_bytes=1000)
    big = os.urandom(4321)
    disk.put(b"t:ns/big", big)
    disk.put(b"t:ns/small", b"s" * 999)
    assert disk.get(b"t:ns/big") == big and disk.size_of(b"t:ns/big") == 4321
    assert sorted(disk.keys(b"t:")) == [b"t:ns/big", b"t:ns/small"]  # parts are not keys
    with disk.env.begin(db=disk.entries) as txn:
        assert sum(1 for _ in txn.cursor()) == 6  # 5 records of the big value, 1 small
    disk.put(b"t:ns/big", b"b" * 2500)  # an overwrite with fewer parts leaves no stray part
    assert disk.get(b"t:ns/big") == b"b" * 2500
    with disk.env.begin(db=disk.entries) as txn:
        assert sum(1 for _ in txn.cursor()) == 4
    with disk.env.begin(write=True, db=disk.entries) as txn:  # a part lost on disk
        assert txn.delete(b"t:ns/big\x00\x00\x00\x00\x02")
    with pytest.raises(Corrupt, match="parts hold 2000 of 2500"):
        disk.get(b"t:ns/big")
    assert disk.delete(b"t:ns/big") and disk.get(b"t:ns/big") is None
    with disk.env.begin(db=disk.entries) as txn:
        assert [bytes(k) for k, _ in txn.cursor()] == [b"t:ns/small"]
    disk.close()
