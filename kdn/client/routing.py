"""Which kdn node of a fleet serves a request: rendezvous hashing of a chain's first blocks with
a bound on load. Pure arithmetic, no I/O: ``kdn.client.fleet.FleetClient`` routes real calls
with it and ``bench/fleet.py`` replays a trace through the very same objects.

Lifecycle::

    router = Router(["10.0.0.1:50051", "10.0.0.2:50051", ...], affinity_blocks=4)
    load = LoadMeter(len(router.nodes), half_life_s=300.0)
    affinity = Affinity(1 << 16)
    route = router.route_key(chain)
    order = router.choose(route, load, now, prefer=affinity.get(route), amount=len(chain))
    load.add(order[0], len(chain), now)         # the work just sent there
    affinity.remember(chain, order[0])          # later chains through these keys go there too
    router.mark(i, live=False)                  # a node stopped answering: its keys move
    router.mark(i, live=True)                   # back: they move back to it

Route key. A chain's key i names the whole prefix up to block i (``kdn.keys.prefix_keys``;
the trace's hash ids are chained the same way), so the key at position ``affinity_blocks - 1``
names the chain's first blocks: every request that starts with them (later turns of one
conversation, or requests over one document) gets the same route key, whatever follows. A
chain shorter than that routes by its last key.

Rendezvous (highest random weight). Each live node scores ``mix64(seed(node) ^ h(route key))``;
nodes are tried in decreasing score. Removing a node moves only the keys it was first for;
adding one moves only the keys it now wins; no table is kept, and every client computes the
same order from the same membership.

Affinity. ``Affinity`` remembers which node served each key lately; ``choose(prefer=...)``
sends a request whose route key was served before to that node while it is within the load
bound: a conversation stays where its blocks are, also after it spilled from its first choice.

Load term (consistent hashing with bounded loads, Mirrokni et al.). The bound is
``cap = load_bound x`` the mean load of the live nodes, the request being placed (``amount``)
counted. A route goes to the first node in rendezvous order with room for the request (its load
plus ``amount`` at most ``cap``): a hot prefix spills to its second choice instead of
overloading its first. A route served before stays on its node (``Affinity``) while that node
is within the bound (its load at most ``cap``): moving a conversation costs its prefix, read
again from the shared tier into another node's RAM, so it moves only once its node is over the
bound, while new work goes only where it fits. When no node has room, the first within the
bound takes it, else the first in rendezvous order. Room counts the request's size because in
a large fleet a node's load is a handful of requests (Mooncake's conversation trace over 100
nodes: some 15 requests' worth each): were the load before the request checked alone, every
placement could overshoot the bound by a whole request.

Quiet fleet. While the live nodes' total load, with the request, is at most ``load_floor``, any
node takes any request: with one conversation in the fleet the bound would otherwise send each
of its calls to another node, the lookup to one and its fetch to the next. The floor counts
the whole fleet's load: a floor per node would leave a large fleet unbalanced however busy, as
long as each of its nodes carried less than the floor. ``LoadMeter`` holds each node's load as
work sent to it, decayed with a half-life (plus what nodes report, in a real fleet).

``owner(key)`` is plain rendezvous of one key (no load term): the key-hashing policy of the
simulator, where each block lives on the node its own key picks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from kdn.errors import InvalidArgument

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def key_hash(key: bytes) -> int:
    """64-bit hash of a key (xxh3: the same in every process, unlike ``hash()``)."""
    return xxhash.xxh3_64_intdigest(key)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)  # type: ignore[no-any-return]


class Router:
    """Rendezvous ranking of the live nodes for a route key, with a load bound (module
    docstring). Node indices are positions in ``nodes``, stable for the router's life."""

    def __init__(self, nodes: Sequence[str], *, affinity_blocks: int = 4,
                 load_bound: float = 1.25, load_floor: float = 0.0) -> None:
        if not nodes:
            raise InvalidArgument("a fleet needs at least one node")
        if len(set(nodes)) != len(nodes):
            dup = sorted({n for n in nodes if list(nodes).count(n) > 1})
            raise InvalidArgument(f"fleet nodes listed twice: {', '.join(dup)}")
        if affinity_blocks < 1:
            raise InvalidArgument(f"affinity_blocks must be >= 1, got {affinity_blocks}")
        if not load_bound > 1.0:
            raise InvalidArgument(f"load_bound must be > 1 (a multiple of the mean load), "
                                  f"got {load_bound}")
        if not load_floor >= 0:
            raise InvalidArgument(f"load_floor must be >= 0, got {load_floor}")
        self.nodes = tuple(nodes)
        self.affinity_blocks = affinity_blocks
        self.load_bound = load_bound
        self.load_floor = load_floor
        # seeds: [nodes] uint64, from the node's name (its address): equal in every client
        self.seeds = np.array([key_hash(n.encode()) for n in self.nodes], dtype=np.uint64)
        self.live = np.ones(len(self.nodes), dtype=bool)

    def mark(self, node: int, *, live: bool) -> bool:
        """Set a node's liveness; True when that changed it."""
        changed = bool(self.live[node]) != live
        self.live[node] = live
        return changed

    def live_nodes(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.live)]

    def route_key(self, chain: Sequence[bytes]) -> bytes:
        """The key naming the chain's first ``affinity_blocks`` blocks (module docstring)."""
        if not chain:
            raise InvalidArgument("routing needs at least one key")
        return chain[min(self.affinity_blocks, len(chain)) - 1]

    def ranking(self, key: bytes | int) -> list[int]:
        """Live node indices by decreasing rendezvous score for ``key`` (bytes, or an
        already computed ``key_hash``)."""
        h = key_hash(key) if isinstance(key, bytes) else key
        scores = _mix(self.seeds ^ np.uint64(h))  # [nodes]
        order = np.argsort(-scores.astype(np.float64), kind="stable")
        return [int(i) for i in order if self.live[i]]

    def owner(self, key: bytes | int) -> int:
        """The live node with the highest score for ``key`` (plain rendezvous, no load)."""
        h = key_hash(key) if isinstance(key, bytes) else key
        scores = _mix(self.seeds ^ np.uint64(h))
        live = np.flatnonzero(self.live)
        if not len(live):
            raise InvalidArgument("no live node in the fleet")
        return int(live[int(np.argmax(scores[live]))])

    def choose(self, route: bytes | int, load: LoadMeter | None = None, now: float = 0.0,
               prefer: int | None = None, amount: float = 0.0) -> list[int]:
        """Live nodes in the order to try for a request of ``amount`` with route key ``route``
        (bytes, or its ``key_hash``): first ``prefer`` (where the route was served last:
        ``Affinity``) when it is live and within the load bound, else the first node in
        rendezvous order with room for the request within the bound (else the first within
        it); then the rest in rendezvous order as fallbacks. Empty when no node is live.
        Without ``load``, or in a quiet fleet, there is no bound (module docstring)."""
        order = self.ranking(route)
        if len(order) < 2:
            return order
        loads, cap = np.zeros(len(self.nodes)), math.inf  # [nodes]; no bound
        if load is not None:
            loads = load.values(now)
            total = float(loads[self.live].sum()) + amount
            if total > self.load_floor:
                cap = self.load_bound * total / int(self.live.sum())
        if prefer is not None and prefer in order and loads[prefer] <= cap:
            order.remove(prefer)
            order.insert(0, prefer)
            return order
        pick = next((j for j, i in enumerate(order) if loads[i] + amount <= cap), None)
        if pick is None:  # no node has room for it: the first within the bound
            pick = next((j for j, i in enumerate(order) if loads[i] <= cap), 0)
        if pick:
            order.insert(0, order.pop(pick))
        return order


