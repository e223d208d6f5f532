"""Staged entries: buffers a caller fills in place and stores without the client copying them
(the store's form of a registered buffer, as Mooncake's ``put_from``).

    with client.stage(layout, tokens, start_position=0) as st:
        for (k, v), (dk, dv) in zip(st.layers, kv_on_gpu):
            k.copy_(dk)                      # on a CUDA host the segment is registered:
            v.copy_(dv)                      # a device-to-host copy lands here directly
        client.store(key, st)                # or store_many([(key, st), ...])

A staged entry is a ``raw`` entry laid out in the client's shared segment (a client on the
server's host): its container header and every frame's and record's prefix are written, and
each layer's K and V is a writable tensor viewing its body where it lies. A store sends only
where the entry lies (a PutMany item with ``seal``): the server copies it out and makes its
checksums on that copy (``kdn.codec.sealing.copy_sealed``: every frame hashed as it is copied,
every record checked against the layout), so the client neither copies nor hashes the bytes,
and nothing it writes afterwards reaches what was stored. The entry stays the caller's: filled
and stored again as often as it likes (each store is a copy of what it holds then).

Every K and V must be written before a store (a body holds whatever the segment held there).
Without a segment (another host, ``shm_bytes=0``, or no room left in it) the entry lies in the
client's own memory and a store seals it there (one pass over it) and sends it as any entry;
so does a client with an in-process tier (the tier keeps the sealed bytes). ``close`` (or the
``with`` block's end) gives the region back once no tensor of it is left.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from kdn.cache import MAX_POSITION
from kdn.codec import inplace
from kdn.codec.api import frame_spans
from kdn.codec.format import (
    FRAME_PREFIX_BYTES,
    RECORD_BYTES,
    EncodedParts,
    Header,
    build_header,
    frame_prefix,
    parse_header,
    record_prefix,
)
from kdn.codec.layouts import layout_to_proto
from kdn.codec.modes import get_mode
from kdn.codec.sealing import seal_in_place
from kdn.errors import InvalidArgument
from kdn.layout import KVLayout
from kdn.transport.regions import ALIGN
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.cache import KVCache

FRAME_ALIGN = 64
"""The first frame of a staged entry starts at a multiple of this (tensors view its bodies)."""
UNSEALED = (1 << 64) - 1
"""Every frame's sum until the entry is sealed (a fixed-width field, but one a header leaves
out when it is zero: a sealed header must have the length of the unsealed one)."""


def skeleton(layout: KVLayout, tokens: int, start_position: int = 0
             ) -> tuple[bytes, list[tuple[int, bytes]], int]:
    """What a ``raw`` entry of ``tokens`` tokens of ``layout`` holds besides its bodies: its
    header (frame sums ``UNSEALED``), the (offset from the first frame, bytes) of every frame and
    record prefix, and the bytes of all its frames. The frames are sized as ``encode_parts``
    sizes them (``layers_per_frame=0``), so a sealed staged entry is byte for byte what
    ``encode_parts(kv, "raw", layers_per_frame=0)`` writes for the same tensors."""
    if not isinstance(layout, KVLayout):
        raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise InvalidArgument(f"a staged entry needs a whole number of tokens, at least one, "
                              f"got {tokens!r}")
    if (isinstance(start_position, bool) or not isinstance(start_position, int)
            or not 0 <= start_position <= MAX_POSITION):
        raise InvalidArgument(f"start_position must be a whole number in [0, 2**63), got "
                              f"{start_position!r}")
    if start_position + tokens - 1 > MAX_POSITION:
        raise InvalidArgument(f"start_position {start_position} with {tokens} tokens puts the "
                              f"last past the largest position, 2**63 - 1")
    plan = _plan(layout, tokens)
    return _header(layout, tokens, start_position), plan.prefixes, plan.frames_bytes


@functools.lru_cache(maxsize=4096)
def _header(layout: KVLayout, tokens: int, start_position: int) -> bytes:
    """The unsealed header of a staged entry; memoised, as an engine's chunks start at a few
    positions over and over (chunk i of every prompt at i times the chunk size)."""
    entry = pb.EntryHeader()
    entry.ParseFromString(_plan(layout, tokens).entry)
    entry.start_position = start_position
    return build_header(entry)


class _Plan(NamedTuple):
    entry: bytes
    """The entry header (its start position 0), serialized."""
    prefixes: list[tuple[int, bytes]]
    frames_bytes: int
    bodies: list[tuple[int, int]]
    """Per layer: (offset of its body from the first frame, bytes of its K)."""
    copies: tuple[tuple[int, int], ...]
    """Per K then V of every layer, in layer order: (offset from the first frame, bytes)."""


@functools.lru_cache(maxsize=64)
def _plan(layout: KVLayout, tokens: int) -> _Plan:
    """``skeleton``'s parts that do not depend on the start position, per (layout, tokens)."""
    size = layout.dtype.itemsize
    bodies = [(lay.k_numel(tokens) + lay.v_numel(tokens)) * size for lay in layout.layers]
    spans = frame_spans([RECORD_BYTES + b for b in bodies], 0)
    codec = get_mode("raw")
    entry = pb.EntryHeader(
        layout=layout_to_proto(layout), codec=pb.Codec(mode="raw", level="",
                                                       params=codec.params("")),
        tokens=tokens, start_position=0,
        frames=[pb.FrameSpan(first_layer=f, num_layers=n, checksum=UNSEALED)
                for f, n in spans],
        layout_fingerprint=layout.fingerprint)
    prefixes: list[tuple[int, bytes]] = []
    at_body: list[tuple[int, int]] = []
    off = 0
    for index, (first, count) in enumerate(spans):
        length = sum(RECORD_BYTES + bodies[layer] for layer in range(first, first + count))
        prefixes.append((off, frame_prefix(index, first, count, length, UNSEALED)))
        at = off + FRAME_PREFIX_BYTES
        for layer in range(first, first + count):
            prefixes.append((at, record_prefix(layout.layers[layer], tokens, bodies[layer])))
            at_body.append((at + RECORD_BYTES, layout.layers[layer].k_numel(tokens) * size))
            at += RECORD_BYTES + bodies[layer]
        off = at
    copies = tuple(c for (at, nk), lay in zip(at_body, layout.layers)
                   for c in ((at, nk), (at + nk, lay.v_numel(tokens) * size)))
    return _Plan(entry.SerializeToString(), prefixes, off, at_body, copies)


