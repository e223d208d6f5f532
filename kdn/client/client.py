"""kdn.Client: the engine-side API over the wire contract.

    client = Client("127.0.0.1:50051")
    client.store(key, kv, mode="lossless")          # encode here, stream frames to the server
    kv = client.retrieve(key, layout=layout)        # KVCache, or None on a miss
    client.lookup(keys, prefix_chain=True)          # which exist, where, how big
    client.delete(key)
    client.blend_stream(pieces, ratio=0.15)         # server-side blend (kdn.client.blend)

One gRPC channel is created per Client and reused by every call and thread. Every call has a
deadline (``timeout_s``). Calls that fail with UNAVAILABLE are retried with exponential backoff
(``Retry``); nothing else is retried. From asyncio code use ``AsyncClient(client)``, which runs
the same methods on worker threads: there is one copy of the logic.

Every RPC method takes ``request_id`` (sent as ``x-request-id``, logged by the server; a fresh
one when None, the same for all retries of the call). ``last_request_id`` is the id of the
calling thread's latest call, so threads sharing a Client never see each other's ids.
"""

from __future__ import annotations

import functools
import os
import random
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kdn import tracing as _tracing
from kdn.addresses import data_host, same_host
from kdn.buffers import tune_allocator
from kdn.client import parallel
from kdn.client.blend import RemotePiece, blend_request
from kdn.client.dataplane import (
    STREAM_ENTRY_BYTES,
    TOO_BIG,
    DataPlane,
    Fetched,
    TooBig,
    ask_pieces,
    keeps_messages,
    received,
    received_many,
)
from kdn.client.landing import (
    decoder_for,
    device_streams,
    new_timings,
    on_cuda,
    stream_of,
    tensor_side,
    tier_joined,
)
from kdn.client.parallel import layer_groups, merged
from kdn.client.storing import grouped_store_messages, store_messages
from kdn.client.writes import WritesMixin, _encoded, _is_staged, _wire_options
from kdn.codec import EncodedParts
from kdn.codec.format import parse_container, parse_header
from kdn.errors import InvalidArgument, KDNError, LayoutMismatch, NotFound, Status, TooLarge
from kdn.keys import DEFAULT_NAMESPACE, check_key, check_namespace
from kdn.layout import KVLayout
from kdn.metadata import API_KEY_HEADER, REQUEST_ID_HEADER
from kdn.options import StoreOptions
from kdn.status import from_grpc
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from kdn.wire import (
    GROUP_INLINE_BYTES,
    get_many_response,
    retrieve_response,
    serialize_passthrough,
)

if TYPE_CHECKING:  # the tensor side loads on first use: admin tools run without torch
    import torch

    from kdn.cache import KVCache
    from kdn.client.staged import Staged
    from kdn.client.stream import LayerStream

LOCAL_TIER = "inproc"  # kdn.client.local.TIER: the in-process tier's name

T = TypeVar("T")
DEFAULT_MAX_MESSAGE = 256 << 20  # the server's default: a frame (>= one layer) is one message
DEFAULT_SHM_BYTES = 1 << 30
DEFAULT_STREAMS = 1
"""Size of the shared segment a client on the server's host uses by default."""


