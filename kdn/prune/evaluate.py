"""Honest evaluation of pruned models: held-out text from SQuAD articles disjoint from the
ones calibration and recovery saw, perplexity with bootstrap intervals over windows, a paired
interval for the change against the unpruned model on the same windows, and answer F1 on
SQuAD questions of the held-out articles.

    split = ArticleSplit.default()                   # calibration / training / evaluation
    windows = split.windows("evaluation", tok, 16, 256)   # 16 x 256 = 4,096 predicted tokens
    base, ppl = perplexity_ci(unpruned, windows), perplexity_ci(pruned, windows)
    change = paired_change(base, ppl)                # ppl / base - 1, with its interval
    qas = split.questions("evaluation", 50, seed=0)
    f1 = mean_f1(answers(pruned, tok, qas), qas)

Windows are spread over every evaluation article (not the first article's first pages), each
predicts ``length`` tokens from the token before it; the bootstrap resamples whole windows
(tokens inside one are not independent). ``paired_change`` resamples the same windows for
both models, which is what says whether a difference is real: the two models' own intervals
overlap far more than their difference varies.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.checks import whole
from kdn.errors import InvalidArgument
from kdn.model.data import SquadArticle, load_squad_dev, squad_f1

USES = {"calibration": "calibration", "training": "training", "evaluation": "evaluation",
        "eval": "evaluation"}
QA = tuple[str, str, tuple[str, ...]]
"""(context, question, reference answers)."""


@dataclass(frozen=True)
class ArticleSplit:
    """Which SQuAD dev articles each use may read; the three ranges never overlap."""

    calibration: range
    training: range
    evaluation: range

    def __post_init__(self) -> None:
        spans = {"calibration": self.calibration, "training": self.training,
                 "evaluation": self.evaluation}
        for name, span in spans.items():
            if not isinstance(span, range) or span.step != 1 or len(span) == 0 \
                    or span.start < 0:
                raise InvalidArgument(f"{name} articles must be a non-empty range of article "
                                      f"indices, got {span!r}")
        names = list(spans)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                common = set(spans[a]) & set(spans[b])
                if common:
                    raise InvalidArgument(
                        f"article ranges overlap: {a} {spans[a]} and {b} {spans[b]} share "
                        f"articles {sorted(common)} (evaluation text must never be calibrated "
                        "or trained on)")

    @classmethod
    def default(cls) -> ArticleSplit:
        """Articles 0-1 calibrate, 2-31 train, 40-47 evaluate (48 articles in the dev set)."""
        return cls(range(0, 2), range(2, 32), range(40, 48))

    def span(self, use: str) -> range:
        if use not in USES:
            raise InvalidArgument(f"unknown use {use!r}: one of calibration, training, "
                                  "evaluation")
        span: range = getattr(self, USES[use])
        return span

    def articles(self, use: str) -> list[SquadArticle]:
        span = self.span(use)
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

    def windows(self, use: str, tokenizer: Any, count: int, length: int) -> torch.Tensor:
        """[count, length + 1] token windows spread over the ``use`` articles: article j gets
        every len(articles)-th window, placed evenly through its text (one tokenization per
        article, windows never overlap)."""
        if count < 1 or length < 1:
            raise InvalidArgument(f"need count >= 1 and length >= 1, got {count}, {length}")
        arts = self.articles(use)
        per = [count // len(arts) + (j < count % len(arts)) for j in range(len(arts))]
        out = []
        for art, k in zip(arts, per):
            if not k:
                continue
            text = "\n\n".join(p.context for p in art.paragraphs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            room = len(ids) - k * (length + 1)
            if room < 0:
                raise InvalidArgument(f"article {art.title!r} holds {len(ids)} tokens, too few "
                                      f"for {k} windows of {length + 1}")
            gap = room // k
            for w in range(k):
                s = w * (length + 1 + gap) + gap // 2
                out.append(torch.tensor(ids[s:s + length + 1], dtype=torch.long))
        return torch.stack(out)

    def questions(self, use: str, n: int, seed: int = 0) -> list[QA]:
        """A seeded draw of ``n`` (context, question, answers) of the ``use`` articles."""
        every = [(p.context, q.question, q.answers) for a in self.articles(use)
                 for p in a.paragraphs for q in p.qas]
        if n > len(every):
            raise InvalidArgument(f"{use} articles hold {len(every)} questions, fewer than {n}")
        return random.Random(seed).sample(every, n)

    def recovery_ids(self, tokenizer: Any, *, qa_share: float = 0.5, seed: int = 0
                     ) -> torch.Tensor:
        """The ids of ``recovery_text`` alone."""
        return self.recovery_text(tokenizer, qa_share=qa_share, seed=seed).ids

    def recovery_text(self, tokenizer: Any, *, qa_share: float = 0.5, seed: int = 0,
                      questions: int = 1) -> RecoveryText:
        """Training text for LoRA recovery, from the training articles only: paragraph after
        paragraph, a ``qa_share`` of them as the answering prompt the evaluation uses (head,
        context and question tail tokenized apart, as ``prompt_ids`` does, then the reference
        answer and the end of the turn) and the rest as plain text. ``answer`` marks the answer
        tokens, which a recovery can weigh above the rest (``RecoveryConfig.answer_weight``);
        with a distillation loss they are inputs only: the targets are the teacher's.
        ``questions``: prompts made of a paragraph chosen for one (up to that many of its
        questions, each prompt with the whole paragraph again)."""
        if not 0.0 <= qa_share <= 1.0:
            raise InvalidArgument(f"qa_share must be in [0, 1], got {qa_share}")
        if questions < 1:
            raise InvalidArgument(f"questions must be >= 1, got {questions}")
        from kdn.rag.corpus import chunk_ids
        from kdn.text import tokenize

        rng = random.Random(seed)
        end = _end_of_turn(tokenizer)
        ids: list[int] = []
        answer: list[bool] = []
        for art in self.articles("training"):
            for p in art.paragraphs:
                if p.qas and rng.random() < qa_share:
                    # one question draws as the committed runs' text did (same generator calls)
                    picked = ([rng.choice(p.qas)] if questions == 1 else
                              rng.sample(p.qas, min(questions, len(p.qas))))
                    for qa in picked:
                        prompt = sum(prompt_ids(tokenizer, p.context, qa.question), [])
                        reply = chunk_ids(tokenizer, qa.answers[0]) + tokenize(
                            tokenizer, end, "the end of turn")
                        ids += prompt + reply
                        answer += [False] * len(prompt) + [True] * len(reply)
                else:
                    text = chunk_ids(tokenizer, p.context + "\n\n")
                    ids += text
                    answer += [False] * len(text)
        return RecoveryText(torch.tensor(ids, dtype=torch.long),
                            torch.tensor(answer, dtype=torch.bool))


@dataclass(frozen=True)
class RecoveryText:
    """LoRA recovery's training text: token ids, and which of them are reference answers."""

    ids: torch.Tensor
    """[n] int64."""
    answer: torch.Tensor
    """[n] bool: True at the tokens of a reference answer (its end of turn included)."""


