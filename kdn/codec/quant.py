"""Quantizers shared by the lossy modes. Torch, on the tensors' own device; no entropy coding.

Every quantizer works on one layer's K or V, ``x: [kv_heads, tokens, channels]``, and returns
integer symbols laid out as streams, ``[kv_heads * channels, tokens]`` (one row per channel, as
the entropy coder models each row separately), plus whatever side information it needs.

    token_absmax(x)             -> [tokens]      CacheGen's per-token scale (max over heads, ch.)
    token_rms(x)                -> [tokens]      kdn's per-token scale (RMS over heads, ch.)
    log_scale_symbols(s)        -> [tokens] int  a positive scale as round(16 * log2 s)
    scale_from_symbols(q)       -> [tokens]      2 ** (q / 16), what encoder and decoder both use
    quantize(x, step)           -> streams       round(x / step), step: [tokens] per token
    dequantize(streams, step)   -> x
"""

from __future__ import annotations

import numpy as np
import torch

LOG_SCALE_RES = 16
"""Log-scale symbols per octave: scales are stored to within 2**(1/32) (~2%)."""
LOG_SCALE_MAX = 4000
"""|symbol| bound: scales in [2**-250, 2**250] (float32 saturates first)."""


def token_absmax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over heads and channels, per token. x: [heads, tokens, ch] -> [tokens] float32."""
    return x.float().abs().amax(dim=(0, 2))


def token_rms(x: torch.Tensor) -> torch.Tensor:
    """RMS over heads and channels, per token. x: [heads, tokens, ch] -> [tokens] float32."""
    return x.float().pow(2).mean(dim=(0, 2)).sqrt()


def log_scale_symbols(scale: torch.Tensor) -> torch.Tensor:
    """Integer symbols of positive scales (zeros map to the smallest scale). -> int32."""
    q = torch.round(torch.log2(scale.float().clamp_min(1e-30)) * LOG_SCALE_RES)
    return q.clamp(-LOG_SCALE_MAX, LOG_SCALE_MAX).to(torch.int32)


def scale_from_symbols(q: torch.Tensor) -> torch.Tensor:
    """The scale a log-scale symbol stands for (float32)."""
    return torch.exp2(q.float() / LOG_SCALE_RES)


def quantize(x: torch.Tensor, step: torch.Tensor, limit: int = 32000) -> torch.Tensor:
    """Uniform quantization with a per-token step.

    x: [heads, tokens, ch], step: [tokens] (> 0) -> symbols [heads * ch, tokens] int32.
    """
    heads, tokens, ch = x.shape
    sym = torch.round(x.float() / step.reshape(1, tokens, 1)).clamp(-limit, limit)
    return sym.to(torch.int32).permute(0, 2, 1).reshape(heads * ch, tokens)


def dequantize(
    sym: torch.Tensor, step: torch.Tensor, heads: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize``: sym [heads * ch, tokens], step [tokens] -> [heads, tokens, ch]."""
    rows, tokens = sym.shape
    x = sym.float().reshape(heads, rows // heads, tokens) * step.reshape(1, 1, tokens)
    top = torch.finfo(dtype).max  # rounding up near the top of float16 must not give inf
    return x.clamp(-top, top).permute(0, 2, 1).to(dtype).contiguous()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def from_numpy(a: np.ndarray, device: torch.device) -> torch.Tensor:
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.array(a, order="C")
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)
