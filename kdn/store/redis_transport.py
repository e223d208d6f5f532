"""How the Redis tier reaches Redis: clients, retries, error kinds, and a cluster's masters.

Lifecycle: ``RedisTier`` (``kdn.store.redis``) builds one ``RedisTransport`` from its config and
makes every Redis call through it: ``call`` (one command), ``keyed`` (an entry's commands, in
its slot), ``batch`` (one command per key), ``scan`` (a listing), ``waited`` (a write
followed by ``WAIT``), and ``primaries`` (the health probe). ``close`` runs once, from the
tier's ``close``.

Transport: a connection pool (``BlockingConnectionPool`` standalone, per-node pools in a
cluster, waited on as long: ``redis_cluster.pool_waited``), commands retried ``retries`` times
with exponential backoff and jitter on connection errors only (a command that timed out is not
sent again: a Redis that is stopped or cut off costs a call one ``timeout_s``); every redis-py
error leaves as a kdn one (``kdn.store.redis_errors``): ``TierUnavailable`` where Redis does not
answer (or refuses kdn's login or TLS), so the hierarchy can mark the tier down and carry on;
``TooLarge`` where it is out of memory; ``PartlyUnavailable`` where it answers but takes no
writes for now, or where every pooled connection stayed busy past ``timeout_s``. A cluster's
client takes the user, password and TLS of its URLs (``kdn.store.redis_urls``), and so do its
WAIT clients.

Cluster, one master out (stopped, cut off or killed): its slots' keys fail with
``PartlyUnavailable`` (reads miss, SHARED stores are refused) and the tier stays up for the other
masters' slots. A master that did not answer (a call was refused or timed out, or the health
probe's PING failed) is remembered (``masters_down``; the tier is told through ``on_degraded``)
and the calls for its slots then fail at once, so that a stopped master holds no server thread
and no entry lock beyond its first socket timeout: a call is not sent again to a node that timed
out, and an entry's or a batch's commands go as one plain pipeline per master (redis-py's
cluster pipeline would try each command again, one by one). While a master is remembered, a
thread refreshes the cluster map and PINGs it every ``WATCH_S``, so that a replica promoted in
its place takes its slots at once and a master that answers again is used again. MOVED/ASK (a
stale map) refresh the map and go through the cluster client. A master whose ``WAIT`` came back
short of replicas (``ReplicasShort``) takes no write until it has them again; a commit sent
with its ``WAIT`` (``waited``) that meets a MOVED refreshes the map and goes to the new master.
A node that lacks one of the tier's Lua scripts (``script``) gets its body (``EVAL``): the key's
master alone, so a dead master does not fail the others' first writes, or the importing master
an ASK reaches while a slot is migrated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.retry import Retry

from kdn.errors import ConfigError, KDNError, PartlyUnavailable, TierUnavailable
from kdn.store.redis_cluster import ClusterClient, pool_waited
from kdn.store.redis_errors import REDIS_ERRORS, access_refused, unanswered, wrap
from kdn.store.redis_masters import Masters, ReplicasShort
from kdn.store.redis_urls import cluster_urls

log = logging.getLogger(__name__)

WATCH_S = 0.25
"""While a cluster master is known not to answer (or, with WAIT, to lack replicas), a thread of
the tier asks it again, and refreshes the cluster map, every ``WATCH_S`` seconds."""


class RedisTransport:
    """The Redis tier's clients and its view of a cluster's masters (see the module docstring).

    ``route(key)`` names the Redis key whose slot holds a tier key's entry (its manifest);
    ``on_degraded()`` is called when a master is found not to answer.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        cluster: bool,
        route: Callable[[bytes], bytes],
        on_degraded: Callable[[], None],
        timeout_s: float,
        retries: int,
        max_connections: int,
        wait_replicas: int,
        wait_timeout_s: float,
    ) -> None:
        self.urls = urls
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_connections = max_connections
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        self._route = route
        self._on_degraded = on_degraded
        # standalone: a command that timed out is not sent again (a stopped or cut-off Redis
        # would hold the call a whole timeout more each try); refused or reset connections
        # are. In a cluster the client's own retries decide (``redis_cluster.ClusterClient``).
        retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries) if cluster \
            else Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries,
                       supported_errors=(redis.exceptions.ConnectionError,))
        # the socket timeout bounds how long a stopped master holds a call (a WAIT, which may
        # take up to wait_timeout_s more, runs on connections of its own: waiting_client)
        common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=retry, health_check_interval=0)
        self._masters = Masters() if cluster else None
        self._budget = 0  # bytes: apply_budget's, kept on every master by keep_budget
        self._others: dict[str, str] = {}  # master -> another client's maxmemory, said once
        self._wait_clients: dict[str, redis.Redis] = {}
        self._wait_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._asking: threading.Thread | None = None  # the watcher's PINGs (``_ask_again``)
        self._stop = threading.Event()
        self._closed = False
        self.client: redis.Redis | RedisCluster
        self._node_options: dict[str, Any] = {}  # a cluster's, for the WAIT clients' pools
        if cluster:
            given = cluster_urls(self.urls)  # user, password, TLS: every node's, as a URL's
            self._node_options = given.pool_options()
            nodes = [ClusterNode(host, port) for host, port in given.nodes]
            try:  # redis-py learns the cluster's map here: some node must answer
                self.client = ClusterClient(
                    startup_nodes=nodes, cluster_error_retry_attempts=max(1, retries),
                    **{**common, "max_connections": max_connections, **given.options})
            except REDIS_ERRORS as exc:
                why = access_refused(exc) or "no node of the cluster answers"
                raise TierUnavailable(f"redis: {why}: {exc}") from exc
        else:
            if len(self.urls) != 1:
                raise ValueError("a standalone Redis tier takes exactly one URL")
            pool = redis.BlockingConnectionPool.from_url(
                self.urls[0], max_connections=max_connections, timeout=timeout_s, **common)
            self.client = redis.Redis(connection_pool=pool)

    # -- one call -------------------------------------------------------------------------------

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a redis-py error leaving as a kdn one (``wrap``); in a
        cluster, waiting up to ``timeout_s`` for a free pooled connection (``pool_waited``)."""
        try:
            return pool_waited(self.timeout_s if self.cluster else 0, fn, *args, **kwargs)
        except REDIS_ERRORS as exc:
            raise wrap(exc, self.cluster) from exc

    def script(self, script: Script, keys: list[bytes], args: list[Any]) -> Any:
        """Run a Lua ``script`` (from ``client.register_script``) on ``keys`` (one slot). In a
        cluster, a node that lacks it gets its body once (``EVAL``, which that node keeps for
        the next ``EVALSHA``): redis-py would load it on every master, and fail (with this
        key's master blamed) while any one of them is dead. The node that lacks it may be one
        no map names: the importing master of a slot being migrated, which an ASK reaches."""
        if not self.cluster:
            return self.call(script, keys=keys, args=args)
        try:
            return pool_waited(self.timeout_s, self.client.evalsha, script.sha, len(keys),
                               *keys, *args)
        except redis.exceptions.NoScriptError:
            pass
        except REDIS_ERRORS as exc:
            raise wrap(exc, self.cluster) from exc
        return self.call(self.client.eval, script.script, len(keys), *keys, *args)

    def master_of(self, key: bytes) -> str:
        """The name (``host:port``) of the cluster master that holds ``key``'s slot, as this
        client's map has it."""
        assert isinstance(self.client, RedisCluster)
        try:
            return str(self.client.get_node_from_key(self._route(key)).name)
        except REDIS_ERRORS as exc:
            raise PartlyUnavailable(f"redis: no master known for this key's slot: {exc}") \
                from exc

    @contextmanager
    def slot(self, key: bytes, *, write: bool = False) -> Iterator[None]:
        """Around every call for ``key`` in a cluster: fail at once while its master is known
        not to answer (or, for a write with WAIT, to lack replicas); learn from the outcome."""
        if self._masters is None:
            yield
            return
        name = self.master_of(key)
        self._masters.check(name, write=write)
        try:
            yield
        except ReplicasShort:
            self._note(name, short=True)
            raise
        except PartlyUnavailable as exc:
            if unanswered(exc):
                self._note(name, down=True)
            raise

    def blocked(self, name: str) -> bool:
        """Whether calls for the cluster master ``name``'s slots fail at once now (it is known
        not to answer); never for a standalone Redis."""
        return self._masters is not None and self._masters.blocked(name)

    def masters_down(self) -> list[str]:
        """The cluster masters (``host:port``) that do not answer, whose slots' keys fail now
        (empty for a standalone Redis, or while every master answers)."""
        return [] if self._masters is None else self._masters.down()

    # -- the masters' watch ---------------------------------------------------------------------

    def _note(self, name: str, *, down: bool = False, short: bool = False) -> None:
        """``name`` did not answer, or lacked replicas: remember it, and watch it."""
        assert self._masters is not None
        if down and self._masters.mark_down(name):
            self._on_degraded()
        if short:
            self._masters.mark_short(name)
        with self._wait_lock:
            if self._closed or (self._watcher is not None and self._watcher.is_alive()):
                return
            self._watcher = threading.Thread(target=self._watch, name="kdn-redis-masters",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """While some master does not answer or lacks replicas: every ``WATCH_S`` refresh the
        cluster map (a replica promoted in a lost master's place takes its slots at once) and
        ask those masters again (in a thread of its own, so that a stopped master's timeout
        does not slow the refreshes); end when every one answers."""
        assert isinstance(self.client, RedisCluster) and self._masters is not None
        masters = self._masters
        asking: threading.Thread | None = None
        while not self._stop.wait(WATCH_S):
            try:
                down = masters.down()
                self._refresh(avoid=down[0] if down else None)
                primaries = {n.name: n for n in self.client.get_primaries()}
                masters.keep(set(primaries))
                if asking is None or not asking.is_alive():
                    asking = threading.Thread(target=self._ask_again, args=(primaries,),
                                              name="kdn-redis-ask", daemon=True)
                    with self._wait_lock:
                        if self._closed:
                            return
                        self._asking = asking
                    asking.start()
            except Exception:  # never let the watch end while a master is remembered
                log.exception("redis cluster watch")
            with self._wait_lock:
                if not masters.down() and not masters.short():
                    self._watcher = None
                    return

    def _ask_again(self, primaries: dict[str, ClusterNode]) -> None:
        """PING the masters that did not answer; ask those short of replicas how many they
        have. Once the transport closes, it stops (a call under way then fails on its
        closed socket: ValueError), and says nothing."""
        assert isinstance(self.client, RedisCluster) and self._masters is not None
        masters = self._masters
        for name in masters.down():
            node = primaries.get(name)
            if self._stop.is_set():
                return
            try:
                if node is not None and self.client.ping(target_nodes=node):
                    self._keep_budget_on(node)  # back with its budget, not before it
                    masters.answered(name)
            except (*REDIS_ERRORS, OSError, ValueError):
                pass
        for name in masters.short():
            node = primaries.get(name)
            if self._stop.is_set():
                return
            try:
                if node is not None and int(self.client.info(
                        "replication", target_nodes=node).get("connected_slaves", 0)) \
                        >= self.wait_replicas:
                    masters.confirmed(name)
            except (*REDIS_ERRORS, OSError, ValueError):
                pass

    def _refresh(self, avoid: str | None = None) -> None:
        """Reload the cluster map, from a node other than ``avoid`` first (no error if no node
        answers)."""
        assert isinstance(self.client, RedisCluster)
        manager = self.client.nodes_manager
        try:
            try:  # keep the pools of the node asked, ask the lost one last (redis-py >= 6)
                manager.initialize(disconnect_startup_nodes_pools=False,
                                   last_failed_node_name=avoid)
            except TypeError:
                manager.initialize()
        except (*REDIS_ERRORS, OSError):
            pass

    def primaries(self) -> tuple[int, int]:
        """(masters that answered a PING, masters known) of the cluster, remembering which do
        not answer. When one did not, the client's view of the cluster is refreshed (and the
        masters new to it asked too), so that a replica promoted in its place is found within
        one probe. A master already known not to answer is left to the watcher (which PINGs it
        every ``WATCH_S``): the probe does not wait out its timeout again."""
        assert isinstance(self.client, RedisCluster) and self._masters is not None
        answers: dict[str, bool] = {}

        def ask(nodes: list[ClusterNode]) -> None:
            assert self._masters is not None
            for node in nodes:
                if node.name in answers:
                    continue
                if self._masters.blocked(node.name):
                    answers[node.name] = False
                    continue
                try:
                    answers[node.name] = bool(self.client.ping(target_nodes=node))
                except (*REDIS_ERRORS, OSError):
                    answers[node.name] = False

        ask(self.client.get_primaries())
        silent = [name for name, ok in answers.items() if not ok]
        if silent:
            self._refresh(avoid=silent[0])
        primaries = self.client.get_primaries()
        ask(primaries)
        names = {n.name for n in primaries}
        self._masters.keep(names)
        down = set(self._masters.down())
        for node in primaries:  # one back gets its budget before it counts as back
            if answers.get(node.name) and node.name in down:
                self._keep_budget_on(node)
        for name, ok in answers.items():
            if ok:
                self._masters.answered(name)
            elif name in names:
                self._note(name, down=True)
        return sum(answers[n] for n in names), len(names)

    # -- pipelines ------------------------------------------------------------------------------

    def _pipelined(self, build: Callable[[Any], Any], master: str | None = None) -> list[Any]:
        """Run the commands ``build(pipe)`` queues in one pipeline. In a cluster they go, as a
        plain pipeline, to ``master`` (every key they name must be in its slots): a master
        that does not answer costs one socket timeout (redis-py's cluster pipeline tries each
        command again, one by one) and is remembered; MOVED or ASK (a stale map after a
        failover or resharding) refreshes the map and runs them through the cluster client,
        which follows redirects."""
        if self._masters is None or master is None:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            return list(self.call(pipe.execute))
        assert isinstance(self.client, RedisCluster)
        node = self.client.get_node(node_name=master)
        if node is None:
            raise PartlyUnavailable(f"redis: the cluster master {master} is no longer known")
        pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
        build(pipe)
        try:
            got = list(self.call(pipe.execute, raise_on_error=False))
        except PartlyUnavailable as exc:
            if unanswered(exc):
                self._note(master, down=True)
            raise
        if any(isinstance(g, (redis.exceptions.MovedError, redis.exceptions.AskError))
               for g in got):
            self._refresh()
            cpipe = self.client.pipeline(transaction=False)
            build(cpipe)
            return list(self.call(cpipe.execute))
        for g in got:
            if isinstance(g, Exception):
                raise wrap(g, self.cluster) from g
        return got

    def keyed(self, key: bytes, build: Callable[[Any], Any]) -> list[Any]:
        """The commands ``build(pipe)`` queues, on keys in ``key``'s slot (an entry's keys), in
        one pipeline (see ``_pipelined``)."""
        return self._pipelined(build, self.master_of(key) if self._masters else None)

    def batch(self, add: Callable[[Any, bytes], Any], keys: list[bytes]) -> list[Any]:
        """One pipelined command per key (``add(pipe, key)``). In a cluster, one pipeline per
        master: the keys of a master that does not answer (known, or found now) read as
        absent, the others answer."""
        if self._masters is None:
            return self._pipelined(lambda pipe: [add(pipe, k) for k in keys])
        out: list[Any] = [None] * len(keys)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            try:
                name = self.master_of(k)
            except PartlyUnavailable:
                continue
            if not self._masters.blocked(name):
                groups.setdefault(name, []).append(i)
        for name, idx in groups.items():
            def build(pipe: Any, idx: list[int] = idx) -> None:
                for i in idx:
                    add(pipe, keys[i])
            try:
                got = self._pipelined(build, name)
            except PartlyUnavailable:
                continue
            for i, g in zip(idx, got):
                out[i] = g
        return out

    def scan(self, pattern: bytes) -> list[bytes]:
        """The Redis keys matching ``pattern``; in a cluster, those of the masters that answer
        (a master known not to answer is skipped at once, one found now after its timeout)."""
        if not isinstance(self.client, RedisCluster) or self._masters is None:
            listed: list[bytes] = self.call(
                lambda: list(self.client.scan_iter(match=pattern, count=1000)))
            return listed
        found: list[bytes] = []
        for node in self.client.get_primaries():
            if self._masters.blocked(node.name):
                continue
            client = self.client.get_redis_connection(node)
            try:
                found += self.call(lambda c=client: list(c.scan_iter(match=pattern, count=1000)))
            except PartlyUnavailable as exc:
                if not unanswered(exc):
                    raise
                self._note(node.name, down=True)
        return found

    # -- WAIT -----------------------------------------------------------------------------------

    def waited(self, manifest_key: bytes, build: Callable[[Any], Any]) -> list[Any]:
        """The commands ``build(pipe)`` queues (a commit, then ``WAIT``), in one pipeline on a
        ``waiting_client`` connection to the master of ``manifest_key``'s slot. A MOVED (a
        reshard or failover since the map was read) refreshes the map and sends them once more,
        to the slot's master now; an ASK (the slot is migrating) or a second MOVED fails with
        ``PartlyUnavailable``: the write is worth retrying once the slot has moved."""
        for attempt in (1, 2):
            pipe = self.waiting_client(manifest_key).pipeline(transaction=False)
            build(pipe)
            try:
                return list(pipe.execute())
            except redis.exceptions.AskError as exc:  # MovedError is one too
                if not self.cluster or attempt == 2 \
                        or not isinstance(exc, redis.exceptions.MovedError):
                    raise PartlyUnavailable(f"redis: this key's slot is moving ({exc})") from exc
                self._refresh()
            except REDIS_ERRORS as exc:
                raise wrap(exc, self.cluster) from exc
        raise AssertionError("unreachable")

    def waiting_client(self, manifest_key: bytes) -> redis.Redis:
        """A client to the master of ``manifest_key``'s slot whose socket timeout leaves room
        for a WAIT (the other calls keep the short one). Connection errors are retried,
        timeouts not (a commit that timed out waiting is not sent again)."""
        if isinstance(self.client, RedisCluster):
            try:
                node = self.client.get_node_from_key(manifest_key)
            except REDIS_ERRORS as exc:
                raise PartlyUnavailable(f"redis: no master known for this key's slot: {exc}") \
                    from exc
            name, where = str(node.name), {"host": node.host, "port": node.port}
        else:
            name, where = "", {}
        with self._wait_lock:
            got = self._wait_clients.get(name)
            if got is None:
                retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), self.retries,
                              supported_errors=(redis.exceptions.ConnectionError,))
                kw: dict[str, Any] = dict(
                    socket_timeout=self.timeout_s + self.wait_timeout_s,
                    socket_connect_timeout=self.timeout_s, retry=retry,
                    health_check_interval=0, max_connections=self.max_connections,
                    timeout=self.timeout_s)
                pool = redis.BlockingConnectionPool(**where, **{**kw, **self._node_options}) \
                    if where else \
                    redis.BlockingConnectionPool.from_url(self.urls[0], **kw)
                got = self._wait_clients[name] = redis.Redis(connection_pool=pool)
        return got

    # -- server settings ------------------------------------------------------------------------

    def check_standalone(self) -> None:
        """Refuse a node of a Redis Cluster taken for a standalone Redis (``ConfigError``): it
        answers every command, and sends the keys of the other masters' slots away (MOVED).
        A Redis that does not answer now is not checked."""
        try:
            enabled = str(self.client.info("cluster").get("cluster_enabled", 0))
        except (*REDIS_ERRORS, OSError):
            return
        if enabled == "1":
            raise ConfigError("redis_url: it names a node of a Redis Cluster; set redis_cluster: "
                              "true (and list the cluster's nodes)")

    def check_coverage(self) -> None:
        """Warn when the cluster stops every key while one slot is uncovered (Redis's default
        ``cluster-require-full-coverage yes``): kdn keeps the other slots serving only if
        Redis does."""
        try:
            got = self.client.config_get("cluster-require-full-coverage",
                                         target_nodes=RedisCluster.PRIMARIES)
        except (*REDIS_ERRORS, OSError):
            return  # CONFIG may be off (managed Redis): nothing to say
        values = got.values() if isinstance(got, dict) and "cluster-require-full-coverage" \
            not in got else [got]
        if any(v.get("cluster-require-full-coverage") == "yes" for v in values
               if isinstance(v, dict)):
            log.warning("redis cluster: cluster-require-full-coverage is yes, so one master's "
                        "loss stops every key until its replica takes over; set it to no to "
                        "keep the other masters' slots serving")

    def apply_budget(self, capacity_bytes: int) -> None:
        """Give Redis the byte budget (per master in a cluster) and an LRU policy over all keys,
        on every master that answers (Redis refusing it, CONFIG turned off, raises
        ``ConfigError`` naming redis_bytes); one that does not answer, or refuses kdn's login
        or TLS (said), gets it from ``keep_budget`` once it does."""
        self._budget = capacity_bytes
        for node in self._budget_nodes():
            try:
                self._set_budget(node)
            except KDNError as exc:
                if not isinstance(exc, TierUnavailable):  # CONFIG off, or refused
                    raise self._budget_refused(node, exc) from exc
                refused = access_refused(exc.__cause__) if exc.__cause__ else None
                if refused is not None:
                    log.warning("redis%s: %s; it gets the byte budget once it lets kdn in",
                                "" if node is None else f" {node.name}", refused)
                    continue
                if not unanswered(exc):
                    raise
                log.warning("redis %s does not answer: it gets the byte budget once it does",
                            "Redis" if node is None else node.name)
                if node is not None:
                    self._note(node.name, down=True)

    @staticmethod
    def _budget_refused(node: ClusterNode | None, exc: KDNError) -> ConfigError:
        return ConfigError(f"redis_bytes: Redis{'' if node is None else ' ' + node.name} "
                           f"answers but does not take the byte budget (CONFIG SET maxmemory: "
                           f"{exc}); set redis_bytes to 0 and give Redis its maxmemory and "
                           "maxmemory-policy allkeys-lru yourself")

    def keep_budget(self) -> None:
        """Give the byte budget again to each master that answers without it (restarted with
        its own settings, or a replica promoted since): called by each health probe, one
        ``CONFIG GET`` per master. A master that holds another budget under kdn's policy
        (allkeys-lru: another kdn server's, with another redis_bytes) keeps it, and a warning
        says so once: two servers setting theirs in turn would change it at every probe. A
        maxmemory under another policy is Redis's own (its config file's, read again at a
        restart) and is replaced."""
        if not self._budget:
            return
        for node in self._budget_nodes():
            if node is None or not self.blocked(node.name):
                self._keep_budget_on(node)

    def _keep_budget_on(self, node: ClusterNode | None) -> None:
        """``keep_budget`` on one master (None: the standalone Redis)."""
        if not self._budget:
            return
        kw: dict[str, Any] = {} if node is None else {"target_nodes": node}
        name = "Redis" if node is None else node.name
        try:
            got = self.call(self.client.config_get, "maxmemory*", **kw)
            held = str(got.get("maxmemory"))
            if held not in ("0", str(self._budget)) and \
                    got.get("maxmemory-policy") == "allkeys-lru":  # another kdn's: left, said once
                if self._others.get(name) != held:
                    self._others[name] = held
                    log.warning("redis %s holds maxmemory %s, not this server's redis_bytes "
                                "%d: another client set it (a kdn server sharing this Redis "
                                "with another redis_bytes?); left as it is: give every kdn "
                                "server sharing a Redis the same redis_bytes",
                                name, held, self._budget)
                return
            self._others.pop(name, None)
            if held != str(self._budget) or got.get("maxmemory-policy") != "allkeys-lru":
                self._set_budget(node)
                log.info("redis %s lacked the byte budget (restarted, or promoted): set", name)
        except KDNError as exc:
            log.debug("redis: byte budget not checked: %s", exc)

    def _budget_nodes(self) -> list[ClusterNode | None]:
        if not isinstance(self.client, RedisCluster):
            return [None]
        return list(self.client.get_primaries())

    def _set_budget(self, node: ClusterNode | None) -> None:
        kw: dict[str, Any] = {} if node is None else {"target_nodes": node}
        self.call(self.client.config_set, "maxmemory", str(self._budget), **kw)
        self.call(self.client.config_set, "maxmemory-policy", "allkeys-lru", **kw)

    def close(self) -> None:
        """Stop the watcher and close every client."""
        with self._wait_lock:
            self._closed = True
            self._stop.set()
            watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout=5)
        asking = self._asking  # a PING of a stopped master ends within its socket timeout
        if asking is not None:
            asking.join(timeout=self.timeout_s * (self.retries + 2))
        for c in [self.client, *self._wait_clients.values()]:
            try:
                c.close()
            except REDIS_ERRORS:
                pass
