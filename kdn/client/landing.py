"""Where fetched entries become tensors: the decoder an entry gets for a target device, the
LayerStream over an entry already in memory (viewed in place, copied once, or decoded frame by
frame), the join of consecutive in-process blocks into one LayerStream, and the stream of an
entry still landing from the network data path (``PendingStream``). Nothing here reads from
the server: the bytes come from ``kdn.client.reads``."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any

from kdn.checks import whole
from kdn.client.deadline import wait_end, wait_left, wait_span
from kdn.client.parallel import layer_groups
from kdn.client.received import Fetched, as_expected
from kdn.codec.format import parse_header, sums_checked_later
from kdn.errors import Cancelled, again, kept
from kdn.layout import Expected
from kdn.transport.wire import Frame, FrameMessage

if TYPE_CHECKING:  # the tensor side loads on first use: admin tools run without torch
    import torch

    from kdn.cache import KVCache
    from kdn.client.stream import LayerStream, StreamTimings
    from kdn.codec import StreamDecoder
    from kdn.codec.inplace import Span


def tensor_side() -> Any:
    """``kdn.client.stream`` (LayerStream, StreamTimings), imported on the first tensor read."""
    from kdn.client import stream

    return stream


def new_timings(**fields: float) -> StreamTimings:
    return tensor_side().StreamTimings(**fields)  # type: ignore[no-any-return]


def decoder_for(header: bytes | memoryview, device: torch.device | str | None,
                got: Fetched | None = None, *, received: bool = False
                ) -> tuple[StreamDecoder, torch.device]:
    """The decoder of an entry for ``device``, and the target device. For a CUDA target,
    compressed modes decode on the GPU (their small encoded bytes are what crosses); ``raw``
    decodes on the CPU into views and LayerStream stages non-blocking copies (pinned: the
    segment is registered with CUDA). An entry read through the segment (``got``) is decoded
    in place and, when the server checked it there, not hashed again. ``received``: the frames
    will be those of a stream this client receives (messages nothing else holds: decoded in
    place, ``Fetched.private``)."""
    from kdn.codec.api import StreamDecoder, target_device

    target = target_device(device, here=False)  # the name checked (LayerStream: the device)
    parsed = got.parsed() if got is not None else parse_header(header)
    on_host = target.type == "cuda" and parsed.mode == "raw"
    return StreamDecoder(parsed, "cpu" if on_host else target,
                         borrow=got is not None and got.owned,
                         checked=got is not None and got.checked,
                         private=received or got is not None and got.private), target


def span_of(got: Fetched, device: torch.device | str | None) -> Span | None:
    """``StreamDecoder.staging_span`` of the entry for ``device`` (the same for any device: a
    ``raw`` entry's host bytes, else None), kept in ``got.memo`` where its holder keeps one (the
    in-process tier, whose bytes never change under a key): a repeated hit derives nothing."""
    memo = got.memo
    if memo is not None and "span" in memo:
        return memo["span"]  # type: ignore[no-any-return]
    dec, _ = decoder_for(got.parts.header, device, got)
    sp = dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
    if memo is not None:
        memo["span"] = sp
    return sp


def on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and str(device).startswith("cuda")


def pinned_for(got: Fetched, target: torch.device, segment: Any = None) -> bool:
    """Whether ``got``'s bytes are page-locked or registered for a GPU target (an entry in
    ``segment`` registers the segment with CUDA first)."""
    pinned = bool(got.pinned)
    if got.owned and not pinned and target.type == "cuda" and segment is not None:
        pinned = bool(segment.register_with_cuda()
                      and got.container is not None and segment.holds(got.container))
    return pinned


def decoded_together(hits: Sequence[Fetched], device: torch.device | str | None,
                     started: float, segment: Any = None) -> list[LayerStream] | None:
    """Entries bound for a GPU (the blocks of one context), all decoded in ONE call of their
    mode's whole-entry decoder (``Mode.decode_layers``: a fixed number of launches for any
    number of entries and layers, one check for all, when the first layer is waited for);
    a LayerStream each. None where that does not apply (not CUDA, a mode without such a
    decoder, entries of different modes, levels or dtypes): then ``stream_of`` each. Each
    step's host time is added to ``kdn.codec.gpu_source.SECONDS`` (``land.*``)."""
    if not on_cuda(device) or len(hits) < 2:
        return None
    from kdn.codec.gpu_source import lap

    t = time.perf_counter()
    decs = [decoder_for(g.parts.header, device, g) for g in hits]
    first = decs[0][0]
    kind = (first.mode.name, first.level, first.header.layout.dtype)
    if any((d.mode.name, d.level, d.header.layout.dtype) != kind or d.device.type != "cuda"
           for d, _ in decs):
        return None
    from kdn.codec.api import decoded_beside, entry_bodies  # the tensor side, on first use

    bodies, addresses, specs, counts, waits = [], [], [], [], []
    for g, (d, _) in zip(hits, decs):
        got = entry_bodies(d.header, g.parts.frames, hashed=d.checked)
        if not d.checked:  # the sums computed beside the decode, waited for by its check
            waits.append(sums_checked_later(d.header, g.parts.frames))
        bodies += got.bodies
        addresses += got.addresses
        specs += got.specs
        counts.append(len(got.specs))
    target = decs[0][1]
    pinned = all(pinned_for(g, target, segment) for g in hits)
    t = lap("land.bodies", t)
    done = decoded_beside(waits, lambda: first.mode.decode_layers(
        bodies, specs, first.level, first.device, pinned=pinned, addresses=addresses))
    t = lap("land.decode", t)
    if done is None:
        return None  # stream_of each (which checks the sums again: nothing waited for)
    out, at = [], 0
    for g, (d, _), n in zip(hits, decs, counts):
        timings = new_timings(started=started)
        timings.header = time.perf_counter()
        timings.bytes_received = g.parts.nbytes
        out.append(tensor_side().LayerStream(  # records come in layer order, frame by frame
            d, iter(()), g.tier, lambda: None, timings, target,
            layers=done.layers[at : at + n], check=done.check, ready=decode_ready(done)))
        at += n
    lap("land.streams", t)
    return out


