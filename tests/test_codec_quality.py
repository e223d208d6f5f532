"""Quality regression of the lossy codecs on the real SmolLM2-135M (small size: 512 + 128 tokens).

The model prefills 512 tokens of English prose; the next 128 tokens are scored on the decoded
cache and compared with the original cache (``kdn.codec.quality``). Bounds sit well above the
values measured when they were set (see the comments) so that only a real regression fails.
"""

from __future__ import annotations

import pytest

from kdn.codec import decode, encode
from kdn.codec.quality import Quality, Reference, evaluate, prepare

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def ref() -> Reference:
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    return prepare(model, tok, ctx_tokens=512, eval_tokens=128)


def run(ref: Reference, mode: str, level: str = "") -> tuple[float, Quality]:
    blob = encode(ref.kv, mode, level)
    elements = sum(k.numel() + v.numel() for k, v in ref.kv.layers)
    return len(blob) * 8 / elements, evaluate(ref, decode(blob))


def test_original_cache_scores_zero(ref: Reference) -> None:
    bits, q = run(ref, "lossless")
    assert q.delta_ppl_pct == 0.0 and q.top1 == 1.0 and abs(q.kl) < 1e-6
    assert bits < 16


def test_kdn_default_quality_and_size(ref: Reference) -> None:
    bits, q = run(ref, "kdn", "default")
    assert bits < 2.67
    assert abs(q.delta_ppl_pct) < 2.0 and q.kl < 0.03 and q.top1 > 0.9


def test_kdn_beats_cachegen(ref: Reference) -> None:
    cg_bits, cg = run(ref, "cachegen")
    bits, q = run(ref, "kdn", "small")
    assert bits <= 0.85 * cg_bits
    assert q.kl <= cg.kl


def test_near_lossless_is_near_lossless(ref: Reference) -> None:
    _, q = run(ref, "kdn", "near-lossless")
    # measured at 512 + 128 tokens: dPPL -0.48% (128 tokens make PPL noisy), KL 0.0006, top-1 0.98
    assert abs(q.delta_ppl_pct) < 1.0 and q.kl < 0.003 and q.top1 > 0.96
