"""One Redis Cluster master out (issue 24 item 4), with real redis-server processes and a real
kdn server: stopped (SIGSTOP: a partition) or killed with a replica to take over, under load
from several clients. The Redis tier stays up for the slots whose masters answer: stores and
reads of keys there see no error (and no stall beyond one socket timeout), only the lost
slots' keys miss or refuse SHARED stores (at once, once the master is known not to answer),
health says DEGRADED (not down), and with `redis_wait_replicas` 1 no acknowledged SHARED store
is lost; `kdn admin verify` says the lost master's entries were not verified. The clusters
run with `cluster-require-full-coverage no` (else Redis itself refuses every key while a slot
is uncovered). The servers keep the default Redis timeout (1 s) and retries (2)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import main
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import KDNError
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.store.redis import RedisTier
from tests.helpers import eventually, random_kv, uniform_layout
from tests.redis_servers import RedisCluster3, RedisServer

pytestmark = pytest.mark.redis
LAY = uniform_layout(layers=2, heads=2, dim=8)
SHARED = StoreOptions(durability=Durability.SHARED)
KV = random_kv(LAY, 4)


def _redis(server: ServerThread) -> RedisTier:
    assert server.server is not None
    tier = next(t for t in server.server.store.tiers if t.name == "redis")
    assert isinstance(tier, RedisTier)
    return tier


def _port_of(server: ServerThread, key: bytes) -> int:
    """The port of the master that holds ``key``'s slot (as the server's client sees it)."""
    tier = _redis(server)
    mkey = tier._manifest_key(keys.store_key("", "default", key))
    return int(tier.client.get_node_from_key(mkey).port)  # type: ignore[union-attr]


def _forget_ram(server: ServerThread, key: bytes) -> None:
    """Drop the server's RAM copy, so that the next read comes from Redis."""
    assert server.server is not None
    server.server.store.tiers[0].delete(keys.store_key("", "default", key))


def _config(tmp: Path, cluster: RedisCluster3, **extra: object) -> ServerConfig:
    return ServerConfig(port=0, data_dir=tmp / "d", disk_bytes=0, redis_url=",".join(cluster.urls),
                        redis_cluster=True, tier_order=("ram", "redis"),
                        **extra)  # type: ignore[arg-type]


@dataclass
class Op:
    at: float  # when it started
    took: float
    key: bytes
    port: int  # the master of its slot when it started
    kind: str  # "store" or "read"
    error: str = ""  # a refusal, or a read that did not give the stored entry back


