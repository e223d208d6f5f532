"""PutMany: many entries stored in one call, inline or (same host) from a shared segment.

A same-host call names regions of the caller's segment (``kdn.server.segments``): each entry is
copied out first and checked on the copy (header, every frame's checksum, layout, codec, size),
so bytes the client changes during the call can not slip past the checks; an item with
``seal`` (a staged entry) has its sums made on the copy (``kdn.codec.sealing``). Every item is
checked before any is stored: one invalid item stores nothing of the call. A call is two
halves, ``PutMany.copy`` (the copies) and ``PutMany.finish`` (the checks and the stores), so
that the same-host fast path can copy calls queued on a connection together
(``kdn.server.fastpath``). Every form, the network data path's too (``kdn.server.streamed``),
checks and stores through ``PutMany.put_items`` and the write path (``kdn.server.ingest``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from kdn.codec.copies import copy_checked
from kdn.codec.format import Header, header_size, parse_container
from kdn.codec.sealing import copy_sealed
from kdn.errors import Corrupt, InvalidArgument, KDNError, TooLarge, kept
from kdn.keys import store_key
from kdn.server.arena import Arena, Arenas, Slot
from kdn.server.auth import Principal
from kdn.server.batch import COPY_THREADS, MAX_BATCH_BYTES, copy_pool, split_one
from kdn.server.ingest import Ingest, written
from kdn.server.segments import Segments, region_span
from kdn.transport.buffers import BufferPool
from kdn.v1 import kdn_pb2 as pb

ARENA_STORE_BYTES = 64 << 10
"""A same-host store's entry from this size is copied into its tenant's read arena, where the
RAM tier keeps it (``Arena.reserve``: up to half the arena), so that its first same-host read
copies nothing. Smaller ones stay in the server's buffers; a copy of each goes into the arena
as it is stored, listed in its directory (``kdn.server.arena.list_small``: read without a
call)."""
PARALLEL_PUT_BYTES = 2 << 20
"""A same-host PutMany of this many bytes of several entries copies them out of the segment on
the copy thread and its own at once (``PutMany._copied_ahead``)."""


class PutCopies(NamedTuple):
    """A PutMany's items copied out of the caller's segment (``PutMany.copy``)."""

    segment: bool
    """Whether the call's items lie in a segment (else their bytes came with the call)."""
    values: dict[int, bytes | memoryview | BaseException]
    """item -> its checked copy, or what copying it raised."""
    homes: dict[int, tuple[Arena, Slot]]
    """item -> the arena slot its copy lies in."""
    checked: dict[int, Checked]
    """item -> what its checks on its copy gave (every check but the quota's, made on the
    thread that copied it: ``PutMany.put_items`` takes them as they are)."""


class Checked(NamedTuple):
    """An item that passed its checks (``PutMany.put_items``)."""

    skey: bytes
    """Its tier key."""
    header: Header
    """Its header, parsed from the bytes checked."""
    seconds: float
    """How long its check took (its copy included, where it was checked as it was copied)."""


