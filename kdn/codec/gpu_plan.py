"""The host's share of the whole-entry GPU decode of ``kdn`` bodies, compiled (numba): walk
every layer's sections and entropy blobs in the bodies' bytes, then lay out what the kernels of
``kdn.codec.gpu_kernels`` read. Per call this is a few compiled calls (``count`` and ``fill``
on several threads, a range of layers each) and one batched zstd call (the blobs' tables,
decompressed on several threads: lo and width only for format-4 blobs, whose count codes the
device reads where the bodies landed), not Python per blob. The host's work is per blob and
per rANS group, never per table row: a blob's rows (thousands: one per head and channel) are
laid out on the device from its decompressed tables (``gpu_kernels.rows``, reading ``fill``'s
row descriptor of the blob).

    walk(payload, first, count, ...)      -> a frame's records' body spans (0: they parse)
    scan(buf, body_at, body_len, n, err)  -> sections [L, 4, 2], blobs [L, 2, 7]
    table_sizes(buf, blobs, streams, err) -> declared size of each packed table (bounded)
    inflate(first, last, ...)             -> a range of layers' tables decompressed (libzstd)
    count(first, last, out, ...)          -> what a range of layers lays out, checked
    fill(first, last, ...)                -> a range of layers into ``allocate``'s arrays
                                             (blob tables, groups, sink spans, row descriptors)

Checks are those of the CPU decoder (``entropy.parse_tables``, ``rans.decode``,
``modes.unpack_sections``): a failed one leaves ``err = [code, layer]`` (``WHY``), and the
caller raises Corrupt. ``FORMAT_1`` is no damage: a range-coded (format-1) blob, which only the
CPU decodes.
"""

from __future__ import annotations

import ctypes.util
from typing import Any

import numba
import numpy as np

from kdn.codec.compiled import kernel
from kdn.codec.entropy import (
    COUNT_OF_CODE,
    LOG_LEVELS,
    MAX_WIDTH,
    RANS_LOG_MARK,
    RANS_MARK,
    RANS_NIBBLE_MARK,
)
from kdn.codec.rans import GROUP, MAX_BLOCK
from kdn.codec.zstd import capacity, frame_end

_capacity = kernel(capacity)
_frame_end = kernel(frame_end)

FORMAT_1 = 4
WHY = {1: "sections do not add up to the body", 2: "empty stream set is not empty",
       3: "entropy blob truncated", FORMAT_1: "range-coded (format 1) blob",
       5: "entropy blob sections do not add up", 6: "zstd frame declares no or too large a size",
       7: "entropy tables are inconsistent", 8: "rANS section does not add up",
       9: "sink tokens have the wrong size", 10: "entropy table code out of range",
       11: "entropy table codes do not fit the tables", 12: "entropy tables do not decode",
       15: "entropy tables have bytes after their zstd frame"}
NF = 15
"""Per-blob fields (columns of ``fill``'s blob tables; column NF: the blob's layer)."""
CROW, ROWBASE, BLOCKS, BLOCK, N, STREAMS, STATES, HEADS, KC, VC, TOKENS, SINK, KBASE, VBASE, \
    QBASE = range(NF)


@kernel
def _u32(buf: np.ndarray, at: int) -> int:
    return int(np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8) | (np.int64(buf[at + 2]) << 16)
            | (np.int64(buf[at + 3]) << 24))


@kernel
def _u16(buf: np.ndarray, at: int) -> int:
    return int(np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8))


