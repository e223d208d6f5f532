"""Entropy coding of integer symbol streams: one static model per stream, rANS coded.

A caller hands over a matrix of small integers, one row per stream (for the KV modes: one row
per (head, channel) of one layer's K or V, the row running over tokens). Each row gets its own
frequency table, stored compactly, and every row is coded by ``kdn.codec.rans`` in blocks of
independent streams:

    sym: [streams, n] int32  ->  blob = u32 RANS_NIBBLE_MARK | u32 table_len | u32 codes_len
                                        | zstd(lo: [streams] int16 | width: [streams] uint16)
                                        | codes: a 4-bit code per bin of every row's
                                          [lo, lo + width) range, two to a byte, low first
                                        | rANS section

Counts are the row histogram rescaled so its largest bin is 255 (any occurring symbol keeps a
count >= 1), then stored as the code of the nearest of ``LOG_LEVELS`` on a log scale (0: the
symbol does not occur); the model is built from the levels. The codes lie outside zstd (format
4): a GPU decoder reads them where the entry's bytes landed, and the host decompresses only
lo and width, a quarter of the table bytes (zstd made the codes 7% smaller: 256-token entries
grow by 0.05-0.5%, 1.3% for ``kdn-near-lossless``; ``bench.codec``).
Older blobs still decode: format 3 (``RANS_LOG_MARK``, a byte per code inside zstd), format 2
(``RANS_MARK``, exact counts inside zstd), format 1 (range coded, a table length first). kdn
from before a format refuses its blobs as damaged (a fleet upgrades its readers before its
writers). Encoder and decoder build the identical model from those bytes. Rows of width 1 (a
constant) cost no payload bits.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import constriction
import numpy as np
import zstandard

from kdn.codec import rans
from kdn.codec.room import check_room
from kdn.codec.zstd import decompress
from kdn.errors import Corrupt, InvalidArgument

_U32 = struct.Struct("<I")
TABLE_BYTES_PER_STREAM = 80
"""Host memory a decoder's tables and models take per stream: bounds, widths, bins, the
normalized model and bucket table (~65 bytes), rounded up."""
_Categorical = constriction.stream.model.Categorical
MAX_WIDTH = 1 << 15
_ZSTD_LEVEL = 9


def _tables(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo [streams] int64, width [streams] int64, counts [sum(width)] uint8) of each row.
    InvalidArgument, before anything is sized by them, for symbols outside int16 or a row
    wider than ``MAX_WIDTH`` (a NaN quantized to INT32_MIN asked for a 16 GiB histogram)."""
    lo = sym.min(axis=1).astype(np.int64)
    hi = sym.max(axis=1).astype(np.int64)
    width = hi - lo + 1
    if lo.min() < -(1 << 15) or hi.max() >= 1 << 15 or width.max() > MAX_WIDTH:
        row = int(np.argmax((lo < -(1 << 15)) | (hi >= 1 << 15) | (width > MAX_WIDTH)))
        raise InvalidArgument(f"entropy symbols must lie within int16, at most {MAX_WIDTH} "
                              f"values a row; row {row} spans [{lo[row]}, {hi[row]}]")
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
RANS_NIBBLE_MARK = 0xFFFFFFFD
"""First word of a format-4 blob: the codes of format 3 two to a byte, outside zstd."""
FORMAT_OF_MARK = {RANS_MARK: 2, RANS_LOG_MARK: 3, RANS_NIBBLE_MARK: 4}
"""The blob format each parallel-rANS mark stands for (any other first word: format 1)."""
RANS_MARKS = tuple(FORMAT_OF_MARK)
"""The first words of the parallel-rANS formats (2, 3 and 4)."""
LOG_LEVELS = np.array([0, 1, 2, 3, 4, 5, 7, 11, 16, 24, 35, 52, 78, 116, 172, 255], np.uint8)
"""The count each 4-bit code stands for: 0 (absent), then about x1.5 a step from 1 to 255."""
COUNT_OF_CODE = np.zeros(256, np.uint8)  # code -> count (codes past 15 are damage: 0)
COUNT_OF_CODE[: len(LOG_LEVELS)] = LOG_LEVELS
_CODE_OF = np.array([0] + [1 + int(np.argmin(np.abs(np.log(c) - np.log(LOG_LEVELS[1:].astype(
    np.float64))))) for c in range(1, 256)], np.uint8)
