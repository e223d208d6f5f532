"""Per-request options of ``Client.store``, as plain Python types (no protobuf, no grpc).

The client turns a ``StoreOptions`` into the wire's ``kdn.v1.StoreOptions``; the server hands
``Durability`` to the tier hierarchy (``kdn.store.tiered.TieredStore.put``).

``MAX_TTL_S`` (10**10 s, over 300 years) is the longest time to live kdn keeps, one rule for
every path: a longer one is taken as it (as good as never expiring) by ``StoreOptions``, by the
server for any client's Store, by ``kdn admin export`` (the file records it) and by Import.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass

from kdn.checks import shown, whole
from kdn.errors import InvalidArgument

MAX_TTL_S = 10**10
"""The longest time to live an entry is given (over 300 years); a longer one is cut to it."""


class Durability(enum.IntEnum):
    """Where an entry must be before a store returns; the values mirror ``kdn.v1.Durability``."""

    DEFAULT = 0
    """The server's write policy decides."""
    MEMORY = 1
    """Acknowledged once in RAM."""
    DISK = 2
    """Acknowledged once on the disk tier (the call fails when the server has none)."""
    SHARED = 3
    """Acknowledged once in the shared tier (Redis; the call fails when it is unreachable)."""


@dataclass(frozen=True)
class StoreOptions:
    """How the server keeps one stored entry."""

    ttl_s: int = 0
    """Seconds until the entry expires; 0 = the server's ``default_ttl_s`` (0 there: never).
    One above ``MAX_TTL_S`` is taken as ``MAX_TTL_S``."""
    pin: bool = False
    """Never evict the entry while it is pinned. Kept by the RAM and disk tiers: a pinned store
    only a Redis tier would take (larger than both) is refused (``TooLarge``)."""
    durability: Durability = Durability.DEFAULT
    """Where the entry must be before the store is acknowledged (its name, ``"disk"``, or
    value is taken too; a bool is not)."""

    def __post_init__(self) -> None:
        whole("ttl_s", self.ttl_s, 0, " (seconds; 0: the server's default)")  # numpy's too
        object.__setattr__(self, "ttl_s", min(int(self.ttl_s), MAX_TTL_S))
        if not isinstance(self.pin, bool):
            raise InvalidArgument(f"pin must be a bool, got {self.pin!r}")
        object.__setattr__(self, "durability", _durability(self.durability))


def _durability(value: object) -> Durability:
    """``value`` as a Durability: one, its value (a whole number, not a bool: ``True`` is not
    "durable", it would be MEMORY) or its name in any case; else InvalidArgument."""
    try:
        if isinstance(value, str):
            return Durability[value.upper()]
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return Durability(int(value))
    except (KeyError, ValueError):
        pass
    raise InvalidArgument(f"durability must be a kdn.Durability or one of "
                          f"{[d.name for d in Durability]}, got {shown(value)}")
