"""The write queue of one lower tier: pending writes and deletes, and the thread that lands them.

Lifecycle: the hierarchy (``kdn.store.tiered.TieredStore``) builds one ``WriteQueue`` per tier
below the first; the queue's writer thread starts at once. Request threads ``offer`` pending
writes (write-behind, promotion, demotion, writes and deletes for a tier that is down),
``retry_later`` the synchronous writes and deletes that part of the tier did not take (a
write-through copy whose Redis Cluster master is dead), ``peek`` at them (reads serve a pending
value, so a queued entry is never invisible) and ``discard`` them (a newer synchronous write or
a delete makes them stale). The hierarchy calls ``wake`` when the tier comes back up,
``wait_empty`` to flush, and at shutdown ``close`` with a deadline, then ``join``.

The queue holds the newest pending item per key, oldest key first, bounded by ``max_entries``
and ``max_bytes``; ``offer`` answers False when an item does not fit: a new key, a write in
place of a pending delete (deletes alone may pass ``max_entries``), or a larger value (the
hierarchy then writes synchronously or drops the write with a counter, queueing a delete in
its place: ``mark_stale``). The writer lands items while the tier is up, each under its key's
stripe lock (the same lock the hierarchy's synchronous writes of that key hold, so an older
queued value never lands over a newer one). A write that finds the tier down stays first in line
(``<tier>.write_retried``) and is retried once the tier is back; one that finds its part of the
tier down (``Fault.PARTLY``) is retried after a backoff (``RETRY_S`` doubling up to
``RETRY_MAX_S``; ``<tier>.write_retried``, a WARNING at most every ``WARN_EVERY_S``) while the
keys behind it land; one the tier refuses otherwise is dropped (``<tier>.write_dropped``) and a
delete of the key queued in its place, so the tier's older copy is never served after the newer
value was acknowledged (a delete the tier refuses is dropped as ``<tier>.delete_dropped``). A
write whose time to live passes while queued is replaced by a delete, for the same reason.
After ``close`` the writer drains everything while the tier is up (a write waiting out its
backoff is tried again until the deadline); what is left at the deadline for a tier, or a part
of it, still down is dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kdn.store.base import Tier
from kdn.store.health import Count, Fault, TierHealth

log = logging.getLogger(__name__)

RETRY_S = 0.25
"""A write that part of the tier did not take is tried again this long after, then after twice
as long each time, up to ``RETRY_MAX_S`` (a Redis Cluster master known dead fails it at once)."""
RETRY_MAX_S = 2.0
STALE_ENTRIES = 1 << 18
"""Keys a queue may hold while deletes of stale copies pass ``max_entries`` (a delete holds a
key only: ~200 bytes each)."""
WARN_EVERY_S = 10.0
"""At most one WARNING line per queue this often about writes queued for a retry."""


@dataclass(frozen=True)
class PendingWrite:
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


class WriteQueue:
    """Pending writes for one lower tier: newest item per key, FIFO, bounded, one writer thread."""

    def __init__(self, tier: Tier, health: TierHealth, *,
                 stripe: Callable[[bytes], threading.Lock], count: Count, max_entries: int,
                 max_bytes: int) -> None:
        self.tier = tier
        self.health = health
        self.stripe = stripe
        self.count = count
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pending: OrderedDict[bytes, PendingWrite] = OrderedDict()
        self.later: dict[bytes, tuple[float, float]] = {}
        """Keys waiting out a retry's backoff: key -> (monotonic time due, backoff)."""
        self.bytes = 0
        self._warned_at = 0.0
        self._unwarned: set[bytes] = set()  # keys retried since the last warning
        self.cond = threading.Condition()
        self.closing = False
        self.deadline = 0.0
        self.thread = threading.Thread(target=self._run, name=f"kdn-write-{tier.name}",
                                       daemon=True)
        self.thread.start()

    def __len__(self) -> int:
        return len(self.pending)

    def peek(self, key: bytes) -> PendingWrite | None:
        with self.cond:
            return self.pending.get(key)

    def offer(self, key: bytes, item: PendingWrite) -> bool:
        """Queue ``item`` for ``key`` (replacing an older one); False when the queue is full:
        it would hold more than ``max_bytes``, or a write would take a place past
        ``max_entries`` (a new key, or one whose pending delete, ``mark_stale``, may sit past
        it: only deletes go there)."""
        with self.cond:
            old = self.pending.get(key)
            held = old.nbytes if old is not None else 0
            takes_place = old is None or old.value is None and item.value is not None
            if takes_place and len(self.pending) >= self.max_entries \
                    or self.bytes - held + item.nbytes > self.max_bytes:
                return False
            if old is not None:
                self.bytes -= held
            self.pending[key] = item
            self.bytes += item.nbytes
            self.cond.notify_all()
            return True

    def mark_stale(self, key: bytes) -> bool:
        """Queue a delete of ``key`` (replacing what was pending): the tier holds a copy
        older than the key's value, which it did not take (refused, or down with the queue
        full). A delete holds no value, so it may pass ``max_entries``, up to
        ``STALE_ENTRIES`` (or twice ``max_entries``); False past it (the stale copy may then
        be served once the tier is back)."""
        with self.cond:
            old = self.pending.pop(key, None)
            if old is None and len(self.pending) >= max(STALE_ENTRIES, 2 * self.max_entries):
                return False
            if old is not None:
                self.bytes -= old.nbytes
            self.later.pop(key, None)
            self.pending[key] = PendingWrite(None)
            self.cond.notify_all()
            return True

    def retry_later(self, key: bytes, item: PendingWrite, what: str) -> bool:
        """Queue ``item``, a write (or delete) of ``key`` that part of the tier did not take
        just now, to be tried again after ``RETRY_S`` (counted as ``<tier>.write_retried``);
        False when the queue is full."""
        if not self.offer(key, item):
            return False
        with self.cond:
            if key in self.pending:
                self.later[key] = (time.monotonic() + RETRY_S, RETRY_S)
        self._retried(key, what)
        return True

    def _defer(self, key: bytes, what: str) -> None:
        """The writer's try of ``key`` found its part of the tier down: try again after twice
        the last backoff, behind the keys queued since."""
        with self.cond:
            if key in self.pending:
                backoff = min(RETRY_MAX_S, 2 * self.later.get(key, (0.0, RETRY_S / 2))[1])
                self.later[key] = (time.monotonic() + backoff, backoff)
                self.pending.move_to_end(key)
        self._retried(key, what)

    def _retried(self, key: bytes, what: str) -> None:
        """``key``'s write was not taken: counted (each try), and a WARNING at most every
        ``WARN_EVERY_S`` naming how many keys (not tries) went so since the last."""
        self.count(f"{self.tier.name}.write_retried", 1)
        now = time.monotonic()
        with self.cond:
            self._unwarned.add(key)
            if now - self._warned_at < WARN_EVERY_S and self._warned_at:
                return
            n, self._warned_at = len(self._unwarned), now
            self._unwarned = set()
        log.warning("tier %s: %d write(s) not taken by a part of the tier that does not take "
                    "writes now (the last: %s: %s); queued, retried until they land (%d queued "
                    "now; with the queue full, further writes are dropped: %s.write_dropped)",
                    self.tier.name, n, what, self.health.refused.get(self.tier.name, "no answer"),
                    len(self.pending), self.tier.name)

    def discard(self, key: bytes) -> PendingWrite | None:
        with self.cond:
            item = self.pending.pop(key, None)
            self.later.pop(key, None)
            if item is not None:
                self.bytes -= item.nbytes
                self.cond.notify_all()
            return item

    def withdraw(self, key: bytes, value: object) -> bool:
        """Discard ``key``'s pending write where it carries this very ``value`` (not a later
        write's); whether it did. For a value found damaged, or one no tier took."""
        item = self.peek(key)
        if item is None or item.value is not value:
            return False
        self._pop_if(key, item)
        return True

    def _pop_if(self, key: bytes, item: PendingWrite) -> None:
        with self.cond:
            if self.pending.get(key) is item:
                del self.pending[key]
                self.later.pop(key, None)
                self.bytes -= item.nbytes
                self.cond.notify_all()

    def _expire(self, key: bytes, item: PendingWrite) -> None:
        """Put a delete of ``key`` in place of ``item``, a write whose time to live passed
        while queued (where it is still pending: not replaced meanwhile)."""
        with self.cond:
            if self.pending.get(key) is item:
                self.pending[key] = PendingWrite(None)
                self.later.pop(key, None)
                self.bytes -= item.nbytes
                self.cond.notify_all()

    def wake(self) -> None:
        """Tell the writer the tier is back up."""
        with self.cond:
            self.cond.notify_all()

    def _next(self) -> bytes | None:
        """The oldest pending key not waiting out a backoff, once the tier is up; None when
        closed and drained (or, past the deadline, when only writes for a tier or a part of
        it that is down are left)."""
        with self.cond:
            while True:
                now = time.monotonic()
                late = self.closing and now >= self.deadline
                wait = 0.2
                if self.pending and self.health.is_up(self.tier.name):
                    for key in self.pending:
                        due, _ = self.later.get(key, (0.0, 0.0))
                        if not due or (due <= now and not late):
                            return key
                        wait = min(wait, due - now)
                if self.closing and (not self.pending or late):
                    return None
                self.cond.wait(timeout=max(wait, 0.001))

    def _land(self, key: bytes, item: PendingWrite) -> None:
        if item.value is None:
            self.tier.delete(key)
        else:
            self.tier.put(key, item.value, ttl_s=item.ttl(time.monotonic()))

    def _run(self) -> None:
        name = self.tier.name
        while (key := self._next()) is not None:
            with self.stripe(key):
                item = self.peek(key)
                if item is None:
                    continue
                if item.value is not None and item.expired(time.monotonic()):
                    self._expire(key, item)  # the tier's older copy must not come back
                    continue
                what = f"queued write of {key!r}"
                got = self.health.attempt(self.tier, partial(self._land, key, item), what)
                if got is Fault.DOWN:
                    self.count(f"{name}.write_retried", 1)
                    continue  # stays first in line; retried once the tier is up
                if got is Fault.PARTLY:
                    self._defer(key, what)  # its part of the tier is down: retried later
                    continue
                if got is Fault.FAILED:
                    if item.value is None:  # a delete refused: the older copy may be served
                        self.count(f"{name}.delete_dropped", 1)
                    else:  # refused: the older copy must go instead
                        self.count(f"{name}.write_dropped", 1)
                        self._pop_if(key, item)
                        self.mark_stale(key)
                        continue
                self._pop_if(key, item)
        with self.cond:
            if self.pending:
                log.error("%d queued writes to %s dropped at shutdown (the tier, or their "
                          "part of it, down)", len(self.pending), name)
                writes = sum(item.value is not None for item in self.pending.values())
                self.count(f"{name}.write_dropped", writes)
                self.count(f"{name}.delete_dropped", len(self.pending) - writes)
                self.pending.clear()
                self.later.clear()
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
        """Stop once drained, or at ``deadline`` (monotonic) while the tier is down."""
        with self.cond:
            self.closing = True
            self.deadline = deadline
            self.cond.notify_all()

    def join(self) -> None:
        self.thread.join()