class Load:
    """Client threads that store (SHARED) and read entries through the server, recording every
    operation: ``storers`` on keys ``pick`` accepts, ``readers`` reading back entries stored
    earlier (from Redis: the RAM copy is dropped first)."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.ops: list[Op] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _run(self, body: Callable[[Client, int], None]) -> None:
        with Client(self.server.address, retry=None, timeout_s=20) as c:
            i = 0
            while not self.stop.is_set():
                body(c, i)
                i += 1

    def storers(self, n: int, pick: Callable[[int], bool], tag: int) -> None:
        def body(c: Client, i: int, seed: int) -> None:
            k = keys.chunk_key([tag, seed, i], LAY)
            port = _port_of(self.server, k)
            if not pick(port):
                return
            t = time.monotonic()
            try:
                c.store(k, KV, options=SHARED)
                err = ""
            except KDNError as exc:
                err = str(exc) or type(exc).__name__
            self.ops.append(Op(t, time.monotonic() - t, k, port, "store", err))

        for s in range(n):
            self.threads.append(threading.Thread(
                target=self._run, args=(lambda c, i, s=s: body(c, i, s),)))

    def readers(self, n: int, pool: Callable[[], list[tuple[bytes, int]]]) -> None:
        def body(c: Client, i: int) -> None:
            got = pool()
            if not got:
                time.sleep(0.01)
                return
            k, port = got[(i * 7919) % len(got)]
            _forget_ram(self.server, k)
            t = time.monotonic()
            try:
                v = c.retrieve(k)
                err = "" if v is not None and v.equal(KV) else "miss"
            except KDNError as exc:
                err = str(exc) or type(exc).__name__
            self.ops.append(Op(t, time.monotonic() - t, k, port, "read", err))

        for _ in range(n):
            self.threads.append(threading.Thread(target=self._run, args=(body,)))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def acked(self, pick: Callable[[int], bool]) -> list[tuple[bytes, int]]:
        return [(o.key, o.port) for o in list(self.ops)
                if o.kind == "store" and not o.error and pick(o.port)]


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    with RedisCluster3(tmp_path / "c") as c:
        yield c


def test_a_stopped_master_takes_out_its_slots_only(tmp_path: Path,
                                                    cluster: RedisCluster3) -> None:
    """Three clients store and two read keys on the other masters while two hammer the
    stopped master's keys, through the stop and the cluster's own reaction (its failure mark
    after the 2 s node timeout). Keys elsewhere: no error, no miss, no call slower than one
    socket timeout plus a margin; the lost keys fail at once after the first timeout."""
    victim = cluster.nodes[0]
    with ServerThread(_config(tmp_path, cluster)) as server, \
            AdminClient(server.address, retry=None, timeout_s=10) as admin:
        live = lambda port: port != victim.port  # noqa: E731
        load = Load(server)
        load.storers(3, live, tag=1)
        load.readers(2, lambda: load.acked(live))
        load.storers(2, lambda port: not live(port), tag=2)
        with load:
            time.sleep(1.0)
            assert victim.proc is not None
            stopped_at = time.monotonic()
            victim.proc.send_signal(signal.SIGSTOP)  # a partition: it neither answers nor dies
            try:
                assert eventually(lambda: cluster.failed(victim), timeout=15, interval=0.1)
                time.sleep(1.0)  # and a while after the cluster's failure mark
                report = admin.health_report()
                probe = ["admin", "health", "--timeout", "5", "--address", server.address]
                exits = (main(probe), main([*probe, "--ready"]))
                down = _redis(server).masters_down()
                assert server.server is not None
                parts = server.server.store.parts_down()
                stored = load.acked(live)
                t = time.monotonic()  # a listing: the masters that answer, at once
                listed = set(_redis(server).keys(b""))
                listing_s = time.monotonic() - t
            finally:
                resumed_at = time.monotonic()
                victim.proc.send_signal(signal.SIGCONT)
        ops = load.ops
        during = [o for o in ops if o.at >= stopped_at and o.at + o.took < resumed_at]
        elsewhere = [o for o in ops if o.port != victim.port]
        bad = [o for o in elsewhere if o.error]
        assert bad == [], bad[:3]
        assert len([o for o in elsewhere if o in during and o.kind == "read"]) > 20
        assert len([o for o in elsewhere if o in during and o.kind == "store"]) > 20
        slow = max(o.took for o in elsewhere)
        assert slow < 2.0, slow  # at worst one socket timeout behind a lost key's write
        lost = [o for o in during if o.port == victim.port]
        assert lost and all(o.error for o in lost if o.at > stopped_at + 1.5)
        late = [o.took for o in lost if o.at > stopped_at + 1.5]
        assert len(late) > 20 and _p(late, 0.99) < 0.25, late[-5:]  # refused at once
        print(f"stopped master: {len(elsewhere)} ops elsewhere, 0 errors, slowest {slow:.3f} s; "
              f"{len(lost)} on its slots, refused after 1.5 s in p99 {_p(late, 0.99):.4f} s")
        assert report["tiers"]["redis"] == "DEGRADED" and report["status"] == "DEGRADED"
        assert report["services"]["kdn.v1.KDN"] == "SERVING"  # not down: degraded
        assert down == [f"127.0.0.1:{victim.port}"] and parts == {"redis": down}
        assert report["parts_down"] == {"redis": down}  # what kdn admin health prints
        assert exits == (0, 1)  # live, not ready: as the README's cluster section says
        readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
        assert "`DEGRADED` with the silent masters (exit 0: the server is live; `--ready` " \
               "with an API key exits 1)" in readme  # (auth off here: any caller's)
        assert listing_s < 0.5 and stored
        assert all(keys.store_key("", "default", k) in listed for k, _ in stored)
        assert eventually(lambda: admin.health_report()["status"] == "SERVING", timeout=15)
        with Client(server.address, retry=None, timeout_s=10) as c:
            k = next(o.key for o in lost)
            c.store(k, KV, options=SHARED)  # its slots are back
            _forget_ram(server, k)
            got = c.retrieve(k)
            assert got is not None and got.equal(KV)


def _promoted(heir: RedisServer, since: float, timeout: float = 20) -> float:
    """When ``heir`` became a master (polled every 20 ms)."""
    c = heir.client()
    try:
        while time.monotonic() - since < timeout:
            if c.info("replication").get("role") == "master":
                return time.monotonic()
            time.sleep(0.02)
    finally:
        c.close()
    raise AssertionError("the replica was not promoted")


@pytest.mark.parametrize("wait", [0, 1])
def test_a_killed_master_takes_out_its_slots_until_its_replica_takes_over(
        tmp_path: Path, wait: int) -> None:
    """Four clients store SHARED entries (on every master) and two read entries of the other
    masters back while a master is killed. Keys on the other masters: no error, no miss.
    Without WAIT the lost slots' SHARED stores resume within 1 s of the replica's promotion.
    With WAIT 1 no acknowledged store is lost; the promoted replica, alone, refuses SHARED
    stores at once (nothing can confirm them) until the old master comes back as its replica,
    and then takes them again."""
    with RedisCluster3(tmp_path / "c", replicas=True) as cluster:
        victim, heir = cluster.nodes[0], cluster.replicas[0]
        cfg = _config(tmp_path, cluster, redis_wait_replicas=wait, redis_wait_timeout_s=1.0)
        with ServerThread(cfg) as server:
            others = lambda port: port not in (victim.port, heir.port)  # noqa: E731
            load = Load(server)
            load.storers(4, lambda port: True, tag=1)
            load.readers(2, lambda: load.acked(others))
            with load:
                time.sleep(1.0)
                killed_at = time.monotonic()
                victim.kill()
                promoted_at = _promoted(heir, killed_at)
                time.sleep(2.0)
                if wait:  # the old master back, as the new one's replica: WAIT 1 can be met
                    victim.start()
                    back_at = time.monotonic()
                    assert eventually(lambda: heir.client().info("replication").get(
                        "connected_slaves", 0) >= 1, timeout=15)
                    time.sleep(1.5)
            ops = load.ops
            # keys on the other masters: zero errors, before, during and after
            bad = [o for o in ops if others(o.port) and o.error]
            assert bad == [], bad[:3]
            assert len([o for o in ops if others(o.port) and o.kind == "read"
                        and o.at > killed_at]) > 20
            on_heir = [o for o in ops if o.kind == "store" and o.at > promoted_at
                       and _port_of(server, o.key) == heir.port]
            if wait == 0:  # the lost slots' SHARED stores resumed within 1 s of the promotion
                first = min((o.at + o.took for o in on_heir if not o.error), default=None)
                assert first is not None, "no store on the promoted replica's slots"
                print(f"killed master: promoted {promoted_at - killed_at:.2f} s after the kill, "
                      f"first SHARED store there acknowledged {first - promoted_at:.3f} s later")
                assert first - promoted_at <= 1.0, first - promoted_at
            else:
                alone = [o for o in on_heir if o.at + o.took < back_at]
                assert alone and all(o.error for o in alone)  # nothing confirms them: refused
                late = [o.took for o in alone if o.at > promoted_at + 1.5]
                assert late and _p(late, 0.9) < 0.25, late[-5:]  # at once, once known short
                assert any(not o.error for o in on_heir if o.at > back_at)  # confirmed again
                tier = _redis(server)  # every acknowledged SHARED store is in Redis
                acked = [o.key for o in ops if o.kind == "store" and not o.error]
                missing = [k for k in acked
                           if tier.get(keys.store_key("", "default", k)) is None]
                assert missing == [], f"{len(missing)} of {len(acked)} acknowledged lost"
                print(f"killed master, WAIT 1: {len(acked)} acknowledged, 0 lost; refusals on "
                      f"the lone promoted replica p90 {_p(late, 0.9):.4f} s")
            assert len([o for o in ops if o.kind == "store" and not o.error]) > 50


def test_batches_follow_a_manual_failover(tmp_path: Path) -> None:
    """A replica that takes over while its master is up (CLUSTER FAILOVER TAKEOVER) leaves the
    old master answering MOVED: the tier's per-master pipelines (batched lookups, reads, an
    entry's parts) follow it at once, no probe needed."""
    with RedisCluster3(tmp_path / "c", replicas=True) as cluster:
        tier = RedisTier(cluster.urls, cluster=True, part_bytes=1024)
        try:
            ks = [b"key-%d" % i for i in range(30)]
            values = {k: bytes([i]) * (3000 if i % 2 else 100) for i, k in enumerate(ks)}
            for k, v in values.items():
                tier.put(k, v)
            old = f"127.0.0.1:{cluster.nodes[0].port}"
            moved = [k for k in ks if tier._master_of(k) == old]
            assert moved
            rc, oc = cluster.replicas[0].client(), cluster.nodes[0].client()
            try:  # TAKEOVER: no handshake with the old master, which then follows it
                rc.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
                assert eventually(lambda: rc.info("replication").get("role") == "master"
                                  and oc.info("replication").get("role") == "slave",
                                  timeout=15)
            finally:
                rc.close()
                oc.close()
            assert tier.contains_many(ks) == [True] * len(ks)
            assert tier.get_many(ks) == [values[k] for k in ks]
            for k in moved[:4]:
                tier.put(k, values[k] + b"!")
                assert tier.get(k) == values[k] + b"!"
            assert tier.masters_down() == []
        finally:
            tier.close()


