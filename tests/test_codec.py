"""Codec round trips for every mode and level, and detection of every corruption.

Random caches cover uniform, pruned (per-layer K/V channel counts) and odd shapes in every
dtype; a real SmolLM2 cache (``-m model``) covers real value distributions. Corruption tests
flip every bit of small containers, truncate at every length and swap frames.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdn.cache import KVCache
from kdn.codec import (
    FRAME_TARGET_BYTES,
    EncodedParts,
    StreamDecoder,
    decode,
    encode,
    encode_parts,
    mode_names,
    parse_header,
)
from kdn.codec.copies import copy_checked
from kdn.codec.entropy import decode_streams, encode_streams
from kdn.codec.format import header_size, seal
from kdn.codec.modes import get_mode, tensor_borrowed
from kdn.codec.modes.cachegen import PARAMS as CACHEGEN
from kdn.codec.modes.kdn import LEVELS as KDN_LEVELS
from kdn.errors import Corrupt, InvalidArgument, KDNError
from kdn.layout import DType, KVLayout, LayerLayout
from tests.helpers import pruned_layout, random_kv, uniform_layout


def all_codecs() -> list[tuple[str, str]]:
    return [(m, lv) for m in mode_names() for lv in get_mode(m).levels]


def odd_layout(dtype: DType = DType.FLOAT16) -> KVLayout:
    """Layers of 1 head and 1 channel up to 3 heads: shapes no real model has."""
    layers = (LayerLayout(1, 1, 3), LayerLayout(3, 7, 1), LayerLayout(2, 64, 5))
    return KVLayout("odd-model", layers, dtype=dtype, head_dim=64)


def error_bound(mode: str, level: str, x: torch.Tensor, layer: int, num_layers: int,
                is_key: bool) -> torch.Tensor:
    """Largest |x - decoded| each element of x [heads, tokens, ch] may show: half a step."""
    x = x.float()
    if mode == "int8":
        half = x.abs().amax(dim=2, keepdim=True) / 127 / 2
    elif mode == "cachegen":
        ck, cv = CACHEGEN.levels(layer)
        half = x.abs().amax(dim=(0, 2), keepdim=True) / (ck if is_key else cv) / 2
    else:
        lv = KDN_LEVELS[level]
        k_step, v_step = lv.steps(layer, num_layers)
        half = x.pow(2).mean(dim=(0, 2), keepdim=True).sqrt() * (k_step if is_key else v_step) / 2
        half[:, : lv.sink_tokens] = 0.0
    # + 3% for stored scales (float16, or kdn's 2**(1/32) log grid) + the dtype's own rounding
    return half * 1.03 + x.abs() * 2.0**-7 + 1e-6


def check_round_trip(kv: KVCache, mode: str, level: str) -> KVCache:
    blob = encode(kv, mode, level, layers_per_frame=2)
    out = decode(blob)
    assert out.layout.fingerprint == kv.layout.fingerprint
    assert out.start_position == kv.start_position and out.num_tokens == kv.num_tokens
    if get_mode(mode).lossless:
        assert out.equal(kv)
        return out
    n = kv.layout.num_layers
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv.layers, out.layers)):
        assert k2.dtype == k.dtype and k2.shape == k.shape and v2.shape == v.shape
        for x, x2, is_key in ((k, k2, True), (v, v2, False)):
            err = (x.float() - x2.float()).abs()
            assert (err <= error_bound(mode, level, x, i, n, is_key)).all(), (i, is_key)
    return out


@pytest.mark.parametrize("mode,level", all_codecs())
@pytest.mark.parametrize("make", [uniform_layout, pruned_layout, odd_layout])
@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32])
def test_round_trip_random(mode: str, level: str, make, dtype: DType) -> None:  # noqa: ANN001
    kv = random_kv(make(dtype=dtype), tokens=37, seed=3, start=5)
    check_round_trip(kv, mode, level)


@pytest.mark.parametrize("mode,level", all_codecs())
@pytest.mark.parametrize("tokens", [1, 2, 300])
def test_round_trip_token_counts(mode: str, level: str, tokens: int) -> None:
    check_round_trip(random_kv(pruned_layout(), tokens=tokens, seed=tokens), mode, level)


@pytest.mark.parametrize("mode,level", all_codecs())
def test_constant_and_extreme_values(mode: str, level: str) -> None:
    layout = uniform_layout(layers=2, heads=2, dim=8)
    zeros = torch.zeros(2, 9, 8, dtype=torch.float16)
    big = torch.full((2, 9, 8), 60000.0, dtype=torch.float16)
    big[0, ::2] = -60000.0
    kv = KVCache(layout, [(zeros, zeros.clone()), (big, big.clone())])
    out = decode(encode(kv, mode, level))
    assert torch.equal(out.layers[0][0], zeros)
    assert torch.isfinite(out.layers[1][0].float()).all()
    if not get_mode(mode).lossless:
        err = (big.float() - out.layers[1][0].float()).abs()
        assert (err <= error_bound(mode, level, big, 1, 2, True)).all()


def test_kdn_keeps_sink_token_exact() -> None:
    kv = random_kv(uniform_layout(), tokens=20, seed=1)
    out = decode(encode(kv, "kdn", "tiny"))
    for (k, v), (k2, v2) in zip(kv.layers, out.layers):
        assert torch.equal(k[:, :1], k2[:, :1]) and torch.equal(v[:, :1], v2[:, :1])


def test_levels_order_size() -> None:
    kv = random_kv(uniform_layout(dim=64), tokens=256, seed=2)
    sizes = [len(encode(kv, "kdn", lv)) for lv in get_mode("kdn").levels]
    assert sizes == sorted(sizes, reverse=True)


def test_unknown_mode_and_level() -> None:
    kv = random_kv(uniform_layout(), tokens=4)
    with pytest.raises(InvalidArgument):
        encode(kv, "nope")
    with pytest.raises(InvalidArgument):
        encode(kv, "kdn", "nope")


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
    with pytest.raises(InvalidArgument):
        encode_parts(small, "raw", layers_per_frame=-1)


def test_entropy_streams_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    sym = (torch.randn(7, 500, generator=g) * torch.tensor([0, 1, 3, 10, 100, 1000, 5000.0])
           .reshape(7, 1)).round().int().numpy()
    sym[0] = 42  # constant row
    blob = encode_streams(sym)
    assert (decode_streams(blob, 7, 500) == sym).all()
    with pytest.raises(Corrupt):  # trailing words (truncation is the frame checksum's job)
        decode_streams(blob + bytes(8), 7, 500)


_BOUNDED = """
import resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from kdn.codec.entropy import encode_streams
from kdn.errors import InvalidArgument
sym = np.zeros((4, 16), np.int32)
sym[1, 3] = np.iinfo(np.int32).min  # a NaN quantized by a lossy mode
try:
    encode_streams(sym)
