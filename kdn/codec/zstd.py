"""zstd decompression of untrusted bytes, bounded by what the caller expects.

python-zstandard's ``decompress(data, max_output_size=n)`` honours ``n`` only for frames that do
not declare their content size; a frame that declares one gets a buffer of that size, whatever
``n`` is (a 20-byte frame declaring 2**45 bytes raises MemoryError, one declaring 16 GiB
reserves it). Bodies and entropy tables are checksummed, but a checksum says who wrote the
bytes, not that they are sane, so the declared size is checked first: against what the caller
expects, and against what the frame's blocks can regenerate at all (``capacity``).
"""

from __future__ import annotations

from typing import Any

import zstandard

from kdn.errors import Corrupt

BLOCK_MAX = 1 << 17
"""The most bytes one zstd block regenerates (128 KiB, whatever the window)."""


def capacity(data: Any, at: int, end: int) -> int:
    """The most content the blocks of a zstd frame, ``data[at:end]`` from its first block on,
    can regenerate, read from their 3-byte headers alone: a raw or RLE block the size its
    header gives, a compressed one ``BLOCK_MAX``; a block cut short nothing. libzstd refuses a
    frame that does not regenerate exactly the size its header declares, so one declaring
    more can not decode: refused before anything is allocated for it, it can not make a
    caller that sizes buffers from headers (``gpu_plan.table_sizes``: every blob's tables
    staged at once) reserve more than its bytes could fill. ``data``: bytes or a memoryview of
    them here, a uint8 array where ``gpu_plan`` compiles it."""
    total = 0
    while at + 3 <= end:
        head = data[at] + 256 * data[at + 1] + 65536 * data[at + 2]  # int64 compiled, too
        kind, size = head >> 1 & 3, head >> 3
        at += 3 + (1 if kind == 1 else size)
        if at > end:
            break
        total += size if kind < 2 else BLOCK_MAX
        if head & 1:  # the last block
            break
    return total


def frame_end(data: Any, at: int, end: int) -> int:
    """Where the blocks of a zstd frame, ``data[at:end]`` from its first block on, end (read
    from their 3-byte headers, as ``capacity``; its checksum, where its header asks for one,
    follows), or -1 where they are cut short by ``end``."""
    while at + 3 <= end:
        head = data[at] + 256 * data[at + 1] + 65536 * data[at + 2]
        at += 3 + (1 if (head >> 1 & 3) == 1 else head >> 3)
        if at > end:
            break
        if head & 1:
            return at
    return -1


def decompress(data: bytes | memoryview, limit: int, where: str) -> bytes:
    """The single zstd frame ``data`` decompressed, at most ``limit`` bytes; Corrupt if it
    declares more (or more than its blocks can regenerate: ``capacity``), declares no size
    (kdn writes every frame in one piece, its size declared; a GPU's decoder sizes its
    buffers from it, and the same bytes must give the same answer on both), does not decode,
    or has bytes after its frame."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared < 0:
            raise Corrupt(f"{where}: zstd frame declares no size")
        mv = memoryview(data).cast("B")
        limit = min(limit, capacity(mv, zstandard.frame_header_size(mv), len(mv)))
        if declared > limit:
            raise Corrupt(f"{where}: zstd frame declares {declared} bytes, at most {limit} "
                          "expected")
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=limit,
                                                       allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise Corrupt(f"{where}: zstd data does not decode: {exc}") from exc
