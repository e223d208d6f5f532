"""Codec round trips for every mode and level: values come back within each mode's bound.

Random caches cover uniform, pruned (per-layer K/V channel counts) and odd shapes in every
dtype; a real SmolLM2 cache (``-m model``) covers real value distributions. Entropy streams,
lossless byte planes and packed device uploads are checked the same way. Container and frame
checks are in ``test_codec_container.py``, damage detection in ``test_codec_damage.py``, checked
copies and borrowed views in ``test_codec_copies.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdn.cache import KVCache
from kdn.codec import decode, encode, mode_names
from kdn.codec.entropy import decode_streams, encode_streams
from kdn.codec.modes import get_mode
from kdn.codec.modes.cachegen import PARAMS as CACHEGEN
from kdn.codec.modes.kdn import LEVELS as KDN_LEVELS
from kdn.errors import Corrupt, InvalidArgument
from kdn.layout import DType, KVLayout, LayerLayout
from tests.helpers import all_codecs, pruned_layout, random_kv, uniform_layout


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_in_token_chunks_is_bit_identical_to_the_whole_layer(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU dequantizes a layer chunk by chunk of tokens, into its output (or a view of
    it, after a sink): bit for bit what products over the whole layer, their clamp and a
    permuted copy gave, saturating at the dtype's top alike."""
    from kdn.codec import quant

    torch.manual_seed(3)
    heads, ch, tokens = 3, 5, 1001
    sym = torch.randint(-32000, 32000, (heads * ch, tokens), dtype=torch.int32)
    step = torch.rand(tokens) * 4 + 1e-3
    step[::7] = 2.0**120  # past float16's and bfloat16's top: clamped, not inf
    top = torch.finfo(dtype).max
    whole = (sym.float().reshape(heads, ch, tokens) * step.reshape(1, 1, tokens)
             ).clamp(-top, top).permute(0, 2, 1).to(dtype).contiguous()
    monkeypatch.setattr(quant, "DEQUANTIZE_CHUNK_BYTES", 4 * heads * ch * 64)  # 16 chunks
    got = quant.dequantize(sym, step, heads, dtype)
    assert got.shape == whole.shape and got.is_contiguous() and torch.equal(got, whole)
    into = torch.full((heads, tokens + 4, ch), 7.0, dtype=dtype)
    quant.dequantize(sym, step, heads, dtype, out=into[:, 4:])
    assert torch.equal(into[:, 4:], whole) and bool((into[:, :4] == 7).all())
