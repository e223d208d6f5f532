"""The Redis tier's byte budget (``redis_bytes``: maxmemory and allkeys-lru, set by kdn) with
real redis-server processes: a Redis, or a cluster master, that does not answer when the tier
starts does not stop it (kdn serves on, as without a budget), and every master that answers
without the budget (down at start, restarted with its own settings, or a replica promoted, once
the tier's map has it) gets it at the next health probe. A Redis that answers but takes no budget
(CONFIG turned off) stops the server naming redis_bytes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from kdn.errors import ConfigError, TierUnavailable
from kdn.server.app import build_store
from kdn.server.config import ServerConfig
from kdn.store.redis import RedisTier
from tests.helpers import eventually
from tests.redis_servers import RedisCluster3, RedisServer

pytestmark = pytest.mark.redis
BUDGET = 64 << 20


def _budget_of(node: RedisServer) -> tuple[int, str]:
    c = node.client()
    try:
        got = c.config_get("maxmemory*")
        return int(got["maxmemory"]), str(got["maxmemory-policy"])
    finally:
        c.close()


def test_a_standalone_redis_down_at_start_gets_the_budget_once_back(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as r:
        r.kill()
        tier = RedisTier(r.url, capacity_bytes=BUDGET)
        try:
            with pytest.raises(TierUnavailable, match="does not answer: ConnectionError"):
                tier.healthy()
            r.start()
            assert tier.healthy()
            assert _budget_of(r) == (BUDGET, "allkeys-lru")
            r.kill()
            r.start()  # its own settings again: no budget
            assert _budget_of(r) == (0, "noeviction")
            assert tier.healthy()
            assert _budget_of(r) == (BUDGET, "allkeys-lru")
        finally:
            tier.close()


def test_a_cluster_master_down_at_start_gets_the_budget_once_back(tmp_path: Path) -> None:
    with RedisCluster3(tmp_path / "c") as cluster:
        lost = cluster.nodes[0]
        lost.kill()
        tier = RedisTier(cluster.urls, cluster=True, capacity_bytes=BUDGET)
        try:
            assert [_budget_of(n) for n in cluster.nodes[1:]] == [(BUDGET, "allkeys-lru")] * 2
            assert tier.masters_down() == [f"127.0.0.1:{lost.port}"]
            lost.start()
            assert eventually(lambda: tier.healthy() and not tier.masters_down(), timeout=15)
            assert _budget_of(lost) == (BUDGET, "allkeys-lru")
        finally:
            tier.close()


def test_a_master_back_counts_as_back_only_with_its_budget(tmp_path: Path) -> None:
    """The master that did not answer is reported back (its slots' keys served again) only
    once it has the byte budget: not before the next health probe gives it, a window in
    which writes would fill it without a limit."""
    with RedisCluster3(tmp_path / "c") as cluster:
        lost = cluster.nodes[0]
        lost.kill()
        tier = RedisTier(cluster.urls, cluster=True, capacity_bytes=BUDGET)
        try:
            tier.transport.keep_budget = lambda: None  # type: ignore[method-assign]
            assert tier.masters_down() == [f"127.0.0.1:{lost.port}"]
            lost.start()
            assert eventually(lambda: not tier.masters_down(), timeout=15)
            assert _budget_of(lost) == (BUDGET, "allkeys-lru")
        finally:
            tier.close()


def test_a_promoted_replica_gets_the_budget(tmp_path: Path) -> None:
    with RedisCluster3(tmp_path / "c", replicas=True) as cluster:
        tier = RedisTier(cluster.urls, cluster=True, capacity_bytes=BUDGET)
        heir = cluster.replicas[0]
        try:
            assert _budget_of(heir) == (0, "noeviction")
            c = heir.client()
            try:
                c.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")  # heir is master now
                assert eventually(lambda: c.info("replication")["role"] == "master", timeout=15)
            finally:
                c.close()
            old = cluster.nodes[0].client()
            try:  # once the old master knows, it answers MOVED
                assert eventually(lambda: old.info("replication")["role"] == "slave", timeout=15)
            finally:
                old.close()
            # the tier learns the new map from the MOVED of its first call there
            key = next(k for k in (b"k%d" % i for i in range(100))
                       if tier._master_of(k) == f"127.0.0.1:{cluster.nodes[0].port}")
            tier.put(key, b"v" * 100)
            assert tier._master_of(key) == f"127.0.0.1:{heir.port}"
            assert tier.healthy()
            assert _budget_of(heir) == (BUDGET, "allkeys-lru")
        finally:
            tier.close()


def test_a_redis_restarted_with_a_maxmemory_of_its_own_gets_the_budget_back(
        tmp_path: Path) -> None:
    """A maxmemory from Redis's own config file (read again at each restart, under its own
    policy) was taken for another kdn server's budget and kept, noeviction with it."""
    with RedisServer(tmp_path, appendonly=False,
                     extra=("--maxmemory", "200mb", "--maxmemory-policy", "noeviction")) as r:
        tier = RedisTier(r.url, capacity_bytes=BUDGET)
        try:
            assert _budget_of(r) == (BUDGET, "allkeys-lru")
            r.kill()
            r.start()  # its own settings again
            assert _budget_of(r) == (200 << 20, "noeviction")
            assert tier.healthy()
            assert _budget_of(r) == (BUDGET, "allkeys-lru")
        finally:
            tier.close()


def test_a_redis_without_config_names_redis_bytes(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False, extra=("--rename-command", "CONFIG", "")) as r:
        cfg = ServerConfig(redis_url=r.url, redis_bytes=BUDGET, disk_bytes=0,
                           data_dir=tmp_path / "data")
        with pytest.raises(ConfigError, match="^redis_bytes: .*CONFIG.*set redis_bytes to 0"):
            build_store(cfg)
        build_store(dataclasses.replace(cfg, redis_bytes=0)).close()  # without it: serves


def test_two_servers_with_other_budgets_do_not_take_turns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each probe set its own budget again: the budget flipped at every probe (a lower one
    evicting at once), logged as a Redis that lacked it. The one found holding another's keeps
    it, said once."""
    with RedisServer(tmp_path, appendonly=False) as r, \
            caplog.at_level(logging.INFO, logger="kdn.store.redis_transport"):
        a = RedisTier(r.url, capacity_bytes=BUDGET)
        b = RedisTier(r.url, capacity_bytes=2 * BUDGET)
        try:
            for _ in range(3):
                assert a.healthy() and b.healthy()
                assert _budget_of(r) == (2 * BUDGET, "allkeys-lru")
            said = [m.getMessage() for m in caplog.records]
            assert not any("lacked" in m for m in said), said
            assert sum(f"redis_bytes {BUDGET}" in m for m in said) == 1, said
            r.kill()
            r.start()  # its own settings again: the budget is given back
            assert a.healthy() and _budget_of(r) == (BUDGET, "allkeys-lru")
        finally:
            a.close()
            b.close()
