"""Room held by pinned entries: a store that pinned entries leave too little room for is
refused before anything is removed (the key's previous value and other entries stay), and a
pinned entry whose time to live has passed holds no room (RAM and LMDB)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kdn.errors import TooLarge
from kdn.options import Durability
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import TieredStore


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
