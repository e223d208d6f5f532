"""An entry held as the frames it arrived in, not copied into one buffer.

A Store stream brings an entry as one gRPC message per frame, and gRPC hands each message to
Python as a bytes object of its own. Copying those frames into one contiguous buffer would be a
large share of a Store's server time (a whole pass over the entry, writing memory no cache
holds). The RAM tier (``Tier.takes_framed``) keeps a ``Framed`` value instead: the
container header and a view of each frame inside the message it came in. Those messages are
exactly the ``RetrieveResponse`` messages a Retrieve of the whole entry sends
(``kdn.transport.wire``: Store and Retrieve carry a frame in the same encoding), so when every frame
came whole the first read sends them as they are (``messages``), with nothing built.

Everything else that reads a tier value wants one buffer (arena copies, GetMany, lower tiers,
verification): ``RamTier.get_stamped`` joins a ``Framed`` value once, on its first such read,
and keeps the joined bytes in its place (same stamp: the same bytes). Only a reader that asks
for it (``framed=True``: Retrieve) sees the frames. A ``Framed`` value is immutable, as the
tier's bytes are: its messages are ``bytes``, and every frame is a read-only view of one.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_FRAMED_BYTES = 64 << 10
"""Smaller entries are joined into one buffer as they are stored: a ``Framed`` value's own
objects would weigh on them (and their copy is cheap)."""
MAX_FRAMED_BYTES = 256 << 20
"""Stores up to this size may be kept as their frames (``framed_limit``)."""


def framed_limit(kept_free: int) -> int:
    """The largest Store a server keeps as its frames, where the allocator keeps
    ``kept_free`` bytes of free heap (``kdn.transport.buffers.kept_free_bytes``): half that, up to
    ``MAX_FRAMED_BYTES``. A larger one is copied into one recycled buffer as it lands
    (``kdn.transport.buffers``): once the entry it replaces is freed, more memory than the allocator
    keeps goes back to the kernel, and the next Store's messages would fault it in again,
    which costs more than the copy. Kept where the memory stays
    (``kdn.transport.buffers.server_trim_bytes``), a Store of that size costs no copy."""
    return min(MAX_FRAMED_BYTES, kept_free // 2)


@dataclass(frozen=True, slots=True)
class Framed:
    header: bytes
    """The container header (``Header.raw``)."""
    frames: tuple[bytes | memoryview, ...]
    """Each frame's bytes, in order (read-only views of the messages they came in)."""
    messages: tuple[bytes, ...] | None
    """Frame ``i``'s serialized ``RetrieveResponse`` (``kdn.transport.wire.frame_message`` form) for
    every frame, where each came whole in one message of that form; None otherwise."""
    nbytes: int
    """``len(header) + sum(len(frame))``: the entry's size, as the joined bytes'."""

    def __post_init__(self) -> None:
        size = len(self.header) + sum(len(f) for f in self.frames)
        if size != self.nbytes:
            raise ValueError(f"framed entry of {size} bytes declared as {self.nbytes}")
        if self.messages is not None and len(self.messages) != len(self.frames):
            raise ValueError(f"{len(self.messages)} messages for {len(self.frames)} frames")
        if any(isinstance(f, memoryview) and not f.readonly for f in self.frames):
            raise ValueError("a framed entry's frames must be read-only")

    def __len__(self) -> int:
        return self.nbytes

    def joined(self) -> bytes:
        """The entry as one buffer (a copy of every frame)."""
        return b"".join((self.header, *self.frames))


def contiguous(value: bytes | Framed) -> bytes:
    """``value`` as one buffer: a ``Framed`` value joined, any other as it is."""
    return value.joined() if isinstance(value, Framed) else value
