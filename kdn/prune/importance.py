"""Phase B of KVPruner: how important each K and V channel of each block is.

A "channel" is one index ``c`` of the original head dimension, shared by every head of the block
(kdn layouts keep the same channels in every KV head of a layer). The weights that touch it:

    K channel c: rows h*head_dim + c of q_proj (every query head h) and of k_proj (every KV head)
    V channel c: rows h*head_dim + c of v_proj (every KV head) and columns h*head_dim + c of
                 o_proj (every query head; with GQA a query head reads its group's KV head)

With grouped-query attention a K channel of a KV head therefore goes together with the same
channel of the query heads that share it, and a V channel with the matching input columns of O.

Per matrix M the score of channel c is the sum over its weights of

    l1: |w|        l2: w^2 (then sqrt: the L2 norm of the channel's weights)
    taylor: |dL/dw * w|   (first order Taylor, L = next-token loss on calibration text)

Each matrix's per-channel scores are divided by their mean over the block's channels before Q+K
(or V+O) are averaged, so q_proj (more heads) does not drown k_proj. RoPE pairs channel c with
c + head_dim/2 (``rotate_half``); ``pair_scores`` sums a pair's two channels, because K/Q
channels are kept or removed in pairs.

    scores = channel_scores(model, Importance.TAYLOR, calib_ids)   # scores.k: [layers, head_dim]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import InvalidArgument
from kdn.model.hf import decoder_layers

PRUNED_KEY = "kdn_pruned"
"""The config attribute a pruned model records its kept channels in (``kdn.prune.apply``)."""


def check_unpruned(model: Any) -> None:
    """InvalidArgument when ``model`` is already pruned: scores, sensitivities and plans are of
    the original head dimension, which a pruned model's projections no longer have."""
    if getattr(model.config, PRUNED_KEY, None) is not None:
        raise InvalidArgument("model is already pruned; prune the original model")


class Importance(enum.Enum):
    """Channel importance metrics (KVPruner Phase B)."""

    L1 = "l1"
    L2 = "l2"
    TAYLOR = "taylor"


