"""The codec modes and levels a stored entry may name, without loading them (no torch).

The storage server checks a Store's declared codec against this table; the modes themselves
(``kdn.codec.modes``, torch) register the same names, and ``tests/test_codec.py`` checks that
the two agree.
"""

from __future__ import annotations

from kdn.errors import InvalidArgument

LEVELS: dict[str, tuple[str, ...]] = {
    "raw": ("",),
    "lossless": ("",),
    "int8": ("",),
    "cachegen": ("",),
    "kdn": ("near-lossless", "high", "balanced", "default", "small", "compact", "tiny"),
}

EXACT_MODES = frozenset({"raw", "lossless"})
"""The modes that give back the KV they were given, bit for bit; the others approximate it."""


def exact(encoding: str) -> bool:
    """Whether ``encoding`` (``mode`` or ``mode-level``) is of one of ``EXACT_MODES``."""
    return encoding.partition("-")[0] in EXACT_MODES

DEFAULT_LEVELS: dict[str, str] = {"kdn": "default"}
"""The level a mode's name alone stands for where it has several (``kdn-default`` is what
``kdn.delivery`` stores by default); a mode of one level stands for that level, ``""``."""


def default_level(mode: str) -> str:
    """The level ``mode`` alone means: ``DEFAULT_LEVELS``, else ``""`` (an unknown mode too:
    ``check_codec`` names it)."""
    return DEFAULT_LEVELS.get(mode, "")


def check_codec(mode: str, level: str) -> None:
    """Raise InvalidArgument unless ``mode`` is a known codec mode and ``level`` one of its
    levels (the same messages as ``kdn.codec.modes.get_mode(...).check_level``); ``""``: the
    level the mode alone means (``default_level``)."""
    level = level or default_level(mode)
    levels = LEVELS.get(mode)
    if levels is None:
        raise InvalidArgument(f"unknown codec mode {mode!r}; known modes: {sorted(LEVELS)}")
    if level not in levels:
        raise InvalidArgument(f"codec mode {mode!r} has no level {level!r}; levels: "
                              f"{list(levels)}")