except InvalidArgument as exc:
    print("refused:", exc)
"""


def test_entropy_symbols_out_of_range_are_refused_before_anything_is_sized_by_them() -> None:
    """A symbol of INT32_MIN (NaN through a quantizer) made the histogram 2**31 bins (16 GiB)
    before the range was checked: in 1 GiB of address space, refused (not MemoryError)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _BOUNDED], cwd=root, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused:" in run.stdout and "row 1" in run.stdout, run.stdout
    wide = np.zeros((2, 8), np.int32)
    wide[0, :2] = (-20000, 20000)  # within int16, but a row wider than MAX_WIDTH
    with pytest.raises(InvalidArgument, match="row 0"):
        encode_streams(wide)


@pytest.mark.parametrize("mode,level", all_codecs())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("token", [0, 5])  # kdn's sink token is stored as it is
def test_a_non_finite_value_is_refused_by_lossy_modes_and_kept_by_lossless_ones(
        mode: str, level: str, bad: float, token: int) -> None:
    """One NaN asked cachegen and kdn for 16 GiB, int8 made its row NaN and an inf zeroed its
    token: every lossy mode now refuses the layer by name; lossless modes keep it bit for
    bit."""
    kv = random_kv(uniform_layout(layers=3), tokens=12, seed=4)
    kv.layers[1][1][0, token, 2] = bad
    if not get_mode(mode).lossless:
        with pytest.raises(InvalidArgument, match="layer 1: V holds NaN or inf"):
            encode(kv, mode, level)
        return
    out = decode(encode(kv, mode, level))
    for (k, v), (k2, v2) in zip(kv.layers, out.layers):
        assert torch.equal(k.view(torch.int16), k2.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v2.view(torch.int16))


