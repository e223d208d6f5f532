"""Which tier values were verified already, by the stamp of the write that stored them.

Lifecycle: ``TieredStore`` builds one ``CheckedStamps``. Its reads ask ``checked`` before
hashing a value an ``in_process`` tier returned with a stamp (``Tier.get_stamped``), and
``remember`` the stamp once the value passed ``verify``; a put whose caller checked the value
remembers its stamp at once. ``forget`` (``TieredStore.distrust``) makes the next read of a key
hash its values again. A stamp names one write's value, so a later write of the key (a new
stamp) is checked again; stamps of values that are gone are only forgotten when the memo is
full (then all at once, and re-learnt).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

MAX_ENTRIES = 1 << 20
"""Stamps of checked values remembered at most (then forgotten at once and re-learnt)."""


class CheckedStamps:
    """(tier name, key) -> the stamp of the value of that key last verified in that tier."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._stamps: dict[tuple[str, bytes], int] = {}
        self._lock = threading.Lock()

    def stamp(self, tier: str, key: bytes) -> int | None:
        """The stamp remembered for ``key`` in ``tier``; None when there is none."""
        return self._stamps.get((tier, key))

    def remember(self, tier: str, key: bytes, stamp: int) -> None:
        """The value of ``key`` in ``tier`` that carries ``stamp`` passed ``verify``."""
        with self._lock:
            if len(self._stamps) >= self.max_entries:
                self._stamps.clear()
            self._stamps[(tier, key)] = stamp

    def forget(self, key: bytes, tiers: Iterable[str]) -> None:
        """Forget ``key``'s checked stamps in each of ``tiers``."""
        with self._lock:
            for tier in tiers:
                self._stamps.pop((tier, key), None)
