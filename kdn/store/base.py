"""The tier contract: a small byte interface every storage tier implements.

Lifecycle: the hierarchy (``kdn.store.tiered``) builds each tier from config, calls the five
core methods (and their batched forms) from worker threads, and calls ``close`` once at shutdown.
A tier stores opaque bytes under bytes keys and nothing else: promotion, demotion, which entries
are protected from eviction (pins) and write policy are the hierarchy's business, never a tier's.

Required: ``contains``, ``get``, ``put``, ``delete``, ``close``.
Optional (defaults loop over the core methods; tiers override them when they can batch):
``contains_many``, ``get_many``, ``put_many``, ``delete_many``, ``size_of``, ``size_many``,
``ttl_remaining``, ``written_at``, ``keys``, ``healthy``, ``stats``, ``parts_down``.
Optional abilities of an ``in_process`` tier (defaults: "no stamp"): ``get_stamped``, ``stamp``,
``stamp_if``.

``put(key, value, ttl_s=...)`` replaces any earlier value atomically: a reader sees the old
value or the new one, never a mix. When ``put`` returns, the entry is as durable as the tier
can make it (a disk tier: committed to disk). ``ttl_s`` (seconds, None = no expiry) is honoured
by every tier: an expired entry is a miss.

Traits: each tier class says what it is, and the hierarchy chooses by these, never by name.

    durable             an acknowledged entry survives a restart of this server (on disk)
    remote              the tier is on another machine, shared by several servers; the server
                        stays healthy while only remote tiers are down
    reports_evictions   the tier evicts on its own byte budget and hands each evicted entry to
                        ``on_evict`` (so the hierarchy can demote it)
    in_process          the values live in this process's memory and can not change in place:
                        a read is a lookup with no I/O (cheap enough for an event loop's
                        thread), and every write gets a stamp (``get_stamped``, ``stamp``,
                        ``stamp_if``), so the hierarchy checks a value once, not on every read
    takes_framed        ``put`` keeps a ``Framed`` value as the frames it arrived in
                        (``kdn.store.framed``), and ``get_stamped(framed=True)`` returns it so;
                        other tiers are given one buffer
    keeps_pins          the tier never evicts a key ``protected`` answers true for (default);
                        False: Redis, whose server evicts on its own memory budget, so the
                        hierarchy refuses a pinned entry only such tiers took

Hooks set by the hierarchy after construction: ``protected(key)``: a tier that evicts on its own
never evicts a key for which it answers true (pins; unless it does not ``keeps_pins``);
``on_evict(key, value, ttl_s, generation)``: called by a tier that ``reports_evictions`` for
each entry it evicted, outside its locks, with the seconds the entry had left (None = no
expiry) and what ``generation(key)`` (the hierarchy's count of the key's writes and deletes)
answered under the lock it evicted it under, so a demotion is skipped for a key written or
deleted since; ``on_event(name, n)``: a tier reports ``n`` more of an event of its own (the
disk tier's ``map_grown``, ``map_full``), which the hierarchy counts as ``<tier>.<name>``
with its other counters (``kdn admin stats``, ``kdn_events``).

A miss is ``None``. A tier that can not be reached raises ``TierUnavailable``; one that can not
hold an entry raises ``TooLarge``. Tiers never raise other exception types on purpose.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from kdn.options import Durability
from kdn.store.framed import Framed


@dataclass
class TierCounters:
    """Monotonic counters a tier keeps; read through ``Tier.stats``."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


@dataclass(frozen=True)
class TierStats:
    name: str
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt: int = 0
    healthy: bool = True
    degraded: bool = False
    """Up, but part of it does not answer (some Redis Cluster masters)."""


def _never(key: bytes) -> bool:
    return False


def _uncounted(name: str, n: int) -> None:
    return None


def _no_generation(key: bytes) -> int:
    return 0


EvictHook = Callable[[bytes, bytes | Framed, float | None, int], None]
"""``on_evict(key, value, ttl_s, generation)``: an entry a tier evicted, with its remaining
seconds or None and the key's ``generation`` when it was evicted (the RAM tier's value may be
``Framed``: ``kdn.store.framed.contiguous`` joins it)."""


