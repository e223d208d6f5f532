"""Redis tier: standalone Redis or Redis Cluster, shared by every kdn server that points at it.

Key scheme (``T`` is the hash tag of the kdn key: the key itself, or its xxh3-128 hex digest
when it holds ``{`` or ``}``; one tag puts all of an entry's keys in one cluster slot):

    kdn:{T}:m            manifest = 40-byte header + the value's first part
    kdn:{T}:<ver>:<i>    part i >= 1 of the value written as version <ver> (16 hex chars)

Header: magic ``KDNM``, format 1, ``ver`` (8 random bytes), part count, total length, part size.
A value no larger than ``part_bytes`` is one key: the manifest holds it whole. ``part_bytes`` is
cut to ``MAX_BULK_BYTES`` (Redis's ``proto-max-bulk-len``) less the header, so that a manifest
is a value Redis takes.

A time to live longer than ``MAX_TTL_S`` (``kdn.options``: 10**10 s, what the server cuts
longer ones to) is held as none (no expiry here: Lua writes a number of 10**14 ms or more as
``1e+14``, which ``SET PX`` refuses).

Writes are made visible atomically. ``put`` writes parts 1.. under a fresh ``ver`` with a
provisional expiry (``PENDING_TTL_S``), then one Lua script checks that every part still
exists, sets the manifest and gives the parts the entry's final TTL (or none). A reader that
fetched manifest ``ver`` reads exactly that version's parts, so two writers racing on one key
leave one complete version (the last commit); the loser's parts and the replaced version's
parts expire after ``GRACE_S`` so readers mid-way through them can finish. A writer killed
before its commit leaves only parts that expire by themselves; a write that Redis refused (out
of memory, a slot moving) unlinks the parts it wrote, where that master answers. A reader that
finds a part missing re-reads the manifest: a new version means retry; the same version means
the part was evicted by Redis (``maxmemory``), and the entry is dropped and reported as a miss
and an eviction (not as damage). Redis evicts blind to the hierarchy's pins (``keeps_pins``
false): a pinned entry only this tier took is refused (``kdn.store.tiered``).

A node of a Redis Cluster given as a standalone Redis (``cluster`` false) is refused at start
(``ConfigError``: it would send two thirds of the keys away with MOVED) where it answers then.

Transport (``kdn.store.redis_transport``): pooled clients, retries on connection errors only
(a command that timed out is not sent again), redis-py errors leaving as ``TierUnavailable``
(``TooLarge`` when Redis is out of memory). In a cluster, a master that does not answer fails
its slots' keys with ``PartlyUnavailable`` (reads miss, SHARED stores are refused) while the
tier stays up for the other masters' slots; ``healthy()`` is true while any master answers and
sets ``degraded`` while some do not; listings (``keys``) and ``stats`` cover the masters that
answer.

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
from collections.abc import Iterable, Iterator
from typing import Any

import redis
import xxhash
from redis.cluster import RedisCluster

from kdn.errors import KDNError, PartlyUnavailable, TierUnavailable, TooLarge
from kdn.options import MAX_TTL_S
from kdn.store.base import Tier, TierStats
from kdn.store.redis_errors import REDIS_ERRORS, said, wrap
from kdn.store.redis_masters import ReplicasShort
from kdn.store.redis_stats import held
from kdn.store.redis_transport import RedisTransport
from kdn.store.redis_urls import shown_url

__all__ = ["GRACE_S", "HEADER_BYTES", "MAX_BULK_BYTES", "MAX_TTL_S", "PENDING_TTL_S",
           "RedisTier", "ReplicasShort"]

log = logging.getLogger(__name__)

_HDR = struct.Struct("<4sB3x8sIQQ4x")  # magic, format, ver, parts, total, part_bytes
HEADER_BYTES = _HDR.size
_MAGIC = b"KDNM"
PENDING_TTL_S = 600
MAX_BULK_BYTES = 512 << 20
"""The longest value Redis takes in one command by default (``proto-max-bulk-len``): a
manifest, header and first part, stays within it, so a part holds at most this less
``HEADER_BYTES`` (a longer one breaks the connection: the tier would be marked down)."""
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
        if magic != _MAGIC or fmt != 1 or part_bytes < 1 \
                or parts != max(1, -(-total // part_bytes)):  # as written: a part count of
            return None  # 2**32 made a read ask for (and hold) as many part keys at once
        return cls(ver, parts, total, part_bytes)


class RedisTier(Tier):
    name = "redis"
    remote = True
    keeps_pins = False  # the server's maxmemory policy evicts what it chooses, pinned or not

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
        max_bulk_bytes: int = MAX_BULK_BYTES,
    ) -> None:
        super().__init__()
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        if part_bytes < 1024:
            raise ValueError(f"part_bytes must be >= 1024, got {part_bytes}")
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.cluster = cluster
        # a manifest (header + first part) is one value: within Redis's proto-max-bulk-len
        self.part_bytes = max(1024, min(part_bytes, max_bulk_bytes - HEADER_BYTES))
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_connections = max_connections
        self.transport = RedisTransport(
            self.urls, cluster=cluster, route=self._manifest_key, on_degraded=self._degrade,
            timeout_s=timeout_s, retries=retries, max_connections=max_connections,
            wait_replicas=wait_replicas, wait_timeout_s=wait_timeout_s)
        self.client: redis.Redis | RedisCluster = self.transport.client
        self._commit = self.client.register_script(_COMMIT)
        self._delete = self.client.register_script(_DELETE)
        self._unsure: dict[bytes, _Header] = {}
        """By key, the version of a commit sent that got no answer (Redis stopped, cut off):
        the write was reported failed, yet Redis may run the commit once it runs again. Each
        is withdrawn (that version only) as soon as Redis answers: before the next read or
        write of its key, and at each health probe (``_settle``)."""
        self._unsure_lock = threading.Lock()
        try:
            if not cluster:
                self.transport.check_standalone()
            if capacity_bytes:
                self.transport.apply_budget(capacity_bytes)
        except KDNError:
            self.transport.close()
            raise
        if cluster:
            self.transport.check_coverage()

    def _degrade(self) -> None:
        """A cluster master was found not to answer: the tier is up but not whole."""
        self.degraded = True

    # -- keys -----------------------------------------------------------------------------------

    def _manifest_key(self, key: bytes) -> bytes:
        return self.prefix + b"{" + _hash_tag(key) + b"}:m"

    def _part_key(self, key: bytes, ver: bytes, i: int) -> bytes:
        return self.prefix + b"{" + _hash_tag(key) + b"}:" + ver.hex().encode() + b":%d" % i

    def _part_keys(self, key: bytes, h: _Header) -> list[bytes]:
        return [self._part_key(key, h.ver, i) for i in range(1, h.parts)]

    def _master_of(self, key: bytes) -> str:
        """The cluster master (``host:port``) of ``key``'s slot, as the client's map has it."""
        return self.transport.master_of(key)

    # -- reads ----------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self.transport.slot(key):
            return bool(self.transport.call(self.client.exists, self._manifest_key(key)))

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [bool(x) for x in
                self.transport.batch(lambda p, k: p.exists(self._manifest_key(k)), keys)]

    def size_of(self, key: bytes) -> int | None:
        return self.size_many([key])[0]

    def size_many(self, keys: list[bytes]) -> list[int | None]:
        out: list[int | None] = []
        for raw in self.transport.batch(
                lambda p, k: p.getrange(self._manifest_key(k), 0, HEADER_BYTES - 1), keys):
            h = _Header.parse(raw) if raw else None
            out.append(None if h is None else h.total)
        return out

    def ttl_remaining(self, key: bytes) -> float | None:
        with self.transport.slot(key):
            ms = self.transport.call(self.client.pttl, self._manifest_key(key))
        if ms == -1:  # held with no expiry; -2: absent (expired since a read), 0: its last ms
            return None
        return 0.0 if ms is None or ms < 0 else ms / 1000.0

    def get(self, key: bytes) -> bytes | None:
        self._settled([key])
        mkey = self._manifest_key(key)
        with self.transport.slot(key):
            for _ in range(_READ_ATTEMPTS):
                manifest = self.transport.call(self.client.get, mkey)
                value = self._assemble(key, manifest)
                if value is not _RETRY:
                    break
            else:
                value = None
        self.counters.add("misses" if value is None else "hits")
        return value  # type: ignore[return-value]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of ``keys``; a key whose master does not answer (or whose unanswered
        commit could not be withdrawn yet) reads as absent, the others are served."""
        unsettled = self._settle(keys)
        manifests = self.transport.batch(lambda p, k: p.get(self._manifest_key(k)),
                                         [k for k in keys if k not in unsettled])
        got = iter(manifests)
        out: list[bytes | None] = []
        for k in keys:
            m = None if k in unsettled else next(got)
            try:
                if m is None:
                    v = None
                else:
                    with self.transport.slot(k):
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
        parts = self.transport.call(self.client.execute_command, "MGET", *pkeys)
        if any(p is None for p in parts):
            now = self.transport.call(self.client.getrange, self._manifest_key(key), 0,
                                      HEADER_BYTES - 1)
            cur = _Header.parse(now) if now else None
            if cur is not None and cur.ver != h.ver:
                return _RETRY
            if cur is not None:  # Redis evicted a part (maxmemory): an eviction, not damage
                log.info("redis entry %r lost a part to eviction; dropped", key)
                self.counters.add("evictions")
                self._drop(key, h)
            return None
        value = b"".join([first, *parts])
        if len(value) != h.total:
            self._drop_damaged(key, h, "parts do not add up to the manifest's length")
            return None
        return value

    def _drop_damaged(self, key: bytes, h: _Header | None, why: str) -> None:
        log.warning("redis entry %r is damaged (%s); dropped", key, why)
        self.counters.add("corrupt")
        self._drop(key, h)

    def _drop(self, key: bytes, h: _Header | None) -> None:
        """Delete the entry's manifest (if still version ``h``) and expire its parts."""
        ver = h.ver if h is not None else b""
        old = self.transport.script(self._delete, [self._manifest_key(key)],
                                    [HEADER_BYTES, ver])
        self._expire_parts(key, old, 0)

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """The keys starting with ``prefix``; in a cluster, those of the masters that answer
        (a master known not to answer is skipped at once, one found now after its timeout)."""
        pattern = self.prefix + b"{" + _glob_escape(prefix) + b"*}:m"
        start = len(self.prefix) + 1
        found = self.transport.scan(pattern)
        return iter(sorted(k[start:-3] for k in found))

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None) -> None:
        self._fits(len(value))
        self._settled([key])
        with self.transport.slot(key, write=True):
            self._put(key, value, ttl_s)

    def _fits(self, size: int) -> None:
        """``TooLarge`` for an entry larger than the byte budget (per master in a cluster):
        Redis would evict its own parts before the commit."""
        if self.capacity_bytes and size > self.capacity_bytes:
            raise TooLarge(f"redis: the entry's {size} bytes exceed the Redis tier's byte budget "
                           f"(redis_bytes {self.capacity_bytes})")

    def _put(self, key: bytes, value: bytes, ttl_s: float | None) -> None:
        total = len(value)
        n = max(1, -(-total // self.part_bytes))
        h = _Header(os.urandom(8), n, total, self.part_bytes)
        view = memoryview(value)
        pkeys = self._part_keys(key, h)
        manifest = h.pack() + view[:self.part_bytes]
        ttl_ms = _ttl_ms(ttl_s)
        try:
            if pkeys:
                def parts(pipe: Any) -> None:
                    for i, pk in enumerate(pkeys, start=1):
                        pipe.set(pk, view[i * self.part_bytes:(i + 1) * self.part_bytes],
                                 ex=PENDING_TTL_S + ttl_ms // 1000)
                self.transport.keyed(key, parts)
            if self.wait_replicas:
                old = self._commit_replicated(key, h, [self._manifest_key(key), *pkeys],
                                              [manifest, ttl_ms, HEADER_BYTES])
            else:
                old = self.transport.script(self._commit, [self._manifest_key(key), *pkeys],
                                            [manifest, ttl_ms, HEADER_BYTES])
        except KDNError as exc:
            if pkeys and _answered(exc):
                self._withdraw_parts(key, h)
            elif not _answered(exc):  # the commit may be in Redis's socket, run when it runs
                with self._unsure_lock:
                    self._unsure[key] = h
            if "KDNPART" in str(exc.__cause__ or ""):  # evicted by the writes that followed
                raise TooLarge(f"redis: a part of the entry's {total} bytes was evicted before "
                               "its commit: Redis has no room for it beside what it holds (its "
                               "maxmemory, redis_bytes"
                               f"{f' {self.capacity_bytes}' if self.capacity_bytes else ''})"
                               ) from exc
            raise
        if old is not None and _same_version(old, h):
            return  # a commit sent again after a lost reply replaced itself: nothing to drop
        self._expire_parts(key, old, GRACE_S)

    def _settle(self, keys: list[bytes] | None = None) -> dict[bytes, KDNError]:
        """Withdraw the unanswered commits (``_unsure``) of ``keys`` (None: all): each entry
        deleted where it is still that version, its parts unlinked. Each is tried on its own:
        one whose master still does not answer stays (for the next try) and does not stop the
        others' (in a cluster, those of the masters that answer). Returns, by key, the error
        of each left."""
        if not self._unsure:
            return {}
        wanted = None if keys is None else set(keys)
        with self._unsure_lock:
            todo = [(k, h) for k, h in self._unsure.items() if wanted is None or k in wanted]
        left: dict[bytes, KDNError] = {}
        for k, h in todo:
            try:
                with self.transport.slot(k, write=True):
                    self.transport.script(self._delete, [self._manifest_key(k)],
                                          [HEADER_BYTES, h.ver])
            except KDNError as exc:
                left[k] = exc
                continue
            self._withdraw_parts(k, h)
            with self._unsure_lock:
                if self._unsure.get(k) is h:
                    del self._unsure[k]
        return left

    def _settled(self, keys: list[bytes]) -> None:
        """``_settle`` of ``keys``, raising the error of the first left (its master still does
        not answer): a write or read of it waits until its unanswered commit is withdrawn."""
        for exc in self._settle(keys).values():
            raise exc

    def _withdraw_parts(self, key: bytes, h: _Header) -> None:
        """Unlink the parts of version ``h`` of a write that failed where Redis answered (out
        of memory, a part evicted, a slot moving), rather than leave them holding memory for
        ``PENDING_TTL_S``; with ``noeviction`` they would refuse the next writes meanwhile.
        Best effort: what is not unlinked still expires by itself."""
        try:
            self._expire_parts(key, h.pack(), 0)
        except KDNError as exc:
            log.debug("redis: the parts of a failed write of %r stay until they expire: %s",
                      key, exc)

    def _commit_replicated(self, key: bytes, h: _Header, keys: list[bytes], args: list[Any]
                           ) -> bytes | None:
        """Commit, then WAIT for ``wait_replicas`` replicas, on one connection to the key's
        master (WAIT covers that connection's writes, and with them everything the master
        replicated before: the parts too). Too few replicas: the entry is withdrawn and the
        write fails (``ReplicasShort``), so that nothing unreplicated is acknowledged."""
        def build(pipe: Any) -> None:
            self._commit(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.wait_replicas, int(self.wait_timeout_s * 1000))

        # a failed call here (it bypasses the cluster client's retries) has _slot remember the
        # master, and the tier's watcher refresh the map to find a replica promoted in its place
        old, acked = self.transport.waited(keys[0], build)
        if int(acked) < self.wait_replicas:
            try:
                self.transport.script(self._delete, [keys[0]], [HEADER_BYTES, h.ver])
                self._expire_parts(key, h.pack(), 0)
                if old is not None and not _same_version(old, h):
                    self._expire_parts(key, old, GRACE_S)
            except KDNError:
                pass
            raise ReplicasShort(f"redis: the write reached {acked} of the {self.wait_replicas} "
                                f"replicas asked for within {self.wait_timeout_s:g} s; "
                                "withdrawn")
        return old  # type: ignore[no-any-return]

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, ttl_s: float | None = None) -> None:
        small: list[tuple[bytes, bytes]] = []
        items = list(items)
        for _, v in items:  # before any is written
            self._fits(len(v))
        for k, v in items:
            if len(v) > self.part_bytes or self.cluster or self.wait_replicas:
                self.put(k, v, ttl_s=ttl_s)
            else:
                small.append((k, v))
        if not small:
            return
        self._settled([k for k, _ in small])
        ttl_ms = _ttl_ms(ttl_s)
        pipe = self.client.pipeline(transaction=False)
        sent: dict[bytes, _Header] = {}
        for k, v in small:
            h = sent[k] = _Header(os.urandom(8), 1, len(v), self.part_bytes)
            self._commit(keys=[self._manifest_key(k)], args=[h.pack() + v, ttl_ms, HEADER_BYTES],
                         client=pipe)
        try:
            olds = self.transport.call(pipe.execute)
        except KDNError as exc:
            if not _answered(exc):  # as ``_put``'s commit
                with self._unsure_lock:
                    self._unsure.update(sent)
            raise
        for (k, _), old in zip(small, olds):
            self._expire_parts(k, old, GRACE_S)

    def _expire_parts(self, key: bytes, old_header: bytes | None, after_s: int) -> None:
        """Let the parts of a replaced or deleted version go (after ``after_s``, or now)."""
        h = _Header.parse(old_header) if old_header else None
        if h is None or h.parts == 1:
            return
        pkeys = self._part_keys(key, h)
        if after_s:
            self.transport.keyed(key, lambda pipe: [pipe.expire(pk, after_s) for pk in pkeys])
        else:
            self.transport.keyed(key, lambda pipe: [pipe.unlink(pk) for pk in pkeys])

    def delete(self, key: bytes) -> bool:
        with self.transport.slot(key):
            old = self.transport.script(self._delete, [self._manifest_key(key)],
                                        [HEADER_BYTES, ""])
            self._expire_parts(key, old, 0)
        return bool(old)

    # -- admin ----------------------------------------------------------------------------------

    def masters_down(self) -> list[str]:
        """The cluster masters (``host:port``) that do not answer, whose slots' keys fail now
        (empty for a standalone Redis, or while every master answers)."""
        return self.transport.masters_down()

    def parts_down(self) -> list[str]:
        """``masters_down``: a cluster's parts are its masters."""
        return self.masters_down()

    def healthy(self) -> bool:
        """Up while Redis answers; for a cluster, while any master does (``degraded`` says
        whether some do not: their slots' keys then miss, and writes there are refused). With
        a byte budget, a master that lacks it (down when the tier started, restarted, or
        promoted) gets it here. A standalone Redis that does not answer raises
        ``TierUnavailable`` naming its URL (no password) and why (refused, timed out, a name
        not found, a refused login or TLS), which the probe logs."""
        try:
            if isinstance(self.client, RedisCluster):
                ok, known = self.transport.primaries()
                self.degraded = 0 < ok < known
            else:
                ok = int(bool(self.client.ping()))
        except (*REDIS_ERRORS, OSError) as exc:
            if said(exc):  # a refused login or TLS: the probe's log says so
                raise wrap(exc) from exc
            if isinstance(self.client, RedisCluster):
                return False
            raise TierUnavailable(f"redis at {shown_url(self.urls[0])} does not answer: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if ok and self.capacity_bytes:
            self.transport.keep_budget()
        if ok:
            self._settle()  # those of masters that do not answer yet stay: the next probe
        return ok > 0

    def stats(self) -> TierStats:
        """What the masters that answer hold (``kdn.store.redis_stats``): entries, not Redis
        keys; the capacity is the byte budget times the masters."""
        c = self.counters
        entries, used, answered, known = held(self.client, self.transport.blocked, self.prefix)
        return TierStats(self.name, entries, used, self.capacity_bytes * known, c.hits,
                         c.misses, c.evictions, c.corrupt, answered > 0,
                         degraded=0 < answered < known)

    def close(self) -> None:
        self.transport.close()


def _ttl_ms(ttl_s: float | None) -> int:
    """An entry's time to live in ms as the commit takes it: 0 for none, and for one longer
    than ``MAX_TTL_S``; at least 1 ms for any other."""
    if not ttl_s or ttl_s > MAX_TTL_S:
        return 0
    return max(1, int(ttl_s * 1000))


def _answered(exc: KDNError) -> bool:
    """Whether Redis answered the call that raised ``exc`` (with a refusal, or with redirects
    until redis-py gave up), rather than not answering at all: then another call costs no
    socket timeout."""
    return isinstance(exc.__cause__, (redis.exceptions.ResponseError,
                                      redis.exceptions.ClusterError))


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
