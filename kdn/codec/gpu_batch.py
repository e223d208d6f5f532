"""Whole-entry decode on the device: every layer of an entry (or a frame) in a few launches.

``kdn`` and ``int8`` bodies of many layers decode together, with no host synchronisation:

1. The host parses what is small: each layer's section table and each entropy blob's
   zstd-packed frequency tables and rANS headers (``Plan``). It validates sizes (Corrupt
   right away) and lays out one output buffer for every layer's K and V.
2. Two copies to the device: the bodies' bytes (one span of the caller's buffer where they lie
   in one, else packed) and one packed metadata buffer (tables, per-blob and per-group
   descriptors, the error flag's zeroed word).
3. Launches, independent of the layer count: ``_normalize`` (every table row's counts to
   rANS frequencies, as ``rans.normalize``), ``_rans`` over the log-scale blobs (int32 symbols
   and their scales), ``_rans`` over the symbol blobs with dequantisation fused (symbol x
   scale x level step, straight into the destination dtype and the [heads, tokens, channels]
   layout), ``_spans`` for the exact sink tokens; ``int8`` is one ``_int8`` launch. Constant
   rows (one symbol value, no coded stream) get ``_fill`` launches only when there are any.
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

import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kdn.codec import gpu_kernels as kernels
from kdn.codec import rans
from kdn.codec.entropy import parse_tables
from kdn.codec.modes import LayerSpec, unpack_sections
from kdn.codec.quant import SCALE_TABLE, upload_many
from kdn.errors import Corrupt, InvalidArgument

STATS = {"launches": 0, "copies": 0, "syncs": 0}
"""Kernel launches, host-to-device copies and host synchronisations made by this module
(counted where they are issued; tests read them to hold the per-entry budget)."""

BAD = {kernels.BAD_GROUP: "rANS data does not decode",
       kernels.BAD_SCALE: "scale symbols out of range",
       kernels.BAD_TABLE: "entropy table row has no mass",
       kernels.BAD_INT8: "infinite int8 scale"}
_NORM_BLOCK = 64
_SPAN_BLOCK = 1024
_INT8_BLOCK = 1024
_FILL_BLOCK = 256


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    if all(grid):
        kernel[grid](*args, **meta)
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

    def check(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The layers, once the kernels' error flag is read (a synchronisation): raises
        Corrupt where any kernel found damaged bytes."""
        if self.flag is not None:
            STATS["syncs"] += 1
            bits = int(self.flag.item())
            self.flag = None
            self.keep.clear()
            if bits:
                why = "; ".join(t for b, t in BAD.items() if bits & b)
                raise Corrupt(f"{self.where}: {why}")
        return self.layers


# ------------------------------------------------------------------------------ host plan

_TOP = {torch.float16: float(torch.finfo(torch.float16).max),
        torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
        torch.float32: float(torch.finfo(torch.float32).max)}
_HDR = struct.Struct("<II")


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


class _Source:
    """The bodies' bytes as one uint8 tensor on the device (one copy), and each body's offset
    in it."""

    def __init__(self, bodies: list[memoryview], device: torch.device) -> None:
        owners = {id(b.obj) for b in bodies}
        addr = [_address(b) for b in bodies]
        sizes = [len(b) for b in bodies]
        nonempty = [i for i, n in enumerate(sizes) if n]
        lo = min((addr[i] for i in nonempty), default=0)
        hi = max((addr[i] + sizes[i] for i in nonempty), default=0)
        start, whole = -1, np.empty(0, np.uint8)
        if len(owners) == 1 and nonempty and hi - lo <= 2 * sum(sizes) + (1 << 20):
            base = bodies[nonempty[0]]
            whole = np.frombuffer(base.obj, dtype=np.uint8)  # type: ignore[call-overload]
            start = lo - int(whole.ctypes.data)
        if 0 <= start and start + hi - lo <= len(whole):
            host = whole[start : start + hi - lo]
            self.offsets = [a - lo if n else 0 for a, n in zip(addr, sizes)]
        else:
            host = np.empty(sum(sizes), dtype=np.uint8)
            self.offsets, at = [], 0
            for b in bodies:
                host[at : at + len(b)] = np.frombuffer(b, dtype=np.uint8)
                self.offsets.append(at)
                at += len(b)
        with warnings.catch_warnings():  # read-only source: the tensor is only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(host) if len(host) else torch.zeros(1, dtype=torch.uint8)
        self.host = t  # the copy's source (registered memory is read asynchronously)
        self.tensor = t.to(device, non_blocking=True) if device.type != "cpu" else t
        STATS["copies"] += device.type != "cpu"