class Tier(abc.ABC):
    """Opaque bytes under bytes keys."""

    name: ClassVar[str] = "tier"
    durable: ClassVar[bool] = False
    remote: ClassVar[bool] = False
    reports_evictions: ClassVar[bool] = False
    in_process: ClassVar[bool] = False
    takes_framed: ClassVar[bool] = False
    keeps_pins: ClassVar[bool] = True

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.protected: Callable[[bytes], bool] = _never
        self.on_evict: EvictHook | None = None
        self.generation: Callable[[bytes], int] = _no_generation
        self.on_event: Callable[[str, int], None] = _uncounted
        self.degraded = False
        """Up, but part of the tier does not answer (set by ``healthy``; a Redis Cluster with
        a master gone): keys there miss and writes there fail, the rest is served."""

    def satisfies(self, durability: Durability) -> bool:
        """Whether an entry this tier acknowledged is where ``durability`` asks: DISK needs a
        ``durable`` tier, SHARED a ``remote`` one; DEFAULT and MEMORY are met by every tier."""
        if durability is Durability.DISK:
            return self.durable
        if durability is Durability.SHARED:
            return self.remote
        return True

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abc.abstractmethod
    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None) -> None: ...

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- batched and optional forms -------------------------------------------------------------

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, ttl_s: float | None = None) -> None:
        for k, v in items:
            self.put(k, v, ttl_s=ttl_s)

    def delete_many(self, keys: list[bytes]) -> int:
        return sum(self.delete(k) for k in keys)

    def put_while(self, key: bytes, value: bytes, still: Callable[[], bool], *,
                  ttl_s: float | None = None, written_at: float | None = None) -> bool:
        """``put`` where ``still()`` answers true just before (a promotion, while no write of
        the key came since its read); whether it put. A tier that ``reports_evictions`` asks
        ``still`` and puts under one lock of its own (its evictions' demotions take the
        hierarchy's key locks, so the hierarchy can not hold one around the put); others are
        called under the key's stripe lock. ``written_at``: when the promoted copy was
        written (unix seconds; None: not known), which RAM keeps as the entry's
        (``written_at``), so a promotion leaves its age as it was; others ignore it."""
        if not still():
            return False
        self.put(key, value, ttl_s=ttl_s)
        return True

    def get_stamped(self, key: bytes, framed: bool = False) -> tuple[bytes, int] | None:
        """The value and the stamp of the write that stored it: an ``in_process`` tier gives
        every write a new stamp > 0, so the hierarchy checks a value once, not on every read;
        0 means "check it every time". ``framed``: a ``takes_framed`` tier returns a value it
        holds as frames as it is (a ``Framed``), others ignore it."""
        value = self.get(key)
        return None if value is None else (value, 0)

    def stamp(self, key: bytes, *, expiring: bool = False, value: object = None) -> int:
        """The stamp of ``key``'s value (as ``get_stamped`` gives it, counting no hit); 0 where
        the tier keeps none (every tier that is not ``in_process``), holds no value, (unless
        ``expiring``) the value has a time to live, or (given ``value``) it holds another
        object."""
        return 0

    def stamp_if(self, key: bytes, value: object) -> int:
        """The stamp of ``key``'s value where that is the very object ``value`` (a put's value
        as it was given, no later one); 0 otherwise, and always for a tier that keeps no
        stamps. Counts no hit."""
        return 0

    def size_of(self, key: bytes) -> int | None:
        """Stored size of ``key`` in bytes, or None when absent."""
        v = self.get(key)
        return None if v is None else len(v)

    def size_many(self, keys: list[bytes]) -> list[int | None]:
        return [self.size_of(k) for k in keys]

    def ttl_remaining(self, key: bytes) -> float | None:
        """Seconds until ``key`` expires; None only when the tier holds it with no expiry; 0.0
        when it is absent or expired (a read that raced its expiry: nothing is left to keep).
        A tier that keeps no times to live answers None."""
        return None

    def written_at(self, key: bytes) -> float | None:
        """When ``key`` was written (unix seconds); None when absent or not recorded."""
        return None

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """Keys starting with ``prefix`` (admin listing; may be slow)."""
        return iter(())

    def sweep_expired(self) -> tuple[int, int]:
        """Remove the entries whose time to live has passed (``kdn admin gc``): (entries
        removed, bytes freed). A tier that keeps expired entries out of ``keys`` and
        ``size_of`` sweeps them its own way."""
        removed = freed = 0
        for k in list(self.keys(b"")):
            left, size = self.ttl_remaining(k), self.size_of(k)
            if (size is None or (left is not None and left <= 0)) and self.delete(k):
                removed, freed = removed + 1, freed + (size or 0)
        return removed, freed

    def healthy(self) -> bool:
        """Whether the tier answers right now (a remote tier probes its server); a tier may
        raise ``TierUnavailable`` instead, its message saying why (the probe logs it)."""
        return True

    def parts_down(self) -> list[str]:
        """The parts of the tier that do not answer now (a Redis Cluster's masters, as
        ``host:port``): their keys miss and refuse SHARED stores. Empty for a tier of one
        part, and while every part answers; asks no server (what the tier remembers)."""
        return []

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(self.name, 0, 0, 0, c.hits, c.misses, c.evictions, c.corrupt,
                         self.healthy())
