"""What the Redis tier's stats say it holds, with real redis-server processes: entries, not
Redis keys (an entry of three parts is one entry; other clients' keys are none), counted on a
small Redis and estimated close to their number on one past ``SAMPLE_KEYS``; and a cluster's
capacity is the byte budget of each master times the masters, as its bytes are every master's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdn.store.redis import RedisTier
from kdn.store.redis_stats import SAMPLE_KEYS
from tests.redis_servers import RedisCluster3, RedisServer

pytestmark = pytest.mark.redis


def test_entries_of_several_parts_count_once(tmp_path: Path) -> None:
    with RedisCluster3(tmp_path / "c") as cluster:
        tier = RedisTier(cluster.urls, cluster=True, part_bytes=4096, capacity_bytes=64 << 20)
        try:
            for i in range(10):
                tier.put(b"default/%064x" % i, os.urandom(10000))  # three Redis keys each
            st = tier.stats()
            assert st.entries == len(list(tier.keys())) == 10
            assert st.capacity_bytes == 3 * (64 << 20)  # each master's budget
        finally:
            tier.close()


def test_entries_of_a_large_redis_are_estimated(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as r:
        c = r.client()
        try:
            pipe = c.pipeline(transaction=False)
            n = 3 * SAMPLE_KEYS
            for i in range(n):  # as the tier names them: a manifest and two parts each
                pipe.set(b"kdn:{k%d}:m" % i, b"m")
                pipe.set(b"kdn:{k%d}:00000000000000ab:1" % i, b"p")
                pipe.set(b"kdn:{k%d}:00000000000000ab:2" % i, b"p")
                pipe.set(b"other:%d:m" % i, b"x")  # another client's keys
            pipe.execute()
        finally:
            c.close()
        tier = RedisTier(r.url)
        try:
            assert abs(tier.stats().entries - n) < 0.15 * n
        finally:
            tier.close()
