"""Checked copies: a container or frame copied into a destination and verified on the copy,
each chunk hashed right after it is written (one pass over memory instead of a copy then a
hash), so a source that changes under the copy can not slip past (the server's copies out of a
client's segment, reads into its arenas and the client's in-process tier); ``copy_summed``
only makes a frame's sum on its copy (``kdn.codec.sealing``)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import xxhash

from kdn.codec.format import (
    FRAME_STRUCT,
    Header,
    check_frame_prefix,
    frame_length,
    frame_sum,
    header_size,
    parse_header,
)
from kdn.errors import Corrupt, InvalidArgument, Truncated, again, kept

COPY_CHUNK = 2 << 20
"""Bytes ``copy_checked`` copies at a time: each chunk is hashed while it is still in cache
(a CPU core's L2 holds it). A 1 MiB frame (the wire's) is copied whole, then hashed: from
uncached memory that is a little faster than copying and hashing it in smaller chunks."""


_NUMPY_COPY_BYTES = 64 << 10
"""Frames from this size are copied by numpy (the GIL free meanwhile; below it its call costs
more than the copy)."""

PARALLEL_COPY_BYTES = 16 << 20
"""``copy_checked`` with a pool splits entries from this size over its workers (smaller ones
lose more to the hand-off than the second core gives: measured at 12 MB and 47 MB)."""


def copy_head(dst: memoryview, value: bytes | memoryview
              ) -> tuple[memoryview, memoryview, int, Header]:
    """The first step of a checked copy of the container ``value`` into ``dst`` (its
    length): both as byte views, the header's length, and the header copied and parsed from
    the copy (so a source that changes under it can not slip past)."""
    src, out = memoryview(value).cast("B"), memoryview(dst).cast("B")
    if len(out) != len(src):
        raise InvalidArgument(f"copy of {len(src)} bytes into {len(out)}")
    head = header_size(src)
    out[:head] = src[:head]
    return src, out, head, parse_header(out[:head])


def copy_checked(dst: memoryview, value: bytes | memoryview, *,
                 pool: Executor | None = None, workers: int = 1) -> Header:
    """Copy the container ``value`` into ``dst`` (same length) and verify the copy: header
    checksum, every frame's checksum and framing, hashed chunk by chunk right after each chunk
    is written (one pass over memory instead of a copy then a hash). Records are not walked
    again: a stored entry's were checked when it was stored, and its checksums bind them.
    With a ``pool`` and ``workers`` > 1, an entry of ``PARALLEL_COPY_BYTES`` or more is copied
    as that many runs of whole frames at once, the last on the calling thread (numpy copies and
    xxhash hashes without the GIL).
    Returns the header (parsed from the copy). Raises Corrupt/Truncated once every run has
    ended; ``dst`` then holds unchecked bytes."""
    src, out, head, header = copy_head(dst, value)
    spans: list[tuple[int, int, int]] = []  # (index, start, end); lengths from the source,
    off = head  # checked again on the copy (its prefix) so a source that changes is caught
    for i in range(len(header.entry.frames)):
        n = frame_length(src, off)
        if off + n > len(src):
            raise Truncated(f"frame {i} needs {n} bytes, {len(src) - off} remain")
        spans.append((i, off, off + n))
        off += n
    if off != len(src):
        raise Corrupt(f"{len(src) - off} trailing bytes after the last frame")

    def run(part: list[tuple[int, int, int]]) -> None:
        for i, start, end in part:
            # the checksum binds these bytes to what Store validated record by record: the
            # frame as a whole is what is left to check here
            copy_frame_checked(header, i, out[start:end], src[start:end])

    if pool is None or workers < 2 or len(spans) < 2 or len(src) < PARALLEL_COPY_BYTES:
        run(spans)
        return header
    share, size = len(src) / workers, 0
    runs: list[list[tuple[int, int, int]]] = []
    part: list[tuple[int, int, int]] = []
    for span in spans:  # consecutive frames, about len / workers bytes a run
        part.append(span)
        size += span[2] - span[1]
        if size >= share * (len(runs) + 1) and len(runs) < workers - 1:
            runs.append(part)
            part = []
    runs.append(part)
    runs = [r for r in runs if r]
    futures = [pool.submit(run, r) for r in runs[:-1]]  # the last run on this thread
    mine: BaseException | None = None
    try:
        run(runs[-1])
    except BaseException as exc:  # raised once every run has ended
        mine = kept(exc)  # not this frame, which holds it
    errors = [f.exception() for f in futures]
    for err in (*errors, mine):
        if err is not None:  # a copy: this frame holds ``err`` and the futures theirs
            raise again(err)
    return header


def copy_frame_checked(header: Header, index: int, dst: memoryview,
                       frame: bytes | memoryview) -> None:
    """Copy frame ``index`` into ``dst`` (of its length), hashing each chunk right after it
    is written, then check the copy as a whole (magic, position, length, checksum: see
    ``check_frame_prefix``). Raises Corrupt/Truncated; ``dst`` then holds unchecked bytes.
    A frame of at most ``COPY_CHUNK`` bytes is one chunk: copied in one go, its copy hashed
    whole while in cache (a ``FrameCopy`` per small frame was most of the 1.75 ms of server
    CPU a 1 MiB entry of 32 one-layer frames took to enter a read arena)."""
    if len(frame) > COPY_CHUNK:
        copy_pieces_checked(header, index, dst, (frame,))
        return
    out = memoryview(dst).cast("B")
    if len(out) != len(frame):
        raise InvalidArgument(f"copy of {len(frame)} bytes of frame {index} into {len(out)} "
                              "bytes")
    _copy_whole(out, frame)
    check_frame_prefix(header, index, out)


def copy_summed(header: Header, index: int, dst: memoryview, frame: bytes | memoryview) -> int:
    """Copy frame ``index`` into ``dst`` (of its length) and return the full sum of the copy
    (prefix sum bytes aside), hashed right after it is written (``FrameCopy``; a frame of at
    most ``COPY_CHUNK`` bytes in one go, without building one). Nothing is checked."""
    if len(frame) > COPY_CHUNK or len(frame) < FRAME_STRUCT.size or len(frame) != len(dst):
        copy = FrameCopy(header, index, dst)
        copy.add(frame)
        return copy.digest()
    out = memoryview(dst).cast("B")
    _copy_whole(out, frame)
    return frame_sum(header.frame_seed, out[:12], out[FRAME_STRUCT.size:])


def _copy_whole(out: memoryview, frame: bytes | memoryview) -> None:
    """``frame`` copied into ``out`` (a byte view of its length) in one go: by numpy from
    ``_NUMPY_COPY_BYTES`` on, the GIL free meanwhile (a memoryview's assignment holds it)."""
    if len(out) >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(out, dtype=np.uint8),
                  np.frombuffer(memoryview(frame).cast("B"), dtype=np.uint8))
    else:
        out[:] = memoryview(frame).cast("B")


