"""Parallel-decodable entropy coding: static-model rANS in thousands of independent streams.

The symbols of one ``encode_streams`` call are a matrix ``[rows, n]`` (for the KV modes: one
row per (head, channel), running over tokens). Each row keeps one static model (the tables of
``kdn.codec.entropy``); its tokens are cut into blocks of ``block`` symbols, and every
(row, block) with more than one symbol value is one rANS *stream*. Streams are numbered row
by row, block by block, and dealt into *groups* of ``GROUP`` consecutive streams. A group is
what one GPU program (or one CPU task) decodes: its streams step through their symbols in
lockstep, and the 16-bit words they read on each step are stored interleaved, in exactly the
order the lockstep decoder asks for them (step by step, stream by stream), so the group reads
its words from one sequential pointer. Groups need nothing from each other: a CPU decoder runs
them without the GIL (compiled with numba; the codec's thread pool decodes layers side by
side, so every core works), a GPU decoder runs them as programs.

Coder: 32-bit state, 16-bit renormalisation, models of precision ``PREC`` (frequencies sum to
2**PREC per row, every occurring symbol at least 1). Decoding a symbol:

    slot = x & (M - 1);  s = the symbol whose [cum, cum + freq) holds slot
    x = freq[s] * (x >> PREC) + slot - cum[s];  if x < 2**16: x = (x << 16) | next word

A stream starts from its stored final encoder state and must end at exactly 2**16, with every
word of its group read: anything else is corruption.

Blob layout (after ``entropy``'s tables):

    u32 block | u32 n_groups | u32 states[coded streams] | u32 words_per_group[n_groups]
    | u16 words[...]
"""

from __future__ import annotations

import struct

import numpy as np

from kdn.codec.compiled import kernel
from kdn.errors import Corrupt

PREC = 16
M = 1 << PREC
L = 1 << 16
GROUP = 32
"""Streams per group (lanes of one GPU program)."""
BLOCK = 1024
"""Symbols per stream (tokens of one row): 4 state bytes per 1024 symbols keep the overhead
near 1% at 2-3 bits per symbol, and an 8k-token layer still has thousands of streams."""
_U32 = struct.Struct("<II")


@kernel
def _normalize(width: np.ndarray, counts: np.ndarray, freq: np.ndarray, cum: np.ndarray
               ) -> int:
    """Fill ``freq``/``cum`` (see ``normalize``); returns the first row with no mass, or -1."""
    b = 0
    for r in range(width.shape[0]):
        w = width[r]
        total = 0
        nnz = 0
        top = b
        for i in range(b, b + w):
            c = counts[i]
            total += c
            if c > 0:
                nnz += 1
            if c > counts[top]:
                top = i
        if total == 0:
            if w > 1:
                return r
            total = 1
        spare = M - nnz
        used = 0
        for i in range(b, b + w):
            c = counts[i]
            f = 1 + c * spare // total if c > 0 else 0
            freq[i] = f
            used += f
        freq[top] += M - used
        run = 0
        for i in range(b, b + w):
            cum[i] = run
            run += freq[i]
        b += w
    return -1


