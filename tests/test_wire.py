"""Hand-encoded Retrieve frames parse as the generated protobuf classes say they should."""

from __future__ import annotations

import pytest

from kdn.v1 import kdn_pb2 as pb
from kdn.wire import frame_message, varint


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