class PutMany:
    """PutMany's items checked and stored through ``ingest``: from the call's messages, from
    the caller's segment (``segments``; copied into the tenant's read arena in ``arenas`` or
    into buffers from ``buffers``), or as the network data path received them."""

    def __init__(self, ingest: Ingest, segments: Segments, arenas: Arenas,
                 buffers: BufferPool) -> None:
        self.ingest = ingest
        self.segments = segments
        self.arenas = arenas
        self.buffers = buffers

    def put(self, p: Principal, request: pb.PutManyRequest) -> pb.PutManyResponse:
        """One PutMany call, whole: its items copied (``copy``), then checked and stored
        (``finish``)."""
        return self.finish(p, request, self.copy(p, request))

    def copy(self, p: Principal, request: pb.PutManyRequest, *, alone: bool = False
             ) -> PutCopies:
        """The first half of a PutMany: the items that lie in a shared segment copied out,
        each checked as it is copied; nothing stored yet. What copying an item raised is kept
        with it and raised by ``finish`` in its turn; what refuses the whole call (no
        segment, sizes) is raised here. ``alone``: copy on this thread only (a caller on the
        copy threads; the same-host fast path copies several calls at once that way)."""
        seg = self.segments.get(p.tenant, request.segment_id) if request.segment_id else None
        if seg is None:
            return PutCopies(False, {}, {}, {})
        self.sizes(request)  # sizes first: nothing is copied for a batch that is refused
        self.within_quota(p, request)  # (nor for one past the quota)
        split = {} if alone else split_one(len(request.items))
        arena = self.arenas.get(p.tenant)
        homes: dict[int, tuple[Arena, Slot]] = {}  # item -> the arena slot it was copied into
        checked: dict[int, Checked] = {}  # item -> its checks' outcome, made on its copy

        def copy_in(j: int, item: pb.PutItem) -> bytes | memoryview:
            # a copy, checked as it is made (one pass): later changes by the client can not
            start, stop = region_span(seg, item.region)  # slip past
            if stop == start:
                raise InvalidArgument("its region is empty: an entry holds at least its "  # named
                                      "container header")  # with its item by ``put_items``
            src = seg.span(start, stop)
            home = arena.reserve(stop - start, header_size(src)) \
                if arena is not None and stop - start >= ARENA_STORE_BYTES else None
            if home is not None:  # into the arena: the RAM tier keeps it there and same-host
                slot, dst = home  # reads copy nothing (``Arena.reserve``)
                into = dst
            else:
                into = memoryview(self.buffers.take(  # type: ignore[arg-type]
                    stop - start, written_now=True))
            t0 = time.perf_counter()
            if item.seal:  # a staged entry: its sums made on this copy (``copy_sealed``)
                header = copy_sealed(into, src)
            else:
                header = copy_checked(into, src, **split)
            if home is not None:
                homes[j] = (arena, home[0])  # type: ignore[assignment]
            checked[j] = Checked(self._check_item(p, request, item, header, len(into)), header,
                                 time.perf_counter() - t0)
            return into.toreadonly()

        copied = {} if alone else self._copied_ahead(request, copy_in)
        for j, item in enumerate(request.items):
            if j not in copied:
                try:
                    copied[j] = copy_in(j, item)
                except Exception as exc:  # raised by ``finish`` in its turn
                    copied[j] = kept(exc)  # not the frames, which hold ``copied``
        return PutCopies(True, copied, homes, checked)

    def finish(self, p: Principal, request: pb.PutManyRequest, copies: PutCopies
               ) -> pb.PutManyResponse:
        """The second half of a PutMany (after ``copy``): every item checked, then
        every item stored, in order."""
        def value_of(j: int, item: pb.PutItem) -> bytes | memoryview:
            if not copies.segment:
                value = bytes(item.data)
                parse_container(value, verify=True)
                return value
            got = copies.values.pop(j)
            if isinstance(got, BaseException):
                try:
                    raise got
                finally:  # its traceback holds this frame, which would hold it
                    del got
            return got

        try:
            return self.put_items(p, request, value_of, copies.homes,
                                  sealing=copies.segment, checked=copies.checked)
        finally:  # a refused call's later copies go now (their arena slots with them), not
            copies.values.clear()  # with whoever still holds ``copies``

    def _check_item(self, p: Principal, request: pb.PutManyRequest, item: pb.PutItem,
                    header: Header, total: int) -> bytes:
        """An item's checks beside its bytes' (name, options, size, codec, model): its tier
        key."""
        skey = self.ingest.check_target(p.tenant, request.namespace, item.key, item.options, total)
        self.ingest.check_kind(header)
        return skey

    def _copied_ahead(self, request: pb.PutManyRequest,
                      copy_in: Callable[[int, pb.PutItem], bytes | memoryview]
                      ) -> dict[int, bytes | memoryview | BaseException]:
        """A batch's items copied by this thread and the copy thread at once, this one from
        the first item on, the copy thread from the last one back, each taking the next item
        left as it is done with one (a thread the machine holds back takes fewer: the batch
        does not wait for a fixed half of it); ``put_items`` then checks them in order. The
        entry -> its value, or what its copy raised. Empty for a batch too small to share."""
        items = request.items
        total = sum(item.region.length for item in items)
        if COPY_THREADS < 1 or len(items) < 2 or total < PARALLEL_PUT_BYTES:
            return {}
        lock = threading.Lock()
        left = [0, len(items) - 1]  # items [left[0], left[1]) not taken yet (the last one is
        # the copy thread's first)

        def take(front: bool) -> int:
            with lock:
                if left[0] >= left[1]:
                    return -1
                if front:
                    left[0] += 1
                    return left[0] - 1
                left[1] -= 1
                return left[1]

        def run(j: int, front: bool) -> dict[int, bytes | memoryview | BaseException]:
            out: dict[int, bytes | memoryview | BaseException] = {}
            while j >= 0:
                try:
                    out[j] = copy_in(j, items[j])
                except Exception as exc:  # raised by value_of in its turn
                    out[j] = kept(exc)  # not the frames, which hold ``out``
                j = take(front)
            return out

        later = copy_pool().submit(run, len(items) - 1, False)
        done = run(take(True), True)
        done.update(later.result())
        return done

    def sizes(self, request: pb.PutManyRequest) -> int:
        """The bytes of ``request``'s items (their regions); TooLarge past the limits."""
        for j, item in enumerate(request.items):
            if item.region.length > self.ingest.config.max_entry_bytes:
                raise TooLarge(f"{_item(j, request)}entry of {item.region.length} bytes exceeds "
                               f"max_entry_bytes {self.ingest.config.max_entry_bytes}")
        total = sum(item.region.length for item in request.items)
        if total > MAX_BATCH_BYTES:
            raise TooLarge(f"this {written(len(request.items))} of {total} bytes: at most "
                           f"{MAX_BATCH_BYTES} per call")
        return total

    def within_quota(self, p: Principal, request: pb.PutManyRequest) -> None:
        """TooLarge when ``request``'s items (their regions' lengths) would take the tenant
        past its quota (``Ingest.check_room``): before their bytes are read or copied."""
        ns = request.namespace or "default"
        self.ingest.check_room(p, [(store_key(p.tenant, ns, item.key), item.region.length)
                                   for item in request.items])

    def put_items(self, p: Principal, request: pb.PutManyRequest,
                  value_of: Callable[[int, pb.PutItem], bytes | memoryview],
                  homes: dict[int, tuple[Arena, Slot]] | None = None, *,
                  sealing: bool = False, checked: dict[int, Checked] | None = None
                  ) -> pb.PutManyResponse:
        """Check every item (its bytes from ``value_of``, which verifies them: Corrupt when
        they fail) and the tenant's quota for all of them (``Ingest.check_room``) before any
        is stored, then store them in order (each within what the batch gives back later:
        ``Ingest.check_room``). ``homes``: items whose
        value lives in an arena slot (published with their put). ``sealing``: ``value_of``
        seals the items that ask for it (``PutItem.seal``; segment items only). ``checked``:
        items checked already on the bytes ``value_of`` returns (``copy``)."""
        done = checked or {}
        items: list[tuple[bytes, bytes | memoryview, Header]] = []
        for j, item in enumerate(request.items):
            if item.seal and not sealing:
                raise InvalidArgument(f"{_item(j, request)}seal applies to an entry in a "
                                      "shared segment only (this one's bytes came with the call)")
            t0 = time.perf_counter()
            try:
                value = value_of(j, item)
                got = done.get(j)
                if got is not None:
                    skey, header, seconds = got
                else:
                    hdr = pb.StoreHeader(namespace=request.namespace, key=item.key,
                                         container_header=bytes(value[: header_size(value)]),
                                         total_bytes=len(value), options=item.options)
                    skey, header = self.ingest.check_header(p.tenant, hdr)
                    seconds = time.perf_counter() - t0
            except Corrupt as exc:
                raise InvalidArgument(f"{_item(j, request)}corrupt input: {exc}") from exc
            except KDNError as exc:
                raise type(exc)(f"{_item(j, request)}{exc}") from exc
            self.ingest.checked(header, seconds)
            items.append((skey, value, header))
        over = self.ingest.check_room(p, [(skey, len(value)) for skey, value, _ in items])
        out = pb.PutManyResponse()
        for j, ((skey, value, header), item) in enumerate(zip(items, request.items)):
            out.results.append(self.ingest.commit(p, skey, value, item.options, header,
                                                  (homes or {}).get(j), over[j]))
        return out


def _item(j: int, request: pb.PutManyRequest) -> str:
    """What an error about item ``j`` begins with: its index, where the call has more than one
    (a single store's error reads as it does through ``Store``)."""
    return f"item {j}: " if len(request.items) > 1 else ""
