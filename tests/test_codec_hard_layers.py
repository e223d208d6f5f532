"""Lossy codecs on the layers a per-token RMS step handles worst.

A pruner may leave a layer 1 head x 1 channel (KVPruner keeps at least one value channel), and
a layer's values may all have about the same magnitude (a constant channel). Such a token's
largest |x| is close to its RMS, so a ``kdn`` step of more than twice the RMS (the V steps of
``compact`` and ``tiny``) would round all of it to 0 were the step not capped at the token's
largest |x| (``kdn.codec.modes.kdn``). bf16 and float32 caches may hold values whose squares
float32 can not hold (|x| beyond ~1e19 or below ~1e-23), so the RMS is taken relative to the
absmax (``kdn.codec.quant.token_rms``); smaller still, ``kdn`` steps stop at 2**-124. Rows
below float16's normal range have int8 and cachegen scales raised where the nearest float16
would clip them (``quant.f16_scale``). These tests hold every lossy level to: finite output,
no token decoded as zeros, its largest value decoded within half of itself with its sign,
every value within half the (capped) step, and values of the token's largest magnitude within
the scale grid wherever the cap applies.
"""

from __future__ import annotations

import pytest
import torch

from kdn.cache import KVCache
from kdn.codec import decode, encode
from kdn.codec.modes import get_mode
from kdn.codec.modes.cachegen import PARAMS as CACHEGEN
from kdn.codec.modes.kdn import LEVELS as KDN_LEVELS
from kdn.codec.quant import f16_scale
from kdn.errors import InvalidLayout
from kdn.layout import DType, KVLayout, LayerLayout

SCALE_GRID = 2.0 ** (1 / 32) - 1
"""Largest relative error of a stored kdn scale (round(16 log2 s)), 2.2%."""

SMALL = [(1, 1, 1), (1, 2, 1), (2, 1, 2), (1, 1, 3), (3, 2, 1), (2, 2, 2), (4, 1, 1)]
"""(kv_heads, k_channels, v_channels) of the pruned layers, each between two normal ones."""


def lossy_codecs() -> list[tuple[str, str]]:
    return [("cachegen", "")] + [("kdn", lv) for lv in get_mode("kdn").levels]


def small_layout(dtype: DType) -> KVLayout:
    normal = LayerLayout(2, 16, 16)
    layers = [normal]
    for h, kc, vc in SMALL:
        layers += [LayerLayout(h, kc, vc), normal]
    return KVLayout("pruned-small", tuple(layers), dtype=dtype, head_dim=16)


def sweep_layout(dtype: DType) -> KVLayout:
    """Every (heads, channels) of 1-4 heads and 1-8 channels, K and V alike."""
    shapes = [(h, c) for h in (1, 2, 3, 4) for c in (1, 2, 3, 4, 8)]
    return KVLayout("sweep", tuple(LayerLayout(h, c, c) for h, c in shapes), dtype=dtype,
                    head_dim=8)


def values(kind: str, shape: tuple[int, int, int], g: torch.Generator) -> torch.Tensor:
    """x: [heads, tokens, ch] drawn as ``kind``."""
    heads, tokens, ch = shape
    x = torch.randn(shape, generator=g)
    if kind == "gauss":
        return x
    if kind == "outliers":  # a per-channel offset, and one channel in four 20x larger
        x = x + 2 * torch.randn(1, 1, ch, generator=g)
        x[:, :, ::4] *= 20
        return x
    if kind == "constant":
        return torch.full(shape, 0.75)
    if kind == "near-constant":
        return 0.75 + 0.01 * x
    if kind == "flat":  # one magnitude, random signs: a token's absmax is its RMS
        return 0.5 * torch.sign(x)
    raise ValueError(kind)


