"""Honest evaluation of pruned models: held-out text from SQuAD articles disjoint from the
ones calibration and recovery saw, perplexity with a bootstrap confidence interval over
windows, and answer F1 on SQuAD questions of the held-out articles.

    split = ArticleSplit.default()          # calibration / training / evaluation articles
    ids = split.token_ids("eval", tok, 4096)
    res = perplexity_ci(model, ids)         # res.ppl, res.low, res.high over 512-token windows
    f1 = answer_f1(model, tok, split.questions("eval", 50, seed=0))
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from kdn.data import SquadArticle, load_squad_dev, squad_f1
from kdn.errors import InvalidArgument

WINDOW = 512


@dataclass(frozen=True)
class ArticleSplit:
    """Which SQuAD dev articles each use may read; the three ranges never overlap."""

    calibration: range
    training: range
    evaluation: range

    def __post_init__(self) -> None:
        spans = [self.calibration, self.training, self.evaluation]
        for i, a in enumerate(spans):
            for b in spans[i + 1:]:
                if set(a) & set(b):
                    raise InvalidArgument(f"article ranges overlap: {a} and {b} (evaluation "
                                          "text must never be calibrated or trained on)")

    @classmethod
    def default(cls) -> ArticleSplit:
        """Articles 0-1 calibrate, 2-31 train, 40-47 evaluate (48 articles in the dev set)."""
        return cls(range(0, 2), range(2, 32), range(40, 48))

    def articles(self, use: str) -> list[SquadArticle]:
        span = {"calibration": self.calibration, "training": self.training,
                "eval": self.evaluation, "evaluation": self.evaluation}[use]
        every = load_squad_dev()
        if span.stop > len(every):
            raise InvalidArgument(f"{use} articles {span} beyond the {len(every)} there are")
        return [every[i] for i in span]

    def text(self, use: str) -> str:
        return "\n\n".join(p.context for a in self.articles(use) for p in a.paragraphs)

    def token_ids(self, use: str, tokenizer: Any, n: int = 0) -> torch.Tensor:
        """The ``use`` articles' text as token ids (the first ``n``; 0: all)."""
        ids = tokenizer(self.text(use), add_special_tokens=False)["input_ids"]
        if n and len(ids) < n:
            raise InvalidArgument(f"{use} articles hold {len(ids)} tokens, fewer than {n}")
        return torch.tensor(ids[:n] if n else ids, dtype=torch.long)

    def questions(self, use: str, n: int, seed: int = 0) -> list[tuple[str, str, tuple[str,
                                                                                       ...]]]:
        """A seeded draw of ``n`` (context, question, answers) of the ``use`` articles."""
        every = [(p.context, q.question, q.answers) for a in self.articles(use)
                 for p in a.paragraphs for q in p.qas]
        return random.Random(seed).sample(every, n)


@dataclass(frozen=True)
class PerplexityCI:
    ppl: float
    low: float
    high: float
    tokens: int
    windows: int


@torch.inference_mode()
def window_nll(model: Any, ids: torch.Tensor, window: int = WINDOW) -> list[tuple[float, int]]:
    """(summed NLL, predicted tokens) of each non-overlapping ``window`` of ``ids``."""
    out = []
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window]
        if chunk.numel() < 2:
            break
        logits = model(input_ids=chunk[None]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
        out.append((float(nll), chunk.numel() - 1))
    return out


def perplexity_ci(model: Any, ids: torch.Tensor, *, window: int = WINDOW, boot: int = 2000,
                  seed: int = 0, level: float = 0.95) -> PerplexityCI:
    """Perplexity of ``ids`` and its bootstrap interval (windows resampled with replacement)."""
    parts = window_nll(model, ids, window)
    if len(parts) < 2:
        raise InvalidArgument("need at least two windows for an interval")
    nll, tok = sum(p[0] for p in parts), sum(p[1] for p in parts)
    rng = random.Random(seed)
    samples = []
    for _ in range(boot):
        draw = [parts[rng.randrange(len(parts))] for _ in parts]
        samples.append(math.exp(sum(d[0] for d in draw) / sum(d[1] for d in draw)))
    samples.sort()
    lo = samples[int((1 - level) / 2 * boot)]
    hi = samples[min(boot - 1, int((1 + level) / 2 * boot))]
    return PerplexityCI(math.exp(nll / tok), lo, hi, tok, len(parts))


@torch.inference_mode()
def answer(model: Any, tokenizer: Any, context: str, question: str, max_new: int = 16) -> str:
    """The model's greedy answer (first line) to ``question`` about ``context``, asked in the
    chat format of the packaged model (an instruction-tuned SmolLM2)."""
    prompt = (f"<|im_start|>user\nAnswer the question from this document.\n\n{context}\n\n"
              f"Question: {question}\nAnswer with a few words.<|im_end|>\n"
              "<|im_start|>assistant\n")  # SmolLM2's chat format (the packaged model's)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    text: str = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return text.strip().split("\n")[0]


def answer_f1(model: Any, tokenizer: Any,
              qas: list[tuple[str, str, tuple[str, ...]]]) -> float:
    """Mean SQuAD F1 of ``model``'s greedy answers."""
    return sum(squad_f1(answer(model, tokenizer, c, q), a) for c, q, a in qas) / len(qas)
