"""Layer-by-layer reception of one Retrieve stream.

Lifecycle: ``Client.retrieve_stream`` issues the RPC, reads the header message itself (so a miss
is known at once), then hands the rest of the stream to a ``LayerStream``. A reader thread pulls
frames off the wire and submits each to the codec's worker pool; every decoded layer sets its
own event. Callers use layer i as soon as it is ready:

    stream = client.retrieve_stream(key)
    for i in range(stream.layout.num_layers):
        k, v = stream.wait_for_layer(i)        # blocks only until layer i is decoded
    kv = stream.result()                       # the whole KVCache

On CUDA, frames are decoded on the CPU, staged in pinned host memory and copied with
non-blocking transfers on a side stream; ``wait_for_layer`` makes the caller's current stream
wait for that layer's copy event instead of blocking the host.

An error anywhere (wire, checksum, decode) is raised from every pending and later wait.
``cancel()`` cancels the RPC so the server stops sending, and the reader decodes no more of
its frames (nor do the workers). At exit every stream still read is stopped so, and its
reader joined (``STOP_WAIT_S`` at most): a torch decode on a daemon thread while the
interpreter finalizes aborts the process.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kdn.cache import KVCache
from kdn.checks import whole
from kdn.client import metrics as client_metrics
from kdn.client.deadline import wait_end, wait_left, wait_span
from kdn.client.received import LOCAL_TIER
from kdn.codec import StreamDecoder
from kdn.codec.api import target_device
from kdn.codec.inplace import EntryViews, Span
from kdn.errors import Cancelled, Corrupt, InvalidArgument, again, kept
from kdn.layout import KVLayout
from kdn.pools import SharedPool
from kdn.status import from_grpc
from kdn.transport.buffers import OVERLAP_FRAME_BYTES

LayerKV = tuple[torch.Tensor, torch.Tensor]
_POOL = SharedPool(max(2, os.cpu_count() or 2), "kdn-recv")
_DONE = threading.Event()
"""The readiness of a layer that was ready when its stream was made (one event, set)."""
_DONE.set()
STOP_WAIT_S = 5.0
"""Seconds the exit waits, in all, for the readers of streams still read (``stop_readers``)."""
_OPEN: set[LayerStream] = set()
"""The streams whose reader thread runs."""
_OPEN_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """Frame decoders shared by all streams of the process (zstd and torch release the GIL)."""
    return _POOL.get()


@dataclass
class StreamTimings:
    """Wall-clock marks (perf_counter seconds) of one retrieve, for TTFT breakdowns."""

    started: float = 0.0
    header: float = 0.0
    first_layer: float = 0.0
    last_frame_received: float = 0.0
    done: float = 0.0
    bytes_received: int = 0
    layer_ready: dict[int, float] = field(default_factory=dict)
    decode_s: float = 0.0
    """Seconds spent decoding frames, summed over frames (threads overlap them)."""


_SIDE: dict[tuple[int, str], Any] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(device: torch.device, role: str = "copy") -> Any:
    """The process's one stream for host-to-device copies of retrieved layers on ``device``
    (copies share the copy engine anyway; a stream per retrieve made the caching allocator
    keep a pool per stream); ``role="join"``: its one stream for the device-side copies that
    join staged layers (``landing.joined_stream``), so they overlap the next host copies.
    ``device`` without an index: the current device's (the one its stream is made on)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE.get((index, role))
        if stream is None:
            stream = _SIDE[index, role] = torch.cuda.Stream(torch.device("cuda", index))
        return stream


