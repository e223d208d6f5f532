"""The blender on the real SmolLM2-135M (small prompt): exact at ratio 1, re-positioning exact,
and selective recompute recovers most of what naive concatenation loses."""

from __future__ import annotations

import pytest
import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.layout import DType
from kdn.model import hf
from kdn.model.data import load_squad_dev
from kdn.model.hf import model_layout

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol() -> tuple:
    from kdn.model.models import load_model

    return load_model("smollm2-135m")


@torch.inference_mode()
def test_smollm2_blend_quality(smol: tuple) -> None:
    model, tok = smol
    layout = model_layout(model, DType.FLOAT32)
    paras = load_squad_dev()[0].paragraphs
    head = tok("<|im_start|>user\nRead the documents.\n\n", add_special_tokens=False)["input_ids"]
    chunks = [tok(p.context + "\n\n", add_special_tokens=False)["input_ids"][:96]
              for p in paras[:3]]
    tail = tok(f"Question: {paras[1].qas[0].question}<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    kvs = [hf.from_transformers(model(torch.tensor([c]), use_cache=True).past_key_values,
                                     layout) for c in chunks]
    pieces = [Piece(head)] + [Piece(c, kv) for c, kv in zip(chunks, kvs)] + [Piece(tail)]
    ids = [t for p in pieces for t in p.ids]
    out = model(torch.tensor([ids]), use_cache=True)
    full = hf.from_transformers(out.past_key_values, layout)
    ref = torch.log_softmax(out.logits[0, -1], -1)

    exact = blend(model, pieces, BlendConfig(ratio=1.0))
    torch.testing.assert_close(exact.logits, out.logits[0, -1], atol=2e-3, rtol=1e-3)
    for (k, v), (kf, vf) in zip(exact.kv.layers, full.layers):
        torch.testing.assert_close(k, kf, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(v, vf, atol=2e-3, rtol=1e-3)

    def kl(ratio: float) -> float:
        lp = torch.log_softmax(blend(model, pieces, BlendConfig(ratio=ratio)).logits, -1)
        return float((ref.exp() * (ref - lp)).sum())

    naive, blended = kl(0.0), kl(0.3)
    assert blended < naive / 2, (naive, blended)
