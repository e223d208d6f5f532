"""The measurements of ``bench.prune`` on one model at a time: what each codec level stores per
token and the ΔPPL it adds on top of the model's fp16 KV (``compression``, and the level
``choose_codec`` keeps), answers through kdn (``kdn_answers``), a ``KDNEngine`` hit against its
prefill (``hit_vs_prefill``), and prefill/decode speed (``speed``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kdn.cache import KVCache
from kdn.codec import decode, encode
from kdn.codec.modes import get_mode
from kdn.layout import DType
from kdn.model import hf
from kdn.model.hf import model_layout
from kdn.prune.evaluate import QA, PerplexityCI, paired_change

QUALITY_BAR_PCT = 1.0
"""ΔPPL (%) a codec level may add on top of a model's fp16 KV to be the one stored."""


def _codecs() -> list[tuple[str, str, str]]:
    out = [("lossless", "lossless", ""), ("int8", "int8", ""), ("cachegen", "cachegen", "")]
    return out + [(f"kdn-{lv}", "kdn", lv) for lv in get_mode("kdn").levels]


def _mode_level(codec: str) -> tuple[str, str]:
    return ("kdn", codec.removeprefix("kdn-")) if codec.startswith("kdn-") else (codec, "")


@torch.inference_mode()
def _tail_nll(model: Any, kv: KVCache, ids: torch.Tensor) -> tuple[float, int, torch.Tensor]:
    """(summed NLL, tokens, argmax) of ``ids[1:]`` predicted from ``ids[:-1]`` run on ``kv``."""
    f32 = [(k.float(), v.float()) for k, v in kv.layers]
    layout = model_layout(model, DType.FLOAT32)
    cache = hf.to_transformers(KVCache(layout, f32))
    logits = model(input_ids=ids[None, :-1], past_key_values=cache, use_cache=True).logits[0]
    logits = logits.float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
    return float(nll), ids.numel() - 1, logits.argmax(-1)


def compression(model: Any, windows: torch.Tensor, ctx: int) -> list[dict[str, Any]]:
    """Per codec: stored bytes per token of each window's first ``ctx`` tokens (fp16 KV of
    ``model``'s layout) and the ΔPPL of the rest predicted from the decoded cache against the
    same from the fp16 cache, with a paired interval over windows."""
    layout = model_layout(model, DType.FLOAT16)
    kvs, ref_parts, tops = [], [], []
    for w in windows:
        kv, _ = hf.prefill(model, w[:ctx], layout)
        nll, n, top = _tail_nll(model, kv, w[ctx:])
        kvs.append(kv)
        ref_parts.append((nll, n))
        tops.append(top)
    base = PerplexityCI(0, 0, 0, 0, 0, tuple(ref_parts))
    out = []
    for name, mode, level in _codecs():
        size, parts, agree = 0, [], 0.0
        for w, kv, top in zip(windows, kvs, tops):
            blob = encode(kv, mode, level)
            back = decode(blob)
            assert isinstance(back, KVCache)
            size += len(blob)
            nll, n, argmax = _tail_nll(model, back, w[ctx:])
            parts.append((nll, n))
            agree += float((argmax == top).float().sum())
        change, lo, hi = paired_change(base, PerplexityCI(0, 0, 0, 0, 0, tuple(parts)),
                                       boot=1000)
        out.append({"codec": name, "bytes_per_token": size / (ctx * len(kvs)),
                    "delta_ppl_pct": change, "delta_ppl_ci": [lo, hi],
                    "top1": agree / sum(n for _, n in ref_parts)})
    return out


def choose_codec(codecs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [c for c in codecs if c["delta_ppl_pct"] <= QUALITY_BAR_PCT]
    return min(ok or codecs, key=lambda c: c["bytes_per_token"])


def kdn_answers(model: Any, tok: Any, qas: list[QA], codec: str, namespace: str,
                client: Any) -> tuple[list[str], dict[str, Any]]:
    """Answers through kdn: each context's KV stored (its layout in the key), then retrieved
    and blended with the question by ``RagEngine``."""
    from kdn.rag import RagConfig, RagEngine

    mode, level = _mode_level(codec)
    engine = RagEngine(model, tok, client, RagConfig(namespace=namespace, mode=mode,
                                                     level=level, max_new_tokens=24))
    contexts = sorted({c for c, _, _ in qas})
    stored = engine.ensure(contexts)
    out, hits, ttft = [], 0, []
    for context, question, _ in qas:
        a = engine.answer(question, [context])
        out.append(a.text)
        hits += a.timings.missing_chunks == 0
        ttft.append(a.timings.ttft_s)
    return out, {"contexts_stored": stored, "answers_from_stored_kv": hits,
                 "median_ttft_s": statistics.median(ttft), "key_layout": engine.layout.fingerprint}


def hit_vs_prefill(models: dict[str, Any], tok: Any, ids: list[int],
                   codecs: dict[str, str], reps: int) -> dict[str, Any]:
    """TTFT through KDNEngine of a full prefill (miss, stored back) against a hit of the same
    prompt (KV from a local kdn server's RAM tier), per model and codec; median of ``reps``
    rounds, the models interleaved."""
    from kdn.client import Client
    from kdn.delivery import encoding_name
    from kdn.engine import EngineConfig, KDNEngine
    from kdn.server import ServerConfig, ServerThread

    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    same: dict[tuple[str, str], bool] = {}
    with tempfile.TemporaryDirectory() as tmp, ServerThread(ServerConfig(
            port=0, data_dir=Path(tmp), disk_bytes=0)) as st, Client(st.address) as client:
        for rep in range(reps):
            for name, model in models.items():
                for codec in dict.fromkeys(("lossless", codecs[name])):
                    cfg = EngineConfig(namespace=f"ttft-{rep}", kv_dtype=DType.FLOAT16,
                                       encodings=(_mode_level(codec),))
                    eng = KDNEngine(model, tok, client, cfg)
                    miss = eng.generate(ids, max_new_tokens=1)
                    if miss.store_thread is not None:
                        miss.store_thread.join()
                    hit = eng.generate(ids, max_new_tokens=1,
                                       force=encoding_name(*_mode_level(codec)))
                    t = times.setdefault((name, codec), {"prefill": [], "hit": [], "reused": []})
                    t["prefill"].append(miss.timings.ttft_s)
                    t["hit"].append(hit.timings.ttft_s)
                    t["reused"].append(hit.timings.reused_tokens)
                    same[(name, codec)] = same.get((name, codec), True) and \
                        hit.token_ids[:1] == miss.token_ids[:1]
    out: dict[str, Any] = {"prompt_tokens": len(ids), "reps": reps}
    for (name, codec), t in times.items():
        p, h = statistics.median(t["prefill"]), statistics.median(t["hit"])
        out.setdefault(name, {})[codec] = {
            "prefill_ttft_s": p, "hit_ttft_s": h, "hit_vs_prefill": h / p,
            "reused_tokens": min(t["reused"]), "same_first_token": same[(name, codec)]}
    return out


@torch.inference_mode()
def speed(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy run on ``ids``."""
    t0 = time.perf_counter()
    out = model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return ids.numel() / (t1 - t0), new_tokens / (t2 - t1)
