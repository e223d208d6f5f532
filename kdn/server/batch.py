"""Batches and the same-host data plane: GetMany, PutMany, Attach, Detach.

gRPC stays the control plane; the bytes of many entries move in one call, either inline in the
messages (any client) or through a shared-memory segment of a client on this host, so that only
descriptors (offset, length) cross gRPC and each entry costs one memory copy on the server.

Lifecycle of a segment: the client creates a sealed memfd (``F_SEAL_SHRINK``: it can not
shrink, so the server's mapping never faults), writes 16 random bytes at its start, and calls
``Attach(pid, fd, size, nonce)``. The server opens ``/proc/<pid>/fd/<fd>``, checks the seals,
the size and the nonce, maps it, and returns a random ``segment_id`` bound to the calling
tenant. ``GetMany``/``PutMany`` name the segment and a region in it; ``Detach`` (or server
shutdown) unmaps it. A server that can not open the segment (another host, another container,
no permission) answers FAILED_PRECONDITION and the client keeps using gRPC.

Tenancy: a segment is looked up by (tenant, segment_id); another tenant's id is NOT_FOUND. The
server writes a tenant's entries only into that tenant's segments and reads stores only from
them, so no descriptor can make it copy one tenant's bytes to another.

Safety against the client: stores are copied out of the segment first and checked on the copy
(header and frame checksums, layout, codec, size), so bytes changed during the call can not slip
past the checks; reads copy immutable stored values into the client's region, checking every
checksum on the bytes written (``EntryRef.verified``). An invalid PutMany item stores nothing
of the batch. An item with ``seal`` (a staged entry, ``kdn.client.staged``) has its checksums
made on the server's copy instead of checked (``kdn.codec.sealing.copy_sealed``; its records
are still checked against the layout), so nothing the client writes afterwards reaches them.

Reads with ``lease`` set answer RAM-tier entries from the tenant's read arena instead
(``kdn.server.arena``): a range and a lease number, no copy per read; releases ride on later
GetMany calls, and a segment's leases go with it when it is detached or reaped.
"""

from __future__ import annotations

import asyncio
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc
import numpy as np

from kdn.buffers import BufferPool
from kdn.codec.copies import copy_checked
from kdn.codec.format import header_layout, header_size, parse_header
from kdn.errors import (
    Corrupt,
    InvalidArgument,
    KDNError,
    LayoutMismatch,
    NotFound,
    Status,
    TooLarge,
)
from kdn.keys import store_key
from kdn.server.arena import Arenas, Slot, next_lease
from kdn.server.auth import Principal, current_principal
from kdn.status import grpc_code
from kdn.store.framed import Framed
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import get_many_message

if TYPE_CHECKING:
    from kdn.server.usage import Usage
    from kdn.store.tiered import FramedHit, Hit, TieredStore

log = logging.getLogger(__name__)

NONCE_BYTES = 16
ALIGN = 64
MAX_SEGMENTS_PER_TENANT = 256
MAX_TICKETS_PER_TENANT = 4096
"""Network data path tickets a tenant holds at most (``Segments.ticket``)."""
MAX_SEGMENT_BYTES = 64 << 30
INLINE_BUDGET = 48 << 20
"""Bytes of entries one inline GetMany answer carries at most (the rest: written=false)."""
STREAM_MIN_FRAME_BYTES = 256 << 10
"""An entry whose frames average less than this is carried inline even past the client's
``inline_max_entry_bytes``: streamed, each of its frames would be a message of its own (a
1 MiB entry of 30 one-layer frames: 31 messages instead of 2)."""


def _streams_well(value: bytes | Framed) -> bool:
    """Whether a stream carries ``value`` well: its frames, a message each, are large."""
    head = value.header if isinstance(value, Framed) else value
    return len(value) >= len(parse_header(head).entry.frames) * STREAM_MIN_FRAME_BYTES


MAX_BATCH_BYTES = 2 << 30
"""Bytes one PutMany may ask the server to copy out of a segment (all items are held until
every one is checked)."""


COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads a large GetMany copies on. Copies are bound by memory bandwidth, and the client
places what it got on its own threads at the same time: half the cores at most (measured on a
2-core host, a second copy thread made one 188 MB batch 12% faster alone and a 4-thread SGLang
batch 10-20% slower, so there it is one)."""
ARENA_STORE_BYTES = 64 << 10
"""A same-host store's entry from this size is copied into its tenant's read arena, where the
RAM tier keeps it (``Arena.reserve``: up to half the arena), so that its first same-host read
copies nothing; smaller ones cost a read little to copy and would take a page each."""
PARALLEL_COPY_BYTES = 8 << 20
"""A GetMany into a segment copies its entries on ``COPY_THREADS`` threads from this size."""
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def copy_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kdn-copy")
        return _pool


class SegmentUnavailable(KDNError):
    """The server can not map the client's segment (another host, no permission, bad seals)."""

    status = Status.FAILED_PRECONDITION


@dataclass
class Segment:
    principal: Principal
    """Who attached it: calls naming the segment act as this caller."""
    source: tuple[str, int]
    """(``/proc/<pid>/fd/<fd>``, inode) it was opened from: gone or another file once the
    client closed it or exited, and then the segment is detached (``Segments.reap``)."""
    size: int
    view: mmap.mmap
    array: np.ndarray[Any, Any]
    """The whole segment as uint8, for copies that release the GIL."""
    leases: dict[int, Slot] = field(default_factory=dict)
    """Read-arena slots this segment's client holds, by lease number (``kdn.server.arena``)."""
    lease_lock: threading.Lock = field(default_factory=threading.Lock)
    detached: bool = False

    def hold(self, slot: Slot) -> int:
        """Record a lease on ``slot`` (already counted by its arena); its number. On a
        segment detached meanwhile the lease is given back at once."""
        n = next_lease()
        with self.lease_lock:
            if not self.detached:
                self.leases[n] = slot
                return n
        slot.arena.release(slot)
        return n

    def release(self, numbers: Any) -> int:
        """Give back the leases ``numbers`` of this segment (others' and unknown ones are
        ignored: a client can only release what it holds); how many were held."""
        with self.lease_lock:
            slots = [s for s in (self.leases.pop(int(n), None) for n in numbers) if s]
        for slot in slots:
            slot.arena.release(slot)
        return len(slots)

    def release_all(self) -> None:
        with self.lease_lock:
            slots, self.leases, self.detached = list(self.leases.values()), {}, True
        for slot in slots:
            slot.arena.release(slot)


def _copy(dst: np.ndarray[Any, Any], src: bytes | memoryview) -> None:
    """memcpy ``src`` into ``dst`` (numpy releases the GIL for plain byte copies)."""
    np.copyto(dst, np.frombuffer(src, dtype=np.uint8))


