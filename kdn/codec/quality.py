"""How much a lossy KV cache hurts the real model: ΔPPL, top-1 agreement and KL.

Lifecycle (shared by ``bench.codec`` and the quality tests):

1. ``prepare(model, tokenizer, ctx_tokens, eval_tokens)`` prefills ``ctx_tokens`` of English
   prose (``kdn.model.data``), keeps the cache in float16 (what kdn stores: the *original* KV), then
   runs the next ``eval_tokens`` tokens on top of that original cache and keeps the reference
   log-probabilities. The prefill is timed (``prefill_s``) for ``decode_vs_prefill``.
2. ``evaluate(ref, kv)`` runs the same ``eval_tokens`` on top of ``kv`` (e.g. a decoded cache)
   and compares with the reference:

    delta_ppl_pct = 100 * (ppl(kv) / ppl(original) - 1)     perplexity of the eval tokens
    top1          = mean over eval positions of [argmax p_kv == argmax p_orig]
    kl            = mean over eval positions of KL(p_orig || p_kv)   (nats)

The cache is never mutated: each evaluation builds a fresh transformers cache of float32 copies.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from kdn.cache import KVCache
from kdn.layout import DType, KVLayout
from kdn.model import hf


@dataclass(frozen=True)
class Quality:
    """Quality of a cache relative to the original, on the eval tokens."""

    ppl: float
    delta_ppl_pct: float
    top1: float
    kl: float


@dataclass
class Reference:
    """The original cache of a context and the model's behaviour on the tokens after it."""

    model: Any
    kv: KVCache
    """Original cache of the context, float16, [kv_heads, ctx_tokens, channels] per layer."""
    eval_ids: torch.Tensor
    """[eval_tokens + 1] ids: inputs are ``[:-1]``, next-token targets are ``[1:]``."""
    logp: torch.Tensor
    """[eval_tokens, vocab] reference log-probabilities (original cache)."""
    ppl: float
    prefill_s: float
    """Wall time of the model's prefill of the context (fastest of the runs)."""


def _as_f32(layout: KVLayout) -> KVLayout:
    return dataclasses.replace(layout, dtype=DType.FLOAT32)


@torch.inference_mode()
def _logp(model: Any, kv: KVCache, inputs: torch.Tensor) -> torch.Tensor:
    f32 = KVCache(_as_f32(kv.layout), [(k.float(), v.float()) for k, v in kv.layers])
    out = model(input_ids=inputs.reshape(1, -1), past_key_values=hf.to_transformers(f32),
                use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)  # [eval_tokens, vocab]


def _ppl(logp: torch.Tensor, targets: torch.Tensor) -> float:
    nll = -logp.gather(1, targets.reshape(-1, 1)).mean()
    return float(torch.exp(nll))


def prepare(
    model: Any,
    tokenizer: Any,
    ctx_tokens: int = 2048,
    eval_tokens: int = 512,
    *,
    offset_paragraphs: int = 0,
    prefill_runs: int = 1,
) -> Reference:
    """Prefill ``ctx_tokens`` of English prose and record the reference on ``eval_tokens``."""
    from kdn.model.data import english_token_ids

    ids = english_token_ids(ctx_tokens + eval_tokens + 1, tokenizer, offset_paragraphs)
    layout = KVLayout.from_config(model.config, dtype=torch.float16)
    ctx, eval_ids = ids[:ctx_tokens], ids[ctx_tokens:]
    times = []
    kv = None
    for _ in range(max(1, prefill_runs)):
        t0 = time.perf_counter()
        kv = hf.prefill(model, ctx, layout)[0]
        times.append(time.perf_counter() - t0)
    assert kv is not None
    logp = _logp(model, kv, eval_ids[:-1])
    return Reference(model, kv, eval_ids, logp, _ppl(logp, eval_ids[1:]),
                     min(times))


def evaluate(ref: Reference, kv: KVCache) -> Quality:
    """Quality of ``kv`` (same layout and tokens as ``ref.kv``) against the original cache."""
    logp = _logp(ref.model, kv, ref.eval_ids[:-1])
    ppl = _ppl(logp, ref.eval_ids[1:])
    top1 = (logp.argmax(-1) == ref.logp.argmax(-1)).float().mean()
    kl = (ref.logp.exp() * (ref.logp - logp)).sum(-1).mean()
    return Quality(ppl, 100.0 * (ppl / ref.ppl - 1.0), float(top1), float(kl))
