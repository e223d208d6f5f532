"""``int8``: per-token int8, the simple baseline (8.25 bits per element at 64 channels).

For each (head, token) of K and of V: scale = max |x| over channels / 127 (float16), symbols =
round(x / scale) as int8. No entropy coding. Rows below 127 x 2**-14 (~7.8e-3) have float16
subnormal scales, raised one float16 step where the nearest would clip (``quant.f16_scale``):
their error is half a step of up to max |x| / 127 + 2**-24, never a clipped or zeroed row.

    body = sections(K scales f16 [heads, tokens] | K int8 [heads, tokens, k_ch]
                    | V scales | V int8)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kdn.codec.modes import LayerSpec, Mode, pack_sections, register, unpack_sections
from kdn.codec.quant import f16_scale, from_numpy, to_numpy
from kdn.errors import Corrupt


def _encode(x: torch.Tensor) -> list[bytes]:
    # x: [heads, tokens, ch]
    x = x.float()
    # [heads, tokens, 1]; values beyond 127 x float16's range (bf16, f32) saturate instead of
    # an infinite scale, which would decode the row as NaN
    absmax = x.abs().amax(dim=2, keepdim=True)
    scale = f16_scale(absmax / 127.0, absmax, 127.5)
    safe = torch.where(scale > 0, scale.float(), 1.0)  # an all-zero row codes as zeros
    q = torch.round(x / safe).clamp(-127, 127).to(torch.int8)
    return [to_numpy(scale).tobytes(), to_numpy(q).tobytes()]


def _decode(
    scales: memoryview, data: memoryview, shape: tuple[int, int, int], dtype: torch.dtype,
    device: torch.device, where: str,
) -> torch.Tensor:
    heads, tokens, ch = shape
    if len(scales) != 2 * heads * tokens or len(data) != heads * tokens * ch:
        raise Corrupt(f"{where}: int8 sections have the wrong sizes for {shape}")
    host = np.frombuffer(scales, dtype=np.float16)
    if not np.isfinite(host).all():  # never written (``_encode``; lossy modes refuse NaN and
        # inf input): the row would decode as NaN. Checked on the host: no GPU sync per layer
        raise Corrupt(f"{where}: a scale is not finite (inf or NaN)")
    s = from_numpy(host.reshape(heads, tokens, 1), device)
    q = from_numpy(np.frombuffer(data, dtype=np.int8).reshape(shape), device)
    top = torch.finfo(dtype).max
    x = q.float()  # [heads, tokens, ch]: the products in place, one float32 copy of K or V
    return x.mul_(s.float()).clamp_(-top, top).to(dtype)


class Int8(Mode):
    name = "int8"
    max_abs = 127.0 * float(torch.finfo(torch.float16).max)  # a float16 scale of 1/127 of it

    def params(self, level: str) -> dict[str, str]:
        return {"scale": "absmax per (head, token)", "bits": "8"}

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        return pack_sections(_encode(k) + _encode(v))

    def decode_work_bytes(self, elements: int, itemsize: int) -> int:
        return 4 * elements  # float32 products of K, then of V

    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"layer {spec.index}"
        ks, kq, vs, vq = unpack_sections(body, 4, where)
        dt = spec.dtype.torch
        return (
            _decode(ks, kq, spec.k_shape, dt, device, where),
            _decode(vs, vq, spec.v_shape, dt, device, where),
        )


    def decode_layers(self, bodies: list[memoryview], specs: list[LayerSpec], level: str,
                      device: torch.device, *, pinned: bool = False,
                      addresses: list[int] | None = None) -> Any:
        from kdn.codec.gpu_batch import decode_int8

        return decode_int8(bodies, specs, device, pinned=pinned, addresses=addresses)


register(Int8())
