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
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import figure, print_table, save_figure, write_json
from kdn.cache import KVCache
from kdn.codec import decode, encode
from kdn.codec.modes import get_mode
from kdn.layout import DType
from kdn.model import hf
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
    QA,
    ArticleSplit,
    PerplexityCI,
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
QUALITY_BAR_PCT = 1.0
PPL_BARS = {0.2: 12.0, 0.5: 50.0}
F1_BAR = 0.03


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


def _codecs() -> list[tuple[str, str, str]]:
    out = [("lossless", "lossless", ""), ("int8", "int8", ""), ("cachegen", "cachegen", "")]
    return out + [(f"kdn-{lv}", "kdn", lv) for lv in get_mode("kdn").levels]


def _mode_level(codec: str) -> tuple[str, str]:
    return ("kdn", codec.removeprefix("kdn-")) if codec.startswith("kdn-") else (codec, "")


# -- compression ----------------------------------------------------------------------------


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


# -- answers and the engine -------------------------------------------------------------------


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


# -- the run ----------------------------------------------------------------------------------


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

    targets = _targets(args, rows, per_ratio, base, base_f1, fp16_bpt, n_questions)
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


def _targets(args: Any, rows: list[dict[str, Any]], per_ratio: list[dict[str, Any]],
             base: PerplexityCI, base_f1: float, fp16_bpt: int, n_questions: int
             ) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []
    if 0.2 in args.ratios:
        at = {(r["allocation"], r["importance"]): r["ppl"] for r in rows if r["ratio"] == 0.2}
        ppl_based = {i: p for (a, i), p in at.items() if a == Allocation.PPL.value}
        best_imp = min(ppl_based, key=lambda i: ppl_based[i])
        targets.append({
            "target": "20%: best ppl-based combination beats uniform with the same importance "
                      "(one-shot)",
            "met": ppl_based[best_imp] < at[(Allocation.UNIFORM.value, best_imp)],
            "importance": best_imp, "ppl_based": ppl_based[best_imp],
            "uniform": at[(Allocation.UNIFORM.value, best_imp)]})
    targets.append({
        "target": "KV bytes per token fall by the pruning ratio exactly",
        "met": all(r["kv_bytes_per_token"] == round(fp16_bpt * (1 - r["ratio"])) for r in rows),
        "fp16_bytes_per_token": fp16_bpt,
        "kv_bytes_per_token": {str(r["ratio"]): r["kv_bytes_per_token"] for r in rows}})
    for r in per_ratio:
        pct = int(round(r["ratio"] * 100))
        bar = PPL_BARS.get(r["ratio"])
        if bar is not None:
            targets.append({
                "target": f"{pct}% pruned + recovered within +{bar:g}% of unpruned PPL on "
                          f"{base.tokens} held-out tokens",
                "met": r["recovered_delta_ppl_pct"] <= bar,
                "met_with_confidence": r["recovered_delta_ppl_ci"][1] <= bar,
                "recovered_ppl": r["recovered_ppl"], "recovered_ppl_ci": r["recovered_ppl_ci"],
                "unpruned_ppl": base.ppl, "unpruned_ppl_ci": [base.low, base.high],
                "delta_ppl_pct": r["recovered_delta_ppl_pct"],
                "delta_ppl_ci": r["recovered_delta_ppl_ci"]})
        targets.append({
            "target": f"{pct}%: answer F1 within {F1_BAR} of unpruned ({n_questions} questions, "
                      "same prompts, greedy)",
            "met": r["answer_f1_delta"] >= -F1_BAR,
            "answer_f1": r["answer_f1"], "unpruned_f1": base_f1,
            "delta": r["answer_f1_delta"], "delta_ci": r["answer_f1_delta_ci"],
            "through_kdn_delta": r["answer_f1_kdn_delta"]})
        if r["ratio"] == 0.5:
            targets.append({
                "target": "50%: recovery within 30 minutes of wall time on this machine",
                "met": r["recovery_s"] <= 1800, "recovery_s": r["recovery_s"],
                "steps": r["recovery_steps"], "stopped_by": r["recovery_stopped_by"]})
            targets.append({
                "target": f"50% pruning + the best codec level adding <= {QUALITY_BAR_PCT:g}% "
                          "ΔPPL on the recovered model <= 1/10 of unpruned fp16 KV",
                "met": r["stored_bytes_per_token"] <= fp16_bpt / 10,
                "stored_bytes_per_token": r["stored_bytes_per_token"],
                "limit": fp16_bpt / 10, "codec": r["stored_codec"],
                "codec_delta_ppl_pct": r["stored_codec_delta_ppl_pct"],
                "codec_delta_ppl_ci": r["stored_codec_delta_ppl_ci"]})
    return targets


