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
a ``Fetched`` the caller holds, the tensors of a ``raw`` entry decoded in place, which view it).

The server's read arena (``LeasedArena``) is viewed in place too; when the client closes, the
pages its caller's views still show become the process's own before the leases go back
(``LeasedArena.close``), so what a closed client returned never changes under its caller;
likewise in a child of ``fork()``, for the views of both (``kdn.client.forked``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdn.client import cudahost, forked
from kdn.client.forked import keep_pages
from kdn.errors import Cancelled, DeadlineExceeded, KDNError, Unavailable
from kdn.transport import directory
from kdn.transport.regions import ALIGN, RegionAllocator

log = logging.getLogger(__name__)

NONCE_BYTES = 16
__all__ = ["ALIGN", "LeasedArena", "RegionAllocator", "SharedSegment", "unanswered"]


def unanswered(exc: BaseException) -> bool:
    """Whether a call that ended with ``exc`` may still be acted on by the server: it did not
    answer it (a deadline passed, the call was lost or cancelled, or it failed in this process
    with something other than an error the server sent). An error the server answered with
    (``KDNError.answered``: a disk tier that refused the write is UNAVAILABLE too) is an
    answer: the server is done with the call's regions."""
    if isinstance(exc, KDNError) and exc.answered:
        return False
    return not isinstance(exc, KDNError) or isinstance(exc, (DeadlineExceeded, Unavailable,
                                                             Cancelled))


def peer_of(conn: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of the Unix connection ``conn``, as the
    kernel saw it connect (``SO_PEERCRED``: pid 0 for a process of another pid namespace);
    None where that can not be asked."""
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    except (OSError, AttributeError):  # no SO_PEERCRED here
        return None
    return pid, uid


def server_watch(conn: socket.socket) -> Callable[[], bool] | None:
    """Whether the process at the other end of the Unix connection ``conn`` (a server) has
    exited, asked without waiting (a pidfd of it, closed with the function); None where that
    can not be known (no pidfd, a process of another pid namespace, this very process)."""
    peer = peer_of(conn)
    if peer is None:
        return None
    try:
        pid = peer[0]
        if pid <= 0 or pid == os.getpid():
            return None
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # no pidfd_open here
        return None

    def gone() -> bool:  # (poll, not select: any descriptor number)
        ask = select.poll()
        ask.register(fd, select.POLLIN)
        return bool(ask.poll(0))  # readable once the process exited

    weakref.finalize(gone, os.close, fd)
    return gone


class SharedSegment:
    """A sealed memfd mapped into this process, carved into regions (module docstring)."""

    def __init__(self, size: int) -> None:
        if size <= 4 * ALIGN:
            raise ValueError(f"a shared segment needs more than {4 * ALIGN} bytes, got {size}")
        self.size = size
        self.fd = os.memfd_create("kdn-client", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # or when dropped unclosed
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        try:  # the nonce first: never a segment of its size (and seals) that a zero nonce opens
            os.pwrite(self.fd, self.nonce, 0)
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            self._close_fd()
            raise
        self.array: np.ndarray[Any, Any] = np.frombuffer(self.map, dtype=np.uint8)
        self.regions = RegionAllocator(NONCE_BYTES, size)
        forked.track(self)  # its views private in a child of fork()
        self._owned: dict[int, weakref.finalize] = {}  # region start -> what frees it
        self._retiring: dict[int, weakref.finalize] = {}  # ... or retires it (``retire_owned``)
        self._cuda_registered: bool | None = None
        self.server_gone: Callable[[], bool] | None = None
        """Whether the server process the segment is attached to now has exited
        (``server_watch``; None: not known): regions retired meanwhile come back then."""

    @property
    def pid(self) -> int:
        return os.getpid()

    def give_back(self, offset: int, n: int, failed: BaseException | None = None) -> None:
        """Free [offset, offset + n), a region a call to the server named, once the call is
        over: unless it ended with ``failed``, an error that leaves the server free to act on
        the call still (``unanswered``): then the region is retired, not used again while
        that server process runs, since it may yet read it (a store of whatever the region
        holds by then, under the call's key) or write it (an entry read, over whatever the
        region holds by then)."""
        if failed is not None and unanswered(failed):
            self.retire(offset, n, type(failed).__name__)
        else:
            self.regions.free(offset, n)

    def retire(self, offset: int, n: int, why: str) -> None:
        """Keep [offset, offset + n) out of use (``give_back``) until the server process
        that may use it has exited (``server_gone``; for good where that is not known),
        saying so."""
        self._retire(offset, n, why, self.server_gone)

    def _retire(self, offset: int, n: int, why: str, until: Callable[[], bool] | None) -> None:
        self.regions.retire(offset, n, until)
        log.warning("kdn: %d bytes of the shared segment retired: the server did not answer "
                    "the call that named them (%s), and may still use them until it exits; %d "
                    "retired in all", n, why, self.regions.retired_bytes())

    def reclaim(self) -> None:
        """Take back the regions retired while attached to a server that has exited since."""
        back = self.regions.reclaim()
        if back:
            log.info("kdn: %d retired bytes of the shared segment in use again: the server "
                     "that might have used them has exited", back)

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
        self._owned[start] = weakref.finalize(owner, self._let_go, start, offset + n - start)
        return memoryview(owner)  # type: ignore[arg-type]

    def _let_go(self, start: int, n: int) -> None:
        self._owned.pop(start, None)
        self.regions.free(start, n)

    def retire_owned(self, start: int) -> None:
        """The region ``owned`` gave out from ``start`` is retired instead of freed when its
        views die (``give_back``: a call that named it went unanswered): until the server
        that may use it has exited, as ``retire``."""
        fin = self._owned.pop(start, None)
        got = fin.detach() if fin is not None else None
        if got is not None:
            owner, _, (at, n), _ = got
            later = weakref.finalize(owner, self._retire, at, n, "a staged entry's store",
                                     self.server_gone)  # (this server's, not a later one's)
            later.atexit = False
            self._retiring = {at: f for at, f in self._retiring.items() if f.alive}
            self._retiring[start] = later

    def make_private(self) -> bool:
        """In a child of ``fork()`` (``kdn.client.forked``): the pages of the regions that
        views still show become this process's own (the parent reuses the regions)."""
        live = [f.peek() for f in (*self._owned.values(), *self._retiring.values())]
        ranges = [got[2][:2] for got in live if got is not None]
        return self.map.closed or keep_pages(self.map, ranges, writable=True,
                                             copy_on_write=False)

    def holds(self, view: memoryview) -> bool:
        """Whether ``view`` lies in this segment's memory."""
        at = np.frombuffer(view, dtype=np.uint8).ctypes.data
        base = self.array.ctypes.data
        return base <= at and at + len(view) <= base + self.size

    def register_with_cuda(self) -> bool:
        """Page-lock the segment for CUDA (``cudaHostRegister``), once: tensors that view it
        are then pinned, and copies from them to the GPU run at the pinned rate with no staging
        copy. False where CUDA is not available or refuses."""
        if self._cuda_registered is None:
            self._cuda_registered = False
            try:
                import torch

                if torch.cuda.is_available():
                    self._cuda_registered = cudahost.register(self.array.ctypes.data, self.size)
            except (ImportError, RuntimeError, AttributeError):
                pass
        return self._cuda_registered

    def close(self) -> None:
        if self._cuda_registered:
            cudahost.unregister(self.array.ctypes.data)
        del self.array
        try:
            self.map.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass
        self._close_fd()


PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = 0x0010
CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
_PRESENT, _SWAPPED, _FILE_PAGE = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)


RESET_WHOLE_PAGES = 4
"""A released range of fewer pages than this is reset whole (``madvise`` alone) rather than
page by page after reading ``/proc/self/pagemap`` (~13 µs a range)."""
KEEP_BYTES = 64 << 20
"""Bytes of entries a client keeps leases on at most by default (and at most an eighth of the
arena, which the tenant's other clients share): a kept lease holds the entry's arena pages."""
KEEP_ENTRIES = 4096
"""Kept leases at most."""


@dataclass(frozen=True)
class Kept:
    """A kept lease: its entry at [offset, offset + length), valid while the arena's u64 at
    index ``word`` is ``generation``."""

    lease: int
    offset: int
    length: int
    word: int
    generation: int
    tier: str


class LeasedArena:
    """The server's read arena of this client's tenant (``kdn.server.arena``), mapped
    copy-on-write: views of leased entries are ordinary writable memory whose changes stay in
    this process. A lease is given back once no view of its entry is left (a finalizer queues
    it, the next GetMany carries it); before that, any page this process changed in the
    entry's range is reset to the arena's (``MADV_DONTNEED`` on a private mapping), so that
    the range shows the server's bytes again when it is read again or reused for another
    entry. One entry is viewed in place by one read at a time: a read of an entry that an
    earlier read's views still show gets a copy of the arena's bytes (read through a second,
    shared read-only mapping), so two results never alias each other. At ``close`` the pages
    that views still show are made this process's own (their bytes as they are), so that
    the leases can go back while the views live on."""

    def __init__(self, fd: int, size: int, keep_bytes: int | None = None) -> None:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & F_SEAL_FUTURE_WRITE or not seals & fcntl.F_SEAL_SHRINK:
                raise ValueError(f"the read arena is not sealed against writes and shrinking "
                                 f"(seals {seals:#x})")
            st = os.fstat(fd)
            if st.st_size != size:
                raise ValueError(f"the read arena has {st.st_size} bytes, the server says {size}")
            self.inode = st.st_ino
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._pristine = mmap.mmap(fd, size, prot=mmap.PROT_READ)  # the server's bytes
        finally:
            os.close(fd)  # the mapping keeps the memfd
        self.size = size
        self.array: np.ndarray[Any, Any] = np.frombuffer(self.map, dtype=np.uint8)
        self._first_page = self.array.ctypes.data // PAGE
        self._source: np.ndarray[Any, Any] = np.frombuffer(self._pristine, dtype=np.uint8)
        self._words: np.ndarray[Any, Any] = self._source[: size // 8 * 8].view(np.uint64)
        self._directory = directory.read_geometry(self._words, size) \
            if directory.ORDERED_STORES else None
        """(first word, sets) of the arena's directory (``kdn.transport.directory``); None
        where the server lists no entries, or this machine's stores may be seen out of order."""
        self.found = 0
        """Reads answered from the directory (no call)."""
        self._found: list[int] = []  # their slots' generations, not yet reported
        self.keep_bytes = min(KEEP_BYTES, size // 8) if keep_bytes is None else keep_bytes
        """Bytes of entries whose leases this client keeps to read again without a call."""
        self._kept: OrderedDict[Hashable, Kept] = OrderedDict()  # least recently read first
        self._kept_leases: set[int] = set()
        self._kept_total = 0
        self._views: dict[int, int] = {}  # lease -> its views alive (in place or read-only)
        self.reused = 0
        """Reads answered from a kept lease (no call)."""
        self._gone: deque[tuple[int, int, int]] = deque()  # (lease, offset, length): no view
        self._gone_clean: deque[tuple[int, int, int]] = deque()  # read-only views that died
        self._live: dict[int, tuple[int, int]] = {}  # offset -> (lease, length) of the entry
        # viewed in place there
        self._shown: dict[tuple[int, int], int] = {}  # (offset, length) -> read-only views
        self._ready: list[int] = []  # leases whose pages are the arena's again
        self._lock = threading.Lock()
        self.closed = False
        """Closed (``close``): its server went (``SameHostPath.renew``) or the client closed."""
        self._cuda_registered: bool | None = None
        try:
            self._pagemap: int | None = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._pagemap = None  # every released range is then reset whole
        else:  # at close, or when the arena dies unclosed (a client dropped without close)
            self._close_pagemap = weakref.finalize(self, os.close, self._pagemap)
        forked.track(self)  # its views private in a child of fork()

    def view(self, lease: int, offset: int, length: int, *, pinned: bool = False
             ) -> memoryview:
        """The leased entry at [offset, offset + length): viewed in place, or a copy where
        another read's views show it still. ``pinned`` (an entry bound for a GPU): a
        read-only view of the server's pages, page-locked for CUDA (``register_with_cuda``),
        where CUDA takes the registration; the lease goes back when the view dies."""
        if offset + length > self.size or length <= 0:
            raise ValueError(f"lease {lease} at [{offset}, {offset + length}) outside the "
                             f"read arena of {self.size} bytes")
        if self.closed:
            raise ValueError("the read arena was closed (its server went)")
        self._settle()  # ranges whose views went since: their pages are the arena's again
        pinned = pinned and self.register_with_cuda()
        with self._lock:
            if self.closed:
                raise ValueError("the read arena was closed (its server went)")
            return self._view(lease, offset, length, pinned)

    def _view(self, lease: int, offset: int, length: int, pinned: bool) -> memoryview:
        """``view``'s; call with the lock held (a kept lease is not given back meanwhile)."""
        if pinned:  # nothing of this process in its pages: ready as soon as it dies
            source = self._source[offset : offset + length]
            self._views[lease] = self._views.get(lease, 0) + 1
            self._shown[offset, length] = self._shown.get((offset, length), 0) + 1
            weakref.finalize(source, self._gone_clean.append, (lease, offset, length))
            return memoryview(source)  # type: ignore[arg-type]
        if offset in self._live:  # another read's views show it: a copy of the arena's bytes
            room = np.empty(length + ALIGN, dtype=np.uint8)
            at = (offset - room.ctypes.data) % ALIGN  # the arena's alignment, for the frames
            np.copyto(room[at : at + length], self._source[offset : offset + length])
            if not self._views.get(lease) and lease not in self._kept_leases:
                self._ready.append(lease)  # nothing of this process is in its pages
            return memoryview(room)[at : at + length]  # type: ignore[arg-type]
        self._live[offset] = (lease, length)
        self._views[lease] = self._views.get(lease, 0) + 1
        owner = self.array[offset : offset + length]
        weakref.finalize(owner, self._gone.append, (lease, offset, length))
        return memoryview(owner)  # type: ignore[arg-type]

    def register_with_cuda(self) -> bool:
        """Page-lock the arena's read-only mapping for CUDA, once (``cudaHostRegister`` with
        ``cudaHostRegisterReadOnly``: the pages are the server's, this process may not write
        them): host-to-device copies from its views then run at the pinned rate. False where
        CUDA is not available or refuses."""
        if self._cuda_registered is None:
            self._cuda_registered = False
            try:
                import torch

                if torch.cuda.is_available():
                    self._cuda_registered = cudahost.register(
                        self._source.ctypes.data, self.size, CUDA_HOST_REGISTER_READ_ONLY)
            except (ImportError, RuntimeError, AttributeError):
                pass
        return self._cuda_registered

    def _settle(self) -> None:
        """Reset the pages of the entries whose views are gone; their leases become ready
        (unless kept)."""
        while True:  # read-only views first: no page to reset (their finalizers append
            try:         # without the lock: one may run while this thread holds it)
                clean, offset, length = self._gone_clean.popleft()
            except IndexError:
                break
            with self._lock:
                n = self._shown.pop((offset, length), 0) - 1
                if n > 0:
                    self._shown[offset, length] = n
                self._unview(clean)
        while True:
            try:
                lease, offset, length = self._gone.popleft()
            except IndexError:
                return
            self._reset(offset, length)
            with self._lock:
                if self._live.get(offset) == (lease, length):
                    del self._live[offset]
                self._unview(lease)

    def _unview(self, lease: int) -> None:
        """A view of ``lease`` is gone (its pages reset): the lease is ready once it has no
        view left and is not kept. Call with the lock held."""
        n = self._views.get(lease, 0) - 1
        if n > 0:
            self._views[lease] = n
            return
        self._views.pop(lease, None)
        if lease not in self._kept_leases:
            self._ready.append(lease)

    # -- kept leases (``kdn.server.arena``: reads without a call) ----------------------------

    def keep(self, name: Hashable, lease: int, offset: int, length: int, at: int,
             generation: int, tier: str) -> None:
        """Keep ``lease`` (an answer's, before it is viewed) to answer later reads of ``name``
        while the arena's word at ``at`` holds ``generation``; the least recently read kept
        leases go back past ``keep_bytes``."""
        if not generation or length > self.keep_bytes or at % 8 or at + 8 > self.size or \
                not at <= offset < offset + length <= self.size:
            return
        with self._lock:
            self._drop_kept(name)
            self._kept[name] = Kept(lease, offset, length, at // 8, generation, tier)
            self._kept_leases.add(lease)
            self._kept_total += length
            while self._kept_total > self.keep_bytes or len(self._kept) > KEEP_ENTRIES:
                self._drop_kept(next(iter(self._kept)))

    def reuse(self, name: Hashable, *, pinned: bool = False) -> tuple[memoryview, str] | None:
        """(a view of ``name``'s entry, its tier) from a kept lease whose entry is still the
        server's value of the key; None when there is none (ask the server)."""
        if not self._kept or self.closed:
            return None
        self._settle()
        pinned = pinned and self.register_with_cuda()
        with self._lock:
            kept = self._kept.get(name)
            if kept is None or self.closed:
                return None
            if int(self._words[kept.word]) != kept.generation:  # written again or deleted
                self._drop_kept(name)
                return None
            self._kept.move_to_end(name)
            self.reused += 1
            return self._view(kept.lease, kept.offset, kept.length, pinned), kept.tier

    @property
    def has_directory(self) -> bool:
        return self._directory is not None

    def find(self, namespace: str, key: bytes) -> tuple[memoryview, int] | None:
        """A copy of the server's value of ``key`` in ``namespace`` where the arena's
        directory lists it (``kdn.transport.directory``: read without a call, never a value
        the server no longer holds, never torn), and its slot's generation (``served``
        once the copy is handed out); None where it does not (ask the server)."""
        if self._directory is None or self.closed:
            return None
        name = directory.tag(namespace, key)
        with self._lock:  # ``close`` drops the arrays under it
            if self.closed:
                return None
            return directory.find(self._words, self._source, *self._directory, name,
                                  self.size)

    def served(self, generation: int) -> None:
        """A copy ``find`` gave (of the slot of ``generation``) was handed out: reported
        to the server with a later call."""
        with self._lock:
            self.found += 1
            self._found.append(generation)

    def reads_to_report(self, *, at_least: int = 0) -> list[int]:
        """The generations of the entries read from the directory since the last report
        (``GetManyRequest.read_listed``: the server counts them as served), when there are
        at least ``at_least`` of them; [] otherwise."""
        with self._lock:
            if len(self._found) < max(at_least, 1):
                return []
            out, self._found = self._found, []
        return out

    def pressed(self) -> bool:
        """Whether the server asks for kept leases back (its arena is full: the header's
        pressure word, ``kdn.server.arena``)."""
        return not self.closed and bool(self._words[0])

    def forget(self) -> None:
        """Give every kept lease back (their reads ask the server again)."""
        with self._lock:
            for name in list(self._kept):
                self._drop_kept(name)

    @property
    def kept_bytes(self) -> int:
        return self._kept_total

    def _drop_kept(self, name: Hashable) -> None:
        """Give ``name``'s kept lease back (once no view of it is left). Call with the lock
        held."""
        kept = self._kept.pop(name, None)
        if kept is None:
            return
        self._kept_leases.discard(kept.lease)
        self._kept_total -= kept.length
        if not self._views.get(kept.lease):
            self._ready.append(kept.lease)  # its pages were reset when its last view went

    def take(self) -> list[int]:
        """Leases to give back now: their views are gone and their pages reset (none once
        closed: its server went)."""
        if self.closed:
            return []
        self._settle()
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def give_back(self, leases: list[int]) -> None:
        """``take``'s leases, when the call that carried them failed: sent with the next."""
        with self._lock:
            self._ready.extend(leases)

    def _reset(self, offset: int, length: int) -> None:
        """Drop this process's private copies of pages in [offset, offset + length)."""
        first, last = offset // PAGE, (offset + length - 1) // PAGE
        if self._pagemap is None or last - first < RESET_WHOLE_PAGES:  # a few pages: dropped
            # whole, a refault each is cheaper than reading which ones are this process's
            self.map.madvise(mmap.MADV_DONTNEED, first * PAGE, (last - first + 1) * PAGE)
            return
        raw = os.pread(self._pagemap, 8 * (last - first + 1), 8 * (self._first_page + first))
        entry = np.frombuffer(raw, dtype=np.uint64)
        # a page of ours: present and not the arena's page, or swapped out (only private
        # pages go to swap from a private mapping; the arena's own pages stay the memfd's)
        changed = np.flatnonzero((entry & _PRESENT != 0) & (entry & _FILE_PAGE == 0)
                                 | (entry & _SWAPPED != 0))
        if not len(changed):
            return
        runs = np.split(changed, np.flatnonzero(np.diff(changed) != 1) + 1)
        for run in runs:  # copied-on-write pages: the next read maps the arena's page again
            self.map.madvise(mmap.MADV_DONTNEED, (first + int(run[0])) * PAGE, len(run) * PAGE)

    def close(self) -> bool:
        """Stop reading the arena. The pages that views still alive show become this
        process's own, with the bytes they show (``_keep``): the leases can then be given
        back (``Detach``) and the server reuse those pages while what the caller holds stays
        as it was read. False where some could not be (their leases must stay held)."""
        if self.closed:
            return True
        self._settle()  # views gone since: their pages are not kept
        with self._lock:
            if self.closed:
                return True
            self.closed = True
            self._kept.clear()
            self._kept_leases.clear()
            self._kept_total = 0
            in_place = [(offset, length) for offset, (_, length) in self._live.items()]
            read_only = list(self._shown)
        if self._pagemap is not None:
            self._pagemap = None
            self._close_pagemap()
        if self._cuda_registered:
            cudahost.unregister(self._source.ctypes.data)
        kept = self._own(in_place, read_only)
        del self.array, self._source, self._words
        for m in (self.map, self._pristine):
            try:
                m.close()
            except BufferError:  # views still alive: the mapping goes when they do
                pass
        return kept

    def _own(self, in_place: list[tuple[int, int]], read_only: list[tuple[int, int]]) -> bool:
        """``forked.keep_pages`` of the ranges of views in place and of read-only views."""
        return keep_pages(self.map, in_place, writable=True, copy_on_write=True) & \
            keep_pages(self._pristine, read_only, writable=False, copy_on_write=False)

    def make_private(self) -> bool:
        """In a child of ``fork()`` (``kdn.client.forked``): the pages that views still show
        become this process's own, as at ``close`` (the leases are the parent's)."""
        if self.closed:  # its views' pages are this process's own already
            return True
        return self._own([(at, n) for at, (_, n) in list(self._live.items())], list(self._shown))
