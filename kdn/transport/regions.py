"""Byte ranges of a shared region handed out and given back: the client's segment
(``kdn.client.shm``) and the server's read arenas (``kdn.server.arena``) carve their memory
with it."""

from __future__ import annotations

import threading

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionAllocator:
    """First-fit allocation of aligned byte ranges in [start, end); thread-safe."""

    def __init__(self, start: int, end: int) -> None:
        self._free: list[tuple[int, int]] = [(_align(start), end)]  # sorted (begin, end)
        self._retired = 0
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of a free range of ``n`` bytes, or None when none is that large."""
        need = _align(max(n, 1))
        with self._lock:
            for i, (b, e) in enumerate(self._free):
                if e - b >= need:
                    self._free[i] = (b + need, e)
                    if b + need == e:
                        del self._free[i]
                    return b
        return None

    def alloc_largest(self, cap: int) -> tuple[int, int] | None:
        """(offset, size) of the largest free range, at most ``cap`` bytes; None when full."""
        with self._lock:
            if not self._free:
                return None
            i = max(range(len(self._free)), key=lambda j: self._free[j][1] - self._free[j][0])
            b, e = self._free[i]
            size = min(e - b, _align(cap))
            if size <= 0:
                return None
            if b + size == e:
                del self._free[i]
            else:
                self._free[i] = (b + size, e)
            return b, size

    def free(self, offset: int, n: int) -> None:
        """Give back [offset, offset + n) (any part of what was allocated, aligned)."""
        b, e = offset, offset + _align(n)
        if e <= b:
            return
        with self._lock:
            spans = self._free
            i = 0
            while i < len(spans) and spans[i][0] < b:
                i += 1
            spans.insert(i, (b, e))
            if i + 1 < len(spans) and spans[i][1] == spans[i + 1][0]:  # merge the right one
                spans[i] = (spans[i][0], spans[i + 1][1])
                del spans[i + 1]
            if i > 0 and spans[i - 1][1] == spans[i][0]:  # and the left one
                spans[i - 1] = (spans[i - 1][0], spans[i][1])
                del spans[i]

    def retire(self, offset: int, n: int) -> None:
        """Keep [offset, offset + n) (allocated) out of use for good: a range another process
        may still read or write (named in a call it did not answer; ``SharedSegment.
        give_back``)."""
        with self._lock:
            self._retired += _align(n)

    def retired_bytes(self) -> int:
        """Bytes kept out of use by ``retire``."""
        with self._lock:
            return self._retired

    def largest_free(self) -> int:
        """Bytes of the largest free range."""
        with self._lock:
            return max((e - b for b, e in self._free), default=0)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(e - b for b, e in self._free)
