"""Tier availability: the up/down mark of every tier, the probe that lifts it, guarded tier calls.

Lifecycle: the hierarchy (``kdn.store.tiered.TieredStore``) builds one ``TierHealth`` over its
tiers, then its write queues, then calls ``start``; ``stop`` runs once at shutdown, after the
write queues have drained. Every tier starts up.

A tier that raises ``TierUnavailable`` is marked down (``mark_down``; counted as
``<tier>.down``) and skipped by reads and writes until the probe thread, which asks every tier
``healthy()`` each ``probe_interval_s``, sees it answer again; ``on_up(name)`` then tells the
hierarchy (which wakes that tier's write queue). A tier that stayed up but was not whole (a part
down: ``Tier.degraded`` or ``Tier.parts_down``, a Redis Cluster master) is told back the same
way at the first probe that finds it whole again. ``degraded`` is true while any tier is down;
``local_ok`` while every tier on this machine (all but the ``remote`` ones) is up. ``stats``
gives every tier's (``Tier.stats``), ``healthy`` only while it is marked up.

Calls into a tier go through ``attempt`` (or ``guard``, for callers to whom a failed call is a
miss): ``TierUnavailable`` marks the tier down, any other ``KDNError`` is logged (a WARNING for
the first of its kind on its tier each ``WARN_EVERY_S``, saying how many went unsaid since: a
Redis out of memory refuses every write, each a line), and so is an error that is no
``KDNError`` (a bug's, in the tier or its client library: an ERROR with its traceback), a
refusal of that call like the others (``refusal``; ``failure`` names it), and the caller
gets a ``Fault`` (or None) instead of an exception, so one failing tier never fails a request
that others can serve. ``PartlyUnavailable`` (a Redis Cluster slot whose master does not answer,
a write that too few replicas confirmed, a full disk) fails that call only (``Fault.PARTLY``: a
write is worth retrying), counted as ``<tier>.partly_unavailable``, its message kept in
``refused`` (the write queue's warning names it): the tier stays up for its other keys
(``Tier.degraded`` says it is not whole), and only the probe (no master answers at all) marks it
down. With ``reraise`` (a
write the client must see acknowledged) the tier is still marked down on ``TierUnavailable``,
and the error goes on to the caller (one that is no ``KDNError`` as the ``failure`` naming it).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from kdn import tracing
from kdn.errors import KDNError, PartlyUnavailable, TierUnavailable
from kdn.ratelog import Throttle, unsaid
from kdn.store.base import Tier, TierStats

log = logging.getLogger(__name__)
T = TypeVar("T")
Count = Callable[[str, int], None]
"""``count(name, n)``: add ``n`` to the hierarchy's counter ``name``."""
WARN_EVERY_S = 60.0
"""A tier's failed calls of one kind (its error's type) are a WARNING at most this often."""


class Fault(enum.Enum):
    """Why a call made through ``TierHealth.attempt`` returned no result."""

    DOWN = "down"  # the tier raised TierUnavailable and is now marked down
    PARTLY = "partly"  # PartlyUnavailable: this key's part of the tier does not answer now
    FAILED = "failed"  # the tier raised another error, which was logged


