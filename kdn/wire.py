"""Hand-encoded frame messages: one copy of the frame bytes instead of three.

Building ``RetrieveResponse(frame=Frame(index=i, data=bytes(view)))`` copies a frame three
times (slice to bytes, into the message, serialization). Frames dominate the bytes of Store and
Retrieve, so both sides write their protobuf encoding directly. ``StoreRequest`` and
``RetrieveResponse`` both carry ``Frame frame = 2`` in their oneof, so one encoding serves both:
field 2 holding Frame{1: index (varint), 2: data (bytes)}. The server's Retrieve and the
client's Store use ``serialize_passthrough``, which sends such bytes as they are.
``tests/test_wire.py`` checks that the generated classes parse them to the same messages.
"""

from __future__ import annotations

from typing import Any

_LEN = 2  # protobuf wire type for length-delimited fields
_FRAME_FIELD_TAG = bytes([(2 << 3) | _LEN])  # StoreRequest.frame = RetrieveResponse.frame = 2
_FRAME_INDEX_TAG = bytes([(1 << 3) | 0])  # Frame.index = 1, varint
_FRAME_DATA_TAG = bytes([(2 << 3) | _LEN])  # Frame.data = 2


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def frame_message(index: int, data: bytes | memoryview) -> bytes:
    """Serialized ``RetrieveResponse(frame=Frame(index=index, data=data))``, which is also the
    serialized ``StoreRequest(frame=Frame(index=index, data=data))``."""
    inner_head = (_FRAME_INDEX_TAG + varint(index) if index else b"") + _FRAME_DATA_TAG + varint(
        len(data))
    inner_len = len(inner_head) + len(data)
    return b"".join((_FRAME_FIELD_TAG, varint(inner_len), inner_head, data))


def serialize_passthrough(message: Any) -> bytes:
    """Serializer accepting pre-encoded bytes as well as generated messages."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[no-any-return]
