"""``raw``: the tensors' own bytes, K then V. The reference mode and the cheapest to serve."""

from __future__ import annotations

import torch

from kdn.codec.modes import (
    LayerSpec,
    Mode,
    register,
    tensor_borrowed,
    tensor_from_bytes,
    tensor_view,
)
from kdn.errors import Corrupt


class Raw(Mode):
    name = "raw"
    lossless = True
    borrows = True

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        return b"".join((tensor_view(k), tensor_view(v)))  # one copy

    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dt = spec.dtype.torch
        nk = spec.layout.k_numel(spec.tokens) * spec.dtype.itemsize
        nv = spec.layout.v_numel(spec.tokens) * spec.dtype.itemsize
        if len(body) != nk + nv:
            raise Corrupt(f"layer {spec.index}: raw body has {len(body)} bytes, expected {nk + nv}")
        return (
            tensor_from_bytes(body[:nk], dt, spec.k_shape, device),
            tensor_from_bytes(body[nk:], dt, spec.v_shape, device),
        )

    def borrow_layer(self, body: memoryview, spec: LayerSpec, *, private: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        nk = spec.layout.k_numel(spec.tokens) * spec.dtype.itemsize
        k = tensor_borrowed(body[:nk], spec.dtype.torch, spec.k_shape, private=private)
        v = tensor_borrowed(body[nk:], spec.dtype.torch, spec.v_shape, private=private)
        return None if k is None or v is None else (k, v)


register(Raw())