# ------------------------------------------------------------------ corruption


def small_kv() -> KVCache:
    layout = KVLayout("tiny", (LayerLayout(1, 4, 3), LayerLayout(1, 2, 4), LayerLayout(1, 3, 2)),
                      head_dim=4)
    return random_kv(layout, tokens=5, seed=7)


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
        assert layer == i and k.shape == kv.layers[i][0].shape


# ------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def real_kv() -> KVCache:
    from kdn.model.data import english_token_ids
    from kdn.model.hf import prefill
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    layout = KVLayout.from_config(model.config, dtype=torch.float16)
    return prefill(model, english_token_ids(96, tok), layout)[0]


@pytest.mark.model
@pytest.mark.parametrize("mode,level", all_codecs())
def test_round_trip_real_model(real_kv: KVCache, mode: str, level: str) -> None:
    check_round_trip(real_kv, mode, level)


# ------------------------------------------------------------------ checked copies, views


@pytest.mark.parametrize("layers_per_frame", [1, 2])
def test_copy_checked_copies_and_finds_every_damage(layers_per_frame: int) -> None:
    blob = bytearray(encode(small_kv(), "raw", layers_per_frame=layers_per_frame))
    out = bytearray(len(blob))
    copy_checked(memoryview(out), bytes(blob))
    assert out == blob
    for i in range(len(blob)):  # a flipped byte anywhere: header, frame prefix, record, body
        blob[i] ^= 0x40
        with pytest.raises(KDNError):
            copy_checked(memoryview(bytearray(len(blob))), bytes(blob))
        blob[i] ^= 0x40
    for n in (10, len(blob) - 1):
        with pytest.raises(KDNError):
            copy_checked(memoryview(bytearray(n)), bytes(blob[:n]))
    with pytest.raises(KDNError):  # bytes after the last frame
        copy_checked(memoryview(bytearray(len(blob) + 3)), bytes(blob) + b"abc")
    with pytest.raises(InvalidArgument):
        copy_checked(memoryview(bytearray(5)), bytes(blob))