@dataclass(frozen=True)
class Retry:
    """Bounded retries with exponential backoff and jitter, only for the named status codes."""

    retries: int = 3
    base_s: float = 0.05
    cap_s: float = 2.0
    codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)

    def call(self, fn: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as err:
                if err.code() not in self.codes or attempt == self.retries:
                    raise
                time.sleep(min(self.cap_s, self.base_s * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class KeyInfo:
    present: bool
    tier: str
    size_bytes: int


@dataclass(frozen=True)
class LookupResult:
    infos: list[KeyInfo]
    prefix_hits: int


@dataclass(frozen=True)
class TLSOptions:
    """TLS for the channel: trust ``ca`` (PEM); present ``cert``/``key`` for mutual TLS."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""
    """Expected name in the server certificate when it differs from the address host."""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def data_path_tls(self) -> tuple[ssl.SSLContext, str]:
        """(context, expected name) for the server's network data path: the same trust as
        the channel (``ca``, else the system's roots). No client certificate is shown there:
        its calls name a ticket the channel's authenticated caller was given."""
        ctx = ssl.create_default_context(cadata=self.ca.decode() if self.ca else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx, self.server_name


F = TypeVar("F", bound=Callable[..., Any])


def _traced(name: str) -> Callable[[F], F]:
    """A span around the method when tracing is on (``kdn.tracing``); the call's metadata
    then carries it to the server."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args[0]._settle()
            if not _tracing.enabled():
                return fn(*args, **kwargs)
            with _tracing.span(name):
                return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def _settles(fn: F) -> F:
    """The method waits for this thread's asynchronous stores first (``Client._settle``)."""
    @functools.wraps(fn)
    def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        return fn(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class Client(WritesMixin):
    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout_s: float = 60.0,
        retry: Retry | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        namespace: str = DEFAULT_NAMESPACE,
        api_key: str | None = None,
        tls: TLSOptions | None = None,
        shm_bytes: int | None = None,
        keep_leases_bytes: int | None = None,
        local_bytes: int = 0,
        streams: int = DEFAULT_STREAMS,
        insecure: bool | None = None,
        tracing: bool = False,
        data_path: bool = True,
    ) -> None:
        if tracing:  # OpenTelemetry spans per call, the trace carried to the server
            _tracing.enable()
        tune_allocator()  # received messages must not fault in fresh pages (kdn.buffers)
        if insecure is None:
            insecure = os.environ.get("KDN_INSECURE", "").strip().lower() in (
                "1", "true", "yes", "on")
        if api_key and tls is None and not same_host(address) and not insecure:
            raise InvalidArgument(
                f"refusing to send an API key in plaintext to {address}: pass tls=TLSOptions("
                "ca=...) (the server's --tls-cert), or insecure=True (KDN_INSECURE=1) on a "
                "network you trust")
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.streams = max(1, streams)
        """gRPC streams one retrieve reads side by side, in layer groups, when the entry comes
        over gRPC and the caller gave its layout (``kdn.client.parallel``)."""
        self.timeout_s = timeout_s
        self.retry = retry or Retry()
        self.namespace = check_namespace(namespace)
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls is not None and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        self._tls = tls
        self._options = options
        self._channel = self._new_channel()
        self._group_calls: list[Any] = []  # Retrieve on channels of their own (parallel reads)
        self._auth: tuple[tuple[str, str], ...] = (
            ((API_KEY_HEADER, api_key),) if api_key else ())
        self._local = threading.local()
        self._stub = pb_grpc.KDNStub(self._channel)
        # Store sends hand-encoded frame messages (kdn.wire): one copy of each frame, not three
        self._store_call = self._channel.stream_unary(
            "/kdn.v1.KDN/Store", request_serializer=serialize_passthrough,
            response_deserializer=pb.StoreResponse.FromString)
        # Retrieve reads frames as views of the received messages (kdn.wire), not copies
        self._retrieve_call = self._channel.unary_stream(
            "/kdn.v1.KDN/Retrieve", request_serializer=pb.RetrieveRequest.SerializeToString,
            response_deserializer=retrieve_response)
        self._retrieve_many_call = self._channel.unary_stream(
            "/kdn.v1.KDN/RetrieveMany", request_serializer=pb.RetrieveManyRequest.SerializeToString,
            response_deserializer=retrieve_response)
        self._retrieve_many_ok = True  # False once a server answered UNIMPLEMENTED (older)
        self._store_many_call = self._channel.stream_unary(
            "/kdn.v1.KDN/StoreMany", request_serializer=serialize_passthrough,
            response_deserializer=pb.StoreManyResponse.FromString)
        self._store_many_ok = True
        self._store_many_grouped = False  # True once a server said it reads grouped StoreMany
        # inline GetMany answers: each entry's bytes a view of the received message (kdn.wire)
        self._stub.GetMany = self._channel.unary_unary(
            "/kdn.v1.KDN/GetMany", request_serializer=pb.GetManyRequest.SerializeToString,
            response_deserializer=get_many_response)
        if shm_bytes is None:
            shm_bytes = DEFAULT_SHM_BYTES if same_host(address) else 0
        if local_bytes:
            from kdn.client.local import LocalTier

            self.local: Any = LocalTier(local_bytes)
        else:
            self.local = None
        """The in-process tier (``kdn.client.local``), when ``local_bytes`` is set."""
        self._lock = threading.Lock()
        self._extra_channels: list[grpc.Channel] = []
        # without a shared segment, batches go by the server's network data path where it
        # offers one (``data_path``; plaintext servers only: kdn.server.netpath)
        self.dataplane = DataPlane(self._stub, self._call, self.metadata, timeout_s, shm_bytes,
                                   max_message_bytes, keep_leases_bytes,
                                   data_host(address) if data_path else "",
                                   tls.data_path_tls() if tls is not None else None)

    def _new_channel(self, *extra: tuple[str, int | str]) -> grpc.Channel:
        options = [*self._options, *extra]
        if self._tls is None:
            return grpc.insecure_channel(self.address, options=options)
        return grpc.secure_channel(self.address, self._tls.credentials(), options=options)

    def _retrieve_calls(self, n: int) -> list[Any]:
        """``n`` Retrieve callables, each on a channel with its own connection (the first is
        the client's own channel)."""
        with self._lock:
            while len(self._group_calls) < n - 1:
                ch = self._new_channel(("grpc.use_local_subchannel_pool", 1))
                self._extra_channels.append(ch)
                self._group_calls.append(ch.unary_stream(
                    "/kdn.v1.KDN/Retrieve",
                    request_serializer=pb.RetrieveRequest.SerializeToString,
                    response_deserializer=retrieve_response))
            return [self._retrieve_call, *self._group_calls[: n - 1]]

    @property
    def last_request_id(self) -> str:
        """The request id of this thread's latest call ("" before its first)."""
        return str(getattr(self._local, "request_id", ""))

    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Metadata of one call: the API key and ``request_id`` (a fresh one when None), which
        becomes this thread's ``last_request_id``."""
        rid = request_id or uuid.uuid4().hex[:16]
        self._local.request_id = rid
        md = (*self._auth, (REQUEST_ID_HEADER, rid))
        return tuple(_tracing.inject(list(md))) if _tracing.enabled() else md

    # -- plumbing -------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return self.retry.call(fn)
        except grpc.RpcError as err:
            raise from_grpc(err) from None

    def close(self) -> None:
        """Close the channels and give the segment back, after this thread's asynchronous
        stores are answered (another thread's: ``flush`` there first)."""
        self._settle()
        self.dataplane.close()
        for ch in (self._channel, *self._extra_channels):
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, namespace: str | None) -> str:
        return check_namespace(namespace or self.namespace)

    # -- store ----------------------------------------------------------------------------------

    @_traced("kdn.client.store")
    def store(
        self,
        key: bytes,
        kv: KVCache | EncodedParts | Staged,
        *,
        mode: str = "lossless",
        level: str = "",
        namespace: str | None = None,
        options: StoreOptions | None = None,
        layers_per_frame: int = 0,
        request_id: str | None = None,
    ) -> pb.StoreResponse:
        """Store ``kv`` (encoded here with ``mode``/``level`` unless already encoded); TTL, pin
        and durability come from ``options`` (defaults: ``StoreOptions()``). Frames hold
        ``layers_per_frame`` layers, or with 0 enough to fill ``codec.FRAME_TARGET_BYTES``."""
        check_key(key)
        if _is_staged(kv):
            return self._store_staged(self._ns(namespace), [(key, kv)], options, request_id)[0]
        parts = _encoded(kv, mode, level, layers_per_frame)
        opts = _wire_options(options)
        if self.dataplane.direct:  # through the shared segment (same host) or the data path
            done = self.dataplane.put_many(self._ns(namespace), [(key, parts, opts)],
                                           request_id)[0]
            if not isinstance(done, TooBig):
                self._remember(self._ns(namespace), key, parts)
                return done
        self._check_frames(parts)
        ns = self._ns(namespace)
        md = self.metadata(request_id)
        resp = self._call(lambda: self._store_call(
            store_messages(ns, key, parts, opts), timeout=self.timeout_s, metadata=md))
        self._remember(ns, key, parts)
        return resp

    def _check_frames(self, parts: EncodedParts) -> None:
        """Refuse, before sending anything, a frame that can not travel in one message."""
        limit = self.max_message_bytes - 1024  # the message's own fields
        for i, frame in enumerate(parts.frames):
            if len(frame) > limit:
                raise TooLarge(
                    f"frame {i} is {len(frame)} bytes, more than one message may carry "
                    f"({self.max_message_bytes} bytes: Client(max_message_bytes=...) and the "
                    "server's max_message_bytes); store fewer tokens per entry (e.g. "
                    "EngineConfig.chunk_tokens) or raise both limits")

    def _remember(self, namespace: str, key: bytes, parts: EncodedParts) -> None:
        """Keep a copy in the in-process tier (when there is one)."""
        if self.local is not None:
            self.local.put(namespace, key, parts)

    def _in_process(self, namespace: str, key: bytes, layout: KVLayout | None
                    ) -> Fetched | None:
        """The in-process tier's copy of the entry (its layout checked), or None."""
        got = self.local.get(namespace, key) if self.local is not None else None
        return None if got is None else _checked_layout(
            Fetched(got.parts, LOCAL_TIER, checked=True, header=got.header, container=got.whole,
                    pinned=self.local.pinned, memo=got.memo), layout)  # type: ignore[union-attr]

    # -- retrieve -------------------------------------------------------------------------------

    @_traced("kdn.client.fetch")
    def fetch(self, key: bytes, *, namespace: str | None = None,
              layout: KVLayout | None = None, request_id: str | None = None) -> Fetched | None:
        """The stored container of ``key`` (header + frames, undecoded), or None on a miss:
        one GetMany (through the segment on the server's host, else inline in one message),
        or a Retrieve stream for an entry too large for either."""
        req = self._retrieve_request(key, namespace, layout)
        got = self._entries(req.namespace, [req.key], layout, request_id)[0]
        if not isinstance(got, TooBig):
            return got
        md = self.metadata(request_id)

        def run() -> Fetched:
            stream = self._retrieve_call(ask_pieces(req), timeout=self.timeout_s, metadata=md)
            first = next(stream)
            got = received(first.header, stream)
            self._remember(req.namespace, req.key, got.parts)
            return got

        try:
            return self._call(run)
        except NotFound:
            return None

    @_settles
    def retrieve_stream(self, key: bytes, *, namespace: str | None = None,
                        layout: KVLayout | None = None,
                        device: torch.device | str | None = None,
                        first_layer: int = 0, last_layer: int = 0,
                        request_id: str | None = None) -> LayerStream | None:
        """Start retrieving ``key``; layers become usable one by one (``wait_for_layer``).

        None on a miss. The header arrives before this returns; frames keep arriving and are
        decoded on worker threads while the caller works on earlier layers.
        """
        req = self._retrieve_request(key, namespace, layout)
        req.first_layer, req.last_layer = first_layer, last_layer
        whole = not (first_layer or last_layer)
        if whole:  # the in-process tier, then the shared segment (same host) or data path
            started = time.perf_counter()
            got = (self._entries(req.namespace, [req.key], layout, request_id,
                                 pinned=on_cuda(device))[0]
                   if self.dataplane.direct else
                   self._in_process(req.namespace, req.key, layout))
            if isinstance(got, Fetched):
                return stream_of(got, device, new_timings(started=started),
                                  self.dataplane.segment()[0])
            if got is None and self.dataplane.direct:
                return None
        keep = (functools.partial(self._remember, req.namespace, req.key)
                if whole and self.local is not None else None)  # what the stream brings
        try:
            if whole and self.streams > 1:
                return self._grouped_stream(req, device, request_id, keep)  # type: ignore[return-value]
            return self.layer_stream(self._retrieve_call, req, device, request_id,
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
        md = self.metadata(request_id)
        if whole_read and min(self.streams, parallel.stream_cores()) == 1:
            req = ask_pieces(req)

        def run() -> LayerStream | Fetched:
            timings = new_timings(started=time.perf_counter())
            whole = self._retrieve_call(req, timeout=self.timeout_s, metadata=md)
            calls = [whole]

            def cancel() -> None:
                for call in calls:
                    call.cancel()

            try:
                head = next(whole).header
                header = head.container_header
                parsed = parse_header(header)
                n = min(self.streams, parsed.layout.num_layers, parallel.stream_cores(),
                        int(head.total_bytes) // max(1, parallel.GROUP_MIN_BYTES))
                groups = layer_groups(parsed.layout.num_layers, n) if n > 1 else []
                # the first frame wholly past the first group: the next stream brings it
                stop = next((i for i, span in enumerate(parsed.entry.frames) if groups
                             and span.first_layer >= groups[0][1]), None)
                if stop is None:  # one frame holds every group's layers: nothing to split
                    groups = []
                for start, (first, last) in zip(self._retrieve_calls(len(groups))[1:],
                                                groups[1:]):
                    part = pb.RetrieveRequest()
                    part.CopyFrom(req)
                    part.first_layer, part.last_layer = first, last
                    calls.append(start(part, timeout=self.timeout_s, metadata=md))
                firsts = [next(call).header for call in calls[1:]]
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
            dec, target = decoder_for(header, device, received=on_complete is None
                                      and keeps_messages(int(head.total_bytes)))
            frames = merged(calls, stop) if len(calls) > 1 else whole
            if on_complete is not None:
                frames = _tee(frames, header, on_complete)
            return tensor_side().LayerStream(dec, frames, head.tier, cancel, timings, target)

        return self._call(run)

    def layer_stream(self, start: Callable[..., Any], request: Any,
                     device: torch.device | str | None = None,
                     request_id: str | None = None,
                     on_complete: Callable[[EncodedParts], object] | None = None
                     ) -> LayerStream:
        """Issue a server-streaming call that answers a header then frames (Retrieve, Blend)
        and hand its frames to a LayerStream, once the header has arrived. ``on_complete``
        gets the whole entry once its last frame has arrived."""
        md = self.metadata(request_id)

        def run() -> LayerStream:
            timings = new_timings(started=time.perf_counter())
            call = start(request, timeout=self.timeout_s, metadata=md)
            first = next(call)
            timings.header = time.perf_counter()
            dec, target = decoder_for(first.header.container_header, device,
                                      received=on_complete is None
                                      and keeps_messages(int(first.header.total_bytes)))
            frames = call if on_complete is None else _tee(
                call, first.header.container_header, on_complete)
            return tensor_side().LayerStream(dec, frames, first.header.tier, call.cancel,
                                              timings, target)

        return self._call(run)

    @_traced("kdn.client.retrieve")
    def retrieve(self, key: bytes, *, namespace: str | None = None,
                 layout: KVLayout | None = None,
                 device: torch.device | str | None = None,
                 request_id: str | None = None) -> KVCache | None:
        """Retrieve and decode ``key``. None on a miss.

        The whole entry is wanted before anything is used, so without the shared segment it
        is read as ``fetch`` reads it (one message, or a stream whose messages are kept, or
        for a large entry copied into one recycled buffer) and decoded in place: decoding
        layer by layer as frames arrive only pays where a caller starts on early layers
        (``retrieve_stream``), or where an entry large enough comes over several streams
        (``streams``, ``kdn.client.parallel``)."""
        if self.dataplane.attached:
            stream = self.retrieve_stream(key, namespace=namespace, layout=layout,
                                          device=device, request_id=request_id)
            return None if stream is None else stream.result()
        started = time.perf_counter()
        req = self._retrieve_request(key, namespace, layout)
        got = self._entries(req.namespace, [req.key], layout, request_id)[0]
        if isinstance(got, TooBig):  # as fetch reads it, but a large entry over several streams
            keep = (functools.partial(self._remember, req.namespace, req.key)
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

    @_traced("kdn.client.fetch_many")
    def fetch_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                   layout: KVLayout | None = None,
                   request_id: str | None = None) -> list[Fetched | None]:
        """Stored containers of ``keys`` (None for a miss) in as few calls as fit: through the
        shared segment on the server's host, else by one grouped RetrieveMany (small entries
        inline, many a message; larger ones a message a frame), or on a server without it
        inline (GetMany) and what that did not hold in one RetrieveMany."""
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        if len(ks) > 1 and not self.dataplane.direct and self._retrieve_many_ok:
            local = [self._in_process(ns, k, layout) for k in ks]
            ask = [j for j, g in enumerate(local) if g is None]
            streamed = self._streamed(ns, [ks[j] for j in ask], layout, request_id,
                                      grouped=True) if ask else []
            if streamed is not None:
                for j, g in zip(ask, streamed):
                    local[j] = g
                return local
        got = self._entries(ns, ks, layout, request_id)
        big = [j for j, g in enumerate(got) if isinstance(g, TooBig)]
        if len(big) > 1 and self._retrieve_many_ok:
            streamed = self._streamed(ns, [ks[j] for j in big], layout, request_id)
            if streamed is not None:
                for j, g in zip(big, streamed):
                    got[j] = g
        return [self.fetch(k, namespace=ns, layout=layout, request_id=request_id)
                if isinstance(g, TooBig) else g for k, g in zip(ks, got)]

    def _streamed(self, ns: str, keys: list[bytes], layout: KVLayout | None,
                  request_id: str | None, grouped: bool = False
                  ) -> list[Fetched | None] | None:
        """``keys``' entries read by one RetrieveMany stream (each checked as ``fetch``
        checks a streamed entry, or when decoded where it came inline, and kept in the
        in-process tier); None from a server that has no RetrieveMany (then each is fetched
        on its own, as before it had). ``grouped``: small entries inline (under
        ``STREAM_ENTRY_BYTES``, at most ``inline_budget`` a message)."""
        req = pb.RetrieveManyRequest(namespace=ns, keys=keys,
                                     expect_layout_fingerprint=layout.fingerprint
                                     if layout else "")
        if grouped:
            req.grouped = True
            req.inline_max_entry_bytes = STREAM_ENTRY_BYTES - 1
            req.inline_budget_bytes = min(GROUP_INLINE_BYTES, self.dataplane.inline_budget)
        md = self.metadata(request_id)
        try:
            got = self._call(lambda: received_many(len(keys), self._retrieve_many_call(
                req, timeout=self.timeout_s, metadata=md)))
        except KDNError as exc:
            if exc.status is not Status.UNIMPLEMENTED:
                raise
            self._retrieve_many_ok = False
            return None
        for k, g in zip(keys, got):
            if g is not None:
                self._remember(ns, k, g.parts)
        return got

    def _entries(self, ns: str, keys: list[bytes], layout: KVLayout | None,
                 request_id: str | None, *, pinned: bool = False, in_process: bool = True
                 ) -> list[Fetched | TooBig | None]:
        """In-process hits (unless ``in_process`` is False: looked up already), then one batch
        (GetMany) for the rest, which is remembered. ``pinned``: bound for a CUDA device
        (``DataPlane.get_many``)."""
        out: list[Fetched | TooBig | None] = [
            self._in_process(ns, k, layout) if in_process else None for k in keys]
        ask = [j for j, f in enumerate(out) if f is None]
        if ask:
            got = self.dataplane.get_many(ns, [keys[j] for j in ask],
                                          layout.fingerprint if layout else "", request_id,
                                          pinned=pinned)
            for j, g in zip(ask, got):
                out[j] = g
                if isinstance(g, Fetched):
                    self._remember(ns, keys[j], g.parts)
        return out

    @_settles
    def retrieve_streams(self, keys: Sequence[bytes], *, namespace: str | None = None,
                         layout: KVLayout | None = None,
                         device: torch.device | str | None = None,
                         request_id: str | None = None) -> list[LayerStream | None]:
        """``retrieve_stream`` of many keys at once (None for a miss): one GetMany through the
        shared segment on the server's host, else one Retrieve stream per key, all started
        before this returns."""
        if not self.dataplane.attached:
            return [self.retrieve_stream(k, namespace=namespace, layout=layout, device=device,
                                         request_id=request_id) for k in keys]
        started = time.perf_counter()
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        seg = self.dataplane.segment()[0]
        if not on_cuda(device) or seg is None:
            got = self._entries(ns, ks, layout, request_id)
            return [self.retrieve_stream(k, namespace=ns, layout=layout, device=device,
                                         request_id=request_id) if isinstance(g, TooBig)
                    else None if g is None else stream_of(g, device, new_timings(started=started),
                                                             seg)
                    for k, g in zip(ks, got)]
        return device_streams(self, ns, ks, layout, device, request_id, seg, started)

    @_settles
    def retrieve_joined(self, keys: Sequence[bytes], *, namespace: str | None = None,
                        layout: KVLayout | None = None,
                        device: torch.device | str | None = None) -> LayerStream | None:
        """Consecutive blocks of one context, every one in the in-process tier, as one
        LayerStream of the whole context (``landing.joined_stream``); None when any is not
        there or the join does not apply (then ``retrieve_streams``)."""
        return tier_joined(self, self._ns(namespace), [check_key(k) for k in keys], layout,
                           device)

    @_traced("kdn.client.retrieve_many")
    def retrieve_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                      layout: KVLayout | None = None, device: torch.device | str | None = None,
                      request_id: str | None = None) -> list[KVCache | None]:
        """``fetch_many``, decoded (frame checksums verified) on ``device``."""
        seg = self.dataplane.segment()[0]
        return [None if f is None else stream_of(f, device, new_timings(), seg).result()
                for f in self.fetch_many(keys, namespace=namespace, layout=layout,
                                         request_id=request_id)]

    @_traced("kdn.client.store_many")
    def store_many(self, items: Sequence[tuple[bytes, KVCache | EncodedParts | Staged]], *,
                   mode: str = "lossless", level: str = "", namespace: str | None = None,
                   options: StoreOptions | None = None, layers_per_frame: int = 0,
                   request_id: str | None = None) -> list[pb.StoreResponse]:
        """Store many entries in as few calls as fit (see ``fetch_many``): through the shared
        segment on the server's host, else entries of ``STREAM_ENTRY_BYTES`` or more in one
        StoreMany stream (a message a frame) and the rest inline (PutMany, many a message).
        Each call's items are all checked before any is stored: a bad item raises and stores
        none of them."""
        ns = self._ns(namespace)
        staged = [j for j, (_, kv) in enumerate(items) if _is_staged(kv)]
        if staged:  # sent where they lie; the rest as below
            out: list[pb.StoreResponse | None] = [None] * len(items)
            done_staged = self._store_staged(ns, [items[j] for j in staged],  # type: ignore[misc]
                                             options, request_id)
            for j, r in zip(staged, done_staged):
                out[j] = r
            rest = [j for j in range(len(items)) if out[j] is None]
            for j, r in zip(rest, self.store_many(
                    [items[j] for j in rest], mode=mode, level=level, namespace=ns,
                    options=options, layers_per_frame=layers_per_frame,
                    request_id=request_id) if rest else []):
                out[j] = r
            return out  # type: ignore[return-value]
        opts = _wire_options(options)
        enc = [(check_key(k), _encoded(kv, mode, level, layers_per_frame), opts)
               for k, kv in items]
        large = [j for j, (_, parts, _) in enumerate(enc)
                 if parts.nbytes >= STREAM_ENTRY_BYTES] if not self.dataplane.direct else []
        if len(large) > 1 and self._store_many_ok:  # remote: a batch's large entries stream
            streamed = self._store_streamed(ns, [enc[j] for j in large], request_id)
            if streamed is not None:
                rest = sorted(set(range(len(enc))) - set(large))
                done_rest = self.dataplane.put_many(ns, [enc[j] for j in rest], request_id)
                done: list[pb.StoreResponse | TooBig] = [TOO_BIG] * len(enc)
                for j, r in zip(large, streamed):
                    done[j] = r
                for j, r2 in zip(rest, done_rest):
                    done[j] = r2
                return self._stored_many(ns, enc, done, options, request_id)
        done = self.dataplane.put_many(ns, enc, request_id)
        return self._stored_many(ns, enc, done, options, request_id)

    def _stored_many(self, ns: str, enc: list[tuple[bytes, EncodedParts, pb.StoreOptions]],
                     done: list[pb.StoreResponse | TooBig], options: StoreOptions | None,
                     request_id: str | None) -> list[pb.StoreResponse]:
        """``store_many``'s answers: the items no batch carried stored one by one, every
        stored one kept in the in-process tier."""
        for (k, parts, _), r in zip(enc, done):
            if not isinstance(r, TooBig):
                self._remember(ns, k, parts)
        return [self.store(k, parts, namespace=ns, options=options, request_id=request_id)
                if isinstance(r, TooBig) else r for (k, parts, _), r in zip(enc, done)]

    def _store_streamed(self, ns: str, items: list[tuple[bytes, EncodedParts, pb.StoreOptions]],
                        request_id: str | None) -> list[pb.StoreResponse] | None:
        """``items`` stored by one StoreMany stream (each entry's header, then its frames in
        the messages the encoder wrote; or grouped, every header first, to a server that said
        it reads that form: ``reads_grouped``; the server checks them all before it stores
        any); None from a server that has no StoreMany (then they go as before it had). A
        grouped stream refused as a bad request is sent once more a header per entry: a
        server replaced by an older one at the same address (or one behind a balancer that
        mixes versions) refuses the form it does not read, and nothing was stored."""
        for _, parts, _ in items:
            self._check_frames(parts)
        md = self.metadata(request_id)
        grouped = grouped_store_messages(ns, items) if self._store_many_grouped else None
        try:
            resp = self._call(lambda: self._store_many_call(
                iter(grouped) if grouped is not None else
                (m for key, parts, opts in items for m in store_messages(ns, key, parts, opts)),
                timeout=self.timeout_s, metadata=md))
        except KDNError as exc:
            if grouped is not None and exc.status is Status.INVALID_ARGUMENT:
                self._store_many_grouped = False
                return self._store_streamed(ns, items, request_id)
            if exc.status is not Status.UNIMPLEMENTED:
                raise
            self._store_many_ok = False
            return None
        self._store_many_grouped = resp.reads_grouped
        if len(resp.results) != len(items):
            raise KDNError(f"StoreMany answered {len(resp.results)} results for "
                           f"{len(items)} entries")
        return list(resp.results)

    def _retrieve_request(self, key: bytes, namespace: str | None,
                          layout: KVLayout | None) -> pb.RetrieveRequest:
        return pb.RetrieveRequest(
            namespace=self._ns(namespace), key=check_key(key),
            expect_layout_fingerprint=layout.fingerprint if layout is not None else "",
        )

    # -- blend ----------------------------------------------------------------------------------

    @_settles
    def blend_stream(self, pieces: Sequence[RemotePiece], *, ratio: float | None = None,
                     select_layer: int = 0, head_tokens: int = 0, per_chunk: bool = False,
                     store: bool = False, mode: str = "", level: str = "",
                     namespace: str | None = None, layout: KVLayout | None = None,
                     device: torch.device | str | None = None,
                     query_share: float | None = None,
                     request_id: str | None = None) -> LayerStream:
        """Start a Blend of ``pieces`` on the server (see ``kdn.client.blend``); the blended KV
        arrives layer by layer. ``stream.tier`` is "blend" when computed now, or the tier a
        stored combination (``store=True``) was read from."""
        req = blend_request(pieces, namespace=self._ns(namespace), ratio=ratio,
                            select_layer=select_layer, head_tokens=head_tokens,
                            per_chunk=per_chunk, store=store, mode=mode, level=level,
                            layout=layout, query_share=query_share)
        return self.layer_stream(self._stub.Blend, req, device, request_id)

    def blend(self, pieces: Sequence[RemotePiece], **options: Any) -> KVCache:
        """Blended KV of ``pieces`` computed by the server; options as ``blend_stream``."""
        return self.blend_stream(pieces, **options).result()

    # -- lookup / delete / stats ----------------------------------------------------------------

    @_traced("kdn.client.lookup")
    def lookup(self, keys: Sequence[bytes], *, namespace: str | None = None,
               prefix_chain: bool = False, request_id: str | None = None) -> LookupResult:
        """Which ``keys`` are stored, where (``inproc`` for the in-process tier) and how big;
        with ``prefix_chain`` also how many leading keys are present."""
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        sizes = [self.local.contains(ns, k) if self.local is not None else None for k in ks]
        infos = [KeyInfo(True, LOCAL_TIER, s) if s is not None else None for s in sizes]
        ask = [k for k, info in zip(ks, infos) if info is None]
        if ask or not ks:
            req = pb.LookupRequest(namespace=ns, keys=ask, prefix_chain=prefix_chain)
            md = self.metadata(request_id)
            resp = self._call(lambda: self._stub.Lookup(req, timeout=self.timeout_s,
                                                        metadata=md))
            remote = iter(resp.infos)
            infos = [info or _key_info(next(remote)) for info in infos]
        done = [i for i in infos if i is not None]
        hits = next((j for j, i in enumerate(done) if not i.present), len(done))
        return LookupResult(done, hits if prefix_chain else 0)

    @_settles
    def contains(self, key: bytes, *, namespace: str | None = None,
                 request_id: str | None = None) -> bool:
        return self.lookup([key], namespace=namespace, request_id=request_id).infos[0].present

    @_traced("kdn.client.delete")
    def delete(self, key: bytes | Sequence[bytes], *, namespace: str | None = None,
               request_id: str | None = None) -> int:
        keys = [key] if isinstance(key, (bytes, bytearray)) else list(key)
        req = pb.DeleteRequest(namespace=self._ns(namespace), keys=[check_key(k) for k in keys])
        if self.local is not None:
            for k in req.keys:
                self.local.discard(req.namespace, k)
        md = self.metadata(request_id)
        return int(self._call(lambda: self._stub.Delete(req, timeout=self.timeout_s,
                                                        metadata=md)).deleted)

    def stats(self, *, request_id: str | None = None) -> pb.StatsResponse:
        md = self.metadata(request_id)
        return self._call(lambda: self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s,
                                                   metadata=md))

    def health(self, service: str = "") -> str:
        """The standard gRPC health status name (SERVING, NOT_SERVING, ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = self._call(lambda: stub.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=self.timeout_s))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _key_info(info: pb.KeyInfo) -> KeyInfo:
    return KeyInfo(info.present, info.tier, info.size_bytes)


def _checked_layout(got: Fetched, layout: KVLayout | None) -> Fetched:
    """``got`` when its layout is the one the caller expects (as the server checks)."""
    if layout is not None:
        have = got.parsed().layout.fingerprint
        if have != layout.fingerprint:
            raise LayoutMismatch(f"entry has layout {have}, caller expects {layout.fingerprint}")
    return got


def _tee(call: Iterator[Any], header: bytes, on_complete: Callable[[EncodedParts], object]
         ) -> Iterator[Any]:
    """The messages of ``call``, handing the whole entry to ``on_complete`` after the last."""
    data: dict[int, bytes | memoryview] = {}
    for msg in call:
        data[msg.frame.index] = msg.frame.data  # a view of the message: the join is the copy
        yield msg
    whole = parse_container(b"".join([header, *(data[i] for i in sorted(data))]), verify=False)
    on_complete(EncodedParts(whole.header.raw, list(whole.frames)))  # type: ignore[arg-type]