def copy_pieces_checked(header: Header, index: int, dst: memoryview,
                        pieces: Sequence[bytes | memoryview]) -> None:
    """``copy_frame_checked`` of a frame that came in ``pieces`` (consecutive, together its
    bytes: ``Frame.offset``), copied one after another into ``dst``."""
    total = sum(len(p) for p in pieces)
    if total != len(dst):
        raise InvalidArgument(f"copy of {total} bytes of frame {index} into {len(dst)} bytes")
    copy = FrameCopy(header, index, dst)
    for piece in pieces:
        copy.add(piece)
    copy.check()


class FrameCopy:
    """Frame ``index`` copied to the start of ``dst`` piece by piece as its pieces arrive,
    each chunk hashed right after it is written (while in cache), then checked as a whole
    (``check``: the ``at`` bytes written, see ``check_frame_prefix``)."""

    __slots__ = ("header", "index", "out", "_a", "_h", "at", "_hashed")

    def __init__(self, header: Header, index: int, dst: memoryview) -> None:
        self.header, self.index = header, index
        self.out = memoryview(dst).cast("B")
        self._a = np.frombuffer(self.out, dtype=np.uint8)
        self._h = xxhash.xxh3_64(seed=header.frame_seed)
        self.at = self._hashed = 0  # written up to ``at``, summed up to ``_hashed`` (bytes 12
        # to the prefix's end are not summed: the checksum lies there)

    def add(self, piece: bytes | memoryview) -> None:
        """Copy the next piece in (Corrupt when it overruns ``dst``)."""
        src = np.frombuffer(memoryview(piece).cast("B"), dtype=np.uint8)
        if self.at + len(src) > len(self.out):
            raise Corrupt(f"frame {self.index}: pieces exceed the {len(self.out)} bytes left")
        out, h = self.out, self._h
        for lo in range(0, len(src), COPY_CHUNK):
            hi = min(lo + COPY_CHUNK, len(src))
            np.copyto(self._a[self.at:self.at + hi - lo], src[lo:hi])
            self.at += hi - lo
            if not self._hashed and self.at >= FRAME_STRUCT.size:
                h.update(out[:12])
                self._hashed = FRAME_STRUCT.size
            if self._hashed and self.at > self._hashed:
                h.update(out[self._hashed:self.at])
                self._hashed = self.at

    def digest(self) -> int:
        """The full sum of what was written so far (prefix sum bytes aside)."""
        return int(self._h.intdigest())

    def check(self) -> None:
        """Check the copy as a whole; Corrupt/Truncated (then ``dst`` holds unchecked bytes)."""
        if self.at < FRAME_STRUCT.size:
            raise Truncated(f"frame {self.index}: {self.at} bytes can not hold its prefix")
        check_frame_prefix(self.header, self.index, self.out[:self.at],
                           digest=self._h.intdigest())
