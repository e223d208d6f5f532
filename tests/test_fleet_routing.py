"""Routing of a fleet (kdn.client.routing, kdn.client.fleet): rendezvous stability under
membership change, the load bound, affinity, bad configurations, and the fallback of a
FleetClient over real in-process servers when the node it routes to stops."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn.client.client import Client, LookupResult
from kdn.client.deadline import deadline_within
from kdn.client.fleet import FleetClient, FleetConfig
from kdn.client.routing import Affinity, LoadMeter, Router
from kdn.errors import ConfigError, DeadlineExceeded, InvalidArgument, Unavailable
from kdn.server import ServerConfig, ServerThread
from tests.helpers import eventually, random_kv, running_nodes, uniform_layout

NODES = [f"10.0.0.{i}:50051" for i in range(1, 11)]
KEYS = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest() for i in range(4000)]


def owners(router: Router) -> list[str]:
    return [router.nodes[router.owner(k)] for k in KEYS]


def test_every_client_computes_the_same_owners_whatever_the_listed_order() -> None:
    a = owners(Router(NODES))
    b = owners(Router(list(reversed(NODES))))
    assert a == b
    share = Counter(a)
    assert set(share) == set(NODES)
    assert all(0.06 * len(KEYS) < n < 0.14 * len(KEYS) for n in share.values()), share


def test_a_lost_node_moves_only_its_own_keys_and_they_come_back() -> None:
    router = Router(NODES)
    before = owners(router)
    gone = NODES.index(before[0])
    router.mark(gone, live=False)
    after = owners(router)
    moved = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    assert moved and all(before[i] == NODES[gone] for i in moved)
    assert NODES[gone] not in after
    # its keys spread over the others, not onto one heir
    assert len({after[i] for i in moved}) > 3
    router.mark(gone, live=True)
    assert owners(router) == before


def test_an_added_node_takes_keys_only_for_itself() -> None:
    before = owners(Router(NODES))
    grown = owners(Router([*NODES, "10.0.0.99:50051"]))
    moved = [i for i, (x, y) in enumerate(zip(before, grown)) if x != y]
    assert moved and all(grown[i] == "10.0.0.99:50051" for i in moved)
    assert 0.04 * len(KEYS) < len(moved) < 0.14 * len(KEYS)


def test_route_key_is_the_chain_key_at_affinity_blocks() -> None:
    router = Router(NODES, affinity_blocks=3)
    chain = KEYS[:10]
    assert router.route_key(chain) == chain[2]
    assert router.route_key(chain[:2]) == chain[1]  # a shorter chain: its last key
    # two chains sharing their first three blocks route alike, whatever follows
    assert router.choose(router.route_key(KEYS[:3] + KEYS[50:60]))[0] == \
        router.choose(router.route_key(KEYS[:3] + KEYS[70:71]))[0]
    with pytest.raises(InvalidArgument, match="at least one key"):
        router.route_key([])


def test_a_hot_route_spills_within_the_load_bound() -> None:
    """One route key asked for again and again: its first node takes it while within 1.25x
    the mean, then others do; no node ends above the bound."""
    router = Router(NODES[:4], load_bound=1.25)
    load = LoadMeter(4, half_life_s=1e9)
    first = router.choose(KEYS[0])[0]
    picks = []
    for t in range(400):
        node = router.choose(KEYS[0], load, float(t))[0]
        load.add(node, 1.0, float(t))
        picks.append(node)
    assert picks[0] == first
    assert len(set(picks)) == 4
    assert load.total.max() <= 1.25 * load.total.mean() + 1


def test_prefer_holds_while_within_the_bound() -> None:
    router = Router(NODES[:4])
    load = LoadMeter(4)
    key = KEYS[1]
    other = router.choose(key)[1]
    assert router.choose(key, load, 0.0, prefer=other)[0] == other
    load.add(other, 100.0, 0.0)  # far above the mean now
    assert router.choose(key, load, 0.0, prefer=other)[0] != other
    router.mark(other, live=False)  # a dead preference is no preference
    assert other not in router.choose(key, None, prefer=other)


def test_a_new_route_needs_room_and_a_served_one_stays_within_the_bound() -> None:
    """The bound with the request's size: a node within the bound but without room for the
    request takes no new route, yet keeps one it served; when no node has room, the first
    within the bound takes it."""
    router = Router(NODES[:4], load_bound=1.25)
    load = LoadMeter(4, half_life_s=1e9)
    key = KEYS[2]
    home, second = router.choose(key)[:2]
    for i in range(4):
        load.add(i, 100.0 if i == home else 60.0, 0.0)
    # with a request of 40: the mean is (280 + 40) / 4 = 80, the bound 100
    assert router.choose(key, load, 0.0, amount=40.0)[0] == second  # no room at home
    assert router.choose(key, load, 0.0, prefer=home, amount=40.0)[0] == home
    load.add(home, 1.0, 0.0)  # over the bound now: its route moves on
    assert router.choose(key, load, 0.0, prefer=home, amount=40.0)[0] == second
    # a request larger than any room: (281 + 1000) / 4 x 1.25 = 400.3, every node within
    assert router.choose(key, load, 0.0, amount=1000.0)[0] == home


def _turns(conversations: int, seed: int) -> list[tuple[float, int, int]]:
    """(time s, conversation, blocks) of every turn of ``conversations`` over an hour, in time
    order: heavy-tailed first prompts and turn counts, each turn's chain the last one's plus a
    few blocks (the shape of Mooncake's conversation trace, ~80 blocks a second)."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        t = rng.uniform(0.0, 3600.0)
        blocks = 1 + int(4 * rng.paretovariate(1.2))
        for _ in range(min(40, int(rng.paretovariate(1.5)))):
            out.append((t, c, min(blocks, 256)))
            t += rng.expovariate(1 / 60)
            blocks += 1 + int(rng.expovariate(1 / 3))
    return sorted(out)


def test_default_routing_balances_100_nodes_and_keeps_conversations() -> None:
    """A skewed workload over 100 nodes routed as FleetClient routes it, with FleetConfig's
    defaults: blocks served per node within 1.3x the mean, and most turns of a conversation
    on the node of its previous turn. Each node carries some 350 blocks of decayed load here
    (about a dozen requests), under a per-node load floor of 1,024, which would leave it
    unbalanced."""
    config = FleetConfig(nodes=tuple(f"10.1.{i // 200}.{i % 200}:50051" for i in range(100)))
    router = Router(config.nodes, affinity_blocks=config.affinity_blocks,
                    load_bound=config.load_bound, load_floor=config.load_floor)
    load = LoadMeter(len(config.nodes), half_life_s=config.load_half_life_s)
    affinity = Affinity(config.memo_keys)
    last: dict[int, int] = {}
    kept = moved = 0
    for t, c, n in _turns(4500, seed=0):
        chain = [hashlib.blake2b(f"{c}/{j}".encode(), digest_size=16).digest()
                 for j in range(n)]
        route = router.route_key(chain)
        node = router.choose(route, load, t, prefer=affinity.get(route), amount=float(n))[0]
        load.add(node, float(n), t)
        affinity.remember(chain, node)
        if c in last:
            kept += last[c] == node
            moved += last[c] != node
        last[c] = node
    served = load.total
    assert served.max() / served.mean() <= 1.3, served.max() / served.mean()
    assert kept / (kept + moved) >= 0.8, kept / (kept + moved)


def test_a_quiet_conversation_stays_on_one_of_100_nodes() -> None:
    """One conversation alone in a fleet of 100 (the default load floor is the fleet's total):
    every call of it goes to one node, as in a fleet of three."""
    config = FleetConfig(nodes=tuple(f"10.1.0.{i}:50051" for i in range(100)))
    router = Router(config.nodes, load_floor=config.load_floor)
    load = LoadMeter(100, half_life_s=config.load_half_life_s)
    affinity = Affinity(config.memo_keys)
    chain = KEYS[:32]
    went = set()
    for t in range(7):
        route = router.route_key(chain)
        node = router.choose(route, load, float(t), prefer=affinity.get(route), amount=32.0)[0]
        load.add(node, 32.0, float(t))
        affinity.remember(chain, node)
        went.add(node)
    assert len(went) == 1


def test_affinity_is_bounded_and_forgets_a_lost_node() -> None:
    aff = Affinity(3)
    aff.remember([b"a", b"b"], 0)
    aff.remember([b"c", b"d"], 1)
    assert aff.get(b"a") is None and aff.get(b"b") == 0 and aff.get(b"d") == 1
    aff.forget_node(1)
    assert aff.get(b"c") is None and aff.get(b"b") == 0


@pytest.mark.parametrize("kw, match", [
    ({"nodes": ()}, "non-empty"),
    ({"nodes": "a:1"}, "non-empty"),
    ({"nodes": ("a:1", "a:1")}, "listed twice"),
    ({"nodes": ("nohost",)}, "not host:port"),
    ({"nodes": ("a:70000",)}, "not host:port"),
    ({"nodes": ("a:1",), "load_bound": 1.0}, "load_bound"),
    ({"nodes": ("a:1",), "affinity_blocks": 0}, "affinity_blocks"),
    ({"nodes": ("a:1",), "timeout_s": 0}, "timeout_s"),
    ({"nodes": ("a:1",), "load_floor": -1.0}, "load_floor"),
    ({"nodes": ("a:1",), "affinity_blocks": float("nan")}, "affinity_blocks must be a whole"),
    ({"nodes": ("a:1",), "affinity_blocks": 2.5}, "affinity_blocks must be a whole"),
    ({"nodes": ("a:1",), "memo_keys": True}, "memo_keys must be a whole"),
    ({"nodes": ("a:1",), "inflight_weight": float("nan")}, "inflight_weight must be a finite"),
    ({"nodes": ("a:1",), "timeout_s": float("inf")}, "timeout_s must be a finite"),
    ({"nodes": ("a:1",), "timeout_s": "fast"}, "timeout_s must be a number"),
    ({"nodes": ("localhost:50051", "127.0.0.1:50051")}, "are one node"),
    ({"nodes": ("localhost:50051", "LOCALHOST:050051")}, "listed twice: localhost:50051"),
    ({"nodes": (b"a:1",)}, "not host:port"),
    ({"nodes": ("a:\u0661\u0662",)}, "not host:port"),
    ({"nodes": 5}, "non-empty list"),
    ({"nodes": ("a:1",), "client_options": {"timeout_s": 5}}, "use FleetConfig.timeout_s"),
    ({"nodes": ("a:1",), "client_options": {"address": "b:2"}}, "may not set 'address'"),
    ({"nodes": ("a:1",), "client_options": {"retry_count": 2}}, "not an option of Client"),
    ({"nodes": ("a:1",), "client_options": {"self": 2}}, "not an option of Client"),
    ({"nodes": ("a:1",), "client_options": [("shm_bytes", 0)]}, "client_options must be a"),
    # 1e10 s: every health check failed at once, or the health thread died (OverflowError)
    ({"nodes": ("a:1",), "health_timeout_s": 1e10}, "health_timeout_s must be a number > 0 "
                                                    "and at most 86400 seconds"),
    ({"nodes": ("a:1",), "health_interval_s": 1e10}, "health_interval_s must be a number in"),
    ({"nodes": ("a:1",), "client_options": {"insecure": "false"}}, "insecure must be True"),
    ({"nodes": ("a:1",), "client_options": {"data_path": "no"}}, "data_path must be True"),
])
def test_bad_fleet_configs_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FleetConfig(**kw)  # type: ignore[arg-type]


def test_fleet_file(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("nodes: [a:1, b:2]\nload_bound: 1.5\n")
    c = FleetConfig.from_file(f)
    assert c.nodes == ("a:1", "b:2") and c.load_bound == 1.5
    f.write_text("nodes: [a:1]\nload_bund: 1.5\n")
    with pytest.raises(ConfigError, match="unknown settings load_bund"):
        FleetConfig.from_file(f)
    for text, match in (("nodes: 5\n", "nodes must be a non-empty list"),
                        ("nodes: a:1\n", "nodes must be a non-empty list"),
                        ("nodes: [a:1]\ntimeout_s: fast\n", "timeout_s must be a number")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=match):
            FleetConfig.from_file(f)
    assert FleetConfig(nodes=("A:050051",)).nodes == ("a:50051",)
    f.write_text("- a:1\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        FleetConfig.from_file(f)
    with pytest.raises(ConfigError, match="fleet file"):
        FleetConfig.from_file(tmp_path / "absent.yaml")


# -- a FleetClient over real servers ------------------------------------------------------------

LAY = uniform_layout(layers=2, heads=2, dim=8)
KV = random_kv(LAY, 4)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerThread]]:
    with running_nodes(tmp_path) as out:
        yield out


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels}")


