"""What the loading controller (``kdn.delivery.controller``) learns from, and how it keeps it:
which observations count (``measured``, ``rate``), prefill length classes, and the running
mean and deviation of one option's cost (``Spread``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
