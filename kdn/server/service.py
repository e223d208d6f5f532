"""The gRPC servicer: thin handlers that validate, then call the store.

The server never decodes tensors. A Store stream is checked as it arrives: the container header
(checksum, layout, known codec, declared size), then every frame (checksum, position, per-layer
shapes against the layout). Only a complete, valid entry is written, in one ``put``; a stream
that fails, is cancelled or ends early writes nothing, so what was stored before stays intact.

Errors are ``KDNError`` kinds; ``_rpc`` maps them to status codes in one place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kdn.buffers import (
    BACKGROUND_CHECK_BYTES,
    COPIES_IN_FLIGHT,
    MIN_BYTES,
    OVERLAP_FRAME_BYTES,
    BufferPool,
    copy_threads,
    kept_free_bytes,
)
from kdn.codec.catalog import check_codec
from kdn.codec.copies import copy_pieces_checked
from kdn.codec.format import (
    Header,
    check_frame,
    declared_length,
    entry_digest,
    parse_container,
    parse_header,
    split_frames,
)
from kdn.errors import Corrupt, InvalidArgument, KDNError, LayoutMismatch, NotFound, TooLarge
from kdn.keys import split_store_key, store_key
from kdn.options import Durability
from kdn.server.arena import Arena, Arenas, Slot
from kdn.server.auth import AuthConfig, Authenticator, Principal, current_principal
from kdn.server.batch import MAX_BATCH_BYTES, BatchMixin, Segments
from kdn.server.blend_rpc import BlendMixin
from kdn.server.config import ServerConfig
from kdn.server.putmany import PutManyMixin
from kdn.server.retrieve_many import RetrieveManyMixin
from kdn.server.usage import Usage
from kdn.server.wire_memo import WireMemo
from kdn.status import grpc_code
from kdn.store.base import Tier
from kdn.store.framed import MIN_FRAMED_BYTES, Framed, framed_limit
from kdn.store.tiered import FramedHit, Hit, TieredStore
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from kdn.wire import FrameMessage, piece_fault

log = logging.getLogger(__name__)
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
"""How a Store stream's entry ends (``KDNServicer._entry``): with the stream (Store), at the
next header (StoreMany), or once its declared bytes arrived (a grouped StoreMany)."""


@dataclass(frozen=True, slots=True)
class _Entry:
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


def verify_entry(value: bytes) -> None:
    """Full check of a stored entry (header and every frame checksum); raises Corrupt."""
    parse_container(value, verify=True)


def _rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: KDNServicer, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            try:
                return await fn(self, request, context)
            except DecodeError as exc:  # a streamed request message that is not protobuf
                raise InvalidArgument(f"malformed request message: {exc}") from exc
        except KDNError as exc:
            self.count(f"{fn.__name__}.{grpc_code(exc).name}")
            await context.abort(grpc_code(exc), str(exc))
            raise  # unreachable: abort raises

    return wrapper


def delete_entry(store: TieredStore, auth: Authenticator, skey: bytes,
                 tier: Tier | None = None) -> bool:
    """Delete ``skey`` from every tier (or only from ``tier``) and refund its tenant when the
    entry is gone from all tiers, once, under the entry's lock (see ``KDNServicer._commit``)."""
    with store.entry_lock(skey):
        before = store.lookup([skey])[0]
        found = store.delete(skey) if tier is None else bool(tier.delete(skey))
        if before.present and (tier is None or not store.lookup([skey])[0].present):
            auth.refund(split_store_key(skey)[0], before.size)
    return bool(found)


def recount_usage(store: TieredStore, auth: Authenticator) -> None:
    """Set every tenant's usage to the bytes its entries hold in the tiers, with no entry
    changing meanwhile: at start-up, and after ``Gc`` (TTL expiries and capacity evictions
    leave the store without a caller, so only a recount gives their bytes back)."""
    with store.all_entries_locked():
        for tenant in auth.config.policies:
            keys = store.keys(f"{tenant}:".encode())
            auth.set_usage(tenant, sum(p.size for p in store.lookup(keys)))


