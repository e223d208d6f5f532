"""Buffers for large entries, recycled once nothing refers to them.

Two users: the server receives a large Store or PutMany into one buffer that becomes the RAM
tier's value; the client decodes a verbatim entry it did not read in place (the in-process
tier, a stream) into one buffer its tensors view (``kdn.codec.inplace``, ``StreamDecoder``).
Fresh anonymous memory is slow to write the first time: every page faults and is zeroed (in
4 KiB pages 1.2–1.9 GB/s on this project's machine; in the 2 MiB pages numpy asks for,
12 GB/s once the kernel has them, 0.3 GB/s while it compacts memory to make them), and freeing
it unmaps every page again. A cache at capacity frees about as many bytes as it stores
(overwrites, evictions, deletes), so the buffers of entries that left are the obvious place for
the next ones: the peers do the same with memory pools allocated up front.

    pool = BufferPool(keep_bytes=1 << 30)
    buf = pool.take(n)             # writable numpy uint8 array of exactly n bytes
    buf[:] = ...; value = memoryview(buf).toreadonly()

Life of a buffer: ``take`` hands out a view of a pooled or new numpy array (``np.empty``: pages
are taken as they are written, in huge pages where the kernel offers them) and watches the view
(``on_release``). Everything that reads the entry (the RAM tier's value, frames being sent, a
queued write to a lower tier, a segment copy; on the client, the tensors of a decoded entry)
holds a memoryview or array derived from
that view, which keeps it alive: the watch fires only when the last reader let go; the array then
goes back to the free list (up to ``keep_bytes``; beyond that it is freed). A buffer is never
written while any view of its previous use exists. Derive from the view through a memoryview
(``memoryview(view)[a:b]``): a numpy slice of it refers to the pool's base array, not to the
view, and does not keep the view alive.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kdn.errors import TooLarge
from kdn.pools import SharedPool

MIN_BYTES = 1 << 20
"""Smaller buffers are plain arrays, not pooled (malloc reuses their memory)."""
_GRAIN = 1 << 20
_SLACK = 1.25
"""A free buffer serves a request of at least 1/_SLACK of its size."""


class _Release(weakref.ref):  # type: ignore[type-arg]
    """``on_release``'s weakref: kept in ``_WATCHED`` until its referent goes (hashed by
    identity: a numpy array, its usual referent, has no hash)."""

    __slots__ = ("fn", "arg")
    __hash__ = object.__hash__
    __eq__ = object.__eq__  # type: ignore[assignment]
    fn: Any
    arg: object


_WATCHED: set[_Release] = set()


def _released(ref: _Release) -> None:
    _WATCHED.discard(ref)
    ref.fn(ref.arg)


def on_release(obj: object, fn: Any, arg: object) -> None:
    """Call ``fn(arg)`` once ``obj`` is gone, on whichever thread drops its last reference (so
    ``fn`` must be safe to run at any allocation, also under its owner's locks). One object per
    watch, where ``weakref.finalize`` makes five that the garbage collector then walks: a
    same-host PutMany of 64 entries left ~590 of them behind, one young-generation collection
    per call."""
    ref = _Release(obj, _released)
    ref.fn, ref.arg = fn, arg
    _WATCHED.add(ref)


class BufferPool:
    """Thread-safe; release watches (``on_release``) may fire on any thread, at any
    allocation."""

    def __init__(self, keep_bytes: int,
                 ahead: Callable[[int], np.ndarray[Any, Any] | None] | None = None) -> None:
        self.keep_bytes = max(0, keep_bytes)
        self.ahead = ahead
        """Asked first for a new buffer's memory (``kdn.transport.prefault.PrefaultedHeap.take``:
        memory faulted in ahead of demand, which goes back to it by itself); None: no such
        source."""
        self._free: list[np.ndarray[Any, Any]] = []
        self._free_bytes = 0
        self._lock = threading.RLock()  # a release can fire inside take() on this thread
        self.reused = 0
        self.created = 0

    def take(self, size: int, *, written_now: bool = False) -> np.ndarray[Any, Any]:
        """A writable uint8 array of ``size`` bytes, its memory pooled or new (below
        ``MIN_BYTES``: a plain array). ``written_now``: the caller writes all of it at once
        (bytes it already has), so new memory is faulted in whole first (``populate``); never
        for a size a peer declared, which it may not send (the memory would be taken for
        nothing). TooLarge where the host can not allocate it."""
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        try:
            return self._take(size, written_now)
        except MemoryError:  # numpy's _ArrayMemoryError too: not a bare UNKNOWN to the peer
            raise TooLarge(f"{size} bytes can not be allocated on this host now (a value "
                           "that large, or memory short)") from None

    def _take(self, size: int, written_now: bool) -> np.ndarray[Any, Any]:
        if size < MIN_BYTES:
            return np.empty(size, dtype=np.uint8)
        if self.ahead is not None:
            got = self.ahead(size)
            if got is not None:
                self.reused += 1
                return got
        base = self._pop(size)
        if base is None:
            base = np.empty(-(-size // _GRAIN) * _GRAIN, dtype=np.uint8)
            if written_now:
                populate(base[:size])
            self.created += 1
        else:
            self.reused += 1
        view = base[:size]
        on_release(view, self._give_back, base)
        return view

    def _pop(self, size: int) -> np.ndarray[Any, Any] | None:
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                if size <= len(buf) <= size * _SLACK + _GRAIN and (
                        best is None or len(buf) < len(self._free[best])):
                    best = i
            if best is None:
                return None
            buf = self._free.pop(best)
            self._free_bytes -= len(buf)
            return buf

    def _give_back(self, buf: np.ndarray[Any, Any]) -> None:
        if len(buf) > self.keep_bytes:
            return  # never kept: freed with its last reference
        with self._lock:
            while self._free_bytes + len(buf) > self.keep_bytes:
                old = self._free.pop(0)  # the oldest go first: the newest match recent sizes
                self._free_bytes -= len(old)
            self._free.append(buf)
            self._free_bytes += len(buf)

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


RECEIVED = BufferPool(keep_bytes=256 << 20)
"""The client side's pool (one per process): large entries a client receives whole over
gRPC (``Client.fetch``, past ``kdn.client.received.KEEP_MESSAGES_BYTES``) and the decoded
copies of verbatim entries (``kdn.codec.inplace``, ``StreamDecoder``'s arena). An engine
that loads entries, moves them into its own KV memory and drops them gets the next ones in
memory that is already faulted in."""


MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14: fault pages in writable, data kept
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def libc_madvise() -> Any:
    """libc's ``madvise`` through ctypes (the GIL free while the kernel works); None where
    there is none."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def populate(array: np.ndarray[Any, Any]) -> None:
    """Fault a new buffer's whole pages in with one call (``MADV_POPULATE_WRITE``) rather than
    one page fault at a time as it is first written (a 1 MiB buffer: ~0.57 ms written as it
    is faulted in, ~0.45 ms populated first, ~0.07 ms once its pages are in). Does nothing
    where the kernel (before 5.14) or libc lacks it."""
    madvise = libc_madvise()
    start = array.ctypes.data
    first, end = -(-start // _PAGE) * _PAGE, (start + array.nbytes) // _PAGE * _PAGE
    if madvise is not None and end > first:
        madvise(first, end - first, MADV_POPULATE_WRITE)


_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # <linux/mman.h>


@functools.cache
def _libc_maps() -> Any:
    """libc with ``mmap``, ``mprotect``, ``mremap`` and ``munmap`` typed; None where there is
    none (or no ``mremap``: Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {"mmap": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long], ctypes.c_void_p),
                 "mprotect": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int),
                 "mremap": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_void_p], ctypes.c_void_p),
                 "munmap": ([ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)}
        for name, (args, result) in calls.items():
            fn = getattr(libc, name)
            fn.argtypes, fn.restype = args, result
    except (OSError, AttributeError):
        return None
    return libc


def own_pages(address: int, length: int, *, writable: bool) -> bool:
    """Swap the whole pages at [address, address + length) of a mapping for anonymous pages of
    this process that hold the same bytes (read-only unless ``writable``), in one step: a
    copy is made aside, then moved over them (``mremap``), so a reader of that memory sees the
    old bytes, then the copy, never a gap; the mapping's file may then change under it
    unseen. False where that is not possible (the memory is left as it was)."""
    libc = _libc_maps()
    if libc is None or address % _PAGE or length % _PAGE or length <= 0:
        return False
    aside = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if aside in (None, ctypes.c_void_p(-1).value):
        return False
    ctypes.memmove(aside, address, length)
    if (writable or libc.mprotect(aside, length, mmap.PROT_READ) == 0) and \
            libc.mremap(aside, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED,
                        address) == address:
        return True
    libc.munmap(aside, length)
    return False


MMAP_THRESHOLD = 32 << 20
"""glibc serves allocations below this from its heaps (the most it accepts: 32 MiB)."""
TRIM_THRESHOLD = 128 << 20
"""glibc gives the free top of a heap back to the kernel past this many bytes (a client's
setting; a server keeps more, ``server_trim_bytes``)."""
SERVER_TRIM_THRESHOLD = 512 << 20
"""The most free heap a server keeps (``server_trim_bytes``)."""
SERVER_ARENAS = 4
"""The glibc heaps (arenas) the threads of a ``kdn serve`` process allocate from
(``tune_allocator``; not where a server runs inside another process, ``ServerThread``). Each
keeps up to the trim threshold free, and glibc makes up to eight per core: under six clients storing
and fetching 16 MiB entries, a server with a 64 MiB RAM tier held 714-921 MiB after four
rounds, kept once the clients left; with four arenas 452 MiB (one run), with two 355-454 MiB.
Four, not two: fewer heaps mean more threads waiting on one heap's lock, unmeasured on a
many-core host. Throughput on two cores with two: 1 MiB entries 922-936 calls/s against
685-873, 128 KiB and 16 MiB ones within the noise. ``MALLOC_ARENA_MAX`` overrides."""
_tuned: bool | None = None
_trim = 0  # the trim threshold set in this process (0: none)
_arenas = 0  # the arenas capped in this process (0: glibc's default)


def server_trim_bytes(ram_bytes: int) -> int:
    """The trim threshold a server with a RAM tier of ``ram_bytes`` sets: half the tier, from
    ``TRIM_THRESHOLD`` to ``SERVER_TRIM_THRESHOLD``. A server keeps a large Store in the
    messages it came in (``kdn.store.framed.framed_limit``); when the entry it replaces is
    freed, its memory must stay in the heap for the next one's messages, or every Store
    faults in its whole size again (a 189 MB SmolLM2 Store under a 128 MiB threshold:
    5,000-11,000 page faults, and 0.80 GB/s where a copy into kept memory runs at 1.16). A
    process's memory then falls back only by what lies free past this threshold, never below
    what it held at its peak: a full RAM tier holds as much anyway."""
    return max(TRIM_THRESHOLD, min(SERVER_TRIM_THRESHOLD, ram_bytes // 2))


def tune_allocator(trim_bytes: int = TRIM_THRESHOLD, arenas: int = 0) -> bool:
    """Keep the allocator from mapping and unmapping memory for every message of an entry.

    gRPC hands each received message to Python as a fresh bytes object. With glibc's defaults
    a 1 MiB one either comes from an mmap of its own (the threshold starts at 128 KiB and only
    rises once such a block is freed) or from the top of a heap that is trimmed whenever more
    than twice that lies free, so whether every message faults in 256 fresh pages depends on
    the heap's history: a 1 MiB fetch took 0.9–1.2 ms in some client processes and 1.9–2.1 ms
    in others, from one process start to the next (never within one). Fixed thresholds
    (``MMAP_THRESHOLD``, ``trim_bytes``) make every process the fast kind. Called by
    ``Client`` (``TRIM_THRESHOLD``), the server (``server_trim_bytes``) and ``kdn serve``
    (``SERVER_ARENAS``:
    ``arenas``, where set, caps glibc's heaps, each of which keeps that much free);
    process-wide: a later call only ever raises the trim threshold, and the first cap
    stays. ``KDN_MALLOC_TUNING=off`` leaves the
    allocator alone. True when the thresholds are set (glibc), False elsewhere or when
    turned off."""
    global _tuned, _trim, _arenas
    if _tuned is None:
        _tuned = False
        if os.environ.get("KDN_MALLOC_TUNING", "").strip().lower() in ("0", "off", "false",
                                                                        "no"):
            return False
        mallopt = _mallopt()
        if mallopt is None:
            return False
        _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if _tuned and trim_bytes > _trim:
        _tuned = bool(_mallopt()(_M_TRIM_THRESHOLD, trim_bytes))  # tuned: glibc's, cached
        _trim = trim_bytes if _tuned else 0
    if _tuned and arenas and not _arenas and "MALLOC_ARENA_MAX" not in os.environ:
        _arenas = arenas if _mallopt()(_M_ARENA_MAX, arenas) else 0
    return _tuned


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # <malloc.h>


@functools.cache
def _mallopt() -> Any:
    """glibc's ``mallopt``; None elsewhere (musl's does nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def allocator_tuned() -> bool:
    """Whether ``tune_allocator`` set the thresholds in this process (it is not called here)."""
    return bool(_tuned)


def kept_free_bytes() -> int:
    """The free heap this process's allocator keeps: the trim threshold ``tune_allocator``
    set; ``TRIM_THRESHOLD`` where it set none."""
    return _trim or TRIM_THRESHOLD


OVERLAP_FRAME_BYTES = 1 << 20
"""A frame from this size is decoded (a ``LayerStream``) or copied into its entry's buffer and
checked (a Store past ``kdn.store.framed.framed_limit``) on worker threads while the next
message arrives; smaller ones where they arrive. From about 1 MiB the overlap pays: large
fetches and stores gain about a tenth of the raw stream's rate; below it the hand-over costs
more than it saves (380 KB frames of 512 SmolLM2 tokens lose ~5%)."""
BACKGROUND_CHECK_BYTES = 8 << 20
"""A Store frame from this size is hashed on ``copy_threads`` while the next message arrives
(on the event loop's thread, its ~0.5 ms a MiB would hold up every other call); smaller ones
are hashed there the moment they are whole, while in cache (for frames of ~1 MB that is as
fast as handing them to the threads, and leaves the threads to the large ones)."""
COPIES_IN_FLIGHT = 4
"""Frames of one stream at most whose checks wait on ``copy_threads``."""
_COPY_THREADS = SharedPool(max(2, os.cpu_count() or 2), "kdn-copy")


def copy_threads() -> ThreadPoolExecutor:
    """The threads frames are copied and checked on beside their streams (numpy and xxhash
    run without the GIL), one per core: streams read or written side by side copy side by
    side, as they did on their own threads (a stream's frames land at their own offsets, in
    any order)."""
    return _COPY_THREADS.get()
