"""Read arenas: RAM-tier entries handed to same-host clients without copying them per read.

A same-host client that attached a segment (``kdn.server.batch``) may ask GetMany to answer
with leases (``GetManyRequest.lease``). The server then keeps a copy of each RAM-tier entry it
answers in its tenant's ``Arena`` (a sealed memfd, one per tenant, created on first use) and
answers with the entry's range there and a lease number instead of copying the entry into the
client's segment. A hot entry is copied (and its checksums checked) once, when it enters the
arena; its later reads move no bytes at all.

Who sees what: the arena's descriptor is handed over the fast-path socket (SCM_RIGHTS) only to
a caller that names an attached segment of that tenant (``kdn.server.fastpath``), so a client
maps only its own tenant's arena, and every offset it is given is in that arena. The memfd is
sealed against writes from anyone but the server (``F_SEAL_FUTURE_WRITE``: only the mapping the
server made before sealing can write), against resizing, and against new seals: a client can
map it read-only or copy-on-write, never change what other clients read.

Why a read never mixes two values: an entry's range is reused only once no lease on it is
left. A lease is held per segment (``Segment.leases``) until the client releases it
(``GetManyRequest.release``, sent when its views are gone), or until the segment is detached
or its process exits. A key written again or deleted drops the arena's copy from the index
(``drop``): leases already given keep the old bytes readable, whole; new reads are answered
from the new value (the RAM tier's stamp names the value a copy was made from). When the arena
is full, the least recently read entries nobody holds are dropped; when all are held, the read
falls back to a copy into the client's segment.

Reads without a call (kept leases): each slot starts with a u64 word, the slot's generation
(unique in the arena) while the slot is the index's copy of its key, 0 from the moment it is
dropped (the key written again, deleted or evicted by an admin: ``drop``, before the call that
changed the key answers). A lease answered with a generation (``EntryRef.generation``, and
where its word is, ``generation_at``) may be kept by the client, which reads the entry again
from its mapping, without asking, as long as the word still holds the generation; the pages
stay the entry's since the lease holds them. Entries with a time to live get none (their
expiry would pass unseen). Such reads are the client's own: the server does not count them.
The arena's first page is its header: its first u64 is 1 while the arena is under pressure (a
read found no room, every entry held) and 0 again once a quarter of it is free; a client that
sees 1 gives back the leases it keeps (with its next call).

Reads without a call of entries never read before (the directory, ``kdn.transport.directory``):
the header's words 1-3 announce a table after the header page that lists small slots (under
``LIST_BELOW_BYTES``) by their namespace and key, with their generation and range. A small
entry is copied into the arena and listed when it is stored (``list_small``, from
``kdn.server.ingest``) or answered inline to a same-host client (``kdn.server.batch``), and
when it is leased; only while it is the RAM tier's value with no time to live, checked under
the key's entry lock. Dropping a slot empties its bucket too. A client copies a listed entry out
between two checks of the slot's word, so it never holds a dropped value. An arena too small to
spare 1/64 of itself keeps no directory.

Same-host stores live here too: a PutMany entry of ``kdn.server.batch.ARENA_STORE_BYTES`` or
more is copied out of the client's segment straight into a slot of its tenant's arena
(``reserve``; checked as it is copied, as any PutMany) and the RAM tier keeps it as a view of
that slot, which holds one
lease until the RAM tier lets the value go; once stored the slot is indexed under the value's
stamp (``publish``), so the entry's first same-host read copies nothing. Such slots take half
the arena at most (past that, entries go to the server's own buffers), so reads of other
entries always have room to be copied in.

Bounded: ``shm_arena_bytes`` per tenant that attached a segment (0 = off). This is memory on
top of ``ram_bytes``: the arena holds a second copy of the tenant's hottest entries.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdn.codec.format import header_size
from kdn.errors import Corrupt
from kdn.keys import split_store_key
from kdn.store.tiered import TieredStore
from kdn.transport import directory
from kdn.transport.buffers import MADV_POPULATE_WRITE, libc_madvise, on_release
from kdn.transport.regions import RegionAllocator

PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = 0x0010
"""Linux 5.1: no new writable shared mapping and no write(2); mappings made before stay
writable (fcntl does not name it)."""
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
FRAME_ALIGN = 64
"""An entry's first frame starts at a multiple of this in the arena (tensors view raw bodies
in place, ``kdn.codec.inplace``)."""
WARM_STEP = 4 << 20
"""Bytes of the arena ``Arena._warm`` faults in at a time."""
WORD = 8
_GOLDEN = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1
"""Bytes of a slot's generation word, at the slot's first (page-aligned) byte."""


def _pages(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(eq=False)
class Slot:
    """One entry's copy in an arena: ``length`` bytes at ``offset`` (inside the slot's pages
    [``start``, ``start`` + ``size``), which no other slot shares)."""

    arena: Arena
    skey: bytes
    stamp: int
    start: int
    size: int
    offset: int
    length: int
    leases: int = 0
    indexed: bool = True
    """Still the arena's copy for ``skey`` (False: dropped; freed at its last release)."""
    generation: int = 0
    """Written at ``start`` while indexed (module docstring); unique in the arena."""
    bucket: int = -1
    """The directory bucket (word index) that lists it; -1: not listed (``Arena.enlist``)."""


