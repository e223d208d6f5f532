"""The container format of an encoded KV cache: a checksummed header, then independent frames.

    container header  = b"KDNC" | u16 version | u16 flags | u32 n | EntryHeader proto (n bytes)
                        | u64 xxh3_64 of all the bytes before it
    frame             = prefix | payload
    prefix (16 bytes) = b"KF" | u16 frame index | u16 first layer | u16 layer count
                        | u32 payload length | u32 checksum (low 32 bits of the frame sum)
    frame sum         = xxh3_64 over the first 12 prefix bytes + payload, seeded (see below)
    payload           = one record per layer of the frame:
                        u16 kv_heads | u32 tokens | u16 k_channels | u16 v_channels
                        | u32 body length | body (mode-specific bytes)

What each checksum covers:

- The header checksum covers every header byte: layout, codec, token count, the frame spans and
  (version 2) every frame's full 64-bit sum.
- Version 2 (written now): frame sums are seeded with a constant and the header lists each
  frame's full sum (``FrameSpan.checksum``). A frame is accepted only where its own sum, the
  prefix's low 32 bits and the header's entry for its index all agree: a flipped bit, a frame
  moved to another position, and a frame of another entry (even one of the same layout and
  length, whose header is otherwise byte-identical) are all detected, on store, on every read,
  by a reader that checks frame by frame as layers stream in, and by ``kdn admin verify``.
- Version 1 (still read): frame sums are seeded with the header checksum and the header lists
  none, so a frame is bound to its position and to a header, not to an entry: two entries of
  one layout and length share a header, and their frames can be exchanged unnoticed. Rewrite
  such entries (``kdn admin`` export and import, or store them again) to get the binding.

Layer records declare their shapes, so a receiver (the server included) checks shapes against
the layout without decoding tensors.

This module knows nothing about how a mode turns tensors into bodies; see ``kdn.codec.modes``.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import xxhash

from kdn.codec.layouts import BoundedMemo, check_layer_bytes, layout_of
from kdn.errors import Corrupt, InvalidArgument, InvalidLayout, Truncated
from kdn.layout import MAX_POSITION, KVLayout, LayerLayout
from kdn.pools import SharedPool
from kdn.v1 import kdn_pb2 as pb

MAGIC = b"KDNC"
FRAME_MAGIC = b"KF"
VERSION = 2
"""The version written. Readers take ``READABLE`` ones."""
READABLE = (1, 2)
FRAME_SEED = 0x6B646E32_66726D31
"""Seed of every version-2 frame sum (the header lists the sums: the binding is there)."""
_HEAD = struct.Struct("<4sHHI")  # magic, version, flags, header length
HEAD_PREFIX_BYTES = _HEAD.size  # a container's fixed prefix: enough for ``header_size``
_HEAD_SUM = struct.Struct("<Q")
FRAME_STRUCT = struct.Struct("<2sHHHIL")  # magic, index, first layer, layer count, payload len, sum
_RECORD = struct.Struct("<HIHHI")  # kv_heads, tokens, k_channels, v_channels, body len
FRAME_PREFIX_BYTES = FRAME_STRUCT.size
RECORD_BYTES = _RECORD.size
MAX_HEADER_BYTES = 1 << 20


# ------------------------------------------------------------------ header


@dataclass(frozen=True)
class Header:
    """A parsed, checksum-verified container header."""

    raw: bytes
    """The container header's bytes exactly as stored (magic through checksum)."""
    entry: pb.EntryHeader
    layout: KVLayout
    checksum: int
    version: int = VERSION

    @property
    def frame_seed(self) -> int:
        """The seed of this container's frame sums (module docstring)."""
        return FRAME_SEED if self.version >= 2 else self.checksum

    @property
    def tokens(self) -> int:
        return int(self.entry.tokens)

    @property
    def mode(self) -> str:
        return self.entry.codec.mode

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(f.first_layer, f.num_layers) for f in self.entry.frames]

    @functools.cached_property
    def record_shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """Each layer's (kv_heads, tokens, k_channels, v_channels), as its record in a frame
        must declare them (``check_frame``)."""
        key = (self.layout.fingerprint, self.tokens)  # a str hashed once, not the layers
        shapes = _RECORD_SHAPES.get(key)
        if shapes is None:
            shapes = tuple((lay.kv_heads, self.tokens, lay.k_channels, lay.v_channels)
                           for lay in self.layout.layers)
            _RECORD_SHAPES.put(key, shapes)
        return shapes