def _load_checkpoint(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Groups (importance/ratio) measured by an interrupted run with the same settings."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(doc["groups"]) if doc.get("settings") == settings else {}


def plot(path: Path, rows: list[dict[str, Any]], per_ratio: list[dict[str, Any]],
         base: PerplexityCI, fp16_bpt: int, codecs_of: dict[str, list[dict[str, Any]]],
         chosen: dict[str, str], f1: dict[str, dict[str, list[float]]],
         ttft: dict[str, Any]) -> None:
    fig, (ax, ax_f1, ax_t) = figure(16, 5.2, ncols=3)
    colors = {"uniform": "tab:gray", "ppl-based": "tab:blue", "rank-based": "tab:orange"}
    markers = {"l1": "o", "l2": "s", "taylor": "^"}
    offsets = {"l1": -0.03, "l2": 0.0, "taylor": 0.03}
    for r in rows:
        x = r["kv_bytes_per_token"] * (1 + offsets[r["importance"]])
        ax.scatter(x, r["ppl"], c=colors[r["allocation"]], marker=markers[r["importance"]], s=30,
                   alpha=0.7)
    ax.errorbar([fp16_bpt], [base.ppl], yerr=[[base.ppl - base.low], [base.high - base.ppl]],
                fmt="*", color="black", ms=12, label="unpruned fp16")
    for r in per_ratio:
        lo, hi = r["recovered_ppl_ci"]
        ax.errorbar([r["kv_bytes_per_token"]], [r["recovered_ppl"]],
                    yerr=[[r["recovered_ppl"] - lo], [hi - r["recovered_ppl"]]], fmt="P",
                    color="tab:green", ms=10)
        ax.annotate("", (r["kv_bytes_per_token"], r["recovered_ppl"]),
                    (r["kv_bytes_per_token"], r["one_shot_ppl"]),
                    arrowprops={"arrowstyle": "->", "color": "tab:green", "lw": 1})
        est = r["recovered_ppl"] * (1 + r["stored_codec_delta_ppl_pct"] / 100)
        ax.scatter(r["stored_bytes_per_token"], est, facecolors="none", edgecolors="tab:green",
                   s=90, marker="D")
        ax.annotate(f"{int(r['ratio'] * 100)}% + {r['stored_codec']}",
                    (r["stored_bytes_per_token"], est), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    u = next(c for c in codecs_of["unpruned"] if c["codec"] == chosen["unpruned"])
    ax.scatter(u["bytes_per_token"], base.ppl * (1 + u["delta_ppl_pct"] / 100), marker="D",
               facecolors="none", edgecolors="black", s=90)
    ax.annotate(f"unpruned + {u['codec']}", (u["bytes_per_token"], base.ppl),
                textcoords="offset points", xytext=(6, -12), fontsize=8)
    for name, c in colors.items():
        ax.scatter([], [], c=c, label=f"one-shot, {name}")
    for name, m in markers.items():
        ax.scatter([], [], c="white", edgecolors="black", marker=m, label=name)
    ax.errorbar([], [], fmt="P", color="tab:green", label="best one-shot, recovered (95% CI)")
    ax.scatter([], [], facecolors="none", edgecolors="tab:green", marker="D",
               label=f"recovered + smallest level within {QUALITY_BAR_PCT:g}% ΔPPL")
    ax.axvline(fp16_bpt / 10, color="tab:red", ls=":", lw=1, label="1/10 of fp16")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token (SmolLM2-135M, 30 layers)")
    ax.set_ylabel(f"perplexity, {base.tokens} held-out tokens")
    ax.set_title("KVPruner: perplexity vs KV bytes per token")
    ax.legend(fontsize=6.5, ncol=2)

    names = list(f1)
    labels = ["unpruned" if n == "unpruned" else f"{int(float(n) * 100)}% pruned" for n in names]
    for j, (path_name, color) in enumerate((("prefill", "tab:blue"), ("kdn", "tab:green"))):
        vals = [sum(f1[n][path_name]) / len(f1[n][path_name]) for n in names]
        ax_f1.bar([i + 0.38 * (j - 0.5) for i in range(len(names))], vals, width=0.38,
                  color=color, label="full prefill" if path_name == "prefill"
                  else "KV from kdn, blended")
    ax_f1.set_xticks(range(len(names)), labels)
    ax_f1.set_ylabel(f"SQuAD F1 ({len(f1['unpruned']['prefill'])} held-out questions)")
    ax_f1.set_title("Answers (greedy, same prompts)")
    ax_f1.legend(fontsize=8)

    bars: list[tuple[str, float, float]] = []
    for n in names:
        for codec, t in ttft[n].items():
            bars.append((f"{labels[names.index(n)]}\n{codec}", t["prefill_ttft_s"],
                         t["hit_ttft_s"]))
    xs = range(len(bars))
    ax_t.bar([x - 0.2 for x in xs], [b[1] for b in bars], width=0.4, color="tab:gray",
             label="prefill (miss)")
    ax_t.bar([x + 0.2 for x in xs], [b[2] for b in bars], width=0.4, color="tab:green",
             label="kdn hit")
    ax_t.set_xticks(list(xs), [b[0] for b in bars], fontsize=7)
    ax_t.set_ylabel(f"TTFT, s ({ttft['prompt_tokens']}-token prompt)")
    ax_t.set_title("KDNEngine: hit vs prefill")
    ax_t.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
