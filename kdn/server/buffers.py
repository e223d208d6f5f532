"""Receive buffers for large entries, recycled once nothing refers to them.

A Store or PutMany of a large entry copies it into one buffer that becomes the RAM tier's value.
Fresh anonymous memory is slow to write the first time: every 4 KiB page faults and is zeroed
(1.2–1.9 GB/s on this project's machine, against 19 GB/s for a copy into memory already
touched), and freeing it unmaps every page again. A cache at capacity frees about as many bytes
as it stores (overwrites, evictions, deletes), so the buffers of entries that left are the
obvious place for the next ones: the peers do the same with memory pools allocated up front.

    pool = BufferPool(keep_bytes=1 << 30)
    buf = pool.take(n)             # writable numpy uint8 array of exactly n bytes
    buf[:] = ...; value = memoryview(buf).toreadonly()

Life of a buffer: ``take`` hands out a numpy array over a pooled or new anonymous mapping and
watches the array with a weakref finalizer. Everything that reads the entry (the RAM tier's
value, frames being sent, a queued write to a lower tier, a segment copy) holds a view that
keeps the array alive, so the finalizer runs only when the last reader let go; the mapping then
goes back to the free list (up to ``keep_bytes``; beyond that it is unmapped). A mapping is
never written while any view of its previous use exists.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import numpy as np

MIN_BYTES = 1 << 20
"""Smaller entries are joined from their messages as before (malloc reuses their memory)."""
_GRAIN = 1 << 20
_SLACK = 1.25
"""A free mapping serves a request of at least 1/_SLACK of its size."""


class BufferPool:
    """Thread-safe; finalizers may run on any thread, at any allocation."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = max(0, keep_bytes)
        self._free: list[mmap.mmap] = []
        self._free_bytes = 0
        self._lock = threading.RLock()  # a finalizer can fire inside take() on this thread
        self.reused = 0
        self.created = 0

    def take(self, size: int) -> np.ndarray[Any, Any]:
        """A writable uint8 array of ``size`` bytes, its memory pooled or new (lazily faulted:
        pages are taken as they are written)."""
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        mm = self._pop(size)
        if mm is None:
            mm = mmap.mmap(-1, -(-size // _GRAIN) * _GRAIN)
            self.created += 1
        else:
            self.reused += 1
        arr = np.frombuffer(mm, dtype=np.uint8, count=size)
        weakref.finalize(arr, self._give_back, mm).atexit = False
        return arr

    def _pop(self, size: int) -> mmap.mmap | None:
        with self._lock:
            best = None
            for i, mm in enumerate(self._free):
                if size <= len(mm) <= size * _SLACK + _GRAIN and (
                        best is None or len(mm) < len(self._free[best])):
                    best = i
            if best is None:
                return None
            mm = self._free.pop(best)
            self._free_bytes -= len(mm)
            return mm

    def _give_back(self, mm: mmap.mmap) -> None:
        with self._lock:
            while self._free and self._free_bytes + len(mm) > self.keep_bytes:
                old = self._free.pop(0)  # the oldest go first: the newest match recent sizes
                self._free_bytes -= len(old)
                old.close()
            if self._free_bytes + len(mm) <= self.keep_bytes:
                self._free.append(mm)
                self._free_bytes += len(mm)
        # else dropped: unmapped once the array's own hold on it is released

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            for mm in self._free:
                mm.close()
            self._free.clear()
            self._free_bytes = 0
