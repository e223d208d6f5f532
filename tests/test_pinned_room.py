"""Room held by pinned entries: a store that pinned entries leave too little room for is
refused before anything is removed (the key's previous value and other entries stay), a
pinned entry whose time to live has passed holds no room (RAM and LMDB), and a pinned entry
only Redis would hold (it evicts under its own budget, pins or not) is refused; under
write-behind one the disk tier keeps is written there at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kdn.errors import TooLarge
from kdn.options import Durability
from kdn.store.hits import WritePolicy
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from kdn.store.tiered import TieredStore
from tests.redis_servers import RedisServer


def test_a_store_refused_for_pinned_entries_removes_nothing() -> None:
    store = TieredStore([RamTier(1000)])
    try:
        store.put(b"pinned", b"p" * 500, pin=True)
        store.put(b"other", b"o" * 300)
        store.put(b"k", b"1" * 200)
        with pytest.raises(TooLarge, match="full of pinned entries"):
            store.put(b"k", b"2" * 600)  # an overwrite
        with pytest.raises(TooLarge, match="full of pinned entries"):
            store.put(b"new", b"n" * 600)
        assert store.get(b"k").value == b"1" * 200 and store.get(b"other").value == b"o" * 300
        assert store.get(b"pinned").value == b"p" * 500
        store.put(b"k", b"3" * 300)  # room for it once "other" is evicted
        assert store.get(b"k").value == b"3" * 300 and store.get(b"other") is None
    finally:
        store.close()


def test_a_refused_ram_put_demotes_nothing() -> None:
    evicted: list[bytes] = []
    ram = RamTier(1000, protected=lambda k: k == b"pinned",
                  on_evict=lambda k, v, ttl, gen: evicted.append(k))
    ram.put(b"pinned", b"p" * 600)
    ram.put(b"a", b"a" * 300)
    with pytest.raises(TooLarge):
        ram.put(b"b", b"b" * 500)
    assert evicted == [] and ram.get(b"a") == b"a" * 300 and ram.used_bytes == 900
    ram.put(b"b", b"b" * 400)
    assert evicted == [b"a"]


def test_an_expired_pinned_entry_holds_no_ram() -> None:
    store = TieredStore([RamTier(1000)])
    try:
        store.put(b"pinned", b"p" * 600, pin=True, ttl_s=0.1)
        time.sleep(0.2)
        store.put(b"next", b"n" * 500)
        assert store.get(b"next").value == b"n" * 500 and store.get(b"pinned") is None
    finally:
        store.close()


def test_an_expired_pinned_entry_holds_no_disk_room(tmp_path: Path) -> None:
    store = TieredStore([RamTier(1 << 20),
                         LmdbTier(tmp_path / "lmdb", capacity_bytes=10_000)])
    try:
        store.put(b"p", b"p" * 6000, pin=True, ttl_s=0.1)
        time.sleep(0.2)
        store.put(b"q", b"q" * 5000, durability=Durability.DISK)
        assert store.tiers[1].get(b"q") == b"q" * 5000
        store.put(b"live", b"l" * 4000, pin=True)
        with pytest.raises(TooLarge, match="disk tier is full of pinned entries"):
            store.put(b"big", b"b" * 7000, durability=Durability.DISK)
    finally:
        store.close()


@pytest.mark.redis
def test_a_pinned_entry_only_redis_would_hold_is_refused(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as r:
        redis = RedisTier(r.url, capacity_bytes=64 << 20)
        store = TieredStore([RamTier(1000), redis])
        try:
            store.put(b"k", b"1" * 1500)  # unpinned: Redis holds it
            with pytest.raises(TooLarge, match="no tier that keeps pinned entries took the "
                               "entry .*the redis tier evicts under its own memory budget"):
                store.put(b"k", b"2" * 1500, pin=True)
            assert not store.is_pinned(b"k") and redis.get(b"k") is None
            assert store.put(b"small", b"s" * 500, pin=True) == "ram"  # RAM keeps its pin
            assert redis.get(b"small") == b"s" * 500
        finally:
            store.close()
        disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
        store = TieredStore([RamTier(1000), RedisTier(r.url), disk])
        try:  # a disk tier keeps pins: taken there
            assert store.put(b"k", b"3" * 1500, pin=True) == "redis"
            assert store.is_pinned(b"k") and disk.get(b"k") == b"3" * 1500
        finally:
            store.close()


@pytest.mark.redis
def test_a_pinned_shared_store_under_write_behind_is_kept_on_disk(tmp_path: Path) -> None:
    """RAM refuses it and Redis, the SHARED tier, does not keep pins: the disk tier is written
    at once, not queued (the queued copy was withdrawn and disk named as down)."""
    with RedisServer(tmp_path, appendonly=False) as r:
        disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
        store = TieredStore([RamTier(1000), RedisTier(r.url), disk],
                            write_policy=WritePolicy.WRITE_BEHIND)
        try:
            assert store.put(b"k", b"4" * 1500, pin=True,
                             durability=Durability.SHARED) == "redis"
            assert store.is_pinned(b"k") and disk.get(b"k") == b"4" * 1500
            assert store.queue_depth()["disk"] == 0
        finally:
            store.close()