@kernel
def scan(buf: np.ndarray, body_at: np.ndarray, body_len: np.ndarray, n: np.ndarray,
         err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's four sections (offset, length) and each of its two entropy blobs'
    (zstd tables offset, their length, rANS section offset, section length, blob format
    (2, 3 or 4: ``kdn.codec.entropy``), count codes offset and length (format 4: they lie
    outside zstd)); -1 where n == 0."""
    layers = body_at.shape[0]
    sect = np.zeros((layers, 4, 2), np.int64)
    blobs = np.full((layers, 2, 7), -1, np.int64)
    for lay in range(layers):
        o, ln = body_at[lay], body_len[lay]
        if ln < 16:
            err[0], err[1] = 1, lay
            return sect, blobs
        total = 16
        for i in range(4):
            sect[lay, i, 1] = _u32(buf, o + 4 * i)
            total += sect[lay, i, 1]
        if total != ln:
            err[0], err[1] = 1, lay
            return sect, blobs
        at = o + 16
        for i in range(4):
            sect[lay, i, 0] = at
            at += sect[lay, i, 1]
        for b in range(2):
            so, sl = sect[lay, 2 + b, 0], sect[lay, 2 + b, 1]
            if n[lay] == 0:
                if sl != 4 or _u32(buf, so) != 0:
                    err[0], err[1] = 2, lay
                    return sect, blobs
                continue
            if sl < 8:
                err[0], err[1] = 3, lay
                return sect, blobs
            mark = _u32(buf, so)
            fmt = 2 if mark == RANS_MARK else 3 if mark == RANS_LOG_MARK else (
                4 if mark == RANS_NIBBLE_MARK else 1)
            if fmt == 1:
                err[0], err[1] = FORMAT_1, lay
                return sect, blobs
            head = 12 if fmt == 4 else 8
            if sl < head:
                err[0], err[1] = 3, lay
                return sect, blobs
            tlen = _u32(buf, so + 4)
            clen = _u32(buf, so + 8) if fmt == 4 else 0
            if head + tlen + clen > sl:
                err[0], err[1] = 5, lay
                return sect, blobs
            blobs[lay, b, 0] = so + head
            blobs[lay, b, 1] = tlen
            blobs[lay, b, 2] = so + head + tlen + clen
            blobs[lay, b, 3] = sl - head - tlen - clen
            blobs[lay, b, 4] = fmt
            blobs[lay, b, 5] = so + head + tlen
            blobs[lay, b, 6] = clen
    return sect, blobs


@kernel
def table_sizes(buf: np.ndarray, blobs: np.ndarray, streams: np.ndarray, err: np.ndarray
                ) -> np.ndarray:
    """The content size each blob's zstd frame declares ([L, 2], 0 where no blob), read from
    its frame header and bounded like ``kdn.codec.zstd.decompress`` before anything is
    allocated for it: by what the blob's streams can need (streams x (4 + MAX_WIDTH); 4 x
    streams where the codes lie outside: format 4) and by what its frame's blocks can
    regenerate (``zstd.capacity``). The caller stages every blob's tables at once: without the
    second bound, small frames that lie about their size made it reserve each blob's most
    (2 GiB for a 32-layer entry of 440 KB) before decompressing any. Bytes after the frame
    (inside the blob's table length) are refused, as the CPU decoder refuses them: libzstd
    and ``zstandard``'s batch call would each take them their own way."""
    layers = blobs.shape[0]
    out = np.zeros((layers, 2), np.int64)
    for lay in range(layers):
        for b in range(2):
            at, ln = blobs[lay, b, 0], blobs[lay, b, 1]
            if at < 0:
                continue
            if ln < 6 or _u32(buf, at) != 0xFD2FB528:
                err[0], err[1] = 6, lay
                return out
            fhd = np.int64(buf[at + 4])
            single = (fhd >> 5) & 1
            fcs = (fhd >> 6) & 3
            did = (0, 1, 2, 4)[fhd & 3]
            size = (single if fcs == 0 else (2, 4, 8)[fcs - 1] if fcs > 0 else 0)
            p = at + 5 + (0 if single else 1) + did
            if size == 0 or p + size > at + ln:
                err[0], err[1] = 6, lay
                return out
            v = np.int64(0)
            for i in range(min(size, 8)):
                v |= np.int64(buf[p + i]) << (8 * i)
            if size == 2:
                v += 256
            bound = 4 if blobs[lay, b, 4] == 4 else 4 + MAX_WIDTH
            if v < 0 or v > min(streams[lay, b] * bound, _capacity(buf, p + size, at + ln)):
                err[0], err[1] = 6, lay
                return out
            stop = _frame_end(buf, p + size, at + ln)
            if stop >= 0 and stop + 4 * ((fhd >> 2) & 1) < at + ln:  # one frame, as the CPU
                err[0], err[1] = 15, lay
                return out
            out[lay, b] = v
    return out


@kernel
def walk(payload: np.ndarray, first: int, count: int, shapes: np.ndarray, lo: np.ndarray,
         hi: np.ndarray, at: int) -> int:
    """A frame's records as ``format.check_frame`` walks them (a u16 heads, u32 tokens, u16 K
    and V channels, u32 body length prefix each, its shape ``shapes[layer]``, the bodies
    filling the payload exactly): body ``j``'s span in ``payload`` into ``lo[at + j]``,
    ``hi[at + j]``. 0, or 1 where the walk fails (the caller then has ``check_frame`` say
    why)."""
    end = payload.shape[0]
    off = 0
    if at + count > lo.shape[0] or first + count > shapes.shape[0]:
        return 1
    for j in range(count):
        layer = first + j
        if end - off < 14:
            return 1
        if (_u16(payload, off) != shapes[layer, 0] or _u32(payload, off + 2) != shapes[layer, 1]
                or _u16(payload, off + 6) != shapes[layer, 2]
                or _u16(payload, off + 8) != shapes[layer, 3]):
            return 1
        blen = _u32(payload, off + 10)
        off += 14
        if end - off < blen:
            return 1
        lo[at + j] = off
        hi[at + j] = off + blen
        off += blen
    return 0 if off == end else 1


@kernel
def count(first: int, last: int, out: np.ndarray, buf: np.ndarray, sect: np.ndarray,
          blobs: np.ndarray, tables: np.ndarray, tab: np.ndarray, streams: np.ndarray,
          heads: np.ndarray, kc: np.ndarray, vc: np.ndarray, tokens: np.ndarray,
          sink: np.ndarray, itemsize: int, err: np.ndarray) -> None:
    """Check the blobs' tables and rANS headers of layers [first, last) and count, per layer,
    what ``fill`` lays out (rows of ``out``, [L, 13], zeros): blobs, groups, coded rows,
    constant rows of set 0 then set 1, then rows, bins, sink spans, log-scale symbols, and
    the bins of set 0's blob
    (disjoint layer ranges count on threads side by side: nogil).
    ``tables``: every blob's decompressed tables one after another, blob (l, b) at
    ``tab[l, b, 0]`` (``tab[l, b, 1]`` bytes)."""
    for lay in range(first, last):
        s, h = sink[lay], heads[lay]
        for b in range(2):
            ch = kc[lay] if b == 0 else vc[lay]
            if sect[lay, b, 1] != h * s * ch * itemsize:
                err[0], err[1] = 9, lay
                return
            if s * ch:
                out[lay, 10] += h
        n = tokens[lay] - s
        if n == 0:
            continue
        out[lay, 11] = 2 * n
        for b in range(2):
            st = streams[lay, b]
            t0, tlen = tab[lay, b, 0], tab[lay, b, 1]
            if tlen < 4 * st:
                err[0], err[1] = 7, lay
                return
            wsum = 0
            coded = 0
            for i in range(st):
                w = _u16(tables, t0 + 2 * st + 2 * i)
                if w == 0:
                    err[0], err[1] = 7, lay
                    return
                wsum += w
                coded += w > 1
            if blobs[lay, b, 4] == 4:  # the codes outside zstd, two to a byte
                if tlen != 4 * st:
                    err[0], err[1] = 7, lay
                    return
                cl = blobs[lay, b, 6]
                if cl != (wsum + 1) // 2 or wsum % 2 and buf[blobs[lay, b, 5] + cl - 1] >> 4:
                    err[0], err[1] = 11, lay
                    return
            elif wsum != tlen - 4 * st:
                err[0], err[1] = 7, lay
                return
            so, sl = blobs[lay, b, 2], blobs[lay, b, 3]
            if sl < 8:
                err[0], err[1] = 8, lay
                return
            block, groups = _u32(buf, so), _u32(buf, so + 4)
            if block == 0 or block > MAX_BLOCK:
                err[0], err[1] = 8, lay
                return
            nstreams = coded * ((n + block - 1) // block)
            need = 8 + 4 * nstreams + 4 * groups
            if groups != (nstreams + GROUP - 1) // GROUP or sl < need or (sl - need) % 2:
                err[0], err[1] = 8, lay
                return
            words = 0
            for g in range(groups):
                words += _u32(buf, so + 8 + 4 * nstreams + 4 * g)
            if 2 * words != sl - need:
                err[0], err[1] = 8, lay
                return
            out[lay, b] += 1
            out[lay, 2 + b] += groups
            out[lay, 4 + b] += coded
            out[lay, 6 + b] += st - coded
            out[lay, 8] += st
            out[lay, 9] += wsum
            if b == 0:
                out[lay, 12] = wsum


def allocate(sizes: np.ndarray) -> tuple:  # type: ignore[type-arg]
    """The arrays ``fill`` writes, for totals ``sizes`` (``count``'s columns summed): per set
    (0: log scales, 1: symbols) a blob table [blobs, NF + 1] (column NF: the blob's layer) and
    groups [g, 4] (blob, first stream, word offset, words); sink spans [s, 3] (from, to,
    bytes); and every blob's row descriptor [blobs of both sets, RD] (``RD_*``) in row order,
    from which the ``rows`` kernel lays out every table row on the device."""
    return ((np.zeros((max(sizes[0], 1), NF + 1), np.int64),
             np.zeros((max(sizes[1], 1), NF + 1), np.int64)),
            (np.zeros((max(sizes[2], 1), 4), np.int64), np.zeros((max(sizes[3], 1), 4), np.int64)),
            np.zeros((max(sizes[10], 1), 3), np.int64),
            np.zeros((max(sizes[0] + sizes[1], 1), RD), np.int64))


RD = 11
"""Columns of a blob's row descriptor (``fill``): its first row, rows, where its tables lie
in the decompressed tables (lo then width, u16 each), its first bin, where its first row's
counts lie (bytes of the tables; format 4: a nibble of the bodies' bytes), whether they are
nibbles, its first coded row's and first constant row's index in its set's lists, the blob's
index in its set, the set, its layer."""
RD_ROW, RD_ROWS, RD_T0, RD_BIN, RD_SRC, RD_PACKED, RD_CODED, RD_CONST, RD_BLOB, RD_SET, \
    RD_LAYER = range(RD)


@kernel
def fill(first: int, last: int, starts: np.ndarray, per_layer: np.ndarray, buf: np.ndarray,
         sect: np.ndarray, blobs: np.ndarray, tables: np.ndarray, tab: np.ndarray,
         streams: np.ndarray, heads: np.ndarray, kc: np.ndarray, vc: np.ndarray,
         tokens: np.ndarray, sink: np.ndarray, kbase: np.ndarray, vbase: np.ndarray,
         itemsize: int, bt0: np.ndarray, bt1: np.ndarray, gr0: np.ndarray, gr1: np.ndarray,
         sp: np.ndarray, rd: np.ndarray, err: np.ndarray) -> None:
    """Layers [first, last) into ``allocate``'s arrays, each at the place ``starts`` (the
    exclusive running sums of ``count``'s rows ``per_layer``) gives it: disjoint layer ranges
    fill on threads side by side (nogil). Work per blob and per group, none per table row
    (the device lays those out: ``rd``). A format-3 blob's count codes are replaced in
    ``tables`` by the counts they stand for (``entropy.LOG_LEVELS``); a code out of range sets
    ``err``. A format-4 blob's codes are left where they lie."""
    bts, grs = (bt0, bt1), (gr0, gr1)
    ib = np.zeros(2, np.int64)
    ig = np.zeros(2, np.int64)
    ic = np.zeros(2, np.int64)
    ik = np.zeros(2, np.int64)
    for b in range(2):
        ib[b] = starts[first, b]
        ig[b] = starts[first, 2 + b]
        ic[b] = starts[first, 4 + b]
        ik[b] = starts[first, 6 + b]
    row = starts[first, 8]
    place = starts[first, 9]
    isp = starts[first, 10]
    qat = starts[first, 11]
    for lay in range(first, last):
        s, h, tk = sink[lay], heads[lay], tokens[lay]
        for b in range(2):
            ch = kc[lay] if b == 0 else vc[lay]
            base = kbase[lay] if b == 0 else vbase[lay]
            if s * ch:
                for hh in range(h):
                    sp[isp, 0] = sect[lay, b, 0] + hh * s * ch * itemsize
                    sp[isp, 1] = (base + hh * tk * ch) * itemsize
                    sp[isp, 2] = s * ch * itemsize
                    isp += 1
        n = tk - s
        if n == 0:
            continue
        for b in range(2):
            st = streams[lay, b]
            t0 = tab[lay, b, 0]
            so = blobs[lay, b, 2]
            block, groups = _u32(buf, so), _u32(buf, so + 4)
            bt, gr = bts[b], grs[b]
            k = ib[b]
            coded = per_layer[lay, 4 + b]
            wsum = per_layer[lay, 12] if b == 0 else per_layer[lay, 9] - per_layer[lay, 12]
            packed = blobs[lay, b, 4] == 4
            if blobs[lay, b, 4] == 3:
                for j in range(t0 + 4 * st, t0 + tab[lay, b, 1]):
                    c = tables[j]
                    if c >= len(LOG_LEVELS):
                        err[0], err[1] = 10, lay
                    tables[j] = COUNT_OF_CODE[c]
            d = rd[ib[0] + ib[1]]
            d[RD_ROW] = row
            d[RD_ROWS] = st
            d[RD_T0] = t0
            d[RD_BIN] = place
            d[RD_SRC] = 2 * blobs[lay, b, 5] if packed else t0 + 4 * st
            d[RD_PACKED] = packed
            d[RD_CODED] = ic[b]
            d[RD_CONST] = ik[b]
            d[RD_BLOB] = k
            d[RD_SET] = b
            d[RD_LAYER] = lay
            blocks = (n + block - 1) // block
            bt[k, CROW] = ic[b]
            bt[k, ROWBASE] = row
            bt[k, BLOCKS] = blocks
            bt[k, BLOCK] = block
            bt[k, N] = n
            bt[k, STREAMS] = coded * blocks
            bt[k, STATES] = so + 8
            bt[k, HEADS] = h
            bt[k, KC] = kc[lay]
            bt[k, VC] = vc[lay]
            bt[k, TOKENS] = tk
            bt[k, SINK] = s
            bt[k, KBASE] = kbase[lay]
            bt[k, VBASE] = vbase[lay]
            bt[k, QBASE] = qat
            bt[k, NF] = lay
            gw = so + 8 + 4 * coded * blocks
            wat = gw + 4 * groups
            for g in range(groups):
                c = _u32(buf, gw + 4 * g)
                gr[ig[b], 0] = k
                gr[ig[b], 1] = g * GROUP
                gr[ig[b], 2] = wat
                gr[ig[b], 3] = c
                wat += 2 * c
                ig[b] += 1
            ic[b] += coded
            ik[b] += st - coded
            ib[b] += 1
            place += wsum
            row += st
        qat += 2 * n


def _load_zstd() -> bool:
    """The system's libzstd, loaded for compiled code (``inflate``); False where there is none
    (the caller then decompresses the tables through ``zstandard``, Python per blob)."""
    import llvmlite.binding as llvm

    for name in ("libzstd.so.1", "libzstd.1.dylib", None):  # None: ask ldconfig (slower)
        name = name or ctypes.util.find_library("zstd")
        if not name:
            continue
        try:
            llvm.load_library_permanently(name)
        except RuntimeError:
            continue
        return True
    return False


HAVE_ZSTD = _load_zstd()
"""Whether ``inflate`` can run (libzstd found)."""

if HAVE_ZSTD:  # pointers as integers (uintp): the planner checks every range first
    _P: Any = numba.types.uintp
    _NEW_DCTX: Any = numba.types.ExternalFunction("ZSTD_createDCtx", _P())
    _FREE_DCTX: Any = numba.types.ExternalFunction("ZSTD_freeDCtx", _P(_P))
    _DECOMPRESS: Any = numba.types.ExternalFunction("ZSTD_decompressDCtx", _P(_P, _P, _P, _P, _P))

    @kernel
    def _inflate_with(ctx: int, first: int, last: int, buf: np.ndarray, blobs: np.ndarray,
                      sizes: np.ndarray, tab: np.ndarray, into: np.ndarray) -> int:
        """``inflate`` with a decompression context: the first layer that fails, else -1."""
        for lay in range(first, last):
            for b in range(2):
                at, ln = blobs[lay, b, 0], blobs[lay, b, 1]
                if at < 0:
                    continue
                off, n = tab[lay, b, 0], sizes[lay, b]
                if (ln <= 0 or at + ln > len(buf) or off < 0 or n < 0
                        or off + n > len(into)):
                    return lay
                got = _DECOMPRESS(ctx, into.ctypes.data + off, n, buf.ctypes.data + at, ln)
                if got != n:  # a zstd error code (near 2**64) or another size
                    return lay
        return -1

    @kernel
    def inflate(first: int, last: int, buf: np.ndarray, blobs: np.ndarray, sizes: np.ndarray,
                tab: np.ndarray, into: np.ndarray, err: np.ndarray) -> None:
        """The zstd-packed tables of layers [first, last) decompressed, blob (l, b) into
        ``into`` at ``tab[l, b, 0]``: exactly ``sizes[l, b]`` bytes (what its frame declares,
        ``table_sizes``), else err 12. Disjoint layer ranges run on threads side by side
        (nogil; a decompression context each): no Python per blob."""
        ctx = _NEW_DCTX()
        bad = first if ctx == 0 else _inflate_with(ctx, first, last, buf, blobs, sizes, tab,
                                                   into)
        if ctx != 0:
            _FREE_DCTX(ctx)
        if bad >= 0:
            err[0], err[1] = 12, bad
