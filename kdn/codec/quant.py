"""Quantizers shared by the lossy modes. Torch, on the tensors' own device; no entropy coding.

Every quantizer works on one layer's K or V, ``x: [kv_heads, tokens, channels]``, and returns
integer symbols laid out as streams, ``[kv_heads * channels, tokens]`` (one row per channel, as
the entropy coder models each row separately), plus whatever side information it needs.

    token_absmax(x)             -> [tokens]      CacheGen's per-token scale (max over heads, ch.)
    token_rms(x)                -> [tokens]      kdn's per-token scale (RMS over heads, ch.;
                                                 capped by the absmax: ``modes.kdn``)
    log_scale_symbols(s, floor) -> [tokens] int  a positive scale as round(16 * log2 s)
    scale_from_symbols(q)       -> [tokens]      2 ** (q / 16), what encoder and decoder both use
    f16_scale(s, absmax, fits)  -> float16       a float16 scale that never clips absmax
    quantize(x, step)           -> streams       round(x / step), step: [tokens] per token
    dequantize(streams, step)   -> x
"""

from __future__ import annotations

import numpy as np
import torch

LOG_SCALE_RES = 16
"""Log-scale symbols per octave: scales are stored to within 2**(1/32) (~2%)."""
LOG_SCALE_MAX = 2000
"""|symbol| bound: scales in [2**-125, 2**125], normal float32 numbers."""
SCALE_TABLE = torch.tensor([2.0 ** (j / LOG_SCALE_RES) for j in range(LOG_SCALE_RES)],
                           dtype=torch.float32)
"""2**(j/16) for j < 16, each rounded once to float32: a scale is one of these times an exact
power of two, so every device computes it bit-identically (no exp2 whose last bit varies)."""


