"""What the hierarchy (``kdn.store.tiered``) answers and is configured with: the write policy,
a read's hit (bytes, or the frames a RAM value arrived in), a lookup's presence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kdn.store.framed import Framed


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
