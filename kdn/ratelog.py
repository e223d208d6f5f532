"""Rate-limited log lines: a failure repeated on every call (a server down, a tier refusing
writes) is one line, then at most one per interval, naming how many went unsaid since.

A ``Throttle`` is shared by the lines of one owner (a tier's health, an engine, a connector);
``admit(kind)`` says whether a line of that kind (any hashable: a tier's name and an error's
type) is due now, and how many of its kind were kept back since the last line; the caller
logs the ones kept back at DEBUG, or not at all. ``unsaid(n)`` words that count for a message.
``Outage`` is the common case of a peer that stops answering: its failures so throttled, and
one INFO line when it answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

EVERY_S = 60.0
"""The default interval: a kind is logged at most this often."""


class Throttle:
    """At most one line of each kind every ``every_s`` seconds; thread-safe."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._kinds: dict[Hashable, tuple[float, int]] = {}  # kind: (next line's time, unsaid)

    def admit(self, kind: Hashable) -> int | None:
        """None where a line of ``kind`` was logged less than ``every_s`` ago (this one is
        counted as unsaid); else the number of that kind that went unsaid since that line."""
        now = time.monotonic()
        with self._lock:
            until, unsaid = self._kinds.get(kind, (0.0, 0))
            if now < until:
                self._kinds[kind] = (until, unsaid + 1)
                return None
            self._kinds[kind] = (now + self.every_s, 0)
            return unsaid

    def clear(self) -> int | None:
        """End every kind's run (the failures are over: the next line of each is logged at
        once); how many went unsaid since their last lines, None where none was logged."""
        with self._lock:
            got, self._kinds = self._kinds, {}
        return sum(n for _, n in got.values()) if got else None


def unsaid(n: int, what: str = "such failures", since: str = "since the last warning") -> str:
    """`` (N more such failures since the last warning)``, or '' where ``n`` is 0."""
    return f" ({n} more {what} {since})" if n else ""


class Outage:
    """Calls to a peer that does not answer (a server down): the first failure a WARNING, then
    one at most every ``every_s`` naming how many went unsaid (the others at DEBUG); the first
    call answered after them one INFO line, ``back``. Failures of several kinds (a lookup's, a
    store's) are throttled apart. Thread-safe."""

    def __init__(self, log: logging.Logger, back: str, every_s: float = EVERY_S) -> None:
        self.log, self.back = log, back
        self._throttle = Throttle(every_s)

    def failed(self, msg: str, *args: object, kind: Hashable = "",
               exc_info: BaseException | bool | None = None) -> None:
        """One more failed call of ``kind``: ``msg % args`` logged, as a WARNING (with
        ``exc_info``) where one is due, else at DEBUG."""
        n = self._throttle.admit(kind)
        if n is None:
            self.log.debug(msg, *args)
        else:
            self.log.warning(msg + "%s", *args, unsaid(n, "such failures"), exc_info=exc_info)

    def answered(self) -> None:
        """A call answered: where calls failed before it, ``back`` is logged at INFO."""
        n = self._throttle.clear()
        if n is not None:
            self.log.info("%s%s", self.back, unsaid(n, "such failures"))
