"""Every layer of a ``raw`` entry as tensors viewing its bytes where they lie, in one step.

A ``raw`` body is the layer's K bytes then its V bytes, so once the bytes are trusted the
tensors are views at offsets that follow from the header alone. Decoding frame by frame pays a
record walk, two buffer wraps and a shape check per layer in Python (about 14 µs a layer, more
than the copy of a 1 MiB entry); here an entry costs one wrap of its frames and one
``as_strided`` per tensor, from a ``Plan`` memoised on the header's bytes.

What is still checked on every call: every prefix byte the header implies (each frame's magic,
index, layers, length and sum; each record's shape and body length) is compared with the bytes
(one numpy gather). Checksums are not computed here: the caller uses this only for bytes whose
sums were verified in place already (``StreamDecoder(checked=True)``: the server hashed them
right after writing them into the client's segment). Anything that does not match the plan
(another version or mode, an unaligned body, a prefix byte off) gets None, and the caller
decodes frame by frame, which names the problem.
"""

from __future__ import annotations

import itertools
import struct
import warnings
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from kdn.codec.copies import copy_checked
from kdn.codec.format import (
    FRAME_PREFIX_BYTES,
    Header,
    check_frame_prefix,
    frame_prefix,
    record_prefix,
)
from kdn.codec.layouts import BoundedMemo
from kdn.transport.buffers import RECEIVED

_PLANS: BoundedMemo[tuple[str, int, tuple[tuple[int, int], ...]], Plan | None] = \
    BoundedMemo(256)  # None too: entries of that shape have no plan
_SUM = np.dtype("<u4")
_ALIGN = 64
BUFFERS = RECEIVED
"""Where decoded copies of verbatim entries live (``copied``, ``StreamDecoder``'s arena)."""


@dataclass(frozen=True)
class Plan:
    """Where everything of one shape of entry lies (layout, tokens, frame spans), counted from
    its first frame. Frame sums differ from entry to entry: only their places are here."""

    frames_bytes: int
    """Bytes of all the frames together (the container is header + this)."""
    positions: np.ndarray
    """Offsets of every prefix byte the shape implies (frame and record prefixes, sums aside)."""
    expected: np.ndarray
    """Those bytes."""
    expected_bytes: bytes
    """The same, as bytes."""
    checked_positions: np.ndarray
    """``positions`` then ``sum_positions``: one gather compared with ``expected_bytes`` and
    the header's sums."""
    sum_positions: np.ndarray
    """Offsets of the 4 sum bytes of each frame's prefix (they hold the header's sums)."""
    tensors: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    """(shape, stride, element offset) of K then V of each layer, in layer order."""
    dtype: torch.dtype
    itemsize: int


@dataclass(frozen=True)
class Span:
    """What every layer of an entry viewed in place views: ``base``, one flat tensor over all
    its frames, and each K and V tensor's (shape, stride, element offset) in it, in layer
    order. A copy of ``base`` to a device viewed with the same ``specs`` is every layer there
    in one transfer (``kdn.client.stream``), with no host view made or walked to find it."""

    base: torch.Tensor
    specs: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]

    def views(self) -> EntryViews:
        return EntryViews(self)


class EntryViews(list[tuple[torch.Tensor, torch.Tensor]]):
    """(K, V) of every layer (``views``), and the ``span`` they view."""

    def __init__(self, span: Span) -> None:
        t = [span.base.as_strided(shape, stride, at) for shape, stride, at in span.specs]
        super().__init__(zip(t[0::2], t[1::2]))
        self.span = span


