"""RAM tier: a byte-bounded LRU map, safe under concurrent use, O(1) get and put.

Values are immutable ``bytes`` and are returned as stored (no copy); a value stored as the
frames it arrived in (``kdn.store.framed.Framed``) is joined on its first read by anyone but a
reader asking for frames (``get_stamped(framed=True)``), and the joined bytes take its place.
When a put would exceed ``capacity_bytes`` the least recently used entries are removed; the
hierarchy decides which entries may not be removed (``protected``, e.g. pins, unless their
time to live has passed) and what happens to removed ones (``on_evict``, e.g. demotion to disk;
called outside the lock, with the seconds the entry had left or None and the key's
``generation`` read under it). Entries larger than the whole budget are refused, and so is a
put for which protected entries leave too little room: before anything is removed, so the
key's previous value stays.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kdn.errors import TooLarge
from kdn.store.base import EvictHook, Tier, TierStats
from kdn.store.framed import Framed


class RamTier(Tier):
    name = "ram"
    reports_evictions = True
    in_process = True
    takes_framed = True

    def __init__(
        self,
        capacity_bytes: int,
        *,
        protected: Callable[[bytes], bool] | None = None,
        on_evict: EvictHook | None = None,
    ) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        if protected is not None:
            self.protected = protected
        self.on_evict = on_evict
        self._data: OrderedDict[bytes, bytes | Framed] = OrderedDict()  # LRU order, oldest first
        self._written: dict[bytes, float] = {}  # unix seconds of each entry's write
        self._expiry: dict[bytes, float] = {}  # only entries with a TTL; monotonic deadline
        self._bytes = 0
        self._lock = threading.Lock()
        self._stamps: dict[bytes, int] = {}  # key -> number of the put that stored its value
        self._next_stamp = itertools.count(1)

    def _live(self, key: bytes) -> bool:
        """Whether ``key`` is held and unexpired (removing it when expired); caller locks."""
        if key not in self._data:
            return False
        if self._expiry:
            exp = self._expiry.get(key)
            if exp is not None and exp <= time.monotonic():
                self._remove(key)
                return False
        return True

    def _remove(self, key: bytes) -> bytes | Framed | None:
        value = self._data.pop(key, None)
        if value is None:
            return None
        self._expiry.pop(key, None)
        self._stamps.pop(key, None)
        self._written.pop(key, None)
        self._bytes -= len(value)
        return value

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._live(key)

    def get(self, key: bytes) -> bytes | None:
        got = self.get_stamped(key)
        return None if got is None else got[0]

    def get_stamped(self, key: bytes, framed: bool = False) -> tuple[bytes, int] | None:
        """Values are immutable bytes held in this process: a put's stamp names its value.
        ``framed``: a ``Framed`` value is returned as it is (else joined, once: the joined
        bytes replace it, under the same stamp)."""
        with self._lock:
            if not self._live(key):
                self.counters.add("misses")
                return None
            self._data.move_to_end(key)
            self.counters.add("hits")
            value, stamp = self._data[key], self._stamps[key]
        if framed or not isinstance(value, Framed):
            return value, stamp  # type: ignore[return-value]
        joined = value.joined()  # outside the lock: a large entry takes a while
        with self._lock:
            if self._data.get(key) is value:  # not overwritten, deleted or evicted meanwhile
                self._data[key] = joined
        return joined, stamp

    def stamp_if(self, key: bytes, value: object) -> int:
        """The stamp of ``key``'s value where that is the very object ``value`` (a put's value
        as it was given, no later one); 0 otherwise. Counts no hit."""
        with self._lock:
            return self._stamps[key] if self._data.get(key) is value else 0

    def size_of(self, key: bytes) -> int | None:
        with self._lock:
            return len(self._data[key]) if self._live(key) else None

    def written_at(self, key: bytes) -> float | None:
        with self._lock:
            return self._written.get(key) if self._live(key) else None

    def stamp(self, key: bytes, *, expiring: bool = False, value: object = None) -> int:
        """The stamp of ``key``'s value; 0 where there is none, (unless ``expiring``) it has
        a time to live, or (given ``value``) it is not that very object."""
        with self._lock:
            if not self._live(key) or key in self._expiry and not expiring or \
                    value is not None and self._data[key] is not value:
                return 0
            return self._stamps[key]

    def ttl_remaining(self, key: bytes) -> float | None:
        with self._lock:
            if not self._live(key):
                return 0.0  # absent, or expired (``Tier.ttl_remaining``)
            if key not in self._expiry:
                return None
            return max(0.0, self._expiry[key] - time.monotonic())

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None) -> None:
        self.put_while(key, value, lambda: True, ttl_s=ttl_s,  # type: ignore[arg-type]
                       written_at=time.time())

    def put_while(self, key: bytes, value: bytes | Framed,  # type: ignore[override]
                  still: Callable[[], bool], *, ttl_s: float | None = None,
                  written_at: float | None = None) -> bool:
        if not (isinstance(value, (bytes, Framed)) or isinstance(value, memoryview)
                and value.readonly and value.contiguous and value.format == "B"):
            value = bytes(value)  # a read-only byte view is kept as it is (no copy)
        if len(value) > self.capacity_bytes:
            raise TooLarge(f"entry of {len(value)} bytes exceeds the RAM tier's "
                           f"{self.capacity_bytes}-byte budget")
        evicted: list[tuple[bytes, bytes | Framed, float, int]] = []
        with self._lock:
            if not still():  # asked under the lock every put takes: atomic with the put
                return False
            old = self._data.get(key)
            over = self._bytes - (0 if old is None else len(old)) + len(value) \
                - self.capacity_bytes
            if over > 0:  # refused before anything is removed: the old value stays served
                evicted = self._evict_locked(over, keep=key)
            self._remove(key)
            self._data[key] = value
            self._stamps[key] = next(self._next_stamp)
            if written_at is not None:  # else its age is not known (``_remove`` forgot it)
                self._written[key] = written_at
            if ttl_s:
                self._expiry[key] = time.monotonic() + ttl_s
            self._bytes += len(value)
        if self.on_evict is not None:
            now = time.monotonic()
            for k, v, exp, gen in evicted:
                if exp and exp <= now:
                    continue
                self.on_evict(k, v, exp - now if exp else None, gen)
        return True

    def _evict_locked(self, need: int,
                      keep: bytes) -> list[tuple[bytes, bytes | Framed, float, int]]:
        """Remove entries other than ``keep`` to free ``need`` bytes, in LRU order: expired
        ones (pinned or not: a pin outlives no entry) and unprotected ones. Chosen first and
        removed only once they free enough: else TooLarge, and nothing is removed."""
        now = time.monotonic()
        victims: list[bytes] = []
        skipped: list[bytes] = []
        for key in self._data:
            if need <= 0:
                break
            if key == keep:
                continue
            if self.protected(key) and self._expiry.get(key, now + 1.0) > now:
                skipped.append(key)
                continue
            victims.append(key)
            need -= len(self._data[key])
        if need > 0:
            raise TooLarge("RAM tier is full of pinned entries; unpin or raise ram budget")
        for key in skipped:
            self._data.move_to_end(key)  # not looked at again by the next eviction
        out: list[tuple[bytes, bytes | Framed, float, int]] = []
        for key in victims:
            expiry = self._expiry.get(key, 0.0)
            value = self._remove(key)
            assert value is not None
            out.append((key, value, expiry, self.generation(key)))
            self.counters.add("evictions")
        return out

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._remove(key) is not None

    def sweep_expired(self) -> tuple[int, int]:
        """Remove the entries whose time to live has passed, counted as removed under the
        lock (``Tier.sweep_expired``'s reads would drop them uncounted first)."""
        removed = freed = 0
        with self._lock:
            now = time.monotonic()
            for key in [k for k, exp in self._expiry.items() if exp <= now]:
                value = self._remove(key)
                if value is not None:
                    removed, freed = removed + 1, freed + len(value)
        return removed, freed

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        with self._lock:
            snapshot = list(self._data)
        return (k for k in snapshot if k.startswith(prefix))

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._expiry.clear()
            self._written.clear()
            self._bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(self.name, len(self._data), self._bytes, self.capacity_bytes,
                         c.hits, c.misses, c.evictions, c.corrupt)
