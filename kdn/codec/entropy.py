"""Entropy coding of integer symbol streams: one static model per stream, range coded.

A caller hands over a matrix of small integers, one row per stream (for the KV modes: one row
per (head, channel) of one layer's K or V, the row running over tokens). Each row gets its own
frequency table, stored compactly, and all rows are range coded (``constriction``) one after
another into one word stream:

    sym: [streams, n] int32    ->    blob = u32 mark | u32 table_len | zstd(tables) | words

    tables (before zstd) = lo: [streams] int16 | width: [streams] uint16 | one byte per
                           symbol of every row's [lo, lo + width) range

Counts are the row histogram rescaled so its largest bin is 255 (any occurring symbol keeps a
count >= 1). Blobs written now (``RANS_LOG_MARK``) store each count as a 4-bit code, the
nearest of ``LOG_LEVELS`` on a log scale (0: the symbol does not occur); the model is built
from the levels. The tables were a tenth of a 256-token ``kdn-default`` entry of SmolLM2 with
exact counts, and the coarser model costs 0.2% of payload: entries are 3.7% smaller (1.1% at
1,024 tokens; ``bench.codec``). Blobs of exact counts (``RANS_MARK``) and range-coded ones
(format 1, a table length first) still decode; kdn from before format 3 refuses format-3
blobs as damaged (a fleet upgrades its readers before its writers). Encoder and decoder build
the identical model from those bytes. Rows of width 1 (a constant) cost no payload bits.
"""

from __future__ import annotations

import struct

import constriction
import numpy as np
import zstandard

from kdn.codec import rans
from kdn.codec.zstd import decompress
from kdn.errors import Corrupt

_U32 = struct.Struct("<I")
_Categorical = constriction.stream.model.Categorical
MAX_WIDTH = 1 << 15
_ZSTD_LEVEL = 9


