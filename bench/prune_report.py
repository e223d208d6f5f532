"""What ``bench.prune`` reports beside its table: the targets, each met or missed with its
numbers (``check_targets``), and the figure (``plot``: perplexity against KV bytes per token,
answer F1, hit against prefill TTFT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import figure, save_figure
from bench.prune_measure import QUALITY_BAR_PCT
from kdn.prune import Allocation
from kdn.prune.evaluate import PerplexityCI

PPL_BARS = {0.2: 12.0, 0.5: 50.0}
F1_BAR = 0.03


def check_targets(args: Any, rows: list[dict[str, Any]], per_ratio: list[dict[str, Any]],
                  base: PerplexityCI, base_f1: float, fp16_bpt: int, n_questions: int
                  ) -> list[dict[str, Any]]:
    """The study's targets, each with ``met`` and the numbers it was judged on."""
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