DIRECT_MAX_BYTES = 16 << 20
"""``direct_kv`` takes entries below this size (larger ones are copied on the codec's worker
pool, ``stream_of``)."""


def direct_kv(got: Fetched) -> KVCache | None:
    """The KVCache of a ``raw`` entry in memory, for the CPU, made in one step with no
    decoder or LayerStream (what ``stream_of(got, "cpu").result()`` gives, ~0.1 ms less of
    Python a read): views of the segment region where it is the caller's, else of one copy
    checked as it is made (``kdn.codec.inplace``; a copy made without hashing of bytes
    verified already: ``checked``), shapes from the entry's memoised plan, so the cache is
    not validated again. None where that does not apply (another mode, no plan, a large
    entry, frames apart): then ``stream_of``."""
    from kdn.cache import KVCache
    from kdn.codec import inplace

    container = got.container
    header = got.parsed()
    if container is None or header.mode != "raw" or len(container) >= DIRECT_MAX_BYTES:
        return None
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None
    if got.owned and not container.readonly:  # the segment region: the caller's
        layers = (inplace.views(header, container) if got.checked else
                  inplace.verified_views(header, got.parts.frames,  # type: ignore[arg-type]
                                         container, readonly=False))
    else:  # the read arena's pages, the in-process tier's, an inline answer's: one copy
        layers = inplace.copied(header, container, verify=not got.checked)
    if layers is None:
        return None
    return KVCache.of_views(header.layout, list(layers), int(header.entry.start_position))


def decode_ready(done: Any) -> Any:
    """What a consumer's stream waits for before it uses the layers of a whole-entry GPU
    decode (``gpu_batch.Decoded``): its kernels, queued on the decoding thread's stream (a
    landing thread's, a worker's: not the consumer's). None off CUDA."""
    ready = getattr(done, "ready", None)
    if ready is None:
        return None
    return tensor_side().Copy(ready, (), span=getattr(done, "out", None))


