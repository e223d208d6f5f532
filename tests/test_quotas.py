"""Byte quotas are exact and refused writes leave nothing behind (issue 20 items 2–3), against
real servers: a storm of concurrent stores, overwrites, deletes and evictions from many clients
ends with each tenant's usage equal to the bytes its entries hold; a store the server refuses
is seen by no reader, before or after a restart, and an overwrite that fails keeps the old
value served."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import InvalidArgument, KDNError, TooLarge
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import digest
from kdn.store.redis import RedisTier
from tests.helpers import eventually, random_kv, sigstop, uniform_layout
from tests.redis_servers import RedisCluster3, RedisServer

LAY = uniform_layout(layers=2, heads=2, dim=8)
TENANTS = """
tenants:
  team-a: {api_keys: ["key-a"], quota_bytes: 1MiB}
  team-b: {api_keys: ["key-b"], quota_bytes: 48KiB}
  ops: {api_keys: ["sha256:%s"], role: admin, quota_bytes: 1MiB}
"""
API_KEYS = {"team-a": "key-a", "team-b": "key-b", "ops": "key-ops"}


def _stored_bytes(server: ServerThread, tenant: str) -> int:
    assert server.server is not None
    store = server.server.store
    return sum(p.size for p in store.lookup(store.keys(f"{tenant}:".encode())))


def _usage(server: ServerThread, tenant: str) -> int:
    assert server.server is not None
    return server.server.servicer.auth.usage(tenant)


def test_usage_equals_stored_bytes_after_a_storm_of_concurrent_operations(
        tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS % digest("key-ops"))
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth),
                       ram_bytes=256 << 10)  # small: RAM evicts (demotes to disk) as it goes
    pool = [keys.chunk_key([i], LAY) for i in range(12)]  # few keys: many collide
    # entries of different sizes, so an overwrite changes the usage
    values = [random_kv(LAY, tokens, seed=tokens) for tokens in (4, 16, 40, 96)]
    counts = {"store": 0, "refused": 0, "delete": 0, "evict": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int, tenant: str, server: ServerThread) -> None:
        rnd = random.Random(seed)
        cls = AdminClient if tenant == "ops" else Client
        try:
            with cls(server.address, api_key=API_KEYS[tenant], shm_bytes=0,
                     retry=None) as c:
                for _ in range(150):
                    key, op = rnd.choice(pool), rnd.random()
                    if op < 0.6:
                        try:
                            c.store(key, rnd.choice(values), mode="raw")
                            what = "store"
                        except TooLarge:
                            what = "refused"
                    elif op < 0.8 or tenant != "ops":
                        c.delete(key)
                        what = "delete"
                    else:
                        c.evict([key], tier=rnd.choice(["ram", "disk"]))  # type: ignore[attr-defined]
                        what = "evict"
                    with lock:
                        counts[what] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with ServerThread(cfg) as server:
        threads = [threading.Thread(target=worker, args=(i, t, server))
                   for i, t in enumerate(["team-a", "team-a", "team-b", "team-b", "ops",
                                          "ops", "team-a", "team-b"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert sum(counts.values()) == 8 * 150
        assert min(counts.values()) > 5, counts  # every kind of operation raced
        assert server.server is not None
        server.server.store.flush()
        for tenant in API_KEYS:
            assert _usage(server, tenant) == _stored_bytes(server, tenant), tenant
        assert _stored_bytes(server, "team-b") <= 48 << 10
    # a restart recounts from the tiers: the same numbers
    with ServerThread(cfg) as again:
        for tenant in API_KEYS:
            assert _usage(again, tenant) == _stored_bytes(again, tenant)


def test_a_refused_store_leaves_nothing_and_a_failed_overwrite_keeps_the_old_value(
        tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS % digest("key-ops"))
    auth.chmod(0o600)
    old, new = random_kv(LAY, 8, seed=1), random_kv(LAY, 24, seed=2)
    key, fresh = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    shared = StoreOptions(durability=Durability.SHARED)
    with RedisServer(tmp_path / "redis") as redis_server:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth),
                           redis_url=redis_server.url, redis_timeout_s=0.3, redis_retries=0)
        with ServerThread(cfg) as server:
            with Client(server.address, api_key="key-a", retry=None) as c:
                c.store(key, old, mode="raw", options=shared)
                used = _usage(server, "team-a")
                assert used == _stored_bytes(server, "team-a") > 0
                redis_server.kill()
                for k, kv in ((key, new), (fresh, new)):
                    with pytest.raises(KDNError):
                        c.store(k, kv, mode="raw", options=shared)
                # the overwrite that failed: the old value is what every reader gets
                got = c.retrieve(key)
                assert got is not None and got.equal(old)
                # the refused new entry: nowhere, in no tier, in no queue
                assert c.retrieve(fresh) is None
                assert server.server is not None
                store = server.server.store
                skey = keys.store_key("team-a", "default", fresh)
                assert not any(t.contains(skey) for t in store.tiers if t.name != "redis")
                assert not store.lookup([skey])[0].present  # queued copies included
                assert _usage(server, "team-a") == used
                store.flush(timeout=2)
            assert server.server is not None
            data_keys = server.server.store.keys(b"team-a:")
        # after a restart (redis still down): the old value, and no trace of the new one
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d",
                                       auth_file=str(auth))) as again:
            with Client(again.address, api_key="key-a", retry=None) as c:
                got = c.retrieve(key)
                assert got is not None and got.equal(old)
                assert c.retrieve(fresh) is None
            assert _usage(again, "team-a") == used
            assert again.server is not None
            assert again.server.store.keys(b"team-a:") == data_keys


def test_usage_is_not_recounted_down_while_a_tier_holding_entries_is_down(
        tmp_path: Path) -> None:
    """Entries only Redis holds stay charged while Redis is down, through a Gc and a restart
    (their bytes given back, the tenant stored past its quota once Redis answered), and the
    usage is counted exactly again once it is back."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS % digest("key-ops"))
    auth.chmod(0o600)
    kv = random_kv(LAY, 16, seed=1)
    shared = StoreOptions(durability=Durability.SHARED)
    with RedisServer(tmp_path / "redis") as redis_server:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth),
                           redis_url=redis_server.url, redis_timeout_s=0.3, redis_retries=0)
        k = [keys.chunk_key([i], LAY) for i in range(3)]
        with ServerThread(cfg) as server, \
                Client(server.address, api_key="key-b", retry=None, shm_bytes=0) as c, \
                AdminClient(server.address, api_key="key-ops", retry=None, shm_bytes=0) as a:
            for key in k:
                c.store(key, kv, mode="raw", options=shared)
            assert server.server is not None
            used = _usage(server, "team-b")
            a.evict(k[:2], tier="ram", tenant="team-b")  # only Redis holds them now
            redis_server.kill()
            assert not a.gc().usage_recounted
            assert _usage(server, "team-b") == used
        with ServerThread(cfg) as again:  # started with Redis down: what RAM holds, nothing
            assert again.server is not None
            assert not again.server.servicer.auth.usage_whole
            redis_server.start()
            deadline = time.monotonic() + 5
            while not again.server.servicer.auth.usage_whole:  # Redis back: counted again
                assert time.monotonic() < deadline
                again.server.store.probe()
                time.sleep(0.05)
            assert _usage(again, "team-b") == _stored_bytes(again, "team-b") > 0
            with AdminClient(again.address, api_key="key-ops", retry=None, shm_bytes=0) as a:
                assert a.gc().usage_recounted


