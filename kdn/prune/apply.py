"""The pruned model: per-layer K and V channel subsets in plain transformers, saved and reloaded.

Lifecycle
---------
1. ``PrunePlan`` says which channels of the original head dimension each layer keeps, for K and
   for V (the same channels in every KV head of a layer). ``plan_from_counts`` builds one from
   channel scores (``kdn.prune.importance``) and per-block removal counts (``kdn.prune.allocate``).
2. ``prune_model(model, plan)`` replaces every ``self_attn`` of a Llama-family model by a
   ``PrunedAttention`` holding sliced projections and records the plan in the config:

       config.kdn_pruned = {"k_kept": [[c, ...] per layer], "v_kept": [[c, ...] per layer]}

   which is exactly what ``KVLayout.from_config`` reads, so the pruned model's layout (and every
   cache it makes: K [kv_heads, tokens, len(k_kept)], V [kv_heads, tokens, len(v_kept)]) records
   the kept channels.
3. ``save_pruned(model, folder)`` is ``save_pretrained`` (safetensors + config.json with
   ``kdn_pruned``); ``load_pruned(folder)`` rebuilds the architecture from the config, prunes it
   to the recorded shapes and loads the weights. Plain ``from_pretrained`` can not load it (the
   projection shapes differ from the config's).

Projections per layer (h: query head, g: KV head, hd: original head_dim):

    q_proj rows  h*hd + c for c in k_kept      k_proj rows  g*hd + c for c in k_kept
    v_proj rows  g*hd + c for c in v_kept      o_proj cols  h*hd + c for c in v_kept

RoPE: K/Q channels are kept in rotary pairs (c, c + hd/2), so the sorted kept list is
``A ++ (A + hd/2)`` and ``rotate_half`` of the pruned vector pairs exactly the channels it paired
before. cos/sin are gathered at the kept indices, so every kept pair keeps its own frequency and
positions stay exact. The attention scale stays ``original_head_dim ** -0.5``: a pruned model whose
removed channels had zero weights gives the unpruned model's logits exactly.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdn.checks import whole
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import pruned_kept
from kdn.model.hf import attention_function, decoder_layers, load_config, model_from_config
from kdn.prune.importance import (
    PRUNED_KEY,
    ChannelScores,
    Geometry,
    attention_modules,
    check_unpruned,
)


@dataclass(frozen=True)
class PrunePlan:
    """Kept channels per layer, indices into the original head dimension (ascending)."""

    head_dim: int
    k_kept: tuple[tuple[int, ...], ...]
    v_kept: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.k_kept) != len(self.v_kept) or not self.k_kept:
            raise InvalidLayout("k_kept and v_kept must list the same, non-zero number of layers")
        half = self.head_dim // 2
        for i, (kk, vk) in enumerate(zip(self.k_kept, self.v_kept)):
            for name, kept in (("k_kept", kk), ("v_kept", vk)):
                if not kept or list(kept) != sorted(set(kept)) or kept[0] < 0 \
                        or kept[-1] >= self.head_dim:
                    raise InvalidLayout(f"layer {i}: {name} must be non-empty ascending "
                                        f"indices < {self.head_dim}")
            low = [c for c in kk if c < half]
            if list(kk) != low + [c + half for c in low]:
                raise InvalidLayout(f"layer {i}: k_kept must hold whole rotary pairs "
                                    f"(c, c + {half})")

    @property
    def num_layers(self) -> int:
        return len(self.k_kept)

    def kept_fraction(self) -> float:
        """Kept K+V channels over the original count (per KV head, all layers)."""
        kept = sum(len(k) + len(v) for k, v in zip(self.k_kept, self.v_kept))
        return kept / (2 * self.head_dim * self.num_layers)

    def to_config(self) -> dict[str, Any]:
        return {"k_kept": [list(k) for k in self.k_kept],
                "v_kept": [list(v) for v in self.v_kept],
                "head_dim_original": self.head_dim}

    @classmethod
    def from_config(cls, d: dict[str, Any], head_dim: int) -> PrunePlan:
        """The plan a config's ``kdn_pruned`` records (InvalidLayout naming a malformed
        field: a missing list, a channel that is not a whole number)."""
        kept = pruned_kept(d)
        original = whole("kdn_pruned head_dim_original", d.get("head_dim_original", head_dim),
                         2, error=InvalidLayout)
        return cls(original, tuple(k for k, _ in kept), tuple(v for _, v in kept))

    @classmethod
    def full(cls, layers: int, head_dim: int) -> PrunePlan:
        every = tuple(range(head_dim))
        return cls(head_dim, (every,) * layers, (every,) * layers)


def kept_from_scores(pair_scores: torch.Tensor, v_scores: torch.Tensor, k_pairs_removed: int,
                     v_removed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One block's kept K and V channels: drop the lowest-scoring pairs / channels.

    pair_scores: [head_dim/2]; v_scores: [head_dim]. Ties go to the lower index (kept first).
    A count must be a whole number that leaves at least one pair / channel (InvalidArgument).
    """
    half = pair_scores.shape[0]
    for name, count, units in (("k_pairs_removed", k_pairs_removed, half),
                               ("v_removed", v_removed, v_scores.shape[0])):
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) \
                or not 0 <= count < units:
            raise InvalidArgument(f"{name} must be a whole number in [0, {units}), got "
                                  f"{count!r}")
    order_k = sorted(range(half), key=lambda c: (float(pair_scores[c]), c))
    low = sorted(order_k[k_pairs_removed:])
    order_v = sorted(range(v_scores.shape[0]), key=lambda c: (float(v_scores[c]), c))
    return tuple(low + [c + half for c in low]), tuple(sorted(order_v[v_removed:]))


