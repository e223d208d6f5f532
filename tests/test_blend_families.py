"""The families the blender takes (``kdn.model.families.BLENDED``): for each, on a tiny random
model, a ratio-1 blend is a full prefill; a family (or a setting) whose layer the blender would
compute otherwise is refused, naming it, before any layer runs, by ``blend``,
``Continuation``, the Blend RPC's ``ModelBlender`` and ``kdn serve --model``'s start check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.decode import Continuation
from kdn.blend.host import ModelBlender
from kdn.errors import InvalidArgument
from kdn.model import hf
from kdn.model.families import BLENDED
from tests.test_blend import ids

SETTINGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}
"""Config settings a family's tiny model needs beyond the common ones."""


def tiny(family: str, **config: Any) -> Any:
    """A tiny random model of ``family`` (4 layers: SmolLM3 drops RoPE in every 4th), its
    1-D weights (norms, biases) random too, so a norm or bias left out shows."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg = tf.AutoConfig.for_model(family, **(common | SETTINGS.get(family, {}) | config))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if float(p.abs().mean()) > 0.5 else 0.0, 0.3)
    return model


@pytest.mark.parametrize("family", sorted(BLENDED))
def test_a_blended_familys_ratio_one_blend_is_a_full_prefill(family: str) -> None:
    """Sparse-MoE families included: their block reads [batch, rows, hidden], and the
    blender's 2-D rows crashed it (ValueError: not enough values to unpack)."""
    model = tiny(family)
    layout = hf.model_layout(model)
    a, b, q = ids(7, 1), ids(11, 2), ids(5, 3)
    kb = hf.prefill(model, b, layout)[0]
    r = blend(model, [Piece(a), Piece(b, kb), Piece(q)], BlendConfig(ratio=1.0))
    with torch.no_grad():
        out = model(torch.tensor([a + b + q]), use_cache=True)
    full = hf.from_transformers(out.past_key_values, layout)
    for (k, v), (fk, fv) in zip(r.kv.layers, full.layers):
        torch.testing.assert_close(k, fk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, fv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r.logits, out.logits[0, -1], atol=1e-4, rtol=1e-4)


REFUSED = [("gemma2", {}), ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5)),
           ("glm", {}), ("smollm3", {}), ("phi3", {}), ("cohere", {}), ("olmo2", {}),
           ("stablelm", dict(qk_layernorm=True)), ("olmo", dict(clip_qkv=0.5))]


@pytest.mark.parametrize("family, config", REFUSED, ids=[f for f, _ in REFUSED])
def test_a_family_the_blender_would_compute_otherwise_is_refused_naming_it(
        family: str, config: dict[str, Any], tmp_path: Path) -> None:
    """Gemma 2 (extra norms, softcaps), Granite (multipliers), GLM (interleaved RoPE), SmolLM3
    (layers without RoPE) blended into wrong KV without a word; Phi-3 (fused qkv_proj),
    Cohere and OLMo-2 crashed with AttributeError. Now InvalidArgument names the class and
    what the blender computes, before anything runs."""
    model = tiny(family, **config)
    ran: list[str] = []
    model.get_input_embeddings().register_forward_hook(lambda *_: ran.append("embed"))
    setting = next(iter(config), "") if family in BLENDED else ""
    match = f"{type(model).__name__}: " + (f"{family} with {setting}=" if setting
                                          else f"model_type '{family}' is not a family")
    a, q = ids(6, 1), ids(4, 2)
    with pytest.raises(InvalidArgument, match=match):
        blend(model, [Piece(a), Piece(q)], BlendConfig(ratio=0.0))
    kv = hf.prefill(model, a, hf.model_layout(model))[0]
    ran.clear()
    with pytest.raises(InvalidArgument, match=match):
        blend(model, [Piece(a, kv), Piece(q)], BlendConfig(ratio=1.0))
    with pytest.raises(InvalidArgument, match=match):
        Continuation(model, kv, room=4)
    with pytest.raises(InvalidArgument, match=match):
        ModelBlender(model, None)
    assert ran == []
    from kdn.cli.args import model_problem

    model.config.save_pretrained(tmp_path)  # kdn serve --model refuses the folder at start
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    assert f"can not be blended: {match.split(': ', 1)[1]}" in str(model_problem(str(tmp_path)))


def test_a_blended_familys_folder_passes_the_start_check(tmp_path: Path) -> None:
    from kdn.cli.args import model_problem

    tiny("qwen2").config.save_pretrained(tmp_path)
    assert model_problem(str(tmp_path)) is None