def test_usage_is_not_recounted_down_while_a_cluster_master_is_down(tmp_path: Path) -> None:
    """Entries only a stopped Redis Cluster master holds (the tier stays up for the others'
    slots) stay charged through a Gc, and the usage is counted exactly again once the master
    answers. (Such an entry can not be pinned: Redis does not keep pins.)"""
    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS % digest("key-ops"))
    auth.chmod(0o600)
    kv = random_kv(LAY, 4, seed=1)
    with RedisCluster3(tmp_path / "c") as cluster:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth),
                           redis_url=",".join(cluster.urls), redis_cluster=True,
                           tier_order=("ram", "redis"), redis_timeout_s=0.3)
        k = [keys.chunk_key([i], LAY) for i in range(9)]
        with ServerThread(cfg) as server, \
                Client(server.address, api_key="key-b", retry=None, shm_bytes=0) as c, \
                AdminClient(server.address, api_key="key-ops", retry=None, shm_bytes=0) as a:
            for key in k:
                c.store(key, kv, mode="raw", options=StoreOptions(durability=Durability.SHARED))
            assert server.server is not None
            store, auth_ = server.server.store, server.server.servicer.auth
            used = _usage(server, "team-b")
            a.evict(k, tier="ram", tenant="team-b")  # only Redis holds them now
            tier = next(t for t in store.tiers if isinstance(t, RedisTier))
            lost = next(n for n in cluster.nodes
                        if tier._master_of(keys.store_key("team-b", "default", k[0]))  # noqa: SLF001
                        == f"127.0.0.1:{n.port}")
            assert lost.proc is not None
            with pytest.raises(InvalidArgument, match="does not keep pins"):
                a.pin([k[0]], tenant="team-b")
            sigstop(lost.proc.pid)
            try:
                store.probe()
                assert store.parts_down() == {"redis": [f"127.0.0.1:{lost.port}"]}
                assert not a.gc().usage_recounted
                assert _usage(server, "team-b") == used
                assert not store.is_pinned(keys.store_key("team-b", "default", k[0]))
            finally:
                lost.proc.send_signal(signal.SIGCONT)
            assert eventually(lambda: (store.probe(), auth_.usage_whole)[1], timeout=8)
            assert _usage(server, "team-b") == _stored_bytes(server, "team-b") == used