_RECORD_SHAPES: BoundedMemo[tuple[str, int], tuple[tuple[int, int, int, int], ...]] = \
    BoundedMemo(1024)
"""``Header.record_shapes`` by (layout fingerprint, tokens): every header of one layout and
length asks the same. Keyed by the fingerprint (a string that keeps its hash), not by the
layers: hashing 30 layer layouts cost ~45 us an entry, a fifth of a StoreMany's checks."""


def build_header(entry: pb.EntryHeader, version: int = VERSION) -> bytes:
    """The container header of ``entry`` (version 2: its spans carry the frame sums)."""
    if version not in READABLE:
        raise InvalidArgument(f"unknown container version {version}")
    body = entry.SerializeToString(deterministic=True)
    head = _HEAD.pack(MAGIC, version, 0, len(body)) + body
    return head + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(head))


def header_size(buf: bytes | memoryview) -> int:
    """Bytes the container header occupies, from its fixed prefix (raises if truncated)."""
    if len(buf) < _HEAD.size:
        raise Truncated(f"container header truncated: {len(buf)} bytes < {_HEAD.size}")
    magic, version, _flags, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise Corrupt(f"bad magic {bytes(magic)!r}; not a kdn container")
    if n > MAX_HEADER_BYTES:
        raise Corrupt(f"container header declares {n} bytes (limit {MAX_HEADER_BYTES})")
    size = _HEAD.size + n + _HEAD_SUM.size
    if version not in READABLE:  # a newer kdn's, or a damaged one: the checksum tells
        if len(buf) >= size and xxhash.xxh3_64_intdigest(bytes(buf[: size - _HEAD_SUM.size])) \
                != _HEAD_SUM.unpack_from(buf, size - _HEAD_SUM.size)[0]:
            raise Corrupt(f"container header checksum mismatch (it reads as version {version})")
        raise InvalidArgument(f"unsupported container version {version} (this kdn reads "
                              f"{', '.join(map(str, READABLE))})")
    return size


_HEADERS: BoundedMemo[bytes, tuple[KVLayout, int, int, int]] = BoundedMemo(4096)
"""Headers already verified, by their exact bytes: (layout, checksum, version, tokens)."""


def parse_header(buf: bytes | memoryview) -> Header:
    """Verify and decode the container header at the start of ``buf``.

    The checks are memoised on the header's exact bytes (their outcome is a pure function of
    them): one entry's header is parsed several times on its way from a tier to a tensor (the
    server's layout check and copy, the client's container split and decoder). Every call still
    returns its own ``entry`` message: a caller may change it without touching another's."""
    size = header_size(buf)
    if len(buf) < size:
        raise Truncated(f"container header truncated: {len(buf)} bytes < {size}")
    raw = bytes(buf[:size])
    known = _HEADERS.get(raw)
    if known is not None:
        entry = pb.EntryHeader()
        entry.ParseFromString(raw[_HEAD.size : size - _HEAD_SUM.size])
        return Header(raw=raw, entry=entry, layout=known[0], checksum=known[1],
                      version=known[2])
    (want,) = _HEAD_SUM.unpack_from(raw, size - _HEAD_SUM.size)
    got = xxhash.xxh3_64_intdigest(raw[: size - _HEAD_SUM.size])
    if got != want:
        raise Corrupt("container header checksum mismatch")
    entry = pb.EntryHeader()
    try:
        entry.ParseFromString(raw[_HEAD.size : size - _HEAD_SUM.size])
    except Exception as exc:  # protobuf raises DecodeError, a bare Exception subclass
        raise Corrupt(f"container header does not parse: {exc}") from exc
    layout = layout_of(entry.layout)
    check_layer_bytes(layout, entry.tokens)  # the layer limit (MAX_LAYER_BYTES)
    _check_fields(entry, layout)
    if entry.layout_fingerprint != layout.fingerprint:
        raise InvalidLayout("container header layout fingerprint does not match its layout")
    _check_spans(entry, layout)
    version = _HEAD.unpack_from(raw, 0)[1]
    _HEADERS.put(raw, (layout, want, version, entry.tokens))
    return Header(raw=raw, entry=entry, layout=layout, checksum=want, version=version)


