"""A Redis Cluster master killed under write-through load (real redis-server processes): a
DEFAULT store whose slot's master is dead is acknowledged from RAM, and its Redis copy is queued
and retried (``store.redis.write_retried``) until the master is back, so that after recovery and
a kdn restart every acknowledged store is in Redis. The only copies lost are the ones the README
names, each counted under ``store.redis.write_dropped``: a queue already full, or a copy still
queued when the shutdown flush gave up on a master that was still dead. The counters add up to
the missing keys exactly. With a replica to take over (and every Redis write confirmed by a
replica, so that a failover itself loses nothing), the queued copies land on the promoted
replica once a replica confirms them.

The masters keep an AOF (``appendfsync always``), so a killed master that restarts keeps what
it had acknowledged to kdn: what is missing afterwards is kdn's doing, not Redis's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.errors import KDNError, PartlyUnavailable
from kdn.server import ServerConfig, ServerThread
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from kdn.store.tiered import TieredStore, WritePolicy
from tests.helpers import eventually, random_kv, uniform_layout
from tests.redis_servers import RedisCluster3, RedisServer

pytestmark = pytest.mark.redis
LAY = uniform_layout(layers=2, heads=2, dim=8)
KV = random_kv(LAY, 4)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    c = RedisCluster3(tmp_path / "c")
    for node in c.nodes:  # a killed master restarts with what it acknowledged
        node.appendonly = True
    with c:
        yield c


def _master_port(tier: RedisTier, key: bytes) -> int:
    return int(tier.client.get_node_from_key(tier._manifest_key(key)).port)  # type: ignore[union-attr]


def _restart(node: RedisServer, tier: RedisTier | None = None) -> None:
    """Start ``node`` again (same port, AOF, nodes.conf); wait until it serves its slots
    and (given ``tier``) the tier uses it again."""
    node.start()
    _restart_wait(node)
    if tier is not None:
        assert eventually(lambda: tier.healthy() and tier.masters_down() == [], timeout=20,
                          interval=0.05)


def _restart_wait(node: RedisServer) -> None:
    """Until ``node`` (started again) serves its slots."""
    c = node.client()
    try:
        assert eventually(lambda: b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO"),
                          timeout=20, interval=0.05)
    finally:
        c.close()


def _missing(cluster: RedisCluster3, stored: list[bytes]) -> list[bytes]:
    """The keys of ``stored`` that a fresh Redis tier (a restarted kdn) does not find."""
    fresh = RedisTier(cluster.urls, cluster=True)
    try:
        return [k for k in stored if fresh.get(k) is None]
    finally:
        fresh.close()


@pytest.mark.parametrize("heir", [False, True], ids=["restarted", "failover"])
def test_acknowledged_stores_survive_a_killed_master(tmp_path: Path, heir: bool) -> None:
    """Three clients store (DEFAULT, write-through) through a real server while a master is
    killed and, 3 s later, restarted; or (``failover``, every Redis write confirmed by a
    replica: ``redis_wait_replicas`` 1) while its replica takes over alone, short of a replica
    to confirm writes, until the old master comes back as its replica. Every store is
    acknowledged; after recovery and a restart of kdn, every acknowledged store is in Redis,
    and none was counted as dropped."""
    cluster = RedisCluster3(tmp_path / "c", replicas=heir)
    for node in cluster.nodes:  # a killed master restarts with what it acknowledged
        node.appendonly = True
    with cluster, _Map(cluster) as owner:
        _survive(tmp_path, cluster, owner, heir)


class _Map:
    """The cluster's slot map before anything fails: which master (port) a key's slot had."""

    def __init__(self, cluster: RedisCluster3) -> None:
        self.tier = RedisTier(cluster.urls, cluster=True)

    def __call__(self, key: bytes) -> int:
        return _master_port(self.tier, key)

    def __enter__(self) -> _Map:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tier.close()


def _survive(tmp_path: Path, cluster: RedisCluster3, owner: _Map, heir: bool) -> None:
    victim = cluster.nodes[0]
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       redis_url=",".join(cluster.urls), redis_cluster=True,
                       tier_order=("ram", "redis"), shutdown_grace_s=10,
                       redis_wait_replicas=int(heir), redis_wait_timeout_s=0.5,
                       # room for every copy queued while the master is dead: a full queue
                       # drops copies, counted (test_lost_copies_are_the_counted_ones); 1,024
                       # entries took 1,294 stores of its slots in 1.5 s on a quiet host
                       write_queue_entries=1 << 20)
    acked: list[bytes] = []
    errors: list[str] = []
    stop = threading.Event()

    def storer(tag: int) -> None:
        with Client(server.address, retry=None, timeout_s=20) as c:
            i = 0
            while not stop.is_set():
                k = keys.chunk_key([tag, i], LAY)
                i += 1
                try:
                    c.store(k, KV)
                    acked.append(k)
                except KDNError as exc:
                    errors.append(str(exc))

    with ServerThread(cfg) as server:
        assert server.server is not None
        store = server.server.store
        tier = next(t for t in store.tiers if isinstance(t, RedisTier))
        threads = [threading.Thread(target=storer, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            victim.kill()
            killed_at = len(acked)
            if heir:
                promoted = cluster.replicas[0].client()
                try:
                    assert eventually(lambda: promoted.info("replication")["role"] == "master",
                                      timeout=20, interval=0.05)
                    time.sleep(1.5)  # alone: no replica confirms its writes
                    during = acked[killed_at:]
                    victim.start()  # back, as the new master's replica
                    assert eventually(lambda: promoted.info("replication").get(
                        "connected_slaves", 0) >= 1, timeout=20)
                finally:
                    promoted.close()
            else:
                time.sleep(3.0)
                during = acked[killed_at:]
                _restart(victim, tier)
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert store.flush(20)
        counters = dict(store.counters)
    # the server stopped (a graceful restart of kdn): what it acknowledged is in Redis
    assert errors == [], errors[:3]
    skeys = [keys.store_key("", "default", k) for k in acked]
    on_victim = [k for k in skeys[killed_at:killed_at + len(during)]
                 if owner(k) == victim.port]
    assert len(on_victim) > 10, "too few stores on the killed master's slots"
    missing = _missing(cluster, skeys)
    dropped = counters.get("redis.write_dropped", 0)
    print(f"killed master{', failover' if heir else ''}: {len(acked)} acknowledged "
          f"({len(on_victim)} on its slots while it was dead), {len(missing)} missing, "
          f"{dropped} counted dropped, "
          f"{counters.get('redis.write_retried', 0)} retried")
    assert len(missing) == dropped == 0, f"{len(missing)} of {len(acked)} acknowledged lost"
    assert counters.get("redis.write_retried", 0) >= len(on_victim)


@pytest.mark.parametrize("back_before_close", [True, False])
def test_lost_copies_are_the_counted_ones(cluster: RedisCluster3, back_before_close: bool) -> None:
    """A write queue of 8 entries and a master dead while 90 entries are stored: the copies
    for its slots beyond the 8 queued are dropped (queue full) and counted, a delete of each
    queued in its place (a copy the master held would be stale); the 8 queued land once it is
    back, or, when it is still dead at shutdown, are dropped and counted too. The keys missing
    from Redis are exactly as many as the counter says."""
    victim = cluster.nodes[0]
    store = TieredStore([RamTier(64 << 20), RedisTier(cluster.urls, cluster=True)],
                        queue_entries=8, flush_timeout_s=1.0, probe_interval_s=0.2)
    redis_tier = store.tiers[1]
    assert isinstance(redis_tier, RedisTier)
    stored = [b"entry-%d" % i for i in range(90)]
    try:
        victim.kill()
        for k in stored:
            store.put(k, k * 10)  # acknowledged: in RAM
        on_victim = [k for k in stored if _master_port(redis_tier, k) == victim.port]
        assert len(on_victim) > 8
        assert store.queue_depth()["redis"] == len(on_victim)  # 8 writes, the rest deletes
        assert all(store.get(k) is not None for k in stored)
        if back_before_close:
            _restart(victim, redis_tier)
            assert store.flush(20)
    finally:
        store.close()
    if not back_before_close:
        _restart(victim)
    dropped = store.counters.get("redis.write_dropped", 0)
    missing = _missing(cluster, stored)
    assert set(missing) <= set(on_victim)
    assert len(missing) == dropped, (len(missing), dropped)
    assert dropped == (len(on_victim) - 8 if back_before_close else len(on_victim))


def test_a_dead_master_does_not_fail_the_others_first_writes(cluster: RedisCluster3) -> None:
    """A Redis tier whose first writes come while a master is dead: the other masters take
    theirs (the tier's Lua scripts are loaded on the key's master only; redis-py loads them on
    every master, which failed, blamed on the key's master, while one is dead)."""
    cluster.nodes[0].kill()
    tier = RedisTier(cluster.urls, cluster=True)
    try:
        ks = [b"first-%d" % i for i in range(30)]
        live = [k for k in ks if _master_port(tier, k) != cluster.nodes[0].port]
        for k in ks:
            try:
                tier.put(k, k)
            except PartlyUnavailable:
                assert k not in live
        assert [tier.get(k) for k in live] == live
        assert tier.masters_down() == [f"127.0.0.1:{cluster.nodes[0].port}"]
    finally:
        tier.close()


def test_the_whole_cluster_lost_and_back(cluster: RedisCluster3) -> None:
    """Every master killed under a write-behind store: reads of keys not in RAM miss and
    stores are acknowledged from RAM (redis-py's cluster client raises no ``RedisError`` when
    no node answers: it must reach the hierarchy as a kdn error, not escape it, nor end the
    Redis write queue's thread); once the masters are back, every queued copy lands."""
    store = TieredStore([RamTier(64 << 20), RedisTier(cluster.urls, cluster=True)],
                        write_policy=WritePolicy.WRITE_BEHIND, probe_interval_s=0.2)
    redis_tier = store.tiers[1]
    assert isinstance(redis_tier, RedisTier)
    before = [b"before-%d" % i for i in range(10)]
    during = [b"during-%d" % i for i in range(20)]
    try:
        for k in before:
            store.put(k, k * 10)
        assert store.flush(10)
        cluster.nodes[0].kill()  # one master known not to answer, then none answers
        assert redis_tier.healthy() and redis_tier.masters_down()
        for node in cluster.nodes[1:]:
            node.kill()
        for i, k in enumerate(during):
            store.put(k, k * 10)
            store.tiers[0].delete(before[i % 10])  # the next read asks Redis
            assert store.get(before[i % 10]) is None
        for node in cluster.nodes:
            node.start()
        for node in cluster.nodes:
            _restart_wait(node)
        assert store.flush(20)
    finally:
        store.close()
    assert _missing(cluster, before + during) == []
