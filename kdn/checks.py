"""Checks of the numbers a caller passes, one rule each, so every entry point words a refusal
alike: a whole number from a lower bound (``whole``), a share in [0, 1] (``share``), a span of
seconds (``seconds``), a setting's number within both bounds (``within``), an on/off switch
(``flag``) and token ids (``token_ids``, ``check_vocabulary``). A bool is none of them (``True``
is not 1 layer or a 100% ratio; ``is_bool`` also knows numpy's and a 0-d tensor of one), nor is
a text, nor, for the whole ones, a float (``int(1.7)`` would quietly be another token)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Sequence
from typing import Any

from kdn.errors import InvalidArgument, KDNError

MAX_WAIT_S = 86400.0
"""The longest timeout or interval a setting may name (a day): far longer ones overflow inside
gRPC, redis-py, threading or the clock (``1e10`` s), and no wait that long is meant."""
MAX_BYTES = (1 << 63) - 1
"""The most bytes a size may name: an off_t, and the 64-bit fields of Stats."""


def whole(name: str, value: object, low: int = 0, hint: str = "",
          error: type[KDNError] = InvalidArgument) -> int:
    """``value`` as an int when it is a whole number >= ``low``; else ``error`` naming
    ``name`` (``hint``: what follows the bound, e.g. what 0 or None means)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise error(f"{name} must be a whole number >= {low}{hint}, got {value!r}"
                    f"{not_an_int(value)}")
    return int(value)


def is_bool(value: object) -> bool:
    """Whether ``value`` is a bool: Python's, numpy's or a 0-d tensor of one (whose
    ``__index__`` gives 0 or 1, so ``operator.index`` takes it for a number)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def not_an_int(value: object) -> str:
    """What follows a refusal of ``value`` as a whole number where it holds one in another
    type (``1.0``: a whole number, but a float)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool | numbers.Integral):
        try:
            if float(value).is_integer():
                return f" (an int is needed, not {type(value).__name__})"
        except (OverflowError, ValueError):
            pass
    return ""


def share(name: str, value: object) -> float:
    """``value`` as a float when it is a number in [0, 1]; else InvalidArgument naming
    ``name``."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0.0 <= to_float(value) <= 1.0):
        raise InvalidArgument(f"{name} must be a number in [0, 1], got {shown(value)}")
    return float(value)


def seconds(name: str, value: object) -> float:
    """``value`` as a float when it is a finite number of seconds >= 0; else InvalidArgument
    naming ``name`` (NaN would compare false with every clock, and never come)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0.0 <= to_float(value) < float("inf")):
        raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got "
                              f"{shown(value)}")
    return float(value)


def within(name: str, value: object, low: float, high: float, *, whole: bool = False,
           above: bool = False, unit: str = "",
           error: type[KDNError] = InvalidArgument) -> Any:
    """``value`` when it is a finite number in [``low``, ``high``] (above ``low`` when
    ``above``), an int when ``whole``; else ``error`` naming ``name`` and both bounds. A bool
    or a text is no number; a setting's upper bound keeps a huge one (a typo, or "no limit")
    from breaking deep inside redis-py, gRPC or threading."""
    ok, got = not isinstance(value, bool) and isinstance(
        value, numbers.Integral if whole else numbers.Real), math.nan
    if ok:
        got = to_float(value)  # NaN fails both comparisons
        ok = (got > low if above else got >= low) and got <= high
    if not ok:
        lo, hi = (str(int(b)) if float(b).is_integer() else f"{b:g}" for b in (low, high))
        span = f"> {lo} and at most {hi}" if above else f"in {lo}..{hi}"
        raise error(f"{name} must be {'a whole number' if whole else 'a number'} {span}{unit}, "
                    f"got {shown(value)}{not_an_int(value) if whole else ''}")
    return int(value) if whole else got  # type: ignore[call-overload]


def flag(name: str, value: object, *, none: bool = False,
         error: type[KDNError] = InvalidArgument) -> bool | None:
    """``value`` when it is a bool (or None, where ``none`` allows it); else ``error`` naming
    ``name``: a text "false" (from a settings file) is true to Python."""
    if not isinstance(value, bool) and not (none and value is None):
        raise error(f"{name} must be True or False{' or None' if none else ''}, got "
                    f"{shown(value)}")
    return value


def to_float(value: Any) -> float:
    """``float(value)``, an int past float's range as that infinity (not OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def token_ids(values: object, what: str, below: int | None = None) -> list[int]:
    """``values`` as a list of ints: a sequence of whole numbers, or an array or tensor of them
    (anything with ``tolist``, which must give such a list: 1-D, an integer dtype);
    InvalidArgument naming ``what`` otherwise: a text or bytes, a batch, a float or a bool is
    no token id, nor, given ``below``, one outside [0, below) (``2**32``: a uint32 on the
    wire). Imports nothing: the client's requests use it without torch."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what}: token ids are a list of whole numbers, got "
                              f"{type(values).__name__}")
    if not isinstance(values, Sequence) and callable(getattr(values, "tolist", None)):
        values = values.tolist()  # type: ignore[attr-defined]  # numpy, torch: Python numbers
    if not isinstance(values, Sequence):
        raise InvalidArgument(f"{what}: token ids are a list of whole numbers, got "
                              f"{type(values).__name__}")
    out = []
    for i, t in enumerate(values):
        try:  # a tensor has __index__, which refuses one of a float or of several elements
            if (isinstance(t, float) or not hasattr(t, "__index__")
                    or (type(t) is not int and is_bool(t))):
                raise TypeError
            out.append(t.__index__())
        except TypeError:
            raise InvalidArgument(f"{what}: token {i} is {shown(t)}, not a token id") from None
        if below is not None and not 0 <= out[-1] < below:
            raise InvalidArgument(f"{what}: token {i} is {shown(out[-1])}, not in [0, "
                                  f"{below_shown(below)})")
    return out


def check_vocabulary(ids: Sequence[int], vocabulary: int, what: str) -> None:
    """InvalidArgument naming ``what`` and the first id of ``ids`` outside
    ``0..vocabulary-1`` (the model's embedding rows), if any."""
    if ids and (min(ids) < 0 or max(ids) >= vocabulary):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocabulary)
        raise InvalidArgument(f"{what}: token id {bad} is outside the model's vocabulary of "
                              f"{vocabulary} (0..{vocabulary - 1}), at token {i}")


def below_shown(bound: int) -> str:
    """A bound as a power of two where it is one (``2**32``), else in digits."""
    return f"2**{bound.bit_length() - 1}" if bound > 1 and bound & (bound - 1) == 0 else str(bound)


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 2, 60, 40, 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4


def shown(value: object) -> str:
    """``repr(value)`` cut short for an error line: a value from a file may be a YAML alias
    bomb (a few hundred bytes whose full repr takes gigabytes) or 400 digits."""
    return _SHOWN.repr(value)