def normalize(width: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(freq, cum) per table bin (flattened like ``counts``): each row's nonzero counts scaled
    to sum exactly ``M``, each at least 1 (the row's first largest bin takes the rounding)."""
    freq = np.empty(len(counts), dtype=np.int64)
    cum = np.empty(len(counts), dtype=np.int64)
    if _normalize(width.astype(np.int64), counts.astype(np.int64), freq, cum) >= 0:
        raise Corrupt("entropy table row has no mass")
    return freq, cum


LUT_BITS = 8
"""Slots per lookup bucket = 2**(PREC - LUT_BITS): a symbol is found from its bucket's first
bin with a short forward scan (most buckets hold one bin)."""


@kernel
def _lookup(coded: np.ndarray, starts: np.ndarray, width: np.ndarray, cum: np.ndarray,
            freq: np.ndarray, lut: np.ndarray) -> None:
    buckets = 1 << LUT_BITS
    for i in range(coded.shape[0]):
        r = coded[i]
        a = starts[r]
        end = starts[r] + width[r] - 1
        for k in range(buckets):
            slot = k << (PREC - LUT_BITS)
            while a < end and cum[a] + freq[a] <= slot:
                a += 1
            lut[i * buckets + k] = a


def lookup(width: np.ndarray, cum: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """[coded rows * 2**LUT_BITS] int64: for each row wider than one (the rows that have
    streams, in order: ``lut_bases``) and bucket, the bin holding the bucket's first slot
    (absolute bin index into the flattened tables). Constant rows get none: they decode
    nothing, and may be millions of rows whose tables zstd stores in a few bytes."""
    width = width.astype(np.int64)
    coded = np.flatnonzero(width > 1)
    starts = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    lut = np.empty(len(coded) << LUT_BITS, dtype=np.int64)
    _lookup(coded, starts, width, cum, freq, lut)
    return lut


def lut_bases(width: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where the ``lookup`` buckets of each stream's row (``plan``'s ``rows``) start."""
    return np.searchsorted(np.flatnonzero(width > 1), rows).astype(np.int64) << LUT_BITS


def plan(width: np.ndarray, n: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(row of each coded stream, block index of each) for rows of ``width`` over ``n``."""
    coded = np.flatnonzero(width > 1)
    blocks = -(-n // block) if n else 0
    return np.repeat(coded, blocks).astype(np.int64), np.tile(np.arange(blocks), len(coded))


@kernel
def _encode_group(sym: np.ndarray, rows: np.ndarray, blks: np.ndarray, first: int, last: int,
                  block: int, starts: np.ndarray, freq: np.ndarray, cum: np.ndarray,
                  lo: np.ndarray, states: np.ndarray, out: np.ndarray) -> int:
    """Encode streams [first, last) into ``out`` (words in decode order); returns the count."""
    n = sym.shape[1]
    lanes = last - first
    x = np.full(lanes, L, dtype=np.uint64)
    steps = 0
    for j in range(lanes):
        ln = min(block, n - blks[first + j] * block)
        steps = max(steps, ln)
    k = 0
    for t in range(steps - 1, -1, -1):
        for j in range(lanes - 1, -1, -1):  # reversed again at the end: decode order
            s = first + j
            begin = blks[s] * block
            if t >= min(block, n - begin):
                continue
            r = rows[s]
            b = starts[r] + (sym[r, begin + t] - lo[r])
            f = freq[b]
            if x[j] >= (np.uint64(f) << np.uint64(32 - PREC)) * np.uint64(L >> 16):
                out[k] = x[j] & np.uint64(0xFFFF)
                k += 1
                x[j] >>= np.uint64(16)
            x[j] = ((x[j] // np.uint64(f)) << np.uint64(PREC)) + (x[j] % np.uint64(f)) \
                + np.uint64(cum[b])
    for j in range(lanes):
        states[first + j] = x[j]
    out[:k] = out[:k][::-1].copy()
    return k


@kernel
def _decode_groups(states: np.ndarray, gwords: np.ndarray, goff: np.ndarray, words: np.ndarray,
                   rows: np.ndarray, blks: np.ndarray, n: int, block: int, group: int,
                   starts: np.ndarray, lut: np.ndarray, bases: np.ndarray, freq: np.ndarray,
                   cum: np.ndarray, lo: np.ndarray, out: np.ndarray, bad: np.ndarray) -> None:
    """Decode every group into ``out`` [rows, n]; ``bad[g]`` != 0 marks a group
    whose bytes are inconsistent (read past its words, left words, or a final state != L)."""
    streams = rows.shape[0]
    groups = gwords.shape[0]
    for g in range(groups):
        first = g * group
        last = min(first + group, streams)
        lanes = last - first
        x = np.empty(lanes, dtype=np.int64)
        steps = 0
        for j in range(lanes):
            x[j] = states[first + j]
            steps = max(steps, min(block, n - blks[first + j] * block))
        ptr = goff[g]
        end = goff[g] + gwords[g]
        length = np.empty(lanes, dtype=np.int64)
        base = np.empty(lanes, dtype=np.int64)  # where lane j writes in the flat output
        first_bin = np.empty(lanes, dtype=np.int64)
        row_lut = np.empty(lanes, dtype=np.int64)
        low = np.empty(lanes, dtype=np.int64)
        for j in range(lanes):
            s = first + j
            r = rows[s]
            begin = blks[s] * block
            length[j] = min(block, n - begin)
            base[j] = r * n + begin
            first_bin[j] = starts[r]
            row_lut[j] = bases[s]
            low[j] = lo[r]
        for t in range(steps):
            for j in range(lanes):
                if t >= length[j]:
                    continue
                xj = x[j]
                slot = xj & (M - 1)
                a = lut[row_lut[j] + (slot >> (PREC - LUT_BITS))]
                while cum[a] + freq[a] <= slot:  # the bin holding slot
                    a += 1
                out[base[j] + t] = low[j] + (a - first_bin[j])
                xj = freq[a] * (xj >> PREC) + slot - cum[a]
                if xj < L:
                    if ptr >= end:
                        bad[g] = 1
                        xj = L
                    else:
                        xj = (xj << 16) | np.int64(words[ptr])
                        ptr += 1
                x[j] = xj
        if ptr != end:
            bad[g] = 2
        for j in range(lanes):
            if x[j] != L:
                bad[g] = 3


def encode(sym: np.ndarray, lo: np.ndarray, width: np.ndarray, counts: np.ndarray,
           block: int = BLOCK) -> bytes:
    """The rANS section of a blob for ``sym`` [rows, n] and its tables (see module doc)."""
    rows_n, n = sym.shape
    freq, cum = normalize(width, counts)
    starts = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    rows, blks = plan(width, n, block)
    streams = len(rows)
    groups = -(-streams // GROUP)
    states = np.zeros(streams, dtype=np.uint32)
    gwords = np.zeros(groups, dtype=np.uint32)
    chunks = []
    buf = np.empty(GROUP * block + 1, dtype=np.uint16)
    sym32 = np.ascontiguousarray(sym, dtype=np.int32)
    lo64 = lo.astype(np.int64)
    for g in range(groups):
        first, last = g * GROUP, min((g + 1) * GROUP, streams)
        k = _encode_group(sym32, rows, blks, first, last, block, starts, freq, cum, lo64,
                          states, buf)
        gwords[g] = k
        chunks.append(buf[:k].copy())
    words = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    return b"".join([_U32.pack(block, groups), states.astype("<u4").tobytes(),
                     gwords.astype("<u4").tobytes(), words.astype("<u2").tobytes()])


MAX_BLOCK = 1 << 20
"""The most symbols a stored block may declare."""


def check_section(mv: memoryview, width: np.ndarray, n: int) -> tuple[int, int, int]:
    """(block, groups, streams) of a rANS section for rows of ``width`` over ``n`` symbols,
    Corrupt unless its block, group count and sizes agree. Counted, not planned: a block of
    1 over a header's millions of tokens declares a stream per symbol, whose plan (16 bytes a
    stream) would be sized before the section's 4 state bytes a stream are found missing."""
    if len(mv) < _U32.size:
        raise Corrupt("rANS section truncated")
    block, groups = _U32.unpack_from(mv, 0)
    if block == 0 or block > MAX_BLOCK:
        raise Corrupt(f"rANS block of {block} symbols")
    streams = int(np.count_nonzero(width > 1)) * (-(-n // block))
    if groups != -(-streams // GROUP):
        raise Corrupt(f"rANS section declares {groups} groups for {streams} streams")
    need = _U32.size + 4 * streams + 4 * groups
    if len(mv) < need or (len(mv) - need) % 2:
        raise Corrupt("rANS section sizes do not add up")
    return block, groups, streams


def decode(mv: memoryview, lo: np.ndarray, width: np.ndarray, counts: np.ndarray,
           rows_n: int, n: int) -> np.ndarray:
    """Inverse of ``encode``: the [rows, n] int32 matrix (raises Corrupt on bad bytes)."""
    block, groups, streams = check_section(mv, width, n)
    rows, blks = plan(width, n, block)
    off = _U32.size
    need = off + 4 * streams + 4 * groups
    states = np.frombuffer(mv, dtype="<u4", count=streams, offset=off).astype(np.int64)
    gwords = np.frombuffer(mv, dtype="<u4", count=groups, offset=off + 4 * streams
                           ).astype(np.int64)
    words = np.frombuffer(mv, dtype="<u2", offset=need)
    if int(gwords.sum()) != len(words):
        raise Corrupt("rANS word counts do not match the words stored")
    goff = np.concatenate([[0], np.cumsum(gwords)[:-1]]).astype(np.int64)
    freq, cum = normalize(width, counts)
    starts = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    out = np.repeat(lo.astype(np.int32)[:, None], n, axis=1)  # width-1 rows: constant
    bad = np.zeros(max(groups, 1), dtype=np.int8)
    _decode_groups(states, gwords, goff, words.astype(np.uint16), rows, blks, n, block, GROUP,
                   starts, lookup(width, cum, freq).astype(np.int32), lut_bases(width, rows),
                   freq.astype(np.int32), cum.astype(np.int32), lo.astype(np.int64),
                   out.reshape(-1), bad)
    if bad.any():
        raise Corrupt(f"rANS group {int(np.flatnonzero(bad)[0])} does not decode")
    return out
