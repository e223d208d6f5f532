"""The in-process tier: an LRU of encoded entries inside the engine's process (its L1).

``Client(local_bytes=N)`` puts one ``LocalTier`` of at most N bytes in front of the server, in
the same key space (namespace, key) as the client's calls. Lifecycle:

* filled by the client on every store that succeeded and on every retrieve or fetch that read
  the whole entry (a copy of the container, so the tier never aliases a caller's buffer or the
  shared segment);
* read first by ``fetch``, ``retrieve``, ``retrieve_stream(s)`` and reported by ``lookup``
  (tier ``inproc``): a hit costs no call to the server;
* ``delete`` drops the key here too (``discard_where``: an engine's clear of its own); the
  least recently used entries go when the byte budget is exceeded; an entry this client
  stored with a time to live (``StoreOptions.ttl_s``) goes once it passed, counted from when
  the store began (so never later than on the server);
* emptied by the client's ``close()``: a read of it after that is refused (``Closed``), as any
  call of a closed client is.

A copy is kept only where it is what the server holds, also when the client's threads store,
delete and read one key side by side (``write``, ``read_ticket``): a store or delete drops the
key's copy before it is sent, and a copy is then kept only by the one that began last, when it
succeeded and no other write of the key was in flight from when it began (the server may take
writes sent side by side in either order); a read's copy only when no write of the key began
since the read did (nor was in flight then). Otherwise the key stays out of this tier and reads
go to the server.

Entries are kept as the server stores them (header + frames), checked as they are copied in
(the header's checksum, every frame's checksum, position and length, hashed chunk by chunk as
it is written: an entry that fails is not kept); a hit is not hashed again, as the server's RAM
tier does not hash a value again after its first check: these are this process's own bytes,
handed out read-only. A hit into CPU tensors is then one plain copy. On a CUDA host the bytes
live in pinned host memory (each entry its own mapping registered with CUDA, its size rounded
to pages: the byte budget is what is pinned) and are the source of a GPU-bound hit's
host-to-device copy, with no pass over them first, so it can run at the pinned limit. kdn keys
name content (a hash of the tokens and the layout), so an entry does not change under its key;
an entry deleted on the server by another client stays usable here until it is evicted, and so
does one whose time to live this client was not told (read from the server, or stored without
``ttl_s`` on a server with a ``default_ttl_s``: the server does not say when they expire).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kdn.client import cudahost
from kdn.client.received import FRAME_ALIGN, LOCAL_TIER
from kdn.client.rpc import CLOSED
from kdn.codec import EncodedParts
from kdn.codec.copies import copy_frame_checked
from kdn.codec.format import Header, parse_container, parse_header
from kdn.errors import Closed, Corrupt, InvalidArgument, Truncated

TIER = LOCAL_TIER
log = logging.getLogger(__name__)
STAMPED_KEYS = 8192
"""Keys whose latest write's stamp is remembered (``LocalTier.write``); the stamps of others
are folded into one floor, which only keeps fewer copies read or stored before it."""


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
    expiry: float = 0.0
    """Monotonic seconds when it expires; 0: not known to (a stored entry without ``ttl_s``)."""


def _unregister(ptr: int) -> None:
    try:
        cudahost.unregister(ptr)
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
    if not cudahost.register(ptr, len(room)):
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


class LocalWrite:
    """A store or delete of one key being sent (``LocalTier.write``): ``keep`` its entry once
    the server took it, ``end`` once it is answered either way (again: nothing). A context
    manager that ends it."""

    __slots__ = ("tier", "namespace", "key", "ticket", "expiry", "ended")

    def __init__(self, tier: LocalTier, namespace: str, key: bytes, ticket: int,
                 expiry: float = 0.0) -> None:
        self.tier, self.namespace, self.key = tier, namespace, key
        self.ticket = ticket
        """Its stamp; 0 where another write of the key was in flight when it began."""
        self.expiry = expiry
        """When a store with a time to live expires, counted from its start (0: none)."""
        self.ended = False

    def keep(self, parts: EncodedParts) -> bool:
        """Keep ``parts``, stored by this write, where no later write of the key began."""
        return bool(self.ticket) and self.tier.put(self.namespace, self.key, parts,
                                                   self.ticket, self.expiry)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.tier._ended((self.namespace, self.key))

    def __enter__(self) -> LocalWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class LocalTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = torch.cuda.is_available()
        """Entries live in page-locked memory (``_host_buffer``): copies to a GPU read them."""
        self._entries: OrderedDict[tuple[str, bytes], _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = LocalStats(capacity_bytes=capacity_bytes)
        self._clock = 1  # the last stamp given (0 is no ticket)
        self._stamps: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # latest write's
        self._floor = 0  # the largest stamp no longer in ``_stamps``
        self._writing: dict[tuple[str, bytes], int] = {}  # writes in flight, by key
        self.closed = False

    def write(self, namespace: str, key: bytes, ttl_s: float = 0.0) -> LocalWrite:
        """A store (with ``ttl_s``: its time to live) or delete of the key is about to be sent
        (module docstring): its copy here goes now; the write's ``keep`` and ``end`` follow
        its answer."""
        k = (namespace, key)
        expiry = time.monotonic() + ttl_s if ttl_s else 0.0
        with self._lock:
            self._drop(k)
            self._clock += 1
            self._stamps[k] = self._clock
            self._stamps.move_to_end(k)
            if len(self._stamps) > STAMPED_KEYS:
                self._floor = max(self._floor, self._stamps.popitem(last=False)[1])
            alone = k not in self._writing
            self._writing[k] = self._writing.get(k, 0) + 1
            return LocalWrite(self, namespace, key, self._clock if alone else 0, expiry)

    def _ended(self, k: tuple[str, bytes]) -> None:
        with self._lock:
            left = self._writing.pop(k) - 1
            if left:
                self._writing[k] = left

    def read_ticket(self, namespace: str, key: bytes) -> int:
        """Taken before the key is read from the server, for ``put`` of what the read brings:
        0 (not kept) while a write of the key is in flight."""
        with self._lock:
            return 0 if (namespace, key) in self._writing else self._clock

    def close(self) -> None:
        """Drop every entry (hits handed out keep their bytes); ``get`` and ``contains``
        raise Closed from now on, ``put`` keeps nothing."""
        with self._lock:
            self.closed = True
            self._entries.clear()
            self._bytes = 0
            self.stats.entries, self.stats.bytes = 0, 0

    def get(self, namespace: str, key: bytes) -> LocalHit | None:
        """The entry (checked and parsed when it was put), or None."""
        with self._lock:
            if self.closed:
                raise Closed(CLOSED)
            held = self._held((namespace, key))
            if held is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end((namespace, key))
            self.stats.hits += 1
        return held.hit

    def contains(self, namespace: str, key: bytes) -> int | None:
        """The entry's size, or None; does not count as a use."""
        with self._lock:
            if self.closed:
                raise Closed(CLOSED)
            held = self._held((namespace, key))
            return None if held is None else int(held.buf.nbytes)

    def _held(self, k: tuple[str, bytes]) -> _Held | None:
        """The key's entry unless it expired (then dropped). Call with the lock."""
        held = self._entries.get(k)
        if held is not None and held.expiry and held.expiry <= time.monotonic():
            self._drop(k)
            return None
        return held

    def put(self, namespace: str, key: bytes, parts: EncodedParts,
            ticket: int | None = None, expiry: float = 0.0) -> bool:
        """Keep a checked copy of the entry until ``expiry`` (monotonic; 0: no end); False
        when it is larger than the tier or fails its check (then nothing of it is kept, and an
        older copy under the key goes too), when it expired already, or when a write of the
        key began after ``ticket`` was taken (``read_ticket``, a write's; 0: not kept; None:
        no such check)."""
        n = parts.nbytes
        if n > self.capacity_bytes or ticket == 0 or expiry and expiry <= time.monotonic():
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
                                   whole, c.header, {}), expiry)
        with self._lock:
            if self.closed:  # a store answered as its client was closed
                return False
            if ticket is not None and self._stamps.get((namespace, key), self._floor) > ticket:
                return False  # a later write began: its answer decides
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
            self._drop((namespace, key))

    def discard_where(self, namespace: str, match: Callable[[Header], bool]) -> int:
        """Drop the namespace's entries whose header ``match`` accepts (an engine's clear of
        its own, e.g. one model's); the count dropped."""
        with self._lock:
            gone = [k for k, held in self._entries.items()
                    if k[0] == namespace and match(held.hit.header)]
            for k in gone:
                self._drop(k)
        return len(gone)

    def _drop(self, k: tuple[str, bytes]) -> None:
        """The key's copy gone. Call with the lock."""
        old = self._entries.pop(k, None)
        if old is not None:
            self._bytes -= old.buf.nbytes
        self.stats.entries, self.stats.bytes = len(self._entries), self._bytes
