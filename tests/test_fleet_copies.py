"""Copies across a fleet (kdn.client.fleet, "Copies"): two in-process kdn nodes sharing a real
redis-server, each with its own RAM tier. An overwrite or a delete made through the fleet
leaves no node's RAM serving the old value, also a node this client had marked down."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import keys
from kdn.cache import KVCache
from kdn.client.admin import AdminClient
from kdn.client.client import Client
from kdn.client.fleet import FleetClient, FleetConfig
from kdn.errors import DeadlineExceeded, InvalidArgument, PermissionDenied, TooLarge
from kdn.names import MAX_CALL_KEYS
from kdn.server import ServerThread
from tests.helpers import random_kv, running_nodes, uniform_layout
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.redis
LAY = uniform_layout(layers=2, heads=2, dim=8)
KEY = hashlib.blake2b(b"copies", digest_size=32).digest()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[ServerThread]]:
    with RedisServer(tmp_path / "redis") as redis, \
            running_nodes(tmp_path, redis_url=redis.url, tier_order=("ram", "redis")) as out:
        yield out


def fleet(addresses: list[str]) -> FleetClient:
    return FleetClient(FleetConfig(nodes=tuple(addresses), health_interval_s=0,
                                   load_bound=100.0, client_options={"shm_bytes": 0}))


def read(node: ServerThread) -> KVCache | None:
    """What ``node`` serves for KEY (its RAM copy when it has one)."""
    with Client(node.address, shm_bytes=0) as c:
        return c.retrieve(KEY)


def test_an_overwrite_leaves_no_node_serving_the_old_value(
        nodes: list[ServerThread]) -> None:
    v1, v2, v3 = (random_kv(LAY, 4, seed=s) for s in (1, 2, 3))
    with fleet([n.address for n in nodes]) as f:
        f.store(KEY, v1)
        home = f.order([KEY])[0]
        other = 1 - home
        assert read(nodes[other]).equal(v1)  # type: ignore[union-attr]  # now in its RAM too
        f.store(KEY, v2)  # to home (and Redis): the other node drops its RAM copy
        assert read(nodes[other]).equal(v2) and read(nodes[home]).equal(v2)  # type: ignore[union-attr]
        assert [f._last.node, f.nodes_report()[other]["stale"]] == [home, 0]
        # home missed a health check: the next overwrite goes through the other node; home
        # keeps v2 in RAM until it is marked live again, and drops it then
        f._mark(home, False)
        f.store(KEY, v3)
        assert f._last.node == other and f.nodes_report()[home]["stale"] == 1
        assert f.check_health() == [True, True] and f.nodes_report()[home]["stale"] == 0
        assert read(nodes[home]).equal(v3)  # type: ignore[union-attr]


def test_a_delete_reaches_every_node_and_a_missing_one_is_remembered(
        nodes: list[ServerThread]) -> None:
    kv = random_kv(LAY, 4, seed=1)
    with fleet([n.address for n in nodes]) as f:
        f.store(KEY, kv)
        home = f.order([KEY])[0]
        assert read(nodes[1 - home]).equal(kv)  # type: ignore[union-attr]
        f._mark(home, False)  # marked down, yet it holds a RAM copy
        assert f.delete(KEY) == 1
        assert read(nodes[1 - home]) is None  # a node marked down is not waited for:
        assert [r["stale"] for r in f.nodes_report()][home] == 1  # its copy is dropped
        f._mark(home, True)  # before it is live again
        assert read(nodes[home]) is None and f.router.live[home]
    with fleet([nodes[0].address, "127.0.0.1:1"]) as f:  # nothing listens on the second
        f.store(KEY, kv)
        assert f.delete(KEY) == 1
        assert [r["stale"] for r in f.nodes_report()] == [0, 1]
        assert not f.router.live[1] and read(nodes[0]) is None


def test_stale_keys_stay_stale_until_their_evict_is_done(
        nodes: list[ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    """A node coming back drops its stale copies before it is marked live; while it does,
    the keys are still listed stale, so a call on another thread meanwhile evicts them too
    before it reads there (it found none and read the old value)."""
    v1, v2 = (random_kv(LAY, 4, seed=s) for s in (1, 2))
    with fleet([n.address for n in nodes]) as f:
        f.store(KEY, v1)
        other = 1 - f._last.node
        assert read(nodes[other]).equal(v1)  # type: ignore[union-attr]
        f._mark(other, False)
        f.store(KEY, v2)
        seen: list[int] = []
        evict = f.clients[other].evict

        def watched(*args: object, **kwargs: object) -> int:
            seen.append(f.nodes_report()[other]["stale"])
            return evict(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(f.clients[other], "evict", watched)
        assert f.check_health() == [True, True]
        assert seen == [1] and f.nodes_report()[other]["stale"] == 0
        assert read(nodes[other]).equal(v2)  # type: ignore[union-attr]


def test_a_pinned_copy_keeps_only_itself_stale(nodes: list[ServerThread]) -> None:
    """An overwrite of two keys, one of them pinned in the other node's RAM: that node
    refuses the Evict of both; the unpinned key is evicted alone, and it serves the new
    value."""
    pinned = hashlib.blake2b(b"pinned", digest_size=32).digest()
    old, new = ([(pinned, random_kv(LAY, 4, seed=s)), (KEY, random_kv(LAY, 4, seed=s + 1))]
                for s in (1, 3))
    with fleet([n.address for n in nodes]) as f:
        f.store_many(old)
        other = 1 - f._last.node
        with AdminClient(nodes[other].address, shm_bytes=0) as c:
            assert all(x is not None for x in c.retrieve_many([pinned, KEY]))
            assert c.pin([pinned], "default") == 1
        f.store_many(new)
        assert read(nodes[other]).equal(new[1][1])  # type: ignore[union-attr]
        assert f.nodes_report()[other]["stale"] == 0


def test_a_store_whose_deadline_passed_is_not_sent_to_another_node(
        nodes: list[ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its node may apply it yet (hung, then back), after a newer store elsewhere: the error
    is raised, the node marked down, and the other nodes drop their copies (it may land)."""
    kv = random_kv(LAY, 4, seed=1)
    with fleet([n.address for n in nodes]) as f:
        f.store(KEY, kv)
        home, sent = f._last.node, []

        def late(*args: object, **kwargs: object) -> None:
            raise DeadlineExceeded("the node did not answer in time")

        monkeypatch.setattr(f.clients[home], "store", late)
        monkeypatch.setattr(f.clients[1 - home], "store", lambda *a, **kw: sent.append(a))
        with pytest.raises(DeadlineExceeded):
            f.store(KEY, random_kv(LAY, 4, seed=2))
        assert sent == [] and not f.router.live[home]