class Affinity:
    """Where keys were served last: a bounded LRU of key (or ``key_hash``) -> node index. A
    request whose route key was part of an earlier request's chain goes where that one went
    (``Router.choose(prefer=...)``), so a conversation that spilled to its second node stays
    there, and stores follow their lookup."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nodes: OrderedDict[bytes | int, int] = OrderedDict()

    def get(self, key: bytes | int) -> int | None:
        return self.nodes.get(key)

    def remember(self, keys: Iterable[bytes | int], node: int) -> None:
        if self.capacity <= 0:
            return
        m = self.nodes
        for k in keys:
            m[k] = node
            m.move_to_end(k)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def forget_node(self, node: int) -> None:
        """Drop what points at ``node`` (it is gone: its RAM with it)."""
        for k in [k for k, n in self.nodes.items() if n == node]:
            del self.nodes[k]


class LoadMeter:
    """Each node's load: work sent to it (e.g. blocks of the requests routed there), decayed
    with ``half_life_s``, plus a reported part (what a node says it is busy with, set by the
    health check of a real fleet; 0 in the simulator)."""

    def __init__(self, nodes: int, *, half_life_s: float = 300.0) -> None:
        if not half_life_s > 0:
            raise InvalidArgument(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.sent = np.zeros(nodes)  # [nodes], decayed to ``self.at``
        self.reported = np.zeros(nodes)  # [nodes]
        self.total = np.zeros(nodes)  # [nodes]: every amount ever added, undecayed
        self.at = 0.0

    def _decay(self, now: float) -> None:
        if now > self.at:
            self.sent *= 0.5 ** ((now - self.at) / self.half_life_s)
            self.at = now

    def values(self, now: float) -> np.ndarray:
        """[nodes] the load of each node at ``now``."""
        self._decay(now)
        return self.sent + self.reported  # type: ignore[no-any-return]

    def add(self, node: int, amount: float, now: float) -> None:
        self._decay(now)
        self.sent[node] += amount
        self.total[node] += amount

    def report(self, node: int, value: float) -> None:
        self.reported[node] = max(0.0, value)
