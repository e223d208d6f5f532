"""Which Redis Cluster masters the Redis tier's transport (``kdn.store.redis_transport``) holds
back: those that do not answer (their slots' calls fail at once) and those whose ``WAIT`` came
back short of replicas (writes to their slots are refused). The transport marks them from the
outcome of its calls, and its watcher clears the marks when a master answers again, has its
replicas again, or is no longer a master."""

from __future__ import annotations

import logging
import threading
import time

from kdn.errors import PartlyUnavailable

log = logging.getLogger(__name__)

__all__ = ["Masters", "ReplicasShort"]


class ReplicasShort(PartlyUnavailable):
    """A write the master took but too few replicas confirmed (``WAIT``); it was withdrawn. Part
    of the tier (that master's slots; all of a standalone Redis) takes no write that must be
    confirmed, the rest serves on."""


class Masters:
    """Which cluster masters (by node name, ``host:port``) do not answer, or answer but lack the
    replicas WAIT asks for: the gate every keyed call passes (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # name -> since when it does not answer
        self._short: dict[str, float] = {}  # name -> since when WAIT came back short

    def check(self, name: str, *, write: bool) -> None:
        """Raise at once when ``name`` does not answer, or (for a write) lacks replicas."""
        if name in self._down:
            raise PartlyUnavailable(f"redis: the cluster master {name} of this key's slot does "
                                    "not answer")
        if write and name in self._short:
            raise ReplicasShort(f"redis: the cluster master {name} of this key's slot lacks the "
                                "replicas to confirm a write")

    def blocked(self, name: str) -> bool:
        """Whether a read of ``name``'s slots fails at once now."""
        return name in self._down

    def mark_down(self, name: str) -> bool:
        """Remember that ``name`` does not answer; True when that is news."""
        with self._lock:
            if name in self._down:
                return False
            self._down[name] = time.monotonic()
        log.warning("redis cluster master %s does not answer: its slots' keys fail, the other "
                    "masters' slots serve on", name)
        return True

    def mark_short(self, name: str) -> bool:
        with self._lock:
            if name in self._short:
                return False
            self._short[name] = time.monotonic()
        log.warning("redis cluster master %s lacks the replicas WAIT asks for: writes to its "
                    "slots are refused", name)
        return True

    def answered(self, name: str) -> None:
        with self._lock:
            back = self._down.pop(name, None) is not None
        if back:
            log.info("redis cluster master %s answers again", name)

    def confirmed(self, name: str) -> None:
        """``name`` has the replicas WAIT asks for (again)."""
        with self._lock:
            back = self._short.pop(name, None) is not None
        if back:
            log.info("redis cluster master %s has its replicas again", name)

    def down(self) -> list[str]:
        with self._lock:
            return sorted(self._down)

    def short(self) -> list[str]:
        with self._lock:
            return sorted(self._short)

    def keep(self, names: set[str]) -> None:
        """Forget the nodes that are no longer masters (a replica took over; the old master
        came back as its replica)."""
        with self._lock:
            for d in (self._down, self._short):
                for name in [n for n in d if n not in names]:
                    del d[name]