@dataclass
class _Blobs:
    """Descriptors of a set of entropy blobs (all log-scale blobs, or all symbol blobs)."""

    per_blob: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in (
        "crow", "rowbase", "blocks", "block", "n", "streams", "states", "heads", "kc",
        "tokens", "sink", "kbase", "vbase", "qbase", "vc", "kstep", "vstep")})
    g_blob: list[np.ndarray] = field(default_factory=list)
    g_first: list[np.ndarray] = field(default_factory=list)
    g_woff: list[np.ndarray] = field(default_factory=list)
    g_wcnt: list[np.ndarray] = field(default_factory=list)
    coded: list[np.ndarray] = field(default_factory=list)
    const_blob: list[np.ndarray] = field(default_factory=list)
    const_row: list[np.ndarray] = field(default_factory=list)
    max_n: int = 0
    ncoded: int = 0

    @property
    def groups(self) -> int:
        return sum(len(g) for g in self.g_blob)

    @property
    def consts(self) -> int:
        return sum(len(c) for c in self.const_row)


class _Tables:
    """Every blob's table rows, concatenated (rows numbered across all blobs)."""

    def __init__(self) -> None:
        self.lo: list[np.ndarray] = []
        self.width: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.rows = 0

    def add(self, lo: np.ndarray, width: np.ndarray, counts: np.ndarray) -> int:
        first = self.rows
        self.lo.append(lo.astype(np.int32))
        self.width.append(width.astype(np.int32))
        self.counts.append(counts)
        self.rows += len(lo)
        return first