def one_span(tensors: list[torch.Tensor], slack: float = 0.25
             ) -> tuple[torch.Tensor, list[int]] | None:
    """The span of host memory that ``tensors`` (CPU views of one storage, one dtype) lie in,
    as one flat tensor, and each tensor's element offset in it: copy the span once, then
    ``span_copy.as_strided(t.shape, t.stride(), offset)`` is ``t``. None when they are not
    such views, or the span holds more than ``slack`` of bytes between them."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    item = first.element_size()
    if not any(t.numel() for t in tensors):
        return None
    lo = min(int(t.storage_offset()) for t in tensors)
    hi = max(t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
             for t in tensors if t.numel())
    if (hi - lo) * item > (1 + slack) * sum(t.numel() * item for t in tensors):
        return None
    return first.as_strided((hi - lo,), (1,), lo), [int(t.storage_offset()) - lo for t in tensors]


@dataclass
class Copy:
    """A host-to-device copy on the side stream: its event, the host sources that must live
    until it is done, and, for a whole entry copied at once, the device span every layer
    views (awaited and recorded on a stream once, not once per layer)."""

    event: Any
    sources: tuple[torch.Tensor, ...]
    span: torch.Tensor | None = None
    awaited_on: list[int] = field(default_factory=list)
    """The streams (``cuda_stream`` handles) that wait for it already."""


class LayerStream:
    def __init__(self, decoder: StreamDecoder, frames: Iterator[Any], tier: str,
                 cancel: Callable[[], object], timings: StreamTimings,
                 device: torch.device | str | None = None, *, inline: bool = False,
                 layers: list[LayerKV] | Span | None = None, pinned: bool = False,
                 ready: Copy | list[Copy] | None = None, blocks: int = 1,
                 tokens: int = 0, check: Callable[[], object] | None = None,
                 window: tuple[int, int] | None = None) -> None:
        """``inline``: the frames are in memory and decode cheaply (borrowed raw bodies: only
        checksums to verify): decode them here, before returning, instead of on threads.
        ``layers``: every layer decoded already (``StreamDecoder.view_entry``), or the span of
        host bytes they view (``StreamDecoder.staging_span``); ``frames`` is then not read.
        ``pinned``: host tensors decoded here are views of page-locked memory (a segment or
        arena registered with CUDA, the pinned in-process tier), so a GPU copies from them in
        place (``Tensor.is_pinned`` does not see registered memory). ``ready``: the copy
        that brings ``layers`` (on the device already) there, waited for before any of them is
        used, or one per layer (layers that land in groups). ``blocks``: stored entries this
        stream holds, ``tokens`` their tokens (``landing.joined_stream``: a whole context in
        one stream; default one entry's). ``check``: run once, before any layer is handed
        out (the device decoder's error flag, ``kdn.codec.gpu_batch.Decoded.check``).
        ``window``: the layers ``[first, end)`` the call asked for (``first_layer``,
        ``last_layer``): the stream brings only those, a wait for another is InvalidArgument
        naming the window."""
        self.decoder = decoder
        self._check = check
        self.device = target_device(device or decoder.device)  # InvalidArgument: not here
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._pinned = pinned
        self._copy_stream = side_stream(self.device) if self.device.type == "cuda" else None
        self._events: dict[int, Copy] = {}
        """Per layer, the copy that brings it to the device (one shared by every layer when
        the whole entry is copied at once)."""
        self.tier = tier
        self.timings = timings
        self.blocks = blocks
        self._tokens = tokens or decoder.header.tokens
        n = decoder.header.layout.num_layers
        self._layers: list[LayerKV | None] = [None] * n
        self._window = window if window is not None and window != (0, n) else None
        # decoded before this returns: nothing to wait for (an error is raised by the wait)
        self._ready = ([_DONE] * n if inline or layers is not None
                       else [threading.Event() for _ in range(n)])
        self._error: BaseException | None = None
        self._cancel = cancel
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._pending: list[Future[None]] = []
        self._reader: threading.Thread | None = None
        if layers is not None:
            if isinstance(ready, list):  # what the layers wait for, known before they are placed
                self._events = dict(enumerate(ready))
            elif ready is not None:
                self._events = dict.fromkeys(range(n), ready)
            self._place_all(layers)
        elif inline:
            self._read(frames, inline=True)
        else:
            self._reader = threading.Thread(target=self._read, args=(frames,), daemon=True,
                                            name="kdn-retrieve")
            with _OPEN_LOCK:
                _OPEN.add(self)
            self._reader.start()

    @property
    def layout(self) -> KVLayout:
        return self.decoder.header.layout

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def start_position(self) -> int:
        """The position of the first token (of the first entry, where it holds several)."""
        return int(self.decoder.header.entry.start_position)

    @property
    def in_process(self) -> bool:
        """The entry came from the client's in-process tier (no transfer)."""
        return self.tier == LOCAL_TIER

    def _fail(self, exc: BaseException) -> None:
        kept(exc)  # its traceback's frames (this stream's among them) would keep the stream
        with self._lock:
            if self._error is None:
                self._error = exc
        for ev in self._ready:
            if not ev.is_set():  # most are, when a finished stream is let go (``cancel``)
                ev.set()

    def _decode(self, index: int, data: bytes) -> None:
        if self._error is not None:  # cancelled or failed: nothing of it is used
            return
        t0 = time.perf_counter()
        try:
            for layer, k, v in self.decoder.decode_frame(index, data):
                self._layers[layer] = self._place(layer, k, v)
                self.timings.layer_ready[layer] = time.perf_counter()
                if layer == 0:
                    self.timings.first_layer = self.timings.layer_ready[0]
                self._ready[layer].set()
        except BaseException as exc:  # reported to waiters
            self._fail(exc)
        finally:
            spent = time.perf_counter() - t0
            with self._lock:
                self.timings.decode_s += spent

    def _place_all(self, layers: list[LayerKV] | Span) -> None:
        now = time.perf_counter()
        placed = self._copy_whole(layers) if self._copy_stream is not None else None
        if isinstance(layers, Span):  # host views only where they are what is used
            layers = layers.views()
        for i, (k, v) in enumerate(layers):
            self._layers[i] = placed[i] if placed is not None else self._place(i, k, v)
        self.timings.layer_ready = dict.fromkeys(range(len(layers)), now)
        self.timings.first_layer = self.timings.last_frame_received = self.timings.done = now
        self._record()

    def _record(self) -> None:
        try:
            client_metrics.record(self)  # a no-op unless kdn.client.metrics is enabled
        except Exception:  # a metric never fails a load
            logging.getLogger("kdn.client").debug("client metrics", exc_info=True)

    def _place(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
        if self._copy_stream is None or k.device == self.device:  # decoded where it is used
            kv = (k, v) if k.device == self.device else (k.to(self.device), v.to(self.device))
            if self.device.type == "cuda" and layer not in self._events:
                # queued on this thread's stream (a codec worker's, not the consumer's): the
                # consumer's stream waits for it (``wait_for_layer``)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._events[layer] = Copy(event, ())
            return kv
        with torch.cuda.stream(self._copy_stream):  # views of a registered segment: pinned
            kp = k if self._pinned or k.is_pinned() else k.pin_memory()
            vp = v if self._pinned or v.is_pinned() else v.pin_memory()
            kg = kp.to(self.device, non_blocking=True)
            vg = vp.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._events[layer] = Copy(event, (kp, vp))  # pinned: live until the copy is awaited
        return kg, vg

    def _copy_whole(self, layers: list[LayerKV] | Span) -> list[LayerKV] | None:
        """Every layer to the device in ONE copy, where the host layers are views of one
        page-locked span (a whole entry viewed in place): the device layers are the same views
        of the copied span. Per-layer copies cost more in launches than in bytes (an 8k-token
        Llama-3-8B context is 2048 of them). None where that does not apply."""
        if not self._pinned:
            return None
        if isinstance(layers, (Span, EntryViews)):  # the span and each view's place in it
            known = layers if isinstance(layers, Span) else layers.span
            host, specs = known.base, known.specs
        else:
            flat = [t for kv in layers for t in kv]
            found = one_span(flat)
            if found is None:
                return None
            host = found[0]
            specs = tuple((tuple(t.shape), t.stride(), at) for t, at in zip(flat, found[1]))
        assert self._copy_stream is not None
        # allocated on the caller's stream, which uses it: the caching allocator then reuses
        # the block only after that stream's work on it; the copy waits for that work
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        staged = Copy(event, (host,), dev)  # the host span lives until the copy is awaited
        for i in range(len(specs) // 2):
            self._events[i] = staged
        views = [dev.as_strided(shape, stride, at) for shape, stride, at in specs]
        return list(zip(views[0::2], views[1::2]))

    def _read(self, frames: Iterator[Any], inline: bool = False) -> None:
        try:
            for msg in frames:
                if self._error is not None:  # cancelled (or failed): no more decoding
                    break
                data = msg.frame.data
                if msg.frame.offset:  # a layer stream never asks for frames in pieces
                    raise Corrupt(f"frame {msg.frame.index} came in pieces (offset "
                                  f"{msg.frame.offset}) on a stream that decodes whole frames")
                self.timings.bytes_received += len(data)
                if inline or self.decoder.borrows and len(data) < OVERLAP_FRAME_BYTES:
                    # a verbatim frame decodes into views: its sum is all there is to do,
                    # and a small one's costs less than the hand-over to a worker (a
                    # 512-token SmolLM2 entry, 380 KB frames, 2 cores: 27 ms handed over,
                    # 21 here)
                    self._decode(msg.frame.index, data)
                else:
                    self._pending.append(pool().submit(self._decode, msg.frame.index, data))
            self.timings.last_frame_received = time.perf_counter()
            for fut in self._pending:
                fut.result()
            missing = [i for i in range(*self._window or (0, len(self._layers)))
                       if self._layers[i] is None]  # (those outside the window: not asked)
            if missing and self._error is None:
                self._fail(InvalidArgument(f"retrieve stream ended without layers {missing}"))
            self.timings.done = time.perf_counter()
        except grpc.RpcError as err:  # the call itself, which ``_cancel`` keeps
            self._fail(from_grpc(kept(err)))
        except BaseException as exc:
            self._fail(exc)
        finally:
            with _OPEN_LOCK:
                _OPEN.discard(self)
        if self._error is None:
            self._record()

    def settle_copies(self) -> None:
        """Wait until this stream's host-to-device copies are done and let go of their host
        sources, so that the segment regions and arena leases they view go back now rather
        than when the stream dies (``Client.retrieve_streams`` of a long context). Frames
        decoded on worker threads are waited for too (their bytes go when they are decoded)."""
        if self._reader is not None:
            self._reader.join()
        self._checked()  # a device decode: its copy and kernels are done once it is checked
        for staged in self._events.values():
            staged.event.synchronize()
            staged.sources = ()

    def wait_for_layer(self, i: int, timeout: float | None = None, *,
                       stream: Any = None) -> LayerKV:
        """Layer i's (K, V) once decoded; raises the stream's error if it failed. On a GPU
        the layer is ready for work queued on ``stream`` (default: the current stream; a
        caller waiting for many streams passes it, as looking it up costs more than the
        rest of this call). InvalidArgument for an index outside [0, layers)."""
        if type(i) is not int or not 0 <= i < len(self._ready):  # (-1 was the last layer)
            self._index(i)
        if self._window is not None and not self._window[0] <= i < self._window[1]:
            raise InvalidArgument(f"layer {i} is outside the requested window "
                                  f"[{self._window[0]}, {self._window[1]}) (first_layer, "
                                  "last_layer): the stream does not bring it")
        if not self._ready[i].wait(wait_span(timeout)):
            raise TimeoutError(f"layer {i} not ready after {timeout} s")
        if self._check is not None:
            self._checked()
        layer = self._layers[i]
        if layer is None:
            assert self._error is not None
            raise again(self._error)  # a copy: its traceback holds the frames that hold this
        staged = self._events.get(i)
        if staged is not None:
            current = stream or torch.cuda.current_stream(self.device)
            if current.cuda_stream in staged.awaited_on:  # the whole entry's copy: once
                return layer
            current.wait_event(staged.event)
            if staged.span is not None:  # one copy of the whole entry: its span is the block
                staged.span.record_stream(current)
                staged.awaited_on.append(current.cuda_stream)
            else:
                for t in layer:  # made on the copy stream, used on this one: not reused before
                    t.record_stream(current)
        return layer

    def _checked(self) -> None:
        """The decode's own check, once: its error fails every layer. A thread that comes
        while another runs it waits for its outcome (no layer is handed out unchecked)."""
        if self._check is None:
            return
        with self._check_lock:
            check = self._check
            if check is None:
                return
            try:
                check()
            except BaseException as exc:
                self._layers = [None] * len(self._layers)
                self._fail(exc)
            finally:
                self._check = None

    def _index(self, i: object) -> int:
        """``i`` as a layer index of this stream; else InvalidArgument naming it and the
        stream's layer count."""
        n = len(self._ready)
        within = f" and below {n}, the stream's layers"
        index = whole("layer index", i, hint=within)
        if index >= n:
            raise InvalidArgument(f"layer index must be a whole number >= 0{within}, got "
                                  f"{index}")
        return index

    def is_ready(self, i: int) -> bool:
        """Layer i is decoded (InvalidArgument for an index outside [0, layers))."""
        i = self._index(i)
        return self._ready[i].is_set() and self._layers[i] is not None

    def result(self, timeout: float | None = None) -> KVCache:
        if self._window is not None:
            raise InvalidArgument(f"result() is every layer, and this stream brings only "
                                  f"layers [{self._window[0]}, {self._window[1]}) "
                                  "(first_layer, last_layer): wait_for_layer each of those")
        self._checked()
        if self._reader is None and self._error is None and not self._events \
                and None not in self._layers:  # decoded before the stream was returned
            layers: list[LayerKV] = self._layers  # type: ignore[assignment]
        else:
            end = wait_end(timeout)  # the whole call, not each of its waits
            if self._reader is not None:  # one wake-up once every frame is in, not one per
                self._reader.join(wait_span(timeout))  # layer (each a switch of the GIL
                # between this thread and the reader: 6.2 ms against 3.1 for 30 frames of 380 KB)
            layers = []
            for i in range(len(self._layers)):
                try:
                    layers.append(self.wait_for_layer(i, wait_left(end)))
                except TimeoutError:
                    raise TimeoutError(f"the stream's layers not ready after {timeout} s"
                                       ) from None
        return KVCache(self.layout, layers, int(self.decoder.header.entry.start_position))

    def cancel(self) -> None:
        for staged in {id(c): c for c in list(self._events.values())}.values():
            if staged.sources:  # host bytes a queued copy still reads: not let go before it
                staged.event.synchronize()
                staged.sources = ()
        self._cancel()
        self._fail(Cancelled("retrieve cancelled"))


def stop_readers(wait_s: float = STOP_WAIT_S) -> None:
    """Stop every stream still read (its call cancelled, its frames no more decoded; its
    waits raise Cancelled) and join their readers, ``wait_s`` seconds in all: run at exit,
    before the interpreter finalizes under their torch decodes."""
    with _OPEN_LOCK:
        streams = list(_OPEN)
    for stream in streams:
        stream._fail(Cancelled("retrieve stopped: the process is exiting"))
        try:
            stream._cancel()
        except Exception:  # a call already ended
            logging.getLogger("kdn.client").debug("stream cancel at exit", exc_info=True)
    end = time.monotonic() + wait_s
    for stream in streams:
        if stream._reader is not None:
            stream._reader.join(max(0.0, end - time.monotonic()))


# run in reverse order: before concurrent.futures' own (which waits for the queued decodes)
getattr(threading, "_register_atexit", atexit.register)(stop_readers)
