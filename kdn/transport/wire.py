"""Hand-encoded frame messages: one copy of the frame bytes instead of three.

Building ``RetrieveResponse(frame=Frame(index=i, data=bytes(view)))`` copies a frame three
times (slice to bytes, into the message, serialization). Frames dominate the bytes of Store and
Retrieve, so both sides write their protobuf encoding directly. ``StoreRequest`` and
``RetrieveResponse`` both carry ``Frame frame = 2`` in their oneof, so one encoding serves both:
field 2 holding Frame{1: index (varint), 3: offset (varint, a piece of a frame), 2: data
(bytes)}. The server's Retrieve and the
client's Store use ``serialize_passthrough``, which sends such bytes as they are.

The receiving sides read them back without the generated classes too: ``parse_frame_message``
turns a message of exactly that form into a ``FrameMessage`` whose ``frame.data`` is a view of
the received bytes (the generated parser copies the frame in, and every read of ``data`` copies
it out again). ``retrieve_response`` and ``store_request`` are the deserializers of the client's
Retrieve and the server's Store: a frame message that way, anything else (headers, or frames
encoded by another protobuf library in another valid form) by the generated class.
``tests/test_wire.py`` checks that the generated classes agree with both directions.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kdn.errors import InvalidArgument
from kdn.names import MAX_CALL_KEYS
from kdn.v1 import kdn_pb2 as pb

_LEN = 2  # protobuf wire type for length-delimited fields
_FRAME_FIELD_TAG = bytes([(2 << 3) | _LEN])  # StoreRequest.frame = RetrieveResponse.frame = 2
_FRAME_INDEX_TAG = bytes([(1 << 3) | 0])  # Frame.index = 1, varint
_FRAME_DATA_TAG = bytes([(2 << 3) | _LEN])  # Frame.data = 2
_FRAME_OFFSET_TAG = bytes([(3 << 3) | 0])  # Frame.offset = 3, varint (written before data)
_UINT64_MAX = (1 << 64) - 1
_UINT32_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class Frame:
    """The fields of a ``Frame`` message; ``data`` may be a view of the received message."""

    index: int
    data: bytes | memoryview
    offset: int = 0


@dataclass(frozen=True, slots=True)
class FrameMessage:
    """A ``RetrieveResponse`` or ``StoreRequest`` carrying a frame, read as those messages are
    read (``msg.WhichOneof("part")``, ``msg.frame.index``, ``msg.frame.data``)."""

    frame: Frame
    message: bytes | None = None
    """The serialized message itself (``parse_frame_message``): a Retrieve answer of the
    same frame can send it again as it is."""

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - the generated classes' name
        return "frame"


def varint(n: int) -> bytes:
    if n < 0:  # shifting a negative number right never reaches 0
        raise InvalidArgument(f"a varint holds a count of at least 0, got {n}")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_head(tag: bytes, size: int) -> bytes:
    """A length-delimited field's tag and length, before its ``size`` bytes."""
    return tag + varint(size)


def frame_message_head(index: int, size: int, offset: int = 0) -> bytes:
    """The bytes of ``frame_message(index, data, offset)`` before ``data`` (``size`` bytes
    long)."""
    inner_head = (_FRAME_INDEX_TAG + varint(index) if index else b"") + (
        _FRAME_OFFSET_TAG + varint(offset) if offset else b"") + _field_head(
        _FRAME_DATA_TAG, size)
    return _field_head(_FRAME_FIELD_TAG, len(inner_head) + size) + inner_head


def frame_message(index: int, data: bytes | memoryview, offset: int = 0) -> bytes:
    """Serialized ``RetrieveResponse(frame=Frame(index=index, data=data, offset=offset))``,
    which is also the serialized ``StoreRequest`` of that frame (``offset`` before ``data``:
    any field order is valid protobuf, and the data last is what ``parse_frame_message``
    reads without a copy)."""
    return b"".join((frame_message_head(index, len(data), offset), data))


