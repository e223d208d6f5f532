"""What the Redis tier says when Redis answers but does not serve it, with real redis-server
processes: a refused login is named as such (at start, by the health probe, by a call), not
as a Redis that does not answer; every pooled connection busy past the pool's wait fails that
call as retryable (``PartlyUnavailable``) and leaves the tier up, since Redis answers; a cluster
master's pool is waited on as long as a standalone Redis's."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from kdn.errors import PartlyUnavailable, TierUnavailable
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from kdn.store.tiered import TieredStore
from tests.helpers import eventually
from tests.redis_servers import RedisCluster3, RedisServer, redis_server_fixture  # noqa: F401

pytestmark = pytest.mark.redis
KEY = b"ns/" + b"ab" * 16


def test_a_refused_login_is_named(redis_server: RedisServer,
                                  caplog: pytest.LogCaptureFixture) -> None:
    c = redis_server.client()
    c.config_set("requirepass", "right")
    c.close()
    url = redis_server.url.replace("redis://", "redis://:wrong@")
    with caplog.at_level(logging.WARNING):
        tier = RedisTier(url, capacity_bytes=64 << 20)  # the budget is not set: said why
        store = TieredStore([RamTier(16 << 20), tier], probe_interval_s=0.05)
        try:
            assert eventually(lambda: not store.health()["redis"], timeout=5)
            with pytest.raises(TierUnavailable, match="login.*redis_url"):
                tier.healthy()
            with pytest.raises(TierUnavailable, match="login.*redis_url"):
                tier.get(KEY)
        finally:
            store.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("login" in m and "byte budget" in m for m in said), said
    assert any("tier redis is down" in m and "login" in m for m in said), said
    assert not any("does not answer" in m for m in said), said


def test_a_busy_connection_pool_leaves_the_tier_up(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, max_connections=2, timeout_s=0.3)
    store = TieredStore([RamTier(16 << 20), tier], probe_interval_s=60)
    try:
        tier.put(KEY, b"v" * 100)
        pool = tier.client.connection_pool
        busy = [pool.get_connection() for _ in range(2)]  # two calls in flight elsewhere
        try:
            with pytest.raises(PartlyUnavailable, match="redis_max_connections"):
                tier.get(KEY)
            assert store.get(KEY) is None  # a miss for now, the tier still up
            assert store.health()["redis"]
        finally:
            for conn in busy:
                pool.release(conn)
        hit = store.get(KEY)
        assert hit is not None and hit.value == b"v" * 100
    finally:
        store.close()


def test_a_cluster_call_waits_for_a_busy_node_pool(tmp_path: Path) -> None:
    """In a cluster, a call that finds every pooled connection to its master busy waits for
    one, as a standalone Redis's pool does (redis-py's node pools failed it at once): served
    once one is freed, PartlyUnavailable after ``timeout_s`` where none is."""
    with RedisCluster3(tmp_path / "c") as cluster:
        tier = RedisTier(cluster.urls, cluster=True, max_connections=2, timeout_s=0.5)
        try:
            tier.put(KEY, b"v" * 100)
            assert isinstance(tier.client, RedisCluster)
            node = tier.client.get_node_from_key(tier._manifest_key(KEY))  # noqa: SLF001
            pool = tier.client.get_redis_connection(node).connection_pool
            busy = [pool.get_connection() for _ in range(2)]  # two calls in flight elsewhere
            freed = threading.Timer(0.2, pool.release, args=(busy.pop(),))
            freed.start()
            t = time.monotonic()
            assert tier.get(KEY) == b"v" * 100
            assert time.monotonic() - t >= 0.15
            freed.join()
            busy.append(pool.get_connection())
            t = time.monotonic()
            with pytest.raises(PartlyUnavailable, match="redis_max_connections"):
                tier.get(KEY)
            assert time.monotonic() - t >= 0.45
            for conn in busy:
                pool.release(conn)
            assert tier.get(KEY) == b"v" * 100
        finally:
            tier.close()
