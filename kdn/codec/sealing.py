"""Sealing: a container's checksums made from its bytes, for entries whose bodies were written
in place (``kdn.client.staged``) and whose frame sums are not known yet. ``copy_sealed`` is the
server's (it makes the sums on its own copy, so nothing the writer changes later reaches
them); ``seal_in_place`` is a client's that sends the bytes (no segment)."""

from __future__ import annotations

import struct

from kdn.codec.copies import copy_head, copy_summed
from kdn.codec.format import (
    FRAME_SEED,
    FRAME_STRUCT,
    Header,
    build_header,
    check_frame,
    frame_length,
    frame_sum,
    header_size,
    parse_header,
    sealed_header,
)
from kdn.errors import Corrupt, InvalidArgument, Truncated


def seal_in_place(buf: memoryview) -> Header:
    """``copy_sealed`` without the copy: the sums of the container ``buf`` (writable) made on
    its own bytes and written into its prefixes and header (a staged entry stored another way
    than through the segment). Returns the sealed header."""
    out = memoryview(buf).cast("B")
    head = header_size(out)
    header = parse_header(out[:head])
    if header.version < 2:
        raise InvalidArgument(f"only container version 2 is sealed, not {header.version}")
    entry, off = header.entry, head
    for i in range(len(entry.frames)):
        n = frame_length(out, off)
        if off + n > len(out):
            raise Truncated(f"frame {i} needs {n} bytes, {len(out) - off} remain")
        full = frame_sum(FRAME_SEED, out[off : off + 12], out[off + FRAME_STRUCT.size : off + n])
        struct.pack_into("<L", out, off + 12, full & 0xFFFFFFFF)
        entry.frames[i].checksum = full
        off += n
    return _sealed_header(out, head, off, header)


def copy_sealed(dst: memoryview, value: bytes | memoryview) -> Header:
    """Copy a version-2 container whose frame sums are not written yet (a staged entry: its
    bodies filled in place, ``kdn.client.staged``) into ``dst`` (of its length) and seal the
    copy: each frame is hashed chunk by chunk as it is copied (as ``copy_checked`` does), its
    sum written into the copy's prefix and into the header, which is rebuilt (sums are fixed
    width: its length does not change); then every frame of the copy is checked whole (magic,
    position, length, each record against the layout). The source's sums are not read; its
    header must be whole (its own checksum holds) and fixes the layout, codec and spans. The
    sums come from the bytes copied, so nothing the source's writer changes later reaches them.
    Returns the sealed header. Raises Corrupt/Truncated/InvalidLayout/InvalidArgument; ``dst``
    then holds unchecked bytes."""
    src, out, head, header = copy_head(dst, value)
    if header.version < 2:
        raise InvalidArgument(f"an entry sealed on store must be container version 2, not "
                              f"{header.version}")
    entry = header.entry
    spans: list[tuple[int, int, int]] = []  # (start, end, sum)
    off = head
    for i in range(len(entry.frames)):
        if len(out) - off < FRAME_STRUCT.size:
            raise Truncated(f"frame {i}: {len(out) - off} bytes can not hold its prefix")
        out[off : off + FRAME_STRUCT.size] = src[off : off + FRAME_STRUCT.size]
        n = frame_length(out, off)  # from the copy: the source may change under it
        if off + n > len(out):
            raise Truncated(f"frame {i} needs {n} bytes, {len(out) - off} remain")
        full = copy_summed(header, i, out[off : off + n], src[off : off + n])
        struct.pack_into("<L", out, off + 12, full & 0xFFFFFFFF)
        entry.frames[i].checksum = full
        spans.append((off, off + n, full))
        off += n
    header = _sealed_header(out, head, off, header)
    for i, (start, end, full) in enumerate(spans):
        check_frame(header, i, out[start:end], digest=full, records=False)
    return header


def _sealed_header(out: memoryview, head: int, end: int, header: Header) -> Header:
    """Write the header of ``header.entry`` (its sums filled in) over the ``head`` bytes at the
    start of ``out``, once the frames ended at ``end``: the sealed header."""
    if end != len(out):
        raise Corrupt(f"{len(out) - end} trailing bytes after the last frame")
    sealed = build_header(header.entry, header.version)
    if len(sealed) != head:
        raise Corrupt(f"sealed header of {len(sealed)} bytes in place of {head}")
    out[:head] = sealed
    return sealed_header(header, sealed)