def test_copy_checked_hashes_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kdn.codec.copies as copies

    monkeypatch.setattr(copies, "COPY_CHUNK", 7)  # many chunks per frame, one frame per layer
    kv = random_kv(uniform_layout(), 9, seed=2)
    blob = encode(kv, "raw")
    out = bytearray(len(blob))
    copies.copy_checked(memoryview(out), blob)
    assert decode(bytes(out)).equal(kv)
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(Corrupt):
        copies.copy_checked(memoryview(bytearray(len(bad))), bytes(bad))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_a_frame_copied_from_pieces_is_checked_as_the_whole_frame(
        monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """``copy_pieces_checked``: any cut of a frame into pieces (some shorter than its prefix)
    copies it whole and passes; a byte flipped anywhere in any piece, or pieces not adding up
    to the destination, is refused."""
    import random

    import kdn.codec.copies as copies
    import kdn.codec.format as fmt

    monkeypatch.setattr(copies, "COPY_CHUNK", chunk)
    blob = encode(random_kv(uniform_layout(), 9, seed=3), "raw", layers_per_frame=2)
    container = fmt.parse_container(blob)
    rng = random.Random(5)
    for index, frame in enumerate(container.frames):
        data = bytes(frame)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 6)))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
            out = bytearray(len(data))
            copies.copy_pieces_checked(container.header, index, memoryview(out), pieces)
            assert out == data
        for at in range(0, len(data), max(1, len(data) // 97)):
            bad = bytearray(data)
            bad[at] ^= 0x10
            pieces = [bytes(bad[:at // 2 + 1]), bytes(bad[at // 2 + 1:])]
            with pytest.raises(KDNError):
                copies.copy_pieces_checked(container.header, index,
                                        memoryview(bytearray(len(data))), pieces)
        with pytest.raises(InvalidArgument):
            copies.copy_pieces_checked(container.header, index, memoryview(bytearray(len(data))),
                                    [data[:10], data[11:]])
        with pytest.raises(KDNError):  # a frame in another frame's place
            copies.copy_pieces_checked(container.header, index + 1 if index == 0 else 0,
                                    memoryview(bytearray(len(data))), [data])


@pytest.mark.parametrize("workers", [2, 3])
def test_copy_checked_on_several_workers_copies_whole_frames_and_waits_for_all(
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import kdn.codec.copies as copies

    monkeypatch.setattr(copies, "PARALLEL_COPY_BYTES", 1)  # every entry is large enough
    kv = random_kv(pruned_layout(), 40, seed=4)
    blob = encode(kv, "raw", layers_per_frame=1)
    checked: list[tuple[str, int]] = []
    real = copies.check_frame_prefix

    def spy(header, index, *a, **k):  # type: ignore[no-untyped-def]
        checked.append((threading.current_thread().name, index))
        return real(header, index, *a, **k)

    monkeypatch.setattr(copies, "check_frame_prefix", spy)
    class Counting(ThreadPoolExecutor):
        runs = 0

        def submit(self, *a, **k):  # type: ignore[no-untyped-def]
            Counting.runs += 1
            return super().submit(*a, **k)

    with Counting(workers, thread_name_prefix="copy") as pool:
        out = bytearray(len(blob))
        copies.copy_checked(memoryview(out), blob, pool=pool, workers=workers)
        assert bytes(out) == blob and Counting.runs == workers - 1  # the last run: here
        assert sorted(i for _, i in checked) == list(range(kv.layout.num_layers))
        names = {name for name, _ in checked}
        assert threading.current_thread().name in names and any(
            n.startswith("copy") for n in names)  # on the pool's threads and this one
        bad = bytearray(blob)
        bad[len(bad) // 3] ^= 0x10  # in the first run: the later runs still end first
        dst = bytearray(len(bad))
        with pytest.raises(Corrupt):
            copies.copy_checked(memoryview(dst), bytes(bad), pool=pool, workers=workers)
        assert dst[-100:] == bad[-100:]  # the last run copied before the error came out
        bad = bytearray(blob)
        bad[-1] ^= 0x10  # in the last run
        with pytest.raises(Corrupt):
            copies.copy_checked(memoryview(bytearray(len(bad))), bytes(bad), pool=pool,
                             workers=workers)


def test_borrowed_tensors_view_writable_aligned_bytes_only() -> None:
    buf = bytearray(66)
    view = tensor_borrowed(memoryview(buf)[2:66], torch.float16, (2, 16))
    assert view is not None
    view.fill_(1.0)
    assert buf[2:4] == torch.tensor([1.0], dtype=torch.float16).view(torch.int16).numpy().tobytes()
    assert tensor_borrowed(memoryview(buf)[1:65], torch.float16, (2, 16)) is None  # misaligned
    assert tensor_borrowed(memoryview(bytes(64)), torch.float16, (2, 16)) is None  # read-only
    assert tensor_borrowed(memoryview(buf)[2:64], torch.float16, (2, 16)) is None  # wrong size


def test_a_decoder_that_borrows_decodes_the_same_and_still_checks() -> None:
    kv = random_kv(uniform_layout(), 12, seed=4)
    parts = encode_parts(kv, "raw")
    frames = [bytearray(f) for f in parts.frames]
    dec = StreamDecoder(parts.header, borrow=True)
    layers = [x for i, f in enumerate(frames) for x in dec.decode_frame(i, memoryview(f))]
    assert KVCache(kv.layout, [(k, v) for _, k, v in layers]).equal(kv)
    frames[0][-1] ^= 1
    with pytest.raises(Corrupt):
        dec.decode_frame(0, memoryview(frames[0]))
    trusting = StreamDecoder(parts.header, borrow=True, checked=True)  # sums skipped, not shapes
    trusting.decode_frame(0, memoryview(frames[0]))
    with pytest.raises(KDNError):
        trusting.decode_frame(0, memoryview(frames[0])[:-1])


def test_a_decoder_that_does_not_borrow_copies() -> None:
    kv = random_kv(uniform_layout(), 12, seed=6)
    parts = encode_parts(kv, "raw")
    frames = [bytearray(f) for f in parts.frames]
    dec = StreamDecoder(parts.header)
    layers = {i: (k, v) for j, f in enumerate(frames) for i, k, v in dec.decode_frame(j, f)}
    for k, v in layers.values():
        k.zero_()
        v.zero_()
    assert [bytes(f) for f in frames] == parts.frames  # the caller's buffers are untouched
    assert decode(parts.to_bytes()).equal(kv)


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


def test_an_unknown_container_version_is_named() -> None:
    a, _ = _same_shape_pair()
    head = bytearray(a.header)
    head[4] = 9  # version field
    with pytest.raises(InvalidArgument, match="unsupported container version 9"):
        decode(bytes(head) + b"".join(a.frames))


def test_the_torch_free_catalog_names_every_registered_mode_and_level() -> None:
    from kdn.codec.catalog import LEVELS, check_codec

    assert {m: get_mode(m).levels for m in mode_names()} == LEVELS
    for mode, level in (("nope", ""), ("kdn", "l2"), ("raw", "high")):
        with pytest.raises(InvalidArgument) as a:
            check_codec(mode, level)
        with pytest.raises(InvalidArgument) as b:
            get_mode(mode).check_level(level)
        assert str(a.value) == str(b.value)


def test_arrays_packed_for_one_device_copy_come_back_whole() -> None:
    """``upload_many`` packed (what a GPU gets: one staging buffer, one copy): every array
    comes back with its dtype, shape and values, whatever their sizes and alignments."""
    import numpy as np

    from kdn.codec.quant import upload_many

    rng = np.random.default_rng(0)
    arrays = {"i64": rng.integers(-9, 9, 7).astype(np.int64),
              "u16": rng.integers(0, 60000, (3, 5)).astype(np.uint16),
              "i8": rng.integers(-100, 100, 13).astype(np.int8),
              "f16": rng.normal(size=(2, 3, 4)).astype(np.float16),
              "empty": np.zeros((4, 0), dtype=np.int32),
              "ro": np.frombuffer(b"abcdefgh", dtype=np.uint8)}
    for pack in (False, True):
        got = upload_many(arrays, torch.device("cpu"), pack=pack)
        for name, a in arrays.items():
            t = got[name]
            assert tuple(t.shape) == a.shape and t.numpy().dtype == a.dtype, (name, pack)
            assert np.array_equal(t.numpy(), a), (name, pack)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_byte_planes_are_the_transpose_of_the_elements(itemsize: int) -> None:
    """``shuffle`` writes plane j as every element's byte j (checked against numpy's
    transpose), ``unshuffle`` undoes it exactly, and lossless layers decode into tensors of
    their own: writable, K and V apart, the stored bytes untouched."""
    from kdn.codec.modes.lossless import shuffle, unshuffle

    raw = np.random.default_rng(itemsize).integers(0, 256, itemsize * 1001, np.uint8).tobytes()
    planes = shuffle(raw, itemsize)
    want = np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T)
    assert planes == want.tobytes()
    back = unshuffle(planes, itemsize)
    assert back.tobytes() == raw and back.flags.writeable
    assert not np.shares_memory(back, np.frombuffer(planes, np.uint8))
    dtype = DType.FLOAT32 if itemsize == 4 else DType.FLOAT16
    kv = random_kv(uniform_layout(layers=2, dtype=dtype), 33, seed=itemsize)
    blob = encode(kv, "lossless")
    got = decode(blob)
    assert got.equal(kv)
    k, v = got.layers[0]
    k.fill_(0)  # writable, and V is not a view of the same bytes
    assert got.layers[0][1].equal(kv.layers[0][1]) and decode(blob).equal(kv)


def test_a_header_declaring_a_layer_past_the_limit_is_refused_naming_that_layer() -> None:
    """The per-layer size limit holds for the widest layer wherever it lies (a pruned layout's
    widest layer need not be its first), checked once per header from the layout's widest."""
    from kdn.codec.format import MAX_LAYER_BYTES, build_header, parse_header
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
