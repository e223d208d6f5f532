"""How the removed channels should split between K and V: one-shot perplexity of SmolLM2-135M
pruned at one ratio with ``PruneConfig.k_share`` swept (no recovery).

    python -m bench.prune_kshare [--quick] [--ratio 0.5] [--out bench/results/prune_kshare.json]

Everything else as ``bench.prune`` and ``bench.prune_recipes`` prune: Taylor importance on 128
calibration tokens, the block allocation ``--allocation`` (rank-based by default, the 50%
model's), its sensitivity at the ratio. Each row: ``k_share`` (0.5: K and V at the same ratio),
the ratios that gives K and V, and the perplexity on the held-out windows (16 x 512 tokens)
with its change against the unpruned model on the same windows. A one-shot sweep says which
split starts the recovery from less damage; it is no measure of the recovered model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from bench.common import arg_parser, print_table, write_json
from kdn.models import load_model
from kdn.prune import (
    Allocation,
    Geometry,
    Importance,
    PruneConfig,
    TailRunner,
    block_sensitivity,
    channel_scores,
    make_plan,
    prune_model,
)
from kdn.prune.evaluate import ArticleSplit, paired_change, perplexity_ci


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "prune_kshare", "two shares on 2 short windows (smoke run)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--allocation", default="rank-based", choices=[a.value for a in Allocation])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7])
    args = ap.parse_args(argv)
    shares = args.shares[:2] if args.quick else args.shares
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m")
    split = ArticleSplit.default()
    calib = split.token_ids("calibration", tok, 64 if args.quick else 128)
    windows = split.windows("evaluation", tok, 2 if args.quick else 16, 128 if args.quick else 512)
    base = perplexity_ci(model, windows)
    imp = Importance("taylor")
    scores = channel_scores(model, imp, calib)
    sens = block_sensitivity(model, calib, scores, args.ratio, TailRunner(model, calib))
    rows: list[dict[str, Any]] = []
    for share in shares:
        cfg = PruneConfig(args.ratio, Allocation(args.allocation), imp, k_share=share)
        plan, _ = make_plan(Geometry.of(model), scores, cfg, sens)
        res = perplexity_ci(prune_model(copy.deepcopy(model), plan), windows)
        change = paired_change(base, res)
        rows.append({"ratio": args.ratio, "allocation": args.allocation, "k_share": share,
                     "k_ratio": cfg.k_ratio, "v_ratio": cfg.v_ratio,
                     "kept_fraction": plan.kept_fraction(), "one_shot_ppl": res.ppl,
                     "delta_ppl_pct": change[0], "delta_ppl_ci": list(change[1:])})
    print_table(rows, ["k_share", "k_ratio", "v_ratio", "kept_fraction", "one_shot_ppl",
                       "delta_ppl_pct"])
    write_json(args.out, "prune_kshare", rows, unpruned_ppl=base.ppl, eval_tokens=base.tokens,
               importance="taylor", torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
