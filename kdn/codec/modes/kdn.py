"""``kdn``: entropy-coded uniform quantization with per-token RMS steps; a ladder of levels.

Per layer, for K and for V separately (any per-layer channel counts: pruned layouts included):

1. The first ``sink_tokens`` tokens are stored exactly (the layout's dtype). The first token of
   a sequence is an attention sink with keys/values far from the rest; quantizing it costs more
   quality than all other tokens together (CacheGen bins on SmolLM2-135M: ΔPPL 1.9% -> 0.5%).
2. Every other token t gets a step = ``step`` x its scale, the RMS of x[:, t, :] over heads and
   channels, capped so the step is at most the token's largest |x|: scale = min(rms,
   absmax / ``step``). The scale is stored as round(16 log2 scale) (~2% resolution) and the
   encoder quantizes with the stored value, so encoder and decoder agree exactly on the step.
   The cap is for a token of few values or of near-equal magnitudes (a pruned layer of 1 head
   x 1 channel, a constant channel): its absmax is close to its RMS, so a step of more than
   twice the RMS (``compact`` and ``tiny`` values) would round every value of it to 0, and
   one of 1-2x the RMS would decode it up to 2x too large. Capped, the largest value is a
   symbol of at least 1, and values of the token's largest magnitude decode to within the
   scale's 2%. A token of many spread-out values (a real model's layer: 192 per token in
   SmolLM2-135M) has absmax several times its RMS and keeps ``step`` x RMS. The decoder reads
   a scale whichever way the encoder chose it. Scales are at least 2**-124 / ``step`` (and
   2**-125, the smallest a symbol holds) so that steps stay normal float32 numbers, which a GPU
   flushing subnormals multiplies as the CPU does: a float32 or bf16 token of values below
   about 1e-36 is kept to within 2**-125 (~2e-38), not to its RMS.
3. symbols = round(x / step): an unbounded uniform quantizer (no clipping, no bins). The step
   sets distortion; the entropy coder, not a bin count, sets the size.
4. Symbols are coded per (head, channel) stream over tokens with its own frequency table
   (``kdn.codec.entropy``); the per-token log-scale values are coded as two more streams.

Mixed precision by layer sensitivity: a level's steps are scaled by a depth profile, one
multiplier per equal slice of the relative depth (so it applies to a model of any depth).
``KEY_DEPTH_PROFILE`` comes from a sensitivity sweep on SmolLM2-135M (coarsen the keys of one
sixth of the layers, measure KL on the real model): keys of the layers at 50-83% depth were
3-5x more sensitive than the rest; values were 10-50x less sensitive than keys everywhere,
hence value steps ~3x key steps. Levels are data (``KdnLevel``); the header names the level.

One scale per token and per K/V (log-scale streams): an entropy-coded uniform quantizer gains
nothing from rotations or finer scales (the README's codec section lists what was compared).

    body = sections(sink K | sink V | log-scale streams [2, n] | symbols [heads*(k_ch+v_ch), n])
           with n = tokens - sink tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kdn.codec.entropy import encode_streams
from kdn.codec.modes import (
    LayerSpec,
    Mode,
    pack_sections,
    register,
    tensor_bytes,
    tensor_from_bytes,
    unpack_sections,
)
from kdn.codec.quant import (
    DEQUANTIZE_CHUNK_BYTES,
    LOG_SCALE_MAX,
    dequantize,
    log_scale_symbols,
    quantize,
    scale_from_symbols,
    to_numpy,
    token_absmax,
    token_rms,
)
from kdn.codec.symbols import symbols
from kdn.errors import Corrupt, InvalidArgument


@dataclass(frozen=True)
class KdnLevel:
    """One rung of the kdn ladder."""

    k_step: float
    """Key quantizer step, in units of each token's key RMS (over heads and channels); a
    token's step is at most its largest |key| (module docstring, 2.)."""
    v_step: float
    """Value quantizer step, in units of each token's value RMS; at most its largest |value|."""
    sink_tokens: int = 1
    """Leading tokens stored exactly."""
    k_profile: tuple[float, ...] = (1.0,)
    """Key step multipliers over equal slices of the relative depth (first to last layer)."""
    v_profile: tuple[float, ...] = (1.0,)
    """Value step multipliers over equal slices of the relative depth."""

    def __post_init__(self) -> None:
        if min(self.k_step, self.v_step, *self.k_profile, *self.v_profile) <= 0:
            raise InvalidArgument("kdn level steps and profile multipliers must be > 0")
        if self.sink_tokens < 0:
            raise InvalidArgument("kdn level: sink_tokens must be >= 0")

    def steps(self, layer: int, num_layers: int) -> tuple[float, float]:
        """(K step, V step) of ``layer`` in units of the token RMS."""
        def at(profile: tuple[float, ...]) -> float:
            return profile[min(len(profile) - 1, layer * len(profile) // num_layers)]

        return self.k_step * at(self.k_profile), self.v_step * at(self.v_profile)


KEY_DEPTH_PROFILE = (1.0, 1.3, 1.0, 0.6, 0.6, 1.0)


def _level(k_step: float, v_step: float) -> KdnLevel:
    return KdnLevel(k_step=k_step, v_step=v_step, k_profile=KEY_DEPTH_PROFILE)


LEVELS: dict[str, KdnLevel] = {
    "near-lossless": _level(0.1, 0.3),
    "high": _level(0.25, 0.75),
    # between high and default: on a 50%-pruned SmolLM2 (bench.prune) high -> default is 27%
    # fewer bytes for +0.1% -> +3.5% PPL; this rung is 9% under high at about +1%
    "balanced": _level(0.3, 0.9),
    "default": _level(0.4, 1.5),
    "small": _level(0.5, 1.5),
    "compact": _level(0.6, 2.0),
    "tiny": _level(0.7, 2.5),
}


def _quant(x: torch.Tensor, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [heads, n, ch] -> (log-scale symbols [n], symbols [heads * ch, n])
    absmax = token_absmax(x)
    floor = max(2.0**-125, 2.0**-124 / step)  # a step stays a normal float32 (module doc, 2.)
    q = log_scale_symbols(torch.minimum(token_rms(x, absmax), absmax / step), floor)
    return q, quantize(x, scale_from_symbols(q) * step)


class Kdn(Mode):
    name = "kdn"
    levels = tuple(LEVELS)

    def params(self, level: str) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(LEVELS[level]).items()}

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        lv = LEVELS[level]
        k_step, v_step = lv.steps(spec.index, spec.num_layers)
        s = min(lv.sink_tokens, spec.tokens)
        kq, k_sym = _quant(k[:, s:], k_step)
        vq, v_sym = _quant(v[:, s:], v_step)
        scales = to_numpy(torch.stack([kq, vq]))  # [2, n]
        streams = to_numpy(torch.cat([k_sym, v_sym]))  # [heads * (k_ch + v_ch), n]
        return pack_sections([
            tensor_bytes(k[:, :s]),
            tensor_bytes(v[:, :s]),
            encode_streams(scales),
            encode_streams(streams),
        ])

    def decode_work_bytes(self, elements: int, itemsize: int) -> int:
        # its int32 symbols; a chunk of float32 products and their conversion
        return 4 * elements + 2 * DEQUANTIZE_CHUNK_BYTES

    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"layer {spec.index}"
        lv = LEVELS[level]
        k_step, v_step = lv.steps(spec.index, spec.num_layers)
        heads, dt = spec.layout.kv_heads, spec.dtype.torch
        kc, vc = spec.layout.k_channels, spec.layout.v_channels
        s = min(lv.sink_tokens, spec.tokens)
        n = spec.tokens - s
        k_sink_raw, v_sink_raw, scale_blob, blob = unpack_sections(body, 4, where)
        k_sink = tensor_from_bytes(k_sink_raw, dt, (heads, s, kc), device)
        v_sink = tensor_from_bytes(v_sink_raw, dt, (heads, s, vc), device)
        q = symbols(scale_blob, 2, n, device)
        sym = symbols(blob, heads * (kc + vc), n, device)
        scale = scale_from_symbols(q)  # [2, n]
        k_steps, v_steps = scale[0] * k_step, scale[1] * v_step
        # a step float32 can not hold would decode a zero symbol as NaN (inf * 0)
        if q.numel() and (q.abs().max() > LOG_SCALE_MAX or not torch.isfinite(k_steps).all()
                          or not torch.isfinite(v_steps).all()):
            raise Corrupt(f"{where}: scale symbols out of range")
        # each written into its layer after the sink: no second copy of the layer
        k = torch.empty(heads, s + n, kc, dtype=dt, device=device)  # [heads, tokens, kc]
        v = torch.empty(heads, s + n, vc, dtype=dt, device=device)
        k[:, :s], v[:, :s] = k_sink, v_sink
        dequantize(sym[: heads * kc], k_steps, heads, dt, out=k[:, s:])
        dequantize(sym[heads * kc :], v_steps, heads, dt, out=v[:, s:])
        return k, v

    def decode_layers(self, bodies: list[memoryview], specs: list[LayerSpec], level: str,
                      device: torch.device, *, pinned: bool = False,
                      addresses: list[int] | None = None) -> Any:
        from kdn.codec.gpu_batch import decode_kdn

        table: dict[tuple[int, int], tuple[float, float, int]] = {}  # a few distinct layers
        steps = []
        for s in specs:
            st = table.get((s.index, s.num_layers))
            if st is None:
                lv = LEVELS[level]
                st = table[s.index, s.num_layers] = (*lv.steps(s.index, s.num_layers),
                                                     lv.sink_tokens)
            steps.append(st)
        return decode_kdn(bodies, specs, steps, device, pinned=pinned, addresses=addresses)


register(Kdn())