def cache(layout: KVLayout, kind: str, tokens: int = 40, seed: int = 0,
          magnitude: float = 1.0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    dt = layout.dtype.torch
    return KVCache(layout, [
        ((values(kind, (lay.kv_heads, tokens, lay.k_channels), g) * magnitude).to(dt),
         (values(kind, (lay.kv_heads, tokens, lay.v_channels), g) * magnitude).to(dt))
        for lay in layout.layers])


def step_of(mode: str, level: str, x: torch.Tensor, layer: int, num_layers: int,
            is_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(step [1, tokens, 1] the encoder is meant to use before its scale is rounded, whether
    the cap at the token's largest |x| set it) for x [heads, tokens, ch]."""
    absmax = x.abs().amax(dim=(0, 2), keepdim=True)  # x float64: no square overflows
    if mode == "cachegen":
        ck, cv = CACHEGEN.levels(layer)
        return absmax / (ck if is_key else cv), torch.zeros_like(absmax, dtype=torch.bool)
    k_step, v_step = KDN_LEVELS[level].steps(layer, num_layers)
    step = x.pow(2).mean(dim=(0, 2), keepdim=True).sqrt() * (k_step if is_key else v_step)
    return torch.minimum(step, absmax), step >= absmax


def by_token(x: torch.Tensor) -> torch.Tensor:
    """x: [heads, tokens, ch] -> [tokens, heads * ch]."""
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def check_small_layers(kv: KVCache, mode: str, level: str) -> None:
    out = decode(encode(kv, mode, level))
    sink = KDN_LEVELS[level].sink_tokens if mode == "kdn" else 0
    n = kv.layout.num_layers
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv.layers, out.layers)):
        for x, y, is_key in ((k, k2, True), (v, v2, False)):
            where = (kv.layout.layers[i], "K" if is_key else "V", mode, level)
            x, y = x.double()[:, sink:], y.double()[:, sink:]
            assert torch.isfinite(y).all(), where
            # the largest value of each token: its sign, within half of itself
            top = by_token(x).abs().argmax(dim=1, keepdim=True)
            xt, yt = by_token(x).gather(1, top), by_token(y).gather(1, top)
            assert ((xt - yt).abs() <= xt.abs() * (0.5 * 1.03)).all(), where
            step, capped = step_of(mode, level, x, i, n, is_key)
            eps = x.abs() * 2.0**-7  # the dtype's own rounding
            err = (x - y).abs()
            assert (err <= step / 2 * 1.03 + eps).all(), where
            # where the step is the token's largest |x|, values of that magnitude are 1 step
            top_values = capped & (x.abs() == x.abs().amax(dim=(0, 2), keepdim=True))
            assert (err[top_values] <= (x.abs() * SCALE_GRID * 1.01 + eps)[top_values]).all(), \
                where


@pytest.mark.parametrize("mode,level", lossy_codecs())
@pytest.mark.parametrize("kind", ["gauss", "outliers", "constant", "near-constant", "flat"])
@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_pruned_layers_of_a_few_values_keep_their_values(mode: str, level: str, kind: str,
                                                         dtype: DType) -> None:
    check_small_layers(cache(small_layout(dtype), kind), mode, level)


@pytest.mark.parametrize("mode,level", lossy_codecs())
def test_no_shape_of_up_to_4_heads_and_8_channels_decodes_as_zeros(mode: str, level: str
                                                                    ) -> None:
    # equal magnitudes are the hardest case for an RMS-relative step, at every size
    check_small_layers(cache(sweep_layout(DType.FLOAT16), "flat", tokens=24, seed=1), mode, level)
    check_small_layers(cache(sweep_layout(DType.FLOAT16), "gauss", tokens=24, seed=2), mode, level)


@pytest.mark.parametrize("level", get_mode("kdn").levels)
def test_a_constant_layer_decodes_to_its_value_where_the_step_reaches_it(level: str) -> None:
    layout = small_layout(DType.FLOAT16)
    kv = cache(layout, "constant")
    out = decode(encode(kv, "kdn", level))
    n = layout.num_layers
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv.layers, out.layers)):
        for x, y, s in zip((k, v), (k2, v2), KDN_LEVELS[level].steps(i, n)):
            err = (x.float() - y.float()).abs().max().item()
            # a step of at least the value codes it as one step; a finer one, within half
            bound = 0.75 * (SCALE_GRID if s >= 1 else s / 2) * 1.03 + 0.75 * 2.0**-10
            assert err <= bound, (i, level, s, err)


