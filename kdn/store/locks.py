"""Key-level locks of the hierarchy: two fixed sets of striped locks, chosen by a key's hash.

Lifecycle: ``TieredStore`` builds one ``KeyLocks`` and hands its locks out for the life of the
store; nothing is ever added or freed, so a key always maps to the same lock.

    stripe(key)          the store's own lock of ``key``: synchronous lower-tier writes,
                         deletes, write-queue flushes and promotions' queued copies of one key
                         hold it, so an older value never lands over a newer one
    generation(key)      a count of the puts and deletes of ``key`` so far (shared by the keys
                         of one of ``GENERATIONS`` slots), raised by ``written`` under the
                         stripe before a put or delete touches any tier
    writing(key)         a put of ``key`` under way: its generation is raised as it begins and
                         again as it ends, and the slot counts it as in flight between
    settled(key, seen)   whether no put or delete of ``key`` came since its generation was
                         ``seen`` and none is under way: a read that saw a value below the
                         first tier promotes it only then (a seqlock: a read that began during
                         a put, before its value reached the tier read, never promotes the
                         older value over it once it is acknowledged)
    entry_lock(key)      the callers' lock of ``key`` (the servicers hold it across look up,
                         quota charge and put or delete, so that concurrent overwrites and
                         deletes of one entry charge and refund it exactly once); the store never
                         takes it, so it is always the outer lock
    all_entries_locked   every entry lock, taken in one order (a recount of usage from the tiers)

``RWLock``: many readers or one writer (the disk tier's transactions against its map's
growth).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import xxhash

STRIPES = 64
"""Locks in each set: keys that share a lock only wait for each other, never deadlock."""
GENERATIONS = 64 * STRIPES
"""Write counters: a promotion is skipped when any key of its slot was written meanwhile."""


class KeyLocks:
    """The stripe locks and the entry locks (see the module docstring)."""

    def __init__(self) -> None:
        self._stripes = [threading.Lock() for _ in range(STRIPES)]
        self._entry_locks = [threading.Lock() for _ in range(STRIPES)]
        self._generations = [0] * GENERATIONS
        self._writing = [0] * GENERATIONS  # puts under way, per generation slot

    def stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[xxhash.xxh64_intdigest(key) % STRIPES]

    def generation(self, key: bytes) -> int:
        return self._generations[xxhash.xxh64_intdigest(key) % GENERATIONS]

    def written(self, key: bytes) -> None:
        """Count a put or delete of ``key`` (the caller holds its stripe: every key of a
        slot has the same stripe, ``GENERATIONS`` being a multiple of ``STRIPES``, so no
        count is lost)."""
        self._generations[xxhash.xxh64_intdigest(key) % GENERATIONS] += 1

    @contextmanager
    def writing(self, key: bytes) -> Iterator[None]:
        """A put of ``key`` under way (the module docstring); takes the key's stripe at its
        start and at its end, so the caller holds none."""
        slot = xxhash.xxh64_intdigest(key) % GENERATIONS
        with self.stripe(key):
            self._generations[slot] += 1
            self._writing[slot] += 1
        try:
            yield
        finally:
            with self.stripe(key):  # raised before the put counts as done: see ``settled``
                self._generations[slot] += 1
                self._writing[slot] -= 1

    def settled(self, key: bytes, seen: int) -> bool:
        """Whether ``key``'s generation is still ``seen`` and no put of its slot is under way.
        Asked without the stripe (under a tier's lock): the count of puts is read first, so a
        put that ended meanwhile is seen by its generation, one that began by either."""
        slot = xxhash.xxh64_intdigest(key) % GENERATIONS
        return not self._writing[slot] and self._generations[slot] == seen

    def entry_lock(self, key: bytes) -> threading.Lock:
        return self._entry_locks[xxhash.xxh64_intdigest(key) % STRIPES]

    @contextmanager
    def all_entries_locked(self) -> Iterator[None]:
        for lock in self._entry_locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(self._entry_locks):
                lock.release()


class RWLock:
    """Many readers or one writer; a waiting writer blocks new readers (no starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1

    def release_shared(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers and self._waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
