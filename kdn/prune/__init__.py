"""KVPruner for kdn: structurally prune KV channels per block, keep the model in transformers.

    from kdn.prune import PruneConfig, kvprune, save_pruned, load_pruned
    result = kvprune(model, calib_ids, PruneConfig(0.2, "ppl-based", "taylor"))
    save_pruned(result.model, folder, tokenizer); model = load_pruned(folder)

``importance`` (Phase B: L1/L2/Taylor channel scores, GQA- and RoPE-aware), ``sensitivity``
(ΔPPL of each block pruned alone), ``allocate`` (Phase A: uniform, PPL-based, rank-based
block ratios; exact integer counts), ``apply`` (PrunedAttention, plan, save/load), ``pruner``
(the one-shot pipeline). The pruned model's config carries ``kdn_pruned``, so
``KVLayout.from_config`` records the kept channels and its caches go through kdn unchanged.
"""

from kdn.extras import model_side

with model_side("kdn.prune"):  # kdn[model] not installed: MissingExtra
    from kdn.prune.allocate import Allocation, block_ratios, default_cap, removal_counts
    from kdn.prune.apply import (
        PrunedAttention,
        PrunePlan,
        load_pruned,
        plan_from_counts,
        prune_model,
        pruned_plan,
        save_pruned,
        zero_pruned_channels,
    )
    from kdn.prune.importance import ChannelScores, Geometry, Importance, channel_scores
    from kdn.prune.pruner import PruneConfig, PruneResult, kvprune, make_plan
    from kdn.prune.sensitivity import Sensitivity, TailRunner, block_sensitivity

__all__ = [
    "Allocation",
    "ChannelScores",
    "Geometry",
    "Importance",
    "PruneConfig",
    "PrunePlan",
    "PruneResult",
    "PrunedAttention",
    "Sensitivity",
    "TailRunner",
    "block_ratios",
    "block_sensitivity",
    "channel_scores",
    "default_cap",
    "kvprune",
    "load_pruned",
    "make_plan",
    "plan_from_counts",
    "prune_model",
    "pruned_plan",
    "removal_counts",
    "save_pruned",
    "zero_pruned_channels",
]
