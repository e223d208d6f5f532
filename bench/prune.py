"""KVPruner benchmark on SmolLM2-135M: allocation x importance at 20% / 50% KV pruning, pruning x
compression, and prefill/decode speed, against the unpruned model measured in the same run.

    python -m bench.prune [--quick] [--out bench/results/prune.json] [--png PATH]

1. Text from SQuAD dev articles that never meet (``kdn.prune.evaluate.ArticleSplit``):
   calibration (articles 0-1), LoRA training (2-31), evaluation (40-47: 4,096 held-out
   tokens). Unpruned perplexity on the evaluation tokens with a bootstrap 95% interval over
   512-token windows, and answer F1 on 50 questions of the evaluation articles (greedy).
2. Per importance (l1, l2, taylor): channel scores; per ratio: block sensitivities ΔPPL_i on the
   calibration text (tail forwards from block i). Per allocation (uniform, ppl-based,
   rank-based): prune a copy, perplexity on the evaluation tokens (KVPruner's Tables III-IV).
3. Per ratio, the best combination: one-shot perplexity (with interval), LoRA recovery
   (``kdn.prune.recover``: peft, merged back; 150 steps at 20%, 300 at 50%; checkpointed in
   ``OUT.recovery-<ratio>/``, resumable), recovered perplexity (with interval), a save and
   reload through ``kdn.models.load_model``, answer F1, and its KV bytes per token as stored
   by kdn with every codec (ΔPPL of the decoded cache against the recovered model's own fp16
   cache, on evaluation-article text); ``stored_bytes_per_token`` is the smallest container
   whose ΔPPL <= 1%. For the largest ratio: TTFT of a KDNEngine hit against its prefill.
4. Prefill and decode tokens/s of the unpruned model and each recovered model, interleaved.
5. Table, JSON with targets (met or not, with their numbers), PNG of perplexity vs KV bytes.

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
from kdn.data import english_token_ids, load_squad_dev
from kdn.hf import model_layout
from kdn.layout import DType
from kdn.models import load_model
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
    save_pruned,
)
from kdn.prune.evaluate import ArticleSplit, answer_f1, perplexity_ci
from kdn.prune.recover import RecoveryConfig, recover

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
    ap.add_argument("--recover-steps", type=int, nargs="+", default=[],
                    help="LoRA steps per ratio (default 150 for 20%%, 300 for 50%%)")
    ap.add_argument("--recover-seconds", type=float, default=1800.0)
    ap.add_argument("--questions", type=int, default=0, help="SQuAD questions for F1 (50)")
    args = ap.parse_args(argv)
    calib_n = args.calib_tokens or (64 if args.quick else 128)
    eval_n = args.eval_tokens or (1024 if args.quick else 4096)
    n_questions = args.questions or (5 if args.quick else 50)
    steps_for = dict(zip(args.ratios, args.recover_steps)) if args.recover_steps else {
        r: (4 if args.quick else (150 if r <= 0.2 else 300)) for r in args.ratios}
    codec_ctx, codec_eval = (128, 32) if args.quick else (256, 64)
    speed_ctx, speed_new, speed_reps = (64, 8, 1) if args.quick else (256, 16, 2)
    torch.manual_seed(0)
    t_start = time.perf_counter()

    model, tok = load_model("smollm2-135m")
    geo = Geometry.of(model)
    split = ArticleSplit.default()  # calibration, training and evaluation articles: disjoint
    calib = split.token_ids("calibration", tok, calib_n)
    train_ids = split.token_ids("training", tok)
    eval_ids = split.token_ids("eval", tok, eval_n)
    # codec quality on evaluation-article text too (paragraph offset of the first one)
    codec_offset = sum(len(a.paragraphs) for a in load_squad_dev()[:split.evaluation.start])
    base = perplexity_ci(model, eval_ids)
    base_ppl = base.ppl
    fp16_layout = model_layout(model, DType.FLOAT16)
    fp16_bpt = fp16_layout.bytes_per_token
    print(f"unpruned ppl {base_ppl:.3f} [{base.low:.3f}, {base.high:.3f}] on {base.tokens} "
          f"held-out tokens (articles {split.evaluation.start}-{split.evaluation.stop - 1}); "
          f"calib {calib_n} tokens; training {train_ids.numel()} tokens; fp16 KV {fp16_bpt} "
          "B/token")

    settings = {"calib": calib_n, "eval": eval_n, "quick": args.quick, "split": "articles"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
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
                ppl = perplexity_ci(pruned, eval_ids, boot=2).ppl
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
    qas = split.questions("eval", n_questions, seed=0)
    base_f1 = answer_f1(model, tok, qas)
    print(f"unpruned answer F1 {base_f1:.3f} on {n_questions} held-out questions", flush=True)
    for ratio in args.ratios:
        best = min((r for r in rows if r["ratio"] == ratio), key=lambda r: r["ppl"])
        plan = plans[(ratio, best["allocation"], best["importance"])]
        pruned = prune_model(copy.deepcopy(model), plan)
        one_shot = perplexity_ci(pruned, eval_ids)
        steps = steps_for[ratio]
        ckpt_dir = args.out.with_name(f"{args.out.stem}.recovery-{ratio}")
        rep = recover(pruned, train_ids, RecoveryConfig(steps=steps, seed=0,
                                                        max_seconds=args.recover_seconds),
                      folder=ckpt_dir, progress=lambda s, n, loss, r=ratio: print(
                          f"    recovery {r:.1f}: step {s}/{n} loss {loss:.3f}",
                          flush=True) if s % 25 == 0 else None)
        recovered = perplexity_ci(pruned, eval_ids)
        print(f"  {ratio:.1f} {best['allocation']}/{best['importance']}: one-shot "
              f"{one_shot.ppl:.3f} -> recovered {recovered.ppl:.3f} [{recovered.low:.3f}, "
              f"{recovered.high:.3f}] in {rep.steps} steps, {rep.seconds:.0f} s", flush=True)
        reload_ok = _round_trip(pruned, tok, eval_ids)
        best_models[ratio] = pruned
        codecs = compression(pruned, tok, codec_ctx, codec_eval, codec_offset)
        ok = [c for c in codecs if c["delta_ppl_pct"] <= QUALITY_BAR_PCT]
        chosen = min(ok or codecs, key=lambda c: c["bytes_per_token"])
        f1 = answer_f1(pruned, tok, qas)
        per_ratio.append({"ratio": ratio, "best_allocation": best["allocation"],
                          "best_importance": best["importance"], "best_ppl": best["ppl"],
                          "one_shot_ppl": one_shot.ppl,
                          "one_shot_ppl_ci": [one_shot.low, one_shot.high],
                          "recovered_ppl": recovered.ppl,
                          "recovered_ppl_ci": [recovered.low, recovered.high],
                          "recovered_delta_ppl_pct": 100 * (recovered.ppl / base_ppl - 1),
                          "recovery_s": rep.seconds, "recovery_steps": rep.steps,
                          "recovery_loss_first_last": [rep.first_loss, rep.last_loss],
                          "recovery_stopped_by": rep.stopped_by,
                          "reloaded_through_load_model": reload_ok,
                          "answer_f1": f1, "answer_f1_delta": f1 - base_f1,
                          "kv_bytes_per_token": best["kv_bytes_per_token"],
                          "kv_fraction_of_fp16": best["kv_bytes_per_token"] / fp16_bpt,
                          "stored_bytes_per_token": chosen["bytes_per_token"],
                          "stored_codec": chosen["codec"],
                          "stored_codec_delta_ppl_pct": chosen["delta_ppl_pct"],
                          "stored_fraction_of_fp16": chosen["bytes_per_token"] / fp16_bpt,
                          "codecs": codecs})
        if ratio == max(args.ratios):
            per_ratio[-1]["hit_vs_prefill"] = _hit_vs_prefill(
                pruned, tok, eval_ids[:512 if args.quick else 1024],
                ("kdn", chosen["codec"].removeprefix("kdn-"))
                if chosen["codec"].startswith("kdn-") else (chosen["codec"], ""))

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
        bar = {0.2: 12.0, 0.5: 50.0}.get(r["ratio"])
        if bar is not None:
            targets.append({
                "target": f"{int(r['ratio'] * 100)}% pruned + recovered within +{bar:g}% of "
                          "unpruned PPL (held-out)",
                "met": r["recovered_delta_ppl_pct"] <= bar,
                "recovered_ppl": r["recovered_ppl"], "recovered_ppl_ci": r["recovered_ppl_ci"],
                "unpruned_ppl": base_ppl, "unpruned_ppl_ci": [base.low, base.high],
                "delta_ppl_pct": r["recovered_delta_ppl_pct"]})
        targets.append({
            "target": f"{int(r['ratio'] * 100)}%: answer F1 within 0.03 of unpruned "
                      f"({n_questions} questions)",
            "met": abs(r["answer_f1_delta"]) <= 0.03 or r["answer_f1_delta"] > 0,
            "answer_f1": r["answer_f1"], "unpruned_f1": base_f1})
        if r["ratio"] == 0.5:
            targets.append({
                "target": "50%: recovery within 30 minutes on this machine",
                "met": r["recovery_s"] <= 1800, "recovery_s": r["recovery_s"],
                "steps": r["recovery_steps"]})
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
               calib_tokens=calib_n, eval_tokens=base.tokens,
               articles={"calibration": [split.calibration.start, split.calibration.stop],
                         "training": [split.training.start, split.training.stop],
                         "evaluation": [split.evaluation.start, split.evaluation.stop]},
               training_tokens=train_ids.numel(), unpruned_ppl=base_ppl,
               unpruned_ppl_ci=[base.low, base.high], unpruned_answer_f1=base_f1,
               questions=n_questions,
               fp16_bytes_per_token=fp16_bpt, per_ratio=per_ratio,
               unpruned_codecs=unpruned_codecs, speed=speed_rows,
               unpruned_prefill_tok_s=unpruned_speed["prefill_tok_s"],
               unpruned_decode_tok_s=unpruned_speed["decode_tok_s"],
               codec_context_tokens=codec_ctx, codec_eval_tokens=codec_eval,
               speed_context_tokens=speed_ctx, speed_new_tokens=speed_new,
               sensitivity_delta_ppl=sensitivities,
               lora_recovery="peft LoRA r16 on q/k/v/o/gate/up/down, merged; best combination "
                             "of each ratio",
               torch_threads=torch.get_num_threads(), elapsed_s=elapsed, targets=targets)
    plot(args.png or args.out.with_suffix(".png"), rows, per_ratio, base_ppl, fp16_bpt)
    ckpt.unlink(missing_ok=True)


def _round_trip(model: Any, tok: Any, ids: torch.Tensor) -> bool:
    """Save the pruned + recovered model as a transformers folder and load it back through
    ``kdn.models.load_model``: same layout, same logits."""
    import tempfile

    from kdn.models import clear_memo

    with tempfile.TemporaryDirectory() as tmp:
        save_pruned(model, tmp, tok)
        back, _ = load_model(tmp)
        with torch.inference_mode():
            a = model(input_ids=ids[None, :64]).logits
            b = back(input_ids=ids[None, :64]).logits
        same_layout = model_layout(back).layers == model_layout(model).layers
        clear_memo()
        return bool(same_layout and torch.allclose(a, b, atol=1e-4))


def _hit_vs_prefill(model: Any, tok: Any, ids: torch.Tensor,
                    encoding: tuple[str, str]) -> dict[str, Any]:
    """TTFT of the pruned model through KDNEngine: a full prefill (miss, stored back) against a
    hit of the same prompt (KV retrieved from a local kdn server's RAM tier), each encoding."""
    import tempfile

    from kdn.client import Client
    from kdn.engine import EngineConfig, KDNEngine
    from kdn.server import ServerConfig, ServerThread

    out: dict[str, Any] = {"prompt_tokens": int(ids.numel())}
    with tempfile.TemporaryDirectory() as tmp, ServerThread(ServerConfig(
            port=0, data_dir=Path(tmp), disk_bytes=0)) as st, Client(st.address) as client:
        for mode, level in {("lossless", ""), encoding}:
            eng = KDNEngine(model, tok, client, EngineConfig(
                namespace=f"prune-{mode}-{level}", encodings=((mode, level),)))
            miss = eng.generate(ids.tolist(), max_new_tokens=1)
            if miss.store_thread is not None:
                miss.store_thread.join()
            hit = eng.generate(ids.tolist(), max_new_tokens=1)
            name = f"{mode}-{level}" if level else mode
            out[name] = {"prefill_ttft_s": miss.timings.ttft_s, "hit_ttft_s": hit.timings.ttft_s,
                         "hit_vs_prefill": hit.timings.ttft_s / miss.timings.ttft_s,
                         "reused_tokens": hit.timings.reused_tokens,
                         "same_first_token": hit.token_ids[:1] == miss.token_ids[:1]}
    return out


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
