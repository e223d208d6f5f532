"""Checks of the numbers a caller passes, one rule each, so every entry point words a refusal
alike: a whole number from a lower bound (``whole``), and a share in [0, 1] (``share``). A bool
is neither (``True`` is not 1 layer or a 100% ratio), nor is a text."""

from __future__ import annotations

import numbers

from kdn.errors import InvalidArgument


def whole(name: str, value: object, low: int = 0, hint: str = "",
          error: type[InvalidArgument] = InvalidArgument) -> int:
    """``value`` as an int when it is a whole number >= ``low``; else ``error`` naming
    ``name`` (``hint``: what follows the bound, e.g. what 0 or None means)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise error(f"{name} must be a whole number >= {low}{hint}, got {value!r}")
    return int(value)


def share(name: str, value: object) -> float:
    """``value`` as a float when it is a number in [0, 1]; else InvalidArgument naming
    ``name``."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0.0 <= float(value) <= 1.0):
        raise InvalidArgument(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)
