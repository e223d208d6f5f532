"""What a read brings back: ``Fetched`` (an entry's container header and frames, not yet
decoded) and the readers of a Retrieve or RetrieveMany stream that check each frame as it lands.

A received entry up to ``KEEP_MESSAGES_BYTES`` stays in the messages it came in; a larger one
is copied, piece by piece, into one recycled buffer (``kdn.transport.buffers.RECEIVED``). Either way
every frame is hashed the moment its last byte lands, while it is in cache, and the entry comes
back ``checked``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

from kdn.codec import EncodedParts
from kdn.codec.copies import FrameCopy
from kdn.codec.format import (
    Header,
    check_frame_prefix,
    declared_length,
    parse_container,
    parse_header,
)
from kdn.errors import Corrupt, InvalidArgument, TooLarge
from kdn.layout import Expected
from kdn.transport.buffers import RECEIVED
from kdn.transport.wire import piece_fault
from kdn.v1 import kdn_pb2 as pb

LOCAL_TIER = "inproc"
"""The in-process tier's name (``kdn.client.local``), as reads and lookups report it."""

@dataclass(frozen=True)
class Fetched:
    """A retrieved entry as its container header plus frames (not decoded)."""

    parts: EncodedParts
    tier: str
    owned: bool = False
    """The frames are views of a region of this client's segment that nothing else holds: the
    decoded tensors may view them in place (``StreamDecoder(borrow=True)``)."""
    checked: bool = False
    """The server verified every checksum on these very bytes after writing them into the
    segment (``EntryRef.verified``): decoding need not hash them again."""
    header: Header | None = None
    """``parts.header`` parsed, where the reader parsed it already (``parsed()``)."""
    container: memoryview | None = None
    """The whole entry (header then frames) as one view, where the reader has one: the
    segment's region when ``owned``, else memory that is not the caller's to change (the
    in-process tier's, read-only)."""
    pinned: bool = False
    """The bytes are page-locked for CUDA (the read arena's registered mapping, the in-process
    tier's pinned buffers): a copy to a GPU reads them where they lie."""
    private: bool = False
    """The frames are read-only views of messages this client received and nothing else
    holds (``received``): decoded CPU tensors may view them in place too
    (``StreamDecoder(private=True)``), and writes through those change nothing anyone else
    sees."""
    memo: dict[str, Any] | None = None
    """What readers derived from these bytes, kept by their holder as long as the bytes (the
    in-process tier's ``LocalHit.memo``), where the bytes never change: None elsewhere."""

    def parsed(self) -> Header:
        """``parts.header`` parsed (verified): the reader's parse where there is one."""
        return self.header if self.header is not None else parse_header(self.parts.header)




G = TypeVar("G")


def as_expected(want: Expected, got: G) -> G:
    """``got`` where it is no entry (None, a TooBig) or an entry of what ``want`` asks for;
    LayoutMismatch otherwise. The server checks what a read expects (``expect_*`` of the
    request), and the client checks again every entry a server answered before it is used:
    a server that does not (an older one that knows no ``expect_tokens``, or one at odds
    with this client) must not hand an engine another shape's KV."""
    if isinstance(got, Fetched) and (want.fingerprint or want.tokens):
        header = got.parsed()
        want.check(header.layout, header.entry.tokens)
    return got


def header_of(stream: Iterator[Any]) -> pb.RetrieveHeader:
    """The header a Retrieve (or Blend) stream begins with; Corrupt where the stream ends
    before it, or begins with anything else (a bare StopIteration would end the caller's
    generator, or leave a future made of the call unanswered)."""
    msg = next(stream, None)
    part = None if msg is None else msg.WhichOneof("part")
    if part != "header":
        raise Corrupt(f"the stream brought {'nothing' if msg is None else 'a ' + str(part)} "
                      "where its header was due")
    return msg.header  # type: ignore[union-attr]


FRAME_ALIGN = 64
"""A received entry's first frame starts at a multiple of this (``kdn.codec.inplace``)."""


def fetched(buf: bytes | memoryview, tier: str, owned: bool = False,
             checked: bool = False, pinned: bool = False, whole: bool = False) -> Fetched:
    """Header and frame views of one container (checked when decoded); ``whole``: the
    container as one view although not the caller's (an inline answer's bytes), so that
    decoding copies it once, checked, into a buffer its tensors view."""
    c = parse_container(buf, verify=False)
    return Fetched(EncodedParts(c.header.raw, list(c.frames)), tier,  # type: ignore[arg-type]
                   owned, checked, c.header, memoryview(buf) if owned or whole else None,
                   pinned)


