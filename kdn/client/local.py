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

Entries are kept as the server stores them (header + frames) and decoded like any other, so the
frame checksums are checked on every use. On a CUDA host the bytes live in pinned host memory,
so a hit copies to the GPU at the pinned limit. kdn keys name content (a hash of the tokens and
the layout), so an entry does not change under its key; an entry deleted on the server by
another client stays usable here until it is evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kdn.codec import EncodedParts
from kdn.codec.format import parse_container

TIER = "inproc"


@dataclass
class LocalStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


def _host_buffer(n: int) -> np.ndarray:  # type: ignore[type-arg]
    """``n`` bytes of host memory, pinned when a CUDA device is there to copy to."""
    if torch.cuda.is_available():
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(n, dtype=np.uint8)


class LocalTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()  # type: ignore[type-arg]
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = LocalStats(capacity_bytes=capacity_bytes)

    def get(self, namespace: str, key: bytes) -> tuple[EncodedParts, memoryview] | None:
        """Header and frame views of the entry and a read-only view of all of it, or None;
        frames are checked when decoded."""
        with self._lock:
            buf = self._entries.get((namespace, key))
            if buf is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end((namespace, key))
            self.stats.hits += 1
        whole = memoryview(buf).toreadonly()  # type: ignore[arg-type]
        c = parse_container(whole, verify=False)
        return EncodedParts(c.header.raw, list(c.frames)), whole  # type: ignore[arg-type]

    def contains(self, namespace: str, key: bytes) -> int | None:
        """The entry's size, or None; does not count as a use."""
        with self._lock:
            buf = self._entries.get((namespace, key))
            return None if buf is None else int(buf.nbytes)

    def put(self, namespace: str, key: bytes, parts: EncodedParts) -> None:
        n = parts.nbytes
        if n > self.capacity_bytes:
            return
        buf = _host_buffer(n)
        at = 0
        for piece in (parts.header, *parts.frames):
            buf[at : at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            at += len(piece)
        with self._lock:
            old = self._entries.pop((namespace, key), None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[(namespace, key)] = buf
            self._bytes += n
            while self._bytes > self.capacity_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self.stats.evictions += 1
            self.stats.entries, self.stats.bytes = len(self._entries), self._bytes

    def discard(self, namespace: str, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop((namespace, key), None)
            if old is not None:
                self._bytes -= old.nbytes
            self.stats.entries, self.stats.bytes = len(self._entries), self._bytes
