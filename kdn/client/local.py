"""The in-process tier: an LRU of encoded entries inside the engine's process (its L1).

``Client(local_bytes=N)`` puts one ``LocalTier`` of at most N bytes in front of the server, in
the same key space (namespace, key) as the client's calls. Lifecycle:

* filled by the client on every store that succeeded and on every retrieve or fetch that read
  the whole entry (a copy of the container, so the tier never aliases a caller's buffer or the
  shared segment);
* read first by ``fetch``, ``retrieve``, ``retrieve_stream(s)`` and reported by ``lookup``
  (tier ``inproc``): a hit costs no call to the server;
* ``delete`` drops the key here too; the least recently used entries go when the byte budget
  is exceeded.

Entries are kept as the server stores them (header + frames), checked as they are copied in
(the header's checksum, every frame's checksum, position and length, hashed chunk by chunk as
it is written: an entry that fails is not kept); a hit is not hashed again, as the server's RAM
tier does not hash a value again after its first check: these are this process's own bytes,
handed out read-only. A hit into CPU tensors is then one plain copy. On a CUDA host the bytes
live in pinned host memory (each entry its own mapping registered with CUDA, its size rounded
to pages: the byte budget is what is pinned) and are the source of a GPU-bound hit's
host-to-device copy, with no pass over them first, so it can run at the pinned limit. kdn keys
name content (a hash of the tokens and the layout), so an entry does not change under its key;
an entry deleted on the server by another client stays usable here until it is evicted.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kdn.client.received import FRAME_ALIGN, LOCAL_TIER
from kdn.codec import EncodedParts
from kdn.codec.copies import copy_frame_checked
from kdn.codec.format import Header, parse_container, parse_header
from kdn.errors import Corrupt, Truncated

TIER = LOCAL_TIER
log = logging.getLogger(__name__)


@dataclass
class LocalStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0
    """Entries not kept: they failed their check as they were copied in."""
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


class LocalHit(NamedTuple):
    """An entry of the tier as ``get`` hands it out."""

    parts: EncodedParts
    """Header and frame views (read-only)."""
    whole: memoryview
    """All of the entry, read-only."""
    header: Header
    memo: dict[str, Any]
    """What readers derived from these bytes (a joined load's span of them): kept as long
    as the entry, as the bytes never change under it; gone with it."""


@dataclass(eq=False)
class _Held:
    """One entry: its buffer, parsed once when it was put (a hit parses nothing)."""

    buf: np.ndarray  # type: ignore[type-arg]
    hit: LocalHit


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (RuntimeError, AttributeError):  # CUDA already torn down at exit
        pass


def _pinned(n: int) -> np.ndarray | None:  # type: ignore[type-arg]
    """``n`` bytes of page-locked host memory that cost ``n`` bytes (rounded to pages): an
    anonymous mapping registered with CUDA, unregistered, then unmapped, once nothing views it
    any more (an entry evicted while a copy still reads it stays until the copy's source goes).
    Not torch's pinned allocator: it rounds each block up to a power of two (an entry of 32 MiB
    and a header took 64 MiB) and keeps freed blocks pinned for reuse, so a tier of N bytes held
    up to 2N, and every entry it ever evicted. None where CUDA refuses."""
    room = mmap.mmap(-1, max(n, 1))
    arr = np.frombuffer(room, dtype=np.uint8, count=n)
    ptr = arr.ctypes.data
    if int(torch.cuda.cudart().cudaHostRegister(ptr, len(room), 0)) != 0:
        return None
    weakref.finalize(arr, _unregister, ptr)  # runs before the mapping's last reference goes
    return arr


def _host_buffer(n: int) -> np.ndarray:  # type: ignore[type-arg]
    """``n`` bytes of host memory, pinned when a CUDA device is there to copy to."""
    if torch.cuda.is_available():
        got = _pinned(n)
        if got is not None:
            return got
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(n, dtype=np.uint8)


class LocalTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = torch.cuda.is_available()
        """Entries live in page-locked memory (``_host_buffer``): copies to a GPU read them."""
        self._entries: OrderedDict[tuple[str, bytes], _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = LocalStats(capacity_bytes=capacity_bytes)

    def get(self, namespace: str, key: bytes) -> LocalHit | None:
        """The entry (checked and parsed when it was put), or None."""
        with self._lock:
            held = self._entries.get((namespace, key))
            if held is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end((namespace, key))
            self.stats.hits += 1
        return held.hit

    def contains(self, namespace: str, key: bytes) -> int | None:
        """The entry's size, or None; does not count as a use."""
        with self._lock:
            held = self._entries.get((namespace, key))
            return None if held is None else int(held.buf.nbytes)

    def put(self, namespace: str, key: bytes, parts: EncodedParts) -> bool:
        """Keep a checked copy of the entry; False when it is larger than the tier or fails
        its check (then nothing of it is kept, and an older copy under the key goes too)."""
        n = parts.nbytes
        if n > self.capacity_bytes:
            return False
        head = len(parts.header)
        room = _host_buffer(n + FRAME_ALIGN)
        start = -(room.ctypes.data + head) % FRAME_ALIGN  # frames aligned: viewed in place
        buf = room[start : start + n]
        out = memoryview(buf)  # type: ignore[arg-type]
        try:
            out[:head] = parts.header
            header = parse_header(out[:head])
            if len(parts.frames) != len(header.entry.frames):
                raise Corrupt(f"{len(parts.frames)} frames, the header lists "
                              f"{len(header.entry.frames)}")
            at = head
            for i, frame in enumerate(parts.frames):
                copy_frame_checked(header, i, out[at : at + len(frame)], frame)
                at += len(frame)
        except (Corrupt, Truncated, ValueError) as exc:
            log.warning("kdn: entry %r not kept in the in-process tier: %s", key, exc)
            self.discard(namespace, key)
            with self._lock:
                self.stats.refused += 1
            return False
        whole = out.toreadonly()
        c = parse_container(whole, verify=False)  # once: a hit hands out these views
        held = _Held(buf, LocalHit(EncodedParts(c.header.raw, list(c.frames)),  # type: ignore[arg-type]
                                   whole, c.header, {}))
        with self._lock:
            old = self._entries.pop((namespace, key), None)
            if old is not None:
                self._bytes -= old.buf.nbytes
            self._entries[(namespace, key)] = held
            self._bytes += n
            while self._bytes > self.capacity_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.buf.nbytes
                self.stats.evictions += 1
            self.stats.entries, self.stats.bytes = len(self._entries), self._bytes
        return True

    def discard(self, namespace: str, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop((namespace, key), None)
            if old is not None:
                self._bytes -= old.buf.nbytes
            self.stats.entries, self.stats.bytes = len(self._entries), self._bytes
