"""Entries near their time to live in the hierarchy (RAM + LMDB): a lower-tier hit that expires
between its read and the question of its time to live is a miss, never promoted into RAM with
no expiry."""

from __future__ import annotations

import time
from pathlib import Path

from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import TieredStore


class _SlowDisk(LmdbTier):
    """An LMDB tier whose reads return only after ``delay_s``: the entry read may expire before
    the hierarchy asks its time to live (the race a real server meets in an entry's last ms)."""

    delay_s = 0.0

    def get_stamped(self, key: bytes, framed: bool = False) -> tuple[bytes, int] | None:
        got = super().get_stamped(key, framed)
        time.sleep(self.delay_s)
        return got


def test_a_hit_that_expires_before_its_ttl_is_asked_is_not_kept_for_ever(
        tmp_path: Path) -> None:
    disk = _SlowDisk(tmp_path / "lmdb", capacity_bytes=8 << 20)
    ram = RamTier(1 << 20)
    store = TieredStore([ram, disk])
    try:
        disk.put(b"k", b"v" * 100, ttl_s=0.2)
        disk.delay_s = 0.3  # read live, expired once its time to live is asked
        assert store.get(b"k") is None
        assert not ram.contains(b"k")
        disk.delay_s = 0.0
        assert store.get(b"k") is None and ram.ttl_remaining(b"k") == 0.0
    finally:
        store.close()


def test_ttl_remaining_tells_no_expiry_from_absent(tmp_path: Path) -> None:
    disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=8 << 20)
    ram = RamTier(1 << 20)
    try:
        for tier in (ram, disk):
            tier.put(b"forever", b"x")
            tier.put(b"brief", b"y", ttl_s=0.05)
            assert tier.ttl_remaining(b"forever") is None
            assert tier.ttl_remaining(b"absent") == 0.0
        time.sleep(0.1)
        assert ram.ttl_remaining(b"brief") == 0.0 and disk.ttl_remaining(b"brief") == 0.0
    finally:
        disk.close()


def test_a_pin_ends_with_its_entry(tmp_path: Path) -> None:
    """A pinned entry that expired leaves no pin behind: the key stored again without ``pin``
    is not pinned (it was, and could never be evicted); a live pinned entry stored again keeps
    its pin."""
    store = TieredStore([RamTier(1 << 20), LmdbTier(tmp_path / "lmdb", capacity_bytes=8 << 20)])
    try:
        store.put(b"p", b"a" * 10, pin=True, ttl_s=0.1)
        store.put(b"live", b"b" * 10, pin=True)
        time.sleep(0.2)
        assert store.get(b"p") is None
        store.put(b"p", b"c" * 10)
        store.put(b"live", b"d" * 10)
        assert not store.is_pinned(b"p") and store.is_pinned(b"live")
    finally:
        store.close()


def test_the_ram_sweep_counts_what_it_removes() -> None:
    ram = RamTier(1 << 20)
    for i in range(5):
        ram.put(b"e/%d" % i, b"x" * 100, ttl_s=0.05)
    ram.put(b"keep", b"y" * 10)
    time.sleep(0.1)
    assert ram.sweep_expired() == (5, 500)
    assert list(ram.keys()) == [b"keep"] and ram.used_bytes == 10
