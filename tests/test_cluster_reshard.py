"""A Redis Cluster slot moved between masters under the Redis tier (real redis-server
processes; the migration done by hand as ``redis-cli --cluster reshard`` does it: SETSLOT
IMPORTING / MIGRATING, MIGRATE key by key, SETSLOT NODE).

While the slot migrates, a new entry's keys go to the importing master (ASK), which may lack
the tier's Lua scripts: the write lands there all the same. An overwrite whose entry is split
between the two masters (its manifest not moved yet, its new parts on the importing one) can
not commit in one place: it fails as ``PartlyUnavailable`` (worth retrying), leaving no parts
behind, and the entry before it is served. Once the slot has moved, every entry reads whole
from its new master, and a write that waits for a replica (``wait_replicas``) follows the
MOVED from a map that predates the move."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from kdn.errors import PartlyUnavailable
from kdn.store.redis import RedisTier
from tests.redis_servers import RedisCluster3, RedisServer

pytestmark = pytest.mark.redis


def _keys_in_slot(tier: RedisTier, slot: int, n: int, tag: bytes) -> list[bytes]:
    found: list[bytes] = []
    i = 0
    while len(found) < n:
        k = tag + b"%d" % i
        i += 1
        if key_slot(tier._manifest_key(k)) == slot:
            found.append(k)
    return found


class _Move:
    """Move ``slot`` from ``src`` to ``dst``: ``begin`` marks it migrating, ``migrate`` moves
    some keys, ``finish`` moves the rest and gives the slot to ``dst`` on both."""

    def __init__(self, cluster: RedisCluster3, slot: int, src: RedisServer,
                 dst: RedisServer) -> None:
        self.slot, self.dst = slot, dst
        self.src_id, self.dst_id = cluster.node_id(src), cluster.node_id(dst)
        self.sc, self.dc = src.client(), dst.client()

    def begin(self) -> None:
        self.dc.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.src_id)
        self.sc.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.dst_id)

    def migrate(self, ks: list[bytes]) -> None:
        self.sc.execute_command("MIGRATE", "127.0.0.1", self.dst.port, "", 0, 5000, "KEYS", *ks)

    def finish(self) -> None:
        while True:
            ks = self.sc.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 10)
            if not ks:
                break
            self.migrate(ks)
        for c in (self.dc, self.sc):
            c.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.dst_id)

    def keys_on(self, client: redis.Redis, tag: bytes) -> list[bytes]:
        return [k for k in client.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 1000)
                if tag in k]

    def close(self) -> None:
        self.sc.close()
        self.dc.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    with RedisCluster3(tmp_path / "c") as c:
        yield c


def test_writes_during_a_slot_migration(cluster: RedisCluster3) -> None:
    tier = RedisTier(cluster.urls, cluster=True, part_bytes=1024)
    src, dst = cluster.nodes[0], cluster.nodes[1]
    slot = 100  # node 0's
    moved_key, split_key, small_key, fresh_key = _keys_in_slot(tier, slot, 4, b"k")
    old = bytes(range(256)) * 20  # 5 parts
    new = bytes(reversed(range(256))) * 24
    move = _Move(cluster, slot, src, dst)
    try:
        tier.put(moved_key, old)
        tier.put(split_key, old)
        # the importing master has taken no write of the tier: it lacks the Lua scripts
        assert move.dc.script_exists(tier._commit.sha) == [False]
        move.begin()
        move.migrate(move.keys_on(move.sc, moved_key))  # that entry is on dst now, whole
        tier.put(moved_key, new)  # its keys all on dst (new parts by ASK): commits there
        tier.put(small_key, b"s" * 100)  # one key, new: ASK, to dst
        assert move.keys_on(move.dc, small_key)
        # manifest on src, new parts on dst; or a new manifest that dst does not hold yet
        for k in (split_key, fresh_key):
            with pytest.raises(PartlyUnavailable):
                tier.put(k, new)
            assert [x for x in move.keys_on(move.dc, k) if not x.endswith(b":m")] == []
        expect = {moved_key: new, split_key: old, small_key: b"s" * 100, fresh_key: None}
        assert {k: tier.get(k) for k in expect} == expect
        move.finish()
        assert {k: tier.get(k) for k in expect} == expect
        tier.put(fresh_key, new)
        fresh = RedisTier(cluster.urls, cluster=True, part_bytes=1024)
        try:
            assert {k: fresh.get(k) for k in expect} == {**expect, fresh_key: new}
            assert fresh._master_of(split_key) == f"127.0.0.1:{dst.port}"
        finally:
            fresh.close()
    finally:
        move.close()
        tier.close()


def test_a_replicated_write_follows_a_moved_slot(tmp_path: Path) -> None:
    """``wait_replicas`` 1: the commit and its WAIT go on a connection of their own to the
    master the tier's map names; after a reshard that map is stale, and the write follows the
    MOVED to the slot's new master (single-part entries, whose write is the commit alone)."""
    with RedisCluster3(tmp_path / "c", replicas=True) as cluster:
        tier = RedisTier(cluster.urls, cluster=True, wait_replicas=1, wait_timeout_s=5)
        slot = 100
        ks = _keys_in_slot(tier, slot, 3, b"w")
        move = _Move(cluster, slot, cluster.nodes[0], cluster.nodes[1])
        try:
            for k in ks:
                tier.put(k, b"old" * 100)
            move.begin()
            move.finish()
            for k in ks:
                tier.put(k, b"new" * 100)
            assert [tier.get(k) for k in ks] == [b"new" * 100] * 3
            assert tier._master_of(ks[0]) == f"127.0.0.1:{cluster.nodes[1].port}"
        finally:
            move.close()
            tier.close()