def token_absmax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over heads and channels, per token. x: [heads, tokens, ch] -> [tokens] float32."""
    return x.abs().amax(dim=(0, 2)).float()  # exact in any float dtype


def token_rms(x: torch.Tensor, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """RMS over heads and channels, per token. x: [heads, tokens, ch] -> [tokens] float32.

    Squares of bf16 or float32 values beyond 2**64 overflow float32 (an infinite RMS; their
    sum over many channels overflows sooner) and those below 2**-63 underflow, so a token whose
    ``absmax`` (computed when not given) lies outside [2**-48, 2**48] (room for sums of 2**32
    squares) has its RMS computed on x / absmax and scaled back. float16 values never do."""
    xf = x.float()
    rms = xf.pow(2).mean(dim=(0, 2)).sqrt()
    a = token_absmax(x) if absmax is None else absmax
    extreme = (a > 2.0**48) | ((a < 2.0**-48) & (a > 0))
    if bool(extreme.any()):
        a1 = torch.where(extreme, a, 1.0)
        scaled = (xf / a1.reshape(1, -1, 1)).pow(2).mean(dim=(0, 2)).sqrt() * a1
        rms = torch.where(extreme, scaled, rms)
    return rms


def log_scale_symbols(scale: torch.Tensor, floor: float = 2.0**-125) -> torch.Tensor:
    """Integer symbols of positive scales, those below ``floor`` (zeros too) raised to it; 2**-125
    is the smallest scale a symbol stands for (``LOG_SCALE_MAX``). -> int32."""
    q = torch.round(torch.log2(scale.float().clamp_min(floor)) * LOG_SCALE_RES)
    return q.clamp(-LOG_SCALE_MAX, LOG_SCALE_MAX).to(torch.int32)


def scale_from_symbols(q: torch.Tensor) -> torch.Tensor:
    """The scale a log-scale symbol stands for (float32): 2**(q/16) as
    ``SCALE_TABLE[q mod 16] * 2**floor(q/16)``, the power of two built from its exponent bits
    (q within ``LOG_SCALE_MAX``; the GPU decoder computes the same)."""
    q = q.to(torch.int32)
    e = ((q >> 4).clamp(-126, 127) + 127) << 23
    return SCALE_TABLE.to(q.device)[q & (LOG_SCALE_RES - 1)] * e.view(torch.float32)


F16_MAX = float(torch.finfo(torch.float16).max)


def f16_scale(scale: torch.Tensor, absmax: torch.Tensor, fits: float) -> torch.Tensor:
    """``scale`` (float32, >= 0; values beyond float16's range saturate at its max) as float16,
    rounded to nearest, then one float16 step up where ``fits`` x the rounded scale is below
    ``absmax``: where the top symbol plus half a step no longer reaches the largest value, which
    would clip. Where ``fits`` leaves over 2**-11 of room (float16's rounding: int8's
    127.5 / 127, cachegen's (c + 0.5) / c below c = 1024) only float16 subnormals (scales below
    2**-14, coarse) ever need it, so normal scales stay the nearest float16; a scale that
    underflows to 0 for an ``absmax`` above 0 becomes 2**-24, the smallest float16 (it decoded
    the values as zeros)."""
    h = scale.clamp(max=F16_MAX).half()
    up = (h.float() * fits < absmax) & (h < F16_MAX)
    return torch.where(up, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize(x: torch.Tensor, step: torch.Tensor, limit: int = 32000) -> torch.Tensor:
    """Uniform quantization with a per-token step.

    x: [heads, tokens, ch], step: [tokens] (> 0) -> symbols [heads * ch, tokens] int32.
    """
    heads, tokens, ch = x.shape
    sym = torch.round(x.float() / step.reshape(1, tokens, 1)).clamp(-limit, limit)
    return sym.to(torch.int32).permute(0, 2, 1).reshape(heads * ch, tokens)


DEQUANTIZE_CHUNK_BYTES = 4 << 20
"""float32 products a CPU ``dequantize`` holds at once: it goes through the tokens in chunks of
about this size, each written straight into the output, so a layer's working memory beyond
its symbols and its output stays this (whole-layer products, their clamp and a permuted copy
had a decode hold ~4 times its output on top of it)."""


def dequantize(
    sym: torch.Tensor, step: torch.Tensor, heads: int, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize``: sym [heads * ch, tokens], step [tokens] -> [heads, tokens, ch],
    written into ``out`` where given (a view of that shape: the tokens of a layer after its
    sink). On the CPU token by token chunk (``DEQUANTIZE_CHUNK_BYTES``); bit for bit the same."""
    rows, tokens = sym.shape
    ch = rows // heads
    if out is None:
        out = torch.empty(heads, tokens, ch, dtype=dtype, device=sym.device)
    top = torch.finfo(dtype).max  # rounding up near the top of float16 must not give inf
    per = tokens if sym.device.type != "cpu" else max(1, DEQUANTIZE_CHUNK_BYTES // (4 * rows or 1))
    by_channel = sym.reshape(heads, ch, tokens)
    for t0 in range(0, tokens, per):
        t1 = min(tokens, t0 + per)
        x = by_channel[:, :, t0:t1].float()  # [heads, ch, chunk]
        x.mul_(step[t0:t1].reshape(1, 1, -1)).clamp_(-top, top)
        out[:, t0:t1].copy_(x.permute(0, 2, 1))
    return out


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def from_numpy(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device`` (``upload_many`` of one array)."""
    return upload_many({"a": a}, device)["a"]


_PACK_ALIGN = 16


def upload_many(arrays: dict[str, np.ndarray], device: torch.device,
                pack: bool | None = None) -> dict[str, torch.Tensor]:
    """Each array as a tensor on ``device``. On the CPU, the arrays themselves (copied only
    where not writable or not contiguous). Packed (the default on a GPU): all of them in ONE
    page-locked staging buffer sent with ONE non-blocking copy, each tensor a view of the
    device copy. A pageable copy per array synchronised the stream each time: a layer's decode
    made a dozen of them, so decodes ran one after another behind their own kernels."""
    if not (device.type != "cpu" if pack is None else pack):
        out = {}
        for name, a in arrays.items():
            if not a.flags.writeable or not a.flags.c_contiguous:
                a = np.array(a, order="C")
            out[name] = torch.from_numpy(a)
        return out
    spans, total = {}, 0
    for name, a in arrays.items():
        spans[name] = total
        total += -(-a.nbytes // _PACK_ALIGN) * _PACK_ALIGN
    staged = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = staged.numpy()
    for name, a in arrays.items():
        at = spans[name]
        flat[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    dev = staged.to(device, non_blocking=True) if device.type != "cpu" else staged
    return {name: dev[spans[name] : spans[name] + a.nbytes].view(
                torch.from_numpy(np.empty(0, a.dtype)).dtype).reshape(a.shape)
            for name, a in arrays.items()}