def _unstore(slot: Slot) -> None:
    """The entry ``Arena.reserve`` handed out is gone from the store: its lease goes, by the
    arena's next call that takes the lock (this runs on any thread, at any allocation: also
    on one that holds the lock)."""
    slot.arena._unstored.append(slot)


class Arena:
    """One tenant's read arena: a sealed memfd, its allocator and index (module docstring)."""

    def __init__(self, tenant: str, size: int) -> None:
        if size < PAGE:
            raise ValueError(f"an arena needs at least one page, got {size} bytes")
        self.size = size // PAGE * PAGE
        self.fd = os.memfd_create(f"kdn-arena-{tenant}"[:200],
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)  # before the seal: stays writable
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        self.array: np.ndarray[Any, Any] = np.frombuffer(self._map, dtype=np.uint8)
        self._words: np.ndarray[Any, Any] = self.array.view(np.uint64)  # aligned 8-byte stores
        self._generations = itertools.count(1)
        self._salt = secrets.randbits(64)
        self._stored = 0  # bytes of slots the RAM tier holds (``reserve``)
        self._unstored: deque[Slot] = deque()  # theirs that went, their leases not yet given
        dir_at, self._sets = directory.geometry(self.size, PAGE)
        self._dir_first = dir_at // WORD
        dir_end = dir_at + directory.directory_bytes(self._sets, PAGE)
        if (dir_end - dir_at) * directory.SHARE > self.size:  # too small to spare one: none
            dir_end, self._sets = PAGE, 0
        else:
            self._words[directory.HEADER_OFFSET] = dir_at
            self._words[directory.HEADER_SETS] = self._sets
            self._words[directory.HEADER_MAGIC] = directory.MAGIC
        self._listed: dict[int, Slot] = {}  # directory bucket -> the slot it lists
        self._by_generation: dict[int, Slot] = {}  # the listed slots by generation
        self._next_way = 0
        self._data_start = dir_end
        self._regions = RegionAllocator(dir_end, self.size)  # the first page: the header
        self.listed = 0
        self._index: OrderedDict[bytes, Slot] = OrderedDict()  # least recently read first
        self._lock = threading.Lock()
        self.hits = self.fills = self.full = 0
        self._mapped = threading.Lock()  # held by each warming step and by ``close``
        self._closed = False
        self.warmed = threading.Event()
        threading.Thread(target=self._warm, args=(self.array.ctypes.data,),
                         name=f"kdn-arena-warm-{tenant}"[:60], daemon=True).start()

    def _warm(self, base: int) -> None:
        """Fault every page of the arena in, ``WARM_STEP`` at a time, off every request's
        path. A fill writing into pages the memfd never had allocates and zeroes each one
        first, which costs several times the copy itself, so every first read of the arena's
        first pass would pay it (the peers' stores allocate their segments up front).
        ``MADV_POPULATE_WRITE`` keeps what pages hold (fills may run meanwhile), through
        ctypes so that the GIL is free while the kernel works; where the kernel lacks it
        (before 5.14), ``posix_fallocate`` allocates them (fills then map them). The arena's
        memory is thus taken once it is made, as ``shm_arena_bytes`` bounds it."""
        madvise = libc_madvise()
        for off in range(0, self.size, WARM_STEP):  # ``base``: the mapping's address, read
            # before ``close`` could drop the array
            n = min(WARM_STEP, self.size - off)
            if self._closed:  # read without the lock too: this loop would take it again
                return  # before a waiting ``close`` got it
            with self._mapped:
                if self._closed:
                    return
                if madvise is None or madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
                    madvise = None
                    try:
                        os.posix_fallocate(self.fd, off, n)
                    except OSError:
                        return
        self.warmed.set()

    def _generation(self) -> int:
        """A slot's generation: unique in the arena (an odd multiplier and a xor are one-to-one
        on 64 bits) and unlike anything an entry's bytes hold where a slot word once stood
        (a small counter could be)."""
        while True:
            g = (next(self._generations) * _GOLDEN ^ self._salt) & _U64
            if g:
                return g

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._settle()
            return self.size - self._data_start - self._regions.free_bytes()

    def lease(self, skey: bytes, value: bytes | memoryview, stamp: int,
              fill: Callable[[memoryview, bytes | memoryview], None]) -> Slot | None:
        """A slot holding ``value`` (the RAM tier's value of ``skey`` with ``stamp``), with
        one more lease on it; None when the arena has no room (every entry is held). A new
        slot is filled by ``fill(dst, value)``, which must raise Corrupt when the copy does
        not check out (the slot is then given back and the error raised)."""
        with self._lock:
            self._settle()
            slot = self._index.get(skey)
            if slot is not None and slot.stamp == stamp:
                slot.leases += 1
                self._index.move_to_end(skey)
                self.hits += 1
                return slot
            if slot is not None:  # another value of the key: the old copy is not read again
                self._unindex(slot)
            got = self._alloc(WORD + len(value) + FRAME_ALIGN)
            if got is None:
                self.full += 1
                self._words[0] = 1  # clients give back the leases they keep (``pressed``)
                return None
            start, size = got
            head = header_size(value)
            offset = start + WORD + (-(start + WORD + head)) % FRAME_ALIGN
            slot = Slot(self, skey, stamp, start, size, offset, len(value), leases=1,
                        indexed=False, generation=self._generation())
            self._words[start // WORD] = 0  # not readable without a call until indexed
        try:  # outside the lock: other reads go on while a large entry is copied
            fill(memoryview(self.array[offset : offset + len(value)]),  # type: ignore[arg-type]
                 value)
        except BaseException:
            with self._lock:
                slot.leases = 0
                self._regions.free(slot.start, slot.size)
            raise
        with self._lock:
            self.fills += 1
            old = self._index.get(skey)
            if old is None or old.stamp != stamp:  # a newer value may have come meanwhile:
                if old is not None:  # the index keeps whichever was filled last
                    self._unindex(old)
                slot.indexed = True
                self._index[skey] = slot
                self._words[slot.start // WORD] = slot.generation  # after the fill's bytes
        return slot

    def reserve(self, length: int, head: int) -> tuple[Slot, memoryview] | None:
        """A slot of ``length`` bytes for a same-host store to copy its entry into (its
        header ``head`` bytes long), and a writable view of it. The view (and whatever is
        derived from it through memoryviews) holds one lease: the RAM tier keeps the entry as
        that view, so the entry lives in the arena and its first same-host read copies
        nothing (``publish`` indexes it once stored). None when the slots held this way would
        pass half the arena, or there is no room."""
        with self._lock:
            self._settle()
            if self._stored + length > self.size // 2:
                return None
            got = self._alloc(WORD + length + FRAME_ALIGN)
            if got is None:
                return None
            start, size = got
            offset = start + WORD + (-(start + WORD + head)) % FRAME_ALIGN
            slot = Slot(self, b"", 0, start, size, offset, length, leases=1, indexed=False,
                        generation=self._generation())
            self._words[start // WORD] = 0
            self._stored += length
        owner = self.array[offset : offset + length]
        on_release(owner, _unstore, slot)
        return slot, memoryview(owner)  # type: ignore[arg-type]

    def _settle(self) -> None:
        """Give back the leases of stored entries that went (``_unstore``). Call with the
        lock held."""
        while True:
            try:
                slot = self._unstored.popleft()
            except IndexError:
                return
            self._stored -= slot.length
            slot.leases -= 1
            if slot.leases == 0 and not slot.indexed:
                self._regions.free(slot.start, slot.size)

    def publish(self, slot: Slot, skey: bytes, stamp: int) -> None:
        """``reserve``'s ``slot`` now holds the RAM tier's value of ``skey`` with ``stamp``:
        reads find it (an older copy of the key is dropped)."""
        with self._lock:
            self._settle()
            old = self._index.get(skey)
            if old is not None:
                self._unindex(old)
            slot.skey, slot.stamp, slot.indexed = skey, stamp, True
            self._index[skey] = slot
            self._words[slot.start // WORD] = slot.generation

    @property
    def stored_bytes(self) -> int:
        """Bytes of entries the RAM tier keeps in this arena (``reserve``)."""
        with self._lock:
            self._settle()
            return self._stored

    def _alloc(self, n: int) -> tuple[int, int] | None:
        """Pages for ``n`` bytes, dropping the least recently read unheld entries until they
        fit; None when they do not. Call with the lock held."""
        size = _pages(n)
        if size > self.size:
            return None
        while (start := self._regions.alloc(size)) is None:
            victim = next((s for s in self._index.values() if s.leases == 0), None)
            if victim is None:
                return None
            self._unindex(victim)
        if self._words[0] and self._regions.free_bytes() >= (self.size - self._data_start) // 4:
            self._words[0] = 0  # room again: clients may keep leases
        return start, size

    def enlist(self, slot: Slot) -> bool:
        """List ``slot`` in the directory (``kdn.transport.directory``), so that same-host
        clients read its entry without a call, while it stays the index's copy of its key;
        small entries only (``LIST_BELOW_BYTES``: a read from the directory is a copy).
        Call under the key's entry lock, once the caller knows the slot holds the key's
        lasting value (no time to live: its expiry would pass unseen). False where it is not
        listed (no directory, or the slot is no longer the key's copy)."""
        if not self._sets or slot.length >= LIST_BELOW_BYTES:  # a larger one is leased: no
            return False  # copy at all
        namespace, key = split_store_key(slot.skey)[1:]
        name = directory.tag(namespace, key)
        with self._lock:
            if not slot.indexed or self._index.get(slot.skey) is not slot:
                return False
            if slot.bucket >= 0:
                return True
            ways = directory.ways_of(self._words, self._dir_first, self._sets, name)
            free = [w for w, b in enumerate(ways) if b not in self._listed]
            if free:
                way = free[0]
            else:  # a full set: the bucket of another slot lists this one instead
                way = self._next_way = (self._next_way + 1) % directory.WAYS
                self._delist(self._listed[ways[way]])
            slot.bucket = directory.list_slot(self._words, self._dir_first, self._sets, name,
                                              slot.generation, slot.start, slot.offset,
                                              slot.length, way)
            self._listed[slot.bucket] = slot
            self._by_generation[slot.generation] = slot
            self.listed += 1
            return True

    def _delist(self, slot: Slot) -> None:
        """Empty the directory bucket listing ``slot``. Call with the lock held."""
        if slot.bucket >= 0:
            self._words[slot.bucket] = 0
            if self._listed.get(slot.bucket) is slot:
                del self._listed[slot.bucket]
            if self._by_generation.get(slot.generation) is slot:
                del self._by_generation[slot.generation]
            slot.bucket = -1

    def listed_entries(self, generations: Sequence[int]) -> list[tuple[bytes, bytes]]:
        """(key, a copy of the entry's bytes) of each slot of ``generations`` still listed
        (reads from the directory a client reported; ``kdn.server.batch``)."""
        with self._lock:
            slots = [s for g in generations if (s := self._by_generation.get(g)) is not None]
            return [(s.skey, self.array[s.offset : s.offset + s.length].tobytes())
                    for s in slots]

    def _unindex(self, slot: Slot) -> None:
        """Drop ``slot`` from the index; its pages are freed now or at its last release."""
        self._delist(slot)  # not found in the directory any more
        if slot.indexed and self._index.get(slot.skey) is slot:
            del self._index[slot.skey]
            self._words[slot.start // WORD] = 0  # kept leases read it no more (a call does)
        slot.indexed = False
        if slot.leases == 0:
            self._regions.free(slot.start, slot.size)

    def release(self, slot: Slot) -> None:
        with self._lock:
            if slot.leases <= 0:
                raise Corrupt(f"release of an arena slot of {slot.skey!r} that has no lease")
            slot.leases -= 1
            if slot.leases == 0 and not slot.indexed:
                self._regions.free(slot.start, slot.size)

    def drop(self, skey: bytes) -> None:
        """``skey`` was written again or deleted: its copy is not handed out any more."""
        with self._lock:
            self._settle()
            slot = self._index.get(skey)
            if slot is not None:
                self._unindex(slot)

    def close(self) -> None:
        self._closed = True  # the warming thread stops before its next step
        with self._mapped:  # and none runs now
            pass
        del self.array, self._words
        try:
            self._map.close()
        except BufferError:  # a copy still running holds a view: the mapping goes with it
            pass
        os.close(self.fd)


@dataclass
class Arenas:
    """The read arenas of a server, one per tenant, each of ``size`` bytes (0 = none)."""

    size: int
    _by_tenant: dict[str, Arena] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, tenant: str) -> Arena | None:
        """The tenant's arena (made on first use); None when arenas are off."""
        if self.size <= 0:
            return None
        with self._lock:
            arena = self._by_tenant.get(tenant)
            if arena is None:
                arena = self._by_tenant[tenant] = Arena(tenant, self.size)
            return arena

    def existing(self, tenant: str) -> Arena | None:
        """The tenant's arena where one was made (a client of the tenant attached); None
        otherwise."""
        with self._lock:
            return self._by_tenant.get(tenant)

    def drop(self, skey: bytes) -> None:
        with self._lock:
            arenas = list(self._by_tenant.values())
        for arena in arenas:
            arena.drop(skey)

    def counters(self) -> dict[str, int]:
        with self._lock:
            arenas = list(self._by_tenant.values())
        return {"arena.tenants": len(arenas),
                "arena.hits": sum(a.hits for a in arenas),
                "arena.fills": sum(a.fills for a in arenas),
                "arena.full": sum(a.full for a in arenas),
                "arena.bytes": sum(a.used_bytes for a in arenas)}

    def close(self) -> None:
        with self._lock:
            arenas, self._by_tenant = list(self._by_tenant.values()), {}
        for arena in arenas:
            arena.close()


LIST_BELOW_BYTES = 64 << 10
"""A RAM-tier entry below this size is copied into its tenant's read arena and listed in its
directory when it is stored, or answered inline to a same-host client (``list_small``):
same-host clients then read it without a call. Larger entries are listed once leased
(``kdn.server.batch``) or stored into the arena (``kdn.server.putmany``)."""


def list_small(arena: Arena | None, store: TieredStore, skey: bytes,
               value: bytes | memoryview, stamp: int) -> bool:
    """Copy ``value``, the RAM tier's value of ``skey`` with ``stamp`` (its bytes, or a copy of
    them, checked by the caller: a store just checked, an inline answer's copy), into its
    tenant's read ``arena`` (``Arenas.existing``: None where no client of the tenant attached)
    and list it in the directory, if it is still the key's lasting value (no time to live)
    once copied, checked under the key's entry lock (a write drops the copy under it). Whether
    it was listed. Call without the entry lock."""
    if arena is None or not stamp or len(value) >= LIST_BELOW_BYTES:
        return False
    slot = arena.lease(skey, value, stamp, _copy)
    if slot is None:
        return False
    try:
        with store.entry_lock(skey):
            return slot.indexed and store.memory_stamp(skey) == slot.stamp and arena.enlist(slot)
    finally:
        arena.release(slot)


def _copy(dst: memoryview, value: bytes | memoryview) -> None:
    dst[:] = value


_lease_numbers = itertools.count(1)


def next_lease() -> int:
    """A lease number, unique in this server process (a segment only releases its own)."""
    return next(_lease_numbers)