def sealed_header(header: Header, raw: bytes) -> Header:
    """The ``Header`` of ``raw``, which ``build_header`` just made of ``header.entry`` (a
    parsed header whose frame sums were filled in: ``kdn.codec.sealing``), without parsing it
    again: the sums are the only change, and they bear on none of ``parse_header``'s checks.
    Remembered as verified, as a parse would."""
    (checksum,) = _HEAD_SUM.unpack_from(raw, len(raw) - _HEAD_SUM.size)
    _HEADERS.put(raw, (header.layout, checksum, header.version, header.entry.tokens))
    return Header(raw=raw, entry=header.entry, layout=header.layout, checksum=checksum,
                  version=header.version)


def header_shape(buf: bytes | memoryview) -> tuple[KVLayout, int]:
    """The layout and tokens of the verified container header at the start of ``buf``
    (``parse_header`` without building its entry message when these bytes were verified
    before)."""
    size = header_size(buf)
    known = _HEADERS.get(bytes(buf[:size])) if len(buf) >= size else None
    if known is not None:
        return known[0], known[3]
    header = parse_header(buf)
    return header.layout, header.entry.tokens


def _check_fields(entry: pb.EntryHeader, layout: KVLayout) -> None:
    """InvalidLayout for a header whose shapes the frames' fields can not hold (a record's
    heads and channels are 16-bit, its tokens 32-bit; frame indices and layers 16-bit), or
    whose tokens' positions pass ``MAX_POSITION`` (int64: no ``KVCache`` may hold them)."""
    start = entry.start_position
    if start + max(entry.tokens, 1) - 1 > MAX_POSITION:  # (a start past it, too)
        raise InvalidLayout(f"container header declares start_position {start} and "
                            f"{entry.tokens} tokens: positions must stay within [0, 2**63)")
    if entry.tokens > 0xFFFFFFFF or len(entry.frames) > 0xFFFF or layout.num_layers > 0xFFFF:
        raise InvalidLayout(f"container header declares {entry.tokens} tokens, "
                            f"{len(entry.frames)} frames, {layout.num_layers} layers: more "
                            "than a frame's fields hold")
    for i, lay in enumerate(layout.layers):
        if max(lay.kv_heads, lay.k_channels, lay.v_channels) > 0xFFFF:
            raise InvalidLayout(f"layer {i} declares heads={lay.kv_heads} k={lay.k_channels} "
                                f"v={lay.v_channels}: more than a record's 16-bit fields hold")


def _check_spans(entry: pb.EntryHeader, layout: KVLayout) -> None:
    nxt = 0
    for i, f in enumerate(entry.frames):
        if f.first_layer != nxt or f.num_layers == 0:
            raise InvalidLayout(
                f"frame {i} covers layers [{f.first_layer}, {f.first_layer + f.num_layers}); "
                f"expected to start at layer {nxt} with at least one layer"
            )
        nxt += f.num_layers
    if nxt != layout.num_layers:
        raise InvalidLayout(f"frames cover {nxt} layers, layout has {layout.num_layers}")


# ------------------------------------------------------------------ frames


