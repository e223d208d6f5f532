"""One decoder layer of a Llama-family transformers model, for a subset of query tokens.

The blender runs each layer for some rows (tokens) only, with attention over the whole
context. These functions drive the model's own modules: ``input_layernorm``,
``self_attn.{q,k,v,o}_proj`` (biases included, as in qwen2), ``self_attn.{q,k}_norm`` when
present (qwen3), ``post_attention_layernorm`` and ``mlp`` (dense or sparse-MoE). Nothing here
is a copy of a model family's code; shapes come from the layout (per-layer K/V channels of
pruned models) and the tensors. Without a batch dimension throughout:

    h: [rows, hidden]  q: [heads, rows, k_ch]  k: [kv_heads, rows, k_ch]  v: [kv_heads, rows, v_ch]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kdn.blend.rope import RopePlan, apply_rope
from kdn.errors import InvalidLayout


@dataclass(frozen=True)
class LayerShape:
    """Head counts and channel widths of one layer's attention."""

    heads: int
    kv_heads: int
    k_channels: int
    v_channels: int


def project_qkv(layer: Any, h: torch.Tensor, shape: LayerShape, cos: torch.Tensor,
                sin: torch.Tensor, plan: RopePlan
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed, projected and rotated q, k, v of rows ``h`` [rows, hidden].

    cos, sin: [rows, rotary_dim] for the rows' absolute positions.
    """
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    rows = x.shape[0]
    q = attn.q_proj(x)
    if q.shape[-1] != shape.heads * shape.k_channels:
        raise InvalidLayout(f"q_proj gives {q.shape[-1]} channels, the layout implies "
                            f"{shape.heads} heads x {shape.k_channels}")
    q = q.view(rows, shape.heads, shape.k_channels)  # [rows, heads, k_ch]
    k = attn.k_proj(x).view(rows, shape.kv_heads, shape.k_channels)
    v = attn.v_proj(x).view(rows, shape.kv_heads, shape.v_channels)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    return apply_rope(q, cos, sin, plan), apply_rope(k, cos, sin, plan), v


@dataclass(frozen=True)
class Causal:
    """Causal attention of query rows at sorted positions over the keys before them, planned
    once for a set of rows and used by every layer (``causal`` builds it).

    The rows are attended in parts of about equal size, each over the keys up to its last
    row's position only: with rows spread over the context that skips about half of the
    masked-out work, as a causal kernel does. Each part is a slice of the rows (no gather)
    with its boolean mask made on the rows' device in one vectorised step; no layer builds a
    mask, loops over rows or reads a position back to the host.
    """

    parts: tuple[tuple[int, int, int], ...]
    """(first row, stop row, keys): rows [first, stop) attend keys [0, keys)."""
    masks: tuple[torch.Tensor, ...]
    """Per part [1, 1, stop - first, keys] bool: True where a row may attend a key."""


def causal(q_positions: torch.Tensor, groups: int = 4, first: int | None = None) -> Causal:
    """The attention plan of rows at sorted ``q_positions`` [rows] (on the model's device).
    ``first``: the rows are the consecutive positions ``first, first + 1, ...``, known on the
    host, so nothing is read back (otherwise each part's last position is, once)."""
    rows = int(q_positions.numel())
    sections = max(1, min(groups, rows))
    size, extra = divmod(rows, sections)  # the first ``extra`` parts take one row more
    stops, at = [], 0
    for j in range(sections):
        at += size + (1 if j < extra else 0)
        stops.append(at)
    if first is not None:
        last = [first + s - 1 for s in stops]
    else:
        last = q_positions[torch.tensor([s - 1 for s in stops], dtype=torch.long,
                                        device=q_positions.device)].tolist()  # one read back
    ctx = torch.arange(int(last[-1]) + 1 if rows else 0, device=q_positions.device)
    parts, masks, begin = [], [], 0
    for stop, end in zip(stops, last):
        keys = int(end) + 1
        pos = q_positions[begin:stop]
        masks.append((pos[:, None] >= ctx[None, :keys])[None, None])  # [1, 1, part, keys]
        parts.append((begin, stop, keys))
        begin = stop
    return Causal(tuple(parts), tuple(masks))


def attend(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           rows: Causal | torch.Tensor | None, groups: int = 4) -> torch.Tensor:
    """Causal attention of the query rows over keys at 0..ctx-1.

    q: [heads, rows, k_ch]; k: [kv_heads, ctx, k_ch]; v: [kv_heads, ctx, v_ch]. ``rows``: the
    plan of where the rows sit (``causal``), or their sorted positions [rows] to plan now, or
    None when the rows are exactly 0..ctx-1 (plain causal prefill). Returns the ``o_proj``
    input, [rows, heads * v_ch]. Inputs are 4-D so SDPA takes its fused CPU/CUDA kernels
    (3-D inputs with a mask fall back to the unfused path).
    """
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)[None]  # [1, heads, ctx, k_ch]
    v = v.repeat_interleave(rep, dim=0)[None]
    scale = float(layer.self_attn.scaling)
    if rows is None:
        out = F.scaled_dot_product_attention(q[None], k, v, is_causal=True, scale=scale)[0]
        return out.transpose(0, 1).reshape(q.shape[1], -1)
    plan = causal(rows, groups) if isinstance(rows, torch.Tensor) else rows
    outs = [F.scaled_dot_product_attention(q[None, :, a:b], k[:, :, :keys], v[:, :, :keys],
                                           attn_mask=mask, scale=scale)[0]
            for (a, b, keys), mask in zip(plan.parts, plan.masks)]
    out = torch.cat(outs, dim=1)  # [heads, rows, v_ch]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def finish(layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual stream after the layer: attention output projection, then the MLP block, given
    a batch of one (a sparse-MoE block, Mixtral's or Qwen2-MoE's, reads [batch, rows, hidden])."""
    h = h + layer.self_attn.o_proj(attn_out)
    return h + layer.mlp(layer.post_attention_layernorm(h)[None])[0]