class TierHealth:
    """Up/down marks for a fixed list of tiers, and the thread that probes the down ones."""

    def __init__(self, tiers: list[Tier], *, count: Count,
                 on_up: Callable[[str], None]) -> None:
        self.tiers = tiers
        self._count = count
        self._on_up = on_up
        self._up = {t.name: True for t in tiers}
        self.refused: dict[str, str] = {}
        """tier -> the message of the latest ``PartlyUnavailable`` it raised (why a write was
        not taken: a disk full, a Redis cluster master that does not answer)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = Throttle(WARN_EVERY_S)  # kinds: (tier, error type)

    # -- marks ----------------------------------------------------------------------------------

    def is_up(self, name: str) -> bool:
        return self._up[name]

    def mark_down(self, name: str, exc: BaseException | str | None = None) -> None:
        if self._up[name]:
            self._up[name] = False
            self._count(f"{name}.down", 1)
            log.warning("tier %s is down (%s); serving from the others", name, exc)

    def mark_up(self, name: str) -> None:
        if not self._up[name]:
            self._up[name] = True
            log.info("tier %s is back", name)
            self._on_up(name)

    def marks(self) -> dict[str, bool]:
        """A copy of the marks: tier name -> up."""
        return dict(self._up)

    def stats(self) -> list[TierStats]:
        """Every tier's stats (its counters alone where it is down or did not answer),
        ``healthy`` only while it is marked up."""
        out = []
        for t in self.tiers:
            st = self.guard(t, t.stats, "stats") if self.is_up(t.name) else None
            if st is None:
                c = t.counters
                st = TierStats(t.name, 0, 0, 0, c.hits, c.misses, c.evictions, c.corrupt, False)
            out.append(dataclasses.replace(st, healthy=st.healthy and self.is_up(t.name)))
        return out

    @property
    def degraded(self) -> bool:
        return not all(self._up.values())

    @property
    def local_ok(self) -> bool:
        """Whether every tier on this machine (all but the remote ones) is up."""
        return all(self._up[t.name] for t in self.tiers if not t.remote)

    # -- probing --------------------------------------------------------------------------------

    def probe(self) -> None:
        """Ask every tier whether it answers and update the up/down marks."""
        for tier in self.tiers:
            why: KDNError | str = "health probe failed"
            parted = tier.degraded or bool(tier.parts_down())  # (found by calls since the last)
            try:
                ok = tier.healthy()
            except Exception as exc:  # its message says why (a Redis refusing kdn's login)
                ok, why = False, self.refusal(tier.name, "health probe", exc)
            if ok and parted and self._up[tier.name] \
                    and not (tier.degraded or tier.parts_down()):
                self._on_up(tier.name)  # whole again
            if ok:
                self.mark_up(tier.name)
            else:
                self.mark_down(tier.name, why)

    def start(self, interval_s: float) -> None:
        """Start the probe thread: ``probe`` every ``interval_s`` seconds until ``stop``."""
        self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                        name="kdn-tier-probe", daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.probe()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- guarded calls --------------------------------------------------------------------------

    def attempt(self, tier: Tier, fn: Callable[[], T], what: str, *,
                reraise: bool = False) -> T | Fault:
        """``fn()``, or the ``Fault`` that kept it from returning (see the module docstring)."""
        if tracing.enabled():  # a span per tier call, in the RPC's trace
            with tracing.span(f"kdn.tier.{tier.name}.{what.split()[0]}"):
                return self._attempt(tier, fn, what, reraise)
        return self._attempt(tier, fn, what, reraise)

    def _attempt(self, tier: Tier, fn: Callable[[], T], what: str, reraise: bool) -> T | Fault:
        try:
            return fn()
        except PartlyUnavailable as exc:  # this key's part of the tier: the rest serves on
            self._count(f"{tier.name}.partly_unavailable", 1)
            self.refused[tier.name] = str(exc)
            if reraise:
                raise
            log.debug("tier %s: %s: %s", tier.name, what, exc)
            return Fault.PARTLY
        except TierUnavailable as exc:
            self.mark_down(tier.name, exc)
            if reraise:
                raise
            return Fault.DOWN
        except KDNError as exc:
            if reraise:
                raise
            self._warn(tier.name, what, exc)
            return Fault.FAILED
        except Exception as exc:  # not a kdn error: a bug's, in the tier or its library
            failed = self.refusal(tier.name, what, exc)
            if reraise:
                raise failed from exc
            return Fault.FAILED

    def refusal(self, name: str, what: str, exc: Exception) -> KDNError:
        """``exc``, raised by tier ``name``'s ``what``, as the kdn error a caller counts as the
        tier's refusal: itself, or (an unexpected error, a bug's) one naming it, the error
        logged with its traceback (``_warn``)."""
        if isinstance(exc, KDNError):
            return exc
        self._warn(name, what, exc)
        return failure(name, exc)

    def _warn(self, name: str, what: str, exc: Exception) -> None:
        """A failed call logged: a WARNING (an ERROR with its traceback where ``exc`` is no
        kdn error) where it is the first of its kind (tier, error type) in ``WARN_EVERY_S``,
        naming how many such went unsaid since; else at DEBUG."""
        n = self._warned.admit((name, type(exc).__name__))
        if n is None:
            log.debug("tier %s: %s failed: %s", name, what, exc)
            return
        bug = not isinstance(exc, KDNError)
        log.log(logging.ERROR if bug else logging.WARNING, "tier %s: %s failed%s: %s%s", name,
                what, " unexpectedly (a bug)" if bug else "", exc,
                unsaid(n),
                exc_info=exc if bug else None)

    def guard(self, tier: Tier, fn: Callable[[], T], what: str) -> T | None:
        """``fn()``, or None when it failed (a miss, to the caller)."""
        got = self.attempt(tier, fn, what)
        return None if isinstance(got, Fault) else got


def failure(name: str, exc: Exception) -> KDNError:
    """``exc``, raised by tier ``name``, as a kdn error: itself, or one naming it (a bug's)."""
    if isinstance(exc, KDNError):
        return exc
    return KDNError(f"the {name} tier failed unexpectedly: {type(exc).__name__}: {exc}")
