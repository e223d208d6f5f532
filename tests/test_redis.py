"""The Redis tier against real redis-server processes: the parts+manifest scheme under crashes
and eviction, two kdn servers sharing one Redis Cluster, Redis killed and restarted under a
running kdn server (degraded health, queued writes, reconnect, nothing acknowledged lost),
Redis stopped (SIGSTOP: one timeout per call, not one per retry), and Redis refusing writes
(out of memory, too few replicas, a failed snapshot)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kdn import keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.errors import KDNError, PartlyUnavailable, Status, TooLarge, Unavailable
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.store.redis import PENDING_TTL_S, RedisTier
from kdn.store.tiered import WritePolicy
from tests.helpers import eventually, random_kv, sigstop, uniform_layout
from tests.redis_servers import (  # noqa: F401
    RedisCluster3,
    RedisServer,
    free_port,
    redis_cluster_fixture,
    redis_server_fixture,
)

pytestmark = pytest.mark.redis
LAYOUT = uniform_layout(layers=4, heads=2, dim=16)


def _eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    return eventually(cond, timeout, interval=0.05)


def _entries(n: int, start: int = 0, tokens: int = 64) -> dict[bytes, KVCache]:
    return {keys.chunk_key([i, 7], LAYOUT): random_kv(LAYOUT, tokens, seed=i)
            for i in range(start, start + n)}


# -- parts + manifest ---------------------------------------------------------------------------


def test_uncommitted_parts_are_invisible_and_expire(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, part_bytes=1024)
    old = b"o" * 5000
    tier.put(b"k", old)
    # A writer that died after writing its parts, before the commit: parts of a new version.
    r = redis_server.client()
    ghost = tier._part_key(b"k", b"\x01" * 8, 1)
    r.set(ghost, b"n" * 1024, ex=PENDING_TTL_S)
    assert tier.get(b"k") == old
    assert 0 < r.ttl(ghost) <= PENDING_TTL_S
    # Committed parts carry the entry's TTL (none here) and replaced versions expire.
    committed = [k for k in r.keys(b"kdn:{k}:*") if not k.endswith(b":m") and k != ghost]
    assert committed and all(r.ttl(k) == -1 for k in committed)
    tier.put(b"k", b"z" * 3000)
    assert all(0 < r.ttl(k) <= 10 for k in committed)  # grace for readers mid-way
    tier.close()


def test_a_commit_redis_never_answered_is_withdrawn_once_it_answers(
        redis_server: RedisServer) -> None:
    """Redis stopped with a commit in its socket: the write fails (no answer in time), and
    Redis runs the commit when it runs again. That version is withdrawn as soon as Redis
    answers (here by the next read; else the next write of the key, or the health probe), so
    a write reported failed is never served: the key is a miss. A write stopped at its parts
    (its commit never sent) leaves the previous value served, and its parts go at once."""
    assert redis_server.proc is not None
    tier = RedisTier(redis_server.url, part_bytes=1024, timeout_s=0.3, retries=0)
    try:
        tier.put(b"k", b"1" * 100)
        tier.put(b"big", b"1" * 5000)
        sigstop(redis_server.proc.pid)
        try:
            for key, size in ((b"k", 100), (b"big", 5000)):
                with pytest.raises(KDNError):
                    tier.put(key, b"2" * size)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        r = redis_server.client()
        assert _eventually(lambda: (r.get(tier._manifest_key(b"k")) or b"").endswith(b"2"))
        assert tier.get(b"k") is None
        assert tier.get(b"big") == b"1" * 5000
        assert len(r.keys(b"kdn:{big}:*")) == 5  # its manifest and 4 parts: no others
        tier.put(b"k", b"3" * 100)  # the key is written as ever after
        assert tier.get(b"k") == b"3" * 100
    finally:
        tier.close()


def test_evicted_part_is_a_miss_counted_as_an_eviction_and_cleans_up(
        redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, part_bytes=1024)
    tier.put(b"k", b"x" * 4000, ttl_s=100)
    r = redis_server.client()
    parts = [k for k in r.keys(b"kdn:{k}:*") if not k.endswith(b":m")]
    assert len(parts) == 3 and all(0 < r.ttl(k) <= 100 for k in parts)
    r.delete(parts[1])  # what maxmemory eviction does to one part
    assert tier.get(b"k") is None
    assert r.keys(b"kdn:{k}:*") == []
    st = tier.stats()  # an eviction (what maxmemory does), not damage an operator must chase
    assert (st.evictions, st.corrupt, st.misses) == (1, 0, 1)
    tier.close()


def test_a_manifest_whose_part_count_does_not_fit_its_length_is_damage(
        redis_server: RedisServer) -> None:
    """A manifest rewritten to declare 2**32-1 parts for 4,000 bytes made a read build (and a
    server hold) that many part keys at once: gigabytes, the call never answered. A part count
    that is not the one its length takes is damage: a miss, counted, dropped."""
    tier = RedisTier(redis_server.url, part_bytes=1024)
    tier.put(b"k", b"x" * 4000)
    r = redis_server.client()
    mk = next(k for k in r.keys(b"kdn:{k}:*") if k.endswith(b":m"))
    for parts in (2**32 - 1, 3, 5, 0):  # 4,000 bytes in parts of 1,024 are 4
        tier.put(b"k", b"x" * 4000)
        m = bytearray(r.get(mk))
        m[16:20] = parts.to_bytes(4, "little")
        r.set(mk, bytes(m))
        t0 = time.monotonic()
        assert tier.get(b"k") is None and time.monotonic() - t0 < 5
    assert tier.stats().corrupt == 4
    tier.put(b"k", b"y" * 4000)
    assert tier.get(b"k") == b"y" * 4000  # the key is written and read again
    tier.close()


def test_a_write_redis_refuses_leaves_no_parts(redis_server: RedisServer) -> None:
    """Out of memory (``noeviction``) part-way through a write's parts: the write fails as
    TooLarge, the parts it wrote are unlinked (not left holding memory for PENDING_TTL_S,
    refusing smaller writes meanwhile), and the entry stored before is served whole."""
    tier = RedisTier(redis_server.url, part_bytes=1024)
    r = redis_server.client()
    try:
        kept = bytes(range(256)) * 20
        tier.put(b"kept", kept)
        before = set(r.keys(b"kdn:*"))
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 64_000)
        with pytest.raises(TooLarge):
            tier.put(b"big", b"b" * 400_000)  # 390 parts: Redis refuses some after the first
        assert set(r.keys(b"kdn:*")) == before
        assert tier.get(b"big") is None and tier.get(b"kept") == kept
        tier.put(b"small", b"s" * 30_000)  # fits in what the refused write would have held
        assert tier.get(b"small") == b"s" * 30_000
    finally:
        r.config_set("maxmemory", 0)
        r.close()
        tier.close()


def test_redis_corrupt_value_served_from_disk(redis_server: RedisServer, tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=redis_server.url,
                       redis_part_bytes=4096, shutdown_grace_s=2)
    (key, kv), = _entries(1).items()
    with ServerThread(cfg) as st, Client(st.address) as c:
        c.store(key, kv)
        store = st.server.store  # type: ignore[union-attr]
        skey = keys.store_key("", "default", key)
        r = redis_server.client()
        mkey = b"kdn:{" + skey + b"}:m"
        raw = bytearray(r.get(mkey))  # type: ignore[arg-type]
        raw[-5] ^= 0xFF
        r.set(mkey, bytes(raw))
        store.tiers[0].delete(skey)
        hit = store.get(skey)  # redis copy fails its checksum; the disk copy is served
        assert hit is not None and hit.tier == "disk"
        assert not r.exists(mkey)
        assert store.counters["corrupt"] == 1
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


# -- Redis Cluster: two kdn servers share it --------------------------------------------------


def test_two_servers_share_a_cluster(redis_cluster: RedisCluster3, tmp_path: Path) -> None:
    url = ",".join(redis_cluster.urls)
    common = dict(port=0, redis_url=url, redis_cluster=True, redis_part_bytes=8192,
                  disk_bytes=0, shutdown_grace_s=2)
    a_cfg = ServerConfig(data_dir=tmp_path / "a", **common)  # type: ignore[arg-type]
    b_cfg = ServerConfig(data_dir=tmp_path / "b", **common)  # type: ignore[arg-type]
    entries = _entries(24)
    with ServerThread(a_cfg) as a, ServerThread(b_cfg) as b, \
            Client(a.address) as ca, Client(b.address) as cb:
        for key, kv in entries.items():
            ca.store(key, kv, options=StoreOptions(durability=Durability.SHARED))
        assert all(i.present and i.tier == "redis" for i in cb.lookup(list(entries)).infos)
        for key, kv in entries.items():
            hit = cb.fetch(key)
            assert hit is not None and hit.tier == "redis"
            assert cb.retrieve(key).equal(kv)  # type: ignore[union-attr]
        assert cb.delete(next(iter(entries))) == 1
        assert ca.lookup([next(iter(entries))]).infos[0].tier == "ram"  # A's own RAM copy
    per_node = [n.client().dbsize() for n in redis_cluster.nodes]
    assert all(n > 0 for n in per_node), per_node  # keys spread over all three masters


# -- Redis stopped mid-run -------------------------------------------------------------------


def test_redis_killed_and_restarted(redis_server: RedisServer, tmp_path: Path,
                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kdn.server")
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=redis_server.url,
                       redis_part_bytes=8192, redis_timeout_s=0.5, shutdown_grace_s=2)
    before, during = _entries(10), _entries(10, start=100)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=10) as c:
        store = st.server.store  # type: ignore[union-attr]
        for key, kv in before.items():
            c.store(key, kv)
        assert c.health("kdn.v1.KDN") == "SERVING"

        redis_server.kill()
        assert _eventually(lambda: c.health("kdn.v1.KDN") == "NOT_SERVING")
        assert c.health() == "SERVING"  # RAM and disk still work
        for key, kv in during.items():
            t0 = time.monotonic()
            c.store(key, kv)
            assert time.monotonic() - t0 < 2.0  # never held for the down tier
        for key, kv in {**before, **during}.items():
            assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]
        st_ = c.stats()
        assert st_.counters["store.degraded"] == 1
        assert st_.counters["store.redis.write_retried"] >= len(during)
        assert not next(t for t in st_.tiers if t.name == "redis").healthy
        with pytest.raises(Unavailable):
            c.store(keys.chunk_key([1, 2, 3], LAYOUT), random_kv(LAYOUT, 8),
                    options=StoreOptions(durability=Durability.SHARED))

        redis_server.start()  # same port, AOF (appendfsync always) brings the data back
        assert _eventually(lambda: c.health("kdn.v1.KDN") == "SERVING")
        assert store.flush(10)  # the writes queued while Redis was down land now

        def said() -> list[tuple[str, str]]:  # the recovery no WARNING (alerts fire on those)
            return [(r.levelname, r.getMessage()) for r in caplog.records
                    if r.getMessage().startswith("store health")]
        assert _eventually(lambda: len(said()) == 2)
        assert said() == [("WARNING", "store health: local tiers ok, degraded"),
                          ("INFO", "store health: local tiers ok, all tiers up")]

    # A second server with only RAM + Redis sees every entry: nothing acknowledged was lost.
    cfg_b = ServerConfig(port=0, data_dir=tmp_path / "b", redis_url=redis_server.url,
                         disk_bytes=0, redis_part_bytes=8192, shutdown_grace_s=2)
    with ServerThread(cfg_b) as st, Client(st.address) as c:
        for key, kv in {**before, **during}.items():
            hit = c.fetch(key)
            assert hit is not None and hit.tier == "redis"
            assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_a_redis_down_at_start_is_logged_with_its_url_and_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The only line was "tier redis is down (health probe failed)": no address, no cause."""
    port = free_port()  # nothing listens there
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, shutdown_grace_s=1,
                       redis_url=f"redis://:secret@127.0.0.1:{port}", redis_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="kdn.store"), ServerThread(cfg):
        def down() -> list[str]:
            return [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
        assert _eventually(lambda: bool(down()))
    assert len(down()) == 1, down()
    assert f"redis at redis://***@127.0.0.1:{port} does not answer: ConnectionError" in down()[0]
    assert "refused" in down()[0] and "secret" not in caplog.text


def test_the_write_queue_of_a_stopped_redis_stays_within_its_byte_budget(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Redis stopped, its write queue full: a store's copy for Redis is dropped and a delete
    of Redis's older copy waits in its place. The same keys stored again must not turn those
    deletes into queued values past the queue's budget (a server whose clients store keys
    again while Redis is down held every value in memory: gigabytes within minutes)."""
    budget = 1 << 20
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=redis_server.url,
                       disk_bytes=0, ram_bytes=64 << 20, redis_timeout_s=0.3,
                       write_queue_entries=4, write_queue_bytes=budget, shutdown_grace_s=2)
    entries = _entries(24, start=500, tokens=256)  # 128 KiB raw each: 3 MiB in all
    with ServerThread(cfg) as st, Client(st.address, timeout_s=10) as c:
        redis_server.kill()
        assert _eventually(lambda: c.health("kdn.v1.KDN") == "NOT_SERVING")
        for _ in range(2):
            for key, kv in entries.items():
                c.store(key, kv, mode="raw")
        counters = c.stats().counters
        assert counters["store.redis.write_dropped"] >= 20
        assert 0 < counters["store.redis.queued_bytes"] <= budget, counters
        for key, kv in entries.items():
            assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_a_key_kdn_did_not_write_into_redis_is_skipped_by_listings(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """One key under kdn's prefix that kdn never wrote (another tool's, a hand-made one)
    made every listing fail: ``kdn admin ls --namespace``, verify, export and Stats answered
    UNKNOWN (ValueError, UnicodeDecodeError) for every caller. Listings skip it."""
    from kdn.client.admin import AdminClient

    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=redis_server.url,
                       disk_bytes=0)
    key = keys.chunk_key([1], LAYOUT)
    r = redis_server.client()
    with ServerThread(cfg) as st, AdminClient(st.address) as c:
        c.store(key, random_kv(LAYOUT, 4), options=StoreOptions(durability=Durability.SHARED))
        for stray in (b"kdn:{default/zz}:m", b"kdn:{default/\xff00}:m", b"kdn:{:m"):
            r.set(stray, b"x")
        assert [e.key for e in c.ls(namespace="default")] == [key]
        c.evict([key], tier="ram")  # now only Redis holds it
        assert [e.key for e in c.ls(namespace="default")] == [key]
        done = [p for p in c.verify(dry_run=True) if p.done]
        assert done and all(p.corrupt == 0 for p in done)
    r.close()


def test_redis_restart_keeps_shared_entries(redis_server: RedisServer, tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=redis_server.url,
                       disk_bytes=0, write_policy=WritePolicy.WRITE_BEHIND,
                       redis_part_bytes=8192, shutdown_grace_s=2)
    entries = _entries(8, start=300)
    with ServerThread(cfg) as st, Client(st.address) as c:
        for key, kv in entries.items():
            c.store(key, kv, options=StoreOptions(durability=Durability.SHARED))
    redis_server.kill()
    redis_server.start()
    with ServerThread(cfg) as st, Client(st.address) as c:
        for key, kv in entries.items():
            assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_durability_shared_fails_fast_when_redis_is_down(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as r:
        url = r.url
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=url, redis_timeout_s=0.3,
                       shutdown_grace_s=2)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=5) as c:
        (key, kv), = _entries(1).items()
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.store(key, kv, options=StoreOptions(durability=Durability.SHARED))
        c.store(key, kv)  # the default durability still succeeds (RAM + disk)
        assert time.monotonic() - t0 < 3
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_a_stopped_redis_costs_a_call_one_timeout(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    timeout = 0.5
    shared = StoreOptions(durability=Durability.SHARED)
    (k1, kv1), (k2, kv2), (k3, kv3) = _entries(3, start=400).items()
    with RedisServer(tmp_path) as r:
        assert r.proc is not None
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", redis_url=r.url, disk_bytes=0,
                           tier_order=("ram", "redis"), redis_timeout_s=timeout,
                           shutdown_grace_s=1)
        st = ServerThread(cfg).start()
        try:
            with Client(st.address, timeout_s=10, shm_bytes=0) as c:
                c.store(k1, kv1, options=shared)
                sigstop(r.proc.pid)
                try:
                    t0 = time.monotonic()
                    with pytest.raises(Unavailable, match="redis tier is down"):
                        c.store(k2, kv2, options=shared)
                    took = time.monotonic() - t0
                    # one timeout; each retry of a command that timed out waits another
                    assert timeout * 0.9 < took < timeout * 1.9, took
                    t0 = time.monotonic()
                    with pytest.raises(Unavailable):  # the tier is down now: refused at once
                        c.store(k3, kv3, options=shared)
                    assert time.monotonic() - t0 < timeout * 0.5
                finally:
                    r.proc.send_signal(signal.SIGCONT)
                store = st.server.store  # type: ignore[union-attr]
                assert _eventually(lambda: store.is_up("redis"))  # the probe's PING answered
                c.store(k3, kv3, options=shared)
        finally:
            st.stop()
    assert raised == []


# -- Redis refusing writes ----------------------------------------------------------------------


def test_redis_refusals_reach_the_client_with_their_status(tmp_path: Path) -> None:
    """Redis refusing a write, also inside the tier's commit script ("Error running script
    ... -OOM ..."), reaches the client with its cause's status, never INTERNAL: out of memory
    is RESOURCE_EXHAUSTED; no writes for now (min-replicas-to-write unmet; MISCONF after a
    failed snapshot) is UNAVAILABLE for a SHARED store, while a DEFAULT store is acknowledged
    and its Redis write retried until Redis takes it (the tier is not marked down)."""
    shared = StoreOptions(durability=Durability.SHARED)
    (k1, kv1), (k2, kv2) = _entries(2, start=500, tokens=256).items()
    with RedisServer(tmp_path, appendonly=False) as rs:
        r = rs.client()
        cfg = ServerConfig(port=0, data_port=-1, data_dir=tmp_path / "d", redis_url=rs.url,
                           shutdown_grace_s=2)
        with ServerThread(cfg) as st, Client(st.address, timeout_s=10) as c:
            r.config_set("min-replicas-to-write", 1)  # no replica: Redis refuses writes
            with pytest.raises(KDNError) as info:
                c.store(k1, kv1, options=shared)
            assert info.value.status is Status.UNAVAILABLE
            c.store(k1, kv1)
            assert c.health("kdn.v1.KDN") == "SERVING"
            r.config_set("min-replicas-to-write", 0)
            assert st.server.store.flush(10)  # type: ignore[union-attr]
            assert r.keys(f"*{k1.hex()}*:m")  # its manifest: the entry is in Redis now

            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 10_000)
            with pytest.raises(KDNError) as info:
                c.store(k2, kv2, options=shared)
            assert info.value.status is Status.RESOURCE_EXHAUSTED, info.value
        r.config_set("maxmemory", 0)
        snapshots = tmp_path / "snapshots"
        snapshots.mkdir()
        r.config_set("dir", str(snapshots))
        r.config_set("save", "3600 1")
        shutil.rmtree(snapshots)
        r.bgsave()
        assert _eventually(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err")
        tier = RedisTier([rs.url])
        try:
            with pytest.raises(PartlyUnavailable, match="MISCONF"):
                tier.put(b"m", b"v" * 100)
        finally:
            tier.close()