@pytest.mark.parametrize("level", get_mode("kdn").levels)
@pytest.mark.parametrize("magnitude", [1e-33, 1e-25, 1e-21, 1e21, 1e30])
@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT32])
def test_values_whose_squares_float32_can_not_hold_keep_the_levels_step(
        level: str, magnitude: float, dtype: DType) -> None:
    # cachegen stores its scales as float16 (as published): such caches are beyond its range
    check_small_layers(cache(small_layout(dtype), "outliers", magnitude=magnitude), "kdn", level)


@pytest.mark.parametrize("level", get_mode("kdn").levels)
@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT32])
def test_tokens_at_the_bottom_of_float32_are_kept_to_within_2_to_the_minus_125(
        level: str, dtype: DType) -> None:
    # scales stop at 2**-124 / step (a step float32 holds as a normal number), not at 1e-30:
    # tokens of 1e-33 decoded as zeros
    kv = cache(small_layout(dtype), "outliers", magnitude=1e-37)
    out = decode(encode(kv, "kdn", level))
    n = kv.layout.num_layers
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv.layers, out.layers)):
        for x, y, is_key in ((k, k2, True), (v, v2, False)):
            x, y = x.double(), y.double()
            step, _ = step_of("kdn", level, x, i, n, is_key)
            bound = step.clamp(min=2.0**-124) / 2 * 1.03 + x.abs() * 2.0**-7
            assert ((x - y).abs() <= bound).all(), (i, level, dtype)
            assert (y[:, 1:] != 0).any()


@pytest.mark.parametrize("mode", ["int8", "cachegen"])
@pytest.mark.parametrize("magnitude", [1e-3, 1e-5, 1e-6, 1e-8, 1e-10])
@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32])
def test_rows_below_float16s_normal_scales_keep_half_a_step(mode: str, magnitude: float,
                                                            dtype: DType) -> None:
    # their float16 scales are subnormals: rounded to nearest they clipped the largest values
    # (1e-5: 15% of them lost) or were 0 (1e-6: the row decoded as zeros)
    layout = small_layout(dtype)
    kv = cache(layout, "outliers", magnitude=magnitude)
    out = decode(encode(kv, mode))
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv.layers, out.layers)):
        for x, y, c in zip((k, v), (k2, v2), CACHEGEN.levels(i)):
            x, y = x.double(), y.double()
            if mode == "int8":  # step = scale
                step, per = x.abs().amax(dim=2, keepdim=True) / 127, 1
            else:  # step = scale / c
                step, per = x.abs().amax(dim=(0, 2), keepdim=True) / c, c
            # half a step of a scale within one float16 step (2**-24 here) above the exact one,
            # and the dtype's own rounding (float16 output: to its subnormals, 2**-24 apart)
            eps = x.abs() * 2.0**-7 + (2.0**-25 if dtype is DType.FLOAT16 else 0.0)
            bound = step / 2 * (1 + 2.0**-10) + 2.0**-25 / per + eps
            assert ((x - y).abs() <= bound).all(), (i, mode, magnitude, dtype)


def test_normal_float16_scales_are_the_nearest_float16() -> None:
    # rows of int8 and cachegen scales in float16's normal range are coded as they always were
    absmax = torch.logspace(-2.1, 6.9, 200_001, dtype=torch.float32)  # / 127: 2**-14 up
    assert torch.equal(f16_scale(absmax / 127, absmax, 127.5), (absmax / 127).half())
    for c in (15, 7):
        top = absmax[absmax < 65504]
        assert torch.equal(f16_scale(top, top, (c + 0.5) / c), top.half())


def test_a_layer_of_no_channels_is_refused_by_the_layout() -> None:
    with pytest.raises(InvalidLayout, match="v_channels must be a positive int"):
        LayerLayout(1, 1, 0)
    with pytest.raises(InvalidLayout, match="kv_heads must be a positive int"):
        LayerLayout(0, 1, 1)
