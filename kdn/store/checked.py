"""Which tier values were verified already, by the stamp of the write that stored them.

Lifecycle: ``TieredStore`` builds one ``CheckedStamps`` with ``held(tier, key)``, the stamp
the named tier holds for ``key`` now (0: none). Its reads ask ``checked`` before hashing a
value an ``in_process`` tier returned with a stamp (``Tier.get_stamped``), and ``remember`` the
stamp once the value passed ``verify``; a put whose caller checked the value remembers its
stamp at once. ``forget`` (``TieredStore.distrust``) makes the next read of a key hash its
values again. A stamp names one write's value, so a later write of the key (a new stamp) is
checked again.

The memo stays the size of what the tiers hold: once it has grown to twice its size after
the last sweep (and at least ``SWEEP_MIN`` stamps), ``remember`` sweeps out every stamp its
tier no longer holds (the value was evicted, deleted, expired or overwritten), so a server
that stores new keys for weeks keeps as many stamps as its RAM tier keeps entries, not one per
key it ever stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

SWEEP_MIN = 4096
"""Stamps below which the memo is never swept (a sweep asks the tier about each one)."""


class CheckedStamps:
    """(tier name, key) -> the stamp of the value of that key last verified in that tier."""

    def __init__(self, held: Callable[[str, bytes], int], sweep_min: int = SWEEP_MIN) -> None:
        self.held = held
        self.sweep_min = sweep_min
        self._stamps: dict[tuple[str, bytes], int] = {}
        self._sweep_at = sweep_min
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stamps)

    def stamp(self, tier: str, key: bytes) -> int | None:
        """The stamp remembered for ``key`` in ``tier``; None when there is none."""
        return self._stamps.get((tier, key))

    def remember(self, tier: str, key: bytes, stamp: int) -> None:
        """The value of ``key`` in ``tier`` that carries ``stamp`` passed ``verify``."""
        with self._lock:
            self._stamps[(tier, key)] = stamp
            if len(self._stamps) >= self._sweep_at:
                self._sweep()

    def _sweep(self) -> None:
        """Drop the stamps of values their tier no longer holds; the caller holds the lock."""
        gone = [tk for tk, s in self._stamps.items() if self.held(*tk) != s]
        for tk in gone:
            del self._stamps[tk]
        self._sweep_at = max(self.sweep_min, 2 * len(self._stamps))

    def forget(self, key: bytes, tiers: Iterable[str]) -> None:
        """Forget ``key``'s checked stamps in each of ``tiers``."""
        with self._lock:
            for tier in tiers:
                self._stamps.pop((tier, key), None)
