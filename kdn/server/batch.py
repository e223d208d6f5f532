"""Batch reads: GetMany, inline or into a client's shared segment, and the network data path's.

gRPC stays the control plane; the bytes of many entries move in one call, either inline in the
messages (any client) or through a shared-memory segment of a client on this host
(``kdn.server.segments``), so that only descriptors (offset, length) cross gRPC and each entry
costs one memory copy on the server.

Safety against the client: reads copy immutable stored values into the client's region,
checking every checksum on the bytes written (``EntryRef.verified``); an entry that fails that
check is read again from the store or answered as a miss. Stores into a segment are the write
path's (``kdn.server.putmany``).

Reads with ``lease`` set answer RAM-tier entries from the tenant's read arena instead
(``kdn.server.arena``): a range and a lease number, no copy per read; releases ride on later
GetMany calls, and a segment's leases go with it when it is detached or reaped.

This module also holds what the data plane's reads and writes share: the copy threads
(``copy_pool``) and the bytes one batch may move (``MAX_BATCH_BYTES``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from kdn.codec.copies import copy_checked
from kdn.codec.format import header_shape, header_size, parse_header
from kdn.errors import Corrupt, KDNError, TooLarge
from kdn.keys import store_key
from kdn.layout import Expected
from kdn.pools import SharedPool
from kdn.server.arena import Arenas, list_small
from kdn.server.auth import Principal
from kdn.server.reader import Sending, expected
from kdn.server.segments import Segment, Segments, region_span
from kdn.store.framed import Framed
from kdn.transport.wire import NET_MAX_KEYS, get_many_message
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.server.usage import Usage
    from kdn.store.tiered import FramedHit, Hit, TieredStore

log = logging.getLogger(__name__)

ALIGN = 64
INLINE_BUDGET = 48 << 20
"""Bytes of entries one inline GetMany answer carries at most (the rest: written=false)."""
INLINE_SLACK = 1 << 20
"""Bytes of an inline answer kept free of entries (its refs, the framing)."""
NET_HELD_BYTES = 2 << 30
"""Bytes of entries read from below the RAM tier that one such answer may hold (those in RAM
are sent from where they lie)."""
NET_WAIT_S = 1.0
"""How long a data-path GetMany that holds no such reads yet waits for room in the bound of
those being sent (``Sending``) before it is refused: an earlier call's answer lets go of its
copies a moment after its last byte went."""
STREAM_MIN_FRAME_BYTES = 256 << 10
"""An entry whose frames average less than this is carried inline even past the client's
``inline_max_entry_bytes``: streamed, each of its frames would be a message of its own (a
1 MiB entry of 30 one-layer frames: 31 messages instead of 2)."""


def inline_room(message_bytes: int) -> int:
    """Entry bytes a message of ``message_bytes`` (0: no bound) carries inline: the rest is
    kept for the answer's other fields, a quarter of it at most (as the client keeps)."""
    if not message_bytes:
        return INLINE_BUDGET
    return max(0, message_bytes - min(INLINE_SLACK, message_bytes // 4))


def _streams_well(value: bytes | Framed) -> bool:
    """Whether a stream carries ``value`` well: its frames, a message each, are large."""
    head = value.header if isinstance(value, Framed) else value
    return len(value) >= len(parse_header(head).entry.frames) * STREAM_MIN_FRAME_BYTES


MAX_BATCH_BYTES = 2 << 30
"""Bytes one PutMany may ask the server to copy out of a segment (all items are held until
every one is checked)."""


COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads a large GetMany copies on. Copies are bound by memory bandwidth, and the client
places what it got on its own threads at the same time: half the cores at most (on two cores a
second copy thread speeds one large batch alone but slows an engine placing batches on its own
threads, so there it is one)."""
PARALLEL_COPY_BYTES = 8 << 20
"""A GetMany into a segment copies its entries on ``COPY_THREADS`` threads from this size."""
_POOL = SharedPool(COPY_THREADS, "kdn-copy")


def copy_pool() -> ThreadPoolExecutor:
    """The copy threads (``COPY_THREADS``), shared by the data plane's reads and writes."""
    return _POOL.get()


def _check_layout(skey: bytes, value: bytes | memoryview | Framed, want: Expected) -> None:
    """LayoutMismatch when ``value`` is not what the caller expects (``want``: a layout, a
    number of tokens)."""
    if want.fingerprint or want.tokens:
        want.check(*header_shape(value.header if isinstance(value, Framed) else value),
                   what=f"entry {skey.decode()}")


def _same_shape(value: bytes | memoryview, checked: bytes | memoryview) -> bool:
    """Whether ``value`` has the layout and tokens of ``checked`` (read again after a
    damaged copy: what the caller expects was checked on the first)."""
    try:
        return header_shape(value) == header_shape(checked)
    except KDNError:
        return False


def _aligned(n: int) -> int:
    """Entries written into a segment start at multiples of ``ALIGN`` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def split_one(entries: int) -> dict[str, Any]:
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


class BatchReads:
    """GetMany's answers (over gRPC, the same-host fast path and the network data path), read
    from ``store`` for the caller; ``count`` counts the servicer's counters."""

    def __init__(self, store: TieredStore, segments: Segments, arenas: Arenas, usage: Usage,
                 count: Callable[..., None], sending: Sending) -> None:
        self.store = store
        self.segments = segments
        self.arenas = arenas
        self.usage = usage
        self.count = count
        self.sending = sending

    def get_many(self, p: Principal, request: pb.GetManyRequest, sending: int = 0,
                 message_bytes: int = 0) -> pb.GetManyResponse | bytes:
        """The answer; inline, already serialized with the entries joined in
        (kdn.transport.wire), no larger than ``message_bytes`` (the gRPC server's
        ``max_message_bytes``; 0: no bound): an entry past that is answered present and not
        written, which the client streams. Its lower-tier reads count for the answer
        ``sending`` (``Sending``; one past the bound is answered present and not written,
        which the client asks for again, or streams), which its caller closes once it is
        sent; 0: one closed when this returns."""
        if not sending:
            with self.sending.answer() as ours:
                return self.get_many(p, request, ours, message_bytes)
        ns = request.namespace or "default"
        skeys = [store_key(p.tenant, ns, k) for k in request.keys]
        seg = self.segments.get(p.tenant, request.segment_id) if request.segment_id else None
        if seg is not None:
            if request.release:
                self.count("arena.released", seg.release(request.release))
            if request.read_listed:
                self._read_listed(p, request.read_listed)
            cursor, end = region_span(seg, request.region) if skeys else (0, 0)  # none: a
            # report of reads only (``_read_listed``)
        else:  # inline: as much as the caller's messages may carry, within the server's budget
            cursor, end = 0, min(INLINE_BUDGET, request.region.length or INLINE_BUDGET,
                                 inline_room(message_bytes))
        out = pb.GetManyResponse()
        want = expected(request)
        sent = 0
        copies: list[tuple[pb.EntryRef, bytes, Hit, int]] = []  # segment copies, placed
        listed: list[tuple[bytes, bytearray, int]] = []  # small RAM entries answered inline
        # (a checked copy, its stamp), to list
        inline: dict[int, bytes | memoryview | list[bytes | memoryview]] = {}  # entry number
        # -> its bytes (or their pieces), joined in
        seen: dict[bytes, Hit | FramedHit | None] = {}  # a key asked for again: read once
        first = self.store.tiers[0].name if self.store.tiers else ""
        crowded = False  # an entry found no room: the next ones' sizes are asked first
        for skey in skeys:
            ref = out.entries.add()
            started = time.perf_counter()
            if crowded and skey not in seen:  # one without room: its size, not its bytes
                found = self.store.presence(skey)
                if not found.present:  # a miss all the same: the client does not ask again
                    self._missed(skey)
                    continue
                elsewhere = seg is not None and (found.size <= request.inline_below_bytes or
                                                 request.lease and found.tier == first)
                if not elsewhere and cursor + found.size > end:  # (small, or leased: no room
                    ref.present, ref.tier, ref.length = True, found.tier, found.size  # needed)
                    continue
            # inline: a RAM value kept as the frames it came in stays so unless it is sent
            # (joined, it would no longer go out as the messages it came in: Retrieve)
            repeat = skey in seen  # a key asked for again: counted again, but read once
            hit = seen[skey] if repeat else seen.setdefault(
                skey, self._hit(skey, want, framed=seg is None))
            if hit is not None and not repeat and not self.sending.took(sending, hit):
                # past the bound of reads being sent (``Sending``): asked again, as an entry
                # without room is (its copy let go now)
                ref.present, ref.tier, ref.length = True, hit.tier, len(hit.value)
                del seen[skey]
                continue
            if hit is None:
                if repeat:
                    self._missed(skey)
                continue
            value = hit.value
            ref.present, ref.tier, ref.length = True, hit.tier, len(value)
            read_s = None if repeat else time.perf_counter() - started
            if seg is not None and len(value) <= request.inline_below_bytes:
                # small: in the answer, checked on the bytes sent (no lease, no region)
                got = self._inline_copy(skey, cast("Hit", hit))
                if got is None:
                    ref.present, ref.tier, ref.length = False, "", 0
                    continue
                inline[len(out.entries) - 1], again = memoryview(got[0]), got[1]
                ref.tier, ref.length = again.tier, len(again.value)
                ref.written = ref.verified = True
                self.usage.served(skey, again.value, again.tier, read_s)
                self.count("getmany.hit")
                sent += len(again.value)
                if request.lease and again.tier == "ram":  # the client maps the arena: its
                    listed.append((skey, got[0], again.stamp))  # next read makes no call
                continue
            if seg is not None and request.lease and self._leased(
                    p, seg, ref, skey, cast("Hit", hit)):  # ``get``'s: one buffer
                self.usage.served(skey, value, hit.tier, read_s)
                sent += len(value)
                continue
            if cursor + len(value) > end or seg is None and \
                    0 < request.inline_max_entry_bytes < len(value) and _streams_well(value):
                crowded = crowded or cursor + len(value) > end
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
        if seg is None or inline:
            message = get_many_message([(ref, inline.get(i, b""))
                                        for i, ref in enumerate(out.entries)])
            arena = self.arenas.existing(p.tenant) if listed else None
            for skey, copy, stamp in listed:
                list_small(arena, self.store, skey, memoryview(copy), stamp)
            return message
        return out

    def _hit(self, skey: bytes, want: Expected, *, framed: bool) -> Hit | FramedHit | None:
        """``skey``'s stored value (a RAM value as the frames it came in, with ``framed``),
        its layout and tokens checked against ``want`` (LayoutMismatch); None, counted, on a
        miss."""
        hit = (self.store.get_in_memory(skey, framed=True) if framed else None) \
            or self.store.get(skey)
        if hit is None:
            self._missed(skey)
            return None
        _check_layout(skey, hit.value, want)
        return hit

    def _missed(self, skey: bytes) -> None:
        """Count one entry asked for and not found (``getmany.miss``, usage)."""
        self.count("getmany.miss")
        self.usage.missed(skey)

    def get_sent(self, p: Principal, request: pb.GetManyRequest, sending: int
                 ) -> tuple[pb.GetManyResponse, list[bytes | memoryview]]:
        """The network data path's GetMany (``kdn.server.netpath``): the answer, and the
        pieces of every present entry's bytes, in order, which follow it on the connection
        (``EntryRef.offset``: where an entry starts in them). Nothing is copied: the pieces
        are the stored values (a RAM value as the frames it came in); the lower tiers'
        reads count for the answer ``sending`` until the caller has sent them."""
        if len(request.keys) > NET_MAX_KEYS:
            raise TooLarge(f"GetMany of {len(request.keys)} keys on the data path; at most "
                           f"{NET_MAX_KEYS} per call")
        ns = request.namespace or "default"
        want = expected(request)
        out = pb.GetManyResponse()
        pieces: list[bytes | memoryview] = []
        at = 0
        first = self.store.tiers[0] if self.store.tiers else None
        memory = first.name if first is not None and first.in_process else None
        seen: dict[bytes, Hit | FramedHit | None] = {}  # a key asked for again: read once
        for key in request.keys:
            skey = store_key(p.tenant, ns, key)
            ref = out.entries.add()
            started, repeat = time.perf_counter(), skey in seen
            if repeat:  # counted again, but read once
                hit = seen[skey]
                if hit is None:
                    self._missed(skey)
            else:
                hit = seen[skey] = self._hit(skey, want, framed=True)
                if hit is not None and hit.tier != memory:  # read into memory for this answer
                    self.sending.hold(sending, hit, NET_WAIT_S)
                    if self.sending.holds(sending) > NET_HELD_BYTES:
                        raise TooLarge(f"GetMany answer of more than {NET_HELD_BYTES} bytes "
                                       "read from redis or disk; ask for fewer keys per call")
            if hit is None:
                continue
            value = hit.value
            ref.present, ref.tier, ref.length, ref.offset = True, hit.tier, len(value), at
            ref.written = True
            self.usage.served(skey, value, hit.tier,
                              None if repeat else time.perf_counter() - started)
            pieces += [value.header, *value.frames] if isinstance(value, Framed) else [value]
            at += len(value)
            self.count("getmany.hit")
        self.count("bytes_out", at)
        return out, pieces

    def _read_listed(self, p: Principal, generations: Sequence[int]) -> None:
        """Count the reads a same-host client made from its arena's directory, without a
        call, as served (``GetManyRequest.read_listed``): those of slots its tenant's arena
        still lists (a generation is unique in the arena: a client can not count another
        tenant's entries, nor ones it never could have read; a slot dropped since its read
        is not counted), as hits (the RAM tier's: its entries are what an arena lists),
        bytes and usage; not as reads of the store, which made none (``kdn_tier_read_seconds``).
        ``arena.listed_reads``: every reported one."""
        self.count("arena.listed_reads", len(generations))
        arena = self.arenas.existing(p.tenant)
        if arena is None:
            return
        ram = next((t for t in self.store.tiers if t.name == "ram"), None)
        for skey, value in arena.listed_entries(generations):
            self.usage.served(skey, value, "ram", None)
            self.count("getmany.hit")
            self.count("bytes_out", len(value))
            if ram is not None:
                ram.counters.add("hits")

    def _leased(self, p: Principal, seg: Segment, ref: pb.EntryRef, skey: bytes, hit: Hit
                ) -> bool:
        """Answer ``hit`` as a lease on its copy in the tenant's read arena (``ref`` filled
        in); False when it goes the segment way (not a RAM-tier value, arenas off, no room, or
        the arena copy failed its check: the segment copy then checks and re-reads it)."""
        arena = self.arenas.get(p.tenant) if hit.tier == "ram" and hit.stamp else None
        if arena is None:
            return False
        split = split_one(1)

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
                arena.enlist(slot)  # and other clients find it in the directory
        self.count("getmany.hit")
        return True

    def _inline_copy(self, skey: bytes, hit: Hit) -> tuple[bytearray, Hit] | None:
        """A copy of ``hit``'s value to send inline, every checksum verified on the copy; a
        value that fails is read again, as a segment copy's is (``_recopy``): the copy of
        the value read then (of the shape the first was: the one the caller's expectations
        were checked on), or None when there is no sound one (answered as a miss)."""
        for attempt in range(2):
            dst = bytearray(len(hit.value))
            try:
                copy_checked(memoryview(dst), hit.value)
                return dst, hit
            except Corrupt as exc:
                self._distrust(skey, exc)
            again = self.store.get(skey) if attempt == 0 else None
            if again is None or not _same_shape(again.value, hit.value):
                return None
            hit = again
        return None

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

        split = split_one(len(copies))

        def one(item: tuple[pb.EntryRef, bytes, Hit, int]) -> Corrupt | None:
            _, _, hit, at = item
            try:
                copy_checked(seg.span(at, at + len(hit.value)), hit.value, **split)
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
                not _same_shape(again.value, hit.value):
            return None
        try:
            copy_checked(seg.span(at, at + len(hit.value)), again.value)
            return again
        except Corrupt as second:
            self._distrust(skey, second)
            return None

    def _distrust(self, skey: bytes, exc: Corrupt) -> None:
        log.error("entry %r failed its check in a segment copy: %s", skey, exc)
        self.count("getmany.corrupt")
        self.store.distrust(skey)
