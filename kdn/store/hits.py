"""What the hierarchy (``kdn.store.tiered``) answers and is configured with: the write policy,
a read's hit (bytes, or the frames a RAM value arrived in), a lookup's presence and how a
lookup finds it (``lookup``: in each tier in read order, a queued value as if the tier held
it, a pending delete hiding what the tier holds), and which tiers hold one key (``held_by``)."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from kdn.store.base import Tier
from kdn.store.framed import Framed
from kdn.store.health import TierHealth
from kdn.store.queue import WriteQueue


class WritePolicy(enum.StrEnum):
    """When lower tiers are written for a request with DEFAULT durability."""

    WRITE_THROUGH = "write-through"
    WRITE_BEHIND = "write-behind"


@dataclass(frozen=True)
class Hit:
    value: bytes
    tier: str
    stamp: int = field(default=0, compare=False)
    """The tier's stamp of this value where it keeps one (``Tier.get_stamped``: a put's
    number, so another value of the key has another stamp); 0 for a queued value."""


@dataclass(frozen=True)
class FramedHit:
    """``get_in_memory(framed=True)``'s answer for a RAM value held as the frames it arrived
    in (``kdn.store.framed``)."""

    value: Framed
    tier: str
    stamp: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Presence:
    present: bool
    tier: str = ""
    size: int = 0


def lookup(keys: list[bytes], tiers: Sequence[Tier], queues: Mapping[str, WriteQueue],
           health: TierHealth) -> list[Presence]:
    """Where each of ``keys`` is, the first of ``tiers`` holding it (``queues``: the lower
    tiers' write queues; a tier that is down is not asked)."""
    out = [Presence(False)] * len(keys)
    todo = list(range(len(keys)))
    now = time.monotonic()
    for tier in tiers:
        if not todo:
            break
        q = queues.get(tier.name)
        ask = []
        for i in todo:
            item = q.peek(keys[i]) if q is not None else None
            if item is None:
                ask.append(i)
            elif item.value is not None and not item.expired(now):
                out[i] = Presence(True, tier.name, len(item.value))
        sizes: list[int | None] = [None] * len(ask)
        if ask and health.is_up(tier.name):
            got = health.guard(tier, partial(tier.size_many, [keys[i] for i in ask]),
                               "size_many")
            if got is not None:
                sizes = got
        todo = [i for i in todo if not out[i].present]
        for i, size in zip(ask, sizes):
            if size is not None:
                out[i] = Presence(True, tier.name, size)
        todo = [i for i in todo if not out[i].present]
    return out


def held_by(key: bytes, tiers: Sequence[Tier], queues: Mapping[str, WriteQueue],
            health: TierHealth, queued: bool = False) -> list[Tier]:
    """The ``tiers`` holding ``key``, in read order (a tier that is down is not asked).
    ``queued``: a live value in a tier's write queue counts as held there (it lands there),
    a pending delete (or an expired value) as not held."""
    out, now = [], time.monotonic()
    for tier in tiers:
        q = queues.get(tier.name) if queued else None
        item = q.peek(key) if q is not None else None
        if item is not None:
            held = item.value is not None and not item.expired(now)
        else:
            held = health.is_up(tier.name) and bool(
                health.guard(tier, partial(tier.contains, key), "contains"))
        if held:
            out.append(tier)
    return out
