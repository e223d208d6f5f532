"""Entropy-coded symbols as a torch tensor where they are needed: decoded on the GPU itself
when the target is CUDA and the blob is format 2 (``kdn.codec.gpu``, Triton, loaded only
then), else by the CPU decoders of ``kdn.codec.entropy`` and copied there."""

from __future__ import annotations

from typing import Any

import torch

from kdn.codec.entropy import decode_streams, parse_tables
from kdn.codec.quant import from_numpy

_GPU_DECODE: list[Any] = []


def symbols(buf: bytes | memoryview, streams: int, n: int, device: Any) -> torch.Tensor:
    """``decode_streams`` as an int32 tensor on ``device`` (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not _GPU_DECODE:
            try:
                from kdn.codec.gpu import decode_on
                _GPU_DECODE.append(decode_on)
            except ImportError:  # no triton: the CPU decodes
                _GPU_DECODE.append(None)
        gpu_decode = _GPU_DECODE[0]
        if gpu_decode is not None and parse_tables(buf, streams, n)[3] is not None:
            return gpu_decode(buf, streams, n, device)  # type: ignore[no-any-return]
    return from_numpy(decode_streams(buf, streams, n), device)