def stream_of(got: Fetched, device: torch.device | str | None,
               timings: StreamTimings, segment: Any = None) -> LayerStream:
    """A LayerStream over an entry already in memory (decoded on the worker pool). An entry in
    ``segment`` bound for a GPU registers the segment with CUDA first (pinned views)."""
    timings.header = time.perf_counter()
    dec, target = decoder_for(got.parts.header, device, got)
    pinned = pinned_for(got, target, segment)
    layers = None
    if got.container is not None:  # the whole entry at once (kdn.codec.inplace)
        if got.owned and got.container.readonly:  # the read arena's registered pages (GPU)
            layers = (dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
                      if target.type == "cuda" else dec.copy_entry(got.container))
        elif got.owned:  # in place: the segment region is the caller's (pinned for a GPU)
            layers = dec.view_entry(got.container, None if got.checked else
                                    list(got.parts.frames))  # type: ignore[arg-type]
        elif target.type == "cpu":  # the in-process tier's checked bytes, an inline answer's
            layers = dec.copy_entry(got.container)  # bytes (checked on the copy): one copy
        elif pinned:  # the tier's pinned bytes (checked as they came in): the H2D copy's source
            layers = span_of(got, device)
    elif got.private:  # a received stream's messages, checked as they landed: views of them
        layers = dec.view_frames(got.parts.frames)  # type: ignore[arg-type]
    if layers is None and target.type == "cuda":
        # compressed: the whole entry in a few launches on the GPU, checked once, when the
        # consumer first waits for a layer
        done = dec.decode_frames(got.parts.frames, pinned=bool(pinned))
        if done is not None:
            timings.bytes_received = got.parts.nbytes
            return tensor_side().LayerStream(dec, iter(()), got.tier, lambda: None, timings,
                                              target, layers=done.layers, check=done.check,
                                              ready=decode_ready(done))
    if layers is not None:
        timings.bytes_received = got.parts.nbytes
        return tensor_side().LayerStream(dec, iter(()), got.tier, lambda: None, timings,
                                          target, layers=layers, pinned=pinned)
    frames = iter([FrameMessage(Frame(i, f)) for i, f in enumerate(got.parts.frames)])
    return tensor_side().LayerStream(dec, frames, got.tier, lambda: None, timings, target,
                                      inline=dec.borrows, pinned=pinned)


