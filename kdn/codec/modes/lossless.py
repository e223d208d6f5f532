"""``lossless``: byte-plane shuffled fp16/bf16 bytes, zstd-compressed; bit-exact round trip.

Splitting each element into byte planes groups the sign/exponent bytes, which repeat far more
than mantissa bytes, so zstd finds them. Body: zstd(plane_0 | plane_1 [| ...]) over K then V.
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard

from kdn.codec.modes import LayerSpec, Mode, register, tensor_bytes, tensor_from_bytes
from kdn.codec.zstd import decompress
from kdn.errors import Corrupt

ZSTD_LEVEL = 3


def shuffle(raw: bytes, itemsize: int) -> bytes:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T
    return np.ascontiguousarray(planes).tobytes()


def unshuffle(buf: bytes, itemsize: int) -> bytes:
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(itemsize, -1).T
    return np.ascontiguousarray(planes).tobytes()


class Lossless(Mode):
    name = "lossless"
    lossless = True

    def params(self, level: str) -> dict[str, str]:
        return {"zstd_level": str(ZSTD_LEVEL), "shuffle": "bytes"}

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        raw = shuffle(tensor_bytes(k) + tensor_bytes(v), spec.dtype.itemsize)
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)

    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nk = spec.layout.k_numel(spec.tokens) * spec.dtype.itemsize
        nv = spec.layout.v_numel(spec.tokens) * spec.dtype.itemsize
        raw = decompress(body, nk + nv, f"layer {spec.index} body")
        if len(raw) != nk + nv:
            raise Corrupt(f"layer {spec.index}: decoded {len(raw)} bytes, expected {nk + nv}")
        raw = unshuffle(raw, spec.dtype.itemsize)
        mv = memoryview(raw)
        dt = spec.dtype.torch
        return (
            tensor_from_bytes(mv[:nk], dt, spec.k_shape, device),
            tensor_from_bytes(mv[nk:], dt, spec.v_shape, device),
        )


register(Lossless())