def frame_sum(seed: int, prefix12: bytes | memoryview, payload: bytes | memoryview) -> int:
    """The full 64-bit sum of a frame (its prefix holds the low 32 bits)."""
    h = xxhash.xxh3_64(seed=seed)
    h.update(prefix12)
    h.update(payload)
    return h.intdigest()


Buffer = bytes | memoryview


def frame_with_sum(seed: int, index: int, first_layer: int,
                   records: list[list[Buffer]] | list[bytes], *,
                   lead: Callable[[int], bytes] | None = None) -> tuple[bytes, int]:
    """One frame from per-layer records (each the parts ``record_parts`` gives, or the bytes
    ``build_record`` gives), and its full sum (for a version-2 header's span). The frame's
    bytes are assembled with a single copy. ``lead(frame_length)``: bytes written before the
    frame in that same copy (a message's own fields, ``kdn.transport.wire.frame_message_head``); the
    frame is then a read-only view after them, and its ``obj`` the whole message."""
    parts: list[Buffer] = []
    for rec in records:
        parts.extend(rec if isinstance(rec, list) else [rec])
    length = sum(len(p) for p in parts)
    pre = frame_prefix(index, first_layer, len(records), length, 0)[:12]
    h = xxhash.xxh3_64(seed=seed)
    h.update(pre)
    for p in parts:
        h.update(p)
    full = h.intdigest()
    head = lead(FRAME_STRUCT.size + length) if lead is not None else b""
    out = b"".join([head, pre, struct.pack("<L", full & 0xFFFFFFFF), *parts])
    return (memoryview(out)[len(head):] if head else out), full  # type: ignore[return-value]


def frame_prefix(index: int, first_layer: int, count: int, length: int, checksum: int) -> bytes:
    """The 16-byte prefix of a frame (``checksum``: its full sum; the low 32 bits are kept).
    InvalidLayout where a field does not fit (a frame of 4 GiB or more)."""
    try:
        return FRAME_STRUCT.pack(FRAME_MAGIC, index, first_layer, count, length,
                                 checksum & 0xFFFFFFFF)
    except struct.error:
        raise InvalidLayout(f"frame {index} of layers [{first_layer}, {first_layer + count}) "
                            f"and {length} bytes does not fit a frame's fields") from None


def build_frame(seed: int, index: int, first_layer: int,
                records: list[list[Buffer]] | list[bytes]) -> bytes:
    """``frame_with_sum`` without the sum (``seed``: ``Header.frame_seed``)."""
    return frame_with_sum(seed, index, first_layer, records)[0]


def seal(entry: pb.EntryHeader, frames: list[bytes], version: int = VERSION
         ) -> tuple[bytes, list[bytes]]:
    """A header and frames whose checksums all agree, from ``entry`` and frames whose sums may
    be stale (their first 12 prefix bytes and payloads are kept as they are). For migrations
    (``version`` 1 entries rewritten as 2), tests and fuzzers that must reach the checks behind
    the checksums; a store accepts the result only if everything else is right too."""
    entry = pb.EntryHeader.FromString(entry.SerializeToString())
    for span in entry.frames:
        span.checksum = 0
    header = build_header(entry, version)
    seed = parse_header(header).frame_seed if version < 2 else FRAME_SEED
    out = []
    for i, frame in enumerate(frames):
        full = frame_sum(seed, frame[:12], frame[FRAME_STRUCT.size :])
        out.append(b"".join([frame[:12], struct.pack("<L", full & 0xFFFFFFFF),
                             frame[FRAME_STRUCT.size :]]))
        if version >= 2 and i < len(entry.frames):
            entry.frames[i].checksum = full
    return (build_header(entry, version) if version >= 2 else header), out


def record_prefix(lay: LayerLayout, tokens: int, body_bytes: int) -> bytes:
    """The shape prefix of a layer record whose body has ``body_bytes`` bytes (InvalidLayout
    where a field does not fit)."""
    try:
        return _RECORD.pack(lay.kv_heads, tokens, lay.k_channels, lay.v_channels, body_bytes)
    except struct.error:
        raise InvalidLayout(f"a layer of {lay.kv_heads} heads, {tokens} tokens, k={lay.k_channels} "
                            f"v={lay.v_channels} and a {body_bytes}-byte body does not fit a "
                            "record's fields") from None


