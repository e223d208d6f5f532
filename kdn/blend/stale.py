"""Stale-token correction: shift the stored K/V of a chunk's tokens that are not recomputed.

After selection the blender recomputes some of each chunk's tokens; the rest keep the K/V
their chunk gave them alone. With ``BlendConfig.correct_k``/``correct_v`` set, each layer
moves every such stale token of a chunk by a fraction of the mean change recomputation made
to the chunk's recomputed tokens (its first token, the sink of a chunk computed alone, left
out of the mean). ``stale_plan`` finds, once per blend, each chunk's recomputed rows and stale
tokens (two reads back to the host for all chunks together); ``correct_stale`` then applies
the shift in each layer from those indices, reading nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdn.blend.rope import RopePlan, apply_rope


@dataclass(frozen=True)
class ChunkStale:
    """One chunk's tokens, for one set of recomputed rows."""

    fresh: torch.Tensor
    """[f] positions of the chunk's recomputed tokens after its first (f >= 2)."""
    rows: torch.Tensor
    """[f] where those tokens are among the recomputed rows (the fresh K/V's index)."""
    stale: torch.Tensor
    """[s] positions of the chunk's tokens that keep their stored K/V (s >= 1)."""


def stale_plan(rows: torch.Tensor, chunks: list[tuple[int, int]], n: int
               ) -> list[ChunkStale]:
    """Per chunk at positions [a, b) of an ``n``-token prompt, with recomputed ``rows``
    [rows] (sorted positions): its ``ChunkStale``, for the chunks that have at least two
    recomputed tokens after their first and at least one stale token (others are not
    corrected)."""
    dev = rows.device
    fresh_mask = torch.zeros(n, dtype=torch.bool, device=dev)
    fresh_mask[rows] = True
    stale_all = (~fresh_mask).nonzero().flatten()  # [stale] sorted positions
    edges = torch.tensor([e for a, b in chunks for e in (a, a + 1, b)], dtype=torch.long,
                         device=dev)  # [3 * chunks]
    found = torch.stack((torch.searchsorted(rows, edges), torch.searchsorted(stale_all, edges)))
    before_rows, before_stale = found.tolist()  # rows / stale tokens before each edge
    out = []
    for j in range(len(chunks)):
        lo, hi = before_rows[3 * j + 1], before_rows[3 * j + 2]  # rows in [a + 1, b)
        s_lo, s_hi = before_stale[3 * j], before_stale[3 * j + 2]  # stale tokens in [a, b)
        if hi - lo >= 2 and s_hi > s_lo:
            out.append(ChunkStale(rows[lo:hi], torch.arange(lo, hi, device=dev),
                                  stale_all[s_lo:s_hi]))
    return out


def correct_stale(chunks: list[ChunkStale], k_all: torch.Tensor, v_all: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rope: RopePlan, *, correct_k: float, correct_v: float) -> None:
    """Shift the stored K/V [kv_heads, n, ch] of each chunk's stale tokens by ``correct_k``/
    ``correct_v`` (``BlendConfig``'s fields) of the mean change the fresh ``k``/``v``
    [kv_heads, rows, ch] make to its recomputed tokens. Must run before the fresh K/V
    overwrite ``k_all``/``v_all``; cos, sin: [n, rotary_dim] of the prompt's positions."""
    for c in chunks:
        if correct_v:
            dv = (v[:, c.rows] - v_all[:, c.fresh]).mean(dim=1, keepdim=True)  # [kv_heads, 1, v_ch]
            v_all[:, c.stale] += correct_v * dv
        if correct_k:  # undo each fresh token's rotation, average, rotate to each stale one
            dk = apply_rope(k[:, c.rows] - k_all[:, c.fresh], cos[c.fresh], -sin[c.fresh], rope)
            shift = dk.mean(dim=1, keepdim=True).expand(-1, c.stale.numel(), -1)
            k_all[:, c.stale] += correct_k * apply_rope(shift, cos[c.stale], sin[c.stale], rope)
