"""The rANS decoder as a Triton kernel: the same bytes as ``kdn.codec.rans``, decoded on a GPU.

One program decodes one group (``rans.GROUP`` streams as lanes), stepping its lanes through
their symbols in lockstep exactly as the CPU decoder does; the lanes that renormalise on a step
take consecutive words from the group's interleaved word run (an exclusive prefix sum over the
lanes gives each its word). Symbols are found from the same lookup table (the bucket's first
bin) by a branchless search inside the bucket, as many steps as the group's widest row needs
(bins that never occur take no slots, so a bucket can span a whole row). Output: the int32
symbol matrix in device memory; the codec mode dequantises it there with torch.

``decode_on(blob, rows, n, device)`` takes a format-2 entropy blob (``entropy.RANS_MARK``);
tables are parsed on the host (a few KB), states and words go to the device with one copy each.
A damaged group is reported like the CPU decoder does (Corrupt). Without a GPU the kernel runs
under ``TRITON_INTERPRET=1`` (exact, slow): that is how CI checks it against the CPU decoder.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kdn.codec import rans
from kdn.codec.gpu_source import launch
from kdn.codec.quant import from_numpy, upload_many
from kdn.errors import Corrupt, InvalidArgument


@triton.jit
def _decode_kernel(states, length, base, first_bin, last_bin, row_lut, low, depth, goff, gwords,
                   words, lut, cum, freq, out, bad, streams, steps,
                   GROUP: tl.constexpr, PREC: tl.constexpr, LUT_BITS: tl.constexpr):
    g = tl.program_id(0)
    lane = tl.arange(0, GROUP)
    s = g * GROUP + lane
    live = s < streams
    x = tl.load(states + s, mask=live, other=1 << 16)
    ln = tl.load(length + s, mask=live, other=0)
    at = tl.load(base + s, mask=live, other=0)
    fb = tl.load(first_bin + s, mask=live, other=0)
    lb = tl.load(last_bin + s, mask=live, other=0)
    rl = tl.load(row_lut + s, mask=live, other=0)
    lo = tl.load(low + s, mask=live, other=0)
    dep = tl.max(tl.load(depth + s, mask=live, other=0), axis=0)
    ptr = tl.load(goff + g)
    end = ptr + tl.load(gwords + g)
    err = g * 0
    for t in range(steps):
        act = t < ln
        slot = x & ((1 << PREC) - 1)
        bucket = slot >> (PREC - LUT_BITS)
        a = tl.load(lut + rl + bucket, mask=act, other=0)
        last = tl.where(bucket == (1 << LUT_BITS) - 1, lb,
                        tl.load(lut + rl + bucket + 1, mask=act & (bucket < (1 << LUT_BITS) - 1),
                                other=0))
        size = last - a + 1
        for _ in range(dep):  # the last bin of [a, last] whose cum <= slot
            half = size >> 1
            probe = a + half
            ok = act & (half > 0) & (tl.load(cum + probe, mask=act & (half > 0),
                                             other=1 << 30) <= slot)
            a = tl.where(ok, probe, a)
            size = size - half
        c = tl.load(cum + a, mask=act, other=0)
        f = tl.load(freq + a, mask=act, other=1)
        tl.store(out + at + t, lo + (a - fb).to(tl.int32), mask=act)
        nx = f * (x >> PREC) + slot - c
        need = act & (nx < (1 << 16))
        take = need.to(tl.int64)
        rank = tl.cumsum(take, axis=0) - take  # this lane's word among the group's readers
        pos = ptr + rank
        inside = need & (pos < end)
        w = tl.load(words + pos, mask=inside, other=0).to(tl.int64)
        err = err | tl.max((need & (pos >= end)).to(tl.int32), axis=0)
        nx = tl.where(inside, (nx << 16) | w, nx)
        x = tl.where(act, nx, x)
        ptr = ptr + tl.sum(take, axis=0)
    err = err | (ptr != end).to(tl.int32) * 2
    err = err | tl.max((live & (x != (1 << 16))).to(tl.int32), axis=0) * 4
    tl.store(bad + g, err)


def decode_on(blob: bytes | memoryview, rows_n: int, n: int, device: torch.device
              ) -> torch.Tensor:
    """The [rows, n] int32 symbols of a format-2 entropy blob, decoded on ``device``."""
    from kdn.codec.entropy import parse_tables

    lo, width, counts, section = parse_tables(blob, rows_n, n)
    if section is None:
        raise InvalidArgument("only format-2 (rANS) entropy blobs decode on the GPU")
    if n == 0:
        return torch.empty((rows_n, 0), dtype=torch.int32, device=device)
    mv = memoryview(section)
    block, groups, streams = rans.check_section(mv, width, n)
    filled = np.repeat(lo.astype(np.int32)[:, None], n, axis=1).reshape(-1)  # constant rows
    rows, blks = rans.plan(width, n, block)
    need = 8 + 4 * streams + 4 * groups
    if streams == 0:
        return from_numpy(filled, device).view(rows_n, n)
    states = np.frombuffer(mv, dtype="<u4", count=streams, offset=8).astype(np.int64)
    gwords = np.frombuffer(mv, dtype="<u4", count=groups, offset=8 + 4 * streams
                           ).astype(np.int64)
    words = np.frombuffer(mv, dtype="<u2", offset=need).astype(np.int32)
    if int(gwords.sum()) != len(words):
        raise Corrupt("rANS word counts do not match the words stored")
    freq, cum = rans.normalize(width, counts)
    starts = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    lut = rans.lookup(width, cum, freq)
    begin = blks * block
    per_stream = {
        "length": np.minimum(block, n - begin), "base": rows * n + begin,
        "first_bin": starts[rows], "last_bin": starts[rows] + width.astype(np.int64)[rows] - 1,
        "row_lut": rans.lut_bases(width, rows),
        "low": lo.astype(np.int32)[rows],
        # ceil(log2 width): steps that narrow any bucket of the row (at most its width) to a bin
        "depth": np.ceil(np.log2(np.maximum(width[rows], 1).astype(np.float64))).astype(np.int32),
    }
    host = {"states": states, "goff": np.concatenate([[0], np.cumsum(gwords)[:-1]]),
            "gwords": gwords, "words": words, "lut": lut, "cum": cum, "freq": freq,
            **per_stream}
    host["out"] = filled
    dev = upload_many(host, device)  # one staging buffer, one copy
    out = dev["out"]
    bad = torch.zeros(groups, dtype=torch.int32, device=device)
    launch(_decode_kernel, (groups,),  # on the device's current stream, as the copies
           dev["states"], dev["length"], dev["base"], dev["first_bin"], dev["last_bin"],
           dev["row_lut"],
           dev["low"], dev["depth"], dev["goff"], dev["gwords"], dev["words"], dev["lut"],
           dev["cum"], dev["freq"], out, bad, streams, int(per_stream["length"].max()),
           GROUP=rans.GROUP, PREC=rans.PREC, LUT_BITS=rans.LUT_BITS)
    if bool((bad != 0).any()):
        first = int(torch.nonzero(bad)[0, 0])
        raise Corrupt(f"rANS group {first} does not decode")
    return out.view(rows_n, n)