class KDNServicer(BatchMixin, PutManyMixin, BlendMixin, RetrieveManyMixin,
                  pb_grpc.KDNServicer):
    def __init__(self, config: ServerConfig, store: TieredStore,
                 auth: Authenticator | None = None) -> None:
        self.config = config
        self.store = store
        self.auth = auth or Authenticator(AuthConfig())
        self.counters: dict[str, int] = {}
        self.started = time.time()
        self.segments = Segments()
        # same-host reads: each tenant's hottest RAM-tier entries, leased (kdn.server.arena)
        self.arenas = Arenas(min(config.shm_arena_bytes, config.ram_bytes // 4))
        # receive buffers of large entries, recycled: up to a quarter of the RAM tier kept free
        self.buffers = BufferPool(min(1 << 30, config.ram_bytes // 4))
        self.usage = Usage()  # tokens stored and served, for the metrics (kdn.server.usage)
        # Retrieve's messages, kept: at most a quarter of the RAM tier on top of it
        self.wire_memo = WireMemo(min(config.wire_memo_bytes, config.ram_bytes // 4))
        self._durabilities = {d.value for d in Durability  # those some tier here meets
                              if any(t.satisfies(d) for t in store.tiers)}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- Store ----------------------------------------------------------------------------------

    def _check_header(self, tenant: str, msg: pb.StoreHeader) -> tuple[bytes, Header]:
        """A Store's header checked and parsed: (tier key, header); refused before anything
        is charged or written (a bad value used to fail in the put)."""
        skey = self._check_target(tenant, msg.namespace, msg.key, msg.options, msg.total_bytes)
        header = parse_header(msg.container_header)
        if len(header.raw) != len(msg.container_header):
            raise InvalidArgument("container_header has trailing bytes after its checksum")
        self._check_kind(header, msg.layout_fingerprint)
        return skey, header

    def _check_target(self, tenant: str, namespace: str, key: bytes, opts: pb.StoreOptions,
                      total: int) -> bytes:
        """The tier key of an entry of ``total`` bytes to store with ``opts``, once its name,
        options and size are allowed here."""
        skey = store_key(tenant, namespace or "default", key)
        if opts.durability not in self._durabilities:
            try:
                durability = Durability(opts.durability)
            except ValueError:
                raise InvalidArgument(f"unknown durability {opts.durability}") from None
            raise InvalidArgument(f"durability {durability.name} needs a tier this server "
                                  "does not have")
        if total > self.config.max_entry_bytes:
            raise TooLarge(f"entry of {total} bytes exceeds max_entry_bytes "
                           f"{self.config.max_entry_bytes}")
        return skey

    def _check_kind(self, header: Header, layout_fingerprint: str = "") -> None:
        """An entry's codec and model allowed here (and its layout the one the caller named,
        where it named one)."""
        check_codec(header.mode, header.entry.codec.level)
        if layout_fingerprint and layout_fingerprint != header.layout.fingerprint:
            raise InvalidArgument(
                f"layout_fingerprint {layout_fingerprint} does not match the container's "
                f"layout {header.layout.fingerprint}"
            )
        allowed = self.config.allowed_models
        if allowed and header.layout.model_fingerprint not in allowed:
            raise LayoutMismatch(
                f"model {header.layout.model_fingerprint} ({header.layout.model_name or '?'}) "
                "is not served here; allowed_models lists "
                + ", ".join(allowed)
            )

    @_rpc
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage],
                    context: grpc.aio.ServicerContext) -> pb.StoreResponse:
        return await _client_bytes(self._store(request_iterator))

    async def _store(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                     ) -> pb.StoreResponse:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("empty Store stream: expected a header first") from None
        if isinstance(first, FrameMessage) or first.WhichOneof("part") != "header":
            raise InvalidArgument("Store stream must start with a header")
        principal = current_principal.get()
        entry = await self._entry(principal, first.header, it, _SINGLE)
        return (await self._commit_entries(principal, [entry]))[0]

    async def _commit_entries(self, principal: Principal, entries: list[_Entry]
                              ) -> list[pb.StoreResponse]:
        """Commit checked entries, in order: on the event loop's thread where the store is a
        dict put (the hand-off to a worker thread and back cost more, ~0.3 ms a Store on a
        2-core VM, than the put itself), else on a worker thread."""
        def run() -> list[pb.StoreResponse]:
            return [self._commit(principal, e.skey, e.value, e.options, e.header)
                    for e in entries]

        return run() if self.store.memory_only else await asyncio.to_thread(run)

    async def _entry(self, principal: Principal, head: pb.StoreHeader, it: AsyncIterator[Any],
                     form: int) -> _Entry:
        """One entry of a Store stream (``head`` its header), received and checked. Its frames
        end with the stream (``_SINGLE``: Store), where the next header begins (``_MANY``:
        StoreMany, ``_Entry.next``), or once its ``total_bytes`` arrived (``_GROUPED``: a
        grouped StoreMany, every header sent first)."""
        t0 = time.perf_counter()
        skey, header = self._check_header(principal.tenant, head)
        checking = time.perf_counter() - t0  # the checks' time, for kdn_entry_check_seconds
        declared = head.total_bytes
        if declared > self.config.max_entry_bytes:
            raise TooLarge(f"entry of {declared} bytes exceeds max_entry_bytes "
                           f"{self.config.max_entry_bytes}")
        # An entry is kept as the frames it arrives in, each a view of its message
        # (kdn.store.framed): no copy into one buffer, and a Retrieve can send those very
        # messages back. Past ``framed_limit`` (declared; half the heap the allocator keeps)
        # it is copied into one buffer recycled from entries that left (kdn.buffers), each
        # frame as it lands: fresh memory for so many messages costs more in page faults than
        # the copy. Entries under MIN_FRAMED_BYTES are joined once at the end.
        if (declared >= MIN_BYTES or form == _GROUPED) and declared < len(header.raw):
            raise InvalidArgument(f"total_bytes {declared} is smaller than the header")
        whole = None
        if declared > framed_limit(kept_free_bytes()):
            whole = memoryview(self.buffers.take(declared))  # type: ignore[arg-type]
            whole[: len(header.raw)] = header.raw
        checks: deque[asyncio.Future[float]] = deque()
        try:
            return await self._frames(it, head, skey, header, whole, checking, checks, form)
        finally:
            if checks:  # nothing writes into the buffer once this returns or raises
                await asyncio.gather(*checks, return_exceptions=True)

    async def _frames(self, it: AsyncIterator[Any], head: pb.StoreHeader, skey: bytes,
                      header: Header, whole: memoryview | None, checking: float,
                      checks: deque[asyncio.Future[float]], form: int) -> _Entry:
        """The rest of a Store stream: its frames checked (copied into ``whole``, where there
        is one; frames of ``BACKGROUND_CHECK_BYTES`` or more, or copied ones of
        ``OVERLAP_FRAME_BYTES`` or more, on ``kdn.buffers.copy_threads`` while the next one
        arrives, held in ``checks``, as the event loop's thread would hold up every other
        call), then the entry received: one buffer (``whole``, or joined below
        ``MIN_FRAMED_BYTES``) or ``Framed``. A frame may come in pieces (``Frame.offset``): each is
        taken once the next frame begins or the stream ends, its pieces joined (or copied)."""
        declared, n_frames = head.total_bytes, len(header.entry.frames)
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
            if total + len(data) > self.config.max_entry_bytes:
                raise TooLarge(f"entry exceeds max_entry_bytes {self.config.max_entry_bytes}")
            if sized and total + len(data) > declared:
                raise InvalidArgument(f"frames exceed the declared total_bytes {declared}")
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
        self.usage.checked(header, checking)
        return _Entry(skey, value, head.options, header, following)

    @_rpc
    async def StoreMany(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage],
                        context: grpc.aio.ServicerContext) -> pb.StoreManyResponse:
        return await _client_bytes(self._store_many(request_iterator))

    async def _store_many(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage]
                          ) -> pb.StoreManyResponse:
        """Many entries in one stream, each its header then its frames (a message each), as
        Store's, or grouped: every header in one message (``StoreHeaders``), then each entry's
        frames, its ``total_bytes`` telling where they end. Every entry is received and
        checked before any is stored (a bad one stores none), at most ``MAX_BATCH_BYTES`` in
        all. The remote form of a batch write; the answer says this server reads the grouped
        form (``reads_grouped``), which a client sends only once told."""
        it = request_iterator.__aiter__()
        principal = current_principal.get()
        entries: list[_Entry] = []
        first: pb.StoreRequest | FrameMessage | None = await anext(it, None)
        if first is not None and not isinstance(first, FrameMessage) and \
                first.WhichOneof("part") == "headers":  # grouped
            heads = list(first.headers.headers)
            if not heads or len(heads) > MAX_GROUPED_ENTRIES:
                raise InvalidArgument(f"StoreMany: a grouped stream of {len(heads)} headers; "
                                      f"from 1 to {MAX_GROUPED_ENTRIES}")
            self._batch_bytes(sum(h.total_bytes for h in heads))
            for head in heads:
                entries.append(await self._many_entry(principal, head, it, _GROUPED, entries))
            if await anext(it, None) is not None:
                raise InvalidArgument(f"StoreMany: more after the {len(heads)} grouped entries")
            self.count("storemany.grouped")
            first = None
        held = sum(len(e.value) for e in entries)
        while first is not None:  # one header after another
            if isinstance(first, FrameMessage) or first.WhichOneof("part") != "header":
                raise InvalidArgument("StoreMany: a frame arrived where an entry's header "
                                      "was due")
            self._batch_bytes(held + first.header.total_bytes)
            entry = await self._many_entry(principal, first.header, it, _MANY, entries)
            held += len(entry.value)
            self._batch_bytes(held)
            entries.append(entry)
            first = entry.next
        return pb.StoreManyResponse(results=await self._commit_entries(principal, entries),
                                    reads_grouped=True)

    async def _many_entry(self, principal: Principal, head: pb.StoreHeader,
                          it: AsyncIterator[Any], form: int, before: list[_Entry]) -> _Entry:
        """Entry ``len(before)`` of a StoreMany stream, an error naming it (as PutMany names
        its item)."""
        try:
            return await self._entry(principal, head, it, form)
        except KDNError as exc:
            raise type(exc)(f"entry {len(before)}: {exc}") from exc

    @staticmethod
    def _batch_bytes(total: int) -> None:
        if total > MAX_BATCH_BYTES:
            raise TooLarge(f"StoreMany of more than {MAX_BATCH_BYTES} bytes; at most "
                           f"{MAX_BATCH_BYTES} per call")

    def _commit(self, principal: Principal, skey: bytes, value: bytes | memoryview | Framed,
                opts: pb.StoreOptions, header: Header | None = None,
                in_arena: tuple[Arena, Slot] | None = None) -> pb.StoreResponse:
        """Charge the tenant and put a checked entry (a worker thread; Store and PutMany).

        Under the entry's lock: the size it replaces is read, growth is charged (refused past
        the quota) before the put and refunded when the put fails; shrinkage is refunded after
        the put succeeds. Concurrent overwrites and deletes of one key thus count it once."""
        self.wire_memo.drop(skey)  # the old value's messages: never sent again (a new stamp)
        with self.store.entry_lock(skey):
            replaced = self.store.presence(skey)
            delta = len(value) - replaced.size
            if delta > 0:
                self.auth.charge(principal, delta)
            try:
                # a read-only byte view (PutMany) is stored as it is: tiers read any buffer
                tier = self.store.put(skey, value,  # type: ignore[arg-type]
                                      ttl_s=float(opts.ttl_seconds) or None, pin=opts.pin,
                                      durability=Durability(opts.durability), verified=True)
            except BaseException:
                if delta > 0:
                    self.auth.charge(principal, -delta)
                raise
            self.arenas.drop(skey)  # nor the old value's arena copy (leases given keep it,
            # whole), now the new one is in: under the entry lock, so no copy of the old one is
            # read without a call from here on (``BatchMixin._leased``)
            if in_arena is not None:  # ``value`` lives in the tenant's read arena (PutMany):
                stamp = self.store.memory_stamp(skey, expiring=True, value=value)  # reads
                if stamp:  # find it there (the RAM tier holds this very view)
                    in_arena[0].publish(in_arena[1], skey, stamp)
            if delta < 0:
                self.auth.charge(principal, delta)
        self.count("store.ok")
        self.count("bytes_in", len(value))
        if header is not None:
            self.usage.stored(skey, header, len(value))
        return pb.StoreResponse(stored_bytes=len(value), tier=tier, replaced=replaced.present)

    # -- Retrieve -------------------------------------------------------------------------------

    async def _read(self, skey: bytes) -> tuple[Hit | FramedHit | None, float]:
        """``skey``'s value (a RAM value checked already on this thread, else through
        ``TieredStore.get`` on a worker thread) and the seconds the read took."""
        started = time.perf_counter()
        hit = self.store.get_in_memory(skey, framed=True) or await asyncio.to_thread(
            self.store.get, skey)
        return hit, time.perf_counter() - started

    def _retrieve_answer(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: str,
                first: int = 0, last: int = 0, piece_bytes: int = 0
                ) -> tuple[pb.RetrieveHeader, list[tuple[int, bytes | memoryview]],
                           Iterator[list[bytes]]]:
        """A Retrieve answer of ``hit``: its header, the frames of layers [first, last) (0:
        through the last) and their messages (a frame's pieces where ``piece_bytes``), which
        a stream sends one at a time: the messages a Store brought where the value is kept
        as they came, else memoised or built as they are sent (``WireMemo``)."""
        header = self._served(skey, hit, read_s, want)
        return self._frames_answer(skey, hit, header, first, last, piece_bytes)

    def _served(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: str) -> Header:
        """``hit``'s header, its read counted as served; LayoutMismatch when ``want`` (a
        layout fingerprint) is not its layout's."""
        header = parse_header(hit.value.header if isinstance(hit, FramedHit) else hit.value)
        self.usage.served(skey, hit.value, hit.tier, read_s, header)
        if want and want != header.layout.fingerprint:
            raise LayoutMismatch(
                f"entry has layout {header.layout.fingerprint}, caller expects {want}")
        return header

    def _frames_answer(self, skey: bytes, hit: Hit | FramedHit, header: Header, first: int,
                       last: int, piece_bytes: int
                       ) -> tuple[pb.RetrieveHeader, list[tuple[int, bytes | memoryview]],
                                  Iterator[list[bytes]]]:
        """``_retrieve_answer`` of a hit whose read was counted (``_served``)."""
        kept = hit.value if isinstance(hit, FramedHit) else None  # as it arrived
        frames: list[bytes | memoryview] = list(
            hit.value.frames if isinstance(hit, FramedHit) else
            split_frames(hit.value, len(header.raw)))
        last = last or header.layout.num_layers
        sel = [
            (i, f) for i, (f, span) in enumerate(zip(frames, header.entry.frames))
            if span.first_layer < last and span.first_layer + span.num_layers > first
        ]
        head = pb.RetrieveHeader(
            container_header=header.raw, total_bytes=len(hit.value), tier=hit.tier,
            frame_count=len(frames), entry_digest=entry_digest(frames))
        memo: Iterator[list[bytes]]
        if kept is not None and kept.messages is not None and piece_bytes <= 0:
            memo = ([kept.messages[i]] for i, _ in sel)  # as they came: nothing to build
        else:
            memo = self.wire_memo.messages(skey, hit.stamp if hit.tier == "ram" else 0,
                                           len(hit.value), len(frames), sel, piece_bytes)
        return head, sel, memo

    async def Retrieve(self, request: pb.RetrieveRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RetrieveResponse]:
        try:
            skey = store_key(current_principal.get().tenant, request.namespace or "default",
                             request.key)
            hit, read_s = await self._read(skey)
            if hit is None:
                self.count("retrieve.miss")
                self.usage.missed(skey)
                raise NotFound(f"no entry for key {request.key.hex()} in {request.namespace!r}")
            pieces = request.piece_bytes if len(hit.value) \
                >= request.piece_min_entry_bytes else 0
            head, sel, memo = self._retrieve_answer(
                skey, hit, read_s, request.expect_layout_fingerprint, request.first_layer,
                request.last_layer, pieces)
        except KDNError as exc:
            self.count(f"Retrieve.{grpc_code(exc).name}")
            await context.abort(grpc_code(exc), str(exc))
            return
        yield pb.RetrieveResponse(header=head)
        sent = 0
        try:
            for (_, frame), msgs in zip(sel, memo):
                for msg in msgs:
                    # Each yield waits for flow control: a slow or cancelled client stops the
                    # sending here instead of the server buffering the whole entry.
                    yield msg  # type: ignore[misc]
                sent += len(frame)
                self.count("retrieve.frames_sent")
        except (asyncio.CancelledError, GeneratorExit):
            self.count("retrieve.cancelled")
            raise
        finally:
            self.count("bytes_out", sent)
        self.count("retrieve.hit")

    # -- Lookup / Delete / Stats ----------------------------------------------------------------

    @_rpc
    async def Lookup(self, request: pb.LookupRequest,
                     context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        tenant, ns = current_principal.get().tenant, request.namespace or "default"
        skeys = [store_key(tenant, ns, k) for k in request.keys]
        found = await asyncio.to_thread(self.store.lookup, skeys)
        resp = pb.LookupResponse(
            infos=[pb.KeyInfo(present=p.present, tier=p.tier, size_bytes=p.size) for p in found]
        )
        if request.prefix_chain:
            hits = 0
            for p in found:
                if not p.present:
                    break
                hits += 1
            resp.prefix_hits = hits
        return resp

    @_rpc
    async def Delete(self, request: pb.DeleteRequest,
                     context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        principal, ns = current_principal.get(), request.namespace or "default"
        skeys = [store_key(principal.tenant, ns, k) for k in request.keys]
        deleted = await asyncio.to_thread(lambda: sum(delete_entry(self.store, self.auth, k)
                                                      for k in skeys))
        for k in skeys:
            self.wire_memo.drop(k)
            self.arenas.drop(k)
        return pb.DeleteResponse(deleted=deleted)

    @_rpc
    async def Stats(self, request: pb.StatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        from kdn import __version__

        tiers = await asyncio.to_thread(self.store.stats)
        down = self.store.parts_down()  # remembered by the tiers' watchers: no calls out
        counters = dict(self.counters)
        counters.update({f"store.{k}": v for k, v in self.store.counters.items()})
        counters.update({"wire_memo.hits": self.wire_memo.hits,
                         "wire_memo.misses": self.wire_memo.misses,
                         "wire_memo.bytes": self.wire_memo.used_bytes})
        counters.update(self.arenas.counters())
        counters.update({"buffers.reused": self.buffers.reused,
                         "buffers.created": self.buffers.created,
                         "buffers.free_bytes": self.buffers.free_bytes})
        counters.update({f"store.{k}.queued": v for k, v in self.store.queue_depth().items()})
        counters["store.degraded"] = int(self.store.degraded)
        return pb.StatsResponse(
            tiers=[
                pb.TierStats(name=t.name, entries=t.entries, bytes=t.bytes,
                             capacity_bytes=t.capacity_bytes, hits=t.hits, misses=t.misses,
                             evictions=t.evictions, corrupt=t.corrupt, healthy=t.healthy,
                             degraded=t.degraded, parts_down=down.get(t.name, []))
                for t in tiers
            ],
            counters=counters,
            version=__version__,
            tenants=await asyncio.to_thread(self._tenant_stats),
            health="degraded" if self.store.degraded or down else "serving",
        )

    def _tenant_stats(self) -> list[pb.TenantStats]:
        """Entries and bytes per tenant: the caller's own, or every tenant for an admin."""
        p = current_principal.get()
        if not self.auth.enabled:
            return []
        prefix = f"{p.tenant}:".encode() if p.tenant and not p.is_admin else b""
        keys = self.store.keys(prefix)
        sizes = self.store.lookup(keys)
        out: dict[str, pb.TenantStats] = {}
        for k, pr in zip(keys, sizes):
            tenant = split_store_key(k)[0]
            policy = self.auth.config.policies.get(tenant)
            ts = out.setdefault(tenant, pb.TenantStats(
                tenant=tenant, quota_bytes=policy.quota_bytes if policy else 0))
            ts.entries += 1
            ts.bytes += pr.size
        return list(out.values())
