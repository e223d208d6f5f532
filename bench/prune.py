"""KVPruner benchmark on SmolLM2-135M: allocation x importance at 20% / 50% KV pruning, LoRA
recovery, pruning x compression, answers, and a kdn hit against a prefill, all against the
unpruned model measured in the same run on the same held-out text.

    python -m bench.prune [--quick] [--out bench/results/prune.json] [--png PATH]

1. Text from SQuAD dev articles that never meet (``kdn.prune.evaluate.ArticleSplit``, checked
   for shared 32-token runs): calibration (articles 0-1), recovery training (2-31),
   evaluation (40-47). Perplexity on 16 windows of 512 predicted tokens spread over the eight
   evaluation articles (8,192 tokens), with a bootstrap 95% interval over windows; each
   pruned model's change against the unpruned one comes with a paired interval (the same
   windows resampled for both), which says whether a difference is real.
2. Per importance (l1, l2, taylor): channel scores; per ratio: block sensitivities ΔPPL_i on
   the calibration text. Per allocation (uniform, ppl-based, rank-based): prune a copy,
   perplexity on the evaluation windows (KVPruner's Tables III-IV): one row each.
3. Per ratio, the best one-shot combination is recovered (``kdn.prune.recover``: LoRA r16 on
   q/k/v/o/gate/up/down with peft, distilled from the unpruned model, bf16 autocast, bounded
   by steps and 30 minutes, checkpointed in ``OUT.recovery-<ratio>/`` and resumed from
   there; a checkpoint of other settings or another training text is refused); its row gets
   the recovered perplexity. What it trains on is a recipe per ratio (``--qa-share``,
   ``--qa-questions``, ``--answer-weight``: one value for all ratios or one each): the share of
   training paragraphs made into answering prompts, the questions per such paragraph, and the
   loss weight of the positions that predict a reference answer. The recovered model is saved as a
   transformers folder and every later measurement uses the copy loaded back through
   ``kdn.model.models.load_model``.
4. Per recovered model and the unpruned one: KV bytes per token as kdn stores it, per codec
   level, and the ΔPPL each level costs on top of that model's own fp16 KV (16 windows of
   evaluation text: 256 context tokens, the storage block of the engine, then 256 tokens
   predicted from the decoded cache: 4096 scored tokens); ``stored_bytes_per_token`` is the
   smallest level with ΔPPL <= 1%.
5. Answers: 50 questions of the evaluation articles, greedy, the same prompt ids for every
   model: (a) a full prefill; (b) through kdn: the context's KV stored in kdn with the chosen
   level (the pruned layout in its key), retrieved and blended with the question
   (``kdn.rag.RagEngine``, 15% recompute). SQuAD F1 with paired intervals.
6. TTFT of a ``KDNEngine`` hit (1,024 of 1,025 prompt tokens reused from a local kdn server)
   against its full prefill, per model and stored level (median of 3, interleaved); prefill
   and decode tokens/s.
7. Table, JSON with targets (met or missed, with their numbers), PNG.

Probing one recipe without the whole study: ``--ratios 0.2 --importances taylor`` runs one
ratio and one importance; ``--questions 200`` a larger answer draw; ``--lr``, ``--rank``,
``--distill``, ``--answer-ce`` and ``--k-share`` (how the removed channels split between K and
V) change the recovery or the plan.

Each importance/ratio group of step 2 is checkpointed to ``OUT.partial.json``; a run with the
same settings resumes from it, and a finished run deletes it.

This module runs the study (steps 1-3 and the order of the rest); the measurements of
steps 4-6 are ``bench.prune_measure``, the targets and the figure ``bench.prune_report``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import print_table, write_json
from bench.prune_measure import (
    QUALITY_BAR_PCT,
    choose_codec,
    compression,
    hit_vs_prefill,
    kdn_answers,
    speed,
)
from bench.prune_report import check_targets, plot
from kdn.layout import DType
from kdn.model.hf import model_layout
from kdn.model.models import clear_memo, load_model
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
from kdn.prune.evaluate import (
    ArticleSplit,
    answers,
    check_disjoint,
    f1_scores,
    paired_change,
    paired_f1_change,
    perplexity_ci,
)
from kdn.prune.recover import RecoveryConfig, recover

RESULTS = Path(__file__).parent / "results"
COLUMNS = ["ratio", "allocation", "importance", "ppl", "delta_ppl_pct", "recovered_ppl",
           "recovered_delta_ppl_pct", "kv_bytes_per_token"]


@dataclass(frozen=True)
class Recipe:
    """What a ratio's recovery trains on: the share of training paragraphs made into answering
    prompts, the questions per such paragraph, and the loss weight of answer positions."""

    qa_share: float
    qa_questions: int
    answer_weight: float
    answer_ce: float = 0.0

    @property
    def label(self) -> str:
        return (f"qa share {self.qa_share:g}, {self.qa_questions} q, answers "
                f"x{self.answer_weight:g}" + (f", answer CE {self.answer_ce:g}"
                                              if self.answer_ce else ""))


def per_ratio_values(values: list[Any], ratios: list[float], flag: str) -> list[Any]:
    """One value for every ratio, or one per ratio in order."""
    if len(values) == 1:
        return values * len(ratios)
    if len(values) != len(ratios):
        raise SystemExit(f"{flag}: give one value or one per ratio ({len(ratios)}), "
                         f"got {len(values)}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short texts, few steps (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prune.json")
    ap.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--importances", nargs="+", default=[i.value for i in Importance])
    ap.add_argument("--calib-tokens", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=0, help="evaluation windows (16)")
    ap.add_argument("--window", type=int, default=0, help="tokens predicted per window (512)")
    ap.add_argument("--recover-steps", type=int, nargs="+", default=[],
                    help="LoRA steps per ratio (default 700 up to 20%%, 950 above)")
    ap.add_argument("--recover-seconds", type=float, default=1800.0)
    ap.add_argument("--distill", type=float, default=1.0,
                    help="weight of the KL from the unpruned model in the recovery loss")
    ap.add_argument("--qa-share", type=float, nargs="+", default=[],
                    help="share of training paragraphs in the answering prompt's form (one "
                         "value, or one per ratio; default 1 up to 20%%, 0.5 above)")
    ap.add_argument("--qa-questions", type=int, nargs="+", default=[],
                    help="questions made into prompts per paragraph chosen for the prompt form "
                         "(one value, or one per ratio; default 5 up to 20%%, 1 above)")
    ap.add_argument("--answer-weight", type=float, nargs="+", default=[1.0],
                    help="recovery loss weight of positions predicting answer tokens (others "
                         "1; 10 moved the 20%% model's F1 on 200 questions by +0.008 and its "
                         "PPL by +0.6 points, both within noise; one value, or one per ratio)")
    ap.add_argument("--answer-ce", type=float, nargs="+", default=[],
                    help="weight of a cross-entropy on the reference answer tokens beside the "
                         "teacher's KL (RecoveryConfig.answer_ce; one value, or one per ratio; "
                         "default 0 up to 20%%, 0.025 above)")
    ap.add_argument("--fp32", action="store_true", help="recover without bf16 autocast")
    ap.add_argument("--lr", type=float, default=RecoveryConfig.lr,
                    help="peak learning rate of the LoRA adapters")
    ap.add_argument("--rank", type=int, default=RecoveryConfig.rank,
                    help="LoRA rank (alpha stays twice the rank)")
    ap.add_argument("--k-share", type=float, default=0.5,
                    help="share of the removed channels taken from K (PruneConfig.k_share; "
                         "0.5: K and V alike; 0.3-0.7 all read worse one-shot at 50%%)")
    ap.add_argument("--questions", type=int, default=0, help="SQuAD questions for F1 (50)")
    args = ap.parse_args(argv)
    calib_n = args.calib_tokens or (64 if args.quick else 128)
    n_windows = args.eval_windows or (4 if args.quick else 16)
    window = args.window or (128 if args.quick else 512)
    n_questions = args.questions or (4 if args.quick else 50)
    steps_for = dict(zip(args.ratios, args.recover_steps)) if args.recover_steps else {
        r: (4 if args.quick else (700 if r <= 0.2 else 950)) for r in args.ratios}
    mild = [r <= 0.2 for r in args.ratios]  # the recipe measured best per ratio (bench/README)
    args.qa_share = args.qa_share or [1.0 if m else 0.5 for m in mild]
    args.qa_questions = args.qa_questions or [5 if m else 1 for m in mild]
    args.answer_ce = args.answer_ce or [0.0 if m else 0.025 for m in mild]
    recipe_of = {r: Recipe(*values) for r, *values in zip(
        args.ratios, *(per_ratio_values(getattr(args, name), args.ratios, flag) for name, flag
                       in (("qa_share", "--qa-share"), ("qa_questions", "--qa-questions"),
                           ("answer_weight", "--answer-weight"), ("answer_ce", "--answer-ce"))))}
    # codec ΔPPL is judged against a 1% bar: 4096 scored tokens (1024 gave intervals of ±0.7%)
    codec_windows, codec_ctx, codec_eval = (2, 64, 32) if args.quick else (16, 256, 256)
    speed_ctx, speed_new, reps = (64, 8, 1) if args.quick else (256, 16, 3)
    ttft_tokens = 129 if args.quick else 1025
    torch.manual_seed(0)
    t_start = time.perf_counter()

    model, tok = load_model("smollm2-135m")
    geo = Geometry.of(model)
    split = ArticleSplit.default()  # calibration, training and evaluation articles: disjoint
    calib = split.token_ids("calibration", tok, calib_n)
    training = {rc: split.recovery_text(tok, qa_share=rc.qa_share, seed=0,
                                        questions=rc.qa_questions)
                for rc in dict.fromkeys(recipe_of.values())}
    eval_windows = split.windows("evaluation", tok, n_windows, window)
    codec_text = split.windows("evaluation", tok, codec_windows, codec_ctx + codec_eval)
    eval_text = split.token_ids("evaluation", tok)
    for name, ids in [*((f"training ({rc.label})", t.ids) for rc, t in training.items()),
                      ("calibration", calib)]:
        check_disjoint(ids, eval_windows)  # no 32-token run of evaluation text elsewhere
        print(f"{name} text ({ids.numel()} tokens) shares no 32-token run with the evaluation "
              "windows", flush=True)
    base = perplexity_ci(model, eval_windows)
    base_ppl = base.ppl
    fp16_bpt = model_layout(model, DType.FLOAT16).bytes_per_token
    print(f"unpruned ppl {base_ppl:.3f} [{base.low:.3f}, {base.high:.3f}] on {base.tokens} "
          f"held-out tokens ({base.windows} windows over articles {split.evaluation.start}-"
          f"{split.evaluation.stop - 1}); calib {calib_n} tokens; fp16 KV {fp16_bpt} B/token",
          flush=True)

    settings = {"calib": calib_n, "windows": n_windows, "window": window, "quick": args.quick,
                "split": "articles-v2"}
    if args.k_share != 0.5:  # another split of the removed channels: other one-shot groups
        settings["k_share"] = args.k_share
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = args.out.with_suffix(".partial.json")
    done = _load_checkpoint(ckpt, settings)
    runner: TailRunner | None = None
    rows: list[dict[str, Any]] = []
    sensitivities: dict[str, dict[str, list[float]]] = {}
    plans: dict[tuple[float, str, str], PrunePlan] = {}
    for imp in (Importance(i) for i in args.importances):
        t0 = time.perf_counter()
        scores = None
        for ratio in args.ratios:
            group = done.get(f"{imp.value}/{ratio}")
            if group is None:
                runner = runner or TailRunner(model, calib)
                scores = scores if scores is not None else channel_scores(model, imp, calib)
                sens = block_sensitivity(model, calib, scores, ratio, runner)
                group = {"sensitivity": list(sens.delta_ppl), "rows": []}
                for alloc in Allocation:
                    cfg = PruneConfig(ratio, alloc, imp, k_share=args.k_share)
                    plan, block_r = make_plan(geo, scores, cfg, sens)
                    pruned = prune_model(copy.deepcopy(model), plan)
                    res = perplexity_ci(pruned, eval_windows)
                    change = paired_change(base, res)
                    group["rows"].append({
                        "ratio": ratio, "allocation": alloc.value, "importance": imp.value,
                        "ppl": res.ppl, "ppl_ci": [res.low, res.high],
                        "delta_ppl_pct": change[0], "delta_ppl_ci": list(change[1:]),
                        "recovered_ppl": None, "recovered_ppl_ci": None,
                        "recovered_delta_ppl_pct": None, "recovered_delta_ppl_ci": None,
                        "kv_bytes_per_token": model_layout(pruned, DType.FLOAT16).bytes_per_token,
                        "block_ratios": [round(r, 4) for r in block_r],
                        "k_channels": [len(k) for k in plan.k_kept],
                        "v_channels": [len(v) for v in plan.v_kept],
                        "k_kept": [list(k) for k in plan.k_kept],
                        "v_kept": [list(v) for v in plan.v_kept]})
                    print(f"  {imp.value:6s} {ratio:.1f} {alloc.value:10s} ppl {res.ppl:10.3f} "
                          f"({change[0]:+.1f}%)", flush=True)
                    del pruned
                done[f"{imp.value}/{ratio}"] = group
                ckpt.write_text(json.dumps({"settings": settings, "groups": done}))
            sensitivities.setdefault(imp.value, {})[str(ratio)] = group["sensitivity"]
            for r in group["rows"]:
                rows.append(r)
                plans[(ratio, r["allocation"], imp.value)] = PrunePlan(
                    geo.head_dim, tuple(map(tuple, r["k_kept"])), tuple(map(tuple, r["v_kept"])))
        print(f"{imp.value}: {time.perf_counter() - t0:.0f} s", flush=True)

    # -- recovery -------------------------------------------------------------------------------
    per_ratio: list[dict[str, Any]] = []
    recovered: dict[str, Any] = {"unpruned": model}
    folders = tempfile.TemporaryDirectory(prefix="kdn-prune-bench-")
    for ratio in args.ratios:
        best = min((r for r in rows if r["ratio"] == ratio), key=lambda r: r["ppl"])
        plan = plans[(ratio, best["allocation"], best["importance"])]
        pruned = prune_model(copy.deepcopy(model), plan)
        recipe = recipe_of[ratio]
        text = training[recipe]
        rcfg = RecoveryConfig(steps=steps_for[ratio], seed=0, max_seconds=args.recover_seconds,
                              distill=args.distill, bf16=not args.fp32, lr=args.lr,
                              rank=args.rank, alpha=2 * args.rank,
                              answer_weight=recipe.answer_weight, answer_ce=recipe.answer_ce)
        ckpt_dir = args.out.with_name(f"{args.out.stem}.recovery-{ratio}")
        every = max(1, steps_for[ratio] // 10)
        rep = recover(pruned, text.ids, rcfg, answer=text.answer,
                      teacher=model if args.distill else None,
                      folder=ckpt_dir, progress=lambda s, n, loss, t, r=ratio, e=every: print(
                          f"    recovery {r:.1f}: step {s}/{n} loss {loss:.3f} {t:.0f} s "
                          f"(eta {t / s * (n - s):.0f} s)", flush=True)
                      if s % e == 0 or s == n else None)
        folder = save_pruned(pruned, Path(folders.name) / f"pruned-{ratio}", tok)
        back, _ = load_model(str(folder))  # everything below runs the reloaded copy
        x = eval_windows[0, :64][None]
        with torch.inference_mode():
            reload_exact = bool(torch.allclose(back(input_ids=x).logits,
                                               pruned(input_ids=x).logits, atol=1e-4))
        reload_layout = model_layout(back).layers == model_layout(pruned).layers
        del pruned
        res = perplexity_ci(back, eval_windows)
        change = paired_change(base, res)
        best.update({"recovered_ppl": res.ppl, "recovered_ppl_ci": [res.low, res.high],
                     "recovered_delta_ppl_pct": change[0],
                     "recovered_delta_ppl_ci": list(change[1:])})
        print(f"  {ratio:.1f} {best['allocation']}/{best['importance']}: one-shot "
              f"{best['ppl']:.3f} -> recovered {res.ppl:.3f} [{res.low:.3f}, {res.high:.3f}] "
              f"({change[0]:+.1f}% [{change[1]:+.1f}, {change[2]:+.1f}]) in {rep.steps} steps, "
              f"{rep.seconds:.0f} s", flush=True)
        recovered[str(ratio)] = back
        per_ratio.append({
            "ratio": ratio, "best_allocation": best["allocation"],
            "best_importance": best["importance"], "best_ppl": best["ppl"],
            "one_shot_ppl": best["ppl"], "one_shot_ppl_ci": best["ppl_ci"],
            "one_shot_delta_ppl_pct": best["delta_ppl_pct"],
            "recovered_ppl": res.ppl, "recovered_ppl_ci": [res.low, res.high],
            "recovered_delta_ppl_pct": change[0], "recovered_delta_ppl_ci": list(change[1:]),
            "recovery_s": rep.seconds, "recovery_steps": rep.steps,
            "recovery_resumed_from": rep.resumed_from, "recovery_stopped_by": rep.stopped_by,
            "recovery_loss_first_last": [rep.first_loss, rep.last_loss],
            "recovery_config": {k: v for k, v in vars(rcfg).items() if k != "targets"},
            "recovery_text": {"qa_share": recipe.qa_share, "qa_questions": recipe.qa_questions,
                              "tokens": text.ids.numel(),
                              "answer_tokens": int(text.answer.sum())},
            "reloaded_through_load_model": reload_exact and reload_layout,
            "kv_bytes_per_token": best["kv_bytes_per_token"],
            "kv_fraction_of_fp16": best["kv_bytes_per_token"] / fp16_bpt})

    print_table(rows, COLUMNS)

    # -- compression on the recovered models ----------------------------------------------------
    codecs_of: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, str] = {}
    for name, m in recovered.items():
        t0 = time.perf_counter()
        codecs_of[name] = compression(m, codec_text, codec_ctx)
        chosen[name] = choose_codec(codecs_of[name])["codec"]
        print(f"  codecs {name}: {time.perf_counter() - t0:.0f} s; smallest within "
              f"{QUALITY_BAR_PCT:g}% ΔPPL: {chosen[name]}", flush=True)
        print_table(codecs_of[name], ["codec", "bytes_per_token", "delta_ppl_pct", "top1"])
    for r in per_ratio:
        c = next(x for x in codecs_of[str(r["ratio"])] if x["codec"] == chosen[str(r["ratio"])])
        r.update({"stored_bytes_per_token": c["bytes_per_token"], "stored_codec": c["codec"],
                  "stored_codec_delta_ppl_pct": c["delta_ppl_pct"],
                  "stored_codec_delta_ppl_ci": c["delta_ppl_ci"],
                  "stored_fraction_of_fp16": c["bytes_per_token"] / fp16_bpt,
                  "codecs": codecs_of[str(r["ratio"])]})

    # -- answers: full prefill, and through kdn ------------------------------------------------
    from kdn.client import Client
    from kdn.server import ServerConfig, ServerThread

    qas = split.questions("evaluation", n_questions, seed=0)
    f1: dict[str, dict[str, list[float]]] = {}
    via_kdn: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, ServerThread(ServerConfig(
            port=0, data_dir=Path(tmp), disk_bytes=0)) as st, Client(st.address) as client:
        for name, m in recovered.items():
            t0 = time.perf_counter()
            direct = answers(m, tok, qas)
            through, info = kdn_answers(m, tok, qas, chosen[name], f"prune-{name}", client)
            f1[name] = {"prefill": f1_scores(direct, qas), "kdn": f1_scores(through, qas)}
            via_kdn[name] = {**info, "codec": chosen[name],
                             "f1": sum(f1[name]["kdn"]) / n_questions,
                             "agreement_with_prefill": sum(a == b for a, b in zip(
                                 direct, through)) / n_questions}
            print(f"  answers {name}: F1 {sum(f1[name]['prefill']) / n_questions:.3f} (prefill)"
                  f", {via_kdn[name]['f1']:.3f} (kdn, {chosen[name]}); "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    base_f1 = sum(f1["unpruned"]["prefill"]) / n_questions
    for r in per_ratio:
        mine = f1[str(r["ratio"])]
        d = paired_f1_change(f1["unpruned"]["prefill"], mine["prefill"])
        dk = paired_f1_change(f1["unpruned"]["kdn"], mine["kdn"])
        r.update({"answer_f1": sum(mine["prefill"]) / n_questions, "answer_f1_delta": d[0],
                  "answer_f1_delta_ci": list(d[1:]), "answer_f1_kdn": via_kdn[str(r["ratio"])],
                  "answer_f1_kdn_delta": dk[0], "answer_f1_kdn_delta_ci": list(dk[1:])})

    # -- TTFT and speed -------------------------------------------------------------------------
    ttft_ids = eval_text[:ttft_tokens].tolist()
    ttft = hit_vs_prefill(recovered, tok, ttft_ids, chosen, reps)
    for name, per in ttft.items():
        if isinstance(per, dict):
            for codec, t in per.items():
                print(f"  ttft {name} {codec}: prefill {t['prefill_ttft_s']:.3f} s, hit "
                      f"{t['hit_ttft_s']:.3f} s ({t['hit_vs_prefill']:.2f}x)", flush=True)
    speed_ids = eval_text[-speed_ctx:]
    speeds: dict[str, list[tuple[float, float]]] = {name: [] for name in recovered}
    for _ in range(reps):  # interleaved, best of the repeats
        for name, m in recovered.items():
            speeds[name].append(speed(m, speed_ids, speed_new))
    speed_rows = [{"model": name, "prefill_tok_s": max(p for p, _ in v),
                   "decode_tok_s": max(d for _, d in v)} for name, v in speeds.items()]
    for r in per_ratio:
        s = next(x for x in speed_rows if x["model"] == str(r["ratio"]))
        r["prefill_tok_s"], r["decode_tok_s"] = s["prefill_tok_s"], s["decode_tok_s"]
        r["hit_vs_prefill"] = ttft[str(r["ratio"])]

    print_table([{k: v for k, v in r.items() if not isinstance(v, (dict, list))}
                 for r in per_ratio],
                ["ratio", "best_allocation", "best_importance", "one_shot_ppl", "recovered_ppl",
                 "recovered_delta_ppl_pct", "recovery_s", "stored_bytes_per_token",
                 "stored_codec", "answer_f1", "answer_f1_delta"])
    print_table(speed_rows, ["model", "prefill_tok_s", "decode_tok_s"])

    targets = check_targets(args, rows, per_ratio, base, base_f1, fp16_bpt, n_questions)
    for t in targets:
        print(("MET     " if t["met"] else "MISSED  ") + t["target"])
    elapsed = time.perf_counter() - t_start
    table_rows = [{k: v for k, v in r.items() if k not in ("k_kept", "v_kept")} for r in rows]
    write_json(args.out, "prune", table_rows, model="smollm2-135m", quick=args.quick,
               calib_tokens=calib_n, eval_tokens=base.tokens, eval_windows=base.windows,
               eval_window_tokens=window,
               articles={"calibration": [split.calibration.start, split.calibration.stop],
                         "training": [split.training.start, split.training.stop],
                         "evaluation": [split.evaluation.start, split.evaluation.stop]},
               unpruned_ppl=base_ppl, unpruned_ppl_ci=[base.low, base.high],
               unpruned_answer_f1=base_f1,
               unpruned_answer_f1_kdn=via_kdn["unpruned"], questions=n_questions,
               fp16_bytes_per_token=fp16_bpt, per_ratio=per_ratio,
               unpruned_codecs=codecs_of["unpruned"], unpruned_stored_codec=chosen["unpruned"],
               unpruned_hit_vs_prefill=ttft["unpruned"], ttft_prompt_tokens=len(ttft_ids),
               speed=speed_rows,
               unpruned_prefill_tok_s=speed_rows[0]["prefill_tok_s"],
               unpruned_decode_tok_s=speed_rows[0]["decode_tok_s"],
               codec_windows=codec_windows, codec_context_tokens=codec_ctx,
               codec_eval_tokens=codec_eval, speed_context_tokens=speed_ctx,
               speed_new_tokens=speed_new, sensitivity_delta_ppl=sensitivities,
               lora_recovery=f"peft LoRA r{args.rank} on q/k/v/o/gate/up/down, merged; loss "
                             f"{1 - args.distill:g} x cross-entropy + {args.distill:g} x KL "
                             "from the unpruned model, answer positions weighed per ratio "
                             "(per_ratio recovery_config, recovery_text); best one-shot "
                             "combination of each ratio",
               torch_threads=torch.get_num_threads(), elapsed_s=elapsed, targets=targets)
    plot(args.png or args.out.with_suffix(".png"), rows, per_ratio, base, fp16_bpt,
         codecs_of, chosen, f1, ttft)
    ckpt.unlink(missing_ok=True)
    clear_memo()
    folders.cleanup()


def _load_checkpoint(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Groups (importance/ratio) measured by an interrupted run with the same settings."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(doc["groups"]) if doc.get("settings") == settings else {}


if __name__ == "__main__":
    main()