class Segments:
    """Mapped client segments by id, each bound to the tenant that attached it."""

    def __init__(self) -> None:
        self._by_id: dict[str, Segment] = {}
        self._tickets: OrderedDict[str, Principal] = OrderedDict()  # the network data path's
        self._lock = threading.Lock()

    def ticket(self, principal: Principal) -> str:
        """A ticket for the network data path (``kdn.server.netpath``): its calls act as
        ``principal``. 128 random bits handed only to the authenticated caller, as a segment
        id is. A tenant holds at most ``MAX_TICKETS_PER_TENANT``: its oldest goes first
        (a client that went away without Detach leaves its ticket behind)."""
        tid = secrets.token_hex(16)
        with self._lock:
            mine = [t for t, p in self._tickets.items() if p.tenant == principal.tenant]
            for old in mine[: max(0, len(mine) + 1 - MAX_TICKETS_PER_TENANT)]:
                del self._tickets[old]
            self._tickets[tid] = principal
        return tid

    def ticket_owner(self, tid: str) -> Principal:
        """The caller a network data path ticket acts as; NotFound for any other string."""
        with self._lock:
            principal = self._tickets.get(tid)
        if principal is None:
            raise NotFound("no such data path ticket (detached, or the server restarted)")
        return principal

    def attach(self, principal: Principal, pid: int, fd: int, size: int, nonce: bytes) -> str:
        tenant = principal.tenant
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
        if not NONCE_BYTES < size <= MAX_SEGMENT_BYTES:
            raise InvalidArgument(f"segment size {size} outside ({NONCE_BYTES}, "
                                  f"{MAX_SEGMENT_BYTES}]")
        self.reap()
        with self._lock:
            mine = sum(1 for s in self._by_id.values() if s.principal.tenant == tenant)
        if mine >= MAX_SEGMENTS_PER_TENANT:
            raise TooLarge(f"tenant holds {mine} attached segments (at most "
                           f"{MAX_SEGMENTS_PER_TENANT}); detach one first")
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        try:
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentUnavailable(f"can not open the client's segment: {exc.strerror}") \
                from None
        try:
            seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise SegmentUnavailable("the segment is not sealed against shrinking "
                                         "(F_SEAL_SHRINK)")
            inode = os.fstat(handle).st_ino
            if os.fstat(handle).st_size != size:
                raise SegmentUnavailable(f"the segment has {os.fstat(handle).st_size} bytes, "
                                         f"the request says {size}")
            view = mmap.mmap(handle, size)
        except OSError as exc:
            raise SegmentUnavailable(f"can not map the client's segment: {exc.strerror}") \
                from None
        finally:
            os.close(handle)
        if not hmac.compare_digest(view[:NONCE_BYTES], nonce):
            view.close()
            raise SegmentUnavailable("the segment's nonce differs: not the client's segment")
        seg_id = secrets.token_hex(16)
        with self._lock:
            self._by_id[seg_id] = Segment(principal, (path, inode), size, view,
                                          np.frombuffer(view, dtype=np.uint8))
        return seg_id

    def reap(self) -> int:
        """Detach the segments whose client exited or closed them without Detach; how many."""
        with self._lock:
            segs = list(self._by_id.items())
        gone = []
        for seg_id, seg in segs:
            path, inode = seg.source
            try:
                alive = os.stat(path).st_ino == inode
            except OSError:
                alive = False
            if not alive:
                gone.append(seg_id)
        with self._lock:
            dropped = [s for s in (self._by_id.pop(i, None) for i in gone) if s is not None]
        for seg in dropped:
            self._unmap(seg)
        return len(dropped)

    def get(self, tenant: str, seg_id: str) -> Segment:
        with self._lock:
            seg = self._by_id.get(seg_id)
        if seg is None or seg.principal.tenant != tenant:
            raise NotFound(f"no attached segment {seg_id!r}")
        return seg

    def owner(self, seg_id: str) -> Principal:
        """The caller that attached ``seg_id`` (the fast path acts as it)."""
        with self._lock:
            seg = self._by_id.get(seg_id)
        if seg is None:
            raise NotFound(f"no attached segment {seg_id!r}")
        return seg.principal

    def detach(self, tenant: str, seg_id: str) -> None:
        with self._lock:
            principal = self._tickets.get(seg_id)
            if principal is not None and principal.tenant == tenant:
                del self._tickets[seg_id]
                return
        self.get(tenant, seg_id)
        with self._lock:
            seg = self._by_id.pop(seg_id, None)
        if seg is not None:
            self._unmap(seg)

    @staticmethod
    def _unmap(seg: Segment) -> None:
        seg.release_all()  # its client is gone: its arena leases with it
        del seg.array
        try:
            seg.view.close()
        except BufferError:  # a copy still holds a view: the mapping goes with it
            pass

    def close(self) -> None:
        with self._lock:
            segs, self._by_id = list(self._by_id.values()), {}
        for seg in segs:
            self._unmap(seg)

    def __len__(self) -> int:
        return len(self._by_id)


def _check_layout(skey: bytes, value: bytes | memoryview | Framed, want: str) -> None:
    """LayoutMismatch when the caller expects layout ``want`` and ``value`` has another."""
    if not want:
        return
    have = header_layout(value.header if isinstance(value, Framed) else value).fingerprint
    if have != want:
        raise LayoutMismatch(f"entry {skey.decode()} has layout {have}, caller expects {want}")