def check_disjoint(a: torch.Tensor, b: torch.Tensor, n: int = 32) -> None:
    """Refuse ``b`` (1-D, or rows of windows) when it shares a run of ``n`` tokens with ``a``
    (evaluation text that leaked into training text, or the reverse)."""
    seq = a.reshape(-1).tolist()
    seen = {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}
    for row in (b if b.dim() == 2 else b.reshape(1, -1)).tolist():
        for i in range(len(row) - n + 1):
            if tuple(row[i:i + n]) in seen:
                raise InvalidArgument(f"texts overlap: a run of {n} tokens of one is in the "
                                      "other (evaluation text must never be trained on)")


@dataclass(frozen=True)
class PerplexityCI:
    ppl: float
    low: float
    high: float
    tokens: int
    windows: int
    parts: tuple[tuple[float, int], ...] = field(default=(), repr=False)
    """(summed NLL, predicted tokens) of each window, in order."""


@torch.inference_mode()
def window_nll(model: Any, windows: torch.Tensor) -> list[tuple[float, int]]:
    """(summed next-token NLL, predicted tokens) of each row of ``windows``; a 1-D tensor is
    cut into rows of 257 ids (256 predicted tokens each, the last row dropped if short)."""
    rows = _rows(windows)
    out = []
    for row in rows:
        logits = model(input_ids=row[None]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")
        out.append((float(nll), row.numel() - 1))
    return out


def _rows(windows: torch.Tensor, length: int = 256) -> torch.Tensor:
    if windows.dim() == 2:
        if windows.shape[1] < 2:
            raise InvalidArgument("windows must hold at least two tokens")
        return windows
    ids = windows.reshape(-1)
    n = (ids.numel() - 1) // length
    return torch.stack([ids[i * length:i * length + length + 1] for i in range(n)]) if n \
        else ids[None]


def perplexity_ci(model: Any, windows: torch.Tensor, *, boot: int = 2000, seed: int = 0,
                  level: float = 0.95) -> PerplexityCI:
    """Perplexity over ``windows`` and its bootstrap interval (windows resampled)."""
    _check_bootstrap(boot, level)
    return interval(window_nll(model, windows), boot=boot, seed=seed, level=level)


def interval(parts: Sequence[tuple[float, int]], *, boot: int = 2000, seed: int = 0,
             level: float = 0.95) -> PerplexityCI:
    _check_bootstrap(boot, level)
    if len(parts) < 2:
        raise InvalidArgument("need at least two windows for an interval")
    nll, tok = sum(p[0] for p in parts), sum(p[1] for p in parts)
    samples = sorted(math.exp(sum(parts[i][0] for i in d) / sum(parts[i][1] for i in d))
                     for d in _draws(len(parts), boot, seed))
    lo, hi = _quantiles(samples, level)
    return PerplexityCI(math.exp(nll / tok), lo, hi, tok, len(parts), tuple(parts))


def paired_change(base: PerplexityCI, other: PerplexityCI, *, boot: int = 2000, seed: int = 0,
                  level: float = 0.95) -> tuple[float, float, float]:
    """(change, low, high) of ``other.ppl / base.ppl - 1`` in percent, the interval from
    resampling the same windows for both (they must be measured on the same windows)."""
    _check_bootstrap(boot, level)
    a, b = base.parts, other.parts
    if len(a) != len(b) or [n for _, n in a] != [n for _, n in b] or len(a) < 2:
        raise InvalidArgument("a paired change needs both models measured on the same windows")
    samples = sorted(100 * (math.exp(sum(b[i][0] - a[i][0] for i in d)
                                     / sum(a[i][1] for i in d)) - 1)
                     for d in _draws(len(a), boot, seed))
    lo, hi = _quantiles(samples, level)
    change = math.exp((sum(x for x, _ in b) - sum(x for x, _ in a)) / sum(n for _, n in a))
    return 100 * (change - 1), lo, hi


def _draws(n: int, boot: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(n) for _ in range(n)] for _ in range(boot)]