def record_parts(lay: LayerLayout, tokens: int, body: Buffer) -> list[Buffer]:
    """A layer record as [shape prefix, body] (no copy of the body)."""
    return [record_prefix(lay, tokens, len(body)), body]


def build_record(lay: LayerLayout, tokens: int, body: Buffer) -> bytes:
    return b"".join(record_parts(lay, tokens, body))


def frame_length(buf: bytes | memoryview, offset: int = 0) -> int:
    """Total bytes of the frame starting at ``offset`` (prefix + payload), from its prefix."""
    if len(buf) - offset < FRAME_STRUCT.size:
        raise Truncated(f"frame prefix truncated at offset {offset}")
    magic, _i, _f, _n, length, _s = FRAME_STRUCT.unpack_from(buf, offset)
    if magic != FRAME_MAGIC:
        raise Corrupt(f"bad frame magic at offset {offset}")
    return FRAME_STRUCT.size + length


def declared_length(first: bytes | memoryview) -> int:
    """``frame_length`` of a frame whose first piece is ``first`` (a stream's receiver knows
    from it when the frame is whole); -1 where ``first`` starts with no frame prefix (the
    frame's check says why, once it has all its bytes)."""
    try:
        return frame_length(first)
    except Corrupt:  # Truncated too
        return -1


class LayerRecord(NamedTuple):
    """One layer's record in a frame: its body a view of the frame (a tuple: a frame's 30
    records cost ~1 us each as a frozen dataclass, a third of that so)."""

    layer: int
    tokens: int
    body: memoryview


def check_frame(header: Header, index: int, frame: bytes | memoryview, *,
                digest: int | None = None, checksum: bool = True, records: bool = True
                ) -> list[LayerRecord]:
    """Verify one frame against its header (checksum, position, shapes); return its records.

    Cheap: no tensor is decoded. Raises Corrupt/Truncated for damaged bytes and InvalidLayout
    for records whose shapes do not match the declared layout. ``digest``: the frame's full
    sum, already computed over these bytes (``copy_checked``); ``checksum=False`` skips the sum
    (bytes the server checked in place, see ``EntryRef.verified``). ``records=False``: the
    same checks, no records built (a server checking what it is asked to store: [] back).
    """
    payload, first, count = check_frame_prefix(header, index, frame, digest=digest,
                                               checksum=checksum)
    end = len(payload)
    key = (header.layout.fingerprint, header.tokens, first, count, end) \
        if count >= _WALK_MEMO_LAYERS else None
    walk = _WALKS.get(key) if key is not None else None
    if walk is not None and walk.matches(payload):  # the walk below would go exactly so
        return walk.records(payload) if records else []
    shapes = header.record_shapes
    unpack, size = _RECORD.unpack_from, _RECORD.size
    out: list[LayerRecord] = []
    starts: list[int] = []
    off = 0
    for layer in range(first, first + count):
        if end - off < size:
            raise Truncated(f"frame {index}: record for layer {layer} truncated")
        heads, tokens, kc, vc, blen = unpack(payload, off)
        if (heads, tokens, kc, vc) != shapes[layer]:
            lay = header.layout.layers[layer]
            raise InvalidLayout(
                f"layer {layer}: frame declares heads={heads} tokens={tokens} k={kc} v={vc}, "
                f"layout expects heads={lay.kv_heads} tokens={header.tokens} "
                f"k={lay.k_channels} v={lay.v_channels}"
            )
        starts.append(off)
        off += size
        if end - off < blen:
            raise Truncated(f"frame {index}: body of layer {layer} truncated")
        if records:
            out.append(LayerRecord(layer, tokens, payload[off : off + blen]))
        off += blen
    if off != end:
        raise Corrupt(f"frame {index}: {end - off} trailing bytes after its records")
    if key is not None:
        _WALKS.put(key, _Walk.of(payload, first, header.tokens, starts))
    return out


