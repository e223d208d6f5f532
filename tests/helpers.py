"""Shared builders for tests: layouts (uniform, GQA-like, pruned), random caches, polling."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kdn.cache import KVCache
from kdn.layout import DType, KVLayout, LayerLayout


def uniform_layout(layers: int = 4, heads: int = 2, dim: int = 16,
                   dtype: DType = DType.FLOAT16, model: str = "test-model") -> KVLayout:
    return KVLayout(model, tuple(LayerLayout(heads, dim, dim) for _ in range(layers)),
                    dtype=dtype, head_dim=dim)


def pruned_layout(dtype: DType = DType.FLOAT16) -> KVLayout:
    """Every layer keeps its own K and V channel subsets (KVPruner-style)."""
    dims = [(16, 16), (12, 16), (8, 10), (16, 4), (6, 12)]
    layers = []
    for i, (kc, vc) in enumerate(dims):
        k_kept = tuple(sorted((c * 2 + i) % 16 for c in range(kc))) if kc < 16 else None
        v_kept = tuple(range(16 - vc, 16)) if vc < 16 else None
        if k_kept is not None and len(set(k_kept)) != kc:
            k_kept = tuple(range(kc))
        layers.append(LayerLayout(2, kc, vc, k_kept, v_kept))
    return KVLayout("pruned-model", tuple(layers), dtype=dtype, head_dim=16)


def random_kv(layout: KVLayout, tokens: int = 32, seed: int = 0, start: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    dt = layout.dtype.torch
    layers = [
        (torch.randn(lay.kv_heads, tokens, lay.k_channels, generator=g).to(dt),
         torch.randn(lay.kv_heads, tokens, lay.v_channels, generator=g).to(dt))
        for lay in layout.layers
    ]
    return KVCache(layout, layers, start)


def eventually(cond: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; its last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()
