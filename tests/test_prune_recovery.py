"""KVPruner's recovery and evaluation mechanics on a tiny random Llama (the real model's
figures are bench.prune's): LoRA lowers the loss and merges back without changing the pruned
layout; it is deterministic for a seed and resumable; the recovered model saves as a
transformers folder and loads back through kdn's model loader; evaluation text never meets
training text; the perplexity interval brackets the estimate."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from kdn.errors import InvalidArgument  # noqa: E402
from kdn.hf import model_layout  # noqa: E402
from kdn.prune import PruneConfig, kvprune, save_pruned  # noqa: E402
from kdn.prune.evaluate import ArticleSplit, perplexity_ci  # noqa: E402
from kdn.prune.recover import RecoveryConfig, recover  # noqa: E402
from tests.test_prune import ids, tiny  # noqa: E402

CFG = RecoveryConfig(steps=12, batch=2, seq_len=32, rank=4, alpha=8, lr=5e-3, seed=3)


def _pruned() -> torch.nn.Module:
    return kvprune(tiny(1), ids(64), PruneConfig(0.5, "uniform", "l2")).model


def _train() -> torch.Tensor:
    return torch.arange(3, 3 + 600) % 11 + 3  # a pattern LoRA can learn


def test_recovery_lowers_the_loss_and_keeps_the_pruned_layout() -> None:
    model = _pruned()
    layout, before = model_layout(model), copy.deepcopy(model.state_dict())
    report = recover(model, _train(), CFG)
    assert report.steps == 12 and report.stopped_by == "steps"
    assert report.last_loss < report.first_loss - 0.1
    assert model_layout(model).fingerprint == layout.fingerprint  # same per-layer channels
    after = model.state_dict()
    assert set(after) == set(before) and not any("lora" in k for k in after)  # merged
    assert any(not torch.equal(after[k], before[k]) for k in after)


def test_recovery_is_deterministic_and_resumable(tmp_path: Path) -> None:
    base = _pruned()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    recover(a, _train(), CFG)
    recover(b, _train(), CFG)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))
    c = copy.deepcopy(base)
    first = recover(c, _train(), RecoveryConfig(**{**CFG.__dict__, "steps": 6}),
                    folder=tmp_path / "ck")
    assert first.steps == 6 and (tmp_path / "ck" / "adapter.safetensors").is_file()
    d = copy.deepcopy(base)  # a new process would start from the pruned model again
    resumed = recover(d, _train(), CFG, folder=tmp_path / "ck")
    assert resumed.resumed_from == 6 and resumed.steps == 12 and len(resumed.losses) == 6
    with pytest.raises(InvalidArgument, match="other settings"):
        recover(copy.deepcopy(base), _train(), RecoveryConfig(**{**CFG.__dict__, "rank": 8}),
                folder=tmp_path / "ck")


def test_a_recovered_model_round_trips_through_the_model_loader(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from kdn.models import clear_memo, load_model

    model = _pruned()
    recover(model, _train(), CFG)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(96)}, unk_token="t0")), unk_token="t0")
    folder = save_pruned(model, tmp_path / "recovered", tok)
    back, _ = load_model(str(folder))
    try:
        x = ids(40, 5)[None]
        with torch.inference_mode():
            assert torch.allclose(model(input_ids=x).logits, back(input_ids=x).logits,
                                  atol=1e-4)
        assert model_layout(back).layers == model_layout(model).layers  # kept channels
    finally:
        clear_memo()


def test_bad_inputs_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="article ranges overlap"):
        ArticleSplit(range(0, 2), range(2, 10), range(8, 12))
    with pytest.raises(InvalidArgument, match="shorter than one sequence"):
        recover(_pruned(), torch.arange(3, 20), CFG)
    with pytest.raises(InvalidArgument, match="steps must be > 0"):
        RecoveryConfig(steps=0)
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    with pytest.raises(InvalidArgument, match="needs peft"):
        recover(_pruned(), _train(), CFG)


def test_the_default_split_keeps_evaluation_text_apart() -> None:
    split = ArticleSplit.default()
    assert not set(split.evaluation) & (set(split.training) | set(split.calibration))


def test_the_perplexity_interval_brackets_the_estimate() -> None:
    model = tiny(2)
    res = perplexity_ci(model, ids(600, 9), window=64, boot=300)
    assert res.windows == 10 and res.tokens == 590
    assert res.low <= res.ppl <= res.high and res.low < res.high
    with pytest.raises(InvalidArgument, match="two windows"):
        perplexity_ci(model, ids(50), window=64)
