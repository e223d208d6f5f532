"""The hierarchy: the one place that owns promotion, demotion, eviction policy and write policy.

Lifecycle: ``TieredStore(tiers, verify=...)`` is built once by the server from config; RPC
handlers call ``get``/``put``/``lookup``/``delete`` from worker threads; ``close`` runs once at
graceful shutdown, after in-flight RPCs finish.

Reads go through the tiers in order (fastest first); a hit below the first tier is checked with
``verify`` and promoted into the tiers above it. A value that fails ``verify`` is removed from
that tier, counted, and treated as a miss there (another tier may still hold a good copy).
Writes go to every tier (write-through); the first tier is acknowledged first, lower tiers in
order. RAM evictions are demoted to the next tier that lacks the entry when ``demote`` is set.
Pinned keys are never evicted from RAM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kdn.errors import Corrupt, KDNError
from kdn.store.base import Tier, TierStats
from kdn.store.ram import RamTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hit:
    value: bytes
    tier: str


@dataclass(frozen=True)
class Presence:
    present: bool
    tier: str = ""
    size: int = 0


class TieredStore:
    def __init__(
        self,
        tiers: list[Tier],
        *,
        verify: Callable[[bytes], None] | None = None,
        demote: bool = True,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = tiers
        self.verify = verify
        self._pins: set[bytes] = set()
        self._lock = threading.Lock()
        self.corrupt_found = 0
        for tier in tiers:
            if isinstance(tier, RamTier):
                tier.protected = self.is_pinned
                if demote:
                    tier.on_evict = self._demote_from(tier)

    # -- pins ---------------------------------------------------------------------------------

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pin(self, key: bytes) -> None:
        with self._lock:
            self._pins.add(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._pins.discard(key)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Hit | None:
        for i, tier in enumerate(self.tiers):
            try:
                value = tier.get(key)
            except KDNError as exc:
                log.warning("tier %s unavailable on get: %s", tier.name, exc)
                continue
            if value is None:
                continue
            if i > 0 and self.verify is not None and not self._verified(tier, key, value):
                continue
            for upper in self.tiers[:i]:
                self._try(upper.put, key, value)
            return Hit(value, tier.name)
        return None

    def _verified(self, tier: Tier, key: bytes, value: bytes) -> bool:
        assert self.verify is not None
        try:
            self.verify(value)
            return True
        except Corrupt as exc:
            log.error("corrupt entry %r in tier %s removed: %s", key, tier.name, exc)
            tier.counters.add("corrupt")
            self.corrupt_found += 1
            self._try(tier.delete, key)
            return False

    def lookup(self, keys: list[bytes]) -> list[Presence]:
        out = [Presence(False)] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            rest = []
            for i in todo:
                try:
                    size = tier.size_of(keys[i])
                except KDNError:
                    size = None
                if size is None:
                    rest.append(i)
                else:
                    out[i] = Presence(True, tier.name, size)
            todo = rest
        return out

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None,
            pin: bool = False) -> str:
        """Write-through to every tier; return the name of the first tier that took it."""
        if pin:
            self.pin(key)
        first = ""
        errors: list[str] = []
        for tier in self.tiers:
            try:
                tier.put(key, value, ttl_s=ttl_s)
                first = first or tier.name
            except KDNError as exc:
                errors.append(f"{tier.name}: {exc}")
        if not first:
            raise KDNError("no tier accepted the entry: " + "; ".join(errors))
        return first

    def delete(self, key: bytes) -> bool:
        self.unpin(key)
        found = False
        for tier in self.tiers:
            found = bool(self._try(tier.delete, key)) or found
        return found

    def _demote_from(self, tier: Tier) -> Callable[[bytes, bytes], None]:
        below = self.tiers[self.tiers.index(tier) + 1 :]

        def demote(key: bytes, value: bytes) -> None:
            for lower in below:
                if self._try(lower.contains, key):
                    return
                if self._try(lower.put, key, value) is not False:
                    return

        return demote

    @staticmethod
    def _try(fn: Callable[..., object], *args: object) -> object:
        try:
            return fn(*args)
        except KDNError as exc:
            log.warning("tier operation %s failed: %s", getattr(fn, "__qualname__", fn), exc)
            return False

    # -- admin ----------------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            self._try(tier.close)
