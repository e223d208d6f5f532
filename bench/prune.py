"""KVPruner benchmark on SmolLM2-135M: allocation x importance at 20% / 50% KV pruning, pruning x
compression, and prefill/decode speed, against the unpruned model measured in the same run.

    python -m bench.prune [--quick] [--out bench/results/prune.json] [--png PATH]

1. Calibration text (SQuAD dev paragraphs from 0) and evaluation text (the paragraphs after it,
   never seen by calibration). Unpruned perplexity on the evaluation text.
2. Per importance (l1, l2, taylor): channel scores; per ratio: block sensitivities ΔPPL_i on the
   calibration text (tail forwards from block i). Per allocation (uniform, ppl-based,
   rank-based): prune a copy, perplexity on the evaluation text (the shape of KVPruner's
   Tables III and IV).
3. Per ratio, the best combination (lowest perplexity): its KV bytes per token in fp16 and as
   stored by kdn with every codec (``kdn.codec.quality``: ΔPPL of the decoded cache against the
   pruned model's own fp16 cache); ``stored_bytes_per_token`` is the smallest container whose
   ΔPPL <= 1% (the codec benchmark's quality bar).
4. Prefill and decode tokens/s of the unpruned model and each best pruned model, interleaved.
5. Table, JSON with targets (met or not, with their numbers), PNG of perplexity vs KV bytes.
No LoRA recovery run: one-shot results only (it does not fit this CPU budget).

Each importance/ratio group is checkpointed to ``OUT.partial.json`` (with its kept channels); a
run with the same settings resumes from it, and a finished run deletes it.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import figure, print_table, save_figure, write_json
from kdn.cache import KVCache
from kdn.codec import decode, encode
from kdn.codec.modes import get_mode
from kdn.codec.quality import evaluate, prepare
from kdn.data import english_text_span, english_token_ids
from kdn.hf import model_layout
from kdn.layout import DType
from kdn.models import load_model, perplexity
from kdn.prune import (
    Allocation,
    Geometry,
    Importance,
    PruneConfig,
    PrunePlan,
    TailRunner,
    block_sensitivity,
    channel_scores,
    make_plan,
    prune_model,
)

RESULTS = Path(__file__).parent / "results"
COLUMNS = ["ratio", "allocation", "importance", "ppl", "delta_ppl_pct", "kv_bytes_per_token"]
QUALITY_BAR_PCT = 1.0


def _codecs() -> list[tuple[str, str, str]]:
    out = [("lossless", "lossless", ""), ("int8", "int8", ""), ("cachegen", "cachegen", "")]
    return out + [(f"kdn-{lv}", "kdn", lv) for lv in get_mode("kdn").levels]


def compression(model: Any, tok: Any, ctx: int, eval_tokens: int, offset: int
                ) -> list[dict[str, Any]]:
    """Stored bytes per token and ΔPPL of every codec on ``model``'s own cache."""
    ref = prepare(model, tok, ctx, eval_tokens, offset_paragraphs=offset)
    out = []
    for name, mode, level in _codecs():
        blob = encode(ref.kv, mode, level)
        kv = decode(blob)
        assert isinstance(kv, KVCache)
        q = evaluate(ref, kv)
        out.append({"codec": name, "bytes_per_token": len(blob) / ref.kv.num_tokens,
                    "delta_ppl_pct": q.delta_ppl_pct, "top1": q.top1})
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short texts (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prune.json")
    ap.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--importances", nargs="+", default=[i.value for i in Importance])
    ap.add_argument("--calib-tokens", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=0)
    args = ap.parse_args(argv)
    calib_n = args.calib_tokens or (64 if args.quick else 128)
    eval_n = args.eval_tokens or (128 if args.quick else 384)
    codec_ctx, codec_eval = (128, 32) if args.quick else (256, 64)
    speed_ctx, speed_new, speed_reps = (64, 8, 1) if args.quick else (256, 16, 2)
    torch.manual_seed(0)
    t_start = time.perf_counter()

    model, tok = load_model("smollm2-135m")
    geo = Geometry.of(model)
    span = english_text_span(calib_n, tok, 0)
    calib = english_token_ids(calib_n, tok, 0)
    eval_ids = english_token_ids(eval_n, tok, span.stop)
    codec_offset = span.stop
    base_ppl = perplexity(model, eval_ids)
    fp16_layout = model_layout(model, DType.FLOAT16)
    fp16_bpt = fp16_layout.bytes_per_token
    print(f"unpruned ppl {base_ppl:.3f} on {eval_n} eval tokens; calib {calib_n} tokens "
          f"(paragraphs 0..{span.stop}); fp16 KV {fp16_bpt} B/token")

    settings = {"calib": calib_n, "eval": eval_n, "quick": args.quick}
    ckpt = args.out.with_suffix(".partial.json")
    done = _load_checkpoint(ckpt, settings)
    runner: TailRunner | None = None
    rows: list[dict[str, Any]] = []
    sensitivities: dict[str, dict[str, list[float]]] = {}
    plans: dict[tuple[float, str, str], Any] = {}
    for imp in (Importance(i) for i in args.importances):
        t0 = time.perf_counter()
        scores = None
        for ratio in args.ratios:
            group = done.get(f"{imp.value}/{ratio}")
            if group is not None:  # measured by an interrupted earlier run with these settings
                sensitivities.setdefault(imp.value, {})[str(ratio)] = group["sensitivity"]
                for r in group["rows"]:
                    rows.append(r)
                    plans[(ratio, r["allocation"], imp.value)] = PrunePlan(
                        geo.head_dim, tuple(map(tuple, r["k_kept"])),
                        tuple(map(tuple, r["v_kept"])))
                    print(f"  {imp.value:6s} {ratio:.1f} {r['allocation']:10s} "
                          f"ppl {r['ppl']:8.3f} (checkpoint)", flush=True)
                continue
            runner = runner or TailRunner(model, calib)
            scores = scores if scores is not None else channel_scores(model, imp, calib)
            sens = block_sensitivity(model, calib, scores, ratio, runner)
            group_rows: list[dict[str, Any]] = []
            sensitivities.setdefault(imp.value, {})[str(ratio)] = list(sens.delta_ppl)
            for alloc in Allocation:
                cfg = PruneConfig(ratio, alloc, imp)
                plan, block_r = make_plan(geo, scores, cfg, sens)
                pruned = prune_model(copy.deepcopy(model), plan)
                ppl = perplexity(pruned, eval_ids)
                kv_bpt = model_layout(pruned, DType.FLOAT16).bytes_per_token
                plans[(ratio, alloc.value, imp.value)] = plan
                rows.append({"ratio": ratio, "allocation": alloc.value,
                             "importance": imp.value, "ppl": ppl,
                             "delta_ppl_pct": 100 * (ppl / base_ppl - 1),
                             "kv_bytes_per_token": kv_bpt,
                             "block_ratios": [round(r, 4) for r in block_r],
                             "k_channels": [len(k) for k in plan.k_kept],
                             "v_channels": [len(v) for v in plan.v_kept],
                             "k_kept": [list(k) for k in plan.k_kept],
                             "v_kept": [list(v) for v in plan.v_kept]})
                group_rows.append(rows[-1])
                print(f"  {imp.value:6s} {ratio:.1f} {alloc.value:10s} ppl {ppl:8.3f}", flush=True)
                del pruned
            done[f"{imp.value}/{ratio}"] = {"sensitivity": list(sens.delta_ppl),
                                            "rows": group_rows}
            ckpt.write_text(json.dumps({"settings": settings, "groups": done}))
        print(f"{imp.value}: {time.perf_counter() - t0:.0f} s", flush=True)

    print_table(rows, COLUMNS)
    table_rows = [{k: v for k, v in r.items() if k not in ("k_kept", "v_kept")} for r in rows]

    # -- pruning x compression, speed -----------------------------------------------------------
    unpruned_codecs = compression(model, tok, codec_ctx, codec_eval, codec_offset)
    per_ratio: list[dict[str, Any]] = []
    best_models: dict[float, Any] = {}
    for ratio in args.ratios:
        best = min((r for r in rows if r["ratio"] == ratio), key=lambda r: r["ppl"])
        plan = plans[(ratio, best["allocation"], best["importance"])]
        pruned = prune_model(copy.deepcopy(model), plan)
        best_models[ratio] = pruned
        codecs = compression(pruned, tok, codec_ctx, codec_eval, codec_offset)
        ok = [c for c in codecs if c["delta_ppl_pct"] <= QUALITY_BAR_PCT]
        chosen = min(ok or codecs, key=lambda c: c["bytes_per_token"])
        per_ratio.append({"ratio": ratio, "best_allocation": best["allocation"],
                          "best_importance": best["importance"], "best_ppl": best["ppl"],
                          "kv_bytes_per_token": best["kv_bytes_per_token"],
                          "kv_fraction_of_fp16": best["kv_bytes_per_token"] / fp16_bpt,
                          "stored_bytes_per_token": chosen["bytes_per_token"],
                          "stored_codec": chosen["codec"],
                          "stored_codec_delta_ppl_pct": chosen["delta_ppl_pct"],
                          "stored_fraction_of_fp16": chosen["bytes_per_token"] / fp16_bpt,
                          "codecs": codecs})

    speed_ids = english_token_ids(speed_ctx, tok, codec_offset)
    speeds: dict[str, list[tuple[float, float]]] = {"unpruned": []}
    speeds.update({str(r): [] for r in args.ratios})
    for _ in range(speed_reps):  # interleaved, best of the repeats
        speeds["unpruned"].append(speed(model, speed_ids, speed_new))
        for ratio, m in best_models.items():
            speeds[str(ratio)].append(speed(m, speed_ids, speed_new))
    speed_rows = [{"model": name, "prefill_tok_s": max(p for p, _ in v),
                   "decode_tok_s": max(d for _, d in v)} for name, v in speeds.items()]
    for r in per_ratio:
        s = next(x for x in speed_rows if x["model"] == str(r["ratio"]))
        r["prefill_tok_s"], r["decode_tok_s"] = s["prefill_tok_s"], s["decode_tok_s"]
    unpruned_speed = speed_rows[0]

    print_table([{k: v for k, v in r.items() if k != "codecs"} for r in per_ratio],
                ["ratio", "best_allocation", "best_importance", "best_ppl",
                 "kv_bytes_per_token", "stored_bytes_per_token", "stored_codec",
                 "stored_codec_delta_ppl_pct", "prefill_tok_s", "decode_tok_s"])
    print_table(speed_rows, ["model", "prefill_tok_s", "decode_tok_s"])

    # -- targets --------------------------------------------------------------------------------
    targets: list[dict[str, Any]] = []
    if 0.2 in args.ratios:
        at = {(r["allocation"], r["importance"]): r["ppl"] for r in rows if r["ratio"] == 0.2}
        ppl_based = {i: p for (a, i), p in at.items() if a == Allocation.PPL.value}
        best_imp = min(ppl_based, key=lambda i: ppl_based[i])
        targets.append({
            "target": "20%: best ppl-based combination beats uniform with the same importance",
            "met": ppl_based[best_imp] < at[(Allocation.UNIFORM.value, best_imp)],
            "importance": best_imp, "ppl_based": ppl_based[best_imp],
            "uniform": at[(Allocation.UNIFORM.value, best_imp)],
            "per_importance": {i: {"ppl_based": ppl_based[i],
                                   "uniform": at[(Allocation.UNIFORM.value, i)]}
                               for i in ppl_based}})
    exact = {str(r["ratio"]): r["kv_bytes_per_token"] for r in rows}
    targets.append({
        "target": "KV bytes per token fall by the pruning ratio exactly",
        "met": all(r["kv_bytes_per_token"] == round(fp16_bpt * (1 - r["ratio"])) for r in rows),
        "fp16_bytes_per_token": fp16_bpt, "kv_bytes_per_token": exact})
    for r in per_ratio:
        if r["ratio"] == 0.5:
            targets.append({
                "target": "50% pruning + best codec level <= 1/10 of unpruned fp16",
                "met": r["stored_bytes_per_token"] <= fp16_bpt / 10,
                "stored_bytes_per_token": r["stored_bytes_per_token"],
                "limit": fp16_bpt / 10, "codec": r["stored_codec"],
                "codec_delta_ppl_pct": r["stored_codec_delta_ppl_pct"]})
    for t in targets:
        print(("MET     " if t["met"] else "MISSED  ") + t["target"])

    elapsed = time.perf_counter() - t_start
    write_json(args.out, "prune", table_rows, model="smollm2-135m", quick=args.quick,
               calib_tokens=calib_n, calib_paragraphs=[0, span.stop], eval_tokens=eval_n,
               eval_offset_paragraphs=span.stop, unpruned_ppl=base_ppl,
               fp16_bytes_per_token=fp16_bpt, per_ratio=per_ratio,
               unpruned_codecs=unpruned_codecs, speed=speed_rows,
               unpruned_prefill_tok_s=unpruned_speed["prefill_tok_s"],
               unpruned_decode_tok_s=unpruned_speed["decode_tok_s"],
               codec_context_tokens=codec_ctx, codec_eval_tokens=codec_eval,
               speed_context_tokens=speed_ctx, speed_new_tokens=speed_new,
               sensitivity_delta_ppl=sensitivities, lora_recovery="not run (CPU budget)",
               torch_threads=torch.get_num_threads(), elapsed_s=elapsed, targets=targets)
    plot(args.png or args.out.with_suffix(".png"), rows, per_ratio, base_ppl, fp16_bpt)
    ckpt.unlink(missing_ok=True)


def _load_checkpoint(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Groups (importance/ratio) measured by an interrupted run with the same settings."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(doc["groups"]) if doc.get("settings") == settings else {}


def plot(path: Path, rows: list[dict[str, Any]], per_ratio: list[dict[str, Any]],
         base_ppl: float, fp16_bpt: int) -> None:
    fig, ax = figure(8, 5)
    colors = {"uniform": "tab:gray", "ppl-based": "tab:blue", "rank-based": "tab:orange"}
    markers = {"l1": "o", "l2": "s", "taylor": "^"}
    offsets = {"l1": -0.03, "l2": 0.0, "taylor": 0.03}
    for r in rows:
        x = r["kv_bytes_per_token"] * (1 + offsets[r["importance"]])
        ax.scatter(x, r["ppl"], c=colors[r["allocation"]], marker=markers[r["importance"]], s=40)
    ax.scatter(fp16_bpt, base_ppl, c="black", marker="*", s=120, label="unpruned fp16")
    for r in per_ratio:
        est = r["best_ppl"] * (1 + r["stored_codec_delta_ppl_pct"] / 100)
        ax.scatter(r["stored_bytes_per_token"], est, facecolors="none", edgecolors="tab:green",
                   s=90, marker="D")
        ax.annotate(f"{int(r['ratio'] * 100)}% + {r['stored_codec']}",
                    (r["stored_bytes_per_token"], est), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    for name, c in colors.items():
        ax.scatter([], [], c=c, label=name)
    for name, m in markers.items():
        ax.scatter([], [], c="white", edgecolors="black", marker=m, label=name)
    ax.scatter([], [], facecolors="none", edgecolors="tab:green", marker="D",
               label="best + kdn-stored (ppl x codec ΔPPL)")
    ax.axvline(fp16_bpt / 10, color="tab:red", ls=":", lw=1, label="1/10 of fp16")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token (SmolLM2-135M, 30 layers)")
    ax.set_ylabel("perplexity on held-out text")
    ax.set_title("KVPruner one-shot: perplexity vs KV bytes per token")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