MAX_ENTRY_BYTES = 1 << 36
"""The largest entry a client takes from a server, on any path (a Retrieve's ``total_bytes``,
a GetMany answer's lengths; 64 GiB, past any server's ``max_entry_bytes``, 8 GiB by default):
a declared size beyond is Corrupt before anything is set aside for it."""
KEEP_MESSAGES_BYTES = 64 << 20
"""A received entry up to this size stays in the messages it came in (``received``); a larger
one is copied into one buffer (``kdn.transport.buffers.RECEIVED``, recycled up to its
``keep_bytes``) as they arrive, in pieces (``PIECE_BYTES``). Kept, an entry costs one hash of its
bytes where they landed; copied, a copy too, but its memory is never fresh: the allocator keeps
freed memory up to ``kdn.transport.buffers.TRIM_THRESHOLD``, and past that every message of a kept
entry faults in new pages: small entries are cheapest kept, large ones copied. An entry larger
than ``RECEIVED.keep_bytes`` lands in fresh memory either way: copied, its pieces are the
messages it travels in."""


def keeps_messages(total: int) -> bool:
    """Whether the frames of a ``total``-byte entry arriving one message each are best left
    in their messages (a ``LayerStream``'s decoder then views them): up to
    ``KEEP_MESSAGES_BYTES``, and past what the recycled buffers keep (fresh memory either
    way). ``received`` copies every entry above ``KEEP_MESSAGES_BYTES``: asked for in pieces,
    they come in messages too small to keep."""
    return total <= KEEP_MESSAGES_BYTES or total > RECEIVED.keep_bytes


PIECE_BYTES = 1 << 20
"""Pieces a copied entry's frames are asked in (``RetrieveRequest.piece_bytes``): the message
size Python gRPC moves fastest, and small enough that a piece is copied and hashed while it
is still in cache."""


def ask_pieces(req: pb.RetrieveRequest) -> pb.RetrieveRequest:
    """``req`` asking for the frames of an entry that ``received`` copies in pieces
    (``PIECE_BYTES``); an entry it keeps comes one message per frame."""
    req.piece_bytes, req.piece_min_entry_bytes = PIECE_BYTES, KEEP_MESSAGES_BYTES + 1
    return req