def _aligned(n: int) -> int:
    """Entries written into a segment start at multiples of ``ALIGN`` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _split_one(entries: int) -> dict[str, Any]:
    """``copy_checked``'s arguments for a call of ``entries`` entries: one entry (what an
    engine waits on for a long context) is copied in runs of its frames on the copy threads and
    the request's own (from ``kdn.codec.copies.PARALLEL_COPY_BYTES``); a batch splits by entry."""
    return {"pool": copy_pool(), "workers": COPY_THREADS + 1} if entries == 1 else {}


def _frames_aligned(cursor: int, value: bytes | memoryview, end: int) -> int:
    """Where in [cursor, end) to write ``value`` so that its first frame starts at a multiple
    of ``ALIGN`` (the client's tensors can then view raw bodies in place); ``cursor`` itself
    when the shift does not fit."""
    head = header_size(value)
    at = _aligned(cursor + head) - head
    return at if at + len(value) <= end else cursor


def _region(seg: Segment, region: pb.Region) -> tuple[int, int]:
    start, length = int(region.offset), int(region.length)
    if start < NONCE_BYTES or start + length > seg.size:
        raise InvalidArgument(f"region [{start}, {start + length}) outside the segment's "
                              f"[{NONCE_BYTES}, {seg.size})")
    return start, start + length


