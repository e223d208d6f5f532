"""The codec's container: frame sizing, frames bound to their entry (version 2, and
version 1 read and resealed), header limits, and the frame record walk and its memo.
"""

from __future__ import annotations

import pytest
import xxhash

from kdn.cache import KVCache
from kdn.codec import (
    FRAME_TARGET_BYTES,
    EncodedParts,
    StreamDecoder,
    decode,
    encode,
    encode_parts,
    parse_header,
)
from kdn.codec.format import seal
from kdn.errors import Corrupt, InvalidArgument, KDNError
from kdn.layout import KVLayout, LayerLayout
from tests.helpers import pruned_layout, random_kv, uniform_layout


def test_frames_sized_for_the_wire() -> None:
    """layers_per_frame=0 fills frames to FRAME_TARGET_BYTES with consecutive layers (a layer
    that large travels alone); explicit counts are kept; a negative count is refused."""
    per_token = 4 * 64 * 2 * 2  # bytes of a layer's K and V per token
    small = random_kv(uniform_layout(layers=10, heads=4, dim=64),  # layers a quarter of it
                      tokens=FRAME_TARGET_BYTES // 4 // per_token)
    parts = encode_parts(small, "raw", layers_per_frame=0)
    assert parse_header(parts.header).spans == [(0, 4), (4, 4), (8, 2)]
    assert all(len(f) >= FRAME_TARGET_BYTES for f in parts.frames[:-1])
    assert decode(parts.to_bytes()).equal(small)
    big = random_kv(uniform_layout(layers=3, heads=4, dim=64),  # layers of the target
                    tokens=FRAME_TARGET_BYTES // per_token)
    assert parse_header(encode_parts(big, "raw", layers_per_frame=0).header).spans == [
        (0, 1), (1, 1), (2, 1)]
    assert len(encode_parts(small, "raw", layers_per_frame=3).frames) == 4
    assert len(encode_parts(small, "lossless", layers_per_frame=0).frames) <= 3
    for bad in (-1, 1.5, "1", True):  # a TypeError each, or a protobuf error in a frame span
        with pytest.raises(InvalidArgument, match=f"layers_per_frame must be a whole number >= 0 "
                                                  f".*got {bad!r}"):
            encode_parts(small, "raw", layers_per_frame=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ entry binding (version 2)


def _same_shape_pair() -> tuple[EncodedParts, EncodedParts]:
    lay = uniform_layout(layers=4)
    return (encode_parts(random_kv(lay, 6, seed=1), "raw", layers_per_frame=1),
            encode_parts(random_kv(lay, 6, seed=2), "raw", layers_per_frame=1))


def test_frames_of_another_entry_are_refused_even_with_the_same_layout() -> None:
    a, b = _same_shape_pair()
    assert parse_header(a.header).version == 2 and a.header != b.header
    spliced = [a.frames[0], b.frames[1], a.frames[2], b.frames[3]]
    with pytest.raises(Corrupt, match="does not belong to this entry"):
        decode(b"".join([a.header, *spliced]))
    dec = StreamDecoder(a.header)  # a reader checking frame by frame as layers stream in
    dec.decode_frame(0, a.frames[0])
    with pytest.raises(Corrupt, match="frame 1 does not belong"):
        dec.decode_frame(1, b.frames[1])
    with pytest.raises(Corrupt):  # sums unchecked (server-verified bytes): still bound
        StreamDecoder(a.header, checked=True).decode_frame(1, b.frames[1])


def test_version_1_entries_stay_readable_and_seal_rewrites_them_bound() -> None:
    a, b = _same_shape_pair()
    entry = parse_header(a.header).entry
    h1, frames1 = seal(entry, list(a.frames), version=1)
    assert parse_header(h1).version == 1
    kv = decode(b"".join([h1, *frames1]))
    assert kv.equal(decode(a.to_bytes()))
    # version 1 binds frames to a header, not to an entry: the same splice passes there
    _, other1 = seal(parse_header(b.header).entry, list(b.frames), version=1)
    mixed = decode(b"".join([h1, frames1[0], other1[1], *frames1[2:]]))
    assert not mixed.equal(kv)
    h2, frames2 = seal(parse_header(h1).entry, frames1)  # migrated to version 2
    assert h2 == a.header and frames2 == a.frames
    with pytest.raises(Corrupt):
        decode(b"".join([h2, frames2[0], b.frames[1], *frames2[2:]]))


def test_an_unknown_container_version_is_named_and_a_damaged_one_is_corrupt() -> None:
    """A header of a version this kdn does not read (a newer kdn's: its checksum holds) is
    named; one whose version field was damaged (its checksum fails) is Corrupt, as damage
    anywhere else is (a tier then drops that copy and reads the next one down)."""
    a, _ = _same_shape_pair()
    head = bytearray(a.header)
    head[4] = 9  # version field
    with pytest.raises(Corrupt, match="checksum mismatch"):
        decode(bytes(head) + b"".join(a.frames))
    head[-8:] = xxhash.xxh3_64_intdigest(bytes(head[:-8])).to_bytes(8, "little")
    with pytest.raises(InvalidArgument, match="unsupported container version 9"):
        decode(bytes(head) + b"".join(a.frames))

def test_a_header_declaring_a_layer_past_the_limit_is_refused_naming_that_layer() -> None:
    """The per-layer size limit holds for the widest layer wherever it lies (a pruned layout's
    widest layer need not be its first), checked once per header from the layout's widest."""
    from kdn.codec.format import build_header, parse_header
    from kdn.codec.layouts import MAX_LAYER_BYTES
    from kdn.errors import InvalidLayout

    lay = KVLayout("widest-in-the-middle", (LayerLayout(2, 4, 4, tuple(range(4)), tuple(range(4))),
                                            LayerLayout(2, 16, 16),
                                            LayerLayout(2, 8, 8, tuple(range(8)), tuple(range(8)))),
                   head_dim=16)
    assert lay.widest_token_bytes == (1, 2 * 32 * 2)
    entry = parse_header(encode_parts(random_kv(lay, 3, seed=1), "raw").header).entry
    entry.tokens = MAX_LAYER_BYTES // (2 * 32 * 2)  # layer 1 exactly at the limit: allowed
    assert parse_header(build_header(entry)).tokens == entry.tokens
    entry.tokens += 1
    with pytest.raises(InvalidLayout, match=r"layer 1 declares .* layer limit"):
        parse_header(build_header(entry))


def test_encode_refuses_a_layer_past_the_limit_that_every_decoder_would_refuse() -> None:
    """The limit held at encode, before any layer is encoded (an entry of a layer over 4 GiB
    decoded, 1M tokens of 8 heads x 128 fp16 channels, was written whole, then unreadable):
    tokens of stride 0, no memory, one past the limit in layer 1, the widest."""
    import torch

    from kdn.codec.layouts import MAX_LAYER_BYTES
    from kdn.errors import InvalidLayout

    lay = KVLayout("wide", (LayerLayout(2, 16, 16), LayerLayout(8, 128, 128)), head_dim=128)
    tokens = MAX_LAYER_BYTES // (8 * 256 * 2) + 1
    one = torch.zeros(1, 1, 1, dtype=torch.float16)
    kv = KVCache(lay, [(one.expand(h, tokens, c), one.expand(h, tokens, c))
                       for h, c in ((2, 16), (8, 128))])
    for mode in ("raw", "int8", "kdn"):
        with pytest.raises(InvalidLayout, match=rf"layer 1 declares {(tokens * 4096)} bytes of "
                                                rf"K and V for {tokens} tokens, over the "
                                                rf"{MAX_LAYER_BYTES}-byte layer limit"):
            encode(kv, mode)


def test_an_entry_at_the_layer_limit_is_encoded_and_decoded(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """What encode writes, decode reads, at the limit (lowered here) and one token past it."""
    from kdn.codec import layouts
    from kdn.errors import InvalidLayout

    monkeypatch.setattr(layouts, "MAX_LAYER_BYTES", 64 << 10)
    lay = uniform_layout(layers=2, heads=2, dim=64)  # 512 bytes of K and V a token
    at = random_kv(lay, tokens=128, seed=4)
    for mode in ("raw", "kdn"):
        assert decode(encode(at, mode)).num_tokens == 128
        with pytest.raises(InvalidLayout, match="65536-byte layer limit"):
            encode(random_kv(lay, tokens=129, seed=4), mode)


def _walk_outcome(header: object, frame: bytes, records: bool) -> object:
    from kdn.codec.format import check_frame

    try:
        got = check_frame(header, 0, frame, checksum=False, records=records)  # type: ignore[arg-type]
    except KDNError as exc:
        return type(exc), str(exc)
    return [(r.layer, r.tokens, bytes(r.body)) for r in got]


@pytest.mark.parametrize("layout", [uniform_layout(layers=6), pruned_layout()],
                         ids=["uniform", "pruned"])
def test_a_remembered_record_walk_never_passes_a_frame_the_walk_would_refuse(
        layout: KVLayout) -> None:
    """A frame's record walk that passed is remembered by (layout, tokens, layers, length)
    and a frame with the same bytes at its record prefixes skips the walk: every record field
    of a frame of that key changed (the frame's length kept) checks as it does with nothing
    remembered, whole frames and their records alike."""
    import struct

    from kdn.codec import format as fmt

    kv = random_kv(layout, 9, seed=3)
    parts = encode_parts(kv, "raw", layers_per_frame=0)
    header = parse_header(parts.header)
    frame = bytes(parts.frames[0])
    assert header.entry.frames[0].num_layers == layout.num_layers >= fmt._WALK_MEMO_LAYERS
    key = (layout.fingerprint, 9, 0, layout.num_layers, len(frame) - fmt.FRAME_STRUCT.size)
    fmt._WALKS._values.pop(key, None)
    sound = _walk_outcome(header, frame, True)
    assert isinstance(sound, list) and len(sound) == layout.num_layers
    assert key in fmt._WALKS  # remembered: the next sound frame skips the walk
    assert _walk_outcome(header, frame, True) == sound
    assert _walk_outcome(header, frame, False) == []
    starts, off = [], fmt.FRAME_STRUCT.size
    for _ in range(layout.num_layers):
        starts.append(off)
        off += fmt.RECORD_BYTES + struct.unpack_from("<HIHHI", frame, off)[4]
    fields = [(0, "<H"), (2, "<I"), (6, "<H"), (8, "<H"), (10, "<I")]
    tried = 0
    for rec in (starts[0], starts[len(starts) // 2], starts[-1]):
        for at, fmt_ in fields:
            for delta in (1, -1):
                bad = bytearray(frame)
                (value,) = struct.unpack_from(fmt_, bad, rec + at)
                wrap = 1 << (8 * struct.calcsize(fmt_))
                struct.pack_into(fmt_, bad, rec + at, (value + delta) % wrap)
                for records in (True, False):
                    remembered = _walk_outcome(header, bytes(bad), records)
                    saved = dict(fmt._WALKS._values)
                    fmt._WALKS._values.clear()
                    try:
                        walked = _walk_outcome(header, bytes(bad), records)
                    finally:
                        fmt._WALKS._values.update(saved)
                    assert remembered == walked
                    assert not isinstance(walked, list)  # every change is refused
                    tried += 1
    assert tried == 3 * len(fields) * 2 * 2



def test_record_specs_are_each_records_layer_spec_for_any_length() -> None:
    from kdn.codec.api import layer_spec, record_specs
    from kdn.codec.format import check_frame, parse_container

    layout = pruned_layout()
    for tokens in (7, 30, 7):  # a length seen before comes from the memo, the same specs
        c = parse_container(encode(random_kv(layout, tokens), "kdn", "default",
                                   layers_per_frame=2), verify=False)
        recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
        got = record_specs(c.header.layout, recs)
        assert got == [layer_spec(layout, r.layer, tokens) for r in recs]
        assert [s.tokens for s in got] == [tokens] * layout.num_layers


def test_decode_takes_any_contiguous_buffer_of_an_entrys_bytes_and_names_what_is_not() -> None:
    """bytes, bytearray, a memoryview (also a 2-D one) and a numpy array of the entry's bytes
    decode alike; a str, None, a list of ints or an int is InvalidArgument
    naming what was given, not a TypeError or a "truncated" header."""
    import numpy as np
    import torch

    kv = random_kv(uniform_layout(layers=2), 6)
    blob = encode(kv, "raw")
    for same in (bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8),
                 memoryview(np.frombuffer(blob, np.uint8)).cast("B", (1, len(blob)))):
        got = decode(same)  # type: ignore[arg-type]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(got.layers, kv.layers))
    for bad in (blob.decode("latin-1"), None, list(blob[:20]), 5):
        with pytest.raises(InvalidArgument, match=f"bytes-like buffer.*got {type(bad).__name__}"):
            decode(bad)  # type: ignore[arg-type]
