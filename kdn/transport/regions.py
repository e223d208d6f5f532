"""Byte ranges of a shared region handed out and given back: the client's segment
(``kdn.client.shm``) and the server's read arenas (``kdn.server.arena``) carve their memory
with it."""

from __future__ import annotations

import threading
from collections.abc import Callable

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionAllocator:
    """First-fit allocation of aligned byte ranges in [start, end); thread-safe. Only whole
    ALIGN-byte blocks are handed out: an ``end`` that is not a multiple of ALIGN is rounded
    down (the tail short of a block is left unused, so no range given back, rounded up to a
    block, reaches past ``end``)."""

    def __init__(self, start: int, end: int) -> None:
        begin, end = _align(start), end // ALIGN * ALIGN
        self._free: list[tuple[int, int]] = [(begin, end)] if end > begin else []  # sorted
        self._retired: list[tuple[int, int, Callable[[], bool] | None]] = []
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of a free range of ``n`` bytes, or None when none is that large (retired
        ranges that may come back, asked first: ``reclaim``)."""
        got = self._alloc(n)
        return got if got is not None or not self.reclaim() else self._alloc(n)

    def _alloc(self, n: int) -> int | None:
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
        """(offset, size) of the largest free range, at most ``cap`` bytes; None when full.
        Where the largest is short of ``cap``, retired ranges that may come back are asked
        first (``reclaim``)."""
        if self.largest_free() < _align(cap):
            self.reclaim()
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

    def retire(self, offset: int, n: int, until: Callable[[], bool] | None = None) -> None:
        """Keep [offset, offset + n) (allocated) out of use: a range another process may
        still read or write (named in a call it did not answer; ``SharedSegment.give_back``).
        ``until``: whether that process is gone now (asked by ``reclaim``; the range is then
        free again); None: out of use for good."""
        with self._lock:
            self._retired.append((offset, _align(n), until))

    def reclaim(self) -> int:
        """Free the retired ranges whose ``until`` says their process is gone (each asked
        once); the bytes freed."""
        with self._lock:
            asks = {id(u): u for _, _, u in self._retired if u is not None}
        if not asks:
            return 0
        gone = {key for key, until in asks.items() if until()}
        with self._lock:
            back = [r for r in self._retired if r[2] is not None and id(r[2]) in gone]
            self._retired = [r for r in self._retired if r not in back]
        for offset, n, _ in back:
            self.free(offset, n)
        return sum(n for _, n, _ in back)

    def retired_bytes(self) -> int:
        """Bytes kept out of use by ``retire``."""
        with self._lock:
            return sum(n for _, n, _ in self._retired)

    def largest_free(self) -> int:
        """Bytes of the largest free range."""
        with self._lock:
            return max((e - b for b, e in self._free), default=0)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(e - b for b, e in self._free)