def _add_blob(blobs: _Blobs, tables: _Tables, blob: memoryview, body_at: int, body: memoryview,
              streams: int, n: int, desc: dict[str, Any], where: str) -> None:
    lo, width, counts, section = parse_tables(blob, streams, n)
    if n == 0:
        return
    if section is None:
        raise InvalidArgument(f"{where}: only format-2 (rANS) entropy blobs decode on the GPU")
    if len(section) < _HDR.size:
        raise Corrupt(f"{where}: rANS section truncated")
    block, groups = _HDR.unpack_from(section, 0)
    if block == 0 or block > 1 << 20:
        raise Corrupt(f"{where}: rANS block of {block} symbols")
    coded = np.flatnonzero(width > 1)
    blocks = -(-n // block)
    nstreams = len(coded) * blocks
    if groups != -(-nstreams // rans.GROUP):
        raise Corrupt(f"{where}: rANS section declares {groups} groups for {nstreams} streams")
    need = _HDR.size + 4 * nstreams + 4 * groups
    if len(section) < need or (len(section) - need) % 2:
        raise Corrupt(f"{where}: rANS section sizes do not add up")
    gwords = np.frombuffer(section, dtype="<u4", count=groups, offset=_HDR.size + 4 * nstreams)
    if int(gwords.sum(dtype=np.int64)) * 2 != len(section) - need:
        raise Corrupt(f"{where}: rANS word counts do not match the words stored")
    rowbase = tables.add(lo, width, counts)
    index = len(blobs.per_blob["n"])
    sec_at = body_at + (_address(section) - _address(body))
    words_at = sec_at + need
    pb = blobs.per_blob
    pb["crow"].append(blobs.ncoded)
    pb["rowbase"].append(rowbase)
    pb["blocks"].append(blocks)
    pb["block"].append(block)
    pb["n"].append(n)
    pb["streams"].append(nstreams)
    pb["states"].append(sec_at + _HDR.size)
    for k, v in desc.items():
        pb[k].append(v)
    blobs.coded.append(coded.astype(np.int32) + rowbase)
    blobs.ncoded += len(coded)
    blobs.g_blob.append(np.full(groups, index, dtype=np.int32))
    blobs.g_first.append(np.arange(groups, dtype=np.int32) * rans.GROUP)
    ends = np.cumsum(gwords, dtype=np.int64)
    blobs.g_woff.append(words_at + 2 * (ends - gwords))
    blobs.g_wcnt.append(gwords.astype(np.int32))
    const = np.flatnonzero(width == 1)
    if len(const):
        blobs.const_blob.append(np.full(len(const), index, dtype=np.int32))
        blobs.const_row.append(const.astype(np.int32) + rowbase)
    blobs.max_n = max(blobs.max_n, n)


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(1, dtype)


def _blob_arrays(prefix: str, blobs: _Blobs) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in blobs.per_blob.items():
        dtype = np.float32 if k in ("kstep", "vstep") else np.int64
        out[f"{prefix}b_{k}"] = np.array(v or [0], dtype=dtype)
    out[f"{prefix}g_blob"] = _cat(blobs.g_blob, np.int32)
    out[f"{prefix}g_first"] = _cat(blobs.g_first, np.int32)
    out[f"{prefix}g_woff"] = _cat(blobs.g_woff, np.int64)
    out[f"{prefix}g_wcnt"] = _cat(blobs.g_wcnt, np.int32)
    out[f"{prefix}coded"] = _cat(blobs.coded, np.int32)
    out[f"{prefix}c_blob"] = _cat(blobs.const_blob, np.int32)
    out[f"{prefix}c_row"] = _cat(blobs.const_row, np.int32)
    return out


def _outputs(specs: list[LayerSpec], device: torch.device
             ) -> tuple[torch.Tensor, list[tuple[int, int]], torch.dtype]:
    dtypes = {s.dtype.torch for s in specs}
    if len(dtypes) != 1:
        raise InvalidArgument("layers of one decode must share a dtype")
    dt = dtypes.pop()
    bases, at = [], 0
    for s in specs:
        kn, vn = s.layout.k_numel(s.tokens), s.layout.v_numel(s.tokens)
        bases.append((at, at + kn))
        at += kn + vn
    return torch.empty(max(at, 1), dtype=dt, device=device), bases, dt


def _views(out: torch.Tensor, specs: list[LayerSpec], bases: list[tuple[int, int]]
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = []
    for s, (kb, vb) in zip(specs, bases):
        k = out[kb : kb + s.layout.k_numel(s.tokens)].view(s.k_shape)
        v = out[vb : vb + s.layout.v_numel(s.tokens)].view(s.v_shape)
        layers.append((k, v))
    return layers


# ------------------------------------------------------------------------------ kdn mode

def decode_kdn(bodies: list[memoryview], specs: list[LayerSpec],
               level_steps: list[tuple[float, float, int]], device: torch.device,
               where: str = "entry") -> Decoded:
    """``kdn`` bodies of ``specs``' layers (``level_steps``: each layer's K step, V step and
    sink tokens) on ``device``; call ``check()`` on the result before using the tensors."""
    out, bases, dt = _outputs(specs, device)
    itemsize = out.element_size()
    scales, syms, tables = _Blobs(), _Blobs(), _Tables()
    span_src: list[int] = []  # the sink tokens' bytes: where they are, where they go, size
    span_dst: list[int] = []
    span_len: list[int] = []
    sections = [unpack_sections(b, 4, f"layer {s.index}") for b, s in zip(bodies, specs)]
    source = _Source(list(bodies), device)
    qat = 0
    for i, (body, spec, (k_step, v_step, sink)) in enumerate(zip(bodies, specs, level_steps)):
        lw = f"layer {spec.index}"
        heads, kc, vc = spec.layout.kv_heads, spec.layout.k_channels, spec.layout.v_channels
        s = min(sink, spec.tokens)
        n = spec.tokens - s
        k_sink, v_sink, scale_blob, blob = sections[i]
        body_at = source.offsets[i]
        kb, vb = bases[i]
        for raw, ch, base in ((k_sink, kc, kb), (v_sink, vc, vb)):
            if len(raw) != heads * s * ch * itemsize:
                raise Corrupt(f"expected {heads * s * ch * itemsize} bytes for "
                              f"{(heads, s, ch)} {dt}, got {len(raw)}")
            at = body_at + (_address(raw) - _address(body)) if len(raw) else 0
            for h in range(heads if s * ch else 0):
                span_src.append(at + h * s * ch * itemsize)
                span_dst.append((base + h * spec.tokens * ch) * itemsize)
                span_len.append(s * ch * itemsize)
        common = {"heads": heads, "kc": kc, "vc": vc, "tokens": spec.tokens, "sink": s,
                  "kbase": kb, "vbase": vb, "qbase": qat,
                  "kstep": float(np.float32(k_step)), "vstep": float(np.float32(v_step))}
        _add_blob(scales, tables, scale_blob, body_at, body, 2, n, common, lw)
        _add_blob(syms, tables, blob, body_at, body, heads * (kc + vc), n, common, lw)
        if n and not (scales.per_blob["qbase"] and scales.per_blob["qbase"][-1] == qat):
            # log-scale rows absent (n == 0 never reaches here): nothing to dequantise with
            raise Corrupt(f"{lw}: no log-scale streams")
        qat += 2 * n
    width = _cat(tables.width, np.int32)
    host = {
        "flag": np.zeros(1, np.int32),
        "table": SCALE_TABLE.numpy(),
        "counts": _cat(tables.counts, np.uint8),
        "width": width,
        "tstart": (np.cumsum(width, dtype=np.int64) - width).astype(np.int32),
        "depth": np.ceil(np.log2(np.maximum(width, 1))).astype(np.int32),
        "lo": _cat(tables.lo, np.int32),
        "span_src": np.array(span_src or [0], np.int64),
        "span_dst": np.array(span_dst or [0], np.int64),
        "span_len": np.array(span_len or [0], np.int64),
        **_blob_arrays("s_", scales), **_blob_arrays("y_", syms),
    }
    if int(host["width"].sum(dtype=np.int64)) != len(host["counts"]) and tables.rows:
        raise Corrupt(f"{where}: entropy tables are inconsistent")
    dev = upload_many(host, device)
    STATS["copies"] += device.type != "cpu"
    bins = max(len(host["counts"]), 1)
    freq = torch.empty(bins, dtype=torch.int32, device=device)
    cum = torch.empty(bins, dtype=torch.int32, device=device)
    qout = torch.empty(max(qat, 1), dtype=torch.int32, device=device)
    sout = torch.empty(max(qat, 1), dtype=torch.float32, device=device)
    flag = dev["flag"]
    top = _TOP[dt]
    _launch(kernels.normalize, (tables.rows,), dev["counts"], dev["tstart"], dev["width"],
            freq, cum, flag, PREC=rans.PREC, BLOCK=_NORM_BLOCK)
    for prefix, blobs, dequant in (("s_", scales, False), ("y_", syms, True)):
        if blobs.consts:
            _launch(kernels.fill, (blobs.consts, -(-blobs.max_n // _FILL_BLOCK)),
                    dev[prefix + "c_blob"], dev[prefix + "c_row"],
                    *(dev[f"{prefix}b_{k}"] for k in (
                        "rowbase", "n", "heads", "kc", "vc", "tokens", "sink", "kbase", "vbase",
                        "qbase", "kstep", "vstep")),
                    dev["lo"], dev["table"], out, qout, sout, flag, top,
                    BLOCK=_FILL_BLOCK, DEQUANT=dequant)
        _launch(kernels.rans, (blobs.groups,), source.tensor,
                dev[prefix + "g_blob"], dev[prefix + "g_first"], dev[prefix + "g_woff"],
                dev[prefix + "g_wcnt"],
                *(dev[f"{prefix}b_{k}"] for k in (
                    "crow", "rowbase", "blocks", "block", "n", "streams", "states", "heads",
                    "kc", "tokens", "sink", "kbase", "vbase", "qbase", "vc", "kstep", "vstep")),
                dev[prefix + "coded"], dev["tstart"], dev["width"], dev["depth"], dev["lo"],
                cum, freq, dev["table"], out, qout, sout, flag, top,
                GROUP=rans.GROUP, PREC=rans.PREC, DEQUANT=dequant)
    _launch(kernels.spans, (len(span_src),), source.tensor, dev["span_src"], dev["span_dst"],
            dev["span_len"], out.view(torch.uint8), BLOCK=_SPAN_BLOCK)
    return Decoded(_views(out, specs, bases), flag, where,
                   keep=[source.host, source.tensor, dev, freq, cum, qout, sout])


# ------------------------------------------------------------------------------ int8 mode

def decode_int8(bodies: list[memoryview], specs: list[LayerSpec], device: torch.device,
                where: str = "entry") -> Decoded:
    """``int8`` bodies of ``specs``' layers on ``device`` in one launch (``check()`` first)."""
    out, bases, dt = _outputs(specs, device)
    source = _Source(list(bodies), device)
    scales_at, data_at, chans, numel, out_at = [], [], [], [], []
    for i, (body, spec) in enumerate(zip(bodies, specs)):
        lw = f"layer {spec.index}"
        ks, kq, vs, vq = unpack_sections(body, 4, lw)
        for sc, data, shape, base in ((ks, kq, spec.k_shape, bases[i][0]),
                                      (vs, vq, spec.v_shape, bases[i][1])):
            heads, tokens, ch = shape
            if len(sc) != 2 * heads * tokens or len(data) != heads * tokens * ch:
                raise Corrupt(f"{lw}: int8 sections have the wrong sizes for {shape}")
            if not len(data):
                continue
            at = source.offsets[i] - _address(body)
            scales_at.append(at + _address(sc))
            data_at.append(at + _address(data))
            chans.append(ch)
            numel.append(len(data))
            out_at.append(base)
    progs = [-(-n // _INT8_BLOCK) for n in numel]
    first = np.cumsum([0, *progs])[:-1]
    host: dict[str, np.ndarray] = {
            "flag": np.zeros(1, np.int32),
            "p_sec": np.repeat(np.arange(len(progs), dtype=np.int32), progs) if progs
            else np.zeros(1, np.int32),
            "p_first": np.array(first if progs else [0], np.int32),
            "s_scales": np.array(scales_at or [0], np.int64),
            "s_data": np.array(data_at or [0], np.int64),
            "s_ch": np.array(chans or [1], np.int64),
            "s_numel": np.array(numel or [0], np.int64),
            "s_out": np.array(out_at or [0], np.int64)}
    dev = upload_many(host, device)
    STATS["copies"] += device.type != "cpu"
    _launch(kernels.int8, (sum(progs),), source.tensor, dev["p_sec"], dev["p_first"],
            dev["s_scales"], dev["s_data"], dev["s_ch"], dev["s_numel"], dev["s_out"],
            out, dev["flag"], _TOP[dt], BLOCK=_INT8_BLOCK)
    return Decoded(_views(out, specs, bases), dev["flag"], where,
                   keep=[source.host, source.tensor, dev])
