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


def blend_problem(config: Any) -> str | None:
    """Why the blender can not compute the model of ``config`` exactly (a transformers config,
    or a config.json read as a dict; a multimodal one's text config counts), None when it can."""
    text = _setting(config, "text_config", None)
    if isinstance(config, dict) and isinstance(text, dict):
        config = text
    elif not isinstance(config, dict) and hasattr(config, "get_text_config"):
        config = config.get_text_config()
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
