"""Every damage to a codec container is detected: each bit flipped, each truncation, frames
swapped or taken from another entry, a remembered header one bit away.
"""

from __future__ import annotations

import pytest

from kdn.codec import StreamDecoder, decode, encode, encode_parts, parse_header
from kdn.codec.format import header_size
from kdn.errors import Corrupt, KDNError
from tests.helpers import all_codecs, random_kv, small_kv


@pytest.mark.parametrize("mode,level", all_codecs())
@pytest.mark.parametrize("layers_per_frame", [1, 2])
def test_every_bit_flip_detected(mode: str, level: str, layers_per_frame: int) -> None:
    blob = bytearray(encode(small_kv(), mode, level, layers_per_frame=layers_per_frame))
    for bit in range(len(blob) * 8):
        blob[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(KDNError):
            decode(bytes(blob))
        blob[bit // 8] ^= 1 << (bit % 8)
    decode(bytes(blob))  # restored intact


def test_a_memoised_header_is_still_checked_byte_for_byte() -> None:
    """parse_header remembers verified headers by their exact bytes: the same bytes give an
    equal header with its own entry message (a caller that changes one, as fuzz/reseal.py does,
    changes no other), and a header one bit away from a remembered one is still refused."""
    blob = encode(small_kv(), "kdn", "default")
    first = parse_header(blob)
    again = parse_header(bytearray(blob))
    assert again == first and again.entry is not first.entry
    again.entry.tokens = 2**40
    assert parse_header(blob).tokens == first.tokens == 5  # small_kv: 5 tokens
    head = bytearray(blob[: header_size(blob)])
    for bit in range(len(head) * 8):
        head[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(KDNError):
            parse_header(bytes(head))
        head[bit // 8] ^= 1 << (bit % 8)
    assert parse_header(bytes(head)) == first


@pytest.mark.parametrize("mode,level", all_codecs())
def test_every_truncation_detected(mode: str, level: str) -> None:
    blob = encode(small_kv(), mode, level)
    for n in range(len(blob)):
        with pytest.raises(KDNError):
            decode(blob[:n])


@pytest.mark.parametrize("mode,level", [("lossless", ""), ("cachegen", ""), ("kdn", "default")])
def test_swapped_and_foreign_frames_detected(mode: str, level: str) -> None:
    kv = small_kv()
    parts = encode_parts(kv, mode, level)
    f = parts.frames
    swapped = b"".join([parts.header, f[1], f[0], f[2]])
    with pytest.raises(Corrupt):
        decode(swapped)
    dec = StreamDecoder(parts.header)
    with pytest.raises(Corrupt):
        dec.decode_frame(0, f[1])
    other = encode_parts(random_kv(kv.layout, tokens=6, seed=8), mode, level)
    with pytest.raises(Corrupt):  # same layout and layer, another entry's frame
        dec.decode_frame(1, other.frames[1])
    for i, frame in enumerate(f):  # and the genuine frames decode one by one
        ((layer, k, _v),) = dec.decode_frame(i, frame)
