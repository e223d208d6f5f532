"""What the loading controller (``kdn.delivery.controller``) learns from, and how it keeps it:
which observations count (``measured``, ``rate``), prefills by length class (``Prefills``),
the running mean and deviation of one option's cost (``Spread``), and which settings it takes
(``check_settings``)."""

from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import dataclass, field
from typing import Any

from kdn.checks import to_float, whole
from kdn.errors import ConfigError

RECENT = 3
"""Samples of an encoding's own hits whose median its running means take (one straggler
among three changes nothing; a change that lasts shows from the second request on); also
the samples kept per prefill length class."""


def measured(*values: float) -> bool:
    """Every value is finite and above 0: an observation worth learning from (an infinite
    or NaN time, from a clock that jumped or a failed timer, would stay in the means)."""
    return all(math.isfinite(v) and v > 0 for v in values)


def speed(value: float) -> bool:
    """``value`` is a speed the estimates can divide by, and by whose inverse: finite and
    above 0, its inverse too (5e-324 passes ``measured``; its inverse is infinite)."""
    return measured(value) and math.isfinite(1 / value)


def rate_of(amount: float, seconds: float) -> float | None:
    """``amount / seconds`` where both are measured and it is a ``speed``; else None (a time
    of 5e-324 s makes an infinite rate, which would poison the running means for good)."""
    if not measured(amount, seconds):
        return None
    got = amount / seconds
    return got if speed(got) else None


def relative(a: float, b: float) -> float:
    """``a / b - 1``, for the decisions' reasons: 0 where they are equal (0 or infinite
    alike), infinite over 0."""
    if a == b:
        return 0.0
    return a / b - 1 if b else math.inf


def length_class(tokens: int) -> int:
    """A prefill's length class: the power of two at or below ``tokens`` (8-15 tokens: 3)."""
    return max(0, tokens.bit_length() - 1)


@dataclass
class Spread:
    """A running mean of one option's measured cost and of its observations' absolute
    deviation from that mean (both exponentially weighted)."""

    mean: float = 0.0
    dev: float = 0.0
    n: int = 0
    """Observations so far."""

    def add(self, x: float, alpha: float) -> None:
        if self.n == 0:
            self.mean = x
        else:
            self.dev = (1 - alpha) * self.dev + alpha * abs(x - self.mean)
            self.mean = (1 - alpha) * self.mean + alpha * x
        self.n += 1

    @property
    def relative_error(self) -> float | None:
        """Mean deviation over mean (0.1: one observation is typically 10% off the mean);
        None before two observations."""
        return self.dev / self.mean if self.n >= 2 and self.mean > 0 else None


@dataclass
class Prefills:
    """Seconds per token of the prefills seen, per length class (``length_class``: the last
    ``RECENT`` of each), and the seconds of one token's forward after a prefill (``step_s``):
    what the controller predicts a recompute and a hit's suffix from (its module docstring).
    Not locked: the controller's lock guards it."""

    by_class: dict[int, list[float]] = field(default_factory=dict)
    step_s: float = 0.0
    """One token's forward with the KV of a typical request before it (the engine's
    calibration, ``kdn.engine.measure.time_prefill``); 0: not measured."""

    def add(self, tokens: int, seconds: float) -> None:
        got = self.by_class.setdefault(length_class(tokens), [])
        got.append(seconds / tokens)
        del got[:-RECENT]

    def seconds(self, tokens: int, prior_tok_s: float) -> float:
        """Predicted seconds of a prefill of ``tokens`` tokens: at the seconds per token of the
        nearest length class with samples (the longer of two as near; of fewer than
        ``RECENT`` samples the fastest, else their median), else at ``prior_tok_s``."""
        if tokens <= 0:
            return 0.0
        if not self.by_class:
            return tokens / prior_tok_s
        want = length_class(tokens)
        near = min(self.by_class, key=lambda c: (abs(c - want), -c))
        got = self.by_class[near]
        return tokens * (min(got) if len(got) < RECENT else statistics.median(got))

    def suffix(self, tokens: int, prior_tok_s: float) -> float:
        """Predicted seconds to compute the ``tokens`` tokens left after a hit, with the
        loaded KV before them: a forward of a few tokens after a long context costs what one
        token's does (the model's weights read once, attention over the context), which a
        prefill's seconds per token leave out."""
        return max(self.step_s, self.seconds(tokens, prior_tok_s)) if tokens > 0 else 0.0


def check_settings(c: Any) -> None:
    """ConfigError naming the first of a ``LoadingController``'s settings out of its range:
    speeds finite and above 0, overheads finite and >= 0, the weights, margins and re-trial
    settings within what their docstrings say."""
    speeds = {"prefill_tok_s": c.prefill_tok_s, **{
        f"{name}[{k!r}]": v for name in ("priors_b_s", "bandwidths_b_s", "decode_b_s",
                                         "codec_b_s") for k, v in getattr(c, name).items()}}
    if c.bandwidth_b_s is not None:
        speeds["bandwidth_b_s"] = c.bandwidth_b_s
    for name, value in speeds.items():  # True is no speed of 1 B/s
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not speed(
                to_float(value)):
            raise ConfigError(f"{name} must be a finite speed above 0, got {value}")
    for dev, value in c.overhead_s_b.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"overhead_s_b[{dev!r}] must be finite and >= 0, got {value}")
    if not 0.0 <= c.alpha <= 1.0:
        raise ConfigError(f"alpha must lie in [0, 1], got {c.alpha}")
    if not 0.0 <= c.margin_min <= c.margin_max < 1.0:
        raise ConfigError("margins must satisfy 0 <= margin_min <= margin_max < 1, got "
                          f"{c.margin_min} and {c.margin_max}")
    if not (math.isfinite(c.explore) and c.explore >= 0):
        raise ConfigError(f"explore must be finite and >= 0, got {c.explore}")
    for name in ("trials", "retry_every", "retry_max"):  # NaN failed every check below
        whole(name, getattr(c, name), 0, error=ConfigError)
    if c.retry_max < c.retry_every:
        raise ConfigError("re-trials need 0 <= retry_every <= retry_max, got "
                          f"{c.retry_every} and {c.retry_max}")
    if not (math.isfinite(c.retry_cost) and c.retry_cost >= 1.0):
        raise ConfigError(f"retry_cost must be finite and >= 1, got {c.retry_cost}")
