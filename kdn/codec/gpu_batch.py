"""Whole-entry decode on the device: every layer of an entry (or a frame) in a few launches.

``kdn`` and ``int8`` bodies of many layers decode together, with no host synchronisation:

1. The host parses what is small: each layer's section table and each entropy blob's
   zstd-packed tables (lo and width; format 3's count codes turned into counts; format 4's
   codes stay where they lie, for the device to read) and rANS headers
   (``Plan``). It validates sizes (Corrupt right away) and lays out one output buffer for
   every layer's K and V.
2. Copies to the device: the bodies' bytes (one span of the caller's buffer where they lie
   in one; from pinned memory, else one copy per run of neighbouring bodies, read where they
   lie: an entry each for the blocks of a context; other memory is packed into pinned staging
   first) and one packed metadata buffer (tables, per-blob and per-group descriptors, the
   error flag's zeroed word).
3. Launches, independent of the layer count: ``rows`` (every blob's table rows laid out from
   its tables: lowest symbol, width, first bin, search depth, where its counts lie, and the
   lists of coded and constant rows; the host plans per blob, not per row), ``_normalize``
   (every table row's counts to rANS frequencies, as ``rans.normalize``), ``_rans`` over the
   log-scale blobs (int32 symbols and their scales), ``_rans`` over the symbol blobs with
   dequantisation fused (symbol x scale x level step, straight into the destination dtype
   and the [heads, tokens, channels] layout), ``_spans`` for the exact sink tokens; ``int8``
   is one ``_int8`` launch. Constant rows (one symbol value, no coded stream) get ``_fill``
   launches only when there are any.
4. Kernels that find damaged bytes set bits of a device flag; ``Decoded.check`` reads it once,
   when the consumer needs the tensors (one synchronisation per entry, not per layer), and
   raises Corrupt: no wrong KV is handed over.

The CPU decoders (``kdn.codec.rans``, ``kdn.codec.modes``) are the oracle: the same bytes give
bit-identical tensors. The scales use ``quant.scale_from_symbols``'s exact construction (a
16-entry table times a power of two made from its bits), so no transcendental function can
differ between devices. Without a GPU every kernel runs under ``TRITON_INTERPRET=1`` (exact,
slow): that is how CI checks them, launch and synchronisation counts included (``STATS``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from kdn.codec import gpu_kernels as kernels
from kdn.codec import gpu_plan as plan
from kdn.codec import rans
from kdn.codec.entropy import LOG_LEVELS
from kdn.codec.gpu_source import (
    DIRECT,
    SPAN_GAP,
    STATS,
    THREADS,
    Source,
    Staging,
    await_ready,
    lap,
    launch,
    layer_chunks,
    record_ready,
    run_all,
)
from kdn.codec.modes import LayerSpec
from kdn.codec.quant import SCALE_TABLE, upload_many
from kdn.codec.room import check_room
from kdn.errors import Corrupt, InvalidArgument, TooLarge, again, kept

__all__ = ["DIRECT", "SPAN_GAP", "STATS", "Decoded", "decode_int8", "decode_kdn"]

BAD = {kernels.BAD_GROUP: "rANS data does not decode",
       kernels.BAD_SCALE: "scale symbols out of range",
       kernels.BAD_TABLE: "entropy table row has no mass",
       kernels.BAD_INT8: "an int8 scale is not finite (inf or NaN)"}
_NORM_BLOCK = 64
_SPAN_BLOCK = 1024
_ROWS_BLOCK = 256
_INT8_BLOCK = 1024
_FILL_BLOCK = 256


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    if all(grid):
        launch(kernel, grid, *args, **meta)
        STATS["launches"] += 1


# ------------------------------------------------------------------------------ results

@dataclass
class Decoded:
    """Layers decoded on a device, with the check that makes them safe to use."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    flag: torch.Tensor | None = None
    where: str = "entry"
    keep: list[Any] = field(default_factory=list)
    """Device buffers the queued kernels read (alive until they have run)."""

    error: Corrupt | None = None
    waits: list[Callable[[], None]] = field(default_factory=list)
    """Checks still running beside the kernels (``format.sums_checked_later``: the frames'
    sums), each raising Corrupt on damage: waited for before the flag is read."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Held while checking: the streams of one context share this check (``kdn.client.
    landing.decoded_together``), and none may see the layers before it is done."""

    ready: Any = None
    """A CUDA event recorded after the kernels, on the stream they were queued on (the
    decoding thread's current one: ``gpu_source.record_ready``); the check's stream waits for
    it before reading the flag, and a consumer's stream before using the layers."""

    out: torch.Tensor | None = None
    """The one buffer every layer views (what a consumer's stream records as in use)."""

    def check(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The layers, once the checks still running are done and the kernels' error flag is
        read (a synchronisation, the first time): raises Corrupt, every time, where a frame's
        sum did not match or any kernel found damaged bytes."""
        with self.lock:
            return self._check()

    def _check(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        waits, self.waits = self.waits, []
        for wait in waits:
            try:
                wait()
            except Corrupt as exc:
                if self.error is None:
                    self.error = kept(exc)  # not this frame, which holds ``self``
                self.layers = []
        if self.flag is not None:
            STATS["syncs"] += 1
            await_ready(self.ready, self.flag.device)  # queued on another stream, maybe
            bits = int(self.flag.item())
            self.flag = None
            self.keep.clear()
            if bits and self.error is None:
                why = "; ".join(t for b, t in BAD.items() if bits & b)
                self.error = Corrupt(f"{self.where}: {why}")
                self.layers = []
        if self.error is not None:
            raise again(self.error)  # a copy: its traceback holds the frames that hold this
        return self.layers


# ------------------------------------------------------------------------------ host plan

_TOP = {torch.float16: float(torch.finfo(torch.float16).max),
        torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
        torch.float32: float(torch.finfo(torch.float32).max)}


def _outputs(specs: list[LayerSpec]) -> tuple[int, list[tuple[int, int]], torch.dtype]:
    """Elements of the one output buffer of ``specs``' layers, where each layer's K and V
    start in it, and their dtype. The buffer is allocated only once the bodies were checked
    (``_output``): the sizes come from the header, which damaged or hostile bytes may
    inflate to far more than the bodies hold."""
    distinct = _distinct(specs)
    dtypes = {s.dtype for s in distinct.values()}
    if len(dtypes) != 1:
        raise InvalidArgument("layers of one decode must share a dtype")
    numel = {i: (s.layout.k_numel(s.tokens), s.layout.v_numel(s.tokens))
             for i, s in distinct.items()}
    bases, at = [], 0
    for s in specs:
        kn, vn = numel[id(s)]
        bases.append((at, at + kn))
        at += kn + vn
    return at, bases, dtypes.pop().torch


def _distinct(specs: list[LayerSpec]) -> dict[int, LayerSpec]:
    """The distinct spec objects among ``specs`` by identity: a context's blocks share one
    spec per layer (``codec.api.record_specs``), so what is derived from a spec is derived
    once per layer, not once per block."""
    return {id(s): s for s in specs}


def _output(numel: int, dt: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tensor every layer's K and V are decoded into; TooLarge where the device has not
    the room (``check_room`` asked before: what other processes hold is not counted there)."""
    try:
        return torch.empty(max(numel, 1), dtype=dt, device=device)
    except torch.OutOfMemoryError as exc:
        raise TooLarge(f"the entries decode to {numel * dt.itemsize / 2**30:.1f} GiB, more "
                       f"than device {device} has free now") from exc


def _views(out: torch.Tensor, specs: list[LayerSpec], bases: list[tuple[int, int]]
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V as views of ``out`` (laid out K, V, K, V, ... by ``_outputs``):
    where every layer has one shape, two ``unbind`` calls make them all."""
    shapes = {(s.k_shape, s.v_shape) for s in _distinct(specs).values()}
    if len(shapes) == 1 and specs:
        ks, vs = shapes.pop()
        kn, vn = math.prod(ks), math.prod(vs)
        rows = out[: len(specs) * (kn + vn)].view(len(specs), kn + vn)
        return list(zip(rows[:, :kn].reshape(len(specs), *ks).unbind(0),
                        rows[:, kn:].reshape(len(specs), *vs).unbind(0)))
    layers = []
    for s, (kb, vb) in zip(specs, bases):
        k = out[kb : kb + s.layout.k_numel(s.tokens)].view(s.k_shape)
        v = out[vb : vb + s.layout.v_numel(s.tokens)].view(s.v_shape)
        layers.append((k, v))
    return layers


# ------------------------------------------------------------------------------ kdn mode

def decode_kdn(bodies: list[memoryview], specs: list[LayerSpec],
               level_steps: list[tuple[float, float, int]], device: torch.device,
               where: str = "entry", *, pinned: bool = False,
               addresses: list[int] | None = None) -> Decoded | None:
    """``kdn`` bodies of ``specs``' layers (``level_steps``: each layer's K step, V step and
    sink tokens) on ``device``; call ``check()`` on the result before using the tensors. None
    where a blob is range-coded (format 1: the CPU decodes those). Each step's host time
    is added to ``gpu_source.SECONDS`` (``kdn.*``)."""
    t = time.perf_counter()
    numel, bases, dt = _outputs(specs)
    check_room(numel * dt.itemsize, sum(s.tokens for s in specs if s.index == 0),
               device=device)  # (constant rows cost no bytes: the bodies bound nothing)
    source = Source(list(bodies), device, pinned, addresses=addresses)
    t = lap("kdn.source", t)
    buf = source.array
    col = np.array([(s.layout.kv_heads, s.layout.k_channels, s.layout.v_channels, s.tokens,
                     min(st[2], s.tokens), kb, vb)
                    for s, st, (kb, vb) in zip(specs, level_steps, bases)], np.int64
                   ).reshape(-1, 7)
    heads, kc, vc, tokens, sink, kbase, vbase = (np.ascontiguousarray(col[:, i])
                                                  for i in range(7))
    streams = np.stack([np.full(len(specs), 2, np.int64), heads * (kc + vc)], axis=1)
    err = np.zeros(2, np.int64)

    def failed() -> bool:
        if err[0] == plan.FORMAT_1:
            return True
        if err[0]:
            raise Corrupt(f"layer {specs[int(err[1])].index}: {plan.WHY[int(err[0])]}")
        return False

    sect, blobs = plan.scan(buf, np.array(source.host_offsets, np.int64),
                            np.array([len(b) for b in bodies], np.int64), tokens - sink, err)
    if failed():
        return None
    sizes = plan.table_sizes(buf, blobs, streams, err)
    failed()
    present = blobs[:, :, 0] >= 0
    big = Staging(device)  # the tables: written where they are sent from
    big.add("counts", np.uint8, int(sizes[present].sum()))
    host_big = big.arrays()
    t = lap("kdn.scan", t)
    tables, tab = _tables(buf, blobs, sizes, host_big["counts"], where, err)
    failed()
    t = lap("kdn.tables", t)
    args = (buf, sect, blobs, tables, tab, streams, heads, kc, vc, tokens, sink)
    per_layer = np.zeros((len(specs), 13), np.int64)
    run_all(lambda c: plan.count(  # type: ignore[call-arg]
        c[0], c[1], per_layer, *args, dt.itemsize, err), layer_chunks(streams[:, 1]))
    failed()
    t = lap("kdn.count", t)
    counts = per_layer.sum(axis=0)
    starts = np.cumsum(per_layer, axis=0) - per_layer
    bts, grs, sp, rd = plan.allocate(counts)
    chunks = layer_chunks(per_layer[:, 0] + per_layer[:, 1] + per_layer[:, 2]
                          + per_layer[:, 3] + per_layer[:, 10])
    run_all(lambda c: plan.fill(  # type: ignore[call-arg]
        c[0], c[1], starts, per_layer, *args, kbase, vbase, dt.itemsize, *bts, *grs, sp, rd,
        err), chunks)
    failed()  # a count code out of range (format 3)
    t = lap("kdn.fill", t)
    out = _output(numel, dt, device)  # every body checked as far as the host checks them
    if source.delta is not None:  # the planner read the bodies elsewhere than the device does
        _to_device(source.delta, counts, bts, grs, sp, per_layer[:, 10], rd)
    qat = int(counts[11])
    ksteps = np.array([st[0] for st in level_steps], np.float32)
    vsteps = np.array([st[1] for st in level_steps], np.float32)
    host: dict[str, np.ndarray] = {
        "flag": np.zeros(1, np.int32), "table": SCALE_TABLE.numpy(),
        "levels": LOG_LEVELS.astype(np.int32),
        "span_src": sp[:, 0].copy(), "span_dst": sp[:, 1].copy(), "span_len": sp[:, 2].copy(),
        "rd": rd}
    for b, p in enumerate(("s_", "y_")):
        bt, gr = bts[b], grs[b]
        for name, field_ in _FIELDS.items():
            host[f"{p}b_{name}"] = bt[:, field_].copy()
        host[f"{p}b_kstep"] = ksteps[bt[:, plan.NF]]
        host[f"{p}b_vstep"] = vsteps[bt[:, plan.NF]]
        host[f"{p}g_blob"] = gr[:, 0].astype(np.int32)
        host[f"{p}g_first"] = gr[:, 1].astype(np.int32)
        host[f"{p}g_woff"] = gr[:, 2].copy()
        host[f"{p}g_wcnt"] = gr[:, 3].astype(np.int32)
    dev = {**upload_many(host, device), **big.send()}
    STATS["copies"] += 2 * (device.type != "cpu")
    bins = max(int(counts[9]), 1)  # every row's bins one after another (``tstart``)
    nrows = max(int(counts[8]), 1)
    for name in ("lo", "width", "tstart", "depth"):  # laid out by the ``rows`` kernel
        dev[name] = torch.empty(nrows, dtype=torch.int32, device=device)
    dev["csrc"] = torch.empty(nrows, dtype=torch.int64, device=device)
    lists = {}  # each set's coded rows and constant rows (blob, row), set 1's after set 0's
    for name, (n0, n1) in (("coded", counts[4:6]), ("c_blob", counts[6:8]),
                           ("c_row", counts[6:8])):
        whole = torch.empty(int(n0 + n1) + 2, dtype=torch.int32, device=device)
        lists[name] = int(n0) + 1
        dev["s_" + name], dev["y_" + name] = whole[: int(n0) + 1], whole[int(n0) + 1 :]
        dev[name] = whole
    freq = torch.empty(bins, dtype=torch.int32, device=device)
    cum = torch.empty(bins, dtype=torch.int32, device=device)
    qout = torch.empty(max(qat, 1), dtype=torch.int32, device=device)
    sout = torch.empty(max(qat, 1), dtype=torch.float32, device=device)
    flag = dev["flag"]
    top = _TOP[dt]
    t = lap("kdn.upload", t)
    _launch(kernels.rows, (int(counts[0] + counts[1]),), dev["rd"], dev["counts"], dev["lo"],
            dev["width"], dev["tstart"], dev["depth"], dev["csrc"], dev["coded"],
            dev["c_blob"], dev["c_row"], lists["coded"], lists["c_blob"], RD=plan.RD,
            BLOCK=_ROWS_BLOCK)
    _launch(kernels.normalize, (int(counts[8]),), dev["counts"], source.tensor, dev["levels"],
            dev["csrc"], dev["tstart"], dev["width"], freq, cum, flag, PREC=rans.PREC,
            BLOCK=_NORM_BLOCK, num_warps=2)
    max_n = int((tokens - sink).max(initial=0))
    for b, (p, dequant) in enumerate((("s_", False), ("y_", True))):
        _launch(kernels.fill, (int(counts[6 + b]), -(-max_n // _FILL_BLOCK)),
                dev[p + "c_blob"], dev[p + "c_row"],
                *(dev[f"{p}b_{k}"] for k in (
                    "rowbase", "n", "heads", "kc", "vc", "tokens", "sink", "kbase", "vbase",
                    "qbase", "kstep", "vstep")),
                dev["lo"], dev["table"], out, qout, sout, flag, top,
                BLOCK=_FILL_BLOCK, DEQUANT=dequant)
        _launch(kernels.rans, (int(counts[2 + b]),), source.tensor,
                dev[p + "g_blob"], dev[p + "g_first"], dev[p + "g_woff"], dev[p + "g_wcnt"],
                *(dev[f"{p}b_{k}"] for k in (
                    "crow", "rowbase", "blocks", "block", "n", "streams", "states", "heads",
                    "kc", "tokens", "sink", "kbase", "vbase", "qbase", "vc", "kstep", "vstep")),
                dev[p + "coded"], dev["tstart"], dev["width"], dev["depth"], dev["lo"],
                cum, freq, dev["table"], out, qout, sout, flag, top,
                GROUP=rans.GROUP, PREC=rans.PREC, DEQUANT=dequant,
                num_warps=1)  # a group's 32 lanes are one warp: more groups per SM
    _launch(kernels.spans, (int(counts[10]),), source.tensor, dev["span_src"], dev["span_dst"],
            dev["span_len"], out.view(torch.uint8), BLOCK=_SPAN_BLOCK)
    ready = record_ready(device)
    t = lap("kdn.launch", t)
    done = Decoded(_views(out, specs, bases), flag, where,
                   keep=[source.host, source.tensor, big.host, dev, freq, cum, qout, sout],
                   ready=ready, out=out)
    lap("kdn.views", t)
    return done


def _to_device(delta: np.ndarray, counts: np.ndarray, bts: tuple[np.ndarray, ...],
               grs: tuple[np.ndarray, ...], sp: np.ndarray, spans: np.ndarray,
               rd: np.ndarray) -> None:
    """The planner's offsets into the host bytes (each layer's body at its place there) moved
    to the device buffer's (``delta``: [L] device minus host offset of each layer's body;
    ``counts``: ``count``'s totals; ``spans``: sink spans per layer): the blobs' rANS states,
    the groups' words, the sink spans' sources and the blobs' count codes where they lie in
    the bodies (format 4: ``rd``'s nibble index)."""
    for b, (bt, gr) in enumerate(zip(bts, grs)):
        nb, ng = int(counts[b]), int(counts[2 + b])
        bt[:nb, plan.STATES] += delta[bt[:nb, plan.NF]]
        gr[:ng, 2] += delta[bt[gr[:ng, 0], plan.NF]]
    sp[: int(counts[10]), 0] += np.repeat(delta, spans)
    blobs = rd[: int(counts[0] + counts[1])]
    packed = blobs[:, plan.RD_PACKED] != 0
    blobs[packed, plan.RD_SRC] += 2 * delta[blobs[packed, plan.RD_LAYER]]


_FIELDS = {"crow": plan.CROW, "rowbase": plan.ROWBASE, "blocks": plan.BLOCKS,
           "block": plan.BLOCK, "n": plan.N, "streams": plan.STREAMS, "states": plan.STATES,
           "heads": plan.HEADS, "kc": plan.KC, "vc": plan.VC, "tokens": plan.TOKENS,
           "sink": plan.SINK, "kbase": plan.KBASE, "vbase": plan.VBASE, "qbase": plan.QBASE}
_DCTX = zstandard.ZstdDecompressor()


def _tables(buf: np.ndarray, blobs: np.ndarray, sizes: np.ndarray, into: np.ndarray,
            where: str, err: np.ndarray, zstd: bool | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Every blob's zstd-packed tables decompressed one after another ``into`` (returned), and
    where each lies ([L, 2, 2]: offset, length): by the compiled planner on the staging
    threads where the system has libzstd (``plan.inflate``; damage sets ``err``), else in one
    call of ``zstandard``'s (several threads, then Python per blob). ``zstd`` forces either."""
    tab = np.zeros((*blobs.shape[:2], 2), np.int64)
    present = blobs[:, :, 0] >= 0
    if not present.any():
        return into, tab
    want = sizes[present]
    tab[:, :, 1][present] = want
    tab[:, :, 0][present] = np.cumsum(want) - want
    if plan.HAVE_ZSTD if zstd is None else zstd:
        run_all(lambda c: plan.inflate(c[0], c[1], buf, blobs, sizes, tab, into, err),
                 layer_chunks(sizes.sum(axis=1)))
        return into, tab
    segs = np.stack([blobs[:, :, 0][present], blobs[:, :, 1][present]], axis=1)
    try:
        got = _DCTX.multi_decompress_to_buffer(
            zstandard.BufferWithSegments(memoryview(buf), segs  # type: ignore[arg-type]
                .astype("<u8").tobytes()),
            decompressed_sizes=want.astype("<u8").tobytes(), threads=THREADS)
        parts = [np.frombuffer(memoryview(got[i]), np.uint8)  # type: ignore[arg-type]
                 for i in range(len(got))]
    except zstandard.ZstdError as exc:
        raise Corrupt(f"{where}: entropy tables do not decode: {exc}") from exc
    if [len(p) for p in parts] != want.tolist():
        raise Corrupt(f"{where}: entropy tables are not the size they declare")
    return np.concatenate(parts, out=into), tab


# ------------------------------------------------------------------------------ int8 mode

def decode_int8(bodies: list[memoryview], specs: list[LayerSpec], device: torch.device,
                where: str = "entry", *, pinned: bool = False,
                addresses: list[int] | None = None) -> Decoded:
    """``int8`` bodies of ``specs``' layers on ``device`` in one launch (``check()`` first).
    Each body's four sections (K scales, K data, V scales, V data) are located and checked
    for all layers at once from the bodies' section tables (``_int8_sections``). Each step's
    host time is added to ``gpu_source.SECONDS`` (``int8.*``)."""
    t = time.perf_counter()
    total, bases, dt = _outputs(specs)
    source = Source(list(bodies), device, pinned, host_view=False, addresses=addresses)
    t = lap("int8.source", t)
    scales_at, data_at, chans, numel, out_at = _int8_sections(bodies, specs, bases,
                                                               source.offsets)
    t = lap("int8.sections", t)
    out = _output(total, dt, device)  # the bodies' sections fit their layers
    progs = -(-numel // _INT8_BLOCK)
    some = len(progs) > 0
    host: dict[str, np.ndarray] = {
            "flag": np.zeros(1, np.int32),
            "p_sec": np.repeat(np.arange(len(progs), dtype=np.int32), progs) if some
            else np.zeros(1, np.int32),
            "p_first": (np.cumsum(progs) - progs).astype(np.int32) if some
            else np.zeros(1, np.int32),
            "s_scales": scales_at if some else np.zeros(1, np.int64),
            "s_data": data_at if some else np.zeros(1, np.int64),
            "s_ch": chans if some else np.ones(1, np.int64),
            "s_numel": numel if some else np.zeros(1, np.int64),
            "s_out": out_at if some else np.zeros(1, np.int64)}
    dev = upload_many(host, device)
    STATS["copies"] += device.type != "cpu"
    t = lap("int8.upload", t)
    _launch(kernels.int8, (int(progs.sum()),), source.tensor, dev["p_sec"], dev["p_first"],
            dev["s_scales"], dev["s_data"], dev["s_ch"], dev["s_numel"], dev["s_out"],
            out, dev["flag"], _TOP[dt], BLOCK=_INT8_BLOCK)
    ready = record_ready(device)
    t = lap("int8.launch", t)
    done = Decoded(_views(out, specs, bases), dev["flag"], where,
                   keep=[source.host, source.tensor, dev], ready=ready, out=out)
    lap("int8.views", t)
    return done


def _int8_sections(bodies: list[memoryview], specs: list[LayerSpec],
                   bases: list[tuple[int, int]], offsets: list[int]
                   ) -> tuple[np.ndarray, ...]:
    """Where each non-empty K and V section of the ``int8`` bodies lies in the device buffer
    (``offsets``: each body's there), in layer order, K before V: (scales at, data at,
    channels, elements, output offset), each an int64 array. A body is four u32 section
    lengths, then the sections (``modes.pack_sections``): scales of 2 bytes per (head, token),
    then one byte per element. Raises Corrupt, naming the first bad layer, where a body is
    shorter than its table, its sections do not add up to it or do not fit the layer."""
    sizes = np.array([len(b) for b in bodies], np.int64)
    short = np.flatnonzero(sizes < 16)
    if len(short):
        i = int(short[0])
        raise Corrupt(f"layer {specs[i].index}: body of {sizes[i]} bytes is shorter than its "
                      "section table")
    lens = np.frombuffer(b"".join([b[:16] for b in bodies]), "<u4").reshape(-1, 4) \
        .astype(np.int64)
    off = np.array(offsets, np.int64)
    shape = np.array([(s.layout.kv_heads * s.tokens, s.layout.k_channels, s.layout.v_channels)
                      for s in specs], np.int64).reshape(-1, 3)
    rows, kc, vc = shape[:, 0], shape[:, 1], shape[:, 2]
    bad_sum = 16 + lens.sum(axis=1) != sizes
    bad_k = (lens[:, 0] != 2 * rows) | (lens[:, 1] != rows * kc)
    bad_v = (lens[:, 2] != 2 * rows) | (lens[:, 3] != rows * vc)
    bad = np.flatnonzero(bad_sum | bad_k | bad_v)
    if len(bad):
        i = int(bad[0])
        lw, sp = f"layer {specs[i].index}", specs[i]
        if bad_sum[i]:
            raise Corrupt(f"{lw}: sections of {int(lens[i].sum())} bytes in a body of "
                          f"{sizes[i]}")
        raise Corrupt(f"{lw}: int8 sections have the wrong sizes for "
                      f"{sp.k_shape if bad_k[i] else sp.v_shape}")
    at = np.cumsum(lens, axis=1) - lens + 16 + off[:, None]  # each section's device offset
    base = np.array(bases, np.int64).reshape(-1, 2)
    fields = [np.stack(pair, axis=1).ravel() for pair in (
        (at[:, 0], at[:, 2]), (at[:, 1], at[:, 3]), (kc, vc), (lens[:, 1], lens[:, 3]),
        (base[:, 0], base[:, 1]))]  # K then V of each layer
    keep = fields[3] > 0  # sections with no elements (no tokens, no kept channels)
    return tuple(np.ascontiguousarray(f[keep]) for f in fields)
