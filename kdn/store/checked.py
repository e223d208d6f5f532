"""Which tier values were verified already, by the stamp of the write that stored them.

Lifecycle: ``TieredStore`` builds one ``CheckedStamps`` with ``held(tier, key)``, the stamp
the named tier holds for ``key`` now (0: none). Its reads ask ``checked`` before hashing a
value an ``in_process`` tier returned with a stamp (``Tier.get_stamped``), and ``remember`` the
stamp once the value passed ``verify``; a put whose caller checked the value remembers its
stamp at once. ``forget`` (``TieredStore.distrust``) makes the next read of a key hash its
values again. A stamp names one write's value, so a later write of the key (a new stamp) is
checked again.

The memo stays the size of what the tiers hold: past ``KEEP`` stamps, each ``remember`` also
looks at the ``LOOK`` stamps remembered longest ago and drops those their tier no longer holds
(the value was evicted, deleted, expired or overwritten), putting the others last in line. So
a server that stores new keys for weeks keeps about as many stamps as its RAM tier keeps
entries, not one per key it ever stored, at a constant cost per call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

KEEP = 1024
"""Stamps kept without looking whether their values are still held."""
LOOK = 2
"""Oldest stamps each ``remember`` looks at past ``KEEP`` (more than the one it adds, so the
stamps of values gone are dropped faster than new ones come)."""


class CheckedStamps:
    """(tier name, key) -> the stamp of the value of that key last verified in that tier."""

    def __init__(self, held: Callable[[str, bytes], int]) -> None:
        self.held = held
        self._stamps: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # oldest first
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
            self._stamps.move_to_end((tier, key))
            for _ in range(LOOK if len(self._stamps) > KEEP else 0):
                oldest, was = self._stamps.popitem(last=False)
                if self.held(*oldest) == was:
                    self._stamps[oldest] = was  # still its tier's value: last in line

    def forget(self, key: bytes, tiers: Iterable[str]) -> None:
        """Forget ``key``'s checked stamps in each of ``tiers``."""
        with self._lock:
            for tier in tiers:
                self._stamps.pop((tier, key), None)
