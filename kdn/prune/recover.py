"""KVPruner's third step: LoRA recovery of a pruned model, merged back into its weights.

    from kdn.prune.recover import RecoveryConfig, recover
    report = recover(pruned, train_ids, RecoveryConfig(steps=300, seed=0), folder=ckpt_dir,
                     teacher=unpruned)              # teacher: optional, for distill > 0
    save_pruned(pruned, out_folder, tokenizer)     # a normal transformers folder, per-layer layout

``peft`` adds low-rank adapters to the attention and MLP projections (the pruned attention's
sliced projections included); a short causal-LM fine-tune on training text recovers most of
the quality pruning cost, and the adapters are then merged, so the model keeps its pruned
shapes and kdn sees the same per-layer KV layout. The caller draws the training text from
articles the evaluation never reads (``kdn.prune.evaluate.ArticleSplit``).

The loss is next-token cross-entropy, mixed (``distill``) with the KL divergence from an
unpruned ``teacher``'s next-token distribution on the same batch: the teacher says what the
pruned model lost, token by token, a richer signal than the one right token. Positions
that predict a reference answer's tokens can weigh more (``answer_weight``, with the mask
``ArticleSplit.recovery_text`` returns): answering from a context is where pruned K and V
channels cost most, and those tokens are a few in a hundred of the text. ``answer_ce`` adds a
cross-entropy term over those positions alone to whatever the mix is: the reference answers'
own tokens as labels, where KL alone teaches the pruned model to imitate the teacher's answers,
wrong ones included, and leaves the rest of the text to the teacher.

Lifecycle of ``recover``:

1. peft wraps the model in place (``init_lora_weights``: B = 0, so the wrapped model computes
   exactly what the pruned one did); ``torch.manual_seed(seed)`` makes the A matrices the same
   every run; dropout is off.
2. With ``folder`` holding a checkpoint of the same settings, the adapters, the AdamW moments
   and the loss history are read back (safetensors + JSON) and training goes on from the step
   it reached; a checkpoint of other settings, or of another training text or answer mask
   (a digest of both is kept with it), is refused.
3. Step s trains on windows drawn by a generator seeded with (seed, s) alone, with a short
   warm-up then cosine decay of the learning rate over ``steps``: a resumed run computes what
   an uninterrupted one does, bit for bit on the same machine.
4. It stops after ``steps`` steps, or before a step that would take the training time
   (resumed runs' included) past ``max_seconds`` at this run's pace per step (a resumed run
   judges its first step at the pace of the run it resumes); the state is written every
   ``save_every`` steps and at the end (temp files renamed into place).
5. The adapters are merged into the weights and peft's wrappers removed: the caller's model
   object is the recovered model, same modules, same shapes. A step whose loss (or whose
   adapters) is not finite, or any other error, stops the run before that: the adapters are
   dropped unmerged and the model is left as it was (InvalidArgument for the loss).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kdn.checks import whole
from kdn.errors import InvalidArgument

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATE = "recovery_state.json"
ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.safetensors"
FORMAT = 2


@dataclass(frozen=True)
class RecoveryConfig:
    steps: int = 300
    """Optimizer steps (the learning-rate schedule spans them)."""
    max_seconds: float = 1800.0
    """Wall-clock bound on training, resumed runs' time included: stop after the step that
    passes it (a later call with a larger bound goes on)."""
    rank: int = 16
    alpha: int = 32
    lr: float = 1e-3
    warmup: int = 10
    """Steps of linear learning-rate warm-up."""
    batch: int = 4
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence (windows drawn from the training text)."""
    distill: float = 0.0
    """Weight of the KL divergence from the teacher (0: cross-entropy only; 1: KL only)."""
    answer_weight: float = 1.0
    """Loss weight of a position whose next token is marked in ``recover``'s ``answer`` mask
    (the reference answers of the training text), against 1 for every other position: the
    few answer tokens are where a pruned model's reading of its context shows."""
    answer_ce: float = 0.0
    """Weight of a cross-entropy term over the positions that predict a marked answer token
    (the mean over them), added to the loss; 0 = none (module docstring)."""
    bf16: bool = False
    """Forward and backward under bfloat16 autocast (about twice as fast on CPUs with bf16
    instructions; the weights, the adapters and the optimizer stay float32)."""
    seed: int = 0
    save_every: int = 50
    """Steps between checkpoints (with ``folder``)."""
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        for name in ("steps", "rank", "alpha", "batch", "seq_len", "save_every"):
            whole(name, getattr(self, name), 1)
        whole("warmup", self.warmup)
        whole("seed", self.seed)
        if not 0 < self.lr < math.inf:
            raise InvalidArgument(f"lr must be a finite number > 0, got {self.lr}")
        if not self.max_seconds > 0:
            raise InvalidArgument(f"max_seconds must be > 0, got {self.max_seconds}")
        if not self.answer_weight > 0 or not math.isfinite(self.answer_weight):
            raise InvalidArgument(f"answer_weight must be > 0, got {self.answer_weight}")
        if not 0.0 <= self.distill <= 1.0:
            raise InvalidArgument(f"distill must be in [0, 1], got {self.distill}")
        if not self.answer_ce >= 0 or not math.isfinite(self.answer_ce):
            raise InvalidArgument(f"answer_ce must be >= 0, got {self.answer_ce}")
        if not self.targets:
            raise InvalidArgument("targets must name at least one module")

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based): linear warm-up, then cosine decay."""
        warm = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * step / self.steps))


@dataclass
class RecoveryReport:
    steps: int
    """Steps done in all (resumed runs included)."""
    seconds: float
    """Training wall time in all (resumed runs included)."""
    losses: list[float] = field(default_factory=list)
    """Training loss of every step done (resumed runs' included)."""
    resumed_from: int = 0
    stopped_by: str = "steps"
    """``steps`` or ``time``."""

    @property
    def first_loss(self) -> float:
        head = self.losses[:10]
        return sum(head) / len(head) if head else math.nan

    @property
    def last_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan


def batch_at(train_ids: torch.Tensor, cfg: RecoveryConfig, step: int,
             answer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step ``step``'s [batch, seq_len] windows, a function of (seed, step) alone, so a resumed
    run draws what an uninterrupted one would have; with ``answer``, the [batch, seq_len - 1]
    loss weight of each predicted position too (``cfg.answer_weight`` where the predicted
    token is marked, else 1)."""
    batch, marked = _windows(train_ids, cfg, step, answer)
    return batch, None if marked is None else torch.where(marked, cfg.answer_weight, 1.0)


def _windows(train_ids: torch.Tensor, cfg: RecoveryConfig, step: int,
             answer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``batch_at``'s windows and, with ``answer``, which predicted positions are marked."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, train_ids.numel() - cfg.seq_len + 1, (cfg.batch,),
                           generator=g).tolist()
    batch = torch.stack([train_ids[s:s + cfg.seq_len] for s in starts])
    if answer is None:
        return batch, None
    return batch, torch.stack([answer[s + 1:s + cfg.seq_len] for s in starts])


def recover(model: Any, train_ids: torch.Tensor, config: RecoveryConfig | None = None, *,
            answer: torch.Tensor | None = None, teacher: Any = None,
            folder: str | Path | None = None,
            progress: Callable[[int, int, float, float], None] | bool = False
            ) -> RecoveryReport:
    """Fine-tune ``model`` (pruned, in place) with LoRA on ``train_ids`` and merge the adapters
    back; returns what happened (module docstring). ``answer``: a bool mask as long as
    ``train_ids`` marking the tokens ``config.answer_weight`` weighs (needed when that is not
    1). ``teacher``: the unpruned model, needed when ``config.distill`` > 0. ``progress``:
    True for a bar on stderr (on a terminal), or a callable(step, steps, loss,
    elapsed_seconds) called after every step."""
    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    except ImportError as exc:
        raise InvalidArgument("LoRA recovery needs peft: pip install 'kdn[prune]'") from exc
    cfg = config or RecoveryConfig()
    ids = train_ids.reshape(-1).to(torch.long)
    if ids.numel() < cfg.seq_len + cfg.batch:
        raise InvalidArgument(f"training text of {ids.numel()} tokens is shorter than one "
                              f"sequence of {cfg.seq_len}")
    vocab = int(model.config.vocab_size)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InvalidArgument(f"training ids must lie in [0, {vocab}) (the model's vocabulary), "
                              f"got [{int(ids.min())}, {int(ids.max())}]")
    mask = None
    if answer is not None or cfg.answer_weight != 1.0 or cfg.answer_ce:
        if answer is None:
            raise InvalidArgument("answer_weight != 1 or answer_ce > 0 needs the answer mask "
                                  "of the training text")
        mask = answer.reshape(-1)
        if mask.dtype != torch.bool or mask.numel() != ids.numel():
            raise InvalidArgument(f"answer must be a bool mask of the training text's "
                                  f"{ids.numel()} tokens, got {mask.dtype} of {mask.numel()}")
        if cfg.answer_weight == 1.0 and not cfg.answer_ce:
            mask = None  # every position weighs 1: the plain mean
    if cfg.distill > 0 and teacher is None:
        raise InvalidArgument("distill > 0 needs the unpruned teacher model")
    if teacher is not None and int(teacher.config.vocab_size) != vocab:
        raise InvalidArgument("the teacher's vocabulary differs from the model's")
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise InvalidArgument("model already holds LoRA adapters")
    state_dir = Path(folder) if folder is not None else None
    text = _text_digest(ids, mask) if state_dir is not None else ""  # names checkpoints only
    saved = _read_state(state_dir, cfg, text) if state_dir is not None else None

    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                      target_modules=list(cfg.targets), bias="none", task_type="CAUSAL_LM",
                      init_lora_weights=True)
    peft_model = get_peft_model(model, lora)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    report = RecoveryReport(steps=0, seconds=0.0)
    if saved is not None:
        from safetensors.torch import load_file

        assert state_dir is not None
        set_peft_model_state_dict(peft_model, load_file(str(state_dir / ADAPTER)))
        _load_optimizer(opt, params, load_file(str(state_dir / OPTIMIZER)), state_dir)
        report.steps = report.resumed_from = int(saved["step"])
        report.seconds = float(saved["seconds"])
        report.losses = [float(x) for x in saved["losses"]]
    bar = _bar(cfg.steps, report.steps) if progress is True else None
    peft_model.train()
    try:
        _train(peft_model, opt, params, ids, mask, cfg, report, teacher, state_dir, text,
               progress, bar)
    except BaseException:
        peft_model.unload()  # the adapters dropped unmerged: the caller's weights as they were
        raise
    finally:
        if bar is not None:
            bar.close()
    if state_dir is not None:
        _save_state(peft_model, opt, params, state_dir, cfg, text, report)
    merged = peft_model.merge_and_unload()
    if merged is not model:  # peft wraps in place: the caller's object is the merged model
        raise RuntimeError("peft did not merge into the model it was given")
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return report


def _train(peft_model: Any, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
           ids: torch.Tensor, mask: torch.Tensor | None, cfg: RecoveryConfig,
           report: RecoveryReport, teacher: Any, state_dir: Path | None, text: str,
           progress: Callable[[int, int, float, float], None] | bool, bar: Any) -> None:
    """``recover``'s training loop (its steps 3 and 4), updating ``report``; a loss or an
    adapter that is not finite is refused (InvalidArgument) before it reaches the weights."""
    t0, prior, first = time.perf_counter(), report.seconds, report.steps
    device = next(peft_model.parameters()).device
    for step in range(report.steps, cfg.steps):
        # checked before the step (a resumed run may be past the bound already), and a step
        # that would cross it at this run's pace is not started: the bound is kept
        # (a resumed run's first step is judged at the pace of the run it resumes)
        pace = (report.seconds - prior) / (step - first) if step > first else (
            report.seconds / report.steps if report.steps else 0.0)
        if report.seconds + pace > cfg.max_seconds:
            report.stopped_by = "time"
            break
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch, marked = _windows(ids, cfg, step, mask)
        weights = None if marked is None or cfg.answer_weight == 1.0 else \
            torch.where(marked, cfg.answer_weight, 1.0).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = _loss(peft_model, teacher, batch.to(device), cfg.distill, weights,
                         marked.to(device) if cfg.answer_ce and marked is not None
                         else None, cfg.answer_ce)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise InvalidArgument(f"recovery loss is {value} at step {step} (lr {cfg.lr} too "
                                  "high, or the model's outputs are not finite); the model is "
                                  "left as it was")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if not all(bool(torch.isfinite(p).all()) for p in params):
            raise InvalidArgument(f"recovery step {step} made the adapters non-finite (lr "
                                  f"{cfg.lr} too high?); the model is left as it was")
        report.losses.append(value)
        report.steps = step + 1
        report.seconds = prior + time.perf_counter() - t0
        if bar is not None:
            bar.set_postfix(loss=f"{report.losses[-1]:.3f}")
            bar.update(1)
        elif callable(progress):
            progress(report.steps, cfg.steps, report.losses[-1], report.seconds)
        if state_dir is not None and report.steps % cfg.save_every == 0:
            _save_state(peft_model, opt, params, state_dir, cfg, text, report)


def _loss(model: Any, teacher: Any, batch: torch.Tensor, distill: float,
          weights: torch.Tensor | None = None, marked: torch.Tensor | None = None,
          answer_ce: float = 0.0) -> torch.Tensor:
    """(1 - distill) * next-token cross-entropy + distill * KL(teacher || model), each the
    mean over predicted positions (weighted by ``weights``, [batch, n - 1], when given), plus
    ``answer_ce`` * the cross-entropy's mean over the ``marked`` positions (when any is)."""
    logits = model(input_ids=batch).logits[:, :-1]
    terms = []
    if answer_ce and marked is not None and bool(marked.any()):
        terms.append(answer_ce * torch.nn.functional.cross_entropy(
            logits[marked].float(), batch[:, 1:][marked]))
    if distill < 1:
        vocab = logits.shape[-1]
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                               batch[:, 1:].reshape(-1), reduction="none")
        w = None if weights is None else weights.reshape(-1).float()
        terms.append((1 - distill) * (ce.mean() if w is None else (ce * w).sum() / w.sum()))
    if distill > 0:
        with torch.no_grad():
            target = teacher(input_ids=batch).logits[:, :-1]
        terms.append(distill * DistillKL.apply(logits, target, weights))
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


class DistillKL(torch.autograd.Function):
    """Mean over positions of KL(softmax(target) || softmax(logits)), both [batch, n, vocab]
    (weighted by ``weights`` [batch, n] when given: sum of w * KL over sum of w).

    The same value as ``kl_div(log_softmax(logits), log_softmax(target), log_target=True,
    reduction="batchmean")`` over the flattened positions, computed in float32 a few rows at a
    time, with its gradient w * (softmax(logits) - softmax(target)) / sum(w) written in the
    same pass: the unfused form makes about ten passes over [positions, vocab] float32
    tensors (casts, two log-softmaxes, the KL, and as many backward), as long as a forward of
    the 135M model on CPU. Only ``logits`` gets a gradient.
    """

    ROWS = 64

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        if logits.shape != target.shape or logits.dim() != 3:
            raise InvalidArgument(f"logits {tuple(logits.shape)} and target "
                                  f"{tuple(target.shape)} must both be [batch, n, vocab]")
        batch, n, _ = logits.shape
        if weights is None:
            scale = torch.full((batch, n), 1.0 / max(1, batch * n), device=logits.device)
        elif tuple(weights.shape) != (batch, n) or not bool((weights >= 0).all()) \
                or not float(weights.sum()) > 0:
            raise InvalidArgument(f"weights must be [batch, n] = {(batch, n)}, >= 0, not all "
                                  f"0; got {tuple(weights.shape)}")
        else:
            scale = weights.float() / weights.float().sum()
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        for b in range(batch):
            for i in range(0, n, DistillKL.ROWS):
                rows = slice(i, i + DistillKL.ROWS)
                s = torch.log_softmax(logits[b, rows].float(), -1)
                t = torch.log_softmax(target[b, rows].float(), -1)
                p = t.exp()
                w = scale[b, rows, None]
                total += (p * (t - s)).mul_(w).sum(dtype=torch.float64)
                grad[b, rows] = (s.exp_() - p).mul_(w)
        ctx.save_for_backward(grad)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx: Any, *grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_out[0].to(grad.dtype), None, None


def _identity(cfg: RecoveryConfig) -> dict[str, Any]:
    """What makes two runs the same run (a longer time budget resumes it)."""
    d = asdict(cfg)
    d["targets"] = list(cfg.targets)
    d.pop("max_seconds")
    d.pop("save_every")
    if cfg.answer_weight == 1.0:  # checkpoints from before the setting existed still resume
        d.pop("answer_weight")
    if not cfg.answer_ce:
        d.pop("answer_ce")
    return d


def _text_digest(ids: torch.Tensor, mask: torch.Tensor | None) -> str:
    """What a checkpoint was trained on: the training ids and the answer mask that weighs them
    (None: every position alike)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(ids.to(torch.int64).numpy().tobytes())
    if mask is not None:
        h.update(b"answer")
        h.update(mask.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read_state(folder: Path, cfg: RecoveryConfig, text: str) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` (None when there is none); refused when it belongs to
    another run (other settings, or another training text) or is incomplete."""
    path = folder / STATE
    if folder.exists() and not folder.is_dir():
        raise InvalidArgument(f"recovery folder {folder} is not a directory")
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not a recovery state ({exc})") from exc
    if state.get("format") != FORMAT:
        raise InvalidArgument(f"{folder} holds a recovery checkpoint of another format; "
                              "use another folder")
    if state.get("config") != _identity(cfg):
        raise InvalidArgument(f"{folder} holds a recovery with other settings "
                              f"({state.get('config')}); use another folder or the same "
                              "RecoveryConfig")
    if state.get("text") != text:
        raise InvalidArgument(f"{folder} holds a recovery trained on another text (or another "
                              "answer mask); use another folder or the same training text")
    for name in (ADAPTER, OPTIMIZER):
        if not (folder / name).is_file():
            raise InvalidArgument(f"recovery checkpoint {folder} lacks {name}")
    return dict(state)


def _save_state(peft_model: Any, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                folder: Path, cfg: RecoveryConfig, text: str, report: RecoveryReport) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    adapter = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(
        peft_model).items()}
    moments: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        for name, value in opt.state.get(p, {}).items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            moments[f"{i}.{name}"] = t.detach().contiguous()
    for name, tensors in ((ADAPTER, adapter), (OPTIMIZER, moments)):
        tmp = folder / (name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(folder / name)
    state = {"format": FORMAT, "step": report.steps, "seconds": report.seconds,
             "losses": report.losses, "config": _identity(cfg), "text": text}
    tmp = folder / (STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(folder / STATE)  # last: a state file names only files already in place


def _load_optimizer(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                    moments: dict[str, torch.Tensor], folder: Path) -> None:
    for key, value in moments.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            raise InvalidArgument(f"{folder / OPTIMIZER} does not match the adapters")
        p = params[int(index)]
        if name != "step" and value.shape != p.shape:
            raise InvalidArgument(f"{folder / OPTIMIZER} does not match the adapters")
        opt.state[p][name] = value.clone()


def _bar(total: int, start: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="LoRA recovery", unit="step",
                disable=not sys.stderr.isatty())