_WALK_MEMO_LAYERS = 4
"""Frames of this many layers or more have their record walk memoised (``_Walk``)."""


class _Walk:
    """A frame's record walk that passed, kept by (layout, tokens, first layer, layer count,
    payload length): the walk is a pure function of the record prefixes it reads and the
    payload's length, so a payload whose bytes at those prefixes are the same ones passes the
    same way and has its records at the same offsets. Checking that is one gather and one
    compare (~3 us) instead of a Python step per layer (~30 us for 32 layers): every frame of
    a model's entries of one length has the same prefixes."""

    __slots__ = ("index", "want", "bodies")

    def __init__(self, index: np.ndarray, want: bytes, bodies: tuple[tuple[int, int, int, int], ...]
                 ) -> None:
        self.index, self.want, self.bodies = index, want, bodies

    @classmethod
    def of(cls, payload: bytes | memoryview, first: int, tokens: int, starts: list[int]
           ) -> _Walk:
        size = _RECORD.size
        index = (np.asarray(starts, dtype=np.int32)[:, None]
                 + np.arange(size, dtype=np.int32)).ravel()
        mv = memoryview(payload).cast("B")
        want = b"".join(bytes(mv[o : o + size]) for o in starts)
        bodies = tuple((first + j, tokens, o + size, o + size + _RECORD.unpack_from(mv, o)[4])
                       for j, o in enumerate(starts))
        return cls(index, want, bodies)

    def matches(self, payload: bytes | memoryview) -> bool:
        got = np.frombuffer(payload, dtype=np.uint8)[self.index]
        return bool(got.tobytes() == self.want)

    def records(self, payload: bytes | memoryview) -> list[LayerRecord]:
        mv = memoryview(payload)
        return [LayerRecord(layer, tokens, mv[lo:hi]) for layer, tokens, lo, hi in self.bodies]


_WALKS: BoundedMemo[tuple[str, int, int, int, int], _Walk] = BoundedMemo(1024)


def check_frame_prefix(header: Header, index: int, frame: bytes | memoryview, *,
                       digest: int | None = None, checksum: bool = True
                       ) -> tuple[memoryview, int, int]:
    """``check_frame``'s checks of the frame as a whole (magic, length, position, checksum and
    its binding to the header): its payload, first layer and layer count. The records are
    the caller's to check (``check_frame`` does, one by one)."""
    mv = memoryview(frame)
    if index >= len(header.entry.frames):
        raise InvalidLayout(f"frame {index} beyond the {len(header.entry.frames)} declared")
    if len(mv) < FRAME_STRUCT.size:
        raise Truncated(f"frame {index} truncated: {len(mv)} bytes")
    magic, idx, first, count, length, want = FRAME_STRUCT.unpack_from(mv, 0)
    if magic != FRAME_MAGIC:
        raise Corrupt(f"frame {index}: bad magic")
    if len(mv) != FRAME_STRUCT.size + length:
        raise Truncated(f"frame {index}: {len(mv) - FRAME_STRUCT.size} payload bytes, "
                        f"declared {length}")
    payload = mv[FRAME_STRUCT.size :]
    span = header.entry.frames[index]
    if header.version >= 2 and want != span.checksum & 0xFFFFFFFF:
        raise Corrupt(f"frame {index} does not belong to this entry: its checksum is not the "
                      f"one the header lists for frame {index}")
    if checksum:
        _check_sum(header, index, want, frame_sum(header.frame_seed, mv[:12], payload)
                   if digest is None else digest)
    if (idx, first, count) != (index, span.first_layer, span.num_layers):
        raise Corrupt(
            f"frame {index}: declares index {idx} layers [{first}, {first + count}), "
            f"header expects layers [{span.first_layer}, {span.first_layer + span.num_layers})"
        )
    return payload, first, count


