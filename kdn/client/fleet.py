"""FleetClient: one client over several kdn nodes that share a Redis Cluster, routing each
call to the node most likely to hold its keys in RAM (``kdn.client.routing``).

    fleet = FleetClient(FleetConfig(nodes=("10.0.0.1:50051", "10.0.0.2:50051", ...)))
    fleet.lookup(chain, prefix_chain=True)   # routed by the chain's first blocks
    fleet.fetch_many(chain)                  # same route: the node that answered the lookup
    fleet.store_many(items)                  # to the node the first key routes to
    fleet.nodes_report()                     # per node: live, load, the node's own health
    fleet.close()

Every node serves every key: from its RAM, else from the shared Redis tier (which the node
reads through and stores through to, as its write policy says). Routing only decides whose
RAM a request warms, so a wrong or lost node costs a Redis read, never a failed request.

Lifecycle of a call: its keys are checked as a Client checks them (an empty batch goes to any
live node, answered as a Client answers it); its route key names its first keys
(``Router.route_key``); a route key that was among the keys of a recent call goes where that
call went (``Affinity``: a later turn of a conversation follows the earlier, the stores after a
lookup land where it went) while that node is within the load bound, else the first node in
rendezvous order with room for the call within the bound. The chosen node is tried first, then
the others in rendezvous order: a node that fails with UNAVAILABLE, a deadline or a closed
connection is marked down at once (its keys move to their next node) and the call goes to the
next one, but for a store whose deadline passed: its node may apply it yet, after a newer store
elsewhere, so its error is raised. A call ended by its caller's ``deadline_within``
(``kdn.client.deadline``) raises DeadlineExceeded as a Client does, its node not marked down:
the time was the caller's (a hung node is then found by the health thread, or by a call without
such a deadline). Ahead of the live nodes a read tries those marked down whose backoff has
passed (``retry_down_s``, doubling while a node keeps failing, at most ``MAX_RETRY_DOWN_S``),
and every call every node marked down when none is live: a node comes back without the health
thread too (a hung one costs such a read one ``timeout_s`` per backoff; a store goes to a live
node while there is one, as a hung node would raise its deadline). Nothing else is retried
here: a bad request fails on its first node.

Copies. A node keeps what it served or stored in its RAM, so a key may sit in several nodes'
RAM. A store goes to its node (and through it to the shared tier); the other nodes are then told
to drop their RAM copy of the stored keys (an Evict of their ``ram`` tier, ``drop_copies``). A
delete goes to every configured node, also those marked down. A node that can not be reached
for either, refuses the delete (not as the caller's mistake that every node would refuse:
``CALLER_REFUSALS``), or refuses the evict for now (rate-limited), keeps the keys in
``stale`` and stays marked down: before it is marked live again (a health check, or a call
that tries it again) it drops them from its RAM, and a node that can not do that stays down.
A live node whose evict its caller's ``deadline_within`` left no time for keeps them in
``stale`` too, and drops them before its next call. ``nodes_report`` counts each node's
``stale`` keys. Node clients with an in-process tier (``client_options``' ``local_bytes``) drop
the keys of every store and delete from each of them.

Membership is the config's list of addresses (``FleetConfig.from_file``: YAML ``nodes:``).
A health thread asks every node for Stats each ``health_interval_s``: an answer marks it live
(keys move back to a node that returns) and reports its calls in flight into the load; no
answer marks it down. Node clients retry UNAVAILABLE once, briefly: the fleet's fallback is
the retry.

With ``kdn.client.metrics.enable()``: ``kdn_fleet_calls_total{node,outcome}`` (``ok``,
``failover``: the node failed and the call moved on), ``kdn_fleet_node_up{node}`` and
``kdn_fleet_node_load{node}``.

Engines use a FleetClient where they use a Client (``KDNEngine(model, tokenizer, fleet)``):
the methods below keep ``Client``'s signatures, and ``address`` / ``dataplane`` are those of
the node the thread's latest call went to. ``retrieve_joined`` (the in-process tier's join)
is not offered: it answers None, and the engine falls back to ``retrieve_streams``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kdn.client import metrics
from kdn.client.admin import AdminClient
from kdn.client.client import Client, LookupResult, Retry
from kdn.client.deadline import caller_deadline_passed
from kdn.client.entries import check_items
from kdn.client.fleetconfig import FleetConfig
from kdn.client.routing import Affinity, LoadMeter, Router
from kdn.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KDNError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    kept,
)
from kdn.names import MAX_CALL_KEYS, check_key, check_namespace
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.cache import KVCache
    from kdn.client.received import Fetched
    from kdn.client.stream import LayerStream

log = logging.getLogger("kdn.client.fleet")
T = TypeVar("T")
NODE_FAILURES = (Unavailable, DeadlineExceeded, OSError)
"""What a node that is gone raises (the fallback's trigger: gRPC's UNAVAILABLE or deadline, a
closed data-path connection); nothing else moves a call."""
CALLER_REFUSALS = (PermissionDenied, Unauthenticated, InvalidArgument)
"""Refusals no later try changes (not allowed, not logged in, a bad request): ``delete``."""
MAX_RETRY_DOWN_S = 60.0
"""The longest a call waits before it tries a node marked down again."""


class FleetClient:
    """Routes ``Client`` calls across the nodes of a fleet (module docstring)."""

    local: None = None
    """No in-process tier of its own (``Client.local``). Node clients given ``local_bytes`` in
    ``client_options`` keep one each; a store or delete through any node drops the key from
    all of them (``_locals_dropped``), so none serves a value overwritten through another."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.router = Router(config.nodes, affinity_blocks=config.affinity_blocks,
                             load_bound=config.load_bound, load_floor=config.load_floor)
        self.load = LoadMeter(len(config.nodes), half_life_s=config.load_half_life_s)
        options = {"retry": Retry(retries=1, base_s=0.02, cap_s=0.1), **config.client_options}
        self.clients = [AdminClient(a, timeout_s=config.timeout_s, **options)
                        for a in config.nodes]
        self.stale: list[dict[tuple[str, str], set[bytes]]] = [{} for _ in config.nodes]
        """Per node, (namespace, tenant) -> keys whose RAM copy it must drop before it is
        marked live again: it missed their store or delete (module docstring, Copies). No
        bound: a node down for long gathers every key written meanwhile."""
        self.calls = [0] * len(config.nodes)
        """Calls each node answered (for the fleet view)."""
        self.failovers = 0
        """Calls that moved on because their node failed."""
        self.affinity = Affinity(config.memo_keys)
        self.retry_at = [0.0] * len(config.nodes)
        """Per node marked down, when a call may try it again (``time.monotonic``)."""
        self._backoff = [0.0] * len(config.nodes)
        self._last = threading.local()  # the node this thread's latest call went to
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if config.health_interval_s:
            self.check_health()
            self._thread = threading.Thread(target=self._health_loop, name="kdn-fleet-health",
                                            daemon=True)
            self._thread.start()

    # -- routing ------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.router.nodes

    def order(self, keys: Sequence[bytes]) -> list[int]:
        """Node indices to try for a call on ``keys``, the chosen one first (for no keys, an
        empty batch that any node answers as a Client does: the live nodes in one order)."""
        with self._lock:
            route = self.router.route_key(keys) if keys else 0
            return self.router.choose(route, self.load, time.monotonic(),
                                      prefer=self.affinity.get(route), amount=len(keys))

    def _remember(self, keys: Sequence[bytes], node: int, amount: float) -> None:
        with self._lock:
            self.load.add(node, amount, time.monotonic())
            self.calls[node] += 1
            self.affinity.remember(keys, node)

    def _mark(self, node: int, live: bool) -> None:
        """Mark ``node`` live or down; a node that can not drop its ``stale`` copies first
        stays down."""
        if live and self.stale[node] and not self._drop_stale(node):
            live = False
        with self._lock:
            changed = self.router.mark(node, live=live)
            if changed and not live:
                self.affinity.forget_node(node)
            self._backoff[node] = 0.0 if live else min(
                max(2 * self._backoff[node], self.config.retry_down_s), MAX_RETRY_DOWN_S)
            self.retry_at[node] = time.monotonic() + self._backoff[node]
        if changed:
            log.warning("fleet node %s is %s", self.nodes[node], "back" if live else "down")
        metrics.record_fleet_node(self.nodes[node], live, float(self.load.values(
            time.monotonic())[node]))

    def call(self, keys: Iterable[bytes], fn: Callable[[Client, list[bytes]], T], *,
             write: bool = False) -> T:
        """``fn(client, keys)`` on the node ``keys`` route to (each key checked first, as a
        Client checks it); on a node failure, on the next. A ``write`` whose deadline passed
        is not sent on: its node may apply it yet (hung, then back), after a newer write
        elsewhere; the error is raised (its outcome unknown). A caller's ``deadline_within``
        that ended the call is raised as is (DeadlineExceeded): its node is not marked down,
        nor another tried."""
        ks = [check_key(k) for k in keys]
        last: Exception | None = None
        for node in self._candidates(ks, write):
            down = not self.router.live[node]
            if self.stale[node] and not self._dropped(node):
                continue  # it would serve what it missed
            try:
                out = fn(self.clients[node], ks)
            except NODE_FAILURES as exc:
                if isinstance(exc, DeadlineExceeded) and caller_deadline_passed():
                    self._last.node = node  # the caller's time, not the node's: as a Client
                    raise  # raises it, no node marked down, no other node tried
                last = kept(exc)  # not this frame, which holds it
                with self._lock:
                    self.failovers += 1
                metrics.record_fleet_call(self.nodes[node], "failover")
                self._mark(node, False)
                if write and isinstance(exc, DeadlineExceeded):
                    self._last.node = node
                    raise
                continue
            if down and ks:  # an empty batch is answered unsent: it shows nothing of a node
                self._mark(node, True)
            self._remember(ks, node, float(len(ks)))
            self._last.node = node
            metrics.record_fleet_call(self.nodes[node], "ok")
            return out
        if caller_deadline_passed():
            raise DeadlineExceeded(f"the caller's deadline_within passed before a node of the "
                                   f"fleet answered: {last}")
        raise Unavailable(f"no node of the fleet answered ({len(self.nodes)} configured, "
                          f"{len(self.router.live_nodes())} live): {last}")

    def drop_copies(self, keys: Sequence[bytes], nodes: Sequence[int],
                    namespace: str | None = None, tenant: str = "") -> None:
        """Have ``nodes`` drop their RAM copies of ``keys`` (they are stale: the entries were
        overwritten or deleted elsewhere): now on a live node (before its next call where the
        caller's deadline left no time), before it is marked live again on a node marked down
        or not reached."""
        for node in nodes if keys else ():
            ns = namespace or self.clients[node].namespace
            with self._lock:
                self.stale[node].setdefault((ns, tenant), set()).update(keys)
            if self.router.live[node]:
                self._dropped(node)

    def _dropped(self, node: int) -> bool:
        """Whether ``node`` holds no ``stale`` copies, having dropped them now; one that did
        not drop them is marked down, but where the caller's ``deadline_within`` left no time
        to (then they are dropped before its next call)."""
        if not caller_deadline_passed() and self._drop_stale(node):
            return True
        if not caller_deadline_passed():
            self._mark(node, False)
        return False

    def _drop_stale(self, node: int) -> bool:
        """Evict ``node``'s stale keys from its RAM tier; False when the node did not answer,
        or refused for now (rate-limited, busy: what is not evicted is kept, and tried again
        before the node is read). Keys leave ``stale`` once evicted, not before: a call on
        another thread meanwhile still finds them, and evicts them too before it reads there.
        A refusal for good (a pinned copy, a node without a RAM tier, a caller not allowed) is
        logged and forgotten: nothing sent again would change it; a batch refused so is sent
        again a key at a time, so that one pinned key does not keep the others' stale
        copies. Keys go in calls of ``MAX_CALL_KEYS``, each leaving ``stale`` once done: a call
        refused for now keeps only its own and later keys, not those already evicted."""
        while True:
            with self._lock:
                if not self.stale[node]:
                    return True
                (ns, tenant), keys = next(iter(self.stale[node].items()))
                batch = sorted(itertools.islice(keys, MAX_CALL_KEYS))
            try:
                self._evict(node, batch, ns, tenant)
            except (*NODE_FAILURES, KDNError) as exc:
                if not isinstance(exc, NODE_FAILURES):
                    log.warning("fleet node %s did not drop its stale RAM copies (%s); it is "
                                "not read until it does", self.nodes[node], exc)
                return False
            with self._lock:
                left = self.stale[node].get((ns, tenant))
                if left is not None:
                    left.difference_update(batch)
                    if not left:
                        del self.stale[node][(ns, tenant)]

    def _evict(self, node: int, keys: list[bytes], ns: str, tenant: str) -> None:
        """Evict ``keys`` from ``node``'s RAM, one at a time where the batch is refused for
        good; any other error is raised (the keys stay stale)."""
        try:
            self.clients[node].evict(keys, ns, "ram", tenant=tenant)
        except (InvalidArgument, PermissionDenied) as exc:  # refused for good (a pinned
            # copy, a node without a RAM tier); not a rate limit, nor a node that is busy
            if len(keys) == 1:
                log.warning("fleet node %s kept a stale RAM copy: %s", self.nodes[node], exc)
                return
            for key in keys:
                self._evict(node, [key], ns, tenant)

    def _candidates(self, keys: Sequence[bytes], write: bool = False) -> list[int]:
        """Nodes to try for a call on ``keys``: for a read those marked down whose
        ``retry_at`` has passed (a call that finds one back marks it live: its keys return to
        it), then the live ones (``order``); every node marked down when none is live. A
        ``write`` tries no node marked down while one is live: one still hung would raise
        its deadline (``call``) where a live node would have taken it."""
        live = self.order(keys)
        now = time.monotonic()
        return [i for i in range(len(self.nodes)) if not self.router.live[i] and (
            not live or (not write and self.retry_at[i] <= now))] + live

    def client_for(self, keys: Sequence[bytes]) -> Client:
        """The node client ``keys`` route to now (for calls the fleet does not wrap)."""
        order = self.order(keys)
        if not order:
            raise Unavailable("no live node in the fleet")
        return self.clients[order[0]]

    # -- health -------------------------------------------------------------------------------

    def check_health(self) -> list[bool]:
        """Ask every node for Stats once; mark each live or down. Returns liveness."""
        out = []
        for i, c in enumerate(self.clients):
            try:
                resp = c.rpc.stub.Stats(pb.StatsRequest(), timeout=self.config.health_timeout_s,
                                        metadata=c.metadata())
            except grpc.RpcError:
                self._mark(i, False)
                out.append(False)
                continue
            self.load.report(i, self.config.inflight_weight *
                             resp.counters.get("rpc.in_flight", 0))
            self._mark(i, True)
            out.append(True)
        return out

    def _health_loop(self) -> None:
        while not self._closed.wait(self.config.health_interval_s):
            try:
                self.check_health()
            except Exception:  # the checker must outlive any one surprise
                log.exception("fleet health check failed")

    def nodes_report(self) -> list[dict[str, Any]]:
        """Per node, as this client sees it: address, live, load, calls it answered."""
        loads = self.load.values(time.monotonic())
        return [{"node": n, "live": bool(self.router.live[i]), "load": round(float(loads[i]), 3),
                 "calls": self.calls[i], "stale": sum(map(len, self.stale[i].values()))}
                for i, n in enumerate(self.nodes)]

    # -- the Client surface -------------------------------------------------------------------

    @property
    def last_client(self) -> Client:
        """The client of the node this thread's latest call went to (the first node before
        any)."""
        return self.clients[getattr(self._last, "node", 0)]

    @property
    def address(self) -> str:
        """The address of the node this thread's latest call went to (what an engine names
        the link it reads over by)."""
        return self.last_client.address

    @property
    def dataplane(self) -> Any:
        """That node's data plane (an engine asks whether it shares a segment)."""
        return self.last_client.dataplane

    def lookup(self, keys: Sequence[bytes], **kw: Any) -> LookupResult:
        return self.call(keys, lambda c, ks: c.lookup(ks, **kw))

    def contains(self, key: bytes, **kw: Any) -> bool:
        return self.call([key], lambda c, ks: c.contains(ks[0], **kw))

    def fetch(self, key: bytes, **kw: Any) -> Fetched | None:
        return self.call([key], lambda c, ks: c.fetch(ks[0], **kw))

    def fetch_many(self, keys: Sequence[bytes], **kw: Any) -> list[Fetched | None]:
        return self.call(keys, lambda c, ks: c.fetch_many(ks, **kw))

    def retrieve(self, key: bytes, **kw: Any) -> KVCache | None:
        return self.call([key], lambda c, ks: c.retrieve(ks[0], **kw))

    def retrieve_many(self, keys: Sequence[bytes], **kw: Any) -> list[KVCache | None]:
        return self.call(keys, lambda c, ks: c.retrieve_many(ks, **kw))

    def retrieve_stream(self, key: bytes, **kw: Any) -> LayerStream | None:
        return self.call([key], lambda c, ks: c.retrieve_stream(ks[0], **kw))

    def retrieve_streams(self, keys: Sequence[bytes], **kw: Any) -> list[LayerStream | None]:
        return self.call(keys, lambda c, ks: c.retrieve_streams(ks, **kw))

    def retrieve_joined(self, keys: Sequence[bytes], **kw: Any) -> None:
        return None

    def store(self, key: bytes, kv: Any, **kw: Any) -> pb.StoreResponse:
        key = check_key(key)
        return self._stored([key], lambda c, _: c.store(key, kv, **kw), kw.get("namespace"))

    def store_many(self, items: Sequence[tuple[bytes, Any]], **kw: Any
                   ) -> list[pb.StoreResponse]:
        items = check_items(items)  # pairs, each key once: before any node is asked
        keys = [k for k, _ in items]
        return self._stored(keys, lambda c, _: c.store_many(items, **kw), kw.get("namespace"))

    def _stored(self, keys: Sequence[bytes], fn: Callable[[Client, list[bytes]], T],
                namespace: str | None) -> T:
        """A store on the node ``keys`` route to; then every other node drops its RAM copy of
        them (it would serve the value this replaced: ``drop_copies``)."""
        with self._locals_dropped(keys, namespace):
            try:
                out = self.call(keys, fn, write=True)
            except DeadlineExceeded:  # its outcome unknown: it may land yet, and the others'
                self._drop_elsewhere(keys, namespace)  # copies would then be stale
                raise
            self._drop_elsewhere(keys, namespace)
        return out

    @contextmanager
    def _locals_dropped(self, keys: Sequence[bytes], namespace: str | None) -> Iterator[None]:
        """While a store or delete of ``keys`` runs: a write of them begun on every node
        client's in-process tier, so their copies go now and none read meanwhile is kept
        (``kdn.client.local``; the storing node's own copy neither: read again, it is)."""
        writes = [c.local.write(check_namespace(namespace or c.namespace), k)
                  for c in self.clients if c.local is not None for k in keys]
        try:
            yield
        finally:
            for w in writes:
                w.end()

    def _drop_elsewhere(self, keys: Sequence[bytes], namespace: str | None) -> None:
        """Every node but the one this thread's latest call went to drops ``keys``."""
        home = self._last.node
        self.drop_copies(keys, [i for i in range(len(self.nodes)) if i != home], namespace)

    def delete(self, key: bytes | Sequence[bytes], *, namespace: str | None = None,
               tenant: str = "", **kw: Any) -> int:
        """Delete from every live node (each may hold a RAM copy); a node marked down is not
        waited for: it drops its copies before it is marked live again (``drop_copies``), as
        one not reached does, or one that refuses the delete (rate-limited: it is marked
        down). The most any node deleted (the shared tier's copy is deleted by the first);
        when none deleted, the first refusal, else Unavailable. A bad key is refused before
        any node is sent it, a ``CALLER_REFUSALS`` answered before any deleted raised as is,
        and so is the caller's ``deadline_within`` that ended it (as ``call``: no node marked
        down; the nodes it did not reach drop their copies before they are read)."""
        keys = [check_key(k) for k in ([key] if isinstance(key, (bytes, bytearray)) else key)]
        check_namespace(namespace or self.clients[0].namespace)  # refused here, not per node
        if tenant:  # another tenant's entries: never in the in-process tiers (the caller's)
            return self._delete(keys, namespace, tenant, **kw)
        with self._locals_dropped(keys, namespace):
            return self._delete(keys, namespace, tenant, **kw)

    def _delete(self, keys: list[bytes], namespace: str | None, tenant: str, **kw: Any) -> int:
        done: list[int] = []
        down = [node for node in range(len(self.clients)) if not self.router.live[node]]
        if len(down) == len(self.clients):
            down = []  # none is live: each is tried
        self.drop_copies(keys, down, namespace, tenant)
        refused: KDNError | None = None
        for node, c in enumerate(self.clients):
            if node in down:
                continue  # a hung node would cost every delete a deadline
            try:
                done.append(c.delete(keys, namespace=namespace, tenant=tenant, **kw))
            except NODE_FAILURES as exc:
                if isinstance(exc, DeadlineExceeded) and caller_deadline_passed():
                    # the caller's time, not the node's (as ``call``): none marked down; this
                    # node and those not reached drop their copies before they are read
                    self.drop_copies(keys, [n for n in range(node, len(self.clients))
                                            if n not in down], namespace, tenant)
                    raise
                self._mark(node, False)
                self.drop_copies(keys, [node], namespace, tenant)
            except KDNError as exc:  # refused: the others delete on, it keeps its copies
                if isinstance(exc, CALLER_REFUSALS) and not done:
                    raise  # the caller's mistake, as every node would say
                log.warning("fleet node %s refused the delete (%s); it is not read until it "
                            "drops its copies", self.nodes[node], exc)
                refused = refused or kept(exc)
                self._mark(node, False)
                self.drop_copies(keys, [node], namespace, tenant)
        if not done and refused is not None:
            raise refused
        if not done:
            raise Unavailable(f"no node of the fleet answered the delete ({len(self.nodes)} "
                              "configured): each drops its copies when it is back")
        return max(done)

    def flush(self) -> None:
        for c in self.clients:
            c.flush()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for c in self.clients:
            c.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNKNOWN = dict.fromkeys(("ram_entries", "ram_bytes", "ram_hit_ratio", "redis_hits",
                          "redis_healthy", "in_flight", "version"))