def joined_stream(hits: list[Fetched], device: torch.device | str | None,
                  timings: StreamTimings) -> LayerStream | None:
    """In-process hits of consecutive blocks of one context (``raw``, one layout, as many
    tokens each) as ONE LayerStream of the whole context: each layer's K and V joined along
    tokens. The entries' bytes are the sources of the join, never handed out. Bound for a GPU:
    the layers cross in groups (``copy_groups``): per group, one host-to-device copy per
    entry into one device buffer (every group's copies queued before any join), and on a
    second stream, while the next group crosses, one strided copy per K and V of each of its
    layers into views of one allocation; a layer is ready once its group is joined
    (a per-block stream costs views, a stream and a wait per layer for each entry, and the
    join a cat per layer over every block: host work as long as the copies on a short
    context). Into CPU tensors: one cat per K
    and V over views of the tier's bytes (no copy of each entry first). None where that does
    not apply (another mode, another layout, unequal entries, bytes not pinned for a GPU)."""
    import torch

    from kdn.codec.api import target_device

    if not hits or any(h.container is None for h in hits):
        return None
    first = span_of(hits[0], device)
    if first is None:
        return None
    head = hits[0].parsed()
    start, tokens = head.entry.start_position, head.tokens
    n, lb = len(hits), first.base.numel()
    target = target_device(device)  # InvalidArgument for a device not here

    def spans() -> Iterator[Span | None]:
        """Each hit's span (the first's, then each later one's once it is checked to be
        the next block of the same layout and shape), or None and stop. Equal shapes are not
        one layout: another model's, or another pruning's with the same counts, would be
        labelled with the first's."""
        yield first
        for j, got in enumerate(hits[1:], 1):
            sp = span_of(got, device)
            if sp is None or sp.specs != first.specs or sp.base.shape != first.base.shape \
                    or sp.base.dtype != first.base.dtype \
                    or (hdr := got.parsed()).layout.fingerprint != head.layout.fingerprint \
                    or hdr.entry.start_position != start + j * tokens:
                yield None  # not one run of consecutive blocks of one layout and shape
                return
            yield sp

    stream = tensor_side()
    ready: list[Any] = []
    if target.type == "cuda":
        if not all(h.pinned for h in hits):
            return None
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        current = torch.cuda.current_stream(target)
        side, join = stream.side_stream(target), stream.side_stream(target, "join")
        groups = copy_groups(first.specs, lb * first.base.element_size())
        dev = torch.empty((n, lb), dtype=first.base.dtype, device=target)
        side.wait_stream(current)  # the buffer is the caller's stream's: its work first
        dev.record_stream(side)  # not reused before the side streams are done with it
        sources: list[torch.Tensor] = []
        landed = []
        # every group's copies queued first, then the joins: a group's joins launched
        # between its copies and the next group's would leave the copy engine idle
        with torch.cuda.stream(side):  # entered once: per copy it cost as much as the copy
            for g, (_, _, lo, hi) in enumerate(groups):
                into = dev[:, lo:hi]
                if g == 0:  # each entry's copy queued as soon as the entry is checked
                    for j, sp in enumerate(spans()):
                        if sp is None:  # the copies queued finish before their sources go
                            side.synchronize()
                            return None
                        into[j].copy_(sp.base[lo:hi], non_blocking=True)
                        sources.append(sp.base)
                else:
                    for j, base in enumerate(sources):
                        into[j].copy_(base[lo:hi], non_blocking=True)
                landed.append(torch.cuda.Event())
                landed[-1].record(side)
        sizes = [math.prod(shape) * n for shape, _, _ in first.specs]
        flat = torch.empty(sum(sizes), dtype=dev.dtype, device=target)  # every layer's K, V
        outs = [part.view(shape[0], n * shape[1], *shape[2:]) for part, (shape, _, _)
                in zip(flat.split(sizes), first.specs)]
        join.wait_stream(current)  # the caller's stream's work on these blocks first
        dev.record_stream(join)
        flat.record_stream(join)
        with torch.cuda.stream(join):
            for (first_layer, end_layer, _, _), copied in zip(groups, landed):
                join.wait_event(copied)  # the group joins while the next group crosses
                for i in range(2 * first_layer, 2 * end_layer):
                    shape, stride, at = first.specs[i]
                    src = dev.as_strided((n, *shape), (lb, *stride), at).transpose(0, 1)
                    outs[i].view(shape[0], n, *shape[1:]).copy_(src)
                joined = torch.cuda.Event()
                joined.record(join)
                # every group's copies read every entry: each group holds them all until awaited
                ready += [stream.Copy(joined, tuple(sources))] * (end_layer - first_layer)
    else:
        all_spans = list(spans())
        if None in all_spans:
            return None
        outs = [torch.cat([sp.base.as_strided(shape, stride, at)  # type: ignore[union-attr]
                           for sp in all_spans], dim=1) for shape, stride, at in first.specs]
    timings.header = timings.first_layer = timings.last_frame_received = time.perf_counter()
    timings.bytes_received = sum(len(h.container or b"") for h in hits)
    dec, _ = decoder_for(hits[0].parts.header, device, hits[0])  # once the copies are queued
    return stream.LayerStream(dec, iter(()), hits[0].tier, lambda: None, timings, target,
                              layers=list(zip(outs[0::2], outs[1::2])), ready=ready or None,
                              blocks=n, tokens=n * tokens)


LAYER_GROUP_BYTES = 8 << 20
"""The least bytes of one entry a layer group of a joined load copies (each group is one
host-to-device copy per entry: more groups land the first layers sooner, for more copies;
copies much smaller than this, queued one by one from Python, fall behind the copy engine)."""
MAX_LAYER_GROUPS = 8