class BatchMixin:
    """GetMany, Attach and Detach for ``KDNServicer`` (which provides ``store``, ``count`` and
    ``usage``); PutMany is ``kdn.server.putmany``'s."""

    if TYPE_CHECKING:
        store: TieredStore
        usage: Usage

        def count(self, name: str, n: int = 1) -> None: ...

    segments: Segments
    arenas: Arenas
    buffers: BufferPool
    fast_path_name: str = ""
    """The socket of the same-host fast path (``kdn.server.fastpath``); "" = none."""
    data_port: int = 0
    """The TCP port of the network data path (``kdn.server.netpath``); 0 = none."""

    async def _answer(self, name: str, context: grpc.aio.ServicerContext,
                      fn: Callable[[Principal], Any]) -> Any:
        """Run ``fn(caller)`` on a worker thread; a KDNError aborts with its status."""
        principal = current_principal.get()
        try:
            return await asyncio.to_thread(fn, principal)
        except KDNError as exc:
            self.count(f"{name}.{grpc_code(exc).name}")
            await context.abort(grpc_code(exc), str(exc))
            raise  # unreachable: abort raises

    async def Attach(self, request: pb.AttachRequest,
                     context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        def run(p: Principal) -> pb.AttachResponse:
            if request.remote:  # another host: a ticket for the network data path
                if not self.data_port:
                    raise NotFound("this server has no network data path (data_port = -1)")
                self.count("net.attached")
                return pb.AttachResponse(segment_id=self.segments.ticket(p),
                                         data_port=self.data_port)
            seg_id = self.segments.attach(p, request.pid, request.fd, request.size,
                                          request.nonce)
            self.count("shm.attached")
            return pb.AttachResponse(segment_id=seg_id, fast_path=self.fast_path_name,
                                     seals=True)

        return await self._answer("Attach", context, run)  # type: ignore[no-any-return]

    async def Detach(self, request: pb.DetachRequest,
                     context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        def run(p: Principal) -> pb.DetachResponse:
            self.segments.detach(p.tenant, request.segment_id)
            return pb.DetachResponse()

        return await self._answer("Detach", context, run)  # type: ignore[no-any-return]

    async def GetMany(self, request: pb.GetManyRequest,
                      context: grpc.aio.ServicerContext) -> pb.GetManyResponse:
        return await self._answer(  # type: ignore[no-any-return]
            "GetMany", context, lambda p: self._get_many(p, request))

    def _get_many(self, p: Principal, request: pb.GetManyRequest) -> pb.GetManyResponse | bytes:
        """The answer; inline, already serialized with the entries joined in (kdn.wire)."""
        ns = request.namespace or "default"
        skeys = [store_key(p.tenant, ns, k) for k in request.keys]
        seg = self.segments.get(p.tenant, request.segment_id) if request.segment_id else None
        if seg is not None:
            if request.release:
                self.count("arena.released", seg.release(request.release))
            cursor, end = _region(seg, request.region)
        else:  # inline: as much as the caller's messages may carry, within the server's budget
            cursor, end = 0, min(INLINE_BUDGET, request.region.length or INLINE_BUDGET)
        out = pb.GetManyResponse()
        want = request.expect_layout_fingerprint
        sent = 0
        copies: list[tuple[pb.EntryRef, bytes, Hit, int]] = []  # segment copies, placed
        inline: dict[int, bytes | memoryview | list[bytes | memoryview]] = {}  # entry number
        # -> its bytes (or their pieces), joined in
        for skey in skeys:
            ref = out.entries.add()
            started = time.perf_counter()
            # inline: a RAM value kept as the frames it came in stays so unless it is sent
            # (joined, it would no longer go out as the messages it came in: Retrieve)
            hit = self._hit(skey, want, framed=seg is None)
            if hit is None:
                continue
            value = hit.value
            ref.present, ref.tier, ref.length = True, hit.tier, len(value)
            read_s = time.perf_counter() - started
            if seg is not None and request.lease and self._leased(
                    p, seg, ref, skey, cast("Hit", hit)):  # ``get``'s: one buffer
                self.usage.served(skey, value, hit.tier, read_s)
                sent += len(value)
                continue
            if cursor + len(value) > end or seg is None and \
                    0 < request.inline_max_entry_bytes < len(value) and _streams_well(value):
                continue  # no room (the client asks again with a region of ref.length), or
                # too large to inline (the client streams it: RetrieveMany); its read is
                # counted by the call that brings it
            self.usage.served(skey, value, hit.tier, read_s)
            if seg is not None:  # placed now, copied below (in parallel)
                assert not isinstance(value, Framed)  # ``get``'s: one buffer
                cursor = _frames_aligned(cursor, value, end)
                ref.offset = cursor
                copies.append((ref, skey, cast("Hit", hit), cursor))
            else:
                inline[len(out.entries) - 1] = [value.header, *value.frames] \
                    if isinstance(value, Framed) else value
                ref.written = True
                self.count("getmany.hit")
            cursor = _aligned(cursor + len(value))
            sent += len(value)
        if copies:
            sent -= self._copy_all(seg, copies)
        self.count("bytes_out", sent)
        if seg is None:
            return get_many_message([(ref, inline.get(i, b""))
                                     for i, ref in enumerate(out.entries)])
        return out

    def _hit(self, skey: bytes, want: str, *, framed: bool) -> Hit | FramedHit | None:
        """``skey``'s stored value (a RAM value as the frames it came in, with ``framed``),
        its layout checked against ``want`` (LayoutMismatch); None, counted, on a miss."""
        hit = (self.store.get_in_memory(skey, framed=True) if framed else None) \
            or self.store.get(skey)
        if hit is None:
            self.count("getmany.miss")
            self.usage.missed(skey)
            return None
        _check_layout(skey, hit.value, want)
        return hit

    def _get_sent(self, p: Principal, request: pb.GetManyRequest
                  ) -> tuple[pb.GetManyResponse, list[bytes | memoryview]]:
        """The network data path's GetMany (``kdn.server.netpath``): the answer, and the
        pieces of every present entry's bytes, in order, which follow it on the connection
        (``EntryRef.offset``: where an entry starts in them). Nothing is copied: the pieces
        are the stored values (a RAM value as the frames it came in)."""
        ns = request.namespace or "default"
        want = request.expect_layout_fingerprint
        out = pb.GetManyResponse()
        pieces: list[bytes | memoryview] = []
        at = 0
        for key in request.keys:
            skey = store_key(p.tenant, ns, key)
            ref = out.entries.add()
            started = time.perf_counter()
            hit = self._hit(skey, want, framed=True)
            if hit is None:
                continue
            value = hit.value
            ref.present, ref.tier, ref.length, ref.offset = True, hit.tier, len(value), at
            ref.written = True
            self.usage.served(skey, value, hit.tier, time.perf_counter() - started)
            pieces += [value.header, *value.frames] if isinstance(value, Framed) else [value]
            at += len(value)
            self.count("getmany.hit")
        self.count("bytes_out", at)
        return out, pieces

    def _leased(self, p: Principal, seg: Segment, ref: pb.EntryRef, skey: bytes, hit: Hit
                ) -> bool:
        """Answer ``hit`` as a lease on its copy in the tenant's read arena (``ref`` filled
        in); False when it goes the segment way (not a RAM-tier value, arenas off, no room, or
        the arena copy failed its check: the segment copy then checks and re-reads it)."""
        arena = self.arenas.get(p.tenant) if hit.tier == "ram" and hit.stamp else None
        if arena is None:
            return False
        split = _split_one(1)

        def fill(dst: memoryview, value: bytes | memoryview) -> None:
            copy_checked(dst, value, **split)

        try:
            slot = arena.lease(skey, hit.value, hit.stamp, fill)
            if slot is None and self.segments.reap():  # leases of clients that exited
                slot = arena.lease(skey, hit.value, hit.stamp, fill)
        except Corrupt:
            return False
        if slot is None:
            return False
        ref.lease = seg.hold(slot)
        ref.offset = slot.offset
        ref.verified = ref.written = True
        with self.store.entry_lock(skey):  # writes put, then drop the arena's copy, under it:
            if slot.indexed and self.store.memory_stamp(skey) == slot.stamp:  # still the value
                ref.generation, ref.generation_at = slot.generation, slot.start  # a kept lease
                # reads without a call (a write from now on zeroes the word before it answers)
        self.count("getmany.hit")
        return True

    def _copy_all(self, seg: Segment | None, copies: list[tuple[pb.EntryRef, bytes, Hit, int]]
                  ) -> int:
        """Copy each placed entry into the segment at its offset, checking every checksum on
        the written bytes, on up to ``COPY_THREADS`` threads (numpy and xxhash run without the
        GIL) when the batch is large, a single large entry in runs of frames on them and this
        thread; an entry that fails its check is read again (``_recopy``) or answered as a
        miss. Returns the bytes not written."""
        assert seg is not None
        total = sum(len(hit.value) for _, _, hit, _ in copies)
        workers = min(COPY_THREADS, len(copies)) if total >= PARALLEL_COPY_BYTES else 1

        split = _split_one(len(copies))

        def one(item: tuple[pb.EntryRef, bytes, Hit, int]) -> Corrupt | None:
            _, _, hit, at = item
            try:
                copy_checked(memoryview(seg.array[at : at + len(hit.value)]),  # type: ignore[arg-type]
                             hit.value, **split)
                return None
            except Corrupt as exc:
                return exc

        if workers > 1:
            results = list(copy_pool().map(one, copies))
        else:
            results = [one(item) for item in copies]
        lost = 0
        for (ref, skey, hit, at), exc in zip(copies, results):
            if exc is not None:
                again = self._recopy(seg, skey, hit, exc, at)
                if again is None:
                    ref.present, ref.tier, ref.length, ref.offset = False, "", 0, 0
                    lost += len(hit.value)
                    continue
                ref.tier = again.tier
            ref.verified = ref.written = True
            self.count("getmany.hit")
        return lost

    def _recopy(self, seg: Segment, skey: bytes, hit: Hit, exc: Corrupt, at: int
                ) -> Hit | None:
        """After ``hit`` failed its check in the segment copy at ``at``: the store hashes the
        key's values again on a second read (a damaged tier copy is dropped there), and a sound
        value of the same length and layout (the region and the later entries' offsets are
        fixed) is copied in its place. None when there is none (answered as a miss)."""
        self._distrust(skey, exc)
        again = self.store.get(skey)
        if again is None or len(again.value) != len(hit.value) or \
                parse_header(again.value).layout != parse_header(hit.value).layout:
            return None
        try:
            copy_checked(memoryview(seg.array[at : at + len(hit.value)]),  # type: ignore[arg-type]
                         again.value)
            return again
        except Corrupt as second:
            self._distrust(skey, second)
            return None

    def _distrust(self, skey: bytes, exc: Corrupt) -> None:
        log.error("entry %r failed its check in a segment copy: %s", skey, exc)
        self.count("getmany.corrupt")
        self.store.distrust(skey)