def plan_from_counts(scores: ChannelScores, k_pairs_removed: Sequence[int],
                     v_removed: Sequence[int]) -> PrunePlan:
    """Plan removing ``k_pairs_removed[i]`` rotary pairs and ``v_removed[i]`` V channels."""
    layers = int(scores.k.shape[0])
    if len(k_pairs_removed) != layers or len(v_removed) != layers:
        raise InvalidArgument(f"need one K and one V count per block ({layers}), got "
                              f"{len(k_pairs_removed)} and {len(v_removed)}")
    pairs = scores.pair_scores()
    kept = [kept_from_scores(pairs[i], scores.v[i], k_pairs_removed[i], v_removed[i])
            for i in range(scores.k.shape[0])]
    return PrunePlan(int(scores.k.shape[1]), tuple(k for k, _ in kept),
                     tuple(v for _, v in kept))


# -- the pruned attention ----------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PrunedAttention(nn.Module):
    """Llama-family self-attention whose K/Q and V/O channels are per-layer subsets.

    Same submodule names as the original (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), so
    state-dict keys and code that drives the projections (the blender) are unchanged.
    """

    k_kept: torch.Tensor
    v_kept: torch.Tensor
    config: Any

    def __init__(self, original: Any, k_kept: Sequence[int], v_kept: Sequence[int],
                 head_dim: int) -> None:
        super().__init__()
        if getattr(original, "q_norm", None) is not None:
            raise InvalidArgument("q/k norms over the head dimension (qwen3) can not be pruned "
                                  "channel-wise without changing the norm")
        self.config = original.config
        self.layer_idx = int(original.layer_idx)
        self.head_dim_original = head_dim
        self.scaling = float(original.scaling)
        self.attention_dropout = float(getattr(original, "attention_dropout", 0.0))
        self.is_causal = True
        self.sliding_window = getattr(original, "sliding_window", None)
        q_out = original.q_proj.out_features
        k_out = original.k_proj.out_features
        self.num_heads = int(q_out) // head_dim
        self.num_key_value_heads = int(k_out) // head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.k_channels, self.v_channels = len(k_kept), len(v_kept)
        self.register_buffer("k_kept", torch.tensor(list(k_kept), dtype=torch.long),
                             persistent=False)
        self.register_buffer("v_kept", torch.tensor(list(v_kept), dtype=torch.long),
                             persistent=False)
        q_rows = head_rows(self.num_heads, head_dim, k_kept)
        k_rows = head_rows(self.num_key_value_heads, head_dim, k_kept)
        v_rows = head_rows(self.num_key_value_heads, head_dim, v_kept)
        o_cols = head_rows(self.num_heads, head_dim, v_kept)
        self.q_proj = _slice_linear(original.q_proj, rows=q_rows)
        self.k_proj = _slice_linear(original.k_proj, rows=k_rows)
        self.v_proj = _slice_linear(original.v_proj, rows=v_rows)
        self.o_proj = _slice_linear(original.o_proj, cols=o_cols)

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        # transformers hands the layer's cache as ``cache`` since 5.2x, ``past_key_values``
        # before: either is the cache to extend
        past_key_values = cache if cache is not None else past_key_values
        batch, tokens = hidden_states.shape[:-1]
        # q: [batch, heads, tokens, k_ch]; k: [batch, kv_heads, tokens, k_ch]
        q = self.q_proj(hidden_states).view(batch, tokens, self.num_heads, self.k_channels)
        k = self.k_proj(hidden_states).view(batch, tokens, self.num_key_value_heads,
                                            self.k_channels)
        v = self.v_proj(hidden_states).view(batch, tokens, self.num_key_value_heads,
                                            self.v_channels)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if position_embeddings is None:
            raise InvalidArgument("PrunedAttention needs the model's position_embeddings")
        cos, sin = position_embeddings  # [batch, tokens, head_dim] -> [batch, 1, tokens, k_ch]
        cos = cos.index_select(-1, self.k_kept).unsqueeze(1)
        sin = sin.index_select(-1, self.k_kept).unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.sliding_window is not None:
            kwargs.setdefault("sliding_window", self.sliding_window)
        attend = attention_function(self.config._attn_implementation)
        out, weights = attend(self, q, k, v, attention_mask,
                              dropout=0.0 if not self.training else self.attention_dropout,
                              scaling=self.scaling, **kwargs)
        out = out.reshape(batch, tokens, -1).contiguous()  # [batch, tokens, heads * v_ch]
        return self.o_proj(out), weights

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, k_channels={self.k_channels}, "
                f"v_channels={self.v_channels}, head_dim_original={self.head_dim_original}")


