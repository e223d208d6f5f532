"""KVPruner on the real SmolLM2-135M (GQA 9/3 heads, head_dim 64, RoPE theta 1e5): the pruned
model computes exactly what the unpruned model with the removed channels zeroed computes, its
layout shrinks by the ratio exactly, and its cache survives the codec and a kdn server."""

from __future__ import annotations

import copy

import pytest
import torch

from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec import decode, encode
from kdn.layout import DType
from kdn.model import hf
from kdn.model.hf import model_layout
from kdn.model.models import load_model
from kdn.prune import Geometry, PruneConfig, channel_scores, make_plan, prune_model
from kdn.prune.apply import zero_pruned_channels

pytestmark = pytest.mark.model


def test_smollm2_pruned_exact_and_through_server(client: Client) -> None:
    model, tok = load_model("smollm2-135m")
    geo = Geometry.of(model)
    plan, _ = make_plan(geo, channel_scores(model, "l2"), PruneConfig(0.2, "uniform", "l2"))
    pruned = prune_model(copy.deepcopy(model), plan)
    ref = copy.deepcopy(model)
    zero_pruned_channels(ref, plan)
    ids = tok("The Normans were the people who in the 10th and 11th centuries gave their name "
              "to Normandy, a region in France.", return_tensors="pt").input_ids
    with torch.inference_mode():
        a = ref(ids, use_cache=True)
        b = pruned(ids, use_cache=True)
        # fp32 over 30 layers: only summation-order rounding differs (max ~1e-3 on logits ~10)
        torch.testing.assert_close(b.logits, a.logits, atol=5e-3, rtol=1e-3)
        assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))
        gen = pruned.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 4
    full = model_layout(model, DType.FLOAT16)
    layout = model_layout(pruned, DType.FLOAT16)
    assert layout.bytes_per_token * 5 == full.bytes_per_token * 4  # exactly 20% fewer bytes
    assert len({lay.k_kept for lay in layout.layers}) > 1  # channels chosen per layer
    kv32 = hf.from_transformers(b.past_key_values, model_layout(pruned, DType.FLOAT32))
    kv = KVCache(layout, [(k.half(), v.half()) for k, v in kv32.layers])
    assert [k.shape[-1] for k, _ in kv.layers] == [len(c) for c in plan.k_kept]
    client.store(b"\x07" * 32, kv, mode="kdn", level="default")
    got = client.retrieve(b"\x07" * 32, layout=layout)
    assert got is not None and got.equal(decode(encode(kv, "kdn", "default")))