def _contiguous(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    return (shape[1] * shape[2], shape[2], 1)


def _build(header: Header) -> Plan | None:
    layout, tokens = header.layout, header.tokens
    size = layout.dtype.itemsize
    positions: list[range] = []
    sums: list[range] = []
    expected: list[bytes] = []
    tensors: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    off = 0
    for index, (first, count) in enumerate(header.spans):
        lays = layout.layers[first : first + count]
        bodies = [(lay.k_numel(tokens), lay.v_numel(tokens)) for lay in lays]
        records = [record_prefix(lay, tokens, (nk + nv) * size)
                   for lay, (nk, nv) in zip(lays, bodies)]
        length = sum(len(r) + (nk + nv) * size for r, (nk, nv) in zip(records, bodies))
        pre = frame_prefix(index, first, count, length, 0)
        positions.append(range(off, off + len(pre) - _SUM.itemsize))
        expected.append(pre[: -_SUM.itemsize])
        sums.append(range(off + len(pre) - _SUM.itemsize, off + len(pre)))
        at = off + FRAME_PREFIX_BYTES
        for lay, rec, (nk, nv) in zip(lays, records, bodies):
            positions.append(range(at, at + len(rec)))
            expected.append(rec)
            at += len(rec)
            if at % size:
                return None  # a body no tensor of this dtype can view in place
            k_shape = (lay.kv_heads, tokens, lay.k_channels)
            v_shape = (lay.kv_heads, tokens, lay.v_channels)
            tensors.append((k_shape, _contiguous(k_shape), at // size))
            tensors.append((v_shape, _contiguous(v_shape), at // size + nk))
            at += (nk + nv) * size
        off += FRAME_PREFIX_BYTES + length
    at_prefixes = np.fromiter(itertools.chain.from_iterable(positions), dtype=np.int64)
    at_sums = np.fromiter(itertools.chain.from_iterable(sums), dtype=np.int64)
    return Plan(off, at_prefixes, np.frombuffer(b"".join(expected), dtype=np.uint8),
                b"".join(expected), np.concatenate([at_prefixes, at_sums]), at_sums,
                tuple(tensors), layout.dtype.torch, size)


def plan(header: Header) -> Plan | None:
    """The plan of ``header``'s entry; None unless it is a version-2 ``raw`` entry whose
    bodies lie aligned for its dtype. Memoised on the entry's shape."""
    if header.mode != "raw" or header.version < 2:
        return None
    key = (header.layout.fingerprint, header.tokens, tuple(header.spans))
    if key in _PLANS:
        return _PLANS.get(key)
    got = _build(header)
    _PLANS.put(key, got)
    return got


@dataclass(frozen=True)
class FramePlan:
    """``Plan`` for an entry whose frames lie apart (each in the message it came in): per
    frame its length, the 12 prefix bytes before its sum and its records' prefixes (offset in
    the frame, bytes); per K and V tensor, in layer order, its frame, byte offset, element count
    and shape."""

    frames: tuple[tuple[int, bytes, tuple[tuple[int, bytes], ...]], ...]
    tensors: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    dtype: torch.dtype
    itemsize: int


_FRAME_PLANS: BoundedMemo[tuple[str, int, tuple[tuple[int, int], ...]], FramePlan | None] = \
    BoundedMemo(256)


def _build_frames(header: Header) -> FramePlan | None:
    layout, tokens = header.layout, header.tokens
    size = layout.dtype.itemsize
    frames: list[tuple[int, bytes, tuple[tuple[int, bytes], ...]]] = []
    tensors: list[tuple[int, int, int, tuple[int, ...]]] = []
    for index, (first, count) in enumerate(header.spans):
        lays = layout.layers[first : first + count]
        at, recs = FRAME_PREFIX_BYTES, []
        for lay in lays:
            nk, nv = lay.k_numel(tokens), lay.v_numel(tokens)
            rec = record_prefix(lay, tokens, (nk + nv) * size)
            recs.append((at, rec))
            at += len(rec)
            if at % size:
                return None  # a body no tensor of this dtype can view where its frame lies
            tensors.append((index, at, nk, (lay.kv_heads, tokens, lay.k_channels)))
            tensors.append((index, at + nk * size, nv, (lay.kv_heads, tokens, lay.v_channels)))
            at += (nk + nv) * size
        pre = frame_prefix(index, first, count, at - FRAME_PREFIX_BYTES, 0)
        frames.append((at, pre[: FRAME_PREFIX_BYTES - _SUM.itemsize], tuple(recs)))
    return FramePlan(tuple(frames), tuple(tensors), layout.dtype.torch, size)


def frame_views(header: Header, frames: Sequence[memoryview]
                ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(K, V) of every layer of a ``raw`` entry whose frames lie apart, as views of the frames
    (read-only ones too: the caller's to hand out, ``StreamDecoder.private``), their checksums
    verified already. Every prefix byte the header implies, sums aside, is compared with the
    frames first; None where anything differs from the plan, a frame is not aligned for the
    dtype, or the entry has no plan: decode frame by frame then, which names the problem.
    About 10 µs a layer where decoding frame by frame took 45."""
    if header.mode != "raw" or header.version < 2:
        return None
    key = (header.layout.fingerprint, header.tokens, tuple(header.spans))
    if key in _FRAME_PLANS:
        p = _FRAME_PLANS.get(key)
    else:
        p = _build_frames(header)
        _FRAME_PLANS.put(key, p)
    if p is None or len(frames) != len(p.frames):
        return None
    for frame, (length, pre, recs) in zip(frames, p.frames):
        if len(frame) != length or frame[: len(pre)] != pre or \
                any(frame[at : at + len(rec)] != rec for at, rec in recs):
            return None
    with warnings.catch_warnings():  # read-only frames: torch says it can not protect them
        warnings.simplefilter("ignore", UserWarning)
        t = [torch.frombuffer(frames[i], dtype=p.dtype, count=n, offset=at).view(shape)
             for i, at, n, shape in p.tensors]
    if any(x.data_ptr() % p.itemsize for x in t):
        return None
    return list(zip(t[0::2], t[1::2]))


def views(header: Header, container: memoryview, *, readonly: bool = False
          ) -> EntryViews | None:
    """(K, V) of every layer of the entry ``container`` holds (header then frames, writable,
    checksums already verified on these bytes), viewing it in place; None where the bytes do
    not follow the plan (module docstring). ``readonly``: ``container`` may be read-only (the
    tensors are then copy sources only: ``verified_views``)."""
    got = span(header, container, readonly=readonly)
    return None if got is None else got.views()


def span(header: Header, container: memoryview, *, readonly: bool = False) -> Span | None:
    """``views`` without making them: the span they would view (every check done)."""
    return _span(plan(header), header, container, readonly)


def _span(p: Plan | None, header: Header, container: memoryview, readonly: bool,
          aligned: bool = False) -> Span | None:
    """``span`` with the plan looked up already; ``aligned``: the caller placed the frames
    itself (``copied``), the alignment is not looked up again."""
    head = len(header.raw)
    if p is None or not p.frames_bytes or container.readonly and not readonly or \
            len(container) != head + p.frames_bytes:
        return None
    arr = np.frombuffer(container, dtype=np.uint8, offset=head)
    frames = header.entry.frames
    sums = struct.pack(f"<{len(frames)}L", *(s.checksum & 0xFFFFFFFF for s in frames))
    if not aligned and arr.ctypes.data % p.itemsize or \
            arr[p.checked_positions].tobytes() != p.expected_bytes + sums:
        return None
    if not container.readonly:
        base = torch.frombuffer(container, dtype=p.dtype, count=p.frames_bytes // p.itemsize,
                                offset=head)
        return Span(base, p.tensors)
    with warnings.catch_warnings():  # read-only bytes (``readonly``): torch says it can not
        warnings.simplefilter("ignore", UserWarning)  # protect them; nothing writes them here
        base = torch.frombuffer(container, dtype=p.dtype, count=p.frames_bytes // p.itemsize,
                                offset=head)
    return Span(base, p.tensors)


def copied(header: Header, container: bytes | memoryview, pool: Executor | None = None,
           verify: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``views`` of a copy of ``container`` in fresh memory (frames 64-byte aligned), every
    frame's checksum verified on the copy as it is made (``copy_checked``, one pass; a large
    entry on two of ``pool``'s workers); None where the entry has no plan. Raises
    Corrupt/Truncated for damaged bytes. ``verify=False``: bytes checked already (the
    in-process tier's, checked when they entered it), copied without hashing; the frame
    prefixes are still compared with the plan (``views``)."""
    p = plan(header)
    if p is None:
        return None
    head = len(header.raw)
    room = BUFFERS.take(len(container) + _ALIGN)
    start = -(room.ctypes.data + head) % _ALIGN
    # a slice of the memoryview keeps ``room`` (the array the pool watches) alive; a numpy
    # slice of ``room`` would keep only the pool's base array, and the buffer would go back
    # to the pool while the tensors still view it (kdn.transport.buffers)
    dst = memoryview(room)[start : start + len(container)]  # type: ignore[arg-type]
    if verify:
        copy_checked(dst, container, pool=pool, workers=2)
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(container, dtype=np.uint8))
    got = _span(p, header, dst, False, aligned=True)
    return None if got is None else got.views()


def verified_views(header: Header, frames: Sequence[memoryview], container: memoryview, *,
                   readonly: bool = True) -> EntryViews | None:
    """``verified_span``'s views."""
    got = verified_span(header, frames, container, readonly=readonly)
    return None if got is None else got.views()


def verified_span(header: Header, frames: Sequence[memoryview], container: memoryview, *,
                  readonly: bool = True) -> Span | None:
    """The ``span`` of an entry after every frame's checksum is verified where it lies
    (``frames``: the container's frame views). ``readonly``: bytes this process must not
    change (the in-process tier's pinned copy): the sources of copies to a device, never
    handed to a caller, so the one copy a hit makes is the host-to-device transfer; else a
    buffer that is the caller's (a received stream's). None where the entry has no plan;
    raises Corrupt or Truncated for damaged bytes."""
    if plan(header) is None or len(frames) != len(header.entry.frames):
        return None
    for i, frame in enumerate(frames):
        check_frame_prefix(header, i, frame)  # the frame's sum over its bytes, and its place
    return span(header, container, readonly=readonly)
