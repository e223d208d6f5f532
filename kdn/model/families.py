"""Which transformers model families the blender computes exactly (no torch: ``kdn serve
--model`` checks a model folder's config.json against it at start, loading nothing).

``kdn.blend`` runs each decoder layer itself from the model's modules (``kdn.blend.layer``):
input norm, q/k/v projections (with their biases and q/k norms), RoPE in the rotate-half
convention from the model's rotary embedding, attention at the model's scaling, ``o_proj``,
post-attention norm and MLP, each added to the residual stream. A family whose layer computes
more or otherwise (Gemma 2's extra feed-forward norms and softcaps, Granite's multipliers,
GLM's interleaved RoPE, SmolLM3's layers without RoPE, Phi-3's fused projection, Cohere's
parallel block) would blend into wrong KV without a word, or crash in the middle. So the
blender, ``Continuation`` and the Blend RPC's model take only the families below
(``BLENDED``), each of which a ratio-1 blend matches a full prefill for
(``tests/test_blend_families.py``), and only with the settings named for it; anything else is
InvalidArgument (``check_blended``) before a layer runs.

``kv_problem`` says, from a config alone, why a model's cache would not hold K and V of every
token in every layer (what ``kdn.model.hf.check_cache`` refuses a model for, before its probe
forward: multi-head latent attention, KV-shared layers, linear-attention, SSM or convolution
layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kdn.errors import InvalidArgument

BLENDED: Mapping[str, Mapping[str, object]] = {
    "llama": {}, "mistral": {}, "ministral": {}, "qwen2": {}, "qwen3": {}, "gemma": {},
    "starcoder2": {}, "nemotron": {}, "seed_oss": {}, "arcee": {},
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {},
    "stablelm": {"use_parallel_residual": False, "qk_layernorm": False},
    "olmo": {"clip_qkv": None},
}
"""Each family (its text config's ``model_type``) the blender computes exactly, with the
config settings it needs as given (each family's default; another value changes the layer)."""


def _setting(config: Any, name: str, default: object) -> object:
    return config.get(name, default) if isinstance(config, dict) \
        else getattr(config, name, default)


def _text(config: Any) -> Any:
    """A multimodal config's text config (a config.json read as a dict alike); else itself."""
    text = _setting(config, "text_config", None)
    if isinstance(config, dict) and isinstance(text, dict):
        return text
    if not isinstance(config, dict) and hasattr(config, "get_text_config"):
        try:
            return config.get_text_config()
        except ValueError:  # several text configs (Musicgen's encoder and decoder)
            return config
    return config


def blend_problem(config: Any) -> str | None:
    """Why the blender can not compute the model of ``config`` exactly (a transformers config,
    or a config.json read as a dict; a multimodal one's text config counts), None when it can."""
    config = _text(config)
    kind = _setting(config, "model_type", None)
    needs = BLENDED.get(kind) if isinstance(kind, str) else None
    if needs is None:
        return (f"model_type {kind!r} is not a family kdn blends: the blender runs each decoder "
                f"layer itself and computes exactly only {', '.join(sorted(BLENDED))} (another "
                f"family's layer has its own norms, multipliers, RoPE or projections)")
    for name, want in needs.items():
        if (got := _setting(config, name, want)) != want:
            return (f"{kind} with {name}={got!r} is not blended: the blender computes {kind}'s "
                    f"layers exactly only with {name}={want!r}")
    return None


def check_blended(model: Any, what: str) -> None:
    """InvalidArgument naming ``model``'s class and ``what`` (the blend, a continuation) unless
    the blender computes it exactly (``blend_problem``)."""
    why = blend_problem(getattr(model, "config", None))
    if why is not None:
        raise InvalidArgument(f"{what} can not run {type(model).__name__}: {why}")


KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention",
                            "attention", "mlp", "moe", "dense", "sparse"})
"""Layer types (a config's ``layer_types``, ``layers_block_type`` or ``block_types``) whose
layers keep K and V of every token, or no state at all (a feed-forward-only layer)."""


def kv_problem(config: Any) -> str | None:
    """Why the cache of the model of ``config`` (as ``blend_problem`` takes it) would not hold
    K and V of every token per KV head in every layer, as a kdn layout describes; None where
    its config names no such reason (a probe forward tells the rest: ``hf.check_cache``). A
    config of per-layer settings (``per_layer_config``) is read layer by layer."""
    config = _text(config)
    if getattr(config, "is_heterogeneous", False):  # its global per-layer settings raise
        return next(filter(None, map(_layer_kv_problem, config.per_layer_config)), None)
    return _layer_kv_problem(config)


def _layer_kv_problem(config: Any) -> str | None:
    rank = _setting(config, "kv_lora_rank", None)
    if rank:
        return (f"it uses multi-head latent attention (kv_lora_rank={rank}): its cache holds a "
                f"compressed latent per token, not K and V per KV head")
    k_dim, v_dim = _setting(config, "head_dim", None), _setting(config, "v_head_dim", None)
    if k_dim and v_dim and v_dim != k_dim:
        return f"its V heads (v_head_dim={v_dim}) differ from its K heads (head_dim={k_dim})"
    shared = _setting(config, "num_kv_shared_layers", 0)
    if isinstance(shared, int) and shared > 0:
        return (f"its last {shared} layers reuse earlier layers' K and V "
                f"(num_kv_shared_layers={shared}) and keep none of their own")
    for name in ("layer_types", "layers_block_type", "block_types"):
        kinds = _setting(config, name, None)
        other = sorted({str(t) for t in kinds} - KV_LAYER_TYPES) \
            if isinstance(kinds, (list, tuple)) else []
        if other:
            return (f"it has layers of type {', '.join(other)} ({name}): linear-attention, "
                    f"state-space, convolution or compressed layers keep no K and V per token")
    if _setting(config, "mamba_d_state", None):
        return "it has Mamba (state-space) layers, which keep no K and V per token"
    return None
