"""Where fetched entries become tensors: the decoder an entry gets for a target device, the
LayerStream over an entry already in memory (viewed in place, copied once, or decoded frame by
frame), and the grouped read of many entries bound for a GPU (``Client.retrieve_streams``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kdn.client.dataplane import Fetched
from kdn.codec.format import parse_header
from kdn.wire import Frame, FrameMessage

if TYPE_CHECKING:  # the tensor side loads on first use: admin tools run without torch
    import torch

    from kdn.client.stream import LayerStream, StreamTimings
    from kdn.codec import StreamDecoder
    from kdn.layout import KVLayout


def tensor_side() -> Any:
    """``kdn.client.stream`` (LayerStream, StreamTimings), imported on the first tensor read."""
    from kdn.client import stream

    return stream


def new_timings(**fields: float) -> StreamTimings:
    return tensor_side().StreamTimings(**fields)  # type: ignore[no-any-return]


def decoder_for(header: bytes | memoryview, device: torch.device | str | None,
             got: Fetched | None = None) -> tuple[StreamDecoder, torch.device]:
    """The decoder of an entry for ``device``, and the target device. For a CUDA target,
    compressed modes decode on the GPU (their small encoded bytes are what crosses); ``raw``
    decodes on the CPU into views and LayerStream stages non-blocking copies (pinned: the
    segment is registered with CUDA). An entry read through the segment (``got``) is decoded
    in place and, when the server checked it there, not hashed again."""
    import torch

    from kdn.codec import StreamDecoder

    target = torch.device(device or "cpu")
    parsed = got.parsed() if got is not None else parse_header(header)
    on_host = target.type == "cuda" and parsed.mode == "raw"
    return StreamDecoder(parsed, "cpu" if on_host else target,
                         borrow=got is not None and got.owned,
                         checked=got is not None and got.checked), target


def on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and str(device).startswith("cuda")


def stream_of(got: Fetched, device: torch.device | str | None,
               timings: StreamTimings, segment: Any = None) -> LayerStream:
    """A LayerStream over an entry already in memory (decoded on the worker pool). An entry in
    ``segment`` bound for a GPU registers the segment with CUDA first (pinned views)."""
    timings.header = time.perf_counter()
    dec, target = decoder_for(got.parts.header, device, got)
    pinned = got.pinned
    if got.owned and not pinned and target.type == "cuda" and segment is not None:
        pinned = (segment.register_with_cuda()  # type: ignore[assignment]
                  and got.container is not None and segment.holds(got.container))
    layers = None
    if got.container is not None:  # the whole entry at once (kdn.codec.inplace)
        if got.owned and got.container.readonly:  # the read arena's registered pages (GPU)
            layers = (dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
                      if target.type == "cuda" else dec.copy_entry(got.container))
        elif got.owned:  # in place: the segment region is the caller's (pinned for a GPU)
            layers = dec.view_entry(got.container, None if got.checked else
                                    list(got.parts.frames))  # type: ignore[arg-type]
        elif target.type == "cpu":  # the in-process tier's checked bytes: one copy, views
            layers = dec.copy_entry(got.container)
        else:  # its pinned bytes (checked as they came in) are the host-to-device copy's source
            layers = dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
    if layers is not None:
        timings.bytes_received = len(got.container)  # type: ignore[arg-type]
        return tensor_side().LayerStream(dec, iter(()), got.tier, lambda: None, timings,
                                          target, layers=layers, pinned=pinned)
    frames = iter([FrameMessage(Frame(i, f)) for i, f in enumerate(got.parts.frames)])
    return tensor_side().LayerStream(dec, frames, got.tier, lambda: None, timings, target,
                                      inline=dec.borrows, pinned=pinned)


def device_streams(client: Any, ns: str, ks: Sequence[bytes], layout: KVLayout | None,
                   device: torch.device | str | None, request_id: str | None, seg: Any,
                   started: float) -> list[LayerStream | None]:
    """``Client.retrieve_streams`` of keys ``ks`` bound for a GPU (``client``: the Client,
    ``seg``: its shared segment). The host bytes are only copy sources. In-process hits hold
    nothing of the server's: all their copies are queued at once. The rest is read in groups
    that fill a quarter of the segment, and each group's regions and leases go back once its
    copies are done (the group before is settled after the next one is asked for: two in
    flight), so a context larger than the segment and the arena never falls back to streams.
    The first group, one entry, gives the size the others are counted by."""
    out: list[LayerStream | None] = [None] * len(ks)
    rest = []
    for j, k in enumerate(ks):
        hit = client._in_process(ns, k, layout)
        if hit is None:
            rest.append(j)
        else:
            out[j] = stream_of(hit, device, new_timings(started=started), seg)
    budget, size, done = max(1, seg.size // 4), 0, 0
    held: list[LayerStream | None] = []
    while done < len(rest):
        group = rest[done:done + (max(1, budget // size) if size else 1)]
        done += len(group)
        got = client._entries(ns, [ks[j] for j in group], layout, request_id, pinned=True,
                              in_process=False)
        streams: list[LayerStream | None] = []
        for j, g in zip(group, got):
            if isinstance(g, Fetched):
                size = max(size, len(g.container) if g.container is not None
                           else sum(map(len, g.parts.frames)))
                out[j] = stream_of(g, device, new_timings(started=started), seg)
            elif g is not None:  # too large for the segment: its own stream
                out[j] = client.retrieve_stream(ks[j], namespace=ns, layout=layout,
                                                device=device, request_id=request_id)
            streams.append(out[j])
        for st in held:
            if st is not None:
                st.settle_copies()
        held = streams
    return out  # the last group's copies run on while the caller starts
