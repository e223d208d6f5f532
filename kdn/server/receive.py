"""Store and StoreMany streams received: each entry's header checked, then its frames as they
arrive, and only complete, valid entries committed (``kdn.server.ingest``).

The server never decodes tensors. A Store stream is checked as it arrives: the container header
(checksum, layout, known codec, declared size), then every frame (checksum, position, per-layer
shapes against the layout). Only a complete, valid entry is written, in one ``put``; a stream
that fails, is cancelled or ends early writes nothing, so what was stored before stays intact.
A StoreMany stream stores none of its entries unless every one passed.

What a stream holds counts as bytes being received (``Ingest.reserve``, ``_Held``) until its
entries are committed or dropped: each entry's declared ``total_bytes``, more as the frames of
one that declared less arrive, and a StoreMany's entries received before its last.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kdn.codec.copies import copy_pieces_checked
from kdn.codec.format import Header, check_frame, declared_length
from kdn.errors import Corrupt, InvalidArgument, KDNError, TooLarge
from kdn.server.auth import Principal
from kdn.server.batch import MAX_BATCH_BYTES
from kdn.server.ingest import Ingest, written
from kdn.store.framed import MIN_FRAMED_BYTES, Framed, framed_limit
from kdn.transport.buffers import (
    BACKGROUND_CHECK_BYTES,
    COPIES_IN_FLIGHT,
    MIN_BYTES,
    OVERLAP_FRAME_BYTES,
    BufferPool,
    copy_threads,
    kept_free_bytes,
)
from kdn.transport.wire import FrameMessage, piece_fault
from kdn.v1 import kdn_pb2 as pb

T = TypeVar("T")


def _copy_frame_timed(header: Header, index: int, dst: memoryview,
                      pieces: list[bytes | memoryview]) -> float:
    """``copy_pieces_checked`` of a frame in one or more pieces (one pass: each chunk hashed
    in cache right after its copy), then the copy's records checked as ``check_frame`` checks
    them (shapes against the layout; the sum not again); the seconds it took."""
    t0 = time.perf_counter()
    copy_pieces_checked(header, index, dst, pieces)
    check_frame(header, index, dst, checksum=False, records=False)
    return time.perf_counter() - t0


def _check_frame_timed(header: Header, index: int, frame: bytes | memoryview) -> float:
    """``check_frame``; the seconds it took."""
    t0 = time.perf_counter()
    check_frame(header, index, frame, records=False)
    return time.perf_counter() - t0


MAX_GROUPED_ENTRIES = 4096
"""Entries one grouped StoreMany may declare (its headers arrive before any frame; a client
groups no more: ``kdn.client.storing.GROUP_ENTRIES``)."""

_SINGLE, _MANY, _GROUPED = 0, 1, 2
"""How a Store stream's entry ends (``Receiver._entry``): with the stream (Store), at the
next header (StoreMany), or once its declared bytes arrived (a grouped StoreMany)."""


@dataclass(frozen=True, slots=True)
class Received:
    """A received, checked entry of a Store or StoreMany stream, not yet stored."""

    skey: bytes
    value: bytes | memoryview | Framed
    options: pb.StoreOptions
    header: Header
    next: pb.StoreRequest | None = None
    """StoreMany: the header of the entry after it (None: the stream ended)."""


async def _client_bytes(call: Awaitable[T]) -> T:
    """``call``, damaged bytes a client sent (Corrupt) answered as a bad request
    (INVALID_ARGUMENT), not as data loss."""
    try:
        return await call
    except Corrupt as exc:
        raise InvalidArgument(f"corrupt input: {exc}") from exc


class _Held:
    """The bytes one Store or StoreMany stream holds, counted as being received
    (``Ingest.reserve``; TooLarge past the bound) until ``release``: its entries stay in memory
    until they are committed, so they count until then."""

    def __init__(self, ingest: Ingest, principal: Principal) -> None:
        self.ingest, self.principal, self.nbytes = ingest, principal, 0

    def add(self, nbytes: int, what: str) -> None:
        if nbytes > 0:
            self.ingest.reserve(self.principal, nbytes, what)
            self.nbytes += nbytes

    def release(self) -> None:
        self.ingest.release(self.principal, self.nbytes)
        self.nbytes = 0


class Receiver:
    """Store and StoreMany streams received into entries and committed through ``ingest``;
    large entries are copied into buffers from ``buffers`` as they arrive."""

    def __init__(self, ingest: Ingest, buffers: BufferPool) -> None:
        self.ingest = ingest
        self.buffers = buffers

    async def store(self, principal: Principal,
                    request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                    ) -> pb.StoreResponse:
        """A Store stream: one entry, its header then its frames, stored once all arrived
        sound."""
        return await _client_bytes(self._store(principal, request_iterator))

    async def store_many(self, principal: Principal,
                         request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                         ) -> pb.StoreManyResponse:
        """A StoreMany stream (``_store_many``)."""
        return await _client_bytes(self._store_many(principal, request_iterator))

    async def _store(self, principal: Principal,
                     request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                     ) -> pb.StoreResponse:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("empty Store stream: expected a header first") from None
        if isinstance(first, FrameMessage) or first.WhichOneof("part") != "header":
            raise InvalidArgument("Store stream must start with a header")
        held = _Held(self.ingest, principal)
        try:
            entry = await self._entry(principal, first.header, it, _SINGLE, held)
            return (await self._commit(principal, [entry]))[0]
        finally:
            held.release()

    async def _store_many(self, principal: Principal,
                          request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                          ) -> pb.StoreManyResponse:
        """Many entries in one stream, each its header then its frames (a message each), as
        Store's, or grouped: every header in one message (``StoreHeaders``), then each entry's
        frames, its ``total_bytes`` telling where they end. Every entry is received and
        checked before any is stored (a bad one stores none), at most ``MAX_BATCH_BYTES`` in
        all. The remote form of a batch write; the answer says this server reads the grouped
        form (``reads_grouped``), which a client sends only once told."""
        held = _Held(self.ingest, principal)  # every entry, until committed
        try:
            return await self._many(principal, request_iterator.__aiter__(), held)
        finally:
            held.release()

    async def _many(self, principal: Principal, it: AsyncIterator[Any], held: _Held
                    ) -> pb.StoreManyResponse:
        entries: list[Received] = []
        first: pb.StoreRequest | FrameMessage | None = await anext(it, None)
        if first is not None and not isinstance(first, FrameMessage) and \
                first.WhichOneof("part") == "headers":  # grouped
            heads = list(first.headers.headers)
            if not heads or len(heads) > MAX_GROUPED_ENTRIES:
                raise InvalidArgument(f"StoreMany: a grouped stream of {len(heads)} headers; "
                                      f"from 1 to {MAX_GROUPED_ENTRIES}")
            self._batch_bytes(sum(h.total_bytes for h in heads))
            held.add(sum(h.total_bytes for h in heads), written(len(heads)))
            for head in heads:
                entries.append(await self._many_entry(principal, head, it, _GROUPED, entries,
                                                      held))
            if await anext(it, None) is not None:
                raise InvalidArgument(f"StoreMany: more after the {len(heads)} grouped entries")
            self.ingest.count("storemany.grouped")
            first = None
        batch = sum(len(e.value) for e in entries)
        while first is not None:  # one header after another
            if isinstance(first, FrameMessage) or first.WhichOneof("part") != "header":
                raise InvalidArgument("StoreMany: a frame arrived where an entry's header "
                                      "was due")
            self._batch_bytes(batch + first.header.total_bytes)
            entry = await self._many_entry(principal, first.header, it, _MANY, entries, held)
            batch += len(entry.value)
            self._batch_bytes(batch)
            entries.append(entry)
            first = entry.next
        return pb.StoreManyResponse(results=await self._commit(principal, entries),
                                    reads_grouped=True)

    async def _many_entry(self, principal: Principal, head: pb.StoreHeader,
                          it: AsyncIterator[Any], form: int, before: list[Received],
                          held: _Held) -> Received:
        """Entry ``len(before)`` of a StoreMany stream, an error naming it (as PutMany names
        its item)."""
        try:
            return await self._entry(principal, head, it, form, held)
        except KDNError as exc:
            raise type(exc)(f"entry {len(before)}: {exc}") from exc

    @staticmethod
    def _batch_bytes(total: int) -> None:
        if total > MAX_BATCH_BYTES:
            raise TooLarge(f"StoreMany of more than {MAX_BATCH_BYTES} bytes; at most "
                           f"{MAX_BATCH_BYTES} per call")

    async def _commit(self, principal: Principal, entries: list[Received]
                      ) -> list[pb.StoreResponse]:
        """Commit checked entries, in order: on the event loop's thread where the store is a
        dict put (the hand-off to a worker thread and back costs more than the put itself),
        else on a worker thread. None of them when they do not fit the tenant's quota
        together, each within what later ones give back (``Ingest.check_room``)."""
        over = self.ingest.check_room(principal, [(e.skey, len(e.value)) for e in entries]) \
            if len(entries) > 1 else [0]

        def run() -> list[pb.StoreResponse]:
            return [self.ingest.commit(principal, e.skey, e.value, e.options, e.header,
                                       over=n) for e, n in zip(entries, over)]

        return run() if self.ingest.store.memory_only else await asyncio.to_thread(run)

    async def _entry(self, principal: Principal, head: pb.StoreHeader, it: AsyncIterator[Any],
                     form: int, held: _Held) -> Received:
        """One entry of a Store stream (``head`` its header), received and checked. Its frames
        end with the stream (``_SINGLE``: Store), where the next header begins (``_MANY``:
        StoreMany, ``Received.next``), or once its ``total_bytes`` arrived (``_GROUPED``: a
        grouped StoreMany, every header sent first). Its bytes count in ``held`` (a grouped
        StoreMany's counted all its entries' at their headers), the stream's to release."""
        t0 = time.perf_counter()
        skey, header = self.ingest.check_header(principal.tenant, head)
        checking = time.perf_counter() - t0  # the checks' time, for kdn_entry_check_seconds
        declared = head.total_bytes
        self.ingest.check_size(declared)
        self.ingest.check_room(principal, [(skey, declared)])  # before it is received
        # An entry is kept as the frames it arrives in, each a view of its message
        # (kdn.store.framed): no copy into one buffer, and a Retrieve can send those very
        # messages back. Past ``framed_limit`` (declared; half the heap the allocator keeps)
        # it is copied into one buffer recycled from entries that left (kdn.transport.buffers), each
        # frame as it lands: fresh memory for so many messages costs more in page faults than
        # the copy. Entries under MIN_FRAMED_BYTES are joined once at the end.
        if (declared >= MIN_BYTES or form == _GROUPED) and declared < len(header.raw):
            raise InvalidArgument(f"total_bytes {declared} is smaller than the header")
        if form != _GROUPED:
            held.add(declared, "entry")
        whole = None
        if declared > framed_limit(kept_free_bytes()):
            whole = memoryview(self.buffers.take(declared))  # type: ignore[arg-type]
            whole[: len(header.raw)] = header.raw
        checks: deque[asyncio.Future[float]] = deque()
        try:
            return await self._frames(it, head, skey, header, whole, checking, checks, form,
                                      held)
        finally:
            if checks:  # nothing writes into the buffer once this returns or raises
                await asyncio.gather(*checks, return_exceptions=True)

    async def _frames(self, it: AsyncIterator[Any], head: pb.StoreHeader, skey: bytes,
                      header: Header, whole: memoryview | None, checking: float,
                      checks: deque[asyncio.Future[float]], form: int, held: _Held
                      ) -> Received:
        """The rest of a Store stream: its frames checked (copied into ``whole``, where there
        is one; frames of ``BACKGROUND_CHECK_BYTES`` or more, or copied ones of
        ``OVERLAP_FRAME_BYTES`` or more, on ``kdn.transport.buffers.copy_threads`` while the next
        one arrives, held in ``checks``, as the event loop's thread would hold up every other
        call), then the entry received: one buffer (``whole``, or joined below
        ``MIN_FRAMED_BYTES``) or ``Framed``. A frame may come in pieces (``Frame.offset``): each is
        taken once the next frame begins or the stream ends, its pieces joined (or copied).
        An unsized entry's bytes past what it declared count in ``held`` as they arrive."""
        declared, n_frames = head.total_bytes, len(header.entry.frames)
        limit = self.ingest.config.max_entry_bytes
        # kept as frames, or copied into ``whole``; a grouped entry's size tells where it ends
        sized = declared >= MIN_BYTES or form == _GROUPED
        loop = asyncio.get_running_loop()
        total = len(header.raw)
        index = 0  # frames begun
        frames: list[bytes | memoryview] = []
        messages: list[bytes] | None = []  # each frame's message, while all came whole
        pieces: list[bytes | memoryview] = []  # the frame being received: its pieces so far
        begun = got = 0  # where it begins in the entry, its bytes so far
        size, done = -1, False  # its length as its prefix declares it (-1: unreadable), taken
        message: bytes | None = None  # its message, where it came in one

        def finish() -> None:  # frame ``index - 1`` has all its pieces
            nonlocal checking, messages
            i = index - 1
            if whole is not None:
                work = partial(_copy_frame_timed, header, i, whole[begun:begun + got],
                               list(pieces))
            else:
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                frames.append(data)
                if messages is not None:
                    if message is None or len(pieces) > 1:
                        messages = None
                    else:
                        messages.append(message)
                work = partial(_check_frame_timed, header, i, data)
            if got >= (BACKGROUND_CHECK_BYTES if whole is None else OVERLAP_FRAME_BYTES):
                checks.append(loop.run_in_executor(copy_threads(), work))  # beside the next
            else:  # now, while in cache
                checking += work()

        following: pb.StoreRequest | None = None  # StoreMany: the next entry's header
        async for msg in it:
            if msg.WhichOneof("part") != "frame":
                if form != _MANY:
                    raise InvalidArgument("Store stream carries a second header"
                                          if form == _SINGLE else
                                          "StoreMany: a header after the grouped headers")
                following = msg
                break
            frame = msg.frame
            data = frame.data  # once: each read of a generated message's bytes copies them
            if frame.offset:
                fault = piece_fault(frame, index - 1 if index else None, got,
                                    len(pieces[-1]) if pieces else 0)
                if fault:
                    raise InvalidArgument(fault)
            elif frame.index != index:
                raise InvalidArgument(f"frame {frame.index} arrived, expected frame {index}")
            if total + len(data) > limit:
                raise TooLarge(f"entry exceeds max_entry_bytes {limit}")
            if total + len(data) > declared:
                if sized:
                    raise InvalidArgument(f"frames exceed the declared total_bytes {declared}")
                held.add(total + len(data) - max(total, declared), "frame")
            if not frame.offset:
                if index and not done:
                    finish()
                while len(checks) > COPIES_IN_FLIGHT or checks and checks[0].done():
                    checking += await checks.popleft()  # raises Corrupt for a damaged frame
                index, pieces, begun, got = index + 1, [], total, 0
                size, done = declared_length(data), False
                message = msg.message if isinstance(msg, FrameMessage) else None
            if size >= 0 and got + len(data) > size:
                raise InvalidArgument(f"frame {index - 1}: more than the {size} bytes its "
                                      "prefix declares")
            pieces.append(data)  # checked once its frame is whole
            got += len(data)
            total += len(data)
            if got == size:  # whole: checked now, while its last bytes are in cache
                finish()
                done = True
                if form == _GROUPED and total == declared:
                    break  # the entry's bytes are in: the next message is the next entry's
        if index and not done:
            finish()
        if index != n_frames:
            raise InvalidArgument(
                f"Store stream ended after {index} of {n_frames} frames; nothing was stored"
            )
        if sized and total != declared:
            raise InvalidArgument(f"frames hold {total} bytes, total_bytes declared {declared}")
        while checks:
            checking += await checks.popleft()
        value: bytes | memoryview | Framed
        if whole is not None:
            value = whole.toreadonly()
        elif total >= MIN_FRAMED_BYTES:
            value = Framed(header.raw, tuple(frames),
                           None if messages is None else tuple(messages), total)
        else:
            value = b"".join((header.raw, *frames))
        self.ingest.checked(header, checking)
        return Received(skey, value, head.options, header, following)