def test_node_clients_in_process_copies_go_with_a_store_or_delete_elsewhere(
        nodes: list[ServerThread]) -> None:
    """Node clients with an in-process tier: an overwrite (or delete) through one node drops
    the key from every node client's tier, so a read routed to another never serves the value
    it replaced from its process's copy."""
    v1, v2 = (random_kv(LAY, 4, seed=s) for s in (1, 2))
    options = {"local_bytes": 64 << 20, "shm_bytes": 0}
    with FleetClient(FleetConfig(nodes=tuple(n.address for n in nodes), health_interval_s=0,
                                 load_bound=100.0, client_options=options)) as f:
        f.store(KEY, v1)
        home = f._last.node
        assert f.retrieve(KEY).equal(v1)  # type: ignore[union-attr]  # (home's client keeps it)
        f._mark(home, False)
        f.store(KEY, v2)  # through the other node
        assert f._last.node != home and f.check_health() == [True, True]
        f._mark(1 - home, False)  # reads go home again
        assert f.retrieve(KEY).equal(v2)  # type: ignore[union-attr]
        assert f._last.node == home
        f._mark(home, False)
        f._mark(1 - home, True)
        assert f.delete(KEY) == 1  # through the other node: home's client's copy goes too
        f._mark(home, True)
        f._mark(1 - home, False)
        assert f.retrieve(KEY) is None and f._last.node == home