def _check_bootstrap(boot: int, level: float) -> None:
    """InvalidArgument unless ``boot`` is a whole number >= 1 and ``level`` in (0, 1): every
    interval here takes the quantiles ``(1 ∓ level) / 2`` of ``boot`` resamples."""
    whole("boot", boot, 1)
    if isinstance(level, bool) or not isinstance(level, numbers.Real) \
            or not 0.0 < level < 1.0:  # NaN too
        raise InvalidArgument(f"level must be a number in (0, 1), got {level!r}")


def _quantiles(samples: list[float], level: float) -> tuple[float, float]:
    k = len(samples)
    return (samples[int((1 - level) / 2 * k)], samples[min(k - 1, int((1 + level) / 2 * k))])


# -- answers ---------------------------------------------------------------------------------


def _template(tokenizer: Any) -> tuple[str, str]:
    from kdn.rag.pipeline import prompt_template

    return prompt_template(tokenizer)


def _end_of_turn(tokenizer: Any) -> str:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for name in ("<|im_end|>", "<|eot_id|>"):
        if name in vocab:
            return name + "\n"
    return str(getattr(tokenizer, "eos_token", "") or "") + "\n"


def prompt_ids(tokenizer: Any, context: str, question: str) -> tuple[list[int], list[int],
                                                                      list[int]]:
    """(head, context, tail) ids of the answering prompt: the tokenizer's chat template around
    the document and the question, each part tokenized alone, exactly as ``kdn.rag.RagEngine``
    builds it, so a full prefill and a kdn blend read the same tokens."""
    from kdn.rag.corpus import chunk_ids
    from kdn.text import template_ids, tokenize

    head, tail = _template(tokenizer)
    return (tokenize(tokenizer, head, "the prompt head"), chunk_ids(tokenizer, context),
            template_ids(tokenizer, tail, "{question}", question, "the question"))


def answers(model: Any, tokenizer: Any, qas: Sequence[QA], max_new_tokens: int = 24
            ) -> list[str]:
    """The model's greedy answers, each from a full prefill of the answering prompt."""
    from kdn.model import hf
    from kdn.rag.pipeline import stop_ids

    stop = stop_ids(tokenizer)
    out = []
    with torch.inference_mode():
        for context, question, _ in qas:
            head, ctx, tail = prompt_ids(tokenizer, context, question)
            decoder = hf.CacheDecoder(model)
            first = decoder.forward(head + ctx + tail)[-1]
            new = hf.greedy(decoder, first, max_new_tokens, stop)
            out.append(tokenizer.decode([t for t in new if t not in stop],
                                        skip_special_tokens=True).strip())
    return out


def f1_scores(preds: Sequence[str], qas: Sequence[QA]) -> list[float]:
    if len(preds) != len(qas):
        raise InvalidArgument("one answer per question")
    return [squad_f1(p, a) for p, (_, _, a) in zip(preds, qas)]


def mean_f1(preds: Sequence[str], qas: Sequence[QA]) -> float:
    """Mean SQuAD F1 of ``preds`` against the questions' reference answers."""
    scores = f1_scores(preds, qas)
    return sum(scores) / len(scores)


def paired_f1_change(base: Sequence[float], other: Sequence[float], *, boot: int = 2000,
                     seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(mean F1 change, low, high): the same questions resampled for both."""
    _check_bootstrap(boot, level)
    if len(base) != len(other) or len(base) < 2:
        raise InvalidArgument("a paired F1 change needs the same questions for both")
    diffs = [b - a for a, b in zip(base, other)]
    samples = sorted(sum(diffs[i] for i in d) / len(d) for d in _draws(len(diffs), boot, seed))
    lo, hi = _quantiles(samples, level)
    return sum(diffs) / len(diffs), lo, hi