@pytest.mark.parametrize("path", [{"shm_bytes": 0, "data_path": False}, {"shm_bytes": 0}, {}],
                         ids=["grpc", "data-path", "shared-segment"])
def test_a_batch_that_fits_the_quota_is_stored_whole_though_an_item_alone_would_not(
        tmp_path: Path, path: dict[str, object]) -> None:
    """A tenant at its quota stores a batch that shrinks two entries around a new one: the
    new one alone is past the quota, the batch is not (it was refused after its first item)."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team-a: {api_keys: ["key-a"], quota_bytes: 6666}\n')
    auth.chmod(0o600)
    big, small = random_kv(LAY, 16, seed=1), random_kv(LAY, 4, seed=2)  # raw: 2222, 686 bytes
    k = [keys.chunk_key([i], LAY) for i in range(4)]
    with ServerThread(ServerConfig(port=0, auth_file=str(auth), data_dir=tmp_path / "d")) as s, \
            Client(s.address, api_key="key-a", retry=None, **path) as c:  # type: ignore[arg-type]
        for key in k[:3]:
            c.store(key, big, mode="raw")
        assert _usage(s, "team-a") == 6666
        c.store_many([(k[1], small), (k[3], big), (k[0], small)], mode="raw")
        assert _usage(s, "team-a") == _stored_bytes(s, "team-a") == 2 * 686 + 2 * 2222
        with pytest.raises(TooLarge, match="nothing of it was stored"):  # one that does not fit
            c.store_many([(k[0], big), (k[1], big), (k[2], small)], mode="raw")
        assert _stored_bytes(s, "team-a") == 2 * 686 + 2 * 2222


def test_a_single_store_is_refused_in_the_same_words_on_every_path(tmp_path: Path) -> None:
    """Client.store past max_entry_bytes or the quota reads alike through gRPC, the same-host
    fast path and the network data path (the last two named "item 0" of a "PutMany")."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team-a: {api_keys: ["key-a"], quota_bytes: 40KiB}\n')
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth), disk_bytes=0,
                       max_entry_bytes=30000)
    paths = ({"shm_bytes": 0, "data_path": False}, {"shm_bytes": 8 << 20}, {"shm_bytes": 0})
    said: list[list[str]] = []
    with ServerThread(cfg) as s:
        for n, path in enumerate(paths):
            with Client(s.address, api_key="key-a", retry=None,
                        **path) as c:  # type: ignore[arg-type]
                got = []
                for kv in (random_kv(LAY, 400, seed=2), random_kv(LAY, 200, seed=3)):
                    try:  # too large; then one that fits alone, and past the quota twice
                        c.store(keys.chunk_key([n, 1], LAY), kv, mode="raw")
                        c.store(keys.chunk_key([n, 2], LAY), kv, mode="raw")
                    except TooLarge as e:
                        got.append(str(e))
                c.delete([keys.chunk_key([n, 1], LAY)])
                said.append(got)
    assert "exceeds max_entry_bytes 30000" in said[0][0]
    assert "tenant 'team-a' quota: this entry adds" in said[0][1]
    assert said[1] == said[0] and said[2] == said[0]