def test_calls_fall_back_to_a_live_node(servers: list[ServerThread]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics

    registry = CollectorRegistry()
    metrics.enable(registry)
    try:
        _fall_back(servers)
        text = generate_latest(registry).decode()
    finally:
        metrics.disable()
    a, b = (s.address for s in servers)
    # every call counted against the node that answered it, the failed one as a failover
    assert sum(_sample(text, "kdn_fleet_calls_total", node=n, outcome="ok") for n in (a, b)) == 5
    assert sum(_sample(text, "kdn_fleet_node_up", node=n) for n in (a, b)) == 0  # both stopped


def _fall_back(servers: list[ServerThread]) -> None:
    config = FleetConfig(nodes=tuple(s.address for s in servers), health_interval_s=0,
                         timeout_s=5, load_bound=100.0,  # the fallback alone, not the load
                         client_options={"shm_bytes": 0})
    with FleetClient(config) as fleet:
        chain = KEYS[:6]
        fleet.store_many([(k, KV) for k in chain], mode="raw")
        home = fleet.affinity.get(chain[0])
        assert home == fleet.order(chain)[0]
        assert fleet.lookup(chain, prefix_chain=True).prefix_hits == 6
        assert fleet.calls[home] == 2
        with pytest.raises(InvalidArgument):  # a bad request is not a node failure
            fleet.lookup([b"short"])
        assert fleet.failovers == 0 and fleet.router.live.all()
        servers[home].stop()
        # no shared tier here: the other node answers, with a miss, and no error
        assert fleet.lookup(chain, prefix_chain=True).prefix_hits == 0
        assert fleet.failovers == 1 and not fleet.router.live[home]
        assert fleet.affinity.get(chain[0]) == 1 - home
        fleet.store_many([(k, KV) for k in chain], mode="raw")
        assert fleet.fetch(chain[0]) is not None
        assert [r["live"] for r in fleet.nodes_report()] == [i != home for i in range(2)]
        servers[1 - home].stop()
        with pytest.raises(Unavailable, match="no node of the fleet answered"):
            fleet.lookup(chain)
        assert fleet.failovers == 2


def test_keys_and_empty_batches_are_taken_as_a_client_takes_them(
        servers: list[ServerThread]) -> None:
    """The fleet keeps Client's signatures: any iterable of keys, a bytearray key, an empty
    batch answered (not refused); a key that is not one is InvalidArgument, no node down."""
    config = FleetConfig(nodes=tuple(s.address for s in servers), health_interval_s=0,
                         client_options={"shm_bytes": 0})
    with FleetClient(config) as fleet:
        fleet.store(bytearray(KEYS[0]), KV, mode="raw")
        home = fleet._last.node
        with Client(servers[home].address, shm_bytes=0) as client:
            for c in (client, fleet):
                # one key: a batch of two routes by its second (``affinity_blocks``), which
                # may be another node than the one the store went to
                assert [i.present for i in c.lookup(iter(KEYS[:1])).infos] == [True]
                assert [g is None for g in c.fetch_many(k for k in KEYS[:1])] == [False]
                assert c.lookup([]) == LookupResult([], 0)
                for many in ("fetch_many", "retrieve_many", "retrieve_streams", "store_many"):
                    assert getattr(c, many)([]) == []
                for name, args in (("fetch", ("ab" * 16,)), ("retrieve", (None,)),
                                   ("store", ("ab" * 16, KV)),
                                   ("lookup", ([KEYS[0], b"short"],))):
                    with pytest.raises(InvalidArgument, match="key must be 32 bytes"):
                        getattr(c, name)(*args)
        assert fleet.router.live.all() and fleet.failovers == 0
        assert fleet.fetch(bytearray(KEYS[0])) is not None


def test_an_empty_batch_does_not_bring_a_node_marked_down_back(
        servers: list[ServerThread]) -> None:
    """A Client answers an empty batch without sending anything, so a node marked down that
    "answers" one has shown nothing: it stays down (it was marked live, and the next real
    calls paid a failover on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once it is closed
    config = FleetConfig(nodes=(servers[0].address, dead), health_interval_s=0,
                         retry_down_s=0, client_options={"shm_bytes": 0})
    with FleetClient(config) as fleet:
        for many in ("fetch_many", "retrieve_many", "retrieve_streams", "store_many"):
            fleet._mark(1, False)  # as a failed call marks it  # noqa: SLF001
            assert getattr(fleet, many)([]) == []
            assert not fleet.router.live[1], many


def test_a_quiet_conversation_stays_on_one_node(tmp_path: Path) -> None:
    """One conversation alone on three nodes (the default load bound): its stores, lookups and
    fetches all go to one node; the bound does not bounce them around a fleet with no load."""
    with running_nodes(tmp_path, 3) as nodes:
        config = FleetConfig(nodes=tuple(n.address for n in nodes), health_interval_s=0,
                             client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            chain = KEYS[:32]
            fleet.store_many([(k, KV) for k in chain], mode="raw")
            went = {fleet.affinity.get(chain[0])}
            for _ in range(3):
                assert fleet.lookup(chain, prefix_chain=True).prefix_hits == 32
                went.add(fleet.affinity.get(chain[0]))
                assert all(f is not None for f in fleet.fetch_many(chain))
                went.add(fleet.affinity.get(chain[0]))
            assert len(went) == 1 and sum(fleet.calls) == 7


def answers(fleet: FleetClient) -> bool:
    try:
        fleet.contains(KEYS[0])
    except Unavailable:
        return False
    return True


def test_a_node_marked_down_comes_back_without_the_health_thread(tmp_path: Path) -> None:
    """No health thread: a node that failed a call is tried again by a later call, at once
    when no node is live, else once its backoff has passed."""
    with running_nodes(tmp_path, 1) as (node,):
        config = FleetConfig(nodes=(node.address,), health_interval_s=0, retry_down_s=30,
                             timeout_s=5, client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            assert not fleet.contains(KEYS[0])
            node.stop()
            with pytest.raises(Unavailable):
                fleet.contains(KEYS[0])
            assert fleet.router.live_nodes() == []
            port = int(node.address.rsplit(":", 1)[1])
            again = ServerThread(ServerConfig(port=port, data_dir=tmp_path / "again",
                                              disk_bytes=0))
            again.start()
            try:  # the only node: tried again by every call, whatever its backoff (until
                # the channel's own reconnect backoff lets it through)
                assert eventually(lambda: answers(fleet), timeout=10, interval=0.2)
                assert fleet.router.live_nodes() == [0]
            finally:
                again.stop()
    with running_nodes(tmp_path / "two", 2) as nodes:
        config = FleetConfig(nodes=tuple(n.address for n in nodes), health_interval_s=0,
                             retry_down_s=0.3, client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            fleet._mark(0, False)  # as a failed call marks it
            fleet.contains(KEYS[0])
            assert fleet.router.live_nodes() == [1]  # within its backoff: not tried
            time.sleep(0.35)
            fleet.contains(KEYS[0])
            assert fleet.router.live_nodes() == [0, 1]
    with pytest.raises(ConfigError, match="health_interval_s must be a finite number"):
        FleetConfig(nodes=("a:1",), health_interval_s=float("inf"))


def test_a_store_does_not_try_a_node_marked_down_while_one_is_live(tmp_path: Path) -> None:
    """A node that takes connections and answers nothing (hung), marked down: once its
    backoff has passed a read tries it again, but a store goes to the live node (tried
    there, it would raise its deadline although a live node could take it)."""
    with socket.create_server(("127.0.0.1", 0)) as hung, \
            running_nodes(tmp_path, 1) as (node,):
        config = FleetConfig(nodes=(f"127.0.0.1:{hung.getsockname()[1]}", node.address),
                             health_interval_s=0, timeout_s=1.0, retry_down_s=0.01,
                             client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            fleet._mark(0, False)  # as a failed call marks it
            time.sleep(0.05)  # its backoff passed
            assert fleet._candidates(KEYS[:1])[0] == 0  # a read tries it first
            t = time.monotonic()
            fleet.store(KEYS[0], KV, mode="raw")
            fleet.store_many([(k, KV) for k in KEYS[1:3]], mode="raw")
            assert time.monotonic() - t < 0.9 and fleet._last.node == 1
            assert fleet.router.live_nodes() == [1] and fleet.failovers == 0
            assert fleet.nodes_report()[0]["stale"] == 3  # dropped before it is read again


def test_a_callers_spent_deadline_marks_no_node_down(servers: list[ServerThread]) -> None:
    """Inside a caller's deadline_within whose time is up, the fleet raises DeadlineExceeded
    as a Client does: every node stays live, no failover is counted, no other node tried."""
    config = FleetConfig(nodes=tuple(s.address for s in servers), health_interval_s=0,
                         client_options={"shm_bytes": 0})
    with FleetClient(config) as fleet:
        fleet.store(KEYS[0], KV, mode="raw")
        calls = list(fleet.calls)
        for call in (lambda: fleet.fetch(KEYS[0]), lambda: fleet.retrieve_many(KEYS[:2]),
                     lambda: fleet.store(KEYS[1], KV, mode="raw")):
            with deadline_within(0.01):
                time.sleep(0.05)  # (a lookup may yet answer in gRPC's last millisecond)
                with pytest.raises(DeadlineExceeded):
                    call()
        assert fleet.router.live.all() and fleet.failovers == 0 and fleet.calls == calls
        # the store may land yet: the other node drops its copy before it is read again
        assert [r["stale"] for r in fleet.nodes_report()] == [i != fleet._last.node
                                                              for i in range(2)]
        assert fleet.check_health() == [True, True]
        assert [r["stale"] for r in fleet.nodes_report()] == [0, 0]
        assert fleet.fetch(KEYS[0]) is not None


def test_a_delete_its_callers_deadline_ended_marks_no_node_down(tmp_path: Path) -> None:
    """A delete whose caller's deadline_within ran out while a node was slow to answer raises
    DeadlineExceeded, as ``call`` does: that node is not marked down (it was marked, as a
    node gone is), and it drops its copies before it is read again."""
    with socket.create_server(("127.0.0.1", 0)) as slow, \
            running_nodes(tmp_path, 1) as (node,):
        config = FleetConfig(nodes=(f"127.0.0.1:{slow.getsockname()[1]}", node.address),
                             health_interval_s=0, timeout_s=5.0,
                             client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            with deadline_within(0.3), pytest.raises(DeadlineExceeded):
                fleet.delete(KEYS[0])
            assert fleet.router.live.all() and fleet.failovers == 0
            assert [r["stale"] for r in fleet.nodes_report()] == [1, 1]


def test_health_check_marks_nodes_down_and_back(servers: list[ServerThread],
                                                tmp_path: Path) -> None:
    config = FleetConfig(nodes=(servers[0].address, "127.0.0.1:1"), health_interval_s=0,
                         health_timeout_s=0.5, client_options={"shm_bytes": 0})
    with FleetClient(config) as fleet:
        assert fleet.check_health() == [True, False]
        assert fleet.router.live_nodes() == [0]
        assert all(fleet.order([k])[0] == 0 for k in KEYS[:20])
        # an idle node reports no call in flight (its Stats call is not counted)
        assert fleet.clients[0].stats().counters["rpc.in_flight"] == 0
        assert fleet.load.reported[0] == 0


def test_admin_fleet_usage_and_a_node_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.cli.main import main

    monkeypatch.delenv("KDN_FLEET", raising=False)
    assert main(["admin", "fleet"]) == 2
    assert "no nodes given" in capsys.readouterr().err
    for bad in ("nohost", "127.0.0.1:99999", "127.0.0.1:\u0665\u0660"):  # (Arabic digits)
        assert main(["admin", "fleet", "--nodes", bad]) == 2
        assert f"node {bad!r} is not host:port" in capsys.readouterr().err
    # one node twice is refused as FleetConfig and --fleet-file refuse it (it showed two rows)
    assert main(["admin", "fleet", "--nodes", "127.0.0.1:1,127.0.0.1:1"]) == 2
    assert "listed twice" in capsys.readouterr().err
    monkeypatch.setenv("KDN_FLEET", "localhost:1,127.0.0.1:1")
    assert main(["admin", "fleet"]) == 2
    assert "are one node" in capsys.readouterr().err
    monkeypatch.delenv("KDN_FLEET")
    f = tmp_path / "fleet.yaml"
    f.write_text("nodes: []\n")
    assert main(["admin", "fleet", "--fleet-file", str(f)]) == 2
    assert "non-empty" in capsys.readouterr().err
    monkeypatch.setenv("KDN_FLEET", "127.0.0.1:1")  # nothing listens there
    assert main(["admin", "fleet", "--timeout", "1", "-o", "json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["node"], r["status"]) for r in rows] == [("127.0.0.1:1", "DOWN")]
    assert rows[0]["ram_bytes"] is None and rows[0]["error"]  # every field, None: unknown
    assert main(["admin", "fleet", "--timeout", "1"]) == 1  # a table (was KeyError: ram_bytes)
    out = capsys.readouterr().out
    assert "127.0.0.1:1" in out and "DOWN" in out


def test_admin_fleet_tables_print_sizes_as_people_read_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.cli.main import main
    from kdn.client import fleet

    row = {"node": "10.0.0.5:50051", "status": "SERVING", "ram_entries": 3,
           "ram_bytes": 10_276_586, "ram_hit_ratio": 0.5, "redis_hits": 0, "in_flight": 0,
           "error": ""}
    monkeypatch.setattr(fleet, "fleet_view", lambda nodes, **kw: [dict(row)])
    assert main(["admin", "fleet", "--nodes", "10.0.0.5:50051"]) == 0
    out = capsys.readouterr().out
    assert "9.8 MiB" in out and "10276586" not in out
    assert main(["admin", "fleet", "--nodes", "10.0.0.5:50051", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ram_bytes"] == 10_276_586  # a number