MIN_PIECE_BYTES = 64 << 10
"""The smallest piece a frame is cut into (``RetrieveRequest.piece_bytes`` below it is raised
to it): a piece always holds a frame's whole prefix, and a message costs about a millisecond
per hundred at this size."""


def piece_spans(size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces a ``size``-byte frame travels in when pieces of
    ``piece_bytes`` are asked for (0: the whole frame, one piece): each of
    ``max(piece_bytes, MIN_PIECE_BYTES)`` bytes but the last, which holds the rest."""
    step = max(piece_bytes, MIN_PIECE_BYTES)
    if piece_bytes <= 0 or size <= step:
        return [(0, size)]
    return [(at, min(step, size - at)) for at in range(0, size, step)]


def piece_fault(piece: Frame, current: int | None, received: int, last: int) -> str | None:
    """Why ``piece`` (a ``Frame`` at a nonzero offset) can not continue the frame being
    received: frame ``current`` (None: none begun yet), ``received`` bytes of it so far, its
    latest piece ``last`` bytes long (every piece of a frame but its last holds at least
    ``MIN_PIECE_BYTES``, which bounds the pieces a receiver holds); None when it can."""
    if current is None or (piece.index, piece.offset) != (current, received):
        want = "none was begun" if current is None else \
            f"expected frame {current} at offset {received}"
        return (f"a piece of frame {piece.index} at offset {piece.offset} arrived that does "
                f"not continue the frame received before it ({want})")
    if last < MIN_PIECE_BYTES:
        return (f"frame {current}: a piece of {last} bytes before its last; pieces of a frame "
                f"but its last hold at least {MIN_PIECE_BYTES}")
    return None


def piece_messages(index: int, frame: bytes | memoryview, piece_bytes: int) -> list[bytes]:
    """The serialized messages frame ``index`` travels in (``piece_spans``)."""
    mv = memoryview(frame)
    return [frame_message(index, mv[at:at + n], at)
            for at, n in piece_spans(len(mv), piece_bytes)]


def _varint_at(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``; (-1, pos) when it is cut off or
    longer than a uint64."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def parse_frame_message(buf: bytes) -> FrameMessage | None:
    """The frame of a serialized ``RetrieveResponse``/``StoreRequest`` holding only a frame
    (optional index, optional offset, then data: the form ``frame_message`` writes), its
    data a zero-copy view of ``buf``; None for any other message."""
    mv = memoryview(buf)
    if not mv or mv[0] != _FRAME_FIELD_TAG[0]:
        return None
    inner, pos = _varint_at(mv, 1)
    if inner < 0 or pos + inner != len(mv):
        return None
    index = offset = 0
    if pos < len(mv) and mv[pos] == _FRAME_INDEX_TAG[0]:
        index, pos = _varint_at(mv, pos + 1)
        if not 0 <= index <= _UINT32_MAX:
            return None
    if pos < len(mv) and mv[pos] == _FRAME_OFFSET_TAG[0]:
        offset, pos = _varint_at(mv, pos + 1)
        if not 0 <= offset <= _UINT64_MAX:
            return None
    if pos == len(mv):  # proto3 leaves out empty data
        return FrameMessage(Frame(index, b"", offset))
    if mv[pos] != _FRAME_DATA_TAG[0]:
        return None
    size, pos = _varint_at(mv, pos + 1)
    if size < 0 or pos + size != len(mv):
        return None
    return FrameMessage(Frame(index, mv[pos:], offset), buf if type(buf) is bytes else None)


def retrieve_response(buf: bytes) -> FrameMessage | HeadersMessage | pb.RetrieveResponse:
    """Deserializer of Retrieve and RetrieveMany answers: frames without a copy, a grouped
    RetrieveMany's headers with their entries as views (``retrieve_headers``), any other
    header by the generated class."""
    msg = parse_frame_message(buf)
    if msg is not None:
        return msg
    if buf[:1] == _HEADERS_TAG:
        return retrieve_headers(buf)
    return pb.RetrieveResponse.FromString(buf)


def store_request(buf: bytes) -> FrameMessage | pb.StoreRequest:
    """Deserializer of Store requests: frames without a copy, headers by the generated class."""
    msg = parse_frame_message(buf)
    return pb.StoreRequest.FromString(buf) if msg is None else msg


# -- inline GetMany answers: entry bytes joined in once, read back as views --------------------

_ENTRIES_TAG = bytes([(1 << 3) | _LEN])  # GetManyResponse.entries = 1
_REF_DATA_FIELD = 6  # EntryRef.data
_REF_DATA_TAG = bytes([(_REF_DATA_FIELD << 3) | _LEN])


def get_many_message(refs: list[tuple[pb.EntryRef, bytes | memoryview
                                      | list[bytes | memoryview]]]) -> bytes:
    """Serialized ``GetManyResponse`` of ``refs``, each ref's ``data`` joined in from its pair
    (one buffer, or the pieces of one: one copy of the entries) instead of set on the message
    (a copy into it, and another to serialize it). The refs themselves carry no data."""
    parts: list[bytes | memoryview] = []
    for ref, data in refs:
        parts += _with_bytes(_ENTRIES_TAG, ref, _REF_DATA_TAG,
                             data if isinstance(data, list) else [data])
    return b"".join(parts)


def _with_bytes(tag: bytes, msg: Any, data_tag: bytes, pieces: list[bytes | memoryview]
                ) -> list[bytes | memoryview]:
    """The parts of field ``tag`` holding ``msg`` with the bytes of ``pieces`` as its field
    ``data_tag`` (written last, as the generated classes write it; left out when empty, as
    proto3 does), for one join."""
    head = msg.SerializeToString()
    size = sum(len(p) for p in pieces)
    if size:
        head += _field_head(data_tag, size)
    return [_field_head(tag, len(head) + size), head, *pieces]


@dataclass(frozen=True, slots=True)
class EntryView:
    """The fields of an ``EntryRef`` read from a GetMany answer; ``data`` a view of it."""

    present: bool
    tier: str
    length: int
    written: bool
    offset: int
    verified: bool
    data: bytes | memoryview
    lease: int = 0
    generation: int = 0
    generation_at: int = 0


@dataclass(frozen=True, slots=True)
class GetManyView:
    entries: list[EntryView]


def _fields(mv: memoryview) -> list[tuple[int, int, int, int, int]] | None:
    """(field number, wire type, field start, payload start, end) of each field of the
    message in ``mv``, or None when it is not well formed."""
    out, pos = [], 0
    while pos < len(mv):
        start = pos
        key, pos = _varint_at(mv, pos)
        if key < 0:
            return None
        number, kind = key >> 3, key & 7
        body = pos
        if kind == 0:
            value, pos = _varint_at(mv, pos)
            if value < 0:
                return None
        elif kind == _LEN:
            size, body = _varint_at(mv, pos)
            if size < 0 or body + size > len(mv):
                return None
            pos = body + size
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
            if pos > len(mv):
                return None
        else:
            return None
        out.append((number, kind, start, body, pos))
    return out


def get_many_response(buf: bytes) -> GetManyView | pb.GetManyResponse:
    """Deserializer of GetMany answers: each entry's data a view of ``buf`` (the generated
    parser copies it in, and reading ``data`` copies it out again); an answer of another form
    (unknown fields, a repeated data field, anything malformed) goes to the generated class,
    which reads it or raises."""
    items = _bytes_lifted(memoryview(buf), 1, _REF_DATA_FIELD, 10)
    if items is None:
        return pb.GetManyResponse.FromString(buf)
    entries: list[EntryView] = []
    for rest, data in items:
        ref = pb.EntryRef.FromString(rest)
        entries.append(EntryView(ref.present, ref.tier, ref.length, ref.written, ref.offset,
                                 ref.verified, data, ref.lease, ref.generation,
                                 ref.generation_at))
    return GetManyView(entries)


def _bytes_lifted(mv: memoryview, field: int, data_field: int, last: int
                  ) -> list[tuple[bytes, memoryview | bytes]] | None:
    """Each message of the repeated field ``field`` that is all ``mv`` holds, as (its other
    fields, serialized; a view of its bytes field ``data_field``). None where the generated
    class must read it instead: no such message, another field, a field past ``last`` (not
    one of ours), ``data_field`` given twice or not as bytes, anything malformed."""
    out: list[tuple[bytes, memoryview | bytes]] = []
    for number, kind, _, body, end in _fields(mv) or [(0, 0, 0, 0, 0)]:
        inner = _fields(mv[body:end]) if number == field and kind == _LEN else None
        if inner is None:
            return None
        rest: list[memoryview] = []
        data: bytes | memoryview = b""
        for n, k, start, at, stop in inner:
            if not 1 <= n <= last or n == data_field and (k != _LEN or len(data)):
                return None
            if n == data_field:
                data = mv[body + at : body + stop]
            else:
                rest.append(mv[body + start : body + stop])
        out.append((b"".join(rest), data))
    return out


# -- grouped RetrieveMany answers: the headers of a run of keys, small entries joined in --------

GROUP_INLINE_BYTES = 2 << 20
"""Entry bytes one message of a grouped RetrieveMany carries whole at most (a client may ask
for fewer; ``RetrieveManyRequest.inline_budget_bytes``): a few messages of about the size
Python gRPC streams best, not one large answer."""

_HEADERS_TAG = bytes([(3 << 3) | _LEN])  # RetrieveResponse.headers = 3
_HEADER_TAG = bytes([(1 << 3) | _LEN])  # RetrieveHeaders.headers = 1
_HEADER_ENTRY_FIELD = 7  # RetrieveHeader.entry
_HEADER_ENTRY_TAG = bytes([(_HEADER_ENTRY_FIELD << 3) | _LEN])


def retrieve_headers_message(heads: list[tuple[pb.RetrieveHeader, list[bytes | memoryview]]]
                             ) -> bytes:
    """Serialized ``RetrieveResponse(headers=...)`` of ``heads``: each header with the pieces
    of its whole entry (header, then frames) joined in as its ``entry`` (none: no pieces).
    One copy of the entries, as ``get_many_message``."""
    parts: list[bytes | memoryview] = []
    for head, pieces in heads:
        parts += _with_bytes(_HEADER_TAG, head, _HEADER_ENTRY_TAG, pieces)
    inner = sum(len(p) for p in parts)
    return b"".join([_field_head(_HEADERS_TAG, inner), *parts])


@dataclass(frozen=True, slots=True)
class HeaderView:
    """One header of a grouped RetrieveMany answer: its fields but ``entry`` (``head``), and
    the entry it carries as a view of the received message (empty: its frames follow)."""

    head: pb.RetrieveHeader
    entry: bytes | memoryview


@dataclass(frozen=True, slots=True)
class HeadersMessage:
    """A ``RetrieveResponse`` carrying ``headers``, read as the generated class is read."""

    headers: list[HeaderView]

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - the generated classes' name
        return "headers"


def retrieve_headers(buf: bytes) -> HeadersMessage | pb.RetrieveResponse:
    """A serialized ``RetrieveResponse(headers=...)`` with each header's entry a view of
    ``buf``; a message of another form (unknown fields, an entry given twice, anything
    malformed) goes to the generated class, which reads it or raises, and its entries are
    copied out."""
    mv = memoryview(buf)
    outer = _fields(mv)
    if not outer or len(outer) != 1 or outer[0][:2] != (3, _LEN):
        return _headers_of(pb.RetrieveResponse.FromString(buf))
    _, _, _, body, end = outer[0]
    items = _bytes_lifted(mv[body:end], 1, _HEADER_ENTRY_FIELD, _HEADER_ENTRY_FIELD)
    if items is None:
        return _headers_of(pb.RetrieveResponse.FromString(buf))
    return HeadersMessage([HeaderView(pb.RetrieveHeader.FromString(rest), entry)
                           for rest, entry in items])


def _headers_of(msg: pb.RetrieveResponse) -> HeadersMessage | pb.RetrieveResponse:
    """``msg``'s headers (its ``headers`` part), or ``msg`` itself when it holds another."""
    if msg.WhichOneof("part") != "headers":
        return msg
    out = []
    for head in msg.headers.headers:
        entry = head.entry
        head.ClearField("entry")
        out.append(HeaderView(head, entry))
    return HeadersMessage(out)


