"""The write queue of one lower tier: pending writes and deletes, and the thread that lands them.

Lifecycle: the hierarchy (``kdn.store.tiered.TieredStore``) builds one ``WriteQueue`` per tier
below the first; the queue's writer thread starts at once. Request threads ``offer`` pending
writes (write-behind, promotion, demotion, writes and deletes for a tier that is down),
``peek`` at them (reads serve a pending value, so a queued entry is never invisible) and
``discard`` them (a newer synchronous write or a delete makes them stale). The hierarchy calls
``wake`` when the tier comes back up, ``wait_empty`` to flush, and at shutdown ``close`` with a
deadline, then ``join``.

The queue holds the newest pending item per key, oldest key first, bounded by ``max_entries``
and ``max_bytes``; ``offer`` answers False when a new key does not fit (the hierarchy then
writes synchronously or drops the write with a counter). The writer lands items while the tier
is up, each under its key's stripe lock (the same lock the hierarchy's synchronous writes of
that key hold, so an older queued value never lands over a newer one). A write that finds the
tier down stays first in line (``<tier>.write_retried``) and is retried once the tier is back;
one the tier refuses otherwise is dropped (``<tier>.write_dropped``). After ``close`` the writer
drains everything while the tier is up; what is left for a tier still down at the deadline is
dropped and counted.
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

    def __init__(self, tier: Tier, health: TierHealth, *, stripe: Callable[[bytes], threading.Lock],
                 count: Count, max_entries: int, max_bytes: int) -> None:
        self.tier = tier
        self.health = health
        self.stripe = stripe
        self.count = count
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pending: OrderedDict[bytes, PendingWrite] = OrderedDict()
        self.bytes = 0
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

    def discard(self, key: bytes) -> PendingWrite | None:
        with self.cond:
            item = self.pending.pop(key, None)
            if item is not None:
                self.bytes -= item.nbytes
                self.cond.notify_all()
            return item

    def _pop_if(self, key: bytes, item: PendingWrite) -> None:
        with self.cond:
            if self.pending.get(key) is item:
                del self.pending[key]
                self.bytes -= item.nbytes
                self.cond.notify_all()

    def wake(self) -> None:
        """Tell the writer the tier is back up."""
        with self.cond:
            self.cond.notify_all()

    def _next(self) -> bytes | None:
        """The oldest pending key once the tier is up; None when closed and drained."""
        with self.cond:
            while True:
                up = self.health.is_up(self.tier.name)
                if self.pending and up:
                    return next(iter(self.pending))
                if self.closing and (not self.pending or time.monotonic() >= self.deadline):
                    return None
                self.cond.wait(timeout=0.2)

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
                if item.expired(time.monotonic()):
                    self._pop_if(key, item)
                    continue
                got = self.health.attempt(self.tier, partial(self._land, key, item),
                                          f"queued write of {key!r}")
                if got is Fault.DOWN:
                    self.count(f"{name}.write_retried", 1)
                    continue  # stays first in line; retried once the tier is up
                if got is Fault.FAILED:
                    self.count(f"{name}.write_dropped", 1)
                self._pop_if(key, item)
        with self.cond:
            if self.pending:
                log.error("%d queued writes to %s dropped at shutdown (tier down)",
                          len(self.pending), name)
                self.count(f"{name}.write_dropped", len(self.pending))
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
        """Stop once drained, or at ``deadline`` (monotonic) while the tier is down."""
        with self.cond:
            self.closing = True
            self.deadline = deadline
            self.cond.notify_all()

    def join(self) -> None:
        self.thread.join()