def _copy_bytes(dst: np.ndarray[Any, Any], src: torch.Tensor) -> None:
    """``src``'s bytes (a CPU tensor; in its logical order) into ``dst`` (contiguous bytes)."""
    if src.dim() and src.stride(-1) == 1:
        raw = src.view(torch.uint8).numpy()
        np.copyto(dst.reshape(raw.shape), raw)
    else:  # a transposed or scalar tensor: made contiguous first
        np.copyto(dst, src.contiguous().view(-1).view(torch.uint8).numpy())


class Staged:
    """One staged entry (module docstring): ``layers`` (K, V) of every layer, writable."""

    def __init__(self, layout: KVLayout, tokens: int, start_position: int = 0,
                 segment: Any = None, *, own_memory: bool = True, tensors: bool = True
                 ) -> None:
        """``own_memory``: without room in ``segment`` (or without one) the entry lies in
        this process's memory; False: it is then made closed, holding nothing. ``tensors``:
        False makes no K and V tensors (``layers`` stays empty): the entry is filled by
        ``write`` (any dtype then: its bodies need not lie aligned for tensors)."""
        head, prefixes, frames_bytes = skeleton(layout, tokens, start_position)
        self.layout, self.tokens, self.start_position = layout, tokens, start_position
        self.nbytes = len(head) + frames_bytes
        self.segment: Any = None
        self.offset = 0
        """Where the container starts in ``segment`` (when staged there)."""
        room = self.nbytes + FRAME_ALIGN
        start = segment.regions.alloc(room) if segment is not None else None
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if start is None and not own_memory:
            return
        if start is not None:
            pad = (-(start + len(head))) % FRAME_ALIGN
            region = segment.owned(start, room)  # freed once no view of it is left
            self.segment, self.offset, self._start = segment, start + pad, start
            self._view = region[pad : pad + self.nbytes]
        else:  # the client's own memory, its first frame aligned all the same
            own = np.empty(room + ALIGN, dtype=np.uint8)
            pad = (-(own.ctypes.data + len(head))) % FRAME_ALIGN
            self._view = memoryview(own[pad : pad + self.nbytes])  # type: ignore[arg-type]
        view = self._view
        view[: len(head)] = head
        for off, raw in prefixes:
            at = len(head) + off
            view[at : at + len(raw)] = raw
        self._head = len(head)
        if not tensors:
            return
        header = parse_header(head)
        views = inplace.views(header, self._view)
        if views is None:  # the container's prefixes leave some bodies unaligned for it
            self.close()
            raise InvalidArgument(
                f"a raw entry of {layout.dtype.value} KV can not be staged: its bodies do not "
                "lie aligned for tensors of that dtype in the container (2-byte dtypes do); "
                "store it with store() or store_many()")
        self.layers = list(views)

    def write(self, kv: KVCache) -> None:
        """Copy the bodies of ``kv`` (on the CPU, of this entry's layout and tokens) into
        place: each contiguous K and V one ``memmove`` of its bytes (one thread, the GIL free;
        torch would split each over its intra-op threads, which on a busy host wait for each
        other; a numpy copy costs ~4 µs of Python a tensor, a 1 MiB entry of 64 tensors more
        than its bytes), any other one numpy copy. Raises InvalidArgument for a cache of
        another layout or token count, or a tensor not on the CPU or not of its layer's size
        (nothing outside the entry is written)."""
        self._check_open()
        if kv.layout is not self.layout and kv.layout != self.layout:
            raise InvalidArgument(f"write of a cache of layout {kv.layout.fingerprint} into a "
                                  f"staged entry of layout {self.layout.fingerprint}")
        if len(kv.layers) != self.layout.num_layers or kv.num_tokens != self.tokens:
            raise InvalidArgument(f"write of a cache of {len(kv.layers)} layers x "
                                  f"{kv.num_tokens} tokens into a staged entry of "
                                  f"{self.layout.num_layers} x {self.tokens}")
        copies = _plan(self.layout, self.tokens).copies
        base = self._address + self._head
        memmove = ctypes.memmove
        for i, (k, v) in enumerate(kv.layers):
            for t, (at, n) in ((k, copies[2 * i]), (v, copies[2 * i + 1])):
                if t.is_cpu and t.nbytes == n and t.is_contiguous():
                    memmove(base + at, t.data_ptr(), n)
                else:
                    self._copy_other(i, t, at, n)

    def _copy_other(self, layer: int, t: torch.Tensor, at: int, n: int) -> None:
        """``write``'s copy of a tensor ``memmove`` does not take (checked here)."""
        if not t.is_cpu:
            raise InvalidArgument(f"layer {layer}: write of a tensor on {t.device}; "
                                  "a staged entry is written from the CPU")
        if t.nbytes != n:
            raise InvalidArgument(f"layer {layer}: a tensor of {t.nbytes} bytes where the "
                                  f"entry's layout and tokens take {n}")
        lo = self._head + at
        _copy_bytes(np.frombuffer(self._view, dtype=np.uint8)[lo : lo + n], t)

    @functools.cached_property
    def _address(self) -> int:
        """Where the entry's first byte lies in this process's memory."""
        return int(np.frombuffer(self._view, dtype=np.uint8).ctypes.data)

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not hasattr(self, "_view")

    def region(self, segment: Any) -> tuple[int, int] | None:
        """(offset, length) of the entry in ``segment`` when it is staged there and open."""
        if self.closed or segment is None or self.segment is not segment:
            return None
        return self.offset, self.nbytes

    def lend(self, segment: Any) -> InFlight | None:
        """The entry named by a store sent and not answered yet (``region``: where it lies),
        its region kept from being given back until that answer comes, even where the entry is
        closed meanwhile; None when it is not staged in ``segment`` and open."""
        at = self.region(segment)
        return None if at is None else InFlight(self, segment, self._start, self._view, at)

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("store of a staged entry that was closed")

    def sealed(self) -> EncodedParts:
        """The entry with its checksums made on its bytes as they are now, written in place
        (for a store that sends the bytes: no segment, an in-process tier): header and
        frames as views of the staged bytes."""
        self._check_open()
        header: Header = seal_in_place(self._view)
        frames, off = [], self._head
        for _ in header.spans:
            n = FRAME_PREFIX_BYTES + int.from_bytes(self._view[off + 8 : off + 12], "little")
            frames.append(self._view[off : off + n])
            off += n
        return EncodedParts(bytes(self._view[: self._head]), frames)  # type: ignore[arg-type]

    def retire(self) -> None:
        """A store of this entry went unanswered (the server may still read its region):
        the region is never given back, and the entry is closed (``close``), so that nothing
        else is stored from those bytes."""
        if not self.closed and self.segment is not None:
            self.segment.retire_owned(self._start)
        self.close()

    def close(self) -> None:
        """Give the region back (once no tensor of it is left); the entry can not be stored
        again."""
        if not self.closed:
            del self._view
            self.layers = []
            self.segment = None


class InFlight(NamedTuple):
    """A staged entry named by a store not answered yet (``Staged.lend``): ``view`` keeps its
    region from being given back (a ``close`` meanwhile frees it once the answer is read and
    this is dropped); ``lost`` where no answer will come."""

    staged: Staged
    segment: Any
    start: int
    view: memoryview
    region: tuple[int, int]
    """(offset, length) of the entry in its segment."""

    def lost(self) -> None:
        """The store went unanswered (the server may still read the region): the region is
        retired, not given back (``SharedSegment.retire_owned``), and the entry is closed,
        as ``Staged.retire``, closed or not by then."""
        self.segment.retire_owned(self.start)
        self.staged.close()
