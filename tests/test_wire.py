"""Hand-encoded Retrieve frames parse as the generated protobuf classes say they should."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import DecodeError

from kdn.errors import InvalidArgument
from kdn.transport.wire import (
    MIN_PIECE_BYTES,
    GetManyView,
    HeadersMessage,
    frame_message,
    frame_message_head,
    get_many_message,
    get_many_response,
    parse_frame_message,
    piece_messages,
    piece_spans,
    retrieve_headers_message,
    retrieve_response,
    store_request,
    varint,
)
from kdn.v1 import kdn_pb2 as pb


@pytest.mark.parametrize("index", [0, 1, 127, 128, 300, 65535])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 1 << 21])
def test_frame_message_matches_generated_encoding(index: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = frame_message(index, memoryview(data))
    theirs = pb.RetrieveResponse(frame=pb.Frame(index=index, data=data)).SerializeToString()
    if size:  # proto3 omits an empty bytes field; frames are never empty
        assert ours == theirs
    msg = pb.RetrieveResponse.FromString(ours)
    assert msg.WhichOneof("part") == "frame"
    assert msg.frame.index == index and msg.frame.data == data


def test_varint() -> None:
    assert varint(0) == b"\x00" and varint(1) == b"\x01" and varint(300) == b"\xac\x02"
    with pytest.raises(InvalidArgument, match="at least 0, got -1"):
        varint(-1)  # not a loop without end


def test_frame_message_is_also_a_store_request() -> None:
    data = bytes(range(200)) * 10
    msg = pb.StoreRequest.FromString(frame_message(7, data))
    assert msg.WhichOneof("part") == "frame"
    assert msg.frame.index == 7 and msg.frame.data == data


@pytest.mark.parametrize("index", [0, 1, 128, 65535, (1 << 32) - 1])
@pytest.mark.parametrize("size", [0, 1, 128, 16384, 1 << 21])
def test_frame_messages_read_back_as_the_generated_classes_read_them(index: int,
                                                                      size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    generated = pb.RetrieveResponse(frame=pb.Frame(index=index, data=data)).SerializeToString()
    for encoded in (frame_message(index, data), generated):
        ours = parse_frame_message(encoded)
        assert ours is not None and ours.WhichOneof("part") == "frame"
        assert ours.frame.index == index and ours.frame.data == data
        if size:
            assert isinstance(ours.frame.data, memoryview) and ours.frame.data.obj is encoded
        for deserialize, cls in ((retrieve_response, pb.RetrieveResponse),
                                 (store_request, pb.StoreRequest)):
            msg, theirs = deserialize(encoded), cls.FromString(encoded)
            assert msg.WhichOneof("part") == theirs.WhichOneof("part") == "frame"
            assert (msg.frame.index, msg.frame.data) == (theirs.frame.index, theirs.frame.data)


def test_other_messages_go_to_the_generated_classes() -> None:
    header = pb.RetrieveResponse(header=pb.RetrieveHeader(container_header=b"h", tier="ram",
                                                          frame_count=3)).SerializeToString()
    assert parse_frame_message(header) is None
    assert retrieve_response(header) == pb.RetrieveResponse.FromString(header)
    store_header = pb.StoreRequest(header=pb.StoreHeader(key=b"k" * 32)).SerializeToString()
    assert store_request(store_header) == pb.StoreRequest.FromString(store_header)
    frame = frame_message(5, b"abcdef")
    odd = [
        b"",
        frame[:-1],  # cut short
        frame + b"\x00",  # trailing bytes
        frame + frame,  # the frame field twice (the generated parser keeps the last)
        pb.Frame(index=5, data=b"abcdef").SerializeToString(),  # a Frame, not a response
        b"\x12\x0a\x12\x06abcdef\x08\x05",  # index after data
        b"\x12\x0c\x08\x85\x80\x80\x80\x10\x12\x06abcdef",  # index beyond uint32
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint longer than 64 bits
    ]
    for buf in odd:
        assert parse_frame_message(buf) is None, buf


def test_parsed_frames_agree_with_the_generated_classes_on_random_bytes() -> None:
    import random

    rng = random.Random(17)
    frame = frame_message(300, bytes(range(40)))
    for _ in range(3000):
        buf = bytearray(frame)
        for _ in range(rng.randrange(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        ours = parse_frame_message(bytes(buf))
        if ours is not None:
            theirs = pb.RetrieveResponse.FromString(bytes(buf))
            assert theirs.WhichOneof("part") == "frame"
            assert (ours.frame.index, ours.frame.data) == (theirs.frame.index, theirs.frame.data)


def test_frame_message_head_is_what_comes_before_the_data() -> None:
    for index, size in ((0, 5), (1, 300), (70000, 1 << 20)):
        data = bytes(size)
        assert frame_message(index, data) == frame_message_head(index, size) + data
        assert frame_message(index, data, 7 << 20) == frame_message_head(index, size,
                                                                         7 << 20) + data


@pytest.mark.parametrize("index", [0, 3, 70000])
@pytest.mark.parametrize("offset", [0, 1, 300, (1 << 33) + 5, (1 << 64) - 1])
def test_pieces_read_back_as_the_generated_classes_read_them(index: int, offset: int) -> None:
    """A piece's offset (written before its data) reads back through both parsers, and the
    generated encoding (offset after the data) goes to the generated class with the same
    fields."""
    data = bytes(range(256)) * 5
    ours = frame_message(index, data, offset)
    generated = pb.StoreRequest(frame=pb.Frame(index=index, data=data, offset=offset)
                                ).SerializeToString()
    for encoded in (ours, generated):
        theirs = pb.RetrieveResponse.FromString(encoded).frame
        assert (theirs.index, theirs.offset, theirs.data) == (index, offset, data)
        for deserialize in (retrieve_response, store_request):
            msg = deserialize(encoded)
            assert (msg.frame.index, msg.frame.offset, bytes(msg.frame.data)) == (
                index, offset, data)
    parsed = parse_frame_message(ours)
    assert parsed is not None and parsed.frame.offset == offset
    assert isinstance(parsed.frame.data, memoryview) and parsed.frame.data.obj is ours
    assert parse_frame_message(generated) is None or offset == 0


def test_piece_spans_cover_a_frame_in_pieces_of_the_size_asked() -> None:
    for size, ask in ((10, 0), (5 << 20, 0), (5 << 20, 1 << 20), ((6 << 20) + 3, 1 << 20),
                      (1 << 20, 1 << 20), ((1 << 20) + 1, 1 << 20), (300_000, 1000)):
        spans = piece_spans(size, ask)
        assert spans[0][0] == 0 and sum(n for _, n in spans) == size
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        step = max(ask, MIN_PIECE_BYTES)
        if ask == 0 or size <= step:
            assert spans == [(0, size)]
        else:
            assert len(spans) == -(-size // step)
            assert all(n == step for _, n in spans[:-1]) and 0 < spans[-1][1] <= step
    frame = bytes(range(256)) * 9000
    msgs = piece_messages(4, frame, 1 << 16)
    got = [parse_frame_message(m) for m in msgs]
    assert len(msgs) == len(piece_spans(len(frame), 1 << 16)) > 1
    assert b"".join(bytes(g.frame.data) for g in got if g) == frame
    assert all(g is not None and g.frame.index == 4 for g in got)


_REFS = [
    (pb.EntryRef(present=True, tier="ram", length=5, written=True), b"hello"),
    (pb.EntryRef(), b""),  # a miss
    (pb.EntryRef(present=True, tier="disk", length=1 << 20), b""),  # no room: asked again
    (pb.EntryRef(present=True, tier="redis", length=300, written=True, verified=True,
                 offset=64), bytes(range(256)) + bytes(44)),
    (pb.EntryRef(present=True, tier="ram", length=64, written=True, lease=7), b""),  # gen 0
    (pb.EntryRef(present=True, tier="ram", length=64, written=True, offset=128, lease=8,
                 generation=3, generation_at=4096), b""),
]


def _generated(refs: list[tuple[pb.EntryRef, bytes]]) -> pb.GetManyResponse:
    out = pb.GetManyResponse()
    for ref, data in refs:
        r = out.entries.add()
        r.CopyFrom(ref)
        r.data = data
    return out


def _fields_of(ref: object) -> tuple[object, ...]:
    return tuple(bytes(getattr(ref, f)) if f == "data" else getattr(ref, f)
                 for f in ("present", "tier", "length", "written", "offset", "verified", "data",
                           "lease", "generation", "generation_at"))


def test_get_many_answers_match_the_generated_encoding_and_read_back_as_views() -> None:
    ours = get_many_message([(r, memoryview(d)) for r, d in _REFS])
    assert pb.GetManyResponse.FromString(ours) == _generated(_REFS)  # data last: same fields
    assert get_many_message([]) == b""
    view = get_many_response(ours)
    assert isinstance(view, GetManyView) and len(view.entries) == len(_REFS)
    theirs = pb.GetManyResponse.FromString(ours)
    for got, want in zip(view.entries, theirs.entries):
        assert _fields_of(got) == _fields_of(want)
    assert isinstance(view.entries[3].data, memoryview)  # no copy of the entry's bytes
    assert view.entries[3].data.obj is ours
    # a lease's generation read as the generated class reads it, 0 where it is left off
    assert [(e.lease, e.generation, e.generation_at) for e in view.entries[4:]] == [
        (7, 0, 0), (8, 3, 4096)]


def test_get_many_answers_of_another_form_go_to_the_generated_class() -> None:
    twice = bytes([0x0A, 0x06, 0x32, 0x01, 0x61, 0x32, 0x01, 0x62])  # data twice: the last
    unknown = bytes([0x0A, 0x02, 0x58, 0x01])  # EntryRef field 11 (not one of ours)
    for buf in (twice, b"", unknown, bytes([0x12, 0x00])):
        got = get_many_response(buf)
        assert not isinstance(got, GetManyView)
        assert got == pb.GetManyResponse.FromString(buf)
    for bad in (bytes([0x0A, 0x05, 0x08]), bytes([0x0A]), bytes([0x0B])):  # cut off, a group
        with pytest.raises(DecodeError):
            get_many_response(bad)


def _agree_on_damaged_copies(seed: int, buf0: bytes, theirs: Callable[[bytes], Any],
                             ours: Callable[[bytes], Any]) -> None:
    """3000 copies of ``buf0`` with 1-3 random bytes changed: where the generated class
    (``theirs``) refuses one, ``ours`` refuses it too; else both read the same (``ours``
    returns what the assertion compares). Most must be readable."""
    import random

    rng = random.Random(seed)
    agreed = 0
    for _ in range(3000):
        buf = bytearray(buf0)
        for _ in range(rng.randrange(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            want = theirs(bytes(buf))
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: ours must refuse it too
            with pytest.raises(Exception):  # noqa: B017
                ours(bytes(buf))
            continue
        assert ours(bytes(buf)) == want
        agreed += 1
    assert agreed > 100


def test_get_many_views_agree_with_the_generated_class_on_random_bytes() -> None:
    _agree_on_damaged_copies(
        23, get_many_message([(r, memoryview(d)) for r, d in _REFS]),
        lambda b: [_fields_of(e) for e in pb.GetManyResponse.FromString(b).entries],
        lambda b: [_fields_of(e) for e in get_many_response(b).entries])


_HEADS = [
    (pb.RetrieveHeader(total_bytes=300, tier="ram", frame_count=2), [b"h" * 100, b"f" * 200]),
    (pb.RetrieveHeader(missing=True), []),
    (pb.RetrieveHeader(container_header=b"c" * 150, total_bytes=1 << 20, tier="disk",
                       frame_count=3, entry_digest=(1 << 64) - 5), []),  # its frames follow
    (pb.RetrieveHeader(total_bytes=20000, tier="redis", frame_count=1),
     [memoryview(bytes(range(256)) * 78 + bytes(32))]),
]


def _head_fields(head: pb.RetrieveHeader, entry: bytes | memoryview) -> tuple[object, ...]:
    return (head.container_header, head.total_bytes, head.tier, head.frame_count,
            head.entry_digest, head.missing, bytes(entry))


def test_grouped_headers_match_the_generated_encoding_and_read_back_as_views() -> None:
    ours = retrieve_headers_message(_HEADS)
    want = pb.RetrieveResponse(headers=pb.RetrieveHeaders(headers=[
        pb.RetrieveHeader(**{f.name: v for f, v in h.ListFields()},
                          entry=b"".join(bytes(p) for p in pieces)) for h, pieces in _HEADS]))
    assert ours == want.SerializeToString()  # entry last: the generated order
    got = retrieve_response(ours)
    assert isinstance(got, HeadersMessage) and got.WhichOneof("part") == "headers"
    assert [_head_fields(v.head, v.entry) for v in got.headers] == \
        [_head_fields(h, h.entry) for h in want.headers.headers]
    assert not got.headers[3].head.entry  # the entry is the view, not a copy in the header
    assert isinstance(got.headers[3].entry, memoryview) and got.headers[3].entry.obj is ours


def test_grouped_headers_of_another_form_go_to_the_generated_class() -> None:
    one = pb.RetrieveHeader(total_bytes=3, frame_count=1).SerializeToString()
    twice = one + bytes([0x3A, 0x01, 0x61, 0x3A, 0x02, 0x62, 0x63])  # entry twice: the last
    unknown = one + bytes([0x58, 0x01])  # RetrieveHeader field 11 (not one of ours)
    for head in (twice, unknown):
        inner = bytes([0x0A, len(head)]) + head
        buf = bytes([0x1A, len(inner)]) + inner
        got = retrieve_response(buf)
        theirs = pb.RetrieveResponse.FromString(buf)
        assert isinstance(got, HeadersMessage)
        assert [_head_fields(v.head, v.entry) for v in got.headers] == \
            [_head_fields(h, h.entry) for h in theirs.headers.headers]
    header_then_headers = pb.RetrieveResponse(header=pb.RetrieveHeader(tier="ram")) \
        .SerializeToString()
    buf = retrieve_headers_message(_HEADS[:1]) + header_then_headers  # the last part wins
    got = retrieve_response(buf)
    assert not isinstance(got, HeadersMessage) and got.WhichOneof("part") == "header"
    for bad in (bytes([0x1A, 0x05, 0x0A]), bytes([0x1A]), bytes([0x1A, 0x02, 0x0B, 0x00])):
        with pytest.raises(DecodeError):
            retrieve_response(bad)


def _normal(msg: object) -> object:
    part = msg.WhichOneof("part")  # type: ignore[attr-defined]
    if part == "headers":
        views = msg.headers  # type: ignore[attr-defined]
        if isinstance(views, list):
            return [_head_fields(v.head, v.entry) for v in views]
        return [_head_fields(h, h.entry) for h in views.headers]
    if part == "frame":
        f = msg.frame  # type: ignore[attr-defined]
        return ("frame", f.index, f.offset, bytes(f.data))
    return (part, msg.SerializeToString() if part else b"")  # type: ignore[attr-defined]


def test_grouped_headers_agree_with_the_generated_class_on_random_bytes() -> None:
    _agree_on_damaged_copies(29, retrieve_headers_message(_HEADS),
                             lambda b: _normal(pb.RetrieveResponse.FromString(b)),
                             lambda b: _normal(retrieve_response(b)))
