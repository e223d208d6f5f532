"""Phase A of KVPruner: how much of each block to prune, from a global ratio.

Three allocations of a global ratio ``P`` over ``N`` blocks with per-block sensitivities
``ΔPPL_i`` (perplexity change on calibration text when block i alone is pruned at ``P``):

uniform
    every block ``P``.
ppl-based
    KVPruner's rule ``P_i ∝ 1 / (e^{ΔPPL_i} + ε)``. Read literally the ratios sum to ``P``
    (mean ``P/N``); kdn scales them so that the *mean* block ratio is ``P`` (so the model's KV
    shrinks by exactly ``P``): ``P_i = N·P · w_i / Σ_j w_j`` with ``w_i = 1/(e^{ΔPPL_i}+ε)``.
    ``ΔPPL_i`` is in perplexity points (absolute, not relative). A block's ratio is capped at
    ``cap``; the excess is handed to the uncapped blocks in proportion to their weights (water
    filling), so the mean stays ``P``.
rank-based
    prune only the least sensitive blocks: fill blocks to ``cap`` in order of increasing
    ``ΔPPL_i`` until the mean is ``P``. With ``cap = 1`` that is the paper's ``⌈P·N⌉`` blocks;
    a block must keep at least one rotary pair and one value channel, so the cap is below 1 and
    ``⌈P·N / cap⌉`` blocks are touched.

Ratios become integer counts of removable units per block (rotary *pairs* for K, channels for V)
by ``removal_counts``: largest remainders, so the total removed is exactly ``round(P·N·units)``
and KV bytes per token fall by ``P`` exactly whenever ``P·N·units`` is an integer.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from kdn.checks import whole
from kdn.errors import InvalidArgument


class Allocation(enum.Enum):
    """How a global pruning ratio is spread over blocks."""

    UNIFORM = "uniform"
    PPL = "ppl-based"
    RANK = "rank-based"


def default_cap(ratio: float) -> float:
    """Largest ratio one block may get: halfway from ``ratio`` to 1, at most 0.9."""
    return min(0.9, ratio + (1.0 - ratio) / 2)


def _check(ratio: float, cap: float, n: int) -> None:
    if not 0.0 <= ratio < 1.0:
        raise InvalidArgument(f"pruning ratio must be in [0, 1), got {ratio}")
    if not ratio <= cap <= 1.0:
        raise InvalidArgument(f"cap must be in [ratio, 1], got {cap} for ratio {ratio}")
    if n <= 0:
        raise InvalidArgument("need at least one block")


def _check_deltas(delta_ppl: Sequence[float]) -> None:
    """NaN orders and weighs nothing; an infinite ΔPPL (a block whose pruning overflows the
    perplexity) is the most sensitive and stays."""
    for i, d in enumerate(delta_ppl):
        if math.isnan(d):
            raise InvalidArgument(f"block {i}: sensitivity (ΔPPL) is NaN")


def uniform_ratios(n: int, ratio: float) -> list[float]:
    _check(ratio, max(ratio, 1e-12), n)
    return [ratio] * n


def ppl_ratios(delta_ppl: Sequence[float], ratio: float, cap: float,
               eps: float = 1e-6) -> list[float]:
    """PPL-based rule, mean-scaled and capped (water filling); see the module docstring."""
    n = len(delta_ppl)
    _check(ratio, cap, n)
    _check_deltas(delta_ppl)
    if not 0 < eps < math.inf:
        raise InvalidArgument(f"eps must be a finite number > 0, got {eps}")
    w = [1.0 / (math.exp(min(d, 700.0)) + eps) for d in delta_ppl]
    out = [0.0] * n
    free = set(range(n))
    budget = ratio * n
    while free:
        total = sum(w[i] for i in free)
        share = {i: budget * w[i] / total for i in free}
        over = {i for i, s in share.items() if s > cap}
        if not over:
            for i, s in share.items():
                out[i] = s
            break
        for i in over:
            out[i] = cap
            budget -= cap
            free.discard(i)
    return out


def rank_ratios(delta_ppl: Sequence[float], ratio: float, cap: float) -> list[float]:
    """Rank-based rule: least sensitive blocks first, each up to ``cap``."""
    n = len(delta_ppl)
    _check(ratio, cap, n)
    _check_deltas(delta_ppl)
    out = [0.0] * n
    budget = ratio * n
    for i in sorted(range(n), key=lambda j: (delta_ppl[j], j)):
        if budget <= 1e-12:
            break
        out[i] = min(cap, budget)
        budget -= out[i]
    return out


def block_ratios(allocation: Allocation | str, ratio: float, n: int,
                 delta_ppl: Sequence[float] | None = None, *, cap: float | None = None,
                 eps: float = 1e-6) -> list[float]:
    """Per-block ratios whose mean is ``ratio``."""
    allocation = Allocation(allocation)
    cap = default_cap(ratio) if cap is None else cap
    if allocation is Allocation.UNIFORM:
        return uniform_ratios(n, ratio)
    if delta_ppl is None or len(delta_ppl) != n:
        raise InvalidArgument(f"{allocation.value} allocation needs {n} block sensitivities")
    if allocation is Allocation.PPL:
        return ppl_ratios(delta_ppl, ratio, cap, eps)
    return rank_ratios(delta_ppl, ratio, cap)


def removal_counts(ratios: Sequence[float], units: int, total: int | None = None,
                   max_per_block: int | None = None) -> list[int]:
    """Integer units to remove per block, summing to ``total`` (default round(Σ ratios·units)).

    Floors of ``ratio·units`` first, then one unit at a time to the block furthest below its
    share (largest remainder; ties to the lower index), never above ``max_per_block``
    (default ``units - 1``: every block keeps at least one unit). InvalidArgument for a ratio
    outside [0, 1] (or NaN) and for a ``total`` or ``max_per_block`` that is not a whole number
    >= 0: a negative count would drop channels from the wrong end.
    """
    units = whole("units", units, 1)
    for i, r in enumerate(ratios):
        if not 0.0 <= r <= 1.0:  # NaN too
            raise InvalidArgument(f"block {i}: removal ratio must be in [0, 1], got {r}")
    limit = units - 1 if max_per_block is None else \
        min(whole("max_per_block", max_per_block), units - 1)
    want = [r * units for r in ratios]
    total = round(sum(want)) if total is None else whole("total", total)
    if total > limit * len(ratios) or total < 0:
        raise InvalidArgument(f"can not remove {total} of {units} units in {len(ratios)} blocks")
    counts = [min(limit, math.floor(x + 1e-9)) for x in want]
    while sum(counts) > total:  # only when the caller's total is below the floors
        i = max(range(len(counts)), key=lambda j: (counts[j] - want[j], -j))
        counts[i] -= 1
    while sum(counts) < total:
        room = [j for j in range(len(counts)) if counts[j] < limit]
        i = max(room, key=lambda j: (want[j] - counts[j], -j))
        counts[i] += 1
    return counts
