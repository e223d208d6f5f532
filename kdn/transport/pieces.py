"""Entry values larger than one gRPC message, sent in pieces (Export's and Import's items).

A message is at most ``max_message_bytes``; a stored entry can be larger (Store sends it frame
by frame). An export or import item whose value would not fit is sent as several items, each
with the entry's names, ``offset`` (where its piece starts) and ``more`` (pieces follow); a
value that fits goes whole, as before pieces existed, so older peers still read it.
``Pieces`` joins them again on the receiving side.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kdn.errors import InvalidArgument, TooLarge

SLACK = 1024
"""Bytes of an item besides its value: names, cursor, counters (each under 200 bytes)."""


class Piece(Protocol):
    tenant: str
    namespace: str
    key: bytes
    offset: int
    more: bool
    value: bytes


def piece_bytes(max_message_bytes: int) -> int:
    """The most value bytes one item of a ``max_message_bytes`` message carries."""
    return max(256, max_message_bytes - SLACK)


def cut(value: bytes, size: int) -> Iterator[tuple[int, bytes, bool]]:
    """``(offset, piece, more)`` of ``value`` in pieces of at most ``size`` bytes: one (the
    whole value, an empty one too) when it fits."""
    if len(value) <= size:
        yield 0, value, False
        return
    for at in range(0, len(value), size):
        yield at, value[at:at + size], at + size < len(value)


class Pieces:
    """Joins values sent in pieces, one entry after another (a stream's items in order)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # the largest value taken (None: any); past it, pieces are dropped
        self._parts: list[bytes] = []
        self._size = 0
        self._name: tuple[str, str, bytes] | None = None  # the value being joined
        self.abandoned = 0
        """Values whose pieces stopped before their last (the next entry began, or the
        stream ended: ``end``): for the caller to count as refused."""

    def end(self) -> bool:
        """The stream ended: whether a value was left unfinished (its last piece never came),
        which is then counted ``abandoned`` too."""
        cut_off = self._name is not None
        self.abandoned += cut_off
        self._parts, self._size, self._name = [], 0, None
        return cut_off

    def drop(self) -> None:
        """Forget the value being joined (the caller refused it and counts it so), not
        ``abandoned``."""
        self._parts, self._size, self._name = [], 0, None

    def add(self, item: Piece) -> bytes | None:
        """The whole value when ``item`` is its last piece, else None. A piece at offset 0
        begins a value (one unfinished before it is ``abandoned``); a later piece must
        continue the value of the same names where it stopped, else InvalidArgument (and
        the value is dropped). TooLarge (at the last piece, once per value) for a value past
        ``limit``, whose pieces are not kept."""
        name = (item.tenant, item.namespace, bytes(item.key))
        if item.offset == 0:
            if self._name is not None:
                self.abandoned += 1
            self._parts, self._size, self._name = [], 0, name
        elif self._name != name or item.offset != self._size:
            had, self._parts, self._size, self._name = self._size, [], 0, None
            raise InvalidArgument(f"a piece at byte {item.offset} of key {name[2].hex()[:16]} "
                                  f"does not continue the value being joined ({had} bytes in)")
        self._size += len(item.value)
        if self.limit is None or self._size <= self.limit:
            self._parts.append(item.value)
        else:
            self._parts.clear()
        if item.more:
            return None
        size, value = self._size, b"".join(self._parts)
        self._parts, self._size, self._name = [], 0, None
        if self.limit is not None and size > self.limit:
            raise TooLarge(f"entry of {size} bytes exceeds max_entry_bytes {self.limit}")
        return value
