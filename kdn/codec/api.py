"""The tensor side of the codec (torch): encode KV caches into containers and decode them.

Imported lazily by ``kdn.codec`` (see there); the container format itself is torch-free.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from kdn.cache import KVCache
from kdn.checks import whole
from kdn.codec import inplace
from kdn.codec.catalog import default_level
from kdn.codec.format import (
    FRAME_SEED,
    Buffer,
    Container,
    EncodedParts,
    Header,
    LayerRecord,
    build_header,
    check_frame,
    check_frame_prefix,
    frame_with_sum,
    parse_container,
    parse_header,
    record_parts,
    sums_checked_later,
)
from kdn.codec.layouts import BoundedMemo, check_layer_bytes, layout_to_proto
from kdn.codec.modes import LayerSpec, Mode, check_finite, get_mode, mode_names
from kdn.codec.room import check_room
from kdn.errors import Corrupt, InvalidArgument, KDNError, TooLarge
from kdn.layout import KVLayout
from kdn.pools import SharedPool
from kdn.transport.wire import frame_message_head
from kdn.v1 import kdn_pb2 as pb

__all__ = [
    "Container",
    "EncodedParts",
    "Header",
    "StreamDecoder",
    "decode",
    "encode",
    "encode_parts",
    "mode_names",
    "parse_container",
    "parse_header",
]

DECODERS = max(2, os.cpu_count() or 2)
"""Layers decoded at once on the CPU, at most: the codec's pool and a stream's (``kdn-recv``)
have this many threads."""
_POOL = SharedPool(DECODERS, "kdn-codec")
DECODER_CODE_BYTES = 64 << 20
"""What a CPU decoder adds besides its layers' working memory: its first use in a process
loads code (numba's rANS decoder from its cache, torch's kernels) and a layer's small
buffers (per-token steps, sinks): 18 to 30 MiB measured, counted twice over with any working
memory (the room check can not tell a first use)."""
FRAME_TARGET_BYTES = 1 << 20
"""With ``layers_per_frame=0`` a frame takes consecutive layers until it holds this many bytes
(so a layer this large is a frame of its own). A frame travels as one gRPC message, and Python
gRPC moves messages of about 1 MiB fastest (streams of ~1 MB frames beat ~400 KB ones by about
20% in ``bench.roundtrip``)."""


_DEVICES: dict[object, torch.device] = {}
"""Devices ``target_device`` found usable, by what the caller named them."""


def target_device(device: torch.device | str | None, *, here: bool = True) -> torch.device:
    """``device`` (None or "": the CPU) as a torch.device; InvalidArgument naming it when
    torch does not know the name ("bogus"), or with ``here`` when this process can not put
    tensors there ("cuda:7" on a host with fewer GPUs, or none: checked where tensors are
    made, once per name; a plan for a device, ``here=False``, needs none). "cuda" with no
    index, where CUDA is available: the calling thread's current device, by its index, so
    that threads that decode or land for the caller (whose current device is their own, by
    default cuda:0) put tensors where the caller meant."""
    if device is None or device == "":
        return _CPU
    memo = here and isinstance(device, (str, int, torch.device))
    got = _DEVICES.get(device) if memo else None
    if got is None:
        got = _named_device(device, here, memo)
    if got.type == "cuda" and got.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return got


def _named_device(device: torch.device | str | int, here: bool, memo: bool) -> torch.device:
    """``target_device``'s parse and check of a name not memoised yet."""
    try:
        got = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument(f"device {str(device)!r} is not a device name torch knows "
                              "(e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if here and got.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=got)  # raises where the device is not here
        except (RuntimeError, AssertionError, ValueError) as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise InvalidArgument(f"device {str(device)!r} is not usable in this process: "
                                  f"{why}") from None
    if memo:
        _DEVICES[device] = got
    return got


_CPU = torch.device("cpu")


def layer_spec(kv_layout: KVLayout, layer: int, tokens: int) -> LayerSpec:
    """What a mode knows about ``layer`` of ``tokens`` tokens in ``kv_layout``."""
    return LayerSpec(layer, kv_layout.num_layers, kv_layout.layers[layer], tokens, kv_layout.dtype)


def record_specs(kv_layout: KVLayout, recs: Sequence[LayerRecord]) -> list[LayerSpec]:
    """``layer_spec`` of each record (memoised by layout and length: a hit on a context's
    blocks asks for the same few thousand, ~1.5 us each to make)."""
    return [_specs(kv_layout, r.tokens)[r.layer] for r in recs]


def _specs(kv_layout: KVLayout, tokens: int) -> tuple[LayerSpec, ...]:
    """Every layer's ``layer_spec`` for ``tokens`` tokens, memoised."""
    key = (kv_layout.fingerprint, tokens)
    specs = _SPECS.get(key)
    if specs is None:
        specs = tuple(layer_spec(kv_layout, i, tokens) for i in range(kv_layout.num_layers))
        _SPECS.put(key, specs)
    return specs


_SPECS: BoundedMemo[tuple[str, int], tuple[LayerSpec, ...]] = BoundedMemo(256)


def frame_spans(layer_bytes: list[int], layers_per_frame: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of each frame for layers of ``layer_bytes`` encoded bytes:
    ``layers_per_frame`` layers each, or with 0 consecutive layers until a frame holds
    ``FRAME_TARGET_BYTES``."""
    n = len(layer_bytes)
    if layers_per_frame:
        return [(first, min(layers_per_frame, n - first))
                for first in range(0, n, layers_per_frame)]
    spans: list[tuple[int, int]] = []
    first, size = 0, 0
    for layer, nbytes in enumerate(layer_bytes):
        size += nbytes
        if size >= FRAME_TARGET_BYTES or layer == n - 1:
            spans.append((first, layer + 1 - first))
            first, size = layer + 1, 0
    return spans


def encode_parts(
    kv: KVCache, mode: str = "lossless", level: str = "", *, layers_per_frame: int = 1,
    wire: bool = False,
) -> EncodedParts:
    """Encode ``kv`` into a container header and frames of ``layers_per_frame`` layers each
    (0: sized by ``FRAME_TARGET_BYTES``, see ``frame_spans``). ``wire``: each frame is written
    inside its serialized Store message (``EncodedParts.wire``), which a Store stream sends as
    it is, and the frames are read-only views of those messages instead of ``bytes``.
    InvalidArgument for anything but a ``KVCache`` of tensors that hold data (not ``meta``) for
    at least one token, and for a lossy mode, a NaN or inf in it (``kdn.codec.modes``);
    InvalidLayout for a layer past the decoders' limit (``layouts.check_layer_bytes``).
    ``level`` ``""``: the level ``mode`` alone means (``catalog.DEFAULT_LEVELS``)."""
    codec = get_mode(mode)
    level = codec.check_level(level or default_level(mode))
    layers_per_frame = whole("layers_per_frame", layers_per_frame, 0, " (0: frames of about "
                             "FRAME_TARGET_BYTES)")
    if not isinstance(kv, KVCache):
        raise InvalidArgument(f"expected a KVCache, got {type(kv).__name__}")
    kv.validate()
    if any(k.is_meta or v.is_meta for k, v in kv.layers):
        raise InvalidArgument("the KVCache's tensors are on the meta device: they hold no "
                              "values to encode")
    if kv.num_tokens == 0:
        raise InvalidArgument("the KVCache holds no tokens: there is no KV of nothing to encode")
    check_layer_bytes(kv.layout, kv.num_tokens)  # before any layer is encoded
    return _encode_unchecked(kv, mode, level, layers_per_frame, wire)


def _encode_unchecked(kv: KVCache, mode: str, level: str, layers_per_frame: int, wire: bool
                      ) -> EncodedParts:
    """``encode_parts`` past its checks of ``kv`` (hostile-decoder tests build entries no
    client can store with it: one of no tokens)."""
    codec = get_mode(mode)
    layout, tokens = kv.layout, kv.num_tokens

    def one(layer: int) -> list[Buffer]:
        k, v = kv.layers[layer]
        if not codec.lossless:
            check_finite(k, v, layer, mode, codec.max_abs)
        body = codec.encode_layer(k, v, layer_spec(layout, layer, tokens), level)
        return record_parts(layout.layers[layer], tokens, body)

    records = list(_POOL.get().map(one, range(layout.num_layers)))
    spans = frame_spans([sum(len(p) for p in rec) for rec in records], layers_per_frame)
    built = [frame_with_sum(FRAME_SEED, i, first, records[first : first + n],
                            lead=partial(frame_message_head, i) if wire else None)
             for i, (first, n) in enumerate(spans)]
    entry = pb.EntryHeader(
        layout=layout_to_proto(layout),
        codec=pb.Codec(mode=mode, level=level, params=codec.params(level)),
        tokens=tokens,
        start_position=kv.start_position,
        frames=[pb.FrameSpan(first_layer=f, num_layers=n, checksum=full)
                for (f, n), (_, full) in zip(spans, built)],
        layout_fingerprint=layout.fingerprint,
    )
    frames = [frame for frame, _ in built]
    return EncodedParts(build_header(entry), frames, wire=tuple(
        f.obj for f in frames) if wire else ())  # type: ignore[attr-defined]


def encode(kv: KVCache, mode: str = "lossless", level: str = "", *, layers_per_frame: int = 1
           ) -> bytes:
    """Encode ``kv`` into one self-describing container."""
    return encode_parts(kv, mode, level, layers_per_frame=layers_per_frame).to_bytes()


def _bytes_like(what: str, buf: object) -> bytes | memoryview:
    """``buf`` itself, or as a byte view (a bytearray, a numpy array, an mmap: any contiguous
    buffer); InvalidArgument starting with ``what`` for anything else (a str, None, a list)."""
    if isinstance(buf, bytes):
        return buf
    try:
        return memoryview(buf).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} (a contiguous bytes-like buffer), got "
                              f"{type(buf).__name__}") from None


class StreamDecoder:
    """Decodes the frames of one container as they arrive, in any order, independently."""

    def __init__(self, header: bytes | memoryview | Header,
                 device: torch.device | str | None = None, *, borrow: bool = False,
                 checked: bool = False, stored_bytes: int | None = None,
                 private: bool = False) -> None:
        """``borrow``: the frames are writable buffers the caller hands over for good (a region
        of its shared segment); CPU tensors may then view them instead of copying.
        ``private``: the frames are read-only views of memory that nothing but them holds (a
        received stream's messages, ``kdn.client.received.received``): borrowed too.
        ``checked``: their checksums were verified on these very bytes already (by the server
        that wrote them into the segment); frames are still checked for structure.
        ``stored_bytes``: the whole entry's size, where known: a mode that stores tensors
        verbatim can not declare more tensor bytes than that (Corrupt before any allocation)."""
        self.checked = checked
        self.header = header if isinstance(header, Header) else parse_header(
            _bytes_like("StreamDecoder takes a container header", header))
        self.device = target_device(device)
        self.private = private and self.device.type == "cpu"
        self.borrow = (borrow or private) and self.device.type == "cpu"
        self.mode: Mode = get_mode(self.header.mode)
        self.level = self.mode.check_level(self.header.entry.codec.level)
        self._offsets: list[int] = []  # layer l's body goes to [offsets[l], offsets[l + 1])
        self._arena: memoryview | None = None  # of the arena they go to, taken on first use
        self._arena_lock = threading.Lock()
        # verbatim bodies are copied once, into one recycled buffer for the whole entry
        # (kdn.transport.buffers: fresh memory faults page by page) that every layer's tensors
        # view; borrowed bodies too where a tensor can not view them where they lie (an fp32
        # body two bytes off its alignment after a 14-byte record prefix): their offsets are
        # counted when the first such body comes
        self._may_arena = self.mode.borrows and self.device.type == "cpu"
        if self._may_arena and not self.borrow:
            self._offsets = self._layer_ends(stored_bytes)
        elif self.device.type != "cpu" or not self.mode.borrows:
            check_room(self.header.layout.bytes_per_token * self.header.tokens,
                       self.header.tokens, device=self.device, work=self._work_bytes())

    def _work_bytes(self) -> int:
        """What the CPU decoders hold beyond the tensors while they run: the widest layer's
        working memory (``Mode.decode_work_bytes``), once per layer decoded at once."""
        if self.device.type != "cpu":
            return 0
        lay, size = self.header.layout, self.header.layout.dtype.itemsize
        elements = lay.widest_token_bytes[1] // size * self.header.tokens
        per_layer = self.mode.decode_work_bytes(elements, size)
        return min(lay.num_layers, DECODERS) * per_layer + DECODER_CODE_BYTES if per_layer else 0

    def _layer_ends(self, stored_bytes: int | None) -> list[int]:
        """Where each layer's tensors start in the arena, and its size last; Corrupt when the
        header declares more tensor bytes than ``stored_bytes`` (before any allocation)."""
        lay, t, size = self.header.layout, self.header.tokens, self.header.layout.dtype.itemsize
        ends = list(itertools.accumulate(
            (lay.layers[i].k_numel(t) + lay.layers[i].v_numel(t)) * size
            for i in range(lay.num_layers)))
        total = ends[-1] if ends else 0
        if stored_bytes is not None and total > stored_bytes:
            raise Corrupt(f"header declares {total} bytes of {self.mode.name} tensors in "
                          f"an entry of {stored_bytes} bytes")
        return [0, *ends]

    def _arena_view(self) -> memoryview | None:
        """The entry's arena, taken when the first layer is decoded into it (not before: a
        decoder whose entry is decoded whole, ``copy_entry``, or whose bodies are all viewed
        where they lie, takes none); None when no memory holds the declared size
        (checksummed, but hostile or damaged): layer by layer then, each body's size checked
        before a copy. Slices of it keep the pooled buffer alive."""
        if self._arena is None and self._may_arena:
            with self._arena_lock:
                if self._arena is None and self._may_arena:
                    if not self._offsets:
                        self._offsets = self._layer_ends(None)
                    total = self._offsets[-1]
                    try:
                        buf = inplace.BUFFERS.take(total) if total else np.empty(0, np.uint8)
                        self._arena = memoryview(buf)  # type: ignore[arg-type]
                    except (MemoryError, TooLarge):  # (the pool's word for MemoryError)
                        self._may_arena = False
        return self._arena

    @property
    def borrows(self) -> bool:
        """Whether decoding is a view plus checksums (borrowed bodies of a verbatim mode)."""
        return self.borrow and self.mode.borrows

    @property
    def num_frames(self) -> int:
        return len(self.header.entry.frames)

    def decode_record(self, rec: LayerRecord) -> tuple[torch.Tensor, torch.Tensor]:
        spec = layer_spec(self.header.layout, rec.layer, rec.tokens)
        kv = self.mode.borrow_layer(rec.body, spec, private=self.private) if self.borrow \
            else None
        arena = self._arena_view() if kv is None else None
        if arena is not None:
            lo, hi = self._offsets[rec.layer], self._offsets[rec.layer + 1]
            if len(rec.body) != hi - lo:
                raise Corrupt(f"layer {rec.layer}: {len(rec.body)} body bytes, expected "
                              f"{hi - lo}")
            place = arena[lo:hi]
            np.frombuffer(place, dtype=np.uint8)[:] = np.frombuffer(rec.body, dtype=np.uint8)
            kv = self.mode.borrow_layer(place, spec)
        k, v = kv if kv is not None else self.mode.decode_layer(rec.body, spec, self.level,
                                                                 self.device)
        if tuple(k.shape) != spec.k_shape or tuple(v.shape) != spec.v_shape:
            raise Corrupt(f"layer {rec.layer}: mode {self.mode.name} decoded wrong shapes")
        return k, v

    def decode_bodies(self, got: Bodies, *, pinned: bool = False) -> Any:
        """The entry's layers (``entry_bodies``) decoded together by the mode's whole-entry
        GPU decoder (``Mode.decode_layers``): a ``Decoded`` to ``check()`` before its tensors
        are used, or None where the mode has none."""
        done = self.mode.decode_layers(got.bodies, got.specs, self.level, self.device,
                                       pinned=pinned, addresses=got.addresses)
        if done is not None:
            for (k, v), spec in zip(done.layers, got.specs):
                if tuple(k.shape) != spec.k_shape or tuple(v.shape) != spec.v_shape:
                    raise Corrupt(f"layer {spec.index}: mode {self.mode.name} decoded wrong "
                                  "shapes")
        return done

    def decode_frames(self, frames: Sequence[bytes | memoryview], *, pinned: bool = False
                      ) -> Any:
        """Every frame of the entry verified, then all its layers decoded together on the
        device (``decode_bodies``; ``pinned``: the frames lie in page-locked or registered
        memory); None where the mode has no whole-entry decoder."""
        if self.device.type == "cpu" or self.mode.decode_layers is Mode.decode_layers:
            return None
        got = entry_bodies(self.header, frames, hashed=self.checked)
        if self.checked:
            return self.decode_bodies(got, pinned=pinned)
        return self.decode_beside_sums(got, frames, pinned=pinned)

    def decode_beside_sums(self, got: Bodies, frames: Sequence[bytes | memoryview], *,
                           pinned: bool = False) -> Any:
        """``decode_bodies`` while the frames' sums are computed on a worker thread
        (``sums_checked_later``), the wait for them added to the result's ``check``; the sums
        waited for first where the planner refuses the bytes (a damaged frame is refused as
        the CPU path refuses it: by its sum), or where the mode has no whole-entry decoder
        (None back: the caller decodes the checked records another way)."""
        wait = sums_checked_later(self.header, frames)
        done = decoded_beside([wait], lambda: self.decode_bodies(got, pinned=pinned))
        if done is None:
            wait()
        return done

    def decode_frame(
        self, index: int, frame: bytes | memoryview
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Verify frame ``index`` and decode its layers: [(layer, K, V), ...]."""
        index = whole("frame index", index)
        frame = _bytes_like(f"frame {index} must be bytes", frame)
        recs = check_frame(self.header, index, frame, checksum=not self.checked)
        return [(r.layer, *self.decode_record(r)) for r in recs]

    def view_entry(self, container: memoryview, frames: Sequence[memoryview] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer at once as views of ``container`` (the whole entry, header then frames)
        where the frames are borrowed; None when that does not apply (``kdn.codec.inplace``):
        decode frame by frame then. Frames not checked yet (``frames``: the container's frame
        views) are checked where they lie first, and raise Corrupt or Truncated when damaged."""
        if not self.borrows:
            return None
        if self.checked:
            return inplace.views(self.header, container)
        return None if frames is None else inplace.verified_views(
            self.header, frames, container, readonly=False)

    def view_frames(self, frames: Sequence[memoryview]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer at once as views of ``frames`` where they lie apart (``private``
        frames, checksums verified already: a received stream's messages); None when that
        does not apply (``kdn.codec.inplace.frame_views``): decode frame by frame then."""
        if not (self.private and self.checked and self.mode.borrows):
            return None
        return inplace.frame_views(self.header, frames)

    def copy_entry(self, container: bytes | memoryview
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer at once from one copy of ``container`` (the whole entry) into a
        recycled buffer, every checksum verified as it is copied (unless ``checked``: bytes
        verified already); None when the entry's mode or layout does not allow views of the
        copy (``kdn.codec.inplace``): decode frame by frame then. Raises Corrupt for damaged
        bytes."""
        if self.device.type != "cpu" or not self.mode.borrows:
            return None
        return inplace.copied(self.header, container, _POOL.get(), verify=not self.checked)

    def staging_span(self, frames: list[memoryview], container: memoryview
                     ) -> inplace.Span | None:
        """Every layer at once, as the span of host bytes the caller must not change that
        their views would view (``frames`` and ``container``: the same entry), every checksum
        verified in place first: the source of one copy to a device
        (``kdn.codec.inplace.verified_span``); None when that does not apply. Raises Corrupt
        for damaged bytes. ``checked`` bytes (verified already) are not hashed again."""
        if self.device.type != "cpu" or not self.mode.borrows:
            return None
        if self.checked:
            return inplace.span(self.header, container, readonly=True)
        return inplace.verified_span(self.header, frames, container)

    def empty_cache(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return [None] * self.header.layout.num_layers


def decoded_beside(waits: list[Callable[[], None]], decode: Callable[[], Any]) -> Any:
    """``decode()`` (a whole-entry GPU decode: a ``Decoded`` or None) while ``waits``' checks
    run (``sums_checked_later``): added to the result's ``check``, or waited for first where
    ``decode`` refuses the bytes, so that a damaged frame is refused by its sum, as on the CPU
    path. Where it gives None, nothing is waited for: the caller decides."""
    try:
        done = decode()
    except KDNError:
        for wait in waits:
            wait()
        raise
    if done is not None:
        done.waits += waits
    return done


class Bodies(NamedTuple):
    """An entry's layer bodies as the whole-entry decoders take them: views of the frames,
    where each lies in memory, and each layer's spec."""

    bodies: list[memoryview]
    addresses: list[int]
    specs: list[LayerSpec]


def entry_bodies(header: Header, frames: Sequence[bytes | memoryview], *,
                 hashed: bool = False) -> Bodies:
    """``unhashed_records`` for a whole-entry decode, without Python per record: each
    frame's prefix checked, its records walked by ``gpu_plan.walk`` (compiled), each body's
    address its frame's plus an offset. The same checks and, where they fail, the same error
    (``unhashed_records`` says it)."""
    from kdn.codec import gpu_plan  # numba, loaded with the GPU decoders

    layout, tokens = header.layout, header.tokens
    key = (layout.fingerprint, tokens)
    shapes = _SHAPES.get(key)
    if shapes is None:
        shapes = np.asarray(header.record_shapes, dtype=np.int64).reshape(-1, 4)
        _SHAPES.put(key, shapes)
    specs_of = _specs(layout, tokens)
    lo = np.empty(layout.num_layers, np.int64)
    hi = np.empty(layout.num_layers, np.int64)
    out = Bodies([], [], [])
    at = 0
    try:
        for i, f in enumerate(frames):
            payload, first, count = check_frame_prefix(header, i, f, checksum=False)
            arr = np.frombuffer(payload, dtype=np.uint8)
            if gpu_plan.walk(arr, first, count, shapes, lo, hi, at):
                raise Corrupt("records do not parse")  # check_frame names it below
            base = arr.ctypes.data if len(arr) else 0
            starts = lo[at : at + count].tolist()
            out.bodies.extend(payload[a:b] for a, b in zip(starts, hi[at : at + count].tolist()))
            out.addresses.extend(base + a for a in starts)
            out.specs.extend(specs_of[first : first + count])
            at += count
    except KDNError:
        from kdn.codec.gpu_source import address

        recs = unhashed_records(header, frames, hashed=hashed)  # raises what check_frame says
        return Bodies([r.body for r in recs], [address(r.body) for r in recs],
                      record_specs(layout, recs))
    return out


_SHAPES: BoundedMemo[tuple[str, int], np.ndarray] = BoundedMemo(256)


def unhashed_records(header: Header, frames: Sequence[bytes | memoryview], *,
                      hashed: bool = False) -> list[LayerRecord]:
    """Every frame checked but for its sum (``sums_checked_later`` does those beside the
    GPU's work), and its records. On damage, the error the whole check gives (``hashed``: the
    bytes were checked already): a sum that does not match before a record that does not
    parse, as ``check_frame`` orders them."""
    try:
        return [r for i, f in enumerate(frames) for r in check_frame(header, i, f,
                                                                     checksum=False)]
    except KDNError:
        for i, f in enumerate(frames):
            check_frame(header, i, f, checksum=not hashed, records=False)
        raise


def decode(buf: bytes | memoryview, *, device: torch.device | str | None = None,
           batched: bool | None = None) -> KVCache:
    """Verify and decode a whole container into a KVCache. On a CUDA device, a mode with a
    whole-entry decoder (``Mode.decode_layers``: ``kdn``, ``int8``) decodes every layer in a
    few kernel launches and one synchronisation at the end, the frames' sums computed on a
    worker thread meanwhile and checked before anything is returned (``decode_beside_sums``);
    elsewhere layers decode in parallel on the codec's thread pool (on a GPU, the caller's
    current stream waits for each worker's, on the device). ``batched`` forces either
    way (True on the CPU runs the GPU kernels under Triton's interpreter: how tests check
    them). InvalidArgument where ``buf`` is no contiguous buffer of bytes (a str, None, a list)."""
    buf = _bytes_like("codec.decode takes a stored entry's bytes", buf)
    container = parse_container(buf, verify=False)  # frames are checked just below
    dec = StreamDecoder(container.header, device, stored_bytes=len(buf))
    start = int(container.header.entry.start_position)
    if dec.device.type == "cuda" if batched is None else batched:
        done = dec.decode_beside_sums(entry_bodies(dec.header, container.frames),
                                      container.frames)
        if done is not None:
            return KVCache(dec.header.layout, done.check(), start)
        recs = unhashed_records(dec.header, container.frames, hashed=True)  # sums waited for
    else:
        recs = [r for i, f in enumerate(container.frames) for r in check_frame(dec.header, i, f)]
    from kdn.codec.gpu_source import await_ready, record_ready

    def here(rec: Any) -> tuple[Any, Any]:  # on a worker: its stream's work, awaited below
        return dec.decode_record(rec), record_ready(dec.device)

    got = list(_POOL.get().map(here, recs))
    for _, ready in got:  # the caller's stream waits for every worker's (no host wait)
        await_ready(ready, dec.device)
    return KVCache(dec.header.layout, [layer for layer, _ in got], start)