@dataclass(frozen=True)
class Geometry:
    """Attention shape of a Llama-family model (before pruning)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> Geometry:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if head_dim % 2:
            raise InvalidArgument(f"head_dim {head_dim} is odd: rotary pairs need an even one")
        return cls(int(cfg.num_hidden_layers), heads,
                   int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim)


@dataclass(frozen=True)
class ChannelScores:
    """Importance of every channel of every block; larger = more important."""

    importance: Importance
    k: torch.Tensor
    """[layers, head_dim] float64: K channels (q_proj and k_proj rows)."""
    v: torch.Tensor
    """[layers, head_dim] float64: V channels (v_proj rows and o_proj columns)."""

    def pair_scores(self) -> torch.Tensor:
        """[layers, head_dim/2]: score of rotary pair (c, c + head_dim/2) for c < head_dim/2."""
        half = self.k.shape[1] // 2
        return self.k[:, :half] + self.k[:, half:]


def calibration_ids(model: Any, calib_ids: Any) -> torch.Tensor:
    """``calib_ids`` ([tokens] or [batch, tokens]) as [batch, tokens] on the model's device;
    InvalidArgument unless it is an integer tensor of ids in the model's vocabulary with at
    least 2 tokens a row (one token predicts none: its loss would be the mean of nothing)."""
    if not torch.is_tensor(calib_ids) or calib_ids.dtype == torch.bool \
            or calib_ids.dtype.is_floating_point or calib_ids.dtype.is_complex:
        what = calib_ids.dtype if torch.is_tensor(calib_ids) else type(calib_ids).__name__
        raise InvalidArgument(f"calibration ids must be an integer tensor of token ids, got "
                              f"{what}")
    if calib_ids.dim() not in (1, 2) or calib_ids.shape[-1] < 2 or calib_ids.numel() == 0:
        raise InvalidArgument(f"calibration ids must be [tokens] or [batch, tokens] with at "
                              f"least 2 tokens a row, got {tuple(calib_ids.shape)}")
    vocab = int(model.config.get_text_config().vocab_size
                if hasattr(model.config, "get_text_config") else model.config.vocab_size)
    low, high = int(calib_ids.min()), int(calib_ids.max())
    if low < 0 or high >= vocab:
        raise InvalidArgument(f"calibration ids must lie in [0, {vocab}) (the model's "
                              f"vocabulary), got [{low}, {high}]")
    return calib_ids.reshape(-1, calib_ids.shape[-1]).to(model.device)


def attention_modules(model: Any) -> list[Any]:
    """``self_attn`` of every decoder block, in order."""
    return [layer.self_attn for layer in decoder_layers(model)]


def _per_channel(w: torch.Tensor, heads: int, head_dim: int, *, rows: bool,
                 importance: Importance) -> torch.Tensor:
    """[head_dim] raw score of matrix ``w`` (already |w|, w^2 or |g*w|, elementwise)."""
    per = w.sum(dim=1) if rows else w.sum(dim=0)  # [heads * head_dim]
    out = per.view(heads, head_dim).sum(dim=0)
    return out.sqrt() if importance is Importance.L2 else out


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.mean().clamp_min(1e-30)


def channel_scores(model: Any, importance: Importance | str,
                   calib_ids: torch.Tensor | None = None) -> ChannelScores:
    """Per-block, per-channel importance of ``model``'s K and V channels.

    ``calib_ids`` ([tokens] or [batch, tokens]) is needed for Taylor only: one forward and one
    backward pass of the next-token loss; the model's parameters are left unchanged.
    """
    importance = Importance(importance)
    check_unpruned(model)
    if calib_ids is not None:
        calib_ids = calibration_ids(model, calib_ids)
    geo = Geometry.of(model)
    attns = attention_modules(model)
    grads = _taylor_grads(model, attns, calib_ids) if importance is Importance.TAYLOR else None
    k_rows, v_rows = [], []
    for i, attn in enumerate(attns):
        mats: dict[str, torch.Tensor] = {}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = getattr(attn, name).weight.detach().double()
            if importance is Importance.L1:
                mats[name] = w.abs()
            elif importance is Importance.L2:
                mats[name] = w.square()
            else:
                assert grads is not None
                mats[name] = (grads[i][name].double() * w).abs()
        hd = geo.head_dim
        q = _per_channel(mats["q_proj"], geo.heads, hd, rows=True, importance=importance)
        k = _per_channel(mats["k_proj"], geo.kv_heads, hd, rows=True, importance=importance)
        v = _per_channel(mats["v_proj"], geo.kv_heads, hd, rows=True, importance=importance)
        o = _per_channel(mats["o_proj"], geo.heads, hd, rows=False, importance=importance)
        k_rows.append((_normalized(q) + _normalized(k)) / 2)
        v_rows.append((_normalized(v) + _normalized(o)) / 2)
    return ChannelScores(importance, torch.stack(k_rows), torch.stack(v_rows))


def _taylor_grads(model: Any, attns: list[Any], calib_ids: torch.Tensor | None
                  ) -> list[dict[str, torch.Tensor]]:
    """dL/dW of every attention projection on the calibration text (one backward pass)."""
    if calib_ids is None:
        raise InvalidArgument("Taylor importance needs calibration ids")
    ids = calibration_ids(model, calib_ids)
    params = {id(p): p.requires_grad for p in model.parameters()}
    watched = [getattr(a, n).weight for a in attns for n in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in watched:
            w.requires_grad_(True)
            w.grad = None
        with torch.enable_grad():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        out = []
        for a in attns:
            out.append({n: getattr(a, n).weight.grad.detach().clone()
                        for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        return out
    finally:
        for w in watched:
            w.grad = None
        for p in model.parameters():
            p.requires_grad_(params[id(p)])
