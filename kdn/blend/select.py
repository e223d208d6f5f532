"""Which cached tokens the blender recomputes.

At the selection layer the blender has, for every cached token, the K/V it was stored with
(computed with its chunk alone, re-positioned) and the K/V the model computes for it in the
whole context. Tokens whose K/V moved most are the ones cross-chunk attention changed most
(CacheBlend's "high KV deviation" tokens); recomputing them through the remaining layers
recovers most of the quality of a full prefill.

``deviation`` scores tokens; ``select_tokens`` turns scores into a sorted index set under a
budget (global, or split between chunks in proportion to their size), plus tokens that are
always recomputed (each chunk's first tokens, when asked).
"""

from __future__ import annotations

import torch


def deviation(k_fresh: torch.Tensor, k_cached: torch.Tensor, v_fresh: torch.Tensor,
              v_cached: torch.Tensor) -> torch.Tensor:
    """[tokens] squared K/V distance, each side normalised by its mean squared norm.

    k_*: [kv_heads, tokens, k_ch]; v_*: [kv_heads, tokens, v_ch].
    """
    dk = (k_fresh - k_cached).float().pow(2).sum(dim=(0, 2))  # [tokens]
    dv = (v_fresh - v_cached).float().pow(2).sum(dim=(0, 2))
    nk = k_cached.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    nv = v_cached.float().pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    return dk / nk + dv / nv


def budget(ratio: float, tokens: int) -> int:
    """Number of tokens ``ratio`` of ``tokens`` recomputes (rounded, within [0, tokens])."""
    return max(0, min(tokens, round(ratio * tokens)))


def select_tokens(scores: torch.Tensor, spans: list[tuple[int, int]], ratio: float, *,
                  per_chunk: bool = False, head_tokens: int = 0,
                  skip: int | None = None) -> torch.Tensor:
    """Sorted indices (into ``scores``) of the cached tokens to recompute.

    scores: [cached] deviation of every cached token; spans: each chunk's [start, stop) in that
    index space. The budget is ``ratio`` of all cached tokens; ``head_tokens`` of each chunk
    are always taken and count against it; ``per_chunk`` splits the budget between chunks in
    proportion to their size instead of taking the global top. ``skip``: a token recomputed
    anyway (the prompt's last, when a chunk ends the prompt), never taken, so the whole budget
    goes to others.
    """
    n = int(scores.numel())
    forced = torch.zeros(n, dtype=torch.bool, device=scores.device)
    for start, stop in spans:
        forced[start : min(stop, start + head_tokens)] = True
    heads = [min(head_tokens, stop - start) for start, stop in spans]  # forced, per chunk
    # what each chunk has left to rank: its tokens, less its forced ones and the skipped one
    left = [stop - start - forced_here for (start, stop), forced_here in zip(spans, heads)]
    if skip is not None:
        forced[skip] = False
        for j, (start, stop) in enumerate(spans):
            if start <= skip < stop:
                heads[j] -= int(skip < start + head_tokens)
                left[j] = stop - start - heads[j] - 1
    picked = forced.clone()
    ranked = scores.float().masked_fill(forced, float("-inf"))
    if skip is not None:
        ranked[skip] = float("-inf")
    if per_chunk:
        for (start, stop), forced_here, room in zip(spans, heads, left):
            extra = min(budget(ratio, stop - start) - forced_here, room)
            if extra > 0:
                top = torch.topk(ranked[start:stop], extra).indices + start
                picked[top] = True
    else:
        extra = min(budget(ratio, n) - sum(heads), sum(left))
        if extra > 0:
            picked[torch.topk(ranked, extra).indices] = True
    return picked.nonzero().flatten()