def copy_groups(specs: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...],
                entry_bytes: int) -> list[tuple[int, int, int, int]]:
    """Consecutive layers of an entry viewed in place (``Span.specs``: K and V of each layer)
    split into groups (``parallel.layer_groups``; the last one's last quarter a group of its
    own, so that less is joined after the last copy) that each lie in their own range of the
    entry's elements, in layer order: (first layer, end layer, lo, hi) each. One group of
    every layer, over the whole entry, where the views do not lie in layer order."""
    layers = len(specs) // 2
    ends = [at + sum((d - 1) * st for d, st in zip(shape, stride)) + 1
            for shape, stride, at in specs]
    whole = [(0, layers, 0, max(ends, default=0))]
    count = min(MAX_LAYER_GROUPS, entry_bytes // LAYER_GROUP_BYTES)
    if count < 2 or layers < 2:
        return whole
    out, lo = [], 0
    split = layer_groups(layers, count)
    a, b = split[-1]
    if b - a >= 4:  # the last group's join is all that is left once the last copy is in:
        split[-1:] = [(a, b - (b - a) // 4), (b - (b - a) // 4, b)]  # its last quarter alone
    for a, b in split:
        start = min(specs[i][2] for i in range(2 * a, 2 * b))
        if start < lo:  # a view of this group lies before the last group's end
            return whole
        lo = max(ends[2 * a:2 * b])
        out.append((a, b, start, lo))
    return out


ANY = Expected()
"""What a read that asks nothing of its entries expects."""


class PendingStream:
    """A LayerStream of an entry still landing (``NetPath.start_get_many``): made the moment
    its bytes are in and checked (``stream_of``, on the thread that received them: for a GPU
    its host-to-device copy is queued then), while the caller goes on; each wait waits for
    that first. Its entry's error (a dropped connection, a damaged frame) is raised from
    every wait. Offers what a caller of ``Client.retrieve_streams`` uses of a LayerStream."""

    blocks = 1
    in_process = False

    def __init__(self, entry: Future[Fetched], tier: str, device: torch.device | str | None,
                 timings: StreamTimings,
                 on_landed: Callable[[Fetched], object] | None = None,
                 want: Expected = ANY) -> None:
        from kdn.codec.api import target_device

        self.tier = tier
        self.timings = timings
        # named here: "cuda" is this thread's current device, not the landing thread's
        self._device = target_device(device, here=False)
        self._on_landed = on_landed
        self._want = want  # what the entry must be (``as_expected``), checked as it lands
        self._done = threading.Event()
        self._stream: LayerStream | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._entry: Future[Fetched] | None = entry
        entry.add_done_callback(self._landed)

    def _landed(self, entry: Future[Fetched]) -> None:
        try:
            got = as_expected(self._want, entry.result())
            if self._on_landed is not None:
                self._on_landed(got)
            if not self._cancelled:
                self._stream = stream_of(got, self._device, self.timings)
        except CancelledError:  # cancelled before it landed: as a LayerStream cancelled
            self._error = Cancelled("retrieve cancelled")
        except BaseException as exc:  # raised from the waits
            self._error = kept(exc)  # its traceback's frames would keep this stream
        # the future keeps this callback, so a stream that kept the future would be a cycle:
        # the entry's buffers (recycled as soon as nothing refers to them) would wait for the
        # garbage collector, and every hit until then would take fresh memory
        self._entry = None
        self._done.set()

    def landed(self, timeout: float | None = None) -> LayerStream:
        """The stream once the entry is in; its error if it failed."""
        if not self._done.wait(wait_span(timeout)):
            raise TimeoutError(f"the entry did not land in {timeout} s")
        if self._error is not None:  # let go by the caller: whatever ended it (its stripe
            if self._cancelled:      # shut by this or another stream's cancel), Cancelled
                raise Cancelled("retrieve cancelled")
            raise again(self._error)  # a copy: its traceback holds the frames that hold this
        if self._stream is None:
            raise Cancelled("retrieve cancelled")
        return self._stream

    @property
    def layout(self) -> Any:
        return self.landed().layout

    @property
    def num_tokens(self) -> int:
        return self.landed().num_tokens

    @property
    def start_position(self) -> int:
        return self.landed().start_position

    def wait_for_layer(self, i: int, timeout: float | None = None, *,
                       stream: Any = None) -> Any:
        end = wait_end(timeout)  # one timeout for the whole call: the landing and the layer
        try:
            return self.landed(timeout).wait_for_layer(i, wait_left(end), stream=stream)
        except TimeoutError:
            raise TimeoutError(f"layer {i} not ready after {timeout} s") from None

    def is_ready(self, i: int) -> bool:
        """Layer i is decoded: InvalidArgument for an index below 0 (or, once the entry
        landed, past its layers), as a LayerStream's."""
        whole("layer index", i)
        return self._stream is not None and self._stream.is_ready(i)

    def result(self, timeout: float | None = None) -> Any:
        end = wait_end(timeout)
        return self.landed(timeout).result(wait_left(end))

    def settle_copies(self) -> None:
        self._done.wait()
        if self._stream is not None:
            self._stream.settle_copies()

    def cancel(self) -> None:
        """Let go of the entry: one still landing is abandoned (``NetPath.start_get_many``
        reads and drops its bytes while another entry of its stripe is awaited, else shuts
        the stripe's connection), one landed is let go."""
        self._cancelled = True
        entry = self._entry
        if entry is not None:
            entry.cancel()
        if self._stream is not None:
            self._stream.cancel()