def layer_window(first_layer: int, last_layer: int) -> tuple[int, int]:
    """The layers ``[first_layer, last_layer)`` a retrieve asks for (``last_layer`` 0: through
    the last); InvalidArgument naming the argument that is not a whole number >= 0, or for a
    window with no layer in it."""
    for name, value in (("first_layer", first_layer), ("last_layer", last_layer)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
            raise InvalidArgument(f"{name} must be a whole number >= 0, got {value!r}")
    if last_layer and first_layer >= last_layer:
        raise InvalidArgument(f"first_layer ({first_layer}) must be below last_layer "
                              f"({last_layer}; 0: through the last layer)")
    return first_layer, last_layer


def in_window(request: Any, layers: int) -> tuple[int, int]:
    """The layers ``[first, end)`` of an entry's ``layers`` that ``request`` asks for (its
    ``first_layer``, ``last_layer``; a request without them: every layer). InvalidArgument
    where the window holds none of them (a stream of no layers, whose every wait would
    fail)."""
    first_layer = int(getattr(request, "first_layer", 0))
    last_layer = int(getattr(request, "last_layer", 0))
    if first_layer >= layers:
        raise InvalidArgument(f"first_layer {first_layer} is past the entry's {layers} layers "
                              f"(0 to {layers - 1})")
    return first_layer, min(last_layer or layers, layers)


def received(head: pb.RetrieveHeader, frames: Iterator[Any]) -> Fetched:
    """A Retrieve stream's entry, each frame checked as it lands: kept in its messages up to
    ``KEEP_MESSAGES_BYTES`` (the frames are views of them, hashed where they lie,
    ``private``), else copied into one recycled buffer and hashed chunk by chunk as it is
    copied (``owned``): each message copied and hashed as it lands, while in cache, then
    dropped. A frame may come in pieces (``Frame.offset``, ``ask_pieces``): copied piece by
    piece (kept, its pieces are joined). A frame is checked the moment its last byte lands
    (its prefix says how long it is), on this thread, while the message is in cache: a 12 MB
    read spent ~0.7 ms more handing 1.2 MB frames to other threads than hashing them here,
    and hashing each frame only once the next one arrived hashed memory the next message had
    pushed out of cache. The entry comes back ``checked``. Raises Corrupt when a frame is
    damaged or out of its place, a piece does not continue its frame, or the frames do not
    add up to the header's frames and ``total_bytes``."""
    header = bytes(head.container_header)
    total = int(head.total_bytes)
    if total < len(header):
        raise Corrupt(f"entry of {total} bytes can not hold its {len(header)}-byte header")
    if total > MAX_ENTRY_BYTES:  # nothing is set aside for a size no entry has
        raise Corrupt(f"the server declared an entry of {total} bytes; kdn stores none of "
                      f"more than {MAX_ENTRY_BYTES}")
    parsed = parse_header(header)
    keep = total <= KEEP_MESSAGES_BYTES
    kept: list[bytes | memoryview] = []
    buf = memoryview(b"")
    if not keep:
        try:
            room = RECEIVED.take(total + FRAME_ALIGN)
        except MemoryError:
            raise TooLarge(f"no memory for an entry of {total} bytes") from None
        start = -(room.ctypes.data + len(header)) % FRAME_ALIGN  # frames aligned: raw bodies
        buf = memoryview(room)[start : start + total]  # type: ignore[arg-type]  # viewed in
        buf[: len(header)] = header  # place
    at = len(header)
    index, sent_as, begun, last = -1, 0, at, -1  # the frame being received: its index, the
    # message's index for it, where it begins, the length of its latest piece (-1: none yet)
    size, done = -1, False  # its length as its prefix declares it (-1: unreadable), finished
    pieces: list[bytes | memoryview] = []  # kept: its pieces so far
    copy: FrameCopy | None = None  # copied: its copy so far

    def finish() -> None:  # frame ``index`` has all its pieces
        if copy is not None:
            copy.check()
            return
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        kept.append(data)
        check_frame_prefix(parsed, index, data)

    for msg in frames:  # waiting for the next message, the GIL is free
        if msg.WhichOneof("part") != "frame":
            raise Corrupt(f"a {msg.WhichOneof('part')} arrived where frame {index + 1} of the "
                          "entry was due")
        data, offset = msg.frame.data, msg.frame.offset
        if at + len(data) > total:
            raise Corrupt(f"frames exceed the entry's {total} bytes")
        if offset:
            fault = piece_fault(msg.frame, sent_as if last >= 0 else None, at - begun, last)
            if fault:
                raise Corrupt(fault)
        else:
            if last >= 0 and not done:
                finish()
            index, sent_as, begun, pieces = index + 1, msg.frame.index, at, []
            size, done = declared_length(data), False
            copy = None if keep else FrameCopy(parsed, index, buf[at:])
        if size >= 0 and at - begun + len(data) > size:
            raise Corrupt(f"frame {index}: more than the {size} bytes its prefix declares")
        if copy is not None:  # copied and hashed now, while the message is in cache
            copy.add(data)
        else:
            pieces.append(data)
        last = len(data)
        at += len(data)
        if at - begun == size:  # whole: checked now, while its last bytes are in cache
            finish()
            done = True
    if last >= 0 and not done:
        finish()
    if at != total:
        raise Corrupt(f"stream ended after {at} of the entry's {total} bytes")
    if not keep:
        return fetched(buf, head.tier, owned=True, checked=True)
    if len(kept) != len(parsed.entry.frames):
        raise Corrupt(f"stream brought {len(kept)} of the entry's {len(parsed.entry.frames)} "
                      f"frames")
    return Fetched(EncodedParts(header, kept), head.tier,  # type: ignore[arg-type]
                   checked=True, header=parsed, private=True)


def received_many(count: int, stream: Iterator[Any]) -> list[Fetched | None]:
    """A RetrieveMany stream's ``count`` entries, in order (None for a key with no entry):
    each header, then its ``frame_count`` frames read by ``received``; in the grouped form
    (``RetrieveHeaders``) a run's headers at once, an entry that came whole in its header as
    ``fetch_many`` takes an inline one (checked when decoded), the run's others read from
    the messages that follow. Raises Corrupt when the stream holds anything else: a frame
    where a header is due, an entry at odds with its header, fewer or more answers."""
    out: list[Fetched | None] = []
    while len(out) < count:
        msg = next(stream, None)
        part = None if msg is None else msg.WhichOneof("part")
        if part == "headers":
            views = msg.headers  # type: ignore[union-attr]
            if not views or len(out) + len(views) > count:
                raise Corrupt(f"RetrieveMany: a run of {len(views)} headers after {len(out)} "
                              f"of the {count} entries asked for")
            for view in views:
                out.append(_answer(view.head, view.entry, stream))
            continue
        if part != "header":
            got = "nothing" if msg is None else f"a {part}"
            raise Corrupt(f"RetrieveMany: {got} arrived where the header of entry {len(out)} "
                          f"of {count} was due")
        out.append(_answer(msg.header, b"", stream))  # type: ignore[union-attr]
    if next(stream, None) is not None:
        raise Corrupt(f"RetrieveMany: more than the {count} entries asked for")
    return out


def _answer(head: pb.RetrieveHeader, entry: bytes | memoryview, stream: Iterator[Any]
            ) -> Fetched | None:
    """One RetrieveMany answer: None (missing), the entry its header carries, or the one its
    ``frame_count`` next messages bring."""
    if head.missing:
        if len(entry) or head.total_bytes:
            raise Corrupt("RetrieveMany: a missing entry with bytes")
        return None
    if not len(entry):
        return received(head, islice(stream, head.frame_count))
    if len(entry) != head.total_bytes:
        raise Corrupt(f"RetrieveMany: an entry of {len(entry)} bytes under a header of "
                      f"{head.total_bytes}")
    got = fetched(entry, head.tier, whole=True)  # its header parsed (checked) here
    if len(got.parts.frames) != head.frame_count:
        raise Corrupt(f"RetrieveMany: an entry of {len(got.parts.frames)} frames under a "
                      f"header of {head.frame_count}")
    return got
