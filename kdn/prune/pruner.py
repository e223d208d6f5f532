"""KVPruner one-shot: Phase A (per-block ratios) + Phase B (channels) -> a pruned model.

    cfg = PruneConfig(ratio=0.2, allocation="ppl-based", importance="taylor")
    result = kvprune(model, calib_ids, cfg)          # prunes a deep copy unless inplace=True
    save_pruned(result.model, "out/", tokenizer)     # reload with load_pruned("out/")

Scores and sensitivities are pure functions of (model, calibration ids, metric, ratio); callers
that sweep allocations pass them in to avoid recomputing them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from kdn.errors import InvalidArgument
from kdn.prune.allocate import Allocation, block_ratios, default_cap, removal_counts
from kdn.prune.apply import PrunePlan, plan_from_counts, prune_model
from kdn.prune.importance import (
    ChannelScores,
    Geometry,
    Importance,
    calibration_ids,
    channel_scores,
    check_unpruned,
)
from kdn.prune.sensitivity import Sensitivity, block_sensitivity


@dataclass(frozen=True)
class PruneConfig:
    """What to prune and how."""

    ratio: float
    """Global fraction of K+V channels to remove (mean of the block ratios)."""
    allocation: Allocation = Allocation.PPL
    """How the ratio is spread over blocks (uniform, ppl-based, rank-based)."""
    importance: Importance = Importance.TAYLOR
    """Channel importance metric (l1, l2, taylor)."""
    cap: float | None = None
    """Largest ratio one block may get; None = ``default_cap(ratio)``."""
    eps: float = 1e-6
    """ε of the PPL-based rule 1/(e^ΔPPL + ε)."""
    k_share: float = 0.5
    """Share of the removed K+V channels taken from K (0.5: K and V at the same ratio; more
    prunes keys harder, whose channels are the more redundant: low-rank, rotary pairs of
    little weight). K's ratio is 2·k_share·ratio and V's 2·(1−k_share)·ratio, per block in
    proportion to the block's ratio."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "allocation", Allocation(self.allocation))
        object.__setattr__(self, "importance", Importance(self.importance))
        if not 0.0 <= self.ratio < 1.0:
            raise InvalidArgument(f"ratio must be in [0, 1), got {self.ratio}")
        if self.cap is not None and not self.ratio <= self.cap <= 1.0:
            raise InvalidArgument(f"cap must be in [ratio, 1], got {self.cap}")
        if not 0 < self.eps < math.inf:
            raise InvalidArgument(f"eps must be a finite number > 0, got {self.eps}")
        if not 0.0 <= self.k_share <= 1.0:
            raise InvalidArgument(f"k_share must be in [0, 1], got {self.k_share}")
        for name, r in (("K", self.k_ratio), ("V", self.v_ratio)):
            if r >= 1.0:
                raise InvalidArgument(f"k_share {self.k_share} at ratio {self.ratio} removes "
                                      f"{r:.0%} of {name}: every block must keep some")

    @property
    def block_cap(self) -> float:
        return default_cap(self.ratio) if self.cap is None else self.cap

    @property
    def k_ratio(self) -> float:
        return 2 * self.k_share * self.ratio

    @property
    def v_ratio(self) -> float:
        return 2 * (1 - self.k_share) * self.ratio


@dataclass
class PruneResult:
    model: Any
    plan: PrunePlan
    block_ratios: list[float]
    sensitivity: Sensitivity | None


def make_plan(geo: Geometry, scores: ChannelScores, config: PruneConfig,
              sensitivity: Sensitivity | None = None) -> tuple[PrunePlan, list[float]]:
    """The kept channels for ``config``: block ratios, then exact integer counts, then channels.

    K is removed in rotary pairs (head_dim/2 units per block), V in channels (head_dim units);
    the totals are round(ratio x layers x units), so the mean block ratio is the global one.
    """
    deltas = sensitivity.delta_ppl if sensitivity is not None else None
    if config.allocation is not Allocation.UNIFORM and deltas is None:
        raise InvalidArgument(f"{config.allocation.value} allocation needs a sensitivity")
    ratios = block_ratios(config.allocation, config.ratio, geo.layers, deltas,
                          cap=config.block_cap, eps=config.eps)
    half = geo.head_dim // 2
    k_pairs = _counts(ratios, half, config.k_ratio, config, geo.layers)
    v_chans = _counts(ratios, geo.head_dim, config.v_ratio, config, geo.layers)
    return plan_from_counts(scores, k_pairs, v_chans), ratios


def _counts(ratios: list[float], units: int, part: float, config: PruneConfig,
            layers: int) -> list[int]:
    """Units of one kind (K pairs or V channels) to remove per block: round(part × layers ×
    units) in all, spread as the block ratios are (scaled by part / ratio, caps too; a
    block's scaled ratio at most 1: the cap bounds its count, the total is kept)."""
    scale = part / config.ratio if config.ratio else 1.0
    return removal_counts([min(1.0, r * scale) for r in ratios], units,
                          round(part * layers * units),
                          max_per_block=_cap_units(min(1.0, config.block_cap * scale), units))


def _cap_units(cap: float, units: int) -> int:
    return min(units - 1, -(-int(round(cap * units * 1e6)) // 1_000_000))


def kvprune(model: Any, calib_ids: torch.Tensor, config: PruneConfig, *,
            scores: ChannelScores | None = None, sensitivity: Sensitivity | None = None,
            inplace: bool = False) -> PruneResult:
    """Prune ``model``'s KV channels per ``config`` (one shot, no fine-tuning)."""
    check_unpruned(model)
    geo = Geometry.of(model)
    calib_ids = calibration_ids(model, calib_ids)
    if scores is None:
        scores = channel_scores(model, config.importance, calib_ids)
    if config.allocation is not Allocation.UNIFORM and sensitivity is None:
        sensitivity = block_sensitivity(model, calib_ids, scores, config.ratio)
    plan, ratios = make_plan(geo, scores, config, sensitivity)
    target = model if inplace else copy.deepcopy(model)
    return PruneResult(prune_model(target, plan), plan, ratios, sensitivity)
