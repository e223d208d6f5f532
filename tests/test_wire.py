"""Hand-encoded Retrieve frames parse as the generated protobuf classes say they should."""

from __future__ import annotations

import pytest

from kdn.v1 import kdn_pb2 as pb
from kdn.wire import (
    frame_message,
    parse_frame_message,
    retrieve_response,
    store_request,
    varint,
)


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
