"""One key's write or delete on one tier below the first: now, through the tier's write queue,
or dropped and counted, never leaving an older copy behind to be served.

Lifecycle: ``TieredStore`` builds one ``LowerWrites`` over its health marks
(``kdn.store.health``) and its per-tier write queues (``kdn.store.queue``), and calls it with
the key's stripe lock held (``kdn.store.locks``): a synchronous write or delete of a key, and the
queue's writer landing an older one, never interleave.

    write(tier, key, value, ...)   write now (``sync``) or queue; a ``required`` write raises
                                   when it can not be acknowledged there now; one the tier
                                   does not take is dropped (counted), or queued for a retry
                                   (``Fault.PARTLY``), its tier listed in ``refused`` (else
                                   ``clear_stale`` at once)
    delete(tier, key)              delete now, else queue the delete (a queued value is
                                   a pending delete meanwhile, hiding the tier's copy)
    clear_stale(tier, key)         a tier did not take the key's new value that another took:
                                   its older copy is deleted now where the tier answers, else a
                                   delete is queued (reads skip the tier's copy meanwhile); the
                                   caller asks once it knows some tier took the value (one no
                                   tier took leaves the previous value served)

A write that found the tier, or the key's part of it (``Fault.PARTLY``: a Redis Cluster master
that does not answer, a full disk), down is queued and retried until it lands
(``<tier>.write_retried``); one ``Fault.PARTLY`` kept out also has the tier's older copy deleted
(``clear_stale``, the queued value kept), as a kill or shutdown drops the queue, not that copy; a
full queue falls back to a synchronous write where the tier is up; what none of that lands is
dropped and counted (``<tier>.write_dropped``; a WARNING), and a delete that can not be queued
either is counted (``<tier>.delete_dropped``) and logged (an ERROR): each per tier at most every
``WARN_EVERY_S``, saying how many went unsaid since (one Delete of many keys was a line each).
A tier's error that is no kdn error (a bug's, in the tier or its client library) is a refusal
(``TierHealth.attempt``): a write-through copy it kept out is dropped, never raised after the
first tier took the value (readers would be served a value whose store failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from kdn.errors import KDNError, TierUnavailable, TooLarge
from kdn.ratelog import Throttle, unsaid
from kdn.store.base import Tier
from kdn.store.framed import Framed, contiguous
from kdn.store.health import WARN_EVERY_S, Fault, TierHealth, failure
from kdn.store.queue import PendingWrite, WriteQueue

log = logging.getLogger(__name__)


class LowerWrites:
    """Writes and deletes of one key on one lower tier (the module docstring)."""

    def __init__(self, health: TierHealth, queues: dict[str, WriteQueue],
                 count: Callable[[str], None]) -> None:
        self._health = health
        self._queues = queues
        self._count = count
        self._unsaid = Throttle(WARN_EVERY_S)  # kinds: (tier, what went unsaid)

    def write(self, tier: Tier, key: bytes, value: bytes | Framed, ttl: float | None,
              expiry: float, sync: bool, required: bool,
              refused: list[Tier] | None = None, acked: bool = False,
              errors: list[tuple[str, KDNError]] | None = None) -> bool:
        """Write to ``tier`` (caller holds the key's stripe); True if written now.

        A ``required`` write that fails raises (after marking the tier down if it is); the
        others fall back to the tier's queue, or are dropped (counted). A dropped one, or one
        queued for a retry as its part of the tier did not take it (the older copy there would
        outlive the queue), adds ``tier`` to ``refused`` for the caller to ``clear_stale`` once
        it knows another tier took the value (without a list, at once). A ``Framed`` value is
        joined first: lower tiers and their queues hold one buffer. ``acked``: the store is
        acknowledged should this tier refuse it for room (``TooLarge``), which its warning then
        says (``_acked_without``). ``errors``: a refusal (not the tier, or its part of it, down:
        those are retried) is added to it, with the tier's name, for the caller's error.
        """
        flat = contiguous(value)
        q = self._queues[tier.name]
        write = partial(tier.put, key, flat, ttl_s=ttl)
        if acked:
            write = partial(_acked_without, write, len(flat), tier.name)
        if errors is not None:
            write = partial(_noted, write, tier.name, errors)
        what = f"write of {key!r}"
        up = self._health.is_up(tier.name)
        if sync and up:
            fault = self._health.attempt(tier, write, what, reraise=required)
            if fault is Fault.PARTLY:  # the key's part of the tier is down: retried later
                if not q.retry_later(key, PendingWrite(flat, expiry), what):
                    self._dropped(tier, key, refused, full=True)
                elif refused is None:  # the retry dies with the process, the older copy not
                    self.clear_stale(tier, key, keep=flat)
                else:
                    refused.append(tier)
                return False
            if fault is Fault.FAILED:  # refused: no retry would take it
                self._dropped(tier, key, refused)
                return False
            if fault is not Fault.DOWN:
                q.discard(key)  # written: an older queued value must not land now
                return True
        elif required:
            raise TierUnavailable(f"the {tier.name} tier is down; can not acknowledge the entry "
                                  "there")
        if q.offer(key, PendingWrite(flat, expiry)):
            if not self._health.is_up(tier.name):
                self._count(f"{tier.name}.write_retried")
            return False
        if self._health.is_up(tier.name):
            self._count(f"{tier.name}.write_sync_fallback")
            if self._health.attempt(tier, write, what) is None:
                q.discard(key)
                return True
        self._dropped(tier, key, refused, full=True)
        return False

    def _dropped(self, tier: Tier, key: bytes, refused: list[Tier] | None,
                 full: bool = False) -> None:
        """``key``'s write to ``tier`` dropped (counted): refused (``TierHealth`` logged
        that), or the tier did not take it now and its queue is ``full`` (logged here, a
        WARNING per tier at most every ``WARN_EVERY_S``)."""
        self._count(f"{tier.name}.write_dropped")
        n = self._unsaid.admit((tier.name, "write")) if full else None
        if n is not None:
            log.warning("tier %s: the write of %r was dropped: the tier does not take it now "
                        "and its write queue is full%s", tier.name, key,
                        unsaid(n, "such writes", f"since the last such line, "
                               f"{tier.name}.write_dropped counts them"))
        if refused is None:
            self.clear_stale(tier, key)
        else:
            refused.append(tier)

    def clear_stale(self, tier: Tier, key: bytes, keep: object = None) -> None:
        """``tier`` did not take ``key``'s new value, which another tier took (refused it, or
        is down with its queue full; caller holds the stripe): the older copy it may hold must
        not be served later. Deleted now where the tier answers, else a delete is queued
        (``WriteQueue.mark_stale``: reads skip the tier's copy meanwhile). A write of this
        very ``keep`` value queued for a retry (``Fault.PARTLY``: a full disk) stays queued:
        a kill or a shutdown that drops it leaves the key absent there, not its older value;
        where the delete fails too, the queued value hides the older copy until it lands."""
        q = self._queues[tier.name]
        if self._health.is_up(tier.name):
            got = self._health.attempt(tier, partial(tier.delete, key),
                                       f"delete of the stale copy of {key!r}")
            if got not in (Fault.DOWN, Fault.PARTLY, Fault.FAILED):
                if not _queued(q, key, keep):
                    q.discard(key)
                return
        if _queued(q, key, keep):
            return
        if not q.mark_stale(key):
            self._stale_kept(tier, key)

    def delete(self, tier: Tier, key: bytes) -> bool:
        """Delete ``key`` from ``tier`` (caller holds its stripe), or queue the delete where
        the tier, or its part of it, does not answer; whether a value was there (or queued).
        A queued value becomes a pending delete first: reads skip the tier's older copy until
        it is gone (dropping the queued value first let them find that copy meanwhile)."""
        q = self._queues[tier.name]
        pending = q.peek(key)
        found = pending is not None and pending.value is not None
        if found:
            q.mark_stale(key)  # in place of a queued value: always taken
        if self._health.is_up(tier.name):
            what = f"delete of {key!r}"
            got = self._health.attempt(tier, partial(tier.delete, key), what)
            if got is Fault.PARTLY:  # the key's part of the tier is down
                if not q.retry_later(key, PendingWrite(None), what):
                    self._stale_kept(tier, key)
                return found
            if got is not Fault.DOWN and got is not Fault.FAILED:
                q.discard(key)  # deleted: nothing pending is left to land
                return bool(got) or found
        if not q.mark_stale(key):
            self._stale_kept(tier, key)
        return found

    def _stale_kept(self, tier: Tier, key: bytes) -> None:
        self._count(f"{tier.name}.delete_dropped")
        n = self._unsaid.admit((tier.name, "delete"))
        if n is None:
            return
        log.error("tier %s: the delete of %r could not be queued (the queue is full); the "
                  "tier may serve an older copy of it once it is back%s", tier.name, key,
                  unsaid(n, "such deletes", f"since the last such line, {tier.name}.delete_dropped "
                         "counts them"))


def _queued(q: WriteQueue, key: bytes, value: object) -> bool:
    """Whether ``q`` holds a write of this very ``value`` (not None) for ``key``."""
    item = q.peek(key)
    return value is not None and item is not None and item.value is value


def _noted(write: Callable[[], None], name: str, errors: list[tuple[str, KDNError]]) -> None:
    """``write()``, its refusal added to ``errors`` (``LowerWrites.write``)."""
    try:
        write()
    except TierUnavailable:
        raise
    except Exception as exc:  # one that is no kdn error (a bug's) is a refusal too (``failure``)
        errors.append((name, failure(name, exc)))
        raise


def _acked_without(write: Callable[[], None], size: int, name: str) -> None:
    """``write()``, its refusal for room (larger than the tier's budget, or its room held by
    pinned entries) saying that the store is acknowledged without it (a write-through DEFAULT
    store a durable tier refused: kept as a MEMORY store is)."""
    try:
        write()
    except TooLarge as exc:
        raise TooLarge(f"{exc}; the write-through store ({size} bytes) is acknowledged "
                       f"without the {name} tier's copy, kept as a MEMORY store is: a restart "
                       "loses it") from None