def _check_sum(header: Header, index: int, want: int, got: int) -> None:
    """Frame ``index``'s full sum ``got`` against the low half its prefix holds (``want``) and,
    in a version-2 header, the whole one the header lists."""
    span = header.entry.frames[index]
    if got & 0xFFFFFFFF != want or header.version >= 2 and got != span.checksum:
        raise Corrupt(f"frame {index}: checksum mismatch")


def sums_checked_later(header: Header, frames: Sequence[bytes | memoryview]
                       ) -> Callable[[], None]:
    """Each frame's sum computed on a worker thread while the caller goes on, and the wait for
    it: the wait raises Corrupt, as ``check_frame`` would, for the first frame whose sum does
    not match. For a GPU decode of frames whose structure ``check_frame(..., checksum=False)``
    has checked: the planner, the copies and the kernels run on them meanwhile (they are safe
    on damaged bytes and report nothing until checked), and their result is used only after
    the wait (``gpu_batch.Decoded.check``). Hashing holds the GIL but the planner's and the
    copies' work does not, so the two overlap; hashing was the largest host cost of a whole
    entry decoded from bytes nobody had checked."""
    views = [memoryview(f) for f in frames]

    def run() -> None:
        for i, mv in enumerate(views):
            want = FRAME_STRUCT.unpack_from(mv, 0)[5]
            _check_sum(header, i, want,
                       frame_sum(header.frame_seed, mv[:12], mv[FRAME_STRUCT.size :]))

    job = _SUMS.get().submit(run)
    return lambda: job.result()


_SUMS = SharedPool(2, "kdn-sums")


def split_frames(buf: bytes | memoryview, offset: int) -> Iterator[memoryview]:
    """Yield each frame of a container as a zero-copy view, starting at ``offset``."""
    mv = memoryview(buf)
    while offset < len(mv):
        n = frame_length(mv, offset)
        if offset + n > len(mv):
            raise Truncated(f"frame at offset {offset} needs {n} bytes, {len(mv) - offset} remain")
        yield mv[offset : offset + n]
        offset += n


def entry_digest(frames: Sequence[bytes | memoryview]) -> int:
    """xxh3-64 over the prefixes of ``frames`` (each names its index, layers, length and
    checksum): two stored versions with the same header differ here unless every frame's
    checksum collides."""
    h = xxhash.xxh3_64()
    for f in frames:
        h.update(f[: FRAME_STRUCT.size])
    return h.intdigest()


@dataclass(frozen=True)
class EncodedParts:
    """An encoded cache as the container header plus its frames, ready to stream."""

    header: bytes
    frames: list[bytes]

    wire: tuple[bytes, ...] = field(default=(), compare=False, repr=False)
    """Each frame's serialized Store message, where the encoder wrote the frames inside them
    (``encode_parts``): a stream sends these without building them (``messages``)."""

    def messages(self) -> list[bytes] | None:
        """``wire`` while every frame is still the view into its message, else None."""
        if len(self.wire) != len(self.frames) or not all(
                isinstance(f, memoryview) and f.obj is w for f, w in zip(self.frames, self.wire)):
            return None
        return list(self.wire)

    def to_bytes(self) -> bytes:
        return b"".join([self.header, *self.frames])

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(f) for f in self.frames)


@dataclass(frozen=True)
class Container:
    """A parsed container: its header and zero-copy views of its frames."""

    header: Header
    frames: list[memoryview]

    @property
    def nbytes(self) -> int:
        return len(self.header.raw) + sum(len(f) for f in self.frames)


def parse_container(buf: bytes | memoryview, *, verify: bool = True) -> Container:
    """Split a stored entry into header and frames; with ``verify`` check every frame too."""
    header = parse_header(buf)
    frames = list(split_frames(buf, len(header.raw)))
    if len(frames) != len(header.entry.frames):
        raise Truncated(f"container holds {len(frames)} frames, header declares "
                        f"{len(header.entry.frames)}")
    if verify:
        for i, f in enumerate(frames):
            check_frame(header, i, f)
    return Container(header, frames)
