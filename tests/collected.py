"""What only the cyclic garbage collector frees, for the tests that a path leaves none of it:
the ``kdn`` objects among it, and the reference cycles that hold them, printed."""

from __future__ import annotations

import gc
from collections.abc import Callable

PREFIX = "kdn."


def kdn_garbage(found: list[object]) -> list[str]:
    """The ``kdn`` types among ``found`` (``gc.garbage`` once collected)."""
    return sorted({type(o).__qualname__ for o in found if type(o).__module__.startswith(PREFIX)})


def collected(run: Callable[[], object], times: int = 2) -> list[object]:
    """What the collector found after ``run()`` ran ``times`` times with it off (kept, not
    freed: ``gc.DEBUG_SAVEALL``); whatever ``run`` returns is dropped at once."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(times):
            run()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def cycle(found: list[object], start: object) -> list[object] | None:
    """The shortest way from ``start`` back to itself over references among ``found`` (a BFS
    over ``gc.get_referents``), or None where ``start`` is in no cycle."""
    among = {id(o): o for o in found}
    back: dict[int, int] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for o in frontier:
            for r in gc.get_referents(o):
                if r is start:  # o's way back to start, then turned around
                    path = [o]
                    while path[-1] is not start:
                        path.append(among[back[id(path[-1])]])
                    return [*reversed(path), start]
                if id(r) in among and id(r) not in back and r is not start:
                    back[id(r)] = id(o)
                    nxt.append(r)
        frontier = nxt
    return None


def _name(o: object) -> str:
    t = type(o)
    code = getattr(o, "f_code", None)
    where = f" {code.co_qualname}:{o.f_lineno}" if code is not None else ""  # type: ignore[attr-defined]
    return f"{t.__module__}.{t.__qualname__}{where}"


def cycles(found: list[object], limit: int = 3) -> str:
    """The cycles through the ``kdn`` objects among ``found``, one a line (at most
    ``limit``): what a failing test shows."""
    lines: list[str] = []
    seen: set[int] = set()
    for o in found:
        if not type(o).__module__.startswith(PREFIX) or id(o) in seen:
            continue
        c = cycle(found, o)
        if c is not None:
            seen.update(id(x) for x in c)
            lines.append(" -> ".join(_name(x) for x in c))
            if len(lines) >= limit:
                break
    return "\n".join(lines) or "(no cycle through a kdn object: one holds them)"