def serialize_passthrough(message: Any) -> bytes:
    """Serializer accepting pre-encoded bytes as well as generated messages."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[no-any-return]


# -- the same-host fast path (kdn.server.fastpath) --------------------------------------------

FAST_HEAD = struct.Struct("<IB")
"""Request: u32 body length, u8 op; response: u32 body length, u8 ok (1) / error (0)."""
FEATURES = ("tenant-scope",)
"""What a server tells in Stats (``features``) that an older one would ignore unannounced:
``tenant-scope``, the tenant field of admin requests (an older server acts on the caller's own
tenant instead: a client that names one asks first)."""
FAST_GET_MANY, FAST_PUT_MANY = 1, 2
FAST_ARENA = 3
"""Body: a segment id; answer: u64 arena size, with the arena's descriptor (SCM_RIGHTS)."""
ARENA_SIZE = struct.Struct("<Q")


READ_STEP = 1 << 20
"""Bytes ``read_exact`` asks of one ``recv`` at most: what it allocates grows with what the
peer really sent, not with the length the peer declared (a forged length of 4 GiB followed by
nothing must not reserve 4 GiB)."""


def read_exact(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``conn``, or None when it closed first."""
    first = conn.recv(min(n, READ_STEP)) if n else b""
    if len(first) == n:  # most often whole at once
        return first
    if not first:
        return None
    buf = bytearray(first)
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), READ_STEP))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


NET_GET_MANY, NET_PUT_MANY = 4, 5
"""The network data path's calls (``kdn.server.netpath``): a GetMany whose answer is followed
by the present entries' bytes, a PutMany followed by its items' bytes (``PutItem.region``:
where each lies in them, one after another)."""
NET_MAX_KEYS = MAX_CALL_KEYS
"""Keys one data path GetMany may ask for (as any call: ``kdn.names.MAX_CALL_KEYS``); a client
asking for more stripes them over calls (``kdn.client.netpath.NetPath.stripes``)."""
SEND_PIECES = 512
"""Buffers one ``sendmsg`` hands the kernel at most (IOV_MAX is 1024 on Linux)."""


def send_pieces(conn: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Send ``pieces`` in order without joining them (their bytes go from where they lie
    straight into the kernel): ``sendmsg`` of up to ``SEND_PIECES`` buffers at a time, resumed
    where a partial send stopped."""
    bufs = [memoryview(p).cast("B") for p in pieces if len(p)]
    if isinstance(conn, ssl.SSLSocket):
        for buf in bufs:  # no sendmsg on TLS: each piece through the record layer
            conn.sendall(buf)
        return
    i = 0
    while i < len(bufs):
        sent = conn.sendmsg(bufs[i : i + SEND_PIECES])
        while sent and i < len(bufs):
            if sent < len(bufs[i]):
                bufs[i] = bufs[i][sent:]
                break
            sent -= len(bufs[i])
            i += 1


def recv_into_all(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when it closed first."""
    at, n = 0, len(view)
    while at < n:
        got = conn.recv_into(view[at:], n - at)
        if not got:
            return False
        at += got
    return True

