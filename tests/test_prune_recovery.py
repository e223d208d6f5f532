"""KVPruner's recovery and evaluation mechanics on tiny random Llamas (the real model's figures
are bench.prune's): LoRA lowers the loss (cross-entropy or distillation from the unpruned
model) and merges back without changing the pruned per-layer layout; it is deterministic for
a seed, bounded by steps and time, and a resumed run equals an uninterrupted one bit for bit;
the recovered model saves as a transformers folder and loads back through kdn's model loader;
its KV is stored in kdn under its own layout, retrieved, blended and answered with; evaluation
text never meets training text; intervals bracket their estimates; bad inputs are named."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")

from kdn.client import Client  # noqa: E402
from kdn.errors import InvalidArgument, InvalidLayout  # noqa: E402
from kdn.model.data import SquadArticle, SquadParagraph, SquadQA  # noqa: E402
from kdn.model.hf import model_layout  # noqa: E402
from kdn.prune import PruneConfig, kvprune, save_pruned  # noqa: E402
from kdn.prune import evaluate as ev  # noqa: E402
from kdn.prune.recover import DistillKL, RecoveryConfig, recover  # noqa: E402
from tests.test_prune import ids, tiny  # noqa: E402

CFG = RecoveryConfig(steps=12, batch=2, seq_len=32, rank=4, alpha=8, lr=5e-3, warmup=2,
                     seed=3)


def _pruned(seed: int = 1) -> torch.nn.Module:
    return kvprune(tiny(seed), ids(64), PruneConfig(0.5, "uniform", "l2")).model


def _train() -> torch.Tensor:
    return torch.arange(3, 3 + 600) % 11 + 3  # a pattern LoRA can learn


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _with(**kw: Any) -> RecoveryConfig:
    return dataclasses.replace(CFG, **kw)


# -- recovery --------------------------------------------------------------------------------


def test_recovery_lowers_the_loss_and_keeps_the_pruned_layout() -> None:
    model = _pruned()
    layout, before = model_layout(model), copy.deepcopy(model.state_dict())
    seen: list[tuple[int, int]] = []
    report = recover(model, _train(), CFG, progress=lambda s, n, loss, t: seen.append((s, n)))
    assert report.steps == 12 and report.stopped_by == "steps" and len(report.losses) == 12
    assert seen == [(s, 12) for s in range(1, 13)]  # progress after every step
    assert report.last_loss < report.first_loss - 0.1
    assert model_layout(model).layers == layout.layers  # same per-layer kept channels
    after = model.state_dict()
    assert set(after) == set(before) and not any("lora" in k for k in after)  # merged
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_distillation_from_the_unpruned_model_lowers_the_kl() -> None:
    teacher = tiny(1)
    model = kvprune(teacher, ids(64), PruneConfig(0.5, "uniform", "l2")).model
    report = recover(model, ids(600, 4), _with(distill=1.0, lr=1e-2), teacher=teacher)
    assert report.last_loss < report.first_loss
    with pytest.raises(InvalidArgument, match="needs the unpruned teacher"):
        recover(_pruned(), _train(), _with(distill=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_distillation_loss_equals_the_unfused_one_and_its_gradient(
        dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    # 3 sequences of 70 positions: row chunks of 64 leave a remainder in each sequence
    logits = (torch.randn(3, 70, 300, generator=g) * 4).to(dtype).requires_grad_()
    target = (torch.randn(3, 70, 300, generator=g) * 4).to(dtype)
    flat = logits.float().reshape(-1, 300)
    ref = torch.nn.functional.kl_div(torch.log_softmax(flat, -1),
                                     torch.log_softmax(target.float().reshape(-1, 300), -1),
                                     log_target=True, reduction="batchmean")
    (ref * 3).backward()
    want = logits.grad.clone()  # type: ignore[union-attr]
    logits.grad = None
    got = DistillKL.apply(logits, target)
    (got * 3).backward()
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 1e-4 * float(ref)
    assert logits.grad is not None and logits.grad.dtype == dtype
    # bfloat16: the gradient is rounded when stored and again when scaled (2**-8 each)
    tol = 1e-7 if dtype == torch.float32 else 2 ** -6 * float(want.abs().max())
    assert float((logits.grad.float() - want.float()).abs().max()) <= tol
    same = DistillKL.apply(logits.detach(), logits.detach())
    assert abs(float(same)) < 1e-6  # no divergence from itself
    with pytest.raises(InvalidArgument, match="must both be"):
        DistillKL.apply(logits, target[:, :-1])


def test_the_weighted_distillation_loss_weighs_each_position() -> None:
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(2, 70, 50, generator=g) * 3).requires_grad_()
    target = torch.randn(2, 70, 50, generator=g) * 3
    weights = torch.where(torch.rand(2, 70, generator=g) < 0.1, 10.0, 1.0)
    per = (torch.softmax(target, -1) * (torch.log_softmax(target, -1)
                                        - torch.log_softmax(logits, -1))).sum(-1)
    ref = (per * weights).sum() / weights.sum()
    ref.backward()
    want = logits.grad.clone()  # type: ignore[union-attr]
    logits.grad = None
    got = DistillKL.apply(logits, target, weights)
    got.backward()
    assert abs(float(got) - float(ref)) < 1e-5 * float(ref)
    assert float((logits.grad - want).abs().max()) < 1e-7  # type: ignore[operator]
    plain = DistillKL.apply(logits.detach(), target)
    ones = DistillKL.apply(logits.detach(), target, torch.ones(2, 70))
    assert abs(float(plain) - float(ones)) < 1e-6 and abs(float(plain) - float(ref)) > 1e-3
    for bad in (torch.ones(2, 69), -torch.ones(2, 70), torch.zeros(2, 70)):
        with pytest.raises(InvalidArgument, match="weights must be"):
            DistillKL.apply(logits, target, bad)


def test_answer_positions_weigh_as_configured_and_need_their_mask() -> None:
    teacher = tiny(1)
    train = ids(600, 4)
    mask = torch.zeros(600, dtype=torch.bool)
    mask[::7] = True
    runs = []
    for weight in (1.0, 20.0):
        model = kvprune(teacher, ids(64), PruneConfig(0.5, "uniform", "l2")).model
        cfg = _with(distill=1.0, answer_weight=weight, steps=3)
        runs.append((recover(model, train, cfg, answer=mask, teacher=teacher), model))
    assert runs[0][0].losses != runs[1][0].losses  # the weights change what is trained
    same = kvprune(teacher, ids(64), PruneConfig(0.5, "uniform", "l2")).model
    plain = recover(same, train, _with(distill=1.0, steps=3), teacher=teacher)
    assert plain.losses == runs[0][0].losses and _same(same, runs[0][1])  # weight 1: no change
    with pytest.raises(InvalidArgument, match="needs the answer mask"):
        recover(_pruned(), _train(), _with(answer_weight=5.0))
    with pytest.raises(InvalidArgument, match="bool mask of the training text's 600"):
        recover(_pruned(), _train(), _with(answer_weight=5.0), answer=mask[:-1])
    with pytest.raises(InvalidArgument, match="bool mask"):
        recover(_pruned(), _train(), _with(answer_weight=5.0), answer=mask.long())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="answer_weight"):
            _with(answer_weight=bad)


def test_answer_cross_entropy_teaches_the_marked_tokens() -> None:
    teacher = tiny(1)
    train = _train()
    mask = torch.zeros(600, dtype=torch.bool)
    mask[::5] = True

    def answer_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = model(input_ids=train[None]).logits[0, :-1]
        marked = mask[1:]
        return float(torch.nn.functional.cross_entropy(logits[marked], train[1:][marked]))

    losses = []
    for weight in (0.0, 5.0):
        model = kvprune(teacher, ids(64), PruneConfig(0.5, "uniform", "l2")).model
        recover(model, train, _with(distill=1.0, answer_ce=weight, steps=8), answer=mask,
                teacher=teacher)
        losses.append(answer_loss(model))
    assert losses[1] < losses[0] - 0.1  # the answers' own labels, beside the teacher's KL
    with pytest.raises(InvalidArgument, match="needs the answer mask"):
        recover(_pruned(), _train(), _with(answer_ce=1.0))
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidArgument, match="answer_ce"):
            _with(answer_ce=bad)


def test_recovery_is_deterministic_and_a_resumed_run_equals_an_uninterrupted_one(
        tmp_path: Path) -> None:
    base = _pruned()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ra, rb = recover(a, _train(), CFG), recover(b, _train(), CFG)
    assert _same(a, b) and ra.losses == rb.losses
    ck = tmp_path / "ck"
    c = copy.deepcopy(base)  # stopped by the time bound after its first step
    first = recover(c, _train(), _with(max_seconds=1e-9), folder=ck)
    assert first.stopped_by == "time" and first.steps == 1
    over = recover(copy.deepcopy(base), _train(), _with(max_seconds=1e-9), folder=ck)
    assert over.steps == 1 and over.stopped_by == "time"  # resumed past its bound: no step
    assert {p.name for p in ck.iterdir()} == {"adapter.safetensors", "optimizer.safetensors",
                                              "recovery_state.json"}
    d = copy.deepcopy(base)  # a new process starts from the pruned model again
    resumed = recover(d, _train(), CFG, folder=ck)
    assert resumed.resumed_from == 1 and resumed.steps == 12 and resumed.stopped_by == "steps"
    assert resumed.losses == ra.losses  # the history carried over, then the same steps
    assert _same(d, a)  # adapters, AdamW moments and batches restored: bit for bit
    e = copy.deepcopy(base)  # a finished checkpoint: nothing to train, the same model
    again = recover(e, _train(), CFG, folder=ck)
    assert again.resumed_from == 12 and again.seconds == resumed.seconds and _same(e, a)


def test_the_time_bound_is_kept_not_crossed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that would take the training past ``max_seconds`` at the run's pace is not
    started (with every step taking 10 s and a 25 s bound: two steps, 20 s, not three)."""
    import types

    from kdn.prune import recover as rec

    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(rec, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    report = recover(_pruned(), _train(), _with(max_seconds=25.0))
    assert report.stopped_by == "time" and report.steps == 2 and report.seconds == 20


def test_a_resumed_run_keeps_the_time_bound_from_its_first_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A resumed run has no pace of its own before its first step: it takes the pace of the run
    it resumes (10 s a step), so a checkpoint at 20 s of a 25 s bound takes no step (one took
    the 50% model of bench.prune from 1799 s to 1804 s)."""
    import types

    from kdn.prune import recover as rec

    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(rec, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    ck = tmp_path / "ck"
    first = recover(_pruned(), _train(), _with(max_seconds=25.0), folder=ck)
    assert first.steps == 2 and first.seconds == 20
    again = recover(_pruned(), _train(), _with(max_seconds=25.0), folder=ck)
    assert again.steps == 2 and again.seconds == 20 and again.stopped_by == "time"
    longer = recover(_pruned(), _train(), _with(max_seconds=45.0), folder=ck)
    assert longer.steps == 4 and longer.seconds == 40 and longer.stopped_by == "time"


def test_a_checkpoint_of_other_settings_or_a_broken_one_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    recover(_pruned(), _train(), _with(steps=2), folder=ck)
    for other in (_with(steps=2, rank=8), _with(steps=3), _with(steps=2, seed=4)):
        with pytest.raises(InvalidArgument, match="other settings"):
            recover(_pruned(), _train(), other, folder=ck)
    # the same settings on another text, or the same text weighed at other positions
    weighed = _with(steps=2, answer_weight=3.0)
    recover(_pruned(), _train(), weighed, answer=_train() == 5, folder=tmp_path / "w")
    for text, mask, cfg, folder in ((_train().flip(0), None, _with(steps=2), ck),
                                    (_train(), _train() == 6, weighed, tmp_path / "w")):
        with pytest.raises(InvalidArgument, match="another text"):
            recover(_pruned(), text, cfg, answer=mask, folder=folder)
    assert recover(_pruned(), _train(), weighed, answer=_train() == 5,
                   folder=tmp_path / "w").resumed_from == 2
    (ck / "optimizer.safetensors").unlink()
    with pytest.raises(InvalidArgument, match="lacks optimizer.safetensors"):
        recover(_pruned(), _train(), _with(steps=2), folder=ck)
    (ck / "recovery_state.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not a recovery state"):
        recover(_pruned(), _train(), _with(steps=2), folder=ck)
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match="not a directory"):
        recover(_pruned(), _train(), CFG, folder=tmp_path / "file")


def test_bad_recovery_inputs_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="shorter than one sequence"):
        recover(_pruned(), torch.arange(3, 20), CFG)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        recover(_pruned(), torch.arange(0, 600), CFG)  # ids past the 96-token vocabulary
    for bad in ({"steps": 0}, {"lr": 0.0}, {"distill": 1.5}, {"targets": ()}):
        with pytest.raises(InvalidArgument):
            RecoveryConfig(**bad)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    with pytest.raises(InvalidArgument, match="needs peft"):
        recover(_pruned(), _train(), CFG)


# -- the recovered model as a folder, and through kdn ------------------------------------------


def _word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="t0", eos_token="t1")


def test_a_recovered_model_round_trips_through_the_model_loader(tmp_path: Path) -> None:
    from kdn.model.models import clear_memo, load_model

    model = _pruned()
    recover(model, _train(), CFG)
    folder = save_pruned(model, tmp_path / "recovered", _word_tokenizer())
    assert json.loads((folder / "config.json").read_text())["kdn_pruned"]["k_kept"]
    back, tok = load_model(str(folder))
    try:
        x = ids(40, 5)[None]
        with torch.inference_mode():
            torch.testing.assert_close(back(input_ids=x).logits, model(input_ids=x).logits,
                                       atol=1e-4, rtol=1e-4)
        layout = model_layout(back)
        assert layout.layers == model_layout(model).layers  # per-layer kept channels
        assert tok("t5 t7")["input_ids"] == [5, 7]
    finally:
        clear_memo()
    with pytest.raises(FileNotFoundError, match="nor a local model folder"):
        load_model(str(tmp_path / "missing"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(InvalidLayout, match="model.safetensors"):
        load_model(str(folder))


def test_a_recovered_model_is_stored_retrieved_blended_and_answered_with(
        client: Client) -> None:
    from kdn.keys import chunk_key
    from kdn.rag import RagConfig, RagEngine
    from tests.test_rag import CharTokenizer, tiny_llama

    full = tiny_llama()
    tok = CharTokenizer()
    calib = torch.tensor(tok("the cat sat on the mat. " * 6)["input_ids"])
    model = kvprune(full, calib, PruneConfig(0.5, "ppl-based", "taylor")).model
    text = torch.tensor(tok("a dog ran in the park and a cat sat on the mat. " * 12)
                        ["input_ids"])
    recover(model, text, _with(steps=3), teacher=full)
    doc = "The river Rhine flows through Basel and Cologne to the North Sea."
    qa = [(doc, "Where does it flow?", ("North Sea",))]
    engine = RagEngine(model, tok, client, RagConfig(blend_ratio=1.0, max_new_tokens=5,
                                                     mode="kdn", level="high"))
    assert engine.layout == model_layout(model) and engine.layout != model_layout(full)
    key = engine.key(tok(doc)["input_ids"])
    assert key != chunk_key(tok(doc)["input_ids"], model_layout(full), "rag")  # layout in key
    miss = engine.answer(qa[0][1], [doc])
    assert miss.timings.missing_chunks == 1
    got = client.retrieve(key, namespace="rag", layout=engine.layout)
    assert got is not None and got.layout == engine.layout  # its own layout, from kdn
    hit = engine.answer(qa[0][1], [doc])
    assert hit.timings.missing_chunks == 0
    # a full recompute of the blended prompt: what a full prefill of the same ids answers
    assert hit.text == ev.answers(model, tok, qa, max_new_tokens=5)[0]


# -- evaluation ------------------------------------------------------------------------------


def _articles(n: int = 6) -> list[SquadArticle]:
    def para(a: int, p: int) -> SquadParagraph:
        text = " ".join(f"w{a}.{p}.{i}" for i in range(60))  # no run of words repeats
        return SquadParagraph(text, (SquadQA(f"{a}-{p}", f"what is {a}/{p}?", (f"w{a}.{p}.0",),
                                             (0,)),))

    return [SquadArticle(f"article {a}", tuple(para(a, p) for p in range(3)))
            for a in range(n)]


class WordIds:
    """One token per whitespace word, ids from a shared table (no chat template)."""

    def __init__(self) -> None:
        self.table: dict[str, int] = {}

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [self.table.setdefault(w, len(self.table)) for w in text.split()]}


def test_the_split_keeps_evaluation_text_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="article ranges overlap.*share articles \\[8, 9\\]"):
        ev.ArticleSplit(range(0, 2), range(2, 10), range(8, 12))
    with pytest.raises(InvalidArgument, match="non-empty range"):
        ev.ArticleSplit(range(0, 2), range(2, 2), range(8, 12))
    split = ev.ArticleSplit.default()
    assert not set(split.evaluation) & (set(split.training) | set(split.calibration))

    monkeypatch.setattr(ev, "load_squad_dev", _articles)
    split = ev.ArticleSplit(range(0, 1), range(1, 4), range(4, 6))
    tok = WordIds()
    win = split.windows("evaluation", tok, 5, 20)
    assert win.shape == (5, 21)
    assert len(set(win[:, 0].tolist())) == 5  # spread over both articles, never overlapping
    train = split.recovery_ids(tok, qa_share=0.5)
    text = split.recovery_text(tok, qa_share=0.5)
    assert torch.equal(text.ids, train) and text.answer.shape == train.shape
    words = {v: k for k, v in tok.table.items()}
    marked = [words[int(i)] for i in text.ids[text.answer]]
    refs = [w for a in _articles()[1:4] for p in a.paragraphs for q in p.qas
            for w in q.answers[0].split()]
    assert marked and all(w in refs for w in marked)  # the reference answers, nothing else
    assert 0 < int(text.answer.sum()) < train.numel() // 4
    everything = split.recovery_text(tok, qa_share=1.0)
    assert int(everything.answer.sum()) > int(text.answer.sum())
    assert not split.recovery_text(tok, qa_share=0.0).answer.any()
    ev.check_disjoint(train, win, n=8)  # different articles: no shared run
    with pytest.raises(InvalidArgument, match="texts overlap"):
        ev.check_disjoint(split.token_ids("evaluation", tok), win, n=8)
    with pytest.raises(InvalidArgument, match="beyond the 6"):
        ev.ArticleSplit(range(0, 1), range(1, 4), range(4, 9)).articles("evaluation")
    with pytest.raises(InvalidArgument, match="too few"):
        split.windows("evaluation", tok, 4, 200)
    with pytest.raises(InvalidArgument, match="unknown use"):
        split.articles("test")
    qas = split.questions("evaluation", 4, seed=1)
    assert qas == split.questions("evaluation", 4, seed=1) and len(set(qas)) == 4
    assert all(c in {p.context for a in _articles()[4:6] for p in a.paragraphs}
               for c, _, _ in qas)


def test_intervals_bracket_their_estimates() -> None:
    model = tiny(2)
    res = ev.perplexity_ci(model, ids(600, 9).reshape(10, 60), boot=300)
    assert res.windows == 10 and res.tokens == 590
    assert res.low <= res.ppl <= res.high and res.low < res.high
    same = ev.paired_change(res, res, boot=300)
    assert same == (0.0, 0.0, 0.0)
    other = ev.perplexity_ci(tiny(3), ids(600, 9).reshape(10, 60), boot=300)
    change, lo, hi = ev.paired_change(res, other, boot=300)
    assert change == pytest.approx(100 * (other.ppl / res.ppl - 1)) and lo <= change <= hi
    with pytest.raises(InvalidArgument, match="same windows"):
        ev.paired_change(res, ev.perplexity_ci(model, ids(300, 9).reshape(5, 60)))
    with pytest.raises(InvalidArgument, match="two windows"):
        ev.perplexity_ci(model, ids(50).reshape(1, 50))
    d, lo, hi = ev.paired_f1_change([0.0, 1.0, 0.5, 0.0], [0.0, 0.5, 0.5, 1.0], boot=300)
    assert d == pytest.approx(0.125) and lo <= d <= hi
    assert ev.mean_f1(["beta", "no"], [("", "", ("the beta",)), ("", "", ("yes",))]) == 0.5


def test_bench_prune_takes_one_recipe_value_or_one_per_ratio() -> None:
    from bench.prune import per_ratio_values

    assert per_ratio_values([5], [0.2, 0.5], "--qa-questions") == [5, 5]
    assert per_ratio_values([5, 1], [0.2, 0.5], "--qa-questions") == [5, 1]
    with pytest.raises(SystemExit, match="--qa-questions: give one value or one per ratio"):
        per_ratio_values([5, 1, 2], [0.2, 0.5], "--qa-questions")
