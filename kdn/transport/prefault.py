"""Memory faulted in ahead of demand: where a server's large received entries land.

A store into memory no process touched before pays the kernel for every page (allocated and
zeroed on its first write: ~0.45–1 GB/s on this project's machine, where a copy into memory
already faulted in runs at 10–14 GB/s). A cache that fills never frees as much as it stores, so
``BufferPool``'s free list of buffers that came back can not help it; the peers allocate their
whole pool up front. ``PrefaultedHeap`` does that in the background, ahead of demand:

    heap = PrefaultedHeap(ahead_bytes=1 << 30, limit_bytes=8 << 30)
    buf = heap.take(n)       # a writable uint8 view of n faulted-in bytes, or None (the
                             # first call starts the grower)
    ...                      # readers derive memoryviews from it; once all are gone the
                             # range goes back to the heap (still faulted in)

Life of the memory: a background thread ("kdn-prefault") maps regions (anonymous memory,
``MADV_HUGEPAGE`` where the kernel offers huge pages) and faults each in whole
(``MADV_POPULATE_WRITE`` through ctypes, the GIL free while the kernel works; before Linux
5.14, one write per page) before any ``take`` may use it. It grows while fewer than
``ahead_bytes`` lie free or no free range holds the largest ``take`` seen (a region holds at
least twice that, and a quarter of ``ahead_bytes``), never past ``limit_bytes`` in all.
``take`` carves a range of a region (first fit); the view it returns is watched
(``kdn.transport.buffers.on_release``) and its range is given back once nothing refers to it,
to be reused as it is. A release may fire on any thread at any allocation, also inside this
heap's own lock, so it only queues the range; the next ``take`` (or the grower) frees what is
queued. Regions are kept until ``close`` (the process's memory stays at its peak, as a full RAM
tier's would anyway).
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdn.transport.buffers import libc_madvise, on_release
from kdn.transport.regions import RegionAllocator

PAGE = mmap.PAGESIZE
HUGE = 2 << 20
"""Regions are multiples of a 2 MiB huge page (what x86-64's THP gives)."""
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
POPULATE_STEP = 8 << 20
"""Bytes faulted in by one call (``close`` waits for at most one such step)."""


@dataclass(eq=False)
class _Region:
    array: np.ndarray[Any, Any]
    mm: mmap.mmap
    regions: RegionAllocator


class PrefaultedHeap:
    """Thread-safe (module docstring). ``ahead_bytes``: free memory kept faulted in ahead of
    demand; ``limit_bytes``: the most all regions together may hold (0: no growth)."""

    def __init__(self, ahead_bytes: int, limit_bytes: int) -> None:
        if ahead_bytes < 0 or limit_bytes < 0:
            raise ValueError(f"ahead_bytes and limit_bytes must be >= 0, got {ahead_bytes} "
                             f"and {limit_bytes}")
        self.ahead_bytes = ahead_bytes
        self.limit_bytes = limit_bytes
        self._regions: list[_Region] = []
        self._released: deque[tuple[_Region, int, int]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(threading.Lock())
        self._missed = 0  # the largest take that found no room since the last growth
        self._largest = 0  # the largest take seen
        self._closed = False
        self.mapped_bytes = 0
        self.taken = self.missed = 0
        self.grown = threading.Event()
        """Set each time a region was added (tests wait on it)."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start growing (``take`` does on its first call: a server that never receives a
        large entry takes no memory for it)."""
        with self._wake:
            if self._thread is None and not self._closed and self.ahead_bytes > 0 \
                    and self.limit_bytes > 0:
                self._thread = threading.Thread(target=self._grow_loop, name="kdn-prefault",
                                                daemon=True)
                self._thread.start()

    # -- taking and giving back -----------------------------------------------------------------

    def take(self, size: int) -> np.ndarray[Any, Any] | None:
        """A writable view of ``size`` faulted-in bytes (64-byte aligned), or None when no
        region has a free range that large (the grower is told)."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        if self._thread is None:
            self.start()
        with self._lock:
            self._settle()
            for reg in self._regions:
                at = reg.regions.alloc(size)
                if at is not None:
                    break
            else:
                self.missed += 1
                self._missed = max(self._missed, size)
                self._note(size)
                self._poke()
                return None
            self.taken += 1
            self._note(size)
        view = reg.array[at : at + size]
        on_release(view, self._released.append, (reg, at, size))
        self._poke()  # the grower looks whether it is still ahead
        return view

    def _note(self, size: int) -> None:
        """Remember the largest take (one that could never be served, past half the limit,
        does not steer the growth)."""
        if 2 * size <= self.limit_bytes:
            self._largest = max(self._largest, size)

    def _settle(self) -> None:
        """Free the ranges whose views went (queued by their release). Call with the lock."""
        while True:
            try:
                reg, at, size = self._released.popleft()
            except IndexError:
                return
            reg.regions.free(at, size)

    def holds(self, address: int) -> bool:
        """Whether ``address`` lies in one of the heap's regions."""
        with self._lock:
            return any(r.array.ctypes.data <= address < r.array.ctypes.data + r.array.nbytes
                       for r in self._regions)

    def free_bytes_unlocked(self) -> int:
        """Free bytes in all regions (ranges released but not yet settled not counted)."""
        return sum(r.regions.free_bytes() for r in list(self._regions))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._settle()
            return self.free_bytes_unlocked()

    # -- growing --------------------------------------------------------------------------------

    def _poke(self) -> None:
        with self._wake:
            self._wake.notify()

    def _want(self) -> int:
        """Bytes of the next region to add; 0 when none is needed or allowed. One is needed
        while fewer than ``ahead_bytes`` lie free or no free range holds the largest take
        seen; it holds at least twice that take and a quarter of ``ahead_bytes`` (a few large
        regions: an entry needs one range)."""
        with self._lock:
            self._settle()
            free = self.free_bytes_unlocked()
            room = max((r.regions.largest_free() for r in self._regions), default=0)
            missed, self._missed = self._missed, 0
        if free >= self.ahead_bytes and room >= self._largest and not missed:
            return 0
        size = max(self.ahead_bytes - free, 2 * self._largest, self.ahead_bytes // 4, HUGE)
        size = min(-(-size // HUGE) * HUGE, self.limit_bytes - self.mapped_bytes)
        return size if size >= max(missed, PAGE) else 0

    def _grow_loop(self) -> None:
        while not self._closed:
            size = self._want()
            if size <= 0:
                with self._wake:
                    if not self._closed:
                        self._wake.wait(timeout=1.0)
                continue
            try:
                reg = self._map(size)
            except (OSError, MemoryError):
                with self._wake:  # no memory now: try again later
                    self._wake.wait(timeout=1.0)
                continue
            if reg is None:
                return
            with self._lock:
                self._regions.append(reg)
                self.mapped_bytes += size
            self.grown.set()

    def grow_now(self, size: int) -> None:
        """Add a region of ``size`` bytes on this thread (faulted in before it returns)."""
        reg = self._map(-(-size // PAGE) * PAGE)
        if reg is not None:
            with self._lock:
                self._regions.append(reg)
                self.mapped_bytes += reg.array.nbytes
            self.grown.set()

    def _map(self, size: int) -> _Region | None:
        """A new region of ``size`` bytes, every page faulted in; None once closed."""
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(mm, dtype=np.uint8)
        base = array.ctypes.data
        madvise = libc_madvise()
        if madvise is not None:
            madvise(base, size, MADV_HUGEPAGE)  # where THP is "madvise": huge pages if any
        for off in range(0, size, POPULATE_STEP):
            if self._closed:
                del array
                mm.close()
                return None
            n = min(POPULATE_STEP, size - off)
            if madvise is None or madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
                madvise = None
                array[off : off + n : PAGE] = 0  # one write per page faults it in
        return _Region(array, mm, RegionAllocator(0, size))

    def close(self) -> None:
        """Stop growing and drop the regions (views still held keep their memory mapped)."""
        self._closed = True
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            regions, self._regions = self._regions, []
        for reg in regions:
            del reg.array
            try:
                reg.mm.close()
            except BufferError:  # a view is still held: unmapped with its last one
                pass