"""count (0..255) -> the code of the nearest level on a log scale."""


_WRITTEN = [4]
"""The blob format ``encode_streams`` writes when not told (``writing_format``)."""


@contextlib.contextmanager
def writing_format(fmt: int) -> Iterator[None]:
    """Within it, every mode's ``encode_streams`` writes blob format ``fmt`` (3 and 2 are what
    earlier kdn wrote: tests and ``bench.codec`` make such entries). Process-wide: not for
    encodes running on other threads meanwhile."""
    if fmt not in (2, 3, 4):
        raise ValueError(f"encode_streams writes blob formats 2, 3 and 4, not {fmt!r}")
    before = _WRITTEN[0]
    _WRITTEN[0] = fmt
    try:
        yield
    finally:
        _WRITTEN[0] = before


def encode_streams(sym: np.ndarray, *, fmt: int | None = None) -> bytes:
    """Code every row of ``sym`` ([streams, n] integers within int16) with its own model, in
    blob format ``fmt`` (None: 4, or what ``writing_format`` set)."""
    fmt = _WRITTEN[0] if fmt is None else fmt
    # sym: [streams, n]
    sym = np.ascontiguousarray(sym, dtype=np.int32)
    if sym.ndim != 2 or sym.shape[0] == 0:
        raise ValueError(f"encode_streams needs a non-empty [streams, n] matrix, got {sym.shape}")
    if fmt not in (2, 3, 4):
        raise ValueError(f"encode_streams writes blob formats 2, 3 and 4, not {fmt!r}")
    if sym.shape[1] == 0:
        return _U32.pack(0)
    lo, width, counts = _tables(sym)
    bounds = lo.astype("<i2").tobytes() + width.astype("<u2").tobytes()
    zstd = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    if fmt == 2:
        head = _U32.pack(RANS_MARK) + _pack_zstd(zstd, bounds + counts.tobytes())
    else:
        codes = _CODE_OF[counts]
        counts = LOG_LEVELS[codes]
        if fmt == 3:
            head = _U32.pack(RANS_LOG_MARK) + _pack_zstd(zstd, bounds + codes.tobytes())
        else:
            packed = zstd.compress(bounds)
            nibbles = pack_nibbles(codes)
            head = b"".join((_U32.pack(RANS_NIBBLE_MARK), _U32.pack(len(packed)),
                             _U32.pack(len(nibbles)), packed, nibbles))
    return head + rans.encode(sym, lo, width, counts)


def _pack_zstd(zstd: zstandard.ZstdCompressor, tables: bytes) -> bytes:
    packed = zstd.compress(tables)
    return _U32.pack(len(packed)) + packed


def pack_nibbles(codes: np.ndarray) -> bytes:
    """4-bit ``codes`` two to a byte, the first in the low half (an odd count's last high
    half 0)."""
    c = np.zeros(len(codes) + len(codes) % 2, np.uint8)
    c[: len(codes)] = codes
    return (c[0::2] | (c[1::2] << 4)).tobytes()  # type: ignore[no-any-return]