def test_wait_withdraws_a_write_no_replica_confirms(tmp_path: Path) -> None:
    """``wait_replicas`` 1 on a standalone master: a write its replica confirmed counts; with
    the replica gone the write fails (ReplicasShort, an UNAVAILABLE error) after the WAIT
    timeout and is withdrawn: no manifest, none of its parts, the replaced version's parts
    expiring rather than kept forever."""
    from kdn.store.redis import GRACE_S, ReplicasShort

    with RedisServer(tmp_path / "m", appendonly=False) as master, \
            RedisServer(tmp_path / "r", appendonly=False,
                        extra=("--replicaof", "127.0.0.1", "0")) as replica:
        rc, mc = replica.client(), master.client()
        try:
            rc.execute_command("REPLICAOF", "127.0.0.1", master.port)
            assert eventually(lambda: rc.info("replication").get("master_link_status") == "up",
                              timeout=15)
            tier = RedisTier(master.url, wait_replicas=1, wait_timeout_s=0.3, part_bytes=1024)
            old = b"o" * 3000
            tier.put(b"k", old)  # three keys: manifest + 2 parts, all on the replica too
            assert tier.get(b"k") == old
            assert eventually(lambda: len(rc.keys(b"kdn:*")) == 3)
            replica.kill()
            t = time.monotonic()
            with pytest.raises(ReplicasShort) as err:
                tier.put(b"k", b"n" * 3000)
            assert 0.3 <= time.monotonic() - t < 2.0
            assert err.value.status.name == "UNAVAILABLE"
            assert tier.get(b"k") is None  # withdrawn, the old value replaced before
            left = mc.keys(b"kdn:*")
            assert left and all(0 < mc.ttl(k) <= GRACE_S for k in left)  # old parts: expiring
            tier.close()
        finally:
            rc.close()
            mc.close()


def test_verify_with_a_master_down_says_its_entries_were_not_verified(tmp_path: Path) -> None:
    """`kdn admin verify` while one master is killed (no replica): the entries of the masters
    that answer are verified, and the call ends UNAVAILABLE naming the lost master, as for a
    tier that is down (it reported the tier done, a third of its entries left out)."""
    with RedisCluster3(tmp_path / "c") as cluster:
        with ServerThread(_config(tmp_path, cluster)) as server, \
                Client(server.address, retry=None) as c, \
                AdminClient(server.address, retry=None) as a:
            for i in range(6):
                c.store(keys.chunk_key([i], LAY), KV)
            cluster.nodes[0].kill()
            assert server.server is not None
            server.server.store.probe()
            with pytest.raises(KDNError, match=rf"redis \(127.0.0.1:{cluster.nodes[0].port}\) "
                                               r"does not answer: not verified"):
                list(a.verify(dry_run=True))
