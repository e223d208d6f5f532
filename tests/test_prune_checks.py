"""KVPruner's refusals of what would prune, score or train by a number that is not one: a
negative or NaN block ratio, a NaN sensitivity or ε, calibration text too short to predict a
token, an interval level outside (0, 1), an infinite learning rate, an already-pruned model,
a malformed ``kdn_pruned`` in a saved config. Each is an error of kdn's tree naming the
problem, never a plan that quietly prunes the wrong channels or a model whose weights went
NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kdn.errors import InvalidArgument
from kdn.prune import channel_scores, plan_from_counts, removal_counts
from kdn.prune.apply import kept_from_scores
from tests.test_prune import HD, LAYERS, tiny

NAN, INF = float("nan"), float("inf")


# -- counts ------------------------------------------------------------------------------------


def test_removal_counts_refuse_ratios_outside_0_1_and_totals_that_are_not_whole() -> None:
    for ratios in ([-0.25, 0.75], [NAN, 0.5], [INF, 0.0], [0.5, 1.5]):
        with pytest.raises(InvalidArgument, match="ratio must be in"):
            removal_counts(ratios, 8)
    for total in (NAN, 2.5, -1, True):
        with pytest.raises(InvalidArgument, match="total"):
            removal_counts([0.25, 0.25], 8, total)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_per_block"):
        removal_counts([0.25, 0.25], 8, max_per_block=-1)
    assert removal_counts([0.0, 0.5], 8) == [0, 4]


def test_a_block_count_outside_its_units_is_refused_not_read_as_a_slice() -> None:
    pairs, vs = torch.arange(8.0), torch.arange(16.0)
    for k, v in ((-2, 0), (8, 0), (0, -1), (0, 16), (1.0, 0)):
        with pytest.raises(InvalidArgument, match="removed must be a whole number"):
            kept_from_scores(pairs, vs, k, v)  # type: ignore[arg-type]
    kk, vk = kept_from_scores(pairs, vs, 0, 0)
    assert len(kk) == 16 and len(vk) == 16
    scores = channel_scores(tiny(), "l1")
    with pytest.raises(InvalidArgument, match="one K and one V count per block"):
        plan_from_counts(scores, [1] * (LAYERS - 1), [1] * LAYERS)
    plan = plan_from_counts(scores, [1] * LAYERS, [2] * LAYERS)
    assert all(len(k) == HD - 2 and len(v) == HD - 2 for k, v in zip(plan.k_kept, plan.v_kept))
    assert not math.isnan(plan.kept_fraction())


# -- recovery ----------------------------------------------------------------------------------


def test_recovery_refuses_a_non_finite_lr_and_a_diverging_loss_leaves_the_model_as_it_was(
        ) -> None:
    pytest.importorskip("peft")
    from kdn.prune.recover import recover
    from tests.test_prune_recovery import _pruned, _same, _train, _with

    for bad in ({"lr": INF}, {"lr": NAN}, {"steps": 2.5}, {"steps": NAN}, {"warmup": 1.5},
                {"batch": True}, {"max_seconds": NAN}):
        with pytest.raises(InvalidArgument):
            _with(**bad)
    model, before = _pruned(), _pruned()
    with pytest.raises(InvalidArgument, match="not finite"):
        recover(model, _train(), _with(lr=1e30, steps=4))
    assert _same(model, before)
    assert not any("lora_" in name for name, _ in model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# -- calibration -------------------------------------------------------------------------------


@pytest.mark.parametrize("calib", [torch.tensor([5]), torch.tensor([], dtype=torch.long),
                                   torch.tensor([[5], [6]]), torch.tensor([5.0, 6.0, 7.0]),
                                   torch.tensor([5, 96, 7]), torch.tensor([-1, 5, 6])])
def test_calibration_text_that_predicts_no_token_is_refused(calib: torch.Tensor) -> None:
    from kdn.prune import PruneConfig, TailRunner, kvprune

    model = tiny()
    for alloc in ("ppl-based", "rank-based", "uniform"):
        with pytest.raises(InvalidArgument, match="calibration ids"):
            kvprune(model, calib, PruneConfig(0.3, alloc, "l1"))
    with pytest.raises(InvalidArgument, match="calibration ids"):
        channel_scores(model, "taylor", calib)
    with pytest.raises(InvalidArgument, match="calibration ids"):
        TailRunner(model, calib)


def test_sensitivities_of_a_model_whose_outputs_are_not_finite_are_refused() -> None:
    from kdn.prune import block_sensitivity

    model = tiny()
    scores = channel_scores(model, "l1")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = NAN
    with pytest.raises(InvalidArgument, match="not finite"):
        block_sensitivity(model, torch.tensor([5, 6, 7, 8]), scores, 0.25)


# -- allocation --------------------------------------------------------------------------------


def test_a_nan_or_infinite_eps_and_nan_sensitivities_are_refused() -> None:
    from kdn.prune import PruneConfig, block_ratios

    for eps in (NAN, INF, 0.0, -1.0):
        with pytest.raises(InvalidArgument, match="eps"):
            PruneConfig(0.3, "ppl-based", eps=eps)
        with pytest.raises(InvalidArgument, match="eps"):
            block_ratios("ppl-based", 0.3, 4, [0.1, 0.2, 0.3, 0.4], eps=eps)
    for alloc in ("ppl-based", "rank-based"):
        with pytest.raises(InvalidArgument, match="block 0: sensitivity"):
            block_ratios(alloc, 0.3, 4, [NAN, 0.1, 0.2, 0.3])
        ratios = block_ratios(alloc, 0.3, 4, [INF, 0.1, 0.2, -INF])  # inf: most sensitive
        assert sum(ratios) == pytest.approx(1.2) and ratios[0] == min(ratios)


# -- evaluation --------------------------------------------------------------------------------


def test_an_interval_level_outside_0_1_or_no_resamples_is_refused() -> None:
    from kdn.prune import evaluate as ev

    parts = [(10.0, 5), (12.0, 5), (11.0, 5)]
    ci = ev.interval(parts, boot=200)
    for bad in ({"level": 1.5}, {"level": -1.0}, {"level": NAN}, {"level": 1.0},
                {"level": "0.9"}, {"boot": 0}, {"boot": 2.5}, {"boot": True}):
        kw = {"boot": 200, **bad}
        with pytest.raises(InvalidArgument, match="level|boot"):
            ev.interval(parts, **kw)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="level|boot"):
            ev.paired_change(ci, ci, **kw)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="level|boot"):
            ev.paired_f1_change([0.0, 1.0], [1.0, 1.0], **kw)  # type: ignore[arg-type]
    assert ci.low <= ci.ppl <= ci.high
    assert ev.interval(parts, boot=1, level=0.5).windows == 3


# -- a pruned model ----------------------------------------------------------------------------


def test_an_already_pruned_model_is_refused_before_it_is_scored() -> None:
    from kdn.prune import (
        PruneConfig,
        block_sensitivity,
        kvprune,
        prune_model,
        zero_pruned_channels,
    )
    from tests.test_prune import ids, random_plan

    scores = channel_scores(tiny(), "l1")
    model = prune_model(tiny(), random_plan())
    for alloc in ("uniform", "ppl-based"):
        with pytest.raises(InvalidArgument, match="already pruned"):
            kvprune(model, ids(32), PruneConfig(0.2, alloc, "l1"))
    with pytest.raises(InvalidArgument, match="already pruned"):
        channel_scores(model, "taylor", ids(32))
    with pytest.raises(InvalidArgument, match="already pruned"):
        block_sensitivity(model, ids(32), scores, 0.2)
    with pytest.raises(InvalidArgument, match="already pruned"):
        zero_pruned_channels(model, random_plan())


def test_zeroing_a_plan_of_another_shape_is_refused() -> None:
    from kdn.prune import PrunePlan, zero_pruned_channels

    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for plan in (PrunePlan.full(LAYERS - 1, HD), PrunePlan.full(LAYERS, HD // 2)):
        with pytest.raises(InvalidArgument, match="model has"):
            zero_pruned_channels(model, plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_malformed_kdn_pruned_is_refused_naming_the_field(tmp_path: Path) -> None:
    import shutil

    from kdn.errors import InvalidLayout
    from kdn.layout import KVLayout
    from kdn.model.hf import load_config
    from kdn.prune import PrunePlan, load_pruned, prune_model, save_pruned
    from tests.test_prune import random_plan

    model = prune_model(tiny(5), random_plan(5))
    good = save_pruned(model, tmp_path / "good")
    fingerprint = KVLayout.from_config(model.config).fingerprint
    assert KVLayout.from_config(load_pruned(good).config).fingerprint == fingerprint
    kk = [list(k) for k in random_plan(5).k_kept]
    cases = {
        "no v_kept": lambda p: p.pop("v_kept"),
        "k_kept must list": lambda p: p.__setitem__("k_kept", None),
        "k_kept layer 0 holds 0.5": lambda p: p.__setitem__(
            "k_kept", [[c + 0.5 for c in kk[0]]] + kk[1:]),
        r"v_kept layer 2 holds \d+\.0": lambda p: p.__setitem__(
            "v_kept", p["v_kept"][:2] + [[float(c) for c in p["v_kept"][2]]] + p["v_kept"][3:]),
        "k_kept layer 1 holds True": lambda p: p.__setitem__(
            "k_kept", [kk[0], [True] + kk[1][1:]] + kk[2:]),
        "head_dim_original": lambda p: p.__setitem__("head_dim_original", 16.5),
    }
    for i, (msg, mutate) in enumerate(cases.items()):
        folder = tmp_path / f"bad{i}"
        shutil.copytree(good, folder)
        cfg = json.loads((folder / "config.json").read_text())
        mutate(cfg["kdn_pruned"])
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InvalidLayout, match=msg):
            load_pruned(folder)
        with pytest.raises(InvalidLayout, match=msg):
            PrunePlan.from_config(cfg["kdn_pruned"], HD)
        if msg != "head_dim_original":  # the layout reads the model's head_dim
            with pytest.raises(InvalidLayout, match=msg):
                KVLayout.from_config(load_config(folder))