def unpack_nibbles(packed: bytes | memoryview, bins: int) -> np.ndarray:
    """The ``bins`` codes of ``pack_nibbles``' bytes; Corrupt unless they are exactly that
    many (the spare half of the last byte 0)."""
    b = np.frombuffer(packed, np.uint8)
    if len(b) != (bins + 1) // 2 or bins % 2 and b[-1] >> 4:
        raise Corrupt(f"entropy table codes are {len(b)} bytes, not those of {bins} bins")
    out = np.empty(2 * len(b), np.uint8)
    out[0::2] = b & 15
    out[1::2] = b >> 4
    return out[:bins]


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
        # read-only views of one value: a header's 65535 heads x 131070 channels of 0 tokens
        # are 8.6e9 streams, whose tables as arrays would be 100 GB for no symbol
        return (np.broadcast_to(np.int32(0), (streams,)),
                np.broadcast_to(np.int64(1), (streams,)), np.zeros(0, np.uint8), None)
    # a decoder holds ~TABLE_BYTES_PER_STREAM of tables and models a stream (row), whatever
    # its tokens: 2e9 rows of one token declare 4 GiB decoded but need ~130 GB of them
    check_room(streams * TABLE_BYTES_PER_STREAM, n, "needs entropy tables of")
    fmt = FORMAT_OF_MARK.get(tlen, 1)
    at = {1: 4, 2: 8, 3: 8, 4: 12}[fmt]  # where the zstd-packed tables start
    if len(mv) < at:
        raise Corrupt("entropy blob truncated")
    (tlen,) = _U32.unpack_from(mv, 0 if fmt == 1 else 4)
    clen = _U32.unpack_from(mv, 8)[0] if fmt == 4 else 0
    if at + tlen + clen > len(mv) or fmt == 1 and (len(mv) - at - tlen) % 4:
        raise Corrupt("entropy blob sections do not add up")
    bound = 4 * streams if fmt == 4 else streams * (4 + MAX_WIDTH)
    tables = decompress(mv[at : at + tlen], bound, "entropy tables")
    if len(tables) < 4 * streams:
        raise Corrupt("entropy tables truncated")
    lo = np.frombuffer(tables, dtype="<i2", count=streams).astype(np.int32)
    width = np.frombuffer(tables, dtype="<u2", count=streams, offset=2 * streams).astype(np.int64)
    if fmt == 4:
        counts = LOG_LEVELS[unpack_nibbles(mv[at + tlen : at + tlen + clen], int(width.sum()))]
    else:
        counts = np.frombuffer(tables, dtype=np.uint8, offset=4 * streams)
    if (width == 0).any() or int(width.sum()) != len(counts):
        raise Corrupt("entropy tables are inconsistent")
    if fmt == 3:
        if len(counts) and int(counts.max()) >= len(LOG_LEVELS):
            raise Corrupt("entropy table code out of range")
        counts = COUNT_OF_CODE[counts]
    _check_payload(width, counts, n, len(mv) - at - tlen - clen)
    return lo, width, counts, mv[at + tlen + clen :] if fmt > 1 else None


def _check_payload(width: np.ndarray, counts: np.ndarray, n: int, payload: int) -> None:
    """Corrupt for tables no encoder wrote, or a payload too short for ``n`` symbols of them,
    before a decoder spends time or memory on them.

    A row wider than one spans its smallest to its largest symbol, both occurring: both end
    bins count >= 1. With counts <= 255 its likeliest bin then has a share of at most 255/256,
    so each of its symbols costs at least log2(256/255) bits (0.0056): one payload byte holds
    at most ~1,400 of a row's symbols. A header may declare a layer of millions of tokens over
    a few hundred bytes; range or rANS decoding it would take seconds and gigabytes to end in
    an error. Half the information bound, less 64 bits a row, is asked: coders' rounding and
    final states never fall that far short (``test_hostile``)."""
    starts = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    coded = width > 1
    if not coded.any():
        return
    c = counts.astype(np.int64)
    if (c[starts[coded]] == 0).any() or (c[(starts + width - 1)[coded]] == 0).any():
        raise Corrupt("entropy table row does not count its own end symbols")
    share = np.maximum.reduceat(c, starts)[coded] / np.add.reduceat(c, starts)[coded]
    bits = 0.5 * n * float(-np.log2(share).sum()) - 64 * int(coded.sum())
    if 8 * payload < bits:
        raise Corrupt(f"entropy payload of {payload} bytes is too short for {n} symbols a "
                      f"row under its tables (at least {bits / 8:.0f} bytes)")


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
