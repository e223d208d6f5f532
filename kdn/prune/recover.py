"""KVPruner's third step: LoRA recovery of a pruned model, merged back into its weights.

    from kdn.prune.recover import RecoveryConfig, recover
    report = recover(pruned, train_ids, RecoveryConfig(steps=300, seed=0), folder=ckpt_dir)
    save_pruned(pruned, out_folder, tokenizer)   # a normal transformers folder, per-layer layout

``peft`` adds low-rank adapters to the attention and MLP projections (the pruned attention's
sliced projections included); a short causal-LM fine-tune on training text (never the
evaluation text: the caller draws them from disjoint articles) recovers most of the quality
pruning cost, and the adapters are then merged, so the model keeps its pruned shapes and kdn
sees the same per-layer KV layout. Bounded by ``steps`` and ``max_seconds``; deterministic for
a seed (the batches are drawn from a generator seeded with it, dropout is off); with
``folder`` it writes the adapter weights (safetensors, through peft) and its step every
``save_every`` steps and resumes from there (the optimizer's moments start again).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kdn.errors import InvalidArgument

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATE = "recovery_state.json"


@dataclass(frozen=True)
class RecoveryConfig:
    steps: int = 300
    """Optimizer steps at most."""
    max_seconds: float = 1800.0
    """Wall-clock bound: stop after the step that passes it."""
    rank: int = 16
    alpha: int = 32
    lr: float = 1e-3
    batch: int = 4
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence (windows drawn from the training text)."""
    seed: int = 0
    save_every: int = 50
    """Steps between checkpoints (with ``folder``)."""
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        for name in ("steps", "rank", "alpha", "batch", "seq_len", "save_every"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.lr > 0 or not self.max_seconds > 0:
            raise InvalidArgument("lr and max_seconds must be > 0")


@dataclass
class RecoveryReport:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    """Training loss of each step."""
    resumed_from: int = 0
    stopped_by: str = "steps"

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else math.nan

    @property
    def last_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan


def _batch(train_ids: torch.Tensor, cfg: RecoveryConfig, step: int) -> torch.Tensor:
    """Step ``step``'s [batch, seq_len] windows: a function of (seed, step) alone, so a resumed
    run draws what an uninterrupted one would have."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, train_ids.numel() - cfg.seq_len, (cfg.batch,), generator=g)
    return torch.stack([train_ids[s:s + cfg.seq_len] for s in starts.tolist()])


def recover(model: Any, train_ids: torch.Tensor, config: RecoveryConfig | None = None, *,
            folder: str | Path | None = None,
            progress: Callable[[int, int, float], None] | bool = False) -> RecoveryReport:
    """Fine-tune ``model`` (pruned, in place) with LoRA on ``train_ids`` and merge the adapters
    back; returns what happened. ``progress``: True for a bar on stderr (only on a terminal),
    or a callable(step, steps, loss)."""
    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    except ImportError as exc:
        raise InvalidArgument("LoRA recovery needs peft: pip install 'kdn[prune]'") from exc
    cfg = config or RecoveryConfig()
    ids = train_ids.reshape(-1).to(torch.long)
    if ids.numel() <= cfg.seq_len + 1:
        raise InvalidArgument(f"training text of {ids.numel()} tokens is shorter than one "
                              f"sequence of {cfg.seq_len}")
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                      target_modules=list(cfg.targets), bias="none", task_type="CAUSAL_LM",
                      init_lora_weights=True)
    was_training = model.training
    peft_model = get_peft_model(model, lora)
    start = 0
    state_dir = Path(folder) if folder is not None else None
    if state_dir is not None and (state_dir / STATE).is_file():
        from safetensors.torch import load_file

        state = json.loads((state_dir / STATE).read_text())
        if state.get("config") != _jsonable(cfg):
            raise InvalidArgument(f"{state_dir} holds a recovery with other settings; "
                                  "use another folder or the same RecoveryConfig")
        set_peft_model_state_dict(peft_model, load_file(str(state_dir / "adapter.safetensors")))
        start = int(state["step"])
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    report = RecoveryReport(steps=start, seconds=0.0, resumed_from=start)
    bar = _bar(cfg.steps, start) if progress is True else None
    t0 = time.perf_counter()
    peft_model.train()
    for step in range(start, cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr  # a short warm-up, then cosine decay
        batch = _batch(ids, cfg, step)
        loss = peft_model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        report.losses.append(float(loss.detach()))
        report.steps = step + 1
        if bar is not None:
            bar.set_postfix(loss=f"{report.losses[-1]:.3f}")
            bar.update(1)
        elif callable(progress):
            progress(step + 1, cfg.steps, report.losses[-1])
        if state_dir is not None and (report.steps % cfg.save_every == 0):
            _save_state(peft_model, state_dir, cfg, report.steps)
        if time.perf_counter() - t0 > cfg.max_seconds:
            report.stopped_by = "time"
            break
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t0
    if state_dir is not None:
        _save_state(peft_model, state_dir, cfg, report.steps)
    merged = peft_model.merge_and_unload()
    if merged is not model:  # peft wraps in place: the caller's object is the merged model
        raise RuntimeError("peft did not merge into the model it was given")
    model.train(was_training)
    model.eval()
    return report


def _jsonable(cfg: RecoveryConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["targets"] = list(cfg.targets)
    d.pop("max_seconds")  # a longer budget (or more steps) resumes the same run
    d.pop("steps")
    d.pop("save_every")
    return d


def _save_state(peft_model: Any, folder: Path, cfg: RecoveryConfig, step: int) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(
        peft_model).items()}
    tmp = folder / "adapter.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(folder / "adapter.safetensors")
    state = folder / (STATE + ".tmp")
    state.write_text(json.dumps({"step": step, "config": _jsonable(cfg)}))
    state.replace(folder / STATE)


def _bar(total: int, start: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="LoRA recovery", unit="step",
                disable=not sys.stderr.isatty())
