"""Redis tier: standalone Redis or Redis Cluster, shared by every kdn server that points at it.

Key scheme (``T`` is the hash tag of the kdn key: the key itself, or its xxh3-128 hex digest
when it holds ``{`` or ``}``; one tag puts all of an entry's keys in one cluster slot):

    kdn:{T}:m            manifest = 40-byte header + the value's first part
    kdn:{T}:<ver>:<i>    part i >= 1 of the value written as version <ver> (16 hex chars)

Header: magic ``KDNM``, format 1, ``ver`` (8 random bytes), part count, total length, part size.
A value no larger than ``part_bytes`` is one key: the manifest holds it whole.

Writes are made visible atomically. ``put`` writes parts 1.. under a fresh ``ver`` with a
provisional expiry (``PENDING_TTL_S``), then one Lua script checks that every part still
exists, sets the manifest and gives the parts the entry's final TTL (or none). A reader that
fetched manifest ``ver`` reads exactly that version's parts, so two writers racing on one key
leave one complete version (the last commit); the loser's parts and the replaced version's
parts expire after ``GRACE_S`` so readers mid-way through them can finish. A writer killed
before its commit leaves only parts that expire by themselves. A reader that finds a part
missing re-reads the manifest: a new version means retry; the same version means the part was
evicted by Redis (``maxmemory``), and the entry is dropped and reported as a miss.

Transport: a connection pool (``BlockingConnectionPool`` standalone, per-node pools in a
cluster), commands retried ``retries`` times with exponential backoff and jitter on connection
and timeout errors only; every redis-py error leaves as ``TierUnavailable`` (or ``TooLarge`` when
Redis is out of memory), so the hierarchy can mark the tier down and carry on.

Cluster, one master out (stopped, cut off or killed): its slots' keys fail with
``PartlyUnavailable`` (reads miss, SHARED stores are refused) and the tier stays up for the other
masters' slots; ``healthy()`` is true while any master answers and sets ``degraded`` while some
do not; listings (``keys``) and ``stats`` cover the masters that answer. A master that did not
answer (a call was refused or timed out, or the health probe's PING failed) is remembered
(``masters_down``) and the calls for its slots then fail at once, so that a stopped master holds
no server thread and no entry lock beyond its first socket timeout: a call is not sent again to
a node that timed out, and an entry's or a batch's commands go as one plain pipeline per master
(redis-py's cluster pipeline would try each command again, one by one). While a master is
remembered, a thread of the tier refreshes the cluster map and PINGs it every ``WATCH_S``, so
that a replica promoted in its place takes its slots at once and a master that answers again is
used again. MOVED/ASK (a stale map) refresh the map and go through the cluster client.

``wait_replicas`` N: each write is committed and then ``WAIT N`` on one connection to the key's
master (connections of their own, whose socket timeout adds ``wait_timeout_s``); fewer replicas
within ``wait_timeout_s`` withdraw the entry and fail the write (``ReplicasShort``, a
``PartlyUnavailable``), so that nothing unreplicated is acknowledged, and further writes to that
master fail at once until it has N replicas connected again.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import redis
import xxhash
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kdn.errors import KDNError, PartlyUnavailable, TierUnavailable, TooLarge
from kdn.store.base import Tier, TierStats

log = logging.getLogger(__name__)

_HDR = struct.Struct("<4sB3x8sIQQ4x")  # magic, format, ver, parts, total, part_bytes
HEADER_BYTES = _HDR.size
_MAGIC = b"KDNM"
PENDING_TTL_S = 600
GRACE_S = 10
_READ_ATTEMPTS = 4

# KEYS: manifest, parts...; ARGV: manifest bytes, ttl ms (0 = none), header length.
# Returns the replaced manifest's header (or false), or an error when a part is gone.
_COMMIT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('KDNPART part ' .. (i - 1) .. ' expired before commit')
  end
end
local old = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
for i = 2, #KEYS do
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
return old
"""

