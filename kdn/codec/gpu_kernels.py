"""Triton kernels of the whole-entry GPU decoder (``kdn.codec.gpu_batch`` plans and launches
them; it documents the data they read). Each kernel is one concern: table rows laid out,
table normalisation, rANS decode (log scales, or symbols with dequantisation fused), constant
rows, byte spans, int8 dequantisation. Damage found sets bits of a device flag (``BAD_*``),
never an exception.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdn.codec.quant import LOG_SCALE_MAX

BAD_GROUP, BAD_SCALE, BAD_TABLE, BAD_INT8 = 1, 2, 4, 8
_BAD_GROUP = tl.constexpr(BAD_GROUP)
_BAD_SCALE = tl.constexpr(BAD_SCALE)
_BAD_TABLE = tl.constexpr(BAD_TABLE)
_BAD_INT8 = tl.constexpr(BAD_INT8)
_QMAX = tl.constexpr(LOG_SCALE_MAX)


# ------------------------------------------------------------------------------ kernels

@triton.jit
def _counts(counts, src, levels, cs, idx, m):
    """Bins ``idx`` of a row's counts (``gpu_plan.fill``'s ``csrc`` = ``cs``): bytes of
    ``counts`` from ``cs``, or where ``cs < 0`` the 4-bit codes in the bodies' bytes ``src``
    from nibble ``-1 - cs``, each the count of its level (``levels``)."""
    packed = (cs + 0 * idx) < 0  # one flag per bin: masks must be blocks
    at = tl.where(packed, -1 - cs, cs) + idx
    whole = tl.load(counts + at, mask=m & ~packed, other=0).to(tl.int32)
    byte = tl.load(src + (at >> 1), mask=m & packed, other=0).to(tl.int32)
    code = (byte >> ((at & 1) * 4).to(tl.int32)) & 15
    return tl.where(packed, tl.load(levels + code, mask=m & packed, other=0), whole)


@triton.jit
def _u16(tables, at, m):
    """u16s (little-endian) of ``tables`` at byte offsets ``at``, as int32."""
    return (tl.load(tables + at, mask=m, other=0).to(tl.int32)
            | (tl.load(tables + at + 1, mask=m, other=0).to(tl.int32) << 8))


@triton.jit
def rows(rd, tables, lo, width, tstart, depth, csrc, coded, c_blob, c_row, set1_coded,
         set1_const, RD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per blob (``gpu_plan.fill``'s row descriptor ``rd``): each of its table
    rows' lowest symbol (signed), width, first bin, search depth (bits to search its width)
    and where its counts lie, from its decompressed tables (lo then width, u16 each); its
    coded rows (width > 1) listed in order in ``coded``, its constant rows in ``c_blob`` /
    ``c_row`` (set 1's lists after set 0's: from ``set1_coded`` / ``set1_const`` on)."""
    d = rd + tl.program_id(0) * RD
    row0 = tl.load(d + 0)
    st = tl.load(d + 1)
    t0 = tl.load(d + 2)
    bin0 = tl.load(d + 3)
    src0 = tl.load(d + 4)
    packed = tl.load(d + 5) != 0
    second = tl.load(d + 9)
    cbase = tl.load(d + 6) + second * set1_coded
    kbase = tl.load(d + 7) + second * set1_const
    blob = tl.load(d + 8).to(tl.int32)
    run = bin0 * 0  # int64 running sums
    crun = run
    for i0 in range(0, st, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < st
        low = _u16(tables, t0 + 2 * i, m)
        w = _u16(tables, t0 + 2 * st + 2 * i, m)
        before = run + tl.cumsum(w.to(tl.int64), axis=0) - w
        r = row0 + i
        tl.store(lo + r, tl.where(low >= 32768, low - 65536, low), mask=m)
        tl.store(width + r, w, mask=m)
        tl.store(tstart + r, (bin0 + before).to(tl.int32), mask=m)
        tl.store(csrc + r, tl.where(packed, -1 - (src0 + before), src0 + before), mask=m)
        # ceil(log2 w) for w > 1: the exponent of float(w - 1) (exact below 2 ** 24), plus one
        bits = (w - 1).to(tl.float32).to(tl.int32, bitcast=True)
        tl.store(depth + r, tl.where(w > 1, ((bits >> 23) & 255) - 126, 0), mask=m)
        c = (m & (w > 1)).to(tl.int64)
        cr = crun + tl.cumsum(c, axis=0) - c  # coded rows before this one in the blob
        tl.store(coded + cbase + cr, r.to(tl.int32), mask=c != 0)
        k = kbase + i - cr
        one = m & (c == 0)
        tl.store(c_blob + k, blob + 0 * i.to(tl.int32), mask=one)
        tl.store(c_row + k, r.to(tl.int32), mask=one)
        run += tl.sum(w.to(tl.int64), axis=0)
        crun += tl.sum(c, axis=0)


@triton.jit
def normalize(counts, src, levels, csrc, tstart, width, freq, cum, flag, PREC: tl.constexpr,
              BLOCK: tl.constexpr):
    """One program per table row: counts -> freq, cum exactly as ``rans.normalize``; the
    row's frequencies land from bin ``tstart`` on."""
    r = tl.program_id(0)
    b = tl.load(tstart + r)
    cs = tl.load(csrc + r)
    w = tl.load(width + r)
    total = 0
    nnz = 0
    best = -1
    top = b
    for i0 in range(0, w, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        m = idx < w
        c = _counts(counts, src, levels, cs, idx, m)
        total += tl.sum(c, axis=0)
        nnz += tl.sum((c > 0).to(tl.int32), axis=0)
        cmax = tl.max(c, axis=0)
        first = tl.min(tl.where(m & (c == cmax), idx, 1 << 30), axis=0)
        better = cmax > best
        top = tl.where(better, b + first, top)
        best = tl.where(better, cmax, best)
    empty = total == 0
    tl.atomic_or(flag, _BAD_TABLE, mask=empty & (w > 1))
    total = tl.where(empty, 1, total)
    spare = (1 << PREC) - nnz
    used = 0
    for i0 in range(0, w, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        c = _counts(counts, src, levels, cs, idx, idx < w)
        used += tl.sum(tl.where(c > 0, 1 + c * spare // total, 0), axis=0)
    run = 0
    for i0 in range(0, w, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        m = idx < w
        c = _counts(counts, src, levels, cs, idx, m)
        f = tl.where(c > 0, 1 + c * spare // total, 0)
        f = f + tl.where(b + idx == top, (1 << PREC) - used, 0)
        f = tl.where(m, f, 0)
        tl.store(freq + b + idx, f, mask=m)
        tl.store(cum + b + idx, run + tl.cumsum(f, axis=0) - f, mask=m)
        run += tl.sum(f, axis=0)


@triton.jit
def cast(val, out):
    """float32 ``val`` in ``out``'s element type, rounded to nearest even like torch (bf16 by
    its bits: the same on every backend, the interpreter included)."""
    if out.dtype.element_ty == tl.bfloat16:
        bits = val.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return val.to(out.dtype.element_ty)


@triton.jit
def scale_of(q, table):
    """float32 scale of log-scale symbols q (``quant.scale_from_symbols``), q in range."""
    e = (q >> 4) + 127
    return tl.load(table + (q & 15)) * (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def place(r, blob, n, b_heads, b_kc, b_vc, b_tokens, b_sink, b_kbase, b_vbase, b_kstep,
          b_vstep):
    """Where symbol row ``r`` of a blob dequantises to: (output index of its first coded
    token, the stride between tokens, its level step, the offset of its log-scale row). Rows
    [0, heads * kc) are K's (head, channel), the rest V's; the first ``sink`` tokens are the
    exact ones."""
    heads = tl.load(b_heads + blob)
    kc = tl.load(b_kc + blob)
    vc = tl.load(b_vc + blob)
    tokens = tl.load(b_tokens + blob).to(tl.int64)
    sink = tl.load(b_sink + blob)
    is_k = r < heads * kc
    rv = r - heads * kc
    ch = tl.where(is_k, kc, vc)
    head = tl.where(is_k, r // tl.maximum(kc, 1), rv // tl.maximum(vc, 1))
    c = tl.where(is_k, r % tl.maximum(kc, 1), rv % tl.maximum(vc, 1))
    obase = tl.where(is_k, tl.load(b_kbase + blob), tl.load(b_vbase + blob)) \
        + (head * tokens + sink) * ch + c
    step = tl.where(is_k, tl.load(b_kstep + blob), tl.load(b_vstep + blob))
    return obase, ch, step, tl.where(is_k, 0, n)


@triton.jit
def rans(buf, g_blob, g_first, g_woff, g_wcnt,
          b_crow, b_rowbase, b_blocks, b_block, b_n, b_streams, b_states,
          b_heads, b_kc, b_tokens, b_sink, b_kbase, b_vbase, b_qbase, b_vc,
          b_kstep, b_vstep,
          coded, tstart, width, depth, lo, cum, freq, table,
          out, qout, sout, flag, top,
          GROUP: tl.constexpr, PREC: tl.constexpr, DEQUANT: tl.constexpr):
    """One program per rANS group of any blob. DEQUANT False: log-scale blobs, writing int32
    symbols to ``qout`` and their scales to ``sout``; True: symbol blobs, writing
    symbol x scale x level step into ``out`` (the destination dtype) at each row's
    [heads, tokens, channels] place."""
    g = tl.program_id(0)
    lane = tl.arange(0, GROUP)
    blob = tl.load(g_blob + g)
    s = tl.load(g_first + g) + lane
    live = s < tl.load(b_streams + blob)
    blocks = tl.load(b_blocks + blob)
    block = tl.load(b_block + blob)
    n = tl.load(b_n + blob)
    crow = tl.load(b_crow + blob) + s // blocks
    blk = s % blocks
    row = tl.load(coded + crow, mask=live, other=0)
    length = tl.where(live, tl.minimum(block, n - blk * block), 0)
    ts = tl.load(tstart + row, mask=live, other=0)
    wd = tl.load(width + row, mask=live, other=1)
    low = tl.load(lo + row, mask=live, other=0)
    dep = tl.max(tl.load(depth + row, mask=live, other=0), axis=0)
    sa = tl.load(b_states + blob) + 4 * s.to(tl.int64)
    x = (tl.load(buf + sa, mask=live, other=0).to(tl.int64)
         | (tl.load(buf + sa + 1, mask=live, other=0).to(tl.int64) << 8)
         | (tl.load(buf + sa + 2, mask=live, other=0).to(tl.int64) << 16)
         | (tl.load(buf + sa + 3, mask=live, other=1).to(tl.int64) << 24))
    ptr = tl.load(g_woff + g)
    end = ptr + 2 * tl.load(g_wcnt + g).to(tl.int64)
    first_tok = blk * block
    r = row - tl.load(b_rowbase + blob)
    qbase = tl.load(b_qbase + blob)
    if DEQUANT:
        obase, ch, step, qoff = place(r, blob, n, b_heads, b_kc, b_vc, b_tokens, b_sink,
                                      b_kbase, b_vbase, b_kstep, b_vstep)
        qrow = qbase + qoff
    else:
        obase = qbase + r.to(tl.int64) * n
    err = 0
    steps = tl.max(length, axis=0)
    for t in range(steps):
        act = t < length
        slot = x & ((1 << PREC) - 1)
        a = ts
        size = wd
        for _ in range(dep):  # the last bin of the row whose cum <= slot
            half = size >> 1
            probe = a + half
            ok = act & (half > 0) & (tl.load(cum + probe, mask=act & (half > 0),
                                             other=1 << 30) <= slot)
            a = tl.where(ok, probe, a)
            size = size - half
        cu = tl.load(cum + a, mask=act, other=0)
        f = tl.load(freq + a, mask=act, other=1)
        sym = low + (a - ts)
        tok = first_tok + t
        if DEQUANT:
            sc = tl.load(sout + qrow + tok, mask=act, other=1.0)
            val = sym.to(tl.float32) * (sc * step)
            val = tl.minimum(tl.maximum(val, -top), top)
            tl.store(out + obase + tok.to(tl.int64) * ch, cast(val, out),
                     mask=act)
        else:
            bad = (sym < -_QMAX) | (sym > _QMAX)
            err = err | tl.max((act & bad).to(tl.int32), axis=0) * _BAD_SCALE
            safe = tl.where(bad, 0, sym)
            tl.store(qout + obase + tok, sym, mask=act)
            tl.store(sout + obase + tok, scale_of(safe, table), mask=act)
        nx = f.to(tl.int64) * (x >> PREC) + slot - cu
        need = act & (nx < (1 << 16))
        take = need.to(tl.int64)
        rank = tl.cumsum(take, axis=0) - take
        pos = ptr + 2 * rank
        inside = need & (pos < end)
        w = (tl.load(buf + pos, mask=inside, other=0).to(tl.int64)
             | (tl.load(buf + pos + 1, mask=inside, other=0).to(tl.int64) << 8))
        err = err | tl.max((need & (pos >= end)).to(tl.int32), axis=0) * _BAD_GROUP
        nx = tl.where(inside, (nx << 16) | w, nx)
        x = tl.where(act, nx, x)
        ptr = ptr + 2 * tl.sum(take, axis=0)
    err = err | (ptr != end).to(tl.int32) * _BAD_GROUP
    err = err | tl.max((live & (x != (1 << 16))).to(tl.int32), axis=0) * _BAD_GROUP
    tl.atomic_or(flag, err, mask=err != 0)


@triton.jit
def fill(r_blob, r_row, b_rowbase, b_n, b_heads, b_kc, b_vc, b_tokens, b_sink,
          b_kbase, b_vbase, b_qbase, b_kstep, b_vstep, lo, table, out, qout, sout, flag, top,
          BLOCK: tl.constexpr, DEQUANT: tl.constexpr):
    """Constant rows (one symbol value, no coded stream): program (row, token block)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    blob = tl.load(r_blob + i)
    row = tl.load(r_row + i)
    r = row - tl.load(b_rowbase + blob)
    n = tl.load(b_n + blob)
    tok = j * BLOCK + tl.arange(0, BLOCK)
    m = tok < n
    sym = tl.load(lo + row)
    qbase = tl.load(b_qbase + blob)
    if DEQUANT:
        obase, ch, step, qoff = place(r, blob, n, b_heads, b_kc, b_vc, b_tokens, b_sink,
                                      b_kbase, b_vbase, b_kstep, b_vstep)
        sc = tl.load(sout + qbase + qoff + tok, mask=m, other=1.0)
        val = sym.to(tl.float32) * (sc * step)
        val = tl.minimum(tl.maximum(val, -top), top)
        tl.store(out + obase + tok.to(tl.int64) * ch, cast(val, out), mask=m)
    else:
        bad = (sym < -_QMAX) | (sym > _QMAX)
        tl.atomic_or(flag, _BAD_SCALE, mask=bad)
        at = qbase + r.to(tl.int64) * n + tok
        tl.store(qout + at, sym + tok * 0, mask=m)
        tl.store(sout + at, scale_of(tl.where(bad, 0, sym), table) + tok * 0.0, mask=m)


@triton.jit
def spans(buf, src, dst, nbytes, out, BLOCK: tl.constexpr):
    """Program i copies nbytes[i] bytes from buf[src[i]:] to out[dst[i]:] (bytes)."""
    i = tl.program_id(0)
    a = tl.load(src + i)
    d = tl.load(dst + i)
    size = tl.load(nbytes + i)
    for o in range(0, size, BLOCK):
        idx = o + tl.arange(0, BLOCK)
        m = idx < size
        tl.store(out + d + idx, tl.load(buf + a + idx, mask=m, other=0), mask=m)


@triton.jit
def int8(buf, p_sec, p_first, s_scales, s_data, s_ch, s_numel, s_out, out, flag, top,
          BLOCK: tl.constexpr):
    """int8 sections: program p dequantises BLOCK elements of section p_sec[p]:
    q x scale (float16 per (head, token)) -> destination dtype, clamped like the CPU."""
    p = tl.program_id(0)
    sec = tl.load(p_sec + p)
    e = (p - tl.load(p_first + sec)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < tl.load(s_numel + sec)
    ch = tl.load(s_ch + sec)
    q = tl.load(buf + tl.load(s_data + sec) + e, mask=m, other=0).to(tl.int8, bitcast=True)
    sa = tl.load(s_scales + sec) + 2 * (e // ch)
    bits = (tl.load(buf + sa, mask=m, other=0).to(tl.int16)
            | (tl.load(buf + sa + 1, mask=m, other=0).to(tl.int16) << 8))
    sc = bits.to(tl.float16, bitcast=True).to(tl.float32)
    bad = tl.max((m & ((bits & 0x7C00) == 0x7C00)).to(tl.int32), axis=0)  # inf or NaN
    tl.atomic_or(flag, _BAD_INT8, mask=bad > 0)
    val = q.to(tl.float32) * sc
    val = tl.minimum(tl.maximum(val, -top), top)
    tl.store(out + tl.load(s_out + sec) + e, cast(val, out), mask=m)
