"""The hierarchy: the one place that owns promotion, demotion, eviction policy and write policy.

Lifecycle: ``TieredStore(tiers, ...)`` is built once by the server from config (``tiers`` in
read order, RAM first); RPC handlers call ``get``/``put``/``lookup``/``delete`` from worker
threads; ``close`` runs once at graceful shutdown, after in-flight RPCs finish: it flushes every
write-behind queue (bounded by ``flush_timeout_s``), then closes the tiers.

Reads go through the tiers in order. Every value about to be returned is checked with
``verify``: one that fails is removed from that tier, counted (``corrupt``) and treated as a
miss there, so another tier's good copy is served instead, and a damaged value never is. A hit
below the first tier is promoted: into the first tier (RAM) at once, into other tiers above it
through their write queues, keeping the entry's remaining TTL.

Writes always go to the first tier, then to each lower tier either synchronously or through
that tier's write queue (one bounded queue and one writer thread per lower tier, holding the
newest pending value per key; pending values are served by reads, so a queued entry is never
invisible). Which lower tiers are written synchronously:

    write-through  every lower tier, unless the request asks for MEMORY durability
    write-behind   none, except the tier the request's durability names
    durability     DISK: the disk tier; SHARED: the redis tier; the call fails (nothing is
                   acknowledged) when that tier is missing, down or refuses the entry

A full queue falls back to a synchronous write. A write (or delete) for a tier that is down is
queued and retried by the writer thread once the tier is back, or dropped with a counter
(``<tier>.write_dropped``) when the queue is full: clients are never held for a down tier.

Availability: a tier that raises ``TierUnavailable`` is marked down and skipped by reads and
writes until a probe thread (``healthy()`` every ``probe_interval_s``) sees it answer again.
``degraded`` is true while any tier is down.

Eviction: tiers evict on their own budget (RAM: LRU; disk: approximate LRU) but skip keys
for which ``protected`` (wired here to the pin set) answers true. RAM evictions are demoted to
the first lower tier that does not hold the entry (through its queue) when ``demote`` is set.
Pins live in this process's memory.

Key-level ordering: synchronous lower-tier writes, deletes and queue flushes of one key hold
that key's stripe lock, so an older queued value never lands over a newer one.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kdn.errors import Corrupt, InvalidArgument, KDNError, TierUnavailable, Unavailable
from kdn.store.base import Tier, TierStats
from kdn.store.ram import RamTier

log = logging.getLogger(__name__)
_STRIPES = 64


class WritePolicy(enum.StrEnum):
    """When lower tiers are written for a request with DEFAULT durability."""

    WRITE_THROUGH = "write-through"
    WRITE_BEHIND = "write-behind"


class Durability(enum.IntEnum):
    """Where an entry must be before ``put`` returns; the values mirror ``kdn.v1.Durability``."""

    DEFAULT = 0
    MEMORY = 1
    DISK = 2
    SHARED = 3


_DURABLE_TIER = {Durability.DISK: "disk", Durability.SHARED: "redis"}


@dataclass(frozen=True)
class Hit:
    value: bytes
    tier: str


@dataclass(frozen=True)
class Presence:
    present: bool
    tier: str = ""
    size: int = 0


@dataclass(frozen=True)
class _Item:
    """A pending write: ``value`` None is a pending delete; ``expiry`` monotonic, 0 = none."""

    value: bytes | None
    expiry: float = 0.0

    def expired(self, now: float) -> bool:
        return bool(self.expiry) and self.expiry <= now

    def ttl(self, now: float) -> float | None:
        return max(0.001, self.expiry - now) if self.expiry else None

    @property
    def nbytes(self) -> int:
        return len(self.value) if self.value is not None else 0


class _WriteQueue:
    """Pending writes for one lower tier: newest item per key, FIFO, bounded, one writer thread."""

    def __init__(self, store: TieredStore, tier: Tier, max_entries: int, max_bytes: int) -> None:
        self.store = store
        self.tier = tier
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pending: OrderedDict[bytes, _Item] = OrderedDict()
        self.bytes = 0
        self.cond = threading.Condition()
        self.closing = False
        self.deadline = 0.0
        self.thread = threading.Thread(target=self._run, name=f"kdn-write-{tier.name}",
                                       daemon=True)
        self.thread.start()

    def peek(self, key: bytes) -> _Item | None:
        with self.cond:
            return self.pending.get(key)

    def offer(self, key: bytes, item: _Item) -> bool:
        """Queue ``item`` for ``key`` (replacing an older one); False when the queue is full."""
        with self.cond:
            old = self.pending.get(key)
            if old is None and (len(self.pending) >= self.max_entries
                                or self.bytes + item.nbytes > self.max_bytes):
                return False
            if old is not None:
                self.bytes -= old.nbytes
            self.pending[key] = item
            self.bytes += item.nbytes
            self.cond.notify_all()
            return True

    def discard(self, key: bytes) -> _Item | None:
        with self.cond:
            item = self.pending.pop(key, None)
            if item is not None:
                self.bytes -= item.nbytes
                self.cond.notify_all()
            return item

    def _pop_if(self, key: bytes, item: _Item) -> None:
        with self.cond:
            if self.pending.get(key) is item:
                del self.pending[key]
                self.bytes -= item.nbytes
                self.cond.notify_all()

    def _next(self) -> bytes | None:
        """The oldest pending key once the tier is up; None when closed and drained."""
        with self.cond:
            while True:
                up = self.store.is_up(self.tier.name)
                if self.pending and up:
                    return next(iter(self.pending))
                if self.closing and (not self.pending or time.monotonic() >= self.deadline):
                    return None
                self.cond.wait(timeout=0.2)

    def _run(self) -> None:
        while (key := self._next()) is not None:
            with self.store.stripe(key):
                item = self.peek(key)
                if item is None:
                    continue
                if item.expired(time.monotonic()):
                    self._pop_if(key, item)
                    continue
                try:
                    if item.value is None:
                        self.tier.delete(key)
                    else:
                        self.tier.put(key, item.value, ttl_s=item.ttl(time.monotonic()))
                except TierUnavailable as exc:
                    self.store.mark_down(self.tier.name, exc)
                    self.store.count(f"{self.tier.name}.write_retried")
                    continue  # stays first in line; retried once the tier is up
                except KDNError as exc:
                    log.warning("queued write of %r to %s dropped: %s", key, self.tier.name, exc)
                    self.store.count(f"{self.tier.name}.write_dropped")
                self._pop_if(key, item)
        with self.cond:
            if self.pending:
                log.error("%d queued writes to %s dropped at shutdown (tier down)",
                          len(self.pending), self.tier.name)
                self.store.count(f"{self.tier.name}.write_dropped", len(self.pending))
                self.pending.clear()
                self.bytes = 0
            self.cond.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cond:
            while self.pending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(timeout=min(left, 0.2))
            return True

    def close(self, deadline: float) -> None:
        with self.cond:
            self.closing = True
            self.deadline = deadline
            self.cond.notify_all()


class TieredStore:
    def __init__(
        self,
        tiers: list[Tier],
        *,
        verify: Callable[[bytes], None] | None = None,
        demote: bool = True,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        queue_entries: int = 1024,
        queue_bytes: int = 256 << 20,
        default_ttl_s: float = 0.0,
        probe_interval_s: float = 1.0,
        flush_timeout_s: float = 10.0,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        self.tiers = tiers
        self.verify = verify
        self.write_policy = WritePolicy(write_policy)
        self.default_ttl_s = default_ttl_s
        self.probe_interval_s = probe_interval_s
        self.flush_timeout_s = flush_timeout_s
        self._by_name = {t.name: t for t in tiers}
        self._pins: set[bytes] = set()
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._up = {t.name: True for t in tiers}
        self.counters: dict[str, int] = {}
        self._closing = False
        for tier in tiers:
            tier.protected = self.is_pinned
            if isinstance(tier, RamTier) and demote:
                tier.on_evict = self._demote_from(tier)
        self._queues = {t.name: _WriteQueue(self, t, queue_entries, queue_bytes)
                        for t in tiers[1:]}
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._probe_loop, name="kdn-tier-probe",
                                         daemon=True)
        self._monitor.start()

    # -- bookkeeping ----------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    @property
    def corrupt_found(self) -> int:
        return self.counters.get("corrupt", 0)

    def stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[xxhash.xxh64_intdigest(key) % _STRIPES]

    # -- availability ---------------------------------------------------------------------------

    def is_up(self, name: str) -> bool:
        return self._up[name]

    def mark_down(self, name: str, exc: BaseException | str | None = None) -> None:
        if self._up[name]:
            self._up[name] = False
            self.count(f"{name}.down")
            log.warning("tier %s is down (%s); serving from the others", name, exc)

    def _mark_up(self, name: str) -> None:
        if not self._up[name]:
            self._up[name] = True
            log.info("tier %s is back", name)
            q = self._queues.get(name)
            if q is not None:
                with q.cond:
                    q.cond.notify_all()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            self.probe()

    def probe(self) -> None:
        """Ask every tier whether it answers and update the up/down marks."""
        for tier in self.tiers:
            try:
                ok = tier.healthy()
            except KDNError:
                ok = False
            if ok:
                self._mark_up(tier.name)
            else:
                self.mark_down(tier.name, "health probe failed")

    def health(self) -> dict[str, bool]:
        return dict(self._up)

    @property
    def degraded(self) -> bool:
        return not all(self._up.values())

    @property
    def local_ok(self) -> bool:
        """Whether every tier on this machine (all but the shared ones) is up."""
        return all(up for t, up in zip(self.tiers, self._up.values()) if not t.remote)

    # -- pins -----------------------------------------------------------------------------------

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pin(self, key: bytes) -> None:
        with self._lock:
            self._pins.add(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._pins.discard(key)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Hit | None:
        for i, tier in enumerate(self.tiers):
            q = self._queues.get(tier.name)
            item = q.peek(key) if q is not None else None
            if item is not None:
                if item.value is None:
                    continue  # a delete is pending: what the tier holds is stale
                now = time.monotonic()
                if item.expired(now) or not self._verified(tier, key, item.value, queued=True):
                    continue
                self._promote(i, key, item.value, item.ttl(now))
                return Hit(item.value, tier.name)
            if not self._up[tier.name]:
                continue
            try:
                value = tier.get(key)
            except TierUnavailable as exc:
                self.mark_down(tier.name, exc)
                continue
            except KDNError as exc:
                log.warning("tier %s failed on get: %s", tier.name, exc)
                continue
            if value is None or not self._verified(tier, key, value):
                continue
            if i > 0:
                ttl = self._try(tier, tier.ttl_remaining, key)
                self._promote(i, key, value, ttl if isinstance(ttl, float) else None)
            return Hit(value, tier.name)
        return None

    def _verified(self, tier: Tier, key: bytes, value: bytes, queued: bool = False) -> bool:
        if self.verify is None:
            return True
        try:
            self.verify(value)
            return True
        except Corrupt as exc:
            log.error("corrupt entry %r in tier %s removed: %s", key, tier.name, exc)
            tier.counters.add("corrupt")
            self.count("corrupt")
            if queued:
                q = self._queues[tier.name]
                with self.stripe(key):
                    item = q.peek(key)
                    if item is not None and item.value is value:
                        q.discard(key)
            else:
                self._try(tier, tier.delete, key)
            return False

    def _promote(self, i: int, key: bytes, value: bytes, ttl: float | None) -> None:
        if i == 0:
            return
        self.count("promotions")
        head = self.tiers[0]
        self._try(head, head.put, key, value, ttl_s=ttl)
        expiry = time.monotonic() + ttl if ttl else 0.0
        for upper in self.tiers[1:i]:
            if self._up[upper.name]:
                self._queues[upper.name].offer(key, _Item(value, expiry))

    def lookup(self, keys: list[bytes]) -> list[Presence]:
        out = [Presence(False)] * len(keys)
        todo = list(range(len(keys)))
        now = time.monotonic()
        for tier in self.tiers:
            if not todo:
                break
            q = self._queues.get(tier.name)
            ask = []
            for i in todo:
                item = q.peek(keys[i]) if q is not None else None
                if item is None:
                    ask.append(i)
                elif item.value is not None and not item.expired(now):
                    out[i] = Presence(True, tier.name, len(item.value))
            sizes: list[int | None] = [None] * len(ask)
            if ask and self._up[tier.name]:
                got = self._try(tier, tier.size_many, [keys[i] for i in ask])
                if isinstance(got, list):
                    sizes = got
            todo = [i for i in todo if not out[i].present]
            for i, size in zip(ask, sizes):
                if size is not None:
                    out[i] = Presence(True, tier.name, size)
            todo = [i for i in todo if not out[i].present]
        return out

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None, pin: bool = False,
            durability: Durability = Durability.DEFAULT) -> str:
        """Store ``value``; return the name of the first tier that holds it.

        Returns once the entry is where ``durability`` (or, for DEFAULT, the write policy)
        asks; raises when that can not be done (nothing is then acknowledged).
        """
        if self._closing:
            raise Unavailable("the store is shutting down")
        durability = Durability(durability)
        required = _DURABLE_TIER.get(durability)
        if required is not None and required not in self._by_name:
            raise InvalidArgument(f"durability {durability.name} needs a {required} tier; "
                                  "this server has none")
        ttl = ttl_s or self.default_ttl_s or None
        expiry = time.monotonic() + ttl if ttl else 0.0
        if pin:
            self.pin(key)
        head = self.tiers[0]
        first, errors = "", []
        try:
            head.put(key, value, ttl_s=ttl)
            first = head.name
        except KDNError as exc:
            errors.append(f"{head.name}: {exc}")
        sync_all = not first or (self.write_policy is WritePolicy.WRITE_THROUGH
                                 and durability is not Durability.MEMORY)
        with self.stripe(key):
            for tier in self.tiers[1:]:
                took = self._write_lower(tier, key, value, ttl, expiry,
                                         sync_all or tier.name == required,
                                         tier.name == required)
                if took and not first:
                    first = tier.name
        if not first:
            raise KDNError("no tier accepted the entry: " + "; ".join(errors))
        return first

    def _write_lower(self, tier: Tier, key: bytes, value: bytes, ttl: float | None,
                     expiry: float, sync: bool, required: bool) -> bool:
        """Write to one lower tier (caller holds the key's stripe); True if written now."""
        q = self._queues[tier.name]
        if sync and self._up[tier.name]:
            try:
                tier.put(key, value, ttl_s=ttl)
                q.discard(key)
                return True
            except TierUnavailable as exc:
                self.mark_down(tier.name, exc)
                if required:
                    raise
            except KDNError as exc:
                if required:
                    raise
                log.warning("write of %r to %s failed: %s", key, tier.name, exc)
                self.count(f"{tier.name}.write_failed")
                q.discard(key)  # an older queued value must not land after this one failed
                return False
        elif required:
            raise TierUnavailable(f"the {tier.name} tier is down; can not acknowledge the entry "
                                  "there")
        if q.offer(key, _Item(value, expiry)):
            if not self._up[tier.name]:
                self.count(f"{tier.name}.write_retried")
            return False
        if self._up[tier.name]:
            self.count(f"{tier.name}.write_sync_fallback")
            try:
                tier.put(key, value, ttl_s=ttl)
                q.discard(key)
                return True
            except TierUnavailable as exc:
                self.mark_down(tier.name, exc)
            except KDNError as exc:
                log.warning("write of %r to %s failed: %s", key, tier.name, exc)
        self.count(f"{tier.name}.write_dropped")
        q.discard(key)
        return False

    def delete(self, key: bytes) -> bool:
        self.unpin(key)
        head = self.tiers[0]
        found = bool(self._try(head, head.delete, key))
        with self.stripe(key):
            for tier in self.tiers[1:]:
                q = self._queues[tier.name]
                pending = q.discard(key)
                found = found or (pending is not None and pending.value is not None)
                if self._up[tier.name]:
                    try:
                        found = bool(tier.delete(key)) or found
                        continue
                    except TierUnavailable as exc:
                        self.mark_down(tier.name, exc)
                    except KDNError as exc:
                        log.warning("delete of %r in %s failed: %s", key, tier.name, exc)
                        continue
                if not q.offer(key, _Item(None)):
                    self.count(f"{tier.name}.delete_dropped")
        return found

    def _demote_from(self, tier: Tier) -> Callable[[bytes, bytes, float | None], None]:
        below = self.tiers[self.tiers.index(tier) + 1:]

        def demote(key: bytes, value: bytes, ttl: float | None) -> None:
            expiry = time.monotonic() + ttl if ttl else 0.0
            with self.stripe(key):
                for lower in below:
                    if not self._up[lower.name]:
                        continue
                    q = self._queues[lower.name]
                    item = q.peek(key)
                    if item is not None:
                        if item.value is None:
                            return  # deleted meanwhile
                        return  # already on its way down
                    if self._try(lower, lower.contains, key) is True:
                        return
                    self.count("demotions")
                    if self._write_lower(lower, key, value, ttl, expiry, False, False) \
                            or q.peek(key) is not None:
                        return

        return demote

    def _try(self, tier: Tier, fn: Callable[..., object], *args: object,
             **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except TierUnavailable as exc:
            self.mark_down(tier.name, exc)
        except KDNError as exc:
            log.warning("tier %s: %s failed: %s", tier.name, getattr(fn, "__name__", fn), exc)
        return None

    # -- admin ----------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queue is empty; False if that took longer than ``timeout``."""
        end = time.monotonic() + (self.flush_timeout_s if timeout is None else timeout)
        return all(q.wait_empty(max(0.0, end - time.monotonic()))
                   for q in self._queues.values())

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        """Sorted keys starting with ``prefix`` held by any reachable tier (admin listing)."""
        found: set[bytes] = set()
        for t in self.tiers:
            if self._up[t.name]:
                got = self._try(t, lambda t=t: list(t.keys(prefix)))
                found.update(got if isinstance(got, list) else ())
        return sorted(found)

    def where(self, key: bytes) -> list[Tier]:
        """The reachable tiers holding ``key``, in read order (no promotion, no stats)."""
        return [t for t in self.tiers if self._up[t.name] and self._try(t, t.contains, key)]

    def queue_depth(self) -> dict[str, int]:
        return {name: len(q.pending) for name, q in self._queues.items()}

    def stats(self) -> list[TierStats]:
        out = []
        for t in self.tiers:
            st: TierStats | None = None
            if self._up[t.name]:
                got = self._try(t, t.stats)
                st = got if isinstance(got, TierStats) else None
            if st is None:
                c = t.counters
                st = TierStats(t.name, 0, 0, 0, c.hits, c.misses, c.evictions, c.corrupt, False)
            out.append(dataclasses.replace(st, healthy=st.healthy and self._up[t.name]))
        return out

    def close(self) -> None:
        """Flush the write queues, stop the probe, close the tiers.

        Queued writes for a tier that is up are all written; those for a tier still down
        ``flush_timeout_s`` after close began are dropped and counted.
        """
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + self.flush_timeout_s
        for q in self._queues.values():
            q.close(deadline)
        for q in self._queues.values():
            # A writer drains everything while its tier is up (a large backlog is written in
            # full); it gives up only on a tier that stays down past the deadline.
            q.thread.join()
        self._stop.set()
        self._monitor.join(timeout=5)
        for tier in self.tiers:
            self._try(tier, tier.close)
