"""Whole raw entries viewed in place (kdn.codec.inplace): the views equal a full decode for
uniform and pruned layouts and every frame grouping, any prefix byte out of place or an entry
the plan does not cover gets None (the caller then decodes frame by frame), and a retrieve
through the shared segment uses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client, dataplane
from kdn.codec import inplace
from kdn.codec.format import parse_header, seal
from kdn.errors import Corrupt
from kdn.layout import DType
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import pruned_layout, random_kv, uniform_layout


def _writable(parts: codec.EncodedParts, shift: int = 0) -> memoryview:
    """The container in writable memory with its first frame 64-byte aligned (as the server
    places it in a segment), or ``shift`` bytes past that."""
    data = parts.to_bytes()
    room = np.empty(len(data) + 128, dtype=np.uint8)
    start = (-(room.ctypes.data + len(parts.header))) % 64 + shift
    room[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return memoryview(room[start : start + len(data)])  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [uniform_layout(), pruned_layout()], ids=["uniform", "pruned"])
@pytest.mark.parametrize("per_frame", [1, 2, 0])
def test_views_equal_a_full_decode_and_alias_the_bytes(layout, per_frame: int) -> None:
    kv = random_kv(layout, 24, seed=per_frame)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=per_frame)
    buf = _writable(parts)
    got = inplace.views(parse_header(buf), buf)
    assert got is not None and len(got) == layout.num_layers
    assert KVCache(layout, got).equal(kv)
    got[1][1].fill_(0)  # views, not copies: the bytes under them change
    again = inplace.views(parse_header(buf), buf)
    assert again is not None and (again[1][1] == 0).all()
    with pytest.raises(Corrupt):  # which only checksums notice (the caller's to verify)
        codec.decode(buf)


def test_every_prefix_byte_out_of_place_is_refused() -> None:
    layout = pruned_layout()
    parts = codec.encode_parts(random_kv(layout, 8, seed=3), "raw", layers_per_frame=2)
    buf = _writable(parts)
    header = parse_header(buf)
    p = inplace.plan(header)
    assert p is not None
    head = len(header.raw)
    checked = [*p.positions.tolist(), *p.sum_positions.tolist()]
    assert len(checked) == 16 * len(parts.frames) + 14 * layout.num_layers
    for pos in checked:
        buf[head + pos] ^= 0x01
        assert inplace.views(header, buf) is None, pos
        buf[head + pos] ^= 0x01
    assert inplace.views(header, buf) is not None  # and whole again
    body = head + 16 + 14  # a body byte is the checksums' business, checked by the caller
    buf[body] ^= 0x01
    assert inplace.views(header, buf) is not None


def test_entries_the_plan_does_not_cover_get_none() -> None:
    layout = uniform_layout()
    kv = random_kv(layout, 8)
    parts = codec.encode_parts(kv, "raw")
    buf = _writable(parts)
    header = parse_header(buf)
    assert inplace.views(header, buf.toreadonly()) is None  # tensors would alias read-only bytes
    assert inplace.views(header, buf[:-1]) is None
    longer = memoryview(bytearray(bytes(buf) + b"\0"))  # (its alignment does not matter)
    assert inplace.views(header, longer) is None
    lossless = codec.encode_parts(kv, "lossless")
    lbuf = _writable(lossless)
    assert inplace.views(parse_header(lbuf), lbuf) is None  # not verbatim bodies
    entry = pb.EntryHeader.FromString(parse_header(buf).entry.SerializeToString())
    head1, frames1 = seal(entry, parts.frames, version=1)
    v1 = memoryview(bytearray(head1 + b"".join(frames1)))
    assert inplace.views(parse_header(v1), v1) is None  # no sums in the header to compare
    fp32 = uniform_layout(dtype=DType.FLOAT32)  # first body at byte 30: not 4-byte aligned
    f32 = _writable(codec.encode_parts(random_kv(fp32, 8), "raw"))
    assert inplace.plan(parse_header(f32)) is None and inplace.views(parse_header(f32), f32) is None
    unaligned = _writable(parts, shift=1)  # frames at an odd address
    assert inplace.views(header, unaligned) is None


def _apart(parts: codec.EncodedParts, shift: int = 0) -> list[memoryview]:
    """Each frame in a read-only bytes object of its own, as a received stream's messages hold
    them (``shift`` bytes into it)."""
    return [memoryview(b"\0" * shift + bytes(f))[shift:] for f in parts.frames]


@pytest.mark.parametrize("layout", [uniform_layout(), pruned_layout()], ids=["uniform", "pruned"])
@pytest.mark.parametrize("per_frame", [1, 3, 0])
def test_frames_apart_are_viewed_where_they_lie(layout, per_frame: int) -> None:
    kv = random_kv(layout, 24, seed=per_frame + 10)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=per_frame)
    frames = _apart(parts)
    header = parse_header(parts.header)
    got = inplace.frame_views(header, frames)
    assert got is not None and KVCache(layout, got).equal(kv)
    spans = [(np.frombuffer(f, np.uint8).ctypes.data, len(f)) for f in frames]
    for k, v in got:  # views of the frames, no copy
        for t in (k, v):
            assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + n
                       for lo, n in spans)
    dec = codec.StreamDecoder(header, private=True, checked=True)
    assert dec.view_frames(frames) is not None
    for unfit in (codec.StreamDecoder(header, private=True),  # sums not verified yet
                  codec.StreamDecoder(header, checked=True)):  # frames not handed over
        assert unfit.view_frames(frames) is None


def test_frames_apart_with_any_prefix_byte_out_of_place_are_refused() -> None:
    layout = pruned_layout()
    parts = codec.encode_parts(random_kv(layout, 8, seed=4), "raw", layers_per_frame=2)
    header = parse_header(parts.header)
    frames = [bytearray(f) for f in parts.frames]
    views = [memoryview(f).toreadonly() for f in frames]
    assert inplace.frame_views(header, views) is not None
    flipped = 0
    for f in frames:
        for pos in [*range(12), *range(16, 30)]:  # the frame's prefix (its sum aside), a record's
            f[pos] ^= 0x01
            assert inplace.frame_views(header, views) is None, pos
            f[pos] ^= 0x01
            flipped += 1
    assert flipped == 26 * len(frames)
    assert inplace.frame_views(header, views) is not None  # whole again
    frames[0][40] ^= 0x01  # a body byte: the checksums' business, verified before
    assert inplace.frame_views(header, views) is not None


def test_frames_apart_the_plan_does_not_cover_get_none() -> None:
    layout = uniform_layout()
    kv = random_kv(layout, 8)
    parts = codec.encode_parts(kv, "raw")
    header = parse_header(parts.header)
    frames = _apart(parts)
    assert inplace.frame_views(header, frames[:-1]) is None  # a frame missing
    assert inplace.frame_views(header, [*frames[:-1], frames[-1][:-1]]) is None  # cut short
    assert inplace.frame_views(header, _apart(parts, shift=1)) is None  # at odd addresses
    lossless = codec.encode_parts(kv, "lossless")
    assert inplace.frame_views(parse_header(lossless.header), _apart(lossless)) is None
    entry = pb.EntryHeader.FromString(header.entry.SerializeToString())
    head1, frames1 = seal(entry, parts.frames, version=1)
    assert inplace.frame_views(parse_header(head1), [memoryview(f) for f in frames1]) is None
    fp32 = uniform_layout(dtype=DType.FLOAT32)  # first body at byte 30: not 4-byte aligned
    p32 = codec.encode_parts(random_kv(fp32, 8), "raw")
    assert inplace.frame_views(parse_header(p32.header), _apart(p32)) is None


def test_retrieve_through_the_segment_views_the_whole_entry_at_once(
        shm_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = pruned_layout()
    kv = random_kv(layout, 40, seed=9)
    key = b"inplace-".ljust(32, b"x")
    shm_client.store(key, kv, mode="raw")
    calls: list[bool] = []
    real = inplace.views

    def spy(header, container):  # type: ignore[no-untyped-def]
        got = real(header, container)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(inplace, "views", spy)
    monkeypatch.setattr(dataplane, "SMALL_ENTRY_BYTES", 0)  # through the segment, not inline
    back = shm_client.retrieve(key, layout=layout)
    assert back is not None and back.equal(kv) and calls == [True]
    stream = shm_client.retrieve_stream(key, layout=layout)
    assert stream is not None and stream.is_ready(layout.num_layers - 1)
    assert stream.timings.bytes_received > kv.nbytes
    k, v = stream.wait_for_layer(2)
    assert torch.equal(k, kv.layers[2][0]) and torch.equal(v, kv.layers[2][1])
    monkeypatch.setattr(inplace, "views", lambda header, container: None)  # frame by frame
    again = shm_client.retrieve(key, layout=layout)
    assert again is not None and again.equal(kv)


def test_staging_views_verify_every_sum_where_the_bytes_lie() -> None:
    """The in-process tier's bytes bound for a device: read-only, viewed after every frame's
    checksum is verified in place (no copy on the host)."""
    layout = pruned_layout()
    kv = random_kv(layout, 16, seed=5)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=2)
    buf = _writable(parts)
    header = parse_header(buf)
    frames = list(codec.parse_container(buf, verify=False).frames)
    got = inplace.verified_views(header, frames, buf.toreadonly())
    assert got is not None and KVCache(layout, got).equal(kv)
    assert inplace.views(header, buf.toreadonly()) is None  # not without saying so
    body = len(header.raw) + 16 + 14 + 5
    buf[body] ^= 0x01  # a body byte: the sums catch what views alone would not
    with pytest.raises(Corrupt, match="frame 0"):
        inplace.verified_views(header, frames, buf.toreadonly())
    buf[body] ^= 0x01
    assert inplace.verified_views(header, frames[:-1], buf.toreadonly()) is None