"""A node's fields that only its Stats tell (None where it did not answer them)."""


def node_view(client: Client) -> dict[str, Any]:
    """One node as ``kdn admin fleet`` shows it, from its Stats: status (``SERVING``,
    ``DEGRADED``, ``DOWN`` when it does not answer, ``REFUSED`` when it refuses this caller),
    RAM entries, bytes and hit ratio, Redis hits, calls in flight, and the error of a node
    that did not answer (every row has every field: None where unknown)."""
    row: dict[str, Any] = {"node": client.address}
    try:
        s = client.stats()
    except (Unavailable, DeadlineExceeded, OSError) as exc:
        return {**row, "status": "DOWN", **_UNKNOWN, "error": str(exc).splitlines()[0][:120]}
    except KDNError as exc:  # it answered, refusing: a key it does not know, a wrong role
        return {**row, "status": "REFUSED", **_UNKNOWN,
                "error": f"{exc.status.value}: {str(exc).splitlines()[0][:100]}"}
    tiers = {t.name: t for t in s.tiers}
    ram = tiers.get("ram")
    redis = tiers.get("redis")
    looked = (ram.hits + ram.misses) if ram is not None else 0
    return {**row, "status": "DEGRADED" if s.health == "degraded" else "SERVING",
            "ram_entries": ram.entries if ram is not None else 0,
            "ram_bytes": ram.bytes if ram is not None else 0,
            "ram_hit_ratio": round(ram.hits / looked, 4) if ram is not None and looked else None,
            "redis_hits": redis.hits if redis is not None else None,
            "redis_healthy": redis.healthy if redis is not None else None,
            "in_flight": int(s.counters.get("rpc.in_flight", 0)),
            "version": s.version, "error": ""}


def fleet_view(addresses: Sequence[str], *, timeout_s: float = 5.0,
               **client_options: Any) -> list[dict[str, Any]]:
    """``node_view`` of every node (a short deadline and one retry each: a dead node costs
    ``timeout_s`` at most)."""
    out = []
    for a in addresses:
        opts = {"retry": Retry(retries=1, base_s=0.02, cap_s=0.1), "shm_bytes": 0,
                **client_options}
        with Client(a, timeout_s=timeout_s, **opts) as c:
            out.append(node_view(c))
    return out