# KEYS: manifest; ARGV: header length, expected ver ('' = any). Deletes; returns old header.
_DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if ARGV[2] ~= '' and string.sub(old, 9, 16) ~= ARGV[2] then return false end
redis.call('DEL', KEYS[1])
return old
"""


def _hash_tag(key: bytes) -> bytes:
    if b"{" in key or b"}" in key:
        return xxhash.xxh3_128_hexdigest(key).encode()
    return key


class _Header:
    __slots__ = ("ver", "parts", "total", "part_bytes")

    def __init__(self, ver: bytes, parts: int, total: int, part_bytes: int) -> None:
        self.ver, self.parts, self.total, self.part_bytes = ver, parts, total, part_bytes

    def pack(self) -> bytes:
        return _HDR.pack(_MAGIC, 1, self.ver, self.parts, self.total, self.part_bytes)

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> _Header | None:
        if len(raw) < HEADER_BYTES:
            return None
        magic, fmt, ver, parts, total, part_bytes = _HDR.unpack_from(raw)
        if magic != _MAGIC or fmt != 1 or parts < 1 or part_bytes < 1:
            return None
        return cls(ver, parts, total, part_bytes)


_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
         redis.exceptions.ClusterDownError, redis.exceptions.BusyLoadingError,
         redis.exceptions.TryAgainError, redis.exceptions.MaxConnectionsError,
         redis.exceptions.MasterDownError, redis.exceptions.SlotNotCoveredError,
         redis.exceptions.ReadOnlyError, redis.exceptions.ClusterError)


def _wrap(exc: BaseException, cluster: bool = False) -> KDNError:
    """TierUnavailable when Redis can not be reached (PartlyUnavailable in a cluster: one
    slot's master; the probe decides whether the whole tier is gone), TooLarge when full, else
    KDNError."""
    if isinstance(exc, _DOWN):
        down = PartlyUnavailable if cluster else TierUnavailable
        return down(f"redis: {type(exc).__name__}: {exc}")
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM"):
        return TooLarge(f"redis is out of memory: {exc}")
    return KDNError(f"redis: {type(exc).__name__}: {exc}")


WATCH_S = 0.25
"""While a cluster master is known not to answer (or, with WAIT, to lack replicas), a thread of
the tier asks it again, and refreshes the cluster map, every ``WATCH_S`` seconds."""


class ReplicasShort(PartlyUnavailable):
    """A write the master took but too few replicas confirmed (``WAIT``); it was withdrawn. Part
    of the tier (that master's slots; all of a standalone Redis) takes no write that must be
    confirmed, the rest serves on."""


def _unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` (a kdn error wrapping a redis-py one) says the node did not answer: a
    refused, reset or timed-out connection (not a full client-side pool)."""
    cause = exc.__cause__
    return isinstance(cause, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) \
        and not isinstance(cause, redis.exceptions.MaxConnectionsError)


class _Masters:
    """Which cluster masters (by node name, ``host:port``) do not answer, or answer but lack the
    replicas WAIT asks for: the gate every keyed call passes (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # name -> since when it does not answer
        self._short: dict[str, float] = {}  # name -> since when WAIT came back short

    def check(self, name: str, *, write: bool) -> None:
        """Raise at once when ``name`` does not answer, or (for a write) lacks replicas."""
        if name in self._down:
            raise PartlyUnavailable(f"redis: the cluster master {name} of this key's slot does "
                                    "not answer")
        if write and name in self._short:
            raise ReplicasShort(f"redis: the cluster master {name} of this key's slot lacks the "
                                "replicas to confirm a write")

    def blocked(self, name: str) -> bool:
        """Whether a read of ``name``'s slots fails at once now."""
        return name in self._down

    def mark_down(self, name: str) -> bool:
        """Remember that ``name`` does not answer; True when that is news."""
        with self._lock:
            if name in self._down:
                return False
            self._down[name] = time.monotonic()
        log.warning("redis cluster master %s does not answer: its slots' keys fail, the other "
                    "masters' slots serve on", name)
        return True

    def mark_short(self, name: str) -> bool:
        with self._lock:
            if name in self._short:
                return False
            self._short[name] = time.monotonic()
        log.warning("redis cluster master %s lacks the replicas WAIT asks for: writes to its "
                    "slots are refused", name)
        return True

    def answered(self, name: str) -> None:
        with self._lock:
            back = self._down.pop(name, None) is not None
        if back:
            log.info("redis cluster master %s answers again", name)

    def confirmed(self, name: str) -> None:
        """``name`` has the replicas WAIT asks for (again)."""
        with self._lock:
            back = self._short.pop(name, None) is not None
        if back:
            log.info("redis cluster master %s has its replicas again", name)

    def down(self) -> list[str]:
        with self._lock:
            return sorted(self._down)

    def short(self) -> list[str]:
        with self._lock:
            return sorted(self._short)

    def keep(self, names: set[str]) -> None:
        """Forget the nodes that are no longer masters (a replica took over; the old master
        came back as its replica)."""
        with self._lock:
            for d in (self._down, self._short):
                for name in [n for n in d if n not in names]:
                    del d[name]


class _Cluster(RedisCluster):
    """A cluster client that does not send a command again to a node that timed out (a stopped
    or cut-off master: every try would wait out the socket timeout again, while the tier fails
    that master's slots at once from then on); refused connections and CLUSTERDOWN are still
    retried on a refreshed map, which is how a killed master's keys reach its promoted
    replica."""

    ERRORS_ALLOW_RETRY = tuple(e for e in RedisCluster.ERRORS_ALLOW_RETRY  # type: ignore[assignment]
                               if e is not redis.exceptions.TimeoutError)


class RedisTier(Tier):
    name = "redis"
    remote = True

    def __init__(
        self,
        urls: str | list[str],
        *,
        cluster: bool = False,
        part_bytes: int = 8 << 20,
        timeout_s: float = 1.0,
        retries: int = 2,
        max_connections: int = 32,
        capacity_bytes: int = 0,
        prefix: bytes = b"kdn:",
        wait_replicas: int = 0,
        wait_timeout_s: float = 1.0,
    ) -> None:
        super().__init__()
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        if part_bytes < 1024:
            raise ValueError(f"part_bytes must be >= 1024, got {part_bytes}")
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.cluster = cluster
        self.part_bytes = part_bytes
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_connections = max_connections
        retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries)
        # the socket timeout bounds how long a stopped master holds a call (a WAIT, which may
        # take up to wait_timeout_s more, runs on connections of its own: _waiting_client)
        common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=retry, health_check_interval=0)
        self._masters = _Masters() if cluster else None
        self._wait_clients: dict[str, redis.Redis] = {}
        self._wait_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.client: redis.Redis | RedisCluster
        if cluster:
            nodes = []
            for u in self.urls:
                p = urlparse(u)
                nodes.append(ClusterNode(p.hostname or "127.0.0.1", p.port or 6379))
            self.client = _Cluster(startup_nodes=nodes, max_connections=max_connections,
                                       cluster_error_retry_attempts=max(1, retries), **common)
        else:
            if len(self.urls) != 1:
                raise ValueError("a standalone Redis tier takes exactly one URL")
            pool = redis.BlockingConnectionPool.from_url(
                self.urls[0], max_connections=max_connections, timeout=timeout_s, **common)
            self.client = redis.Redis(connection_pool=pool)
        self._commit = self.client.register_script(_COMMIT)
        self._delete = self.client.register_script(_DELETE)
        if capacity_bytes:
            self._apply_budget()
        if cluster:
            self._check_coverage()

    # -- keys -----------------------------------------------------------------------------------

    def _manifest_key(self, key: bytes) -> bytes:
        return self.prefix + b"{" + _hash_tag(key) + b"}:m"

    def _part_key(self, key: bytes, ver: bytes, i: int) -> bytes:
        return self.prefix + b"{" + _hash_tag(key) + b"}:" + ver.hex().encode() + b":%d" % i

    def _part_keys(self, key: bytes, h: _Header) -> list[bytes]:
        return [self._part_key(key, h.ver, i) for i in range(1, h.parts)]

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise _wrap(exc, self.cluster) from exc

    def _master_of(self, key: bytes) -> str:
        """The name (``host:port``) of the cluster master that holds ``key``'s slot, as this
        client's map has it."""
        assert isinstance(self.client, RedisCluster)
        try:
            return str(self.client.get_node_from_key(self._manifest_key(key)).name)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise PartlyUnavailable(f"redis: no master known for this key's slot: {exc}") \
                from exc

    @contextmanager
    def _slot(self, key: bytes, *, write: bool = False) -> Iterator[None]:
        """Around every call for ``key`` in a cluster: fail at once while its master is known
        not to answer (or, for a write with WAIT, to lack replicas); learn from the outcome."""
        if self._masters is None:
            yield
            return
        name = self._master_of(key)
        self._masters.check(name, write=write)
        try:
            yield
        except ReplicasShort:
            self._note(name, short=True)
            raise
        except PartlyUnavailable as exc:
            if _unanswered(exc):
                self._note(name, down=True)
            raise

    def _note(self, name: str, *, down: bool = False, short: bool = False) -> None:
        """``name`` did not answer, or lacked replicas: remember it, and watch it."""
        assert self._masters is not None
        if down and self._masters.mark_down(name):
            self.degraded = True
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
                    asking.start()
            except Exception:  # never let the watch end while a master is remembered
                log.exception("redis cluster watch")
            with self._wait_lock:
                if not masters.down() and not masters.short():
                    self._watcher = None
                    return

    def _ask_again(self, primaries: dict[str, ClusterNode]) -> None:
        """PING the masters that did not answer; ask those short of replicas how many they
        have."""
        assert isinstance(self.client, RedisCluster) and self._masters is not None
        masters = self._masters
        for name in masters.down():
            node = primaries.get(name)
            try:
                if node is not None and self.client.ping(target_nodes=node):
                    masters.answered(name)
            except (redis.exceptions.RedisError, OSError):
                pass
        for name in masters.short():
            node = primaries.get(name)
            try:
                if node is not None and int(self.client.info(
                        "replication", target_nodes=node).get("connected_slaves", 0)) \
                        >= self.wait_replicas:
                    masters.confirmed(name)
            except (redis.exceptions.RedisError, OSError, ValueError):
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
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError):
            pass

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
            return list(self._call(pipe.execute))
        assert isinstance(self.client, RedisCluster)
        node = self.client.get_node(node_name=master)
        if node is None:
            raise PartlyUnavailable(f"redis: the cluster master {master} is no longer known")
        pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
        build(pipe)
        try:
            got = list(self._call(pipe.execute, raise_on_error=False))
        except PartlyUnavailable as exc:
            if _unanswered(exc):
                self._note(master, down=True)
            raise
        if any(isinstance(g, (redis.exceptions.MovedError, redis.exceptions.AskError))
               for g in got):
            self._refresh()
            cpipe = self.client.pipeline(transaction=False)
            build(cpipe)
            return list(self._call(cpipe.execute))
        for g in got:
            if isinstance(g, Exception):
                raise _wrap(g, self.cluster) from g
        return got

    def _keyed(self, key: bytes, build: Callable[[Any], Any]) -> list[Any]:
        """``_pipelined`` for commands on keys in ``key``'s slot (an entry's keys)."""
        return self._pipelined(build, self._master_of(key) if self._masters else None)

    def _batch(self, add: Callable[[Any, bytes], Any], keys: list[bytes]) -> list[Any]:
        """One pipelined command per key (``add(pipe, key)``). In a cluster, one pipeline per
        master: the keys of a master that does not answer (known, or found now) read as
        absent, the others answer."""
        if self._masters is None:
            return self._pipelined(lambda pipe: [add(pipe, k) for k in keys])
        out: list[Any] = [None] * len(keys)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            try:
                name = self._master_of(k)
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

    def _check_coverage(self) -> None:
        """Warn when the cluster stops every key while one slot is uncovered (Redis's default
        ``cluster-require-full-coverage yes``): kdn keeps the other slots serving only if
        Redis does."""
        try:
            got = self.client.config_get("cluster-require-full-coverage",
                                         target_nodes=RedisCluster.PRIMARIES)
        except (redis.exceptions.RedisError, OSError):
            return  # CONFIG may be off (managed Redis): nothing to say
        values = got.values() if isinstance(got, dict) and "cluster-require-full-coverage" \
            not in got else [got]
        if any(v.get("cluster-require-full-coverage") == "yes" for v in values
               if isinstance(v, dict)):
            log.warning("redis cluster: cluster-require-full-coverage is yes, so one master's "
                        "loss stops every key until its replica takes over; set it to no to "
                        "keep the other masters' slots serving")

    def _apply_budget(self) -> None:
        """Give Redis the byte budget (per node in a cluster) and an LRU policy over all keys."""
        kw: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        self._call(self.client.config_set, "maxmemory", str(self.capacity_bytes), **kw)
        self._call(self.client.config_set, "maxmemory-policy", "allkeys-lru", **kw)

    # -- reads ----------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._slot(key):
            return bool(self._call(self.client.exists, self._manifest_key(key)))

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [bool(x) for x in
                self._batch(lambda p, k: p.exists(self._manifest_key(k)), keys)]

    def size_of(self, key: bytes) -> int | None:
        return self.size_many([key])[0]

    def size_many(self, keys: list[bytes]) -> list[int | None]:
        out: list[int | None] = []
        for raw in self._batch(
                lambda p, k: p.getrange(self._manifest_key(k), 0, HEADER_BYTES - 1), keys):
            h = _Header.parse(raw) if raw else None
            out.append(None if h is None else h.total)
        return out

    def ttl_remaining(self, key: bytes) -> float | None:
        with self._slot(key):
            ms = self._call(self.client.pttl, self._manifest_key(key))
        return None if ms is None or ms < 0 else ms / 1000.0

    def get(self, key: bytes) -> bytes | None:
        mkey = self._manifest_key(key)
        with self._slot(key):
            for _ in range(_READ_ATTEMPTS):
                manifest = self._call(self.client.get, mkey)
                value = self._assemble(key, manifest)
                if value is not _RETRY:
                    break
            else:
                value = None
        self.counters.add("misses" if value is None else "hits")
        return value  # type: ignore[return-value]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        manifests = self._batch(lambda p, k: p.get(self._manifest_key(k)), keys)
        out: list[bytes | None] = []
        for k, m in zip(keys, manifests):
            try:
                if m is None:
                    v = None
                else:
                    with self._slot(k):
                        v = self._assemble(k, m)
            except PartlyUnavailable:  # its master went away since the manifests came
                v = None
            if v is _RETRY:
                out.append(self.get(k))
                continue
            self.counters.add("misses" if v is None else "hits")
            out.append(v)  # type: ignore[arg-type]
        return out

    def _assemble(self, key: bytes, manifest: bytes | None) -> bytes | None | object:
        """The value a manifest describes, None for a miss, or _RETRY when it was replaced."""
        if manifest is None:
            return None
        h = _Header.parse(manifest)
        if h is None:
            self._drop_damaged(key, None, "unreadable manifest")
            return None
        first = memoryview(manifest)[HEADER_BYTES:]
        if h.parts == 1:
            if len(first) != h.total:
                self._drop_damaged(key, h, "manifest length mismatch")
                return None
            return bytes(first)
        pkeys = self._part_keys(key, h)
        parts = self._call(self.client.execute_command, "MGET", *pkeys)
        if any(p is None for p in parts):
            now = self._call(self.client.getrange, self._manifest_key(key), 0, HEADER_BYTES - 1)
            cur = _Header.parse(now) if now else None
            if cur is not None and cur.ver != h.ver:
                return _RETRY
            if cur is not None:
                self._drop_damaged(key, h, "a part was evicted")
            return None
        value = b"".join([first, *parts])
        if len(value) != h.total:
            self._drop_damaged(key, h, "parts do not add up to the manifest's length")
            return None
        return value

    def _drop_damaged(self, key: bytes, h: _Header | None, why: str) -> None:
        log.warning("redis entry %r is damaged (%s); dropped", key, why)
        self.counters.add("corrupt")
        ver = h.ver if h is not None else b""
        old = self._call(self._delete, keys=[self._manifest_key(key)],
                         args=[HEADER_BYTES, ver])
        self._expire_parts(key, old, 0)

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """The keys starting with ``prefix``; in a cluster, those of the masters that answer
        (a master known not to answer is skipped at once, one found now after its timeout)."""
        pattern = self.prefix + b"{" + _glob_escape(prefix) + b"*}:m"
        start = len(self.prefix) + 1
        if not isinstance(self.client, RedisCluster) or self._masters is None:
            found = self._call(lambda: list(self.client.scan_iter(match=pattern, count=1000)))
            return iter(sorted(k[start:-3] for k in found))
        found = []
        for node in self.client.get_primaries():
            if self._masters.blocked(node.name):
                continue
            client = self.client.get_redis_connection(node)
            try:
                found += self._call(lambda c=client: list(c.scan_iter(match=pattern, count=1000)))
            except PartlyUnavailable as exc:
                if not _unanswered(exc):
                    raise
                self._note(node.name, down=True)
        return iter(sorted(k[start:-3] for k in found))

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None) -> None:
        with self._slot(key, write=True):
            self._put(key, value, ttl_s)

    def _put(self, key: bytes, value: bytes, ttl_s: float | None) -> None:
        total = len(value)
        n = max(1, -(-total // self.part_bytes))
        h = _Header(os.urandom(8), n, total, self.part_bytes)
        view = memoryview(value)
        pkeys = self._part_keys(key, h)
        if pkeys:
            def parts(pipe: Any) -> None:
                for i, pk in enumerate(pkeys, start=1):
                    pipe.set(pk, view[i * self.part_bytes:(i + 1) * self.part_bytes],
                             ex=PENDING_TTL_S + int(ttl_s or 0))
            self._keyed(key, parts)
        manifest = h.pack() + view[:self.part_bytes]
        ttl_ms = int(ttl_s * 1000) if ttl_s else 0
        if self.wait_replicas:
            old = self._commit_replicated(key, h, [self._manifest_key(key), *pkeys],
                                          [manifest, ttl_ms, HEADER_BYTES])
        else:
            old = self._call(self._commit, keys=[self._manifest_key(key), *pkeys],
                             args=[manifest, ttl_ms, HEADER_BYTES])
        if old is not None and _same_version(old, h):
            return  # a commit sent again after a lost reply replaced itself: nothing to drop
        self._expire_parts(key, old, GRACE_S)

    def _commit_replicated(self, key: bytes, h: _Header, keys: list[bytes], args: list[Any]
                           ) -> bytes | None:
        """Commit, then WAIT for ``wait_replicas`` replicas, on one connection to the key's
        master (WAIT covers that connection's writes, and with them everything the master
        replicated before: the parts too). Too few replicas: the entry is withdrawn and the
        write fails (``ReplicasShort``), so that nothing unreplicated is acknowledged."""
        pipe = self._waiting_client(keys[0]).pipeline(transaction=False)
        self._commit(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.wait_replicas, int(self.wait_timeout_s * 1000))
        # a failed call here (it bypasses the cluster client's retries) has _slot remember the
        # master, and the tier's watcher refresh the map to find a replica promoted in its place
        old, acked = self._call(pipe.execute)
        if int(acked) < self.wait_replicas:
            try:
                self._call(self._delete, keys=[keys[0]], args=[HEADER_BYTES, h.ver])
                self._expire_parts(key, h.pack(), 0)
                if old is not None and not _same_version(old, h):
                    self._expire_parts(key, old, GRACE_S)
            except KDNError:
                pass
            raise ReplicasShort(f"redis: the write reached {acked} of the {self.wait_replicas} "
                                f"replicas asked for within {self.wait_timeout_s:g} s; "
                                "withdrawn")
        return old  # type: ignore[no-any-return]

    def _waiting_client(self, manifest_key: bytes) -> redis.Redis:
        """A client to the master of ``manifest_key``'s slot whose socket timeout leaves room
        for a WAIT (the other calls keep the short one). Connection errors are retried,
        timeouts not (a commit that timed out waiting is not sent again)."""
        if isinstance(self.client, RedisCluster):
            try:
                node = self.client.get_node_from_key(manifest_key)
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
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
                pool = redis.BlockingConnectionPool(**where, **kw) if where else \
                    redis.BlockingConnectionPool.from_url(self.urls[0], **kw)
                got = self._wait_clients[name] = redis.Redis(connection_pool=pool)
        return got

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, ttl_s: float | None = None) -> None:
        small: list[tuple[bytes, bytes]] = []
        for k, v in items:
            if len(v) > self.part_bytes or self.cluster or self.wait_replicas:
                self.put(k, v, ttl_s=ttl_s)
            else:
                small.append((k, v))
        if not small:
            return
        ttl_ms = int(ttl_s * 1000) if ttl_s else 0
        pipe = self.client.pipeline(transaction=False)
        for k, v in small:
            manifest = _Header(os.urandom(8), 1, len(v), self.part_bytes).pack() + v
            self._commit(keys=[self._manifest_key(k)], args=[manifest, ttl_ms, HEADER_BYTES],
                         client=pipe)
        olds = self._call(pipe.execute)
        for (k, _), old in zip(small, olds):
            self._expire_parts(k, old, GRACE_S)

    def _expire_parts(self, key: bytes, old_header: bytes | None, after_s: int) -> None:
        """Let the parts of a replaced or deleted version go (after ``after_s``, or now)."""
        h = _Header.parse(old_header) if old_header else None
        if h is None or h.parts == 1:
            return
        pkeys = self._part_keys(key, h)
        if after_s:
            self._keyed(key, lambda pipe: [pipe.expire(pk, after_s) for pk in pkeys])
        else:
            self._keyed(key, lambda pipe: [pipe.unlink(pk) for pk in pkeys])

    def delete(self, key: bytes) -> bool:
        with self._slot(key):
            old = self._call(self._delete, keys=[self._manifest_key(key)],
                             args=[HEADER_BYTES, ""])
            self._expire_parts(key, old, 0)
        return bool(old)

    # -- admin ----------------------------------------------------------------------------------

    def _primaries(self) -> tuple[int, int]:
        """(masters that answered a PING, masters known) of the cluster, remembering which do
        not answer. When one did not, the client's view of the cluster is refreshed (and the
        masters new to it asked too), so that a replica promoted in its place is found within
        one probe. A master already known not to answer is left to the tier's watcher (which
        PINGs it every ``WATCH_S``): the probe does not wait out its timeout again."""
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
                except (redis.exceptions.RedisError, OSError):
                    answers[node.name] = False

        ask(self.client.get_primaries())
        silent = [name for name, ok in answers.items() if not ok]
        if silent:
            self._refresh(avoid=silent[0])
        primaries = self.client.get_primaries()
        ask(primaries)
        names = {n.name for n in primaries}
        self._masters.keep(names)
        for name, ok in answers.items():
            if ok:
                self._masters.answered(name)
            elif name in names:
                self._note(name, down=True)
        return sum(answers[n] for n in names), len(names)

    def masters_down(self) -> list[str]:
        """The cluster masters (``host:port``) that do not answer, whose slots' keys fail now
        (empty for a standalone Redis, or while every master answers)."""
        return [] if self._masters is None else self._masters.down()

    def parts_down(self) -> list[str]:
        """``masters_down``: a cluster's parts are its masters."""
        return self.masters_down()

    def healthy(self) -> bool:
        """Up while Redis answers; for a cluster, while any master does (``degraded`` says
        whether some do not: their slots' keys then miss, and writes there are refused)."""
        try:
            if isinstance(self.client, RedisCluster):
                ok, known = self._primaries()
                self.degraded = 0 < ok < known
                return ok > 0
            return bool(self.client.ping())
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError):
            return False

    def stats(self) -> TierStats:
        c = self.counters
        entries = used = answered = 0
        nodes = self.client.get_primaries() if isinstance(self.client, RedisCluster) else [None]
        for node in nodes:  # in a cluster, what the masters that answer hold
            if node is not None and self._masters is not None \
                    and self._masters.blocked(node.name):
                continue  # known not to answer: no call that waits out the timeout
            kw: dict[str, Any] = {} if node is None else {"target_nodes": node}
            try:
                entries += int(self.client.dbsize(**kw))
                used += int(self.client.info("memory", **kw)["used_memory"])
                answered += 1
            except (redis.exceptions.RedisError, OSError):
                pass
        return TierStats(self.name, entries, used, self.capacity_bytes, c.hits, c.misses,
                         c.evictions, c.corrupt, answered > 0,
                         degraded=0 < answered < len(nodes))

    def close(self) -> None:
        with self._wait_lock:
            self._closed = True
            self._stop.set()
            watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout=5)
        for c in [self.client, *self._wait_clients.values()]:
            try:
                c.close()
            except redis.exceptions.RedisError:
                pass


def _same_version(header: bytes, h: _Header) -> bool:
    """Whether ``header`` (a manifest's first bytes) names version ``h.ver``."""
    got = _Header.parse(header)
    return got is not None and got.ver == h.ver


_RETRY = object()


def _glob_escape(raw: bytes) -> bytes:
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)