def _tables(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo [streams] int64, width [streams] int64, counts [sum(width)] uint8) of each row."""
    lo = sym.min(axis=1).astype(np.int64)
    width = sym.max(axis=1).astype(np.int64) - lo + 1
    starts = np.concatenate([[0], np.cumsum(width)[:-1]])
    flat = (sym - lo[:, None] + starts[:, None]).ravel()
    counts = np.bincount(flat, minlength=int(width.sum()))
    # rescale per row so its largest count is 255; an occurring symbol keeps >= 1
    row_max = np.repeat(np.maximum.reduceat(counts, starts), width)
    scaled = np.where(counts > 0, np.maximum(1, (counts * 255 + row_max - 1) // row_max), 0)
    return lo, width, scaled.astype(np.uint8)


RANS_MARK = 0xFFFFFFFF
"""First word of a format-2 blob (parallel rANS, ``kdn.codec.rans``, exact counts); a format-1
blob starts with its table length instead, which is never this large."""
RANS_LOG_MARK = 0xFFFFFFFE
"""First word of a format-3 blob: format 2 with each count stored as a code of ``LOG_LEVELS``."""
RANS_MARKS = (RANS_MARK, RANS_LOG_MARK)
"""The first words of the parallel-rANS formats (2 and 3)."""
LOG_LEVELS = np.array([0, 1, 2, 3, 4, 5, 7, 11, 16, 24, 35, 52, 78, 116, 172, 255], np.uint8)
"""The count each 4-bit code stands for: 0 (absent), then about x1.5 a step from 1 to 255."""
COUNT_OF_CODE = np.zeros(256, np.uint8)  # code -> count (codes past 15 are damage: 0)
COUNT_OF_CODE[: len(LOG_LEVELS)] = LOG_LEVELS
_CODE_OF = np.array([0] + [1 + int(np.argmin(np.abs(np.log(c) - np.log(LOG_LEVELS[1:].astype(
    np.float64))))) for c in range(1, 256)], np.uint8)
"""count (0..255) -> the code of the nearest level on a log scale."""


def encode_streams(sym: np.ndarray, *, exact_counts: bool = False) -> bytes:
    """Code every row of ``sym`` ([streams, n] integers within int16) with its own model
    (``exact_counts``: a format-2 blob, the counts stored whole; else format 3)."""
    # sym: [streams, n]
    sym = np.ascontiguousarray(sym, dtype=np.int32)
    if sym.ndim != 2 or sym.shape[0] == 0:
        raise ValueError(f"encode_streams needs a non-empty [streams, n] matrix, got {sym.shape}")
    if sym.shape[1] == 0:
        return _U32.pack(0)
    lo, width, counts = _tables(sym)
    if lo.min() < -(1 << 15) or (lo + width).max() > (1 << 15) or width.max() > MAX_WIDTH:
        raise ValueError("symbols outside int16 range")
    mark, stored = RANS_MARK, counts
    if not exact_counts:
        mark, stored = RANS_LOG_MARK, _CODE_OF[counts]
        counts = LOG_LEVELS[stored]
    tables = lo.astype("<i2").tobytes() + width.astype("<u2").tobytes() + stored.tobytes()
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(tables)
    body = rans.encode(sym, lo, width, counts)
    return _U32.pack(mark) + _U32.pack(len(packed)) + packed + body


def _range_coded(sym: np.ndarray, lo: np.ndarray, width: np.ndarray, counts: np.ndarray
                 ) -> bytes:
    """The words of the format-1 range coder (one sequential stream; kept for tests that
    check old entries still decode)."""
    enc = constriction.stream.queue.RangeEncoder()
    off = 0
    for row, lo_r, w in zip(sym, lo.tolist(), width.tolist()):
        if w > 1:
            probs = counts[off : off + w].astype(np.float32)
            enc.encode(row - np.int32(lo_r), _Categorical(probs, perfect=False))
        off += w
    return enc.get_compressed().astype("<u4").tobytes()  # type: ignore[no-any-return]


def parse_tables(buf: bytes | memoryview, streams: int, n: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, memoryview | None]:
    """(lo, width, counts, rANS section) of a blob; the section is None for a format-1 blob
    (whose range-coded words follow the tables) and for n == 0."""
    mv = memoryview(buf)
    if len(mv) < 4:
        raise Corrupt("entropy blob truncated")
    (tlen,) = _U32.unpack_from(mv, 0)
    if n == 0:
        if tlen or len(mv) != 4:
            raise Corrupt("entropy blob of an empty stream set is not empty")
        empty = np.zeros(streams, dtype=np.int32)
        return empty, np.ones(streams, dtype=np.int64), np.zeros(0, np.uint8), None
    parallel = tlen in RANS_MARKS
    coded = tlen == RANS_LOG_MARK
    if parallel:
        mv = mv[4:]
        if len(mv) < 4:
            raise Corrupt("entropy blob truncated")
        (tlen,) = _U32.unpack_from(mv, 0)
    if 4 + tlen > len(mv) or not parallel and (len(mv) - 4 - tlen) % 4:
        raise Corrupt("entropy blob sections do not add up")
    tables = decompress(mv[4 : 4 + tlen], streams * (4 + MAX_WIDTH), "entropy tables")
    if len(tables) < 4 * streams:
        raise Corrupt("entropy tables truncated")
    lo = np.frombuffer(tables, dtype="<i2", count=streams).astype(np.int32)
    width = np.frombuffer(tables, dtype="<u2", count=streams, offset=2 * streams).astype(np.int64)
    counts = np.frombuffer(tables, dtype=np.uint8, offset=4 * streams)
    if (width == 0).any() or int(width.sum()) != len(counts):
        raise Corrupt("entropy tables are inconsistent")
    if coded:
        if len(counts) and int(counts.max()) >= len(LOG_LEVELS):
            raise Corrupt("entropy table code out of range")
        counts = COUNT_OF_CODE[counts]
    return lo, width, counts, mv[4 + tlen :] if parallel else None


def decode_streams(buf: bytes | memoryview, streams: int, n: int) -> np.ndarray:
    """Inverse of ``encode_streams``: the [streams, n] int32 matrix (either format)."""
    lo, width, counts, section = parse_tables(buf, streams, n)
    if n == 0:
        return np.zeros((streams, 0), dtype=np.int32)
    if section is not None:
        return rans.decode(section, lo, width, counts, streams, n)
    mv = memoryview(buf)
    (tlen,) = _U32.unpack_from(mv, 0)
    words = np.frombuffer(mv[4 + tlen :], dtype="<u4").astype(np.uint32)
    out = np.zeros((streams, n), dtype=np.int32)
    try:
        dec = constriction.stream.queue.RangeDecoder(words)
        off = 0
        for i, w in enumerate(width.tolist()):
            if w > 1:
                probs = counts[off : off + w].astype(np.float32)
                if not probs.any():
                    raise Corrupt("entropy table row has no mass")
                out[i] = dec.decode(_Categorical(probs, perfect=False), n)
            off += w
        if not dec.maybe_exhausted():
            raise Corrupt("entropy payload has words left over after its symbols")
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise Corrupt(f"entropy payload does not decode: {exc}") from exc
    out += lo[:, None]
    return out
