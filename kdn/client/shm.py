"""The client's half of the same-host data plane: a shared-memory segment and its regions.

Lifecycle: a ``Client`` with ``shm_bytes`` set creates one ``SharedSegment`` on first use: a
memfd of that size, sealed so that it can neither shrink nor grow (the server's mapping of it
never faults), with 16 random bytes at its start. ``Attach`` hands the server the process id,
the descriptor number and that nonce (``kdn.server.batch``); from then on GetMany / PutMany
move entries through regions of the segment and only descriptors cross gRPC.

Regions: ``RegionAllocator`` hands out byte ranges (first fit, 64-byte aligned, neighbours
merged on free). A range the server filled is handed to the caller as ``owned`` memoryviews:
each view keeps a private numpy array of its range alive, and that array's finalizer gives the
range back, so a region is reused only once nothing reads it any more (frames still decoding,
a ``Fetched`` the caller holds). Decoded tensors are copies and never alias the segment.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

NONCE_BYTES = 16
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionAllocator:
    """First-fit allocation of aligned byte ranges in [start, end); thread-safe."""

    def __init__(self, start: int, end: int) -> None:
        self._free: list[tuple[int, int]] = [(_align(start), end)]  # sorted (begin, end)
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

    def free_bytes(self) -> int:
        with self._lock:
            return sum(e - b for b, e in self._free)


class SharedSegment:
    """A sealed memfd mapped into this process, carved into regions (module docstring)."""

    def __init__(self, size: int) -> None:
        if size <= 4 * ALIGN:
            raise ValueError(f"a shared segment needs more than {4 * ALIGN} bytes, got {size}")
        self.size = size
        self.fd = os.memfd_create("kdn-client", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.map[:NONCE_BYTES] = self.nonce
        self.array: np.ndarray[Any, Any] = np.frombuffer(self.map, dtype=np.uint8)
        self.regions = RegionAllocator(NONCE_BYTES, size)
        self._cuda_registered: bool | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the segment at ``offset`` (numpy: the GIL is released)."""
        np.copyto(self.array[offset : offset + len(data)], np.frombuffer(data, dtype=np.uint8))

    def owned(self, offset: int, n: int, start: int | None = None) -> memoryview:
        """A view of [offset, offset + n) that frees [start, offset + n) (``start``: an
        aligned offset at or before ``offset``; default ``offset``) once no view of it is
        left."""
        start = offset if start is None else start
        if start % ALIGN or not start <= offset:
            raise ValueError(f"region start {start} unaligned or after the view at {offset}")
        owner = self.array[offset : offset + n]
        weakref.finalize(owner, self.regions.free, start, offset + n - start)
        return memoryview(owner)  # type: ignore[arg-type]

    def register_with_cuda(self) -> bool:
        """Page-lock the segment for CUDA (``cudaHostRegister``), once: tensors that view it
        are then pinned, and copies from them to the GPU run at the pinned rate with no staging
        copy. False where CUDA is not available or refuses."""
        if self._cuda_registered is None:
            self._cuda_registered = False
            try:
                import torch

                if torch.cuda.is_available():
                    err = torch.cuda.cudart().cudaHostRegister(self.array.ctypes.data, self.size, 0)
                    self._cuda_registered = int(err) == 0
            except (ImportError, RuntimeError, AttributeError):
                pass
        return self._cuda_registered

    def close(self) -> None:
        if self._cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
        del self.array
        try:
            self.map.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass
        os.close(self.fd)
