"""The read side of ``kdn.client.Client``: which source an entry comes from, and how.

A read tries, in order: the in-process tier (``Client(local_bytes=...)``, no call); the data
plane's batch (``kdn.client.dataplane``: GetMany through the shared segment or the read arena
on the server's host, the network data path on another, else inline gRPC); and for an entry
too large for a batch, a Retrieve stream (over several streams of layer groups with
``streams``, ``kdn.client.parallel``), or one RetrieveMany stream for a batch's large entries.
Whatever a read brings whole is kept in the in-process tier. Turning fetched bytes into layers
on a device is ``kdn.client.landing``'s.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kdn.client import parallel
from kdn.client.dataplane import STREAM_ENTRY_BYTES, DataPlane, TooBig
from kdn.client.deadline import time_left
from kdn.client.landing import (
    PendingStream,
    decoded_together,
    decoder_for,
    direct_kv,
    joined_stream,
    new_timings,
    on_cuda,
    stream_of,
    tensor_side,
)
from kdn.client.parallel import layer_groups, merged
from kdn.client.received import (
    LOCAL_TIER,
    Fetched,
    as_expected,
    ask_pieces,
    header_of,
    in_window,
    keeps_messages,
    layer_window,
    received,
    received_many,
)
from kdn.client.rpc import Rpc, settles, traced
from kdn.codec import EncodedParts
from kdn.codec.format import parse_container, parse_header
from kdn.errors import KDNError, NotFound, Status
from kdn.keys import check_key, check_namespace
from kdn.layout import Expected, KVLayout
from kdn.names import MAX_CALL_KEYS, call_batches
from kdn.transport.wire import GROUP_INLINE_BYTES
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:  # the tensor side loads on first use: admin tools run without torch
    import torch

    from kdn.cache import KVCache
    from kdn.client.stream import LayerStream



class Reader:
    """``Client``'s reads (module docstring): ``rpc`` its channel, ``dataplane`` its batches,
    ``local`` its in-process tier (or None), ``namespace`` the default namespace,
    ``streams`` the gRPC streams one retrieve may read side by side."""

    def __init__(self, rpc: Rpc, dataplane: DataPlane, local: Any, namespace: str,
                 streams: int) -> None:
        self.rpc = rpc
        self.dataplane = dataplane
        self.local = local
        self.namespace = namespace
        self.streams = streams
        self._retrieve_many_ok = True  # False once a server answered UNIMPLEMENTED (older)

    def _ns(self, namespace: str | None) -> str:
        return check_namespace(namespace or self.namespace)

    def ticket(self, namespace: str, key: bytes) -> int:
        """The in-process tier's ``read_ticket`` for a read of ``key`` from the server about to
        be made (0 without a tier)."""
        return self.local.read_ticket(namespace, key) if self.local is not None else 0

    def remember(self, namespace: str, key: bytes, ticket: int, parts: EncodedParts) -> None:
        """Keep a copy of what a read brought in the in-process tier (when there is one), unless
        a write of the key began after ``ticket`` was taken (``kdn.client.local``)."""
        if self.local is not None:
            self.local.put(namespace, key, parts, ticket)

    def in_process(self, namespace: str, key: bytes, want: Expected) -> Fetched | None:
        """The in-process tier's copy of the entry (checked against ``want``, as the server
        checks), or None."""
        got = self.local.get(namespace, key) if self.local is not None else None
        if got is None:
            return None
        out = Fetched(got.parts, LOCAL_TIER, checked=True, header=got.header,
                      container=got.whole, pinned=self.local.pinned,  # type: ignore[union-attr]
                      memo=got.memo)
        if want.fingerprint or want.tokens:
            header = out.parsed()
            want.check(header.layout, header.entry.tokens)
        return out

    @traced("kdn.client.fetch")
    def fetch(self, key: bytes, *, namespace: str | None = None,
              layout: KVLayout | None = None, tokens: int = 0,
              request_id: str | None = None) -> Fetched | None:
        """The stored container of ``key`` (header + frames, undecoded), or None on a miss:
        one GetMany (through the segment on the server's host, else inline in one message),
        or a Retrieve stream for an entry too large for either. ``layout``, ``tokens``: what
        the entry must be (LayoutMismatch otherwise; None / 0: any)."""
        want = Expected.of(layout, tokens)
        req = self._retrieve_request(key, namespace, want)
        got = self._entries(req.namespace, [req.key], want, request_id)[0]
        if not isinstance(got, TooBig):
            return got
        md = self.rpc.metadata(request_id)
        ticket = self.ticket(req.namespace, req.key)

        def run() -> Fetched:
            stream = self.rpc.retrieve_call(ask_pieces(req),
                                            timeout=time_left(self.rpc.timeout_s), metadata=md)
            got = as_expected(want, received(header_of(stream), stream))
            self.remember(req.namespace, req.key, ticket, got.parts)
            return got

        try:
            return self.rpc.call(run)
        except NotFound:
            return None

    @settles
    def retrieve_stream(self, key: bytes, *, namespace: str | None = None,
                        layout: KVLayout | None = None, tokens: int = 0,
                        device: torch.device | str | None = None,
                        first_layer: int = 0, last_layer: int = 0,
                        request_id: str | None = None) -> LayerStream | None:
        """Start retrieving ``key``; layers become usable one by one (``wait_for_layer``).

        None on a miss. The header arrives before this returns; frames keep arriving and are
        decoded on worker threads while the caller works on earlier layers. ``layout``,
        ``tokens``: what the entry must be (LayoutMismatch before anything is decoded).
        """
        want = Expected.of(layout, tokens)
        req = self._retrieve_request(key, namespace, want)
        req.first_layer, req.last_layer = layer_window(first_layer, last_layer)
        whole = not (first_layer or last_layer)
        if whole:  # the in-process tier, then the shared segment (same host) or data path
            started = time.perf_counter()
            got = (self._entries(req.namespace, [req.key], want, request_id,
                                 pinned=on_cuda(device))[0]
                   if self.dataplane.direct else
                   self.in_process(req.namespace, req.key, want))
            if isinstance(got, Fetched):
                return stream_of(got, device, new_timings(started=started),
                                  self.dataplane.segment()[0])
            if got is None and self.dataplane.direct:
                return None
        keep = (functools.partial(self.remember, req.namespace, req.key,
                                  self.ticket(req.namespace, req.key))
                if whole and self.local is not None else None)  # what the stream brings
        try:
            if whole and self.streams > 1:
                return self._grouped_stream(req, device, request_id, keep)  # type: ignore[return-value]
            return self.layer_stream(self.rpc.retrieve_call, req, device, request_id,
                                     on_complete=keep)
        except NotFound:
            return None

    def _grouped_stream(self, req: pb.RetrieveRequest, device: torch.device | str | None,
                        request_id: str | None,
                        on_complete: Callable[[EncodedParts], object] | None,
                        whole_read: bool = False) -> LayerStream | Fetched:
        """One retrieve over up to ``self.streams`` streams (``kdn.client.parallel``). The
        first asks for every layer, as a one-stream read does; its header tells the entry's
        size, and only an entry of ``GROUP_MIN_BYTES`` or more per stream is split, over no
        more streams than the cores receive side by side (``stream_cores``): the
        other streams then ask for the later layer groups, and the first is cancelled once
        it has brought its own group. Where their headers differ from the first's (an
        overwrite came between the calls) they are cancelled and the first reads on alone.
        ``whole_read``: an entry read over one stream is received here, as ``fetch`` receives
        it (``received``), and comes back as a Fetched (handed to ``on_complete`` first); in
        pieces (``ask_pieces``) where it can not be split (one stream, or one core pair)."""
        md = self.rpc.metadata(request_id)
        if whole_read and min(self.streams, parallel.stream_cores()) == 1:
            req = ask_pieces(req)

        def run() -> LayerStream | Fetched:
            timings = new_timings(started=time.perf_counter())
            deadline = time_left(self.rpc.timeout_s)  # this attempt's: sooner after a retry
            whole = self.rpc.retrieve_call(req, timeout=deadline, metadata=md)
            calls = [whole]

            def cancel() -> None:
                for call in calls:
                    call.cancel()

            try:
                head = header_of(whole)
                header = head.container_header
                parsed = parse_header(header)
                Expected(req.expect_layout_fingerprint, req.expect_tokens).check(
                    parsed.layout, parsed.entry.tokens)
                n = min(self.streams, parsed.layout.num_layers, parallel.stream_cores(),
                        int(head.total_bytes) // max(1, parallel.GROUP_MIN_BYTES))
                groups = layer_groups(parsed.layout.num_layers, n) if n > 1 else []
                # the first frame wholly past the first group: the next stream brings it
                stop = next((i for i, span in enumerate(parsed.entry.frames) if groups
                             and span.first_layer >= groups[0][1]), None)
                if stop is None:  # one frame holds every group's layers: nothing to split
                    groups = []
                for start, (first, last) in zip(self.rpc.retrieve_calls(len(groups))[1:],
                                                groups[1:]):
                    part = pb.RetrieveRequest()
                    part.CopyFrom(req)
                    part.first_layer, part.last_layer = first, last
                    calls.append(start(part, timeout=deadline, metadata=md))
                firsts = [header_of(call) for call in calls[1:]]
            except BaseException:
                cancel()
                raise
            if any((f.container_header, f.entry_digest) != (header, head.entry_digest)
                   for f in firsts):
                for call in calls[1:]:
                    call.cancel()
                calls[1:] = []
            if whole_read and len(calls) == 1:
                try:
                    got = received(head, whole)
                except BaseException:
                    whole.cancel()
                    raise
                if on_complete is not None:
                    on_complete(got.parts)
                return got
            timings.header = time.perf_counter()
            # views of the messages only where nothing copies them later: the in-process
            # tier's copy (``on_complete``) is taken once the last frame came, and a caller
            # may be writing to early layers by then
            try:  # (a device not here: InvalidArgument)
                dec, target = decoder_for(header, device, received=on_complete is None
                                          and keeps_messages(int(head.total_bytes)))
                frames = self.rpc.frames(merged(calls, stop) if len(calls) > 1 else whole)
                if on_complete is not None:
                    frames = _tee(frames, header, on_complete)
                return tensor_side().LayerStream(dec, frames, head.tier, cancel, timings,
                                                  target)
            except BaseException:
                cancel()
                raise

        return self.rpc.call(run)

    def layer_stream(self, start: Callable[..., Any], request: Any,
                     device: torch.device | str | None = None,
                     request_id: str | None = None,
                     on_complete: Callable[[EncodedParts], object] | None = None
                     ) -> LayerStream:
        """Issue a server-streaming call that answers a header then frames (Retrieve, Blend)
        and hand its frames to a LayerStream, once the header has arrived. ``on_complete``
        gets the whole entry once its last frame has arrived."""
        md = self.rpc.metadata(request_id)
        want = Expected(getattr(request, "expect_layout_fingerprint", ""),  # (a Blend: any)
                        getattr(request, "expect_tokens", 0))

        def run() -> LayerStream:
            timings = new_timings(started=time.perf_counter())
            call = start(request, timeout=time_left(self.rpc.timeout_s), metadata=md)
            try:  # the call cancelled where no stream takes it (a device not here, ...)
                head = header_of(call)
                timings.header = time.perf_counter()
                parsed = parse_header(head.container_header)  # (remembered: parsed once)
                want.check(parsed.layout, parsed.entry.tokens)  # before a decoder is made
                window = in_window(request, parsed.layout.num_layers)
                dec, target = decoder_for(head.container_header, device,
                                          received=on_complete is None
                                          and keeps_messages(int(head.total_bytes)))
                frames = self.rpc.frames(call) if on_complete is None else _tee(
                    self.rpc.frames(call), head.container_header, on_complete)
                return tensor_side().LayerStream(dec, frames, head.tier, call.cancel, timings,
                                                  target, window=window)
            except BaseException:
                call.cancel()
                raise

        return self.rpc.call(run)

    @traced("kdn.client.retrieve")
    def retrieve(self, key: bytes, *, namespace: str | None = None,
                 layout: KVLayout | None = None, tokens: int = 0,
                 device: torch.device | str | None = None,
                 request_id: str | None = None) -> KVCache | None:
        """Retrieve and decode ``key``. None on a miss. ``layout``, ``tokens``: what the
        entry must be (LayoutMismatch otherwise; None / 0: any).

        The whole entry is wanted before anything is used, so without the shared segment it
        is read as ``fetch`` reads it (one message, or a stream whose messages are kept, or
        for a large entry copied into one recycled buffer) and decoded in place: decoding
        layer by layer as frames arrive only pays where a caller starts on early layers
        (``retrieve_stream``), or where an entry large enough comes over several streams
        (``streams``, ``kdn.client.parallel``)."""
        want = Expected.of(layout, tokens)
        if self.dataplane.attached:
            if device is None or str(device) == "cpu":  # one GetMany, the cache made at once
                got = self._entries(self._ns(namespace), [check_key(key)], want,
                                    request_id)[0]
                if got is None:
                    return None
                if isinstance(got, Fetched):
                    kv = direct_kv(got)
                    return kv if kv is not None else stream_of(got, device, new_timings(
                        started=time.perf_counter())).result()
            stream = self.retrieve_stream(key, namespace=namespace, layout=layout,
                                          tokens=tokens, device=device, request_id=request_id)
            return None if stream is None else stream.result()
        started = time.perf_counter()
        req = self._retrieve_request(key, namespace, want)
        got = self._entries(req.namespace, [req.key], want, request_id)[0]
        if isinstance(got, TooBig):  # as fetch reads it, but a large entry over several streams
            keep = (functools.partial(self.remember, req.namespace, req.key,
                                      self.ticket(req.namespace, req.key))
                    if self.local is not None else None)
            try:
                read = self._grouped_stream(req, device, request_id, keep, whole_read=True)
            except NotFound:
                return None
            if not isinstance(read, Fetched):
                return read.result()
            got = read
        return None if got is None else stream_of(got, device,
                                                   new_timings(started=started)).result()

    # -- many entries per call ------------------------------------------------------------------

    @traced("kdn.client.fetch_many")
    def fetch_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                   layout: KVLayout | None = None, tokens: int = 0,
                   request_id: str | None = None) -> list[Fetched | None]:
        """Stored containers of ``keys`` (None for a miss) in as few calls as fit: through the
        shared segment on the server's host, else by one grouped RetrieveMany (small entries
        inline, many a message; larger ones a message a frame), or on a server without it
        inline (GetMany) and what that did not hold in one RetrieveMany. ``layout``,
        ``tokens``: what each entry must be (``fetch``)."""
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        want = Expected.of(layout, tokens)
        if len(ks) > MAX_CALL_KEYS:  # a server takes at most so many a call
            return [g for batch in call_batches(ks)
                    for g in self.fetch_many(batch, namespace=ns, layout=layout,
                                             tokens=tokens, request_id=request_id)]
        if len(ks) > 1 and not self.dataplane.direct and self._retrieve_many_ok:
            local = [self.in_process(ns, k, want) for k in ks]
            ask = [j for j, g in enumerate(local) if g is None]
            streamed = self._streamed(ns, [ks[j] for j in ask], want, request_id,
                                      grouped=True) if ask else []
            if streamed is not None:
                for j, g in zip(ask, streamed):
                    local[j] = g
                return local
        got = self._entries(ns, ks, want, request_id)
        big = [j for j, g in enumerate(got) if isinstance(g, TooBig)]
        if len(big) > 1 and self._retrieve_many_ok:
            streamed = self._streamed(ns, [ks[j] for j in big], want, request_id)
            if streamed is not None:
                for j, g in zip(big, streamed):
                    got[j] = g
        return [self.fetch(k, namespace=ns, layout=layout, tokens=tokens,
                           request_id=request_id)
                if isinstance(g, TooBig) else g for k, g in zip(ks, got)]

    def _streamed(self, ns: str, keys: list[bytes], want: Expected,
                  request_id: str | None, grouped: bool = False
                  ) -> list[Fetched | None] | None:
        """``keys``' entries read by one RetrieveMany stream (each checked as ``fetch``
        checks a streamed entry, or when decoded where it came inline, and kept in the
        in-process tier); None from a server that has no RetrieveMany (then each is fetched
        on its own). ``grouped``: small entries inline (under
        ``STREAM_ENTRY_BYTES``, at most ``inline_budget`` a message)."""
        req = pb.RetrieveManyRequest(namespace=ns, keys=keys,
                                     expect_layout_fingerprint=want.fingerprint,
                                     expect_tokens=want.tokens)
        if grouped:
            req.grouped = True
            req.inline_max_entry_bytes = STREAM_ENTRY_BYTES - 1
            req.inline_budget_bytes = min(GROUP_INLINE_BYTES, self.dataplane.inline_budget)
        md = self.rpc.metadata(request_id)
        tickets = [self.ticket(ns, k) for k in keys]
        try:
            got = self.rpc.call(lambda: received_many(len(keys), self.rpc.retrieve_many_call(
                req, timeout=time_left(self.rpc.timeout_s), metadata=md)))
        except KDNError as exc:
            if exc.status is not Status.UNIMPLEMENTED:
                raise
            self._retrieve_many_ok = False
            return None
        for k, t, g in zip(keys, tickets, got):
            if g is not None:
                self.remember(ns, k, t, as_expected(want, g).parts)
        return got

    def _entries(self, ns: str, keys: list[bytes], want: Expected,
                 request_id: str | None, *, pinned: bool = False, in_process: bool = True
                 ) -> list[Fetched | TooBig | None]:
        """In-process hits (unless ``in_process`` is False: looked up already), then one batch
        (GetMany) for the rest, which is remembered. ``pinned``: bound for a CUDA device
        (``DataPlane.get_many``)."""
        out: list[Fetched | TooBig | None] = [
            self.in_process(ns, k, want) if in_process else None for k in keys]
        ask = [j for j, f in enumerate(out) if f is None]
        tickets = {j: self.ticket(ns, keys[j]) for j in ask}
        if len(ask) == 1 and not pinned:  # one key: the short way where it applies
            one = out[ask[0]] = as_expected(want, self.dataplane.get_one(ns, keys[ask[0]], want,
                                                                       request_id))
            if isinstance(one, Fetched):
                self.remember(ns, keys[ask[0]], tickets[ask[0]], one.parts)
        elif ask:
            got = self.dataplane.get_many(ns, [keys[j] for j in ask], want, request_id,
                                          pinned=pinned)
            for j, g in zip(ask, got):
                out[j] = as_expected(want, g)
                if isinstance(g, Fetched):
                    self.remember(ns, keys[j], tickets[j], g.parts)
        return out

    @settles
    def retrieve_streams(self, keys: Sequence[bytes], *, namespace: str | None = None,
                         layout: KVLayout | None = None, tokens: int = 0,
                         device: torch.device | str | None = None,
                         request_id: str | None = None) -> list[LayerStream | None]:
        """``retrieve_stream`` of many keys at once (None for a miss): one GetMany through the
        shared segment on the server's host, else one Retrieve stream per key, all started
        before this returns. ``layout``, ``tokens``: what every entry must be (an engine's
        blocks: its layout, ``chunk_tokens`` each); one that is not fails the call
        (LayoutMismatch) before any entry is decoded."""
        started = time.perf_counter()
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        want = Expected.of(layout, tokens)
        net = self.dataplane.net() if not self.dataplane.attached and len(ks) > 1 else None
        if net is not None:
            landing = self._landing(net, ns, ks, want, device, started)
            if landing is not None:
                return landing
        if not self.dataplane.attached:
            return [self.retrieve_stream(k, namespace=namespace, layout=layout, tokens=tokens,
                                         device=device, request_id=request_id) for k in keys]
        seg = self.dataplane.segment()[0]
        if not on_cuda(device) or seg is None:
            got = self._entries(ns, ks, want, request_id)
            return [self.retrieve_stream(k, namespace=ns, layout=layout, tokens=tokens,
                                         device=device, request_id=request_id)
                    if isinstance(g, TooBig)
                    else None if g is None else stream_of(g, device, new_timings(started=started),
                                                             seg)
                    for k, g in zip(ks, got)]
        return self._device_streams(ns, ks, (layout, tokens), device, request_id, seg, started)

    def _landing(self, net: Any, ns: str, ks: list[bytes], want: Expected,
                 device: torch.device | str | None, started: float
                 ) -> list[LayerStream | None] | None:
        """``retrieve_streams`` of a remote client on the network data path: one GetMany,
        striped over the path's connections, answered before the entries' bytes come: the
        streams are handed out then (``PendingStream``), each made as its entry lands,
        checked, in page-locked memory where it is bound for a GPU (one host-to-device copy
        per entry, queued as it lands). None when the path failed (each read alone then)."""
        out: list[Any] = [self.in_process(ns, k, want) for k in ks]
        ask = [j for j, g in enumerate(out) if g is None]
        for j, g in enumerate(out):
            if g is not None:
                out[j] = stream_of(g, device, new_timings(started=started))
        if not ask:
            return out
        tickets = {j: self.ticket(ns, ks[j]) for j in ask}
        got = self.dataplane.network.start_get_many(
            net, ns, [ks[j] for j in ask], want, pinned=on_cuda(device))
        if got is None:
            return None
        for j, g in zip(ask, got):
            if g is not None:
                keep = (functools.partial(_keep, self.remember, ns, ks[j], tickets[j])
                        if self.local is not None else None)
                out[j] = PendingStream(g[1], g[0], device, new_timings(started=started), keep,
                                       want)
        return out

    def _device_streams(self, ns: str, ks: Sequence[bytes], shape: tuple[KVLayout | None, int],
                        device: torch.device | str | None, request_id: str | None, seg: Any,
                        started: float) -> list[LayerStream | None]:
        """``retrieve_streams`` of keys ``ks`` bound for a GPU (``seg``: the shared segment;
        ``shape``: the layout and tokens every entry must have).
        The host bytes are only copy sources. In-process hits hold nothing of the server's: all
        their copies are queued at once. The rest is read in groups of about a quarter of the
        segment (the first sized by the raw size, the most any encoding takes; then by the
        largest entry read). Entries copied into the segment hold its room until their copies
        are done: before a group is asked for, the oldest are waited for (``settle_copies``)
        until half the segment is left, so a context larger than the segment and the arena
        never falls back to streams; entries lent from the read arena hold none (no wait).
        Host time of each step: ``gpu_source.SECONDS`` (``read.*``; the decode's: ``land.*``)."""
        from kdn.codec.gpu_source import lap

        layout, tokens = shape
        want = Expected.of(layout, tokens)
        out: list[LayerStream | None] = [None] * len(ks)
        rest = []
        for j, k in enumerate(ks):
            hit = self.in_process(ns, k, want)
            if hit is None:
                rest.append(j)
            else:
                out[j] = stream_of(hit, device, new_timings(started=started), seg)
        budget, done = max(1, seg.size // 4), 0
        size = layout.bytes_per_token * tokens * 101 // 100 + (64 << 10) \
            if layout is not None and tokens else 0  # raw, its headers and frames at most
        held: deque[tuple[list[LayerStream | None], int]] = deque()  # (streams, bytes in seg)
        in_seg, seen, t = 0, 0, time.perf_counter()
        while done < len(rest):
            while held and in_seg > budget:  # half the segment left for the next group
                old, n = held.popleft()
                in_seg -= n
                for st in filter(None, old):
                    st.settle_copies()
            t = lap("read.settle", t)
            group = rest[done:done + (max(1, budget // size) if size else 1)]
            done += len(group)
            got = self._entries(ns, [ks[j] for j in group], want, request_id, pinned=True,
                                  in_process=False)
            t, streams, n = lap("read.entries", t), [], 0
            hits = [(j, g) for j, g in zip(group, got) if isinstance(g, Fetched)]
            together = decoded_together([g for _, g in hits], device, started, seg)
            for (j, _), one in zip(hits, together or []):
                out[j] = one
            for j, g in zip(group, got):
                if isinstance(g, Fetched):
                    seen, n = max(seen, g.parts.nbytes), n + g.parts.nbytes * (
                        g.container is None or seg.holds(g.container))  # (not the arena's)
                    if out[j] is None:
                        out[j] = stream_of(g, device, new_timings(started=started), seg)
                elif g is not None:  # too large for the segment: its own stream
                    out[j] = self.retrieve_stream(ks[j], namespace=ns, layout=layout,
                                                    tokens=tokens, device=device,
                                                    request_id=request_id)
                streams.append(out[j])
            held.append((streams, n))
            in_seg, size = in_seg + n, seen or size
            t = lap("read.streams", t)  # (decoded together: land.*, inside this)
        return out  # the last group's copies run on while the caller starts

    @settles
    def retrieve_joined(self, keys: Sequence[bytes], *, namespace: str | None = None,
                        layout: KVLayout | None = None, tokens: int = 0,
                        device: torch.device | str | None = None) -> LayerStream | None:
        """Consecutive blocks of one context, every one in the in-process tier, as one
        LayerStream of the whole context (``landing.joined_stream``); None when any is not
        there or the join does not apply (then ``retrieve_streams``). ``layout``,
        ``tokens``: what every block must be (``retrieve_streams``)."""
        ns, ks = self._ns(namespace), [check_key(k) for k in keys]
        if self.local is None or not ks or any(self.local.contains(ns, k) is None for k in ks):
            return None
        want = Expected.of(layout, tokens)
        hits = [self.in_process(ns, k, want) for k in ks]
        if any(h is None for h in hits):  # evicted since
            return None
        return joined_stream(hits, device,  # type: ignore[arg-type]
                             new_timings(started=time.perf_counter()))

    @traced("kdn.client.retrieve_many")
    def retrieve_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                      layout: KVLayout | None = None, tokens: int = 0,
                      device: torch.device | str | None = None,
                      request_id: str | None = None) -> list[KVCache | None]:
        """``fetch_many``, decoded (frame checksums verified) on ``device``."""
        seg = self.dataplane.segment()[0]
        return [None if f is None else stream_of(f, device, new_timings(), seg).result()
                for f in self.fetch_many(keys, namespace=namespace, layout=layout,
                                         tokens=tokens, request_id=request_id)]

    def _retrieve_request(self, key: bytes, namespace: str | None, want: Expected
                          ) -> pb.RetrieveRequest:
        return pb.RetrieveRequest(namespace=self._ns(namespace), key=check_key(key),
                                  expect_layout_fingerprint=want.fingerprint,
                                  expect_tokens=want.tokens)


def _keep(remember: Callable[[str, bytes, int, EncodedParts], object], ns: str, key: bytes,
          ticket: int, got: Fetched) -> None:
    remember(ns, key, ticket, got.parts)


def _tee(call: Iterator[Any], header: bytes, on_complete: Callable[[EncodedParts], object]
         ) -> Iterator[Any]:
    """The messages of ``call``, handing the whole entry to ``on_complete`` after the last."""
    data: dict[int, bytes | memoryview] = {}
    for msg in call:
        data[msg.frame.index] = msg.frame.data  # a view of the message: the join is the copy
        yield msg
    whole = parse_container(b"".join([header, *(data[i] for i in sorted(data))]), verify=False)
    on_complete(EncodedParts(whole.header.raw, list(whole.frames)))  # type: ignore[arg-type]
