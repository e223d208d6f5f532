"""``cachegen``: our re-implementation of CacheGen (Liu et al., SIGCOMM 2024), the baseline.

As published (and as in the authors' LMCache code):

* per (layer, token) a scale = max |x| over all heads and channels (float16), for K and for V;
* symbols round(x / scale * C), C = bins // 2 - 1, with bins by layer: keys 32 in the first
  10 layers then 16; values 32 in the first 2 layers then 16 (``CacheGenParams``);
* for each (layer, head, channel) a symbol distribution over the chunk's tokens, and arithmetic
  coding of each channel's stream with it (here a range coder, ``kdn.codec.entropy``; range and
  arithmetic coding reach the same size to within a few bytes).

Delta encoding against anchor tokens (paper §5.1: groups of 10 tokens, the first of a group
coded as is, the others as deltas to it) is *not* applied. The authors' released encoder
(LMCache's ``cachegen_encoder``) does not do it either, and on SmolLM2-135M it made the baseline
worse: with the same bins, deltas raised size by 25% (2.58 -> 3.24 bits/element) for a smaller
quality gain than spending those bits on more bins. RoPE-rotated keys change quickly from token
to token in most channels, so deltas are not smaller than the values they replace.

    body = sections(K scales f16 [tokens] | V scales f16 [tokens]
                    | entropy streams [heads * (k_ch + v_ch), tokens])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kdn.codec.entropy import encode_streams
from kdn.codec.modes import LayerSpec, Mode, pack_sections, register, unpack_sections
from kdn.codec.quant import (
    DEQUANTIZE_CHUNK_BYTES,
    F16_MAX,
    dequantize,
    f16_scale,
    from_numpy,
    quantize,
    to_numpy,
    token_absmax,
)
from kdn.codec.symbols import symbols
from kdn.errors import Corrupt, InvalidArgument


@dataclass(frozen=True)
class CacheGenParams:
    """CacheGen's layer-wise quantization bins."""

    key_bins_first: int = 32
    """Bins for keys in the first ``key_first_layers`` layers."""
    key_bins_rest: int = 16
    key_first_layers: int = 10
    value_bins_first: int = 32
    """Bins for values in the first ``value_first_layers`` layers."""
    value_bins_rest: int = 16
    value_first_layers: int = 2

    def __post_init__(self) -> None:
        for b in (self.key_bins_first, self.key_bins_rest, self.value_bins_first,
                  self.value_bins_rest):
            if b < 4:
                raise InvalidArgument(f"CacheGen bins must be >= 4, got {b}")

    def levels(self, layer: int) -> tuple[int, int]:
        """C (the largest symbol magnitude) for K and V of ``layer``."""
        kb = self.key_bins_first if layer < self.key_first_layers else self.key_bins_rest
        vb = self.value_bins_first if layer < self.value_first_layers else self.value_bins_rest
        return kb // 2 - 1, vb // 2 - 1


PARAMS = CacheGenParams()


def _quant(x: torch.Tensor, c: int) -> tuple[bytes, torch.Tensor]:
    # x: [heads, tokens, ch] -> (scale f16 bytes, symbols [heads * ch, tokens])
    # float16 scales: values beyond its range (bf16, f32 caches) saturate instead of an
    # infinite scale, whose step would decode the whole token as NaN; a subnormal one is raised
    # where the nearest would clip the token's largest value (or be 0 for a token of tiny values)
    absmax = token_absmax(x)
    scale = f16_scale(absmax, absmax, (c + 0.5) / c)
    step = torch.where(scale > 0, scale.float(), 1.0) / c  # an all-zero token codes as zeros
    return to_numpy(scale).tobytes(), quantize(x, step, limit=c)


def _step(raw: memoryview, tokens: int, c: int, device: torch.device, where: str
          ) -> torch.Tensor:
    if len(raw) != 2 * tokens:
        raise Corrupt(f"{where}: scale section has {len(raw)} bytes for {tokens} tokens")
    scale = from_numpy(np.frombuffer(raw, dtype=np.float16), device).float()
    if not torch.isfinite(scale).all():  # never written (``_quant``; lossy modes refuse NaN
        # and inf input): inf would decode the token as NaN, NaN as values of step 1 / c
        raise Corrupt(f"{where}: a scale is not finite (inf or NaN)")
    return torch.where(scale > 0, scale, 1.0) / c


class CacheGen(Mode):
    name = "cachegen"
    max_abs = F16_MAX  # a token's float16 scale is its largest magnitude

    def params(self, level: str) -> dict[str, str]:
        p = PARAMS
        return {
            "key_bins": f"{p.key_bins_first}x{p.key_first_layers},{p.key_bins_rest}",
            "value_bins": f"{p.value_bins_first}x{p.value_first_layers},{p.value_bins_rest}",
            "scale": "absmax per (layer, token)",
            "entropy": "range coder, model per (layer, head, channel)",
        }

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        ck, cv = PARAMS.levels(spec.index)
        k_scale, k_sym = _quant(k, ck)
        v_scale, v_sym = _quant(v, cv)
        streams = to_numpy(torch.cat([k_sym, v_sym]))  # [heads * (k_ch + v_ch), tokens]
        return pack_sections([k_scale, v_scale, encode_streams(streams)])

    def decode_work_bytes(self, elements: int, itemsize: int) -> int:
        # its int32 symbols; a chunk of float32 products and their conversion
        return 4 * elements + 2 * DEQUANTIZE_CHUNK_BYTES

    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"layer {spec.index}"
        ck, cv = PARAMS.levels(spec.index)
        k_raw, v_raw, blob = unpack_sections(body, 3, where)
        heads, tokens = spec.layout.kv_heads, spec.tokens
        k_rows = heads * spec.layout.k_channels
        # the scales first: 4 stored bytes a token, where constant symbol rows cost none (a
        # header's millions of tokens over a few bytes are refused before [rows, tokens]
        # symbols are made)
        k_step = _step(k_raw, tokens, ck, device, where)
        v_step = _step(v_raw, tokens, cv, device, where)
        sym = symbols(blob, k_rows + heads * spec.layout.v_channels, tokens, device)
        dt = spec.dtype.torch
        k = dequantize(sym[:k_rows], k_step, heads, dt)
        v = dequantize(sym[k_rows:], v_step, heads, dt)
        return k, v


register(CacheGen())