def test_an_evict_refused_for_now_keeps_its_keys_stale(tmp_path: Path) -> None:
    """A node that answers the evict of its stale copies RESOURCE_EXHAUSTED (its tenant's
    rate limit) keeps the keys stale and is not read until it drops them (it served the
    overwritten value: the refusal was taken for a pinned key's)."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team: {api_keys: ["k"], rate_rps: 1, burst: 3}\n')
    auth.chmod(0o600)
    v1, v2 = (random_kv(LAY, 4, seed=s) for s in (1, 2))
    opts = {"api_key": "k", "shm_bytes": 0}
    with RedisServer(tmp_path / "redis") as redis, running_nodes(
            tmp_path, redis_url=redis.url, tier_order=("ram", "redis"),
            auth_file=str(auth)) as ns, \
            FleetClient(FleetConfig(nodes=tuple(n.address for n in ns), health_interval_s=0,
                                    load_bound=100.0, client_options=opts)) as f:
        f.store(KEY, v1)
        other = 1 - f._last.node
        time.sleep(1.0)  # the buckets full again
        with Client(ns[other].address, **opts) as c:
            assert c.retrieve(KEY).equal(v1)  # type: ignore[union-attr]  # in its RAM
            with pytest.raises(TooLarge):
                for _ in range(5):  # the tenant is busy on that node meanwhile
                    c.lookup([KEY])
        f.store(KEY, v2)  # acknowledged by home; the other node refuses the evict for now
        assert f.nodes_report()[other]["stale"] == 1 and not f.router.live[other]
        time.sleep(1.0)  # a token again: the node drops its copy before it is live again
        f._mark(other, True)
        assert f.router.live[other] and f.nodes_report()[other]["stale"] == 0
        ram = next(t for t in ns[other].server.store.tiers if t.name == "ram")
        assert not ram.contains(keys.store_key("team", "default", KEY))  # v1 is gone


def test_a_node_refusing_the_delete_keeps_its_keys_stale_and_the_others_delete(
        tmp_path: Path) -> None:
    """A node that answers the delete RESOURCE_EXHAUSTED (its tenant's rate limit) is marked
    down with the keys stale, and the nodes after it are still sent the delete (the first
    refusal ended the delete: the key's home, never sent it, served the deleted value). When
    every node refuses, the first refusal is raised; a bad key is refused before any node."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team: {api_keys: ["k"], rate_rps: 1, burst: 6}\n')
    auth.chmod(0o600)
    opts = {"api_key": "k", "shm_bytes": 0}

    def drain(node: ServerThread) -> None:
        with Client(node.address, **opts) as c, pytest.raises(TooLarge):
            for _ in range(10):
                c.lookup([KEY])

    with RedisServer(tmp_path / "redis") as redis, running_nodes(
            tmp_path, redis_url=redis.url, tier_order=("ram", "redis"),
            auth_file=str(auth)) as ns, \
            FleetClient(FleetConfig(nodes=tuple(n.address for n in ns), health_interval_s=0,
                                    load_bound=100.0, client_options=opts)) as f:
        key = next(k for k in (hashlib.blake2b(b"%d" % i, digest_size=32).digest()
                               for i in range(100)) if f.order([k])[0] == 1)
        f.store(key, random_kv(LAY, 4, seed=1))  # in node 1's RAM (and Redis)
        drain(ns[0])
        assert f.delete(key) == 1  # node 0 refuses; node 1, after it, deletes
        assert [(r["live"], r["stale"]) for r in f.nodes_report()] == [(False, 1), (True, 0)]
        assert f.retrieve(key) is None and f._last.node == 1
        with pytest.raises(InvalidArgument):
            f.delete(b"short")
        time.sleep(1.0)
        drain(ns[1])
        with pytest.raises(TooLarge):  # node 0 (marked down) is not waited for; node 1 refuses
            f.delete(KEY)
        assert [r["stale"] for r in f.nodes_report()] == [2, 1] and not any(f.router.live)


def test_a_delete_the_caller_may_not_make_is_raised_with_no_node_marked_down(
        tmp_path: Path) -> None:
    """Another tenant's keys deleted by a non-admin: every node refuses PERMISSION_DENIED,
    and each was marked down with the key stale (one caller mistake took the fleet out of
    routing and its next read missed)."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team: {api_keys: ["k"]}\n  other: {api_keys: ["o"]}\n')
    auth.chmod(0o600)
    with running_nodes(tmp_path, auth_file=str(auth)) as ns, FleetClient(FleetConfig(
            nodes=tuple(n.address for n in ns), health_interval_s=0,
            client_options={"api_key": "k", "shm_bytes": 0})) as f:
        value = random_kv(LAY, 4, seed=1)
        f.store(KEY, value)
        with pytest.raises(PermissionDenied, match="only admins"):
            f.delete(KEY, tenant="other")
        assert [(r["live"], r["stale"]) for r in f.nodes_report()] == [(True, 0)] * len(ns)
        got = f.retrieve(KEY)
        assert got is not None and got.equal(value)


def test_stale_keys_leave_in_calls_so_a_refused_call_keeps_only_its_own(tmp_path: Path) -> None:
    """A node that missed more keys than one Evict call takes drops them a call at a time: a
    call refused for now (the rate limit) keeps stale only the keys not yet evicted (all of
    them were kept, and every attempt began again at the first call: the node never came
    back)."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team: {api_keys: ["k"], rate_rps: 0.1, burst: 2}\n')
    auth.chmod(0o600)
    missed = [hashlib.blake2b(b"%d" % i, digest_size=32).digest()
              for i in range(2 * MAX_CALL_KEYS + 5)]
    with RedisServer(tmp_path / "redis") as redis, running_nodes(
            tmp_path, redis_url=redis.url, tier_order=("ram", "redis"),
            auth_file=str(auth)) as ns, \
            FleetClient(FleetConfig(nodes=tuple(n.address for n in ns), health_interval_s=0,
                                    client_options={"api_key": "k", "shm_bytes": 0})) as f:
        f._mark(1, False)
        f.drop_copies(missed, [1])
        f._mark(1, True)  # two calls evicted, the third refused for now
        assert f.nodes_report()[1]["stale"] == 5 and not f.router.live[1]
        time.sleep(10.1)  # a token again (one in 10 s: the evicts above may take seconds)
        f._mark(1, True)
        assert f.nodes_report()[1]["stale"] == 0 and f.router.live[1]
