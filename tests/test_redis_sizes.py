"""Entries at the Redis tier's limits, with real redis-server processes: a manifest (header
and first part) stays within the longest value Redis takes (``proto-max-bulk-len``; a longer one
broke the connection and marked the tier down), and an entry larger than the byte budget
(``redis_bytes``) is refused as ``TooLarge`` naming it (Redis evicted its own parts before the
commit, a plain error); a time to live longer than Redis holds is none there (Redis refused the
write)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn.errors import TooLarge
from kdn.options import Durability
from kdn.store.ram import RamTier
from kdn.store.redis import HEADER_BYTES, MAX_BULK_BYTES, MAX_TTL_S, RedisTier
from kdn.store.tiered import TieredStore
from tests.helpers import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.redis
KEY = b"ns/" + b"ab" * 16


def test_a_manifest_stays_within_the_longest_value_redis_takes(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False,
                     extra=("--proto-max-bulk-len", str(1 << 20))) as r:
        tier = RedisTier(r.url, part_bytes=1 << 20, max_bulk_bytes=1 << 20)
        try:
            assert tier.part_bytes == (1 << 20) - HEADER_BYTES
            for size in (1 << 20, (1 << 20) - HEADER_BYTES, 3 << 20):
                value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                tier.put(KEY, value)
                assert tier.get(KEY) == value
            assert tier.healthy()
        finally:
            tier.close()
        big = RedisTier(r.url, part_bytes=MAX_BULK_BYTES)  # the most redis_part_bytes takes
        try:
            assert big.part_bytes + HEADER_BYTES == MAX_BULK_BYTES
        finally:
            big.close()


def test_an_entry_larger_than_the_budget_is_too_large(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as r:
        tier = RedisTier(r.url, capacity_bytes=8 << 20, part_bytes=1 << 20)
        store = TieredStore([RamTier(64 << 20), tier])
        try:
            with pytest.raises(TooLarge, match="redis_bytes 8388608"):
                store.put(KEY, b"y" * (16 << 20), durability=Durability.SHARED)
            with pytest.raises(TooLarge, match="redis_bytes"):
                tier.put_many([(KEY, b"y" * 100), (KEY + b"2", b"z" * (9 << 20))])
            assert tier.get(KEY) is None  # refused before any was written
            # within the budget, but not beside what Redis holds: its parts were evicted
            with pytest.raises(TooLarge, match="evicted before its commit.*redis_bytes"):
                tier.put(KEY, b"w" * ((8 << 20) - 4096))
            store.put(KEY, b"v" * (2 << 20), durability=Durability.SHARED)
            assert tier.get(KEY) == b"v" * (2 << 20)
        finally:
            store.close()


def test_a_time_to_live_redis_can_not_hold_is_none_there(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as r:
        tier = RedisTier(r.url, part_bytes=1024)
        store = TieredStore([RamTier(16 << 20), tier])
        try:
            for ttl in (10.0**16, float(2**64 - 1), MAX_TTL_S * 2):
                for size in (100, 5000):  # one key; parts
                    store.put(KEY, b"v" * size, ttl_s=ttl, durability=Durability.SHARED)
                    assert tier.get(KEY) == b"v" * size
                    assert tier.ttl_remaining(KEY) is None
            tier.put_many([(KEY, b"w" * 10)], ttl_s=10.0**16)
            assert tier.get(KEY) == b"w" * 10 and tier.ttl_remaining(KEY) is None
            tier.put(KEY, b"x" * 5000, ttl_s=MAX_TTL_S)
            assert MAX_TTL_S - 60 < (tier.ttl_remaining(KEY) or 0) <= MAX_TTL_S
            tier.put(KEY, b"y" * 10, ttl_s=0.0004)  # under a millisecond: not kept for ever
            assert eventually(lambda: tier.get(KEY) is None, timeout=2)
        finally:
            store.close()