def head_rows(heads: int, head_dim: int, kept: Sequence[int]) -> list[int]:
    """The rows (or columns) of a projection that ``heads`` heads keep: channels ``kept`` of
    each head of ``head_dim``."""
    return [h * head_dim + c for h in range(heads) for c in kept]


def _slice_linear(lin: nn.Linear, *, rows: list[int] | None = None,
                  cols: list[int] | None = None) -> nn.Linear:
    w = lin.weight.detach()
    b = lin.bias.detach() if lin.bias is not None else None
    if rows is not None:
        idx = torch.tensor(rows, dtype=torch.long, device=w.device)
        w = w.index_select(0, idx)
        b = b.index_select(0, idx) if b is not None else None
    if cols is not None:
        w = w.index_select(1, torch.tensor(cols, dtype=torch.long, device=w.device))
    out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if b is not None:
            out.bias.copy_(b)
    return out


def _geometry_for(model: Any, plan: PrunePlan) -> Geometry:
    """The geometry of ``model``, unpruned and of ``plan``'s layers and head_dim (else
    InvalidArgument)."""
    geo = Geometry.of(model)
    if plan.num_layers != geo.layers or plan.head_dim != geo.head_dim:
        raise InvalidArgument(f"plan for {plan.num_layers} layers x head_dim {plan.head_dim}; "
                              f"model has {geo.layers} x {geo.head_dim}")
    check_unpruned(model)
    return geo


def prune_model(model: Any, plan: PrunePlan) -> Any:
    """Prune ``model`` in place to ``plan`` (its attention must be unpruned); returns it."""
    geo = _geometry_for(model, plan)
    for layer, kk, vk in zip(decoder_layers(model), plan.k_kept, plan.v_kept):
        attn: Any = layer.self_attn
        layer.self_attn = PrunedAttention(attn, kk, vk, geo.head_dim)
    setattr(model.config, PRUNED_KEY, plan.to_config())
    return model


def pruned_plan(model: Any) -> PrunePlan | None:
    """The plan recorded in a pruned model's config (None for an unpruned model)."""
    d = getattr(model.config, PRUNED_KEY, None)
    return PrunePlan.from_config(d, Geometry.of(model).head_dim) if d is not None else None


@torch.no_grad()
def zero_pruned_channels(model: Any, plan: PrunePlan) -> None:
    """Zero, in an unpruned model, the q/k/v rows and o columns ``plan`` would remove.

    The result computes what the pruned model computes (same scale; zero K channels add nothing
    to q·k, zero V channels add nothing to the output): a reference for exactness tests.
    InvalidArgument for a pruned model or a plan of another layer count or head_dim.
    """
    geo = _geometry_for(model, plan)
    for attn, kk, vk in zip(attention_modules(model), plan.k_kept, plan.v_kept):
        for name, heads, kept, dim in (("q_proj", geo.heads, kk, 0),
                                       ("k_proj", geo.kv_heads, kk, 0),
                                       ("v_proj", geo.kv_heads, vk, 0),
                                       ("o_proj", geo.heads, vk, 1)):
            lin = getattr(attn, name)
            drop = torch.ones(heads * geo.head_dim, dtype=torch.bool)
            drop[head_rows(heads, geo.head_dim, kept)] = False
            if dim == 0:
                lin.weight[drop] = 0.0
                if lin.bias is not None:
                    lin.bias[drop] = 0.0
            else:
                lin.weight[:, drop] = 0.0


# -- save / load -------------------------------------------------------------------------------


def save_pruned(model: Any, folder: str | Path, tokenizer: Any = None) -> Path:
    """Save a pruned model (safetensors + config.json with ``kdn_pruned``) and its tokenizer."""
    if getattr(model.config, PRUNED_KEY, None) is None:
        raise InvalidArgument("model is not pruned (no config.kdn_pruned)")
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    if PRUNED_KEY not in saved:
        raise InvalidLayout("config.json was written without kdn_pruned")
    return folder


def load_pruned(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "eager") -> Any:
    """Rebuild a model saved by ``save_pruned``: architecture from config, pruned, weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InvalidLayout(f"{folder} holds no config.json: not a saved model folder")
    config = load_config(folder)
    plan_d = getattr(config, PRUNED_KEY, None)
    if plan_d is None:
        raise InvalidLayout(f"{folder} holds no kdn_pruned config extension")
    delattr(config, PRUNED_KEY)
    config._attn_implementation = attn_implementation
    model = model_from_config(config, dtype)
    prune_model(model, PrunePlan.from_config(plan_d, Geometry.of(model).head_dim))
    state: dict[str, torch.Tensor] = {}
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.is_file() else ["model.safetensors"]
    for name in files:
        if not (folder / name).is_file():
            raise InvalidLayout(f"{folder} lacks {name}: the pruned model's weights")
        state.update(load_file(str(folder / name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise InvalidLayout(f"pruned weights do not match: missing={missing} "
                            f"unexpected={unexpected}")
    if tied:
        model.tie_weights()
    model.to(dtype)
    model.name_or_path = str(folder)
    return model.eval()
