"""The tier contract (kdn.store.base), one suite run against every tier: RAM, LMDB disk, Redis
standalone and Redis Cluster (real redis-server processes; the Redis tiers split values into
1 KiB parts here so that multi-part entries are exercised everywhere)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn.store.base import Tier, TierStats
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from tests.helpers import eventually
from tests.redis_servers import RedisCluster3, RedisServer, redis_cluster_fixture  # noqa: F401

PART = 1024
SIZES = [0, 1, 100, PART - 40, PART, PART + 1, 3 * PART + 7, 64 << 10]


@pytest.fixture(scope="module")
def redis_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as r:
        yield r


@pytest.fixture(params=["ram", "disk",
                        pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    prefix = f"t{uuid.uuid4().hex[:8]}:".encode()
    t: Tier
    if request.param == "ram":
        t = RamTier(64 << 20)
    elif request.param == "disk":
        t = LmdbTier(tmp_path / "lmdb", capacity_bytes=64 << 20)
    elif request.param == "redis":
        r: RedisServer = request.getfixturevalue("redis_one")
        t = RedisTier(r.url, part_bytes=PART, prefix=prefix)
    else:
        c: RedisCluster3 = request.getfixturevalue("redis_cluster")
        t = RedisTier(c.urls, cluster=True, part_bytes=PART, prefix=prefix)
    yield t
    t.close()


def test_miss_is_none(tier: Tier) -> None:
    assert tier.get(b"absent") is None
    assert not tier.contains(b"absent")
    assert tier.size_of(b"absent") is None
    assert tier.delete(b"absent") is False
    assert tier.ttl_remaining(b"absent") == 0.0  # None is "held with no expiry" only


@pytest.mark.parametrize("size", SIZES)
def test_roundtrip(tier: Tier, size: int) -> None:
    value = os.urandom(size)
    key = b"ns/%d" % size
    tier.put(key, value)
    assert tier.contains(key)
    assert tier.get(key) == value
    assert tier.size_of(key) == size
    assert tier.ttl_remaining(key) is None


def test_overwrite_and_delete(tier: Tier) -> None:
    big, small = os.urandom(5 * PART + 3), os.urandom(10)
    tier.put(b"k", big)
    tier.put(b"k", small)
    assert tier.get(b"k") == small
    tier.put(b"k", big)
    assert tier.get(b"k") == big
    assert tier.delete(b"k") is True
    assert tier.get(b"k") is None and not tier.contains(b"k")
    assert tier.delete(b"k") is False


def test_batched_forms(tier: Tier) -> None:
    items = [(b"b/%d" % i, os.urandom(i * 300)) for i in range(8)]
    tier.put_many(items)
    keys = [k for k, _ in items] + [b"b/missing"]
    assert tier.get_many(keys) == [v for _, v in items] + [None]
    assert tier.contains_many(keys) == [True] * 8 + [False]
    assert tier.size_many(keys) == [len(v) for _, v in items] + [None]
    assert sorted(tier.keys(b"b/")) == sorted(k for k, _ in items)
    assert tier.delete_many(keys[:3] + [b"b/missing"]) == 3
    assert tier.get_many(keys[:4]) == [None, None, None, items[3][1]]


def test_ttl(tier: Tier) -> None:
    tier.put(b"short", os.urandom(3 * PART), ttl_s=0.3)
    tier.put(b"long", b"x" * 10, ttl_s=60)
    assert tier.get(b"short") is not None
    remaining = tier.ttl_remaining(b"long")
    assert remaining is not None and 50 < remaining <= 60
    assert eventually(lambda: tier.get(b"short") is None, timeout=5)
    assert not tier.contains(b"short") and tier.size_of(b"short") is None
    assert tier.get(b"long") == b"x" * 10


def test_keys_prefix(tier: Tier) -> None:
    for k in (b"a/1", b"a/2", b"ab/3", b"b/4"):
        tier.put(k, b"v")
    assert sorted(tier.keys(b"a/")) == [b"a/1", b"a/2"]


def test_concurrent_writers_never_mix(tier: Tier) -> None:
    """Two writers race on one key with multi-part values; readers see one whole value."""
    versions = [bytes([i]) * (4 * PART + i) for i in range(1, 5)]
    tier.put(b"race", versions[0])
    stop = threading.Event()
    bad: list[object] = []

    def write(offset: int) -> None:
        i = offset
        while not stop.is_set():
            tier.put(b"race", versions[i % len(versions)])
            i += 1

    def read() -> None:
        while not stop.is_set():
            v = tier.get(b"race")
            if v not in versions:
                bad.append(None if v is None else (len(v), v[:1], v[-1:]))

    threads = [threading.Thread(target=write, args=(o,)) for o in (0, 1)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    assert tier.get(b"race") in versions


def test_stats_and_health(tier: Tier) -> None:
    tier.put(b"s", b"1234")
    tier.get(b"s")
    tier.get(b"nope")
    st = tier.stats()
    assert isinstance(st, TierStats) and st.name == tier.name
    assert st.entries >= 1 and st.hits >= 1 and st.misses >= 1 and st.healthy
    assert tier.healthy()
