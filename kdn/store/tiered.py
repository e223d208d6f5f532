"""The hierarchy: the one place that owns promotion, demotion, eviction policy and write policy.

Lifecycle: ``TieredStore(tiers, ...)`` is built once by the server from config (``tiers`` in
read order, RAM first). It builds the tiers' health marks (``kdn.store.health``), one write
queue per lower tier (``kdn.store.queue``), then starts the health probe. RPC handlers call
``get``/``put``/``lookup``/``delete`` from worker threads; ``close`` runs once at graceful
shutdown, after in-flight RPCs finish: it flushes every write queue (bounded by
``flush_timeout_s``), stops the probe, then closes the tiers.

Reads go through the tiers in order, skipping tiers that are down. Every value about to be
returned is checked with ``verify``: one that fails is removed from that tier, counted
(``corrupt``) and treated as a miss there, so another tier's good copy is served instead, and a
damaged value never is. A tier whose values live in this process and can not change in place
(``Tier.in_process``; RAM: immutable bytes) stamps every write (``Tier.get_stamped``); a value is
checked on its first read and its later reads are not hashed again, until a write gives the key
a new stamp (``kdn.store.checked`` remembers the stamps checked). A value still in a tier's
write queue is served as if the tier held it (a pending delete hides what the tier holds).
A hit below the first tier is promoted: into the first tier (RAM) at once, with the write
time of the copy it came from (``Tier.written_at``), into other tiers above it through their
write queues, keeping the entry's remaining TTL (one that expired since its read is a miss
there, never promoted with no TTL), unless the key was written or deleted since the read began
or a put of it is under way (its generation, ``kdn.store.locks``): an older value never lands
over an acknowledged one.

Writes always go to the first tier, then to each lower tier either synchronously or through
that tier's write queue. Which lower tiers are written synchronously:

    write-through  every lower tier, unless the request asks for MEMORY durability
    write-behind   none, except the tier the request's durability needs and those read before
                   it (their older copies would be served first after a crash), and for a
                   pinned entry no tier that keeps pins took yet, those that do (Redis does not)
    durability     DISK: a ``durable`` tier; SHARED: a ``remote`` one (``Tier.satisfies``); the
                   call fails (nothing is acknowledged) when that tier is missing, down or
                   refuses the entry

A full queue falls back to a synchronous write. A write (or delete) for a tier that is down is
queued and retried by the queue's writer once the tier is back, or dropped with a counter
(``<tier>.write_dropped``) when the queue is full: clients are never held for a down tier. So is
a synchronous write (or delete) that found the key's part of the tier down (``Fault.PARTLY``: a
Redis Cluster master that does not answer): queued and retried with a backoff until it lands
(``<tier>.write_retried``), or dropped and counted when the queue is full. A write the tier
refuses otherwise (too large, out of memory; or fails with no kdn error, a bug's: logged with
its traceback) is dropped and counted too, never raised once the first tier took it; a
write-through DEFAULT store a durable tier refuses for room (larger than its budget, or its room
held by pinned entries) is so acknowledged without it, kept as a MEMORY store is, and the
tier's warning names its size and says so. A tier that did not take a write keeps no older copy to
serve later: it is deleted there at once, or a delete is queued in the write's place (reads
skip the tier's copy meanwhile).

Eviction: tiers evict on their own budget (RAM: LRU; disk: approximate LRU) but skip keys
for which ``protected`` (wired here to the pin set) answers true, their time to live left;
Redis evicts as its server chooses (``Tier.keeps_pins``), so a store of a pinned key that only
such tiers took is refused (``TooLarge``) and their copies deleted.
Evictions from a tier that ``reports_evictions`` are demoted to the first lower tier that does
not hold the entry (through its queue) when ``demote`` is set, unless the key was written or
deleted since (its generation, handed to ``on_evict``). Pins live in this process's memory and
outlive no entry: a store without ``pin`` of a key no tier holds drops its pin, as gc does.

Key-level ordering: synchronous lower-tier writes, deletes and queue flushes of one key hold
that key's stripe lock (``kdn.store.locks``), so an older queued value never lands over a newer
one. How one key's write or delete reaches one lower tier (now, queued, dropped, its older copy
deleted) is ``kdn.store.lower``.

The first tier's abilities are asked through the tier contract, never by its class: an
``in_process`` head is asked directly (``presence``, ``get_in_memory``, ``memory_stamp``), and a
``takes_framed`` head that is the only tier keeps a ``Framed`` value as it came.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from kdn.errors import Corrupt, InvalidArgument, KDNError, TierUnavailable, TooLarge, Unavailable
from kdn.names import parse_store_key
from kdn.options import Durability
from kdn.store.base import EvictHook, Tier, TierStats
from kdn.store.checked import CheckedStamps
from kdn.store.framed import Framed
from kdn.store.health import Fault, TierHealth
from kdn.store.hits import FramedHit, Hit, Presence, WritePolicy, held_by, lookup
from kdn.store.locks import KeyLocks
from kdn.store.lower import LowerWrites
from kdn.store.queue import PendingWrite, WriteQueue

__all__ = ["Durability", "FramedHit", "Hit", "Presence", "TieredStore", "WritePolicy"]

log = logging.getLogger(__name__)

# The tier a durability needs, as an error names it where there is none (``Tier.satisfies``).
_NEEDED_TIER = {Durability.DISK: "disk", Durability.SHARED: "redis"}


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
        self._pins: set[bytes] = set()
        self._checked = CheckedStamps(self._held_stamp)
        self._lock = threading.Lock()
        self._locks = KeyLocks()
        self.counters: dict[str, int] = {}
        self._closing = False
        self.on_back: list[Callable[[str], object]] = []  # told the name of a tier back up
        self._health = TierHealth(tiers, count=self.count, on_up=self._tier_back)
        for tier in tiers:
            tier.protected = self.is_pinned
            tier.generation = self._locks.generation
            tier.on_event = partial(self._tier_event, tier.name)
            if demote and tier.reports_evictions:
                tier.on_evict = self._demote_from(tier)
        self._queues = {t.name: WriteQueue(t, self._health, stripe=self.stripe, count=self.count,
                                           max_entries=queue_entries, max_bytes=queue_bytes)
                        for t in tiers[1:]}
        self._lower = LowerWrites(self._health, self._queues, self.count)
        self._health.start(probe_interval_s)

    # -- bookkeeping ----------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def _tier_event(self, tier: str, name: str, n: int) -> None:
        self.count(f"{tier}.{name}", n)

    def stripe(self, key: bytes) -> threading.Lock:
        """The store's own lock of ``key`` (``kdn.store.locks``)."""
        return self._locks.stripe(key)

    def entry_lock(self, key: bytes) -> threading.Lock:
        """The callers' lock of ``key`` (``kdn.store.locks``; the servicers hold it across look
        up, quota charge and put or delete). The store never takes it: it is the outer lock."""
        return self._locks.entry_lock(key)

    @contextmanager
    def all_entries_locked(self) -> Iterator[None]:
        """Every entry lock, taken in one order: no caller changes an entry meanwhile (for a
        recount of usage from the tiers)."""
        with self._locks.all_entries_locked():
            yield

    # -- availability (kept by ``TierHealth``) --------------------------------------------------

    def is_up(self, name: str) -> bool:
        return self._health.is_up(name)

    def mark_down(self, name: str, exc: BaseException | str | None = None) -> None:
        self._health.mark_down(name, exc)

    def probe(self) -> None:
        """Ask every tier whether it answers and update the up/down marks."""
        self._health.probe()

    def health(self) -> dict[str, bool]:
        return self._health.marks()

    @property
    def degraded(self) -> bool:
        return self._health.degraded

    @property
    def local_ok(self) -> bool:
        """Whether every tier on this machine (all but the shared ones) is up."""
        return self._health.local_ok

    def _tier_back(self, name: str) -> None:
        for hook in self.on_back:  # on the probe's thread, the tier marked up
            hook(name)
        q = self._queues.get(name)
        if q is not None:
            q.wake()

    # -- pins -----------------------------------------------------------------------------------

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pin(self, key: bytes) -> None:
        with self._lock:
            self._pins.add(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._pins.discard(key)

    def pinned(self) -> list[bytes]:
        with self._lock:
            return list(self._pins)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Hit | None:
        guard = self._health.guard
        seen = self._locks.generation(key)  # a write after this: the hit is not promoted
        for i, tier in enumerate(self.tiers):
            q = self._queues.get(tier.name)
            item = q.peek(key) if q is not None else None
            if item is not None:
                if item.value is None:
                    continue  # a delete is pending: what the tier holds is stale
                now = time.monotonic()
                if item.expired(now) or not self._verified(tier, key, item.value, queued=True):
                    continue
                self._promote(i, key, item.value, item.ttl(now), seen, time.time())
                return Hit(item.value, tier.name)
            if not self.is_up(tier.name):
                continue
            got = guard(tier, partial(tier.get_stamped, key), "get")
            if got is None:
                continue
            value, stamp = got
            if not (stamp and self._checked.stamp(tier.name, key) == stamp):
                if not self._verified(tier, key, value):
                    continue
                if stamp:  # this very value was checked: its later reads are not re-hashed
                    self._checked.remember(tier.name, key, stamp)
            if i > 0:
                ttl = self._health.attempt(tier, partial(tier.ttl_remaining, key),
                                           "ttl_remaining")
                if isinstance(ttl, Fault):  # its time to live unknown: served, not promoted
                    self.count("promotions_skipped")
                elif ttl is not None and ttl <= 0:
                    continue  # expired since the read (a miss there), never kept for ever
                else:  # kept with the age of its copy there (None: not known)
                    at = guard(tier, partial(tier.written_at, key), "written_at")
                    self._promote(i, key, value, ttl, seen, at)
            return Hit(value, tier.name, stamp)
        return None

    @property
    def memory_only(self) -> bool:
        """Whether the only tier is one in this process (``Tier.in_process``: RAM): a put then
        does no I/O and never waits on another tier (cheap enough for an event loop's
        thread)."""
        return len(self.tiers) == 1 and self.tiers[0].in_process

    def get_in_memory(self, key: bytes, framed: bool = False) -> Hit | FramedHit | None:
        """``get``'s answer where the first tier holds ``key`` in this process's memory
        (``Tier.in_process``: RAM) and that very value was verified already: a dict lookup,
        no I/O and no hashing, cheap enough for an event loop's thread (handing a small
        entry's ``get`` to a worker thread and back costs more than the read). None
        otherwise: ask ``get`` (on a worker thread). ``framed``: a value held as the frames
        it arrived in comes as they are (a ``FramedHit``), else it is joined (once)."""
        tier = self.tiers[0] if self.tiers else None
        if tier is None or not tier.in_process:
            return None
        q, checked = self._queues.get(tier.name), self._checked.stamp(tier.name, key)
        if not checked or tier.stamp(key, expiring=True) != checked or \
                q is not None and q.peek(key) is not None:  # probes count no hit: ``get`` does
            return None
        got = tier.get_stamped(key, framed=framed)
        if got is None or got[1] != checked:
            return None
        if isinstance(got[0], Framed):
            return FramedHit(got[0], tier.name, got[1])
        return Hit(got[0], tier.name, got[1])

    def memory_stamp(self, key: bytes, *, expiring: bool = False, value: object = None) -> int:
        """The first tier's stamp of ``key``'s value (``Hit.stamp``) where that tier is
        ``in_process`` (RAM); 0 where it is not or holds none, a write to it is queued, (unless
        ``expiring``) the value has a time to live, or (given ``value``) the tier holds another
        object."""
        tier = self.tiers[0] if self.tiers else None
        if tier is None or not tier.in_process:
            return 0
        q = self._queues.get(tier.name)
        if q is not None and q.peek(key) is not None:
            return 0
        return tier.stamp(key, expiring=expiring, value=value)

    def _held_stamp(self, tier: str, key: bytes) -> int:
        """The stamp of the value ``tier`` holds for ``key`` now (0: none; ``CheckedStamps``)."""
        return next((t.stamp(key, expiring=True) for t in self.tiers if t.name == tier), 0)

    def distrust(self, key: bytes) -> None:
        """Forget that ``key``'s values were checked: its next read hashes them again (and a
        copy that fails is removed from its tier). For readers that found damage later."""
        self._checked.forget(key, [tier.name for tier in self.tiers])

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
                with self.stripe(key):
                    self._queues[tier.name].withdraw(key, value)
            else:  # unless a write replaced it meanwhile (that value is not the damaged one)
                with self.stripe(key):
                    now = self._health.guard(tier, partial(tier.get, key), "get")
                    if now is not None and (now is value or now == value):
                        self._health.guard(tier, partial(tier.delete, key), "delete")
            return False

    def _promote(self, i: int, key: bytes, value: bytes, ttl: float | None, seen: int,
                 at: float | None) -> None:
        """Copy a hit in tier ``i`` into the tiers above it, unless ``key`` was written or
        deleted since its read began (``seen``: its generation then): an older value never
        lands over a newer one that was acknowledged meanwhile. The first tier keeps ``at``,
        when the copy was written (None: not known), as the entry's write time."""
        if i == 0:
            return
        head = self.tiers[0]
        expiry = time.monotonic() + ttl if ttl else 0.0

        def still() -> bool:  # puts count themselves (under the stripe) before any tier
            return self._locks.settled(key, seen)  # and after the last, deletes before

        put = partial(head.put_while, key, value, still, ttl_s=ttl, written_at=at)
        if head.reports_evictions:  # asked and put under the tier's own lock
            done = self._health.guard(head, put, "put")
        else:
            with self.stripe(key):
                done = self._health.guard(head, put, "put")
        with self.stripe(key):
            if not (done and still()):
                self.count("promotions_skipped")
                return
            self.count("promotions")
            for upper in self.tiers[1:i]:
                if self.is_up(upper.name):
                    self._queues[upper.name].offer(key, PendingWrite(value, expiry))

    def lookup(self, keys: list[bytes]) -> list[Presence]:
        return lookup(keys, self.tiers, self._queues, self._health)

    def presence(self, key: bytes) -> Presence:
        """``lookup`` of one key, an ``in_process`` first tier (RAM) asked directly first (what
        a put replaces)."""
        tiers = self.tiers
        head = tiers[0] if tiers else None
        if head is not None and head.in_process and head.name not in self._queues \
                and self.is_up(head.name):
            size = head.size_of(key)
            if size is not None:
                return Presence(True, head.name, size)
            tiers = tiers[1:]
        return lookup([key], tiers, self._queues, self._health)[0]

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None,
            pin: bool = False, durability: Durability = Durability.DEFAULT,
            verified: bool = False) -> str:
        """Store ``value``; return the name of the first tier that holds it.

        Returns once the entry is where ``durability`` (or, for DEFAULT, the write policy)
        asks; raises when that can not be done (nothing is then acknowledged). ``verified``:
        the caller checked ``value`` as ``verify`` would (a Store stream, frame by frame), so
        the RAM tier's copy is not hashed again on its first read (``get_in_memory`` answers
        it at once).
        """
        if self._closing:
            raise Unavailable("the store is shutting down")
        durability = Durability(durability)
        # The first tier that meets the durability; for DEFAULT and MEMORY that is the first
        # tier, so no lower tier is required.
        required = next((t for t in self.tiers if t.satisfies(durability)), None)
        if required is None:
            raise InvalidArgument(f"durability {durability.name} needs a "
                                  f"{_NEEDED_TIER[durability]} tier; this server has none")
        ttl = ttl_s or self.default_ttl_s or None
        if isinstance(value, Framed) and (len(self.tiers) > 1
                                          or not self.tiers[0].takes_framed):
            value = value.joined()
        was_pinned = self.is_pinned(key)
        if was_pinned and not pin and not self.presence(key).present:
            self.unpin(key)  # its entry expired (or left): a new one is not pinned by it
            was_pinned = False
        if pin:
            self.pin(key)
        try:
            with self._locks.writing(key):  # no read in flight promotes an older value now
                tier = self._put(key, value, ttl, required, durability, pin or was_pinned)
        except BaseException:
            if pin and not was_pinned:
                self.unpin(key)
            raise
        head = self.tiers[0]
        if verified and head.in_process:
            stamp = head.stamp_if(key, value)  # 0 where another put came in between
            if stamp:
                self._checked.remember(head.name, key, stamp)
        return tier

    def _put(self, key: bytes, value: bytes | Framed, ttl: float | None, required: Tier,
             durability: Durability, pinned: bool) -> str:
        """``put`` after its checks. A refused write leaves no trace: the tier that must
        acknowledge is written first (a refusal there raises before any other tier has the
        value), and when every tier refuses, the copies queued for tiers that are down are
        withdrawn (``TierUnavailable`` names them: one may take it once back). A previous value
        stays served, except where a tier that refused the new value held the old one while
        another took the new: that tier drops its stale copy (``LowerWrites.clear_stale``).
        A ``pinned`` entry only tiers that do not keep pins took (``Tier.keeps_pins``: Redis)
        is refused, their copies deleted: it would be evicted there, pinned or not."""
        expiry = time.monotonic() + ttl if ttl else 0.0
        head = self.tiers[0]
        first, errors = "", []  # errors: each tier's refusal, in read order
        refused: list[Tier] = []  # tiers that did not take it: stale, once another did
        holders: list[Tier] = []  # and those that took it now
        if required is not head:
            with self.stripe(key):
                self._lower.write(required, key, value, ttl, expiry, True, True)
            first = required.name
            holders.append(required)
        try:
            head.put(key, value, ttl_s=ttl)  # type: ignore[arg-type]  # Framed: takes_framed
            first = head.name
            holders.append(head)
        except Exception as exc:  # refused (an error that is no kdn error, a bug's, logged)
            errors.append((head.name, self._health.refusal(head.name, f"write of {key!r}", exc)))
            refused.append(head)
        sync_all = not first or (self.write_policy is WritePolicy.WRITE_THROUGH
                                 and durability is not Durability.MEMORY)
        before = self.tiers.index(required)  # the tiers read before it: written now too
        with self.stripe(key):
            for i, tier in enumerate(self.tiers[1:], 1):
                if tier is required and first:
                    continue  # written first, above
                acked = first == head.name and durability is Durability.DEFAULT \
                    and tier.durable and self.write_policy is WritePolicy.WRITE_THROUGH
                kept = pinned and tier.keeps_pins and not any(t.keeps_pins for t in holders)
                took = self._lower.write(tier, key, value, ttl, expiry, sync_all or i < before
                                         or kept, False, refused, acked, errors)
                if took:
                    first = first or tier.name
                    holders.append(tier)
            evicting = [] if not pinned or any(t.keeps_pins for t in holders) else holders
            for tier in evicting:  # a pin they would not keep: the entry is refused
                if tier is head:
                    self._health.guard(head, partial(head.delete, key), "delete")
                else:
                    self._lower.clear_stale(tier, key)
            first = "" if evicting else first
            for tier in refused if first else ():  # their older copies: never served again
                if tier is head:
                    self._health.guard(head, partial(head.delete, key), "delete")
                else:
                    self._lower.clear_stale(tier, key, keep=value)
            # Refused everywhere: withdraw what was queued for later (a tier, or the key's
            # part of it, that does not answer now) and fail as UNAVAILABLE, naming those (for
            # a pinned entry only those that keep pins: the others were never written now).
            down = [] if first else [t.name for t in self.tiers[1:] if (self._queues[
                t.name].withdraw(key, value) or not self.is_up(t.name))
                and (t.keeps_pins or not evicting)]
        why = "; ".join(f"{name}: {exc}" for name, exc in errors)
        if down:
            raise TierUnavailable(f"no tier accepted the entry ({why}); the "
                                  f"{' and '.join(down)} tier does not answer now")
        if evicting:
            raise TooLarge(f"no tier that keeps pinned entries took the entry ({why}); the "
                           f"{' and '.join(t.name for t in evicting)} tier evicts under its "
                           "own memory budget, pinned or not: store it unpinned, or raise "
                           "the RAM or disk tier's byte budget")
        if not first:  # each lower tier refused it for good (a write no retry would take)
            if errors and all(isinstance(exc, TooLarge) for _, exc in errors):
                raise TooLarge(f"no tier accepted the entry: it is larger than each takes "
                               f"({why}); raise the tiers' byte budgets")
            raise KDNError(f"no tier accepted the entry: {why}")
        return first

    def delete(self, key: bytes) -> bool:
        self.unpin(key)
        head = self.tiers[0]
        with self.stripe(key):
            self._locks.written(key)  # a read in flight must not promote it back
        found = bool(self._health.guard(head, partial(head.delete, key), "delete"))
        with self.stripe(key):
            for tier in self.tiers[1:]:
                found = self._lower.delete(tier, key) or found
            # a read that began after the count above missed the head and may have found a
            # lower tier's copy before it went: its promotion (``_promote``, checked against
            # the count) is refused from here on, and one made already is deleted here
            self._locks.written(key)
            if len(self.tiers) > 1:
                self._health.guard(head, partial(head.delete, key), "delete")
        return found

    def _demote_from(self, tier: Tier) -> EvictHook:
        below = self.tiers[self.tiers.index(tier) + 1:]

        def demote(key: bytes, value: bytes | Framed, ttl: float | None, seen: int) -> None:
            expiry = time.monotonic() + ttl if ttl else 0.0
            with self.stripe(key):
                if self._locks.generation(key) != seen:
                    return  # written or deleted since its eviction: its value is not the key's
                for lower in below:
                    if not self.is_up(lower.name):
                        continue
                    q = self._queues[lower.name]
                    if q.peek(key) is not None:
                        return  # already on its way down, or deleted meanwhile
                    if self._health.guard(lower, partial(lower.contains, key), "contains"):
                        return
                    self.count("demotions")
                    if self._lower.write(lower, key, value, ttl, expiry, False, False) \
                            or q.peek(key) is not None:
                        return

        return demote

    # -- admin ----------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queue is empty; False if that took longer than ``timeout``."""
        end = time.monotonic() + (self.flush_timeout_s if timeout is None else timeout)
        return all(q.wait_empty(max(0.0, end - time.monotonic()))
                   for q in self._queues.values())

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        """Sorted keys starting with ``prefix`` held by any reachable tier (admin listing);
        a key no ``kdn.keys.store_key`` made (another program's, in a shared Redis) is not
        one of them."""

        def listed(tier: Tier) -> list[bytes]:
            return [k for k in tier.keys(prefix) if parse_store_key(k) is not None]

        found: set[bytes] = set()
        for t in self.tiers:
            if self.is_up(t.name):
                found.update(self._health.guard(t, partial(listed, t), "keys") or ())
        return sorted(found)

    def where(self, key: bytes, queued: bool = False) -> list[Tier]:
        """The reachable tiers holding ``key``, in read order (no promotion, no stats);
        ``queued``: and those whose write queue holds a live value of it (``held_by``)."""
        return held_by(key, self.tiers, self._queues, self._health, queued)

    def queue_depth(self) -> dict[str, int]:
        return {name: len(q) for name, q in self._queues.items()}

    def queue_bytes(self) -> dict[str, int]:
        """Bytes of the values each lower tier's write queue holds (at most its ``max_bytes``)."""
        return {name: q.bytes for name, q in self._queues.items()}

    def parts_down(self) -> dict[str, list[str]]:
        """For each tier that is up, the parts of it that do not answer now, if any (a Redis
        Cluster's masters, as ``host:port``; their keys miss and refuse SHARED stores)."""
        out: dict[str, list[str]] = {}
        for t in self.tiers:
            if self.is_up(t.name) and (names := t.parts_down()):
                out[t.name] = names
        return out

    def stats(self) -> list[TierStats]:
        return self._health.stats()

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
            q.join()
        self._health.stop()
        for tier in self.tiers:
            self._health.guard(tier, tier.close, "close")
