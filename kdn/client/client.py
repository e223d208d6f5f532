"""kdn.Client: the engine-side API over the wire contract.

    client = Client("127.0.0.1:50051")
    client.store(key, kv, mode="lossless")          # encode here, stream frames to the server
    kv = client.retrieve(key, layout=layout)        # KVCache, or None on a miss
    client.lookup(keys, prefix_chain=True)          # which exist, where, how big
    client.delete(key)
    client.blend_stream(pieces, ratio=0.15)         # server-side blend (kdn.client.blend)

One gRPC channel is created per Client and reused by every call and thread. Every call has a
deadline: ``timeout_s`` seconds, a number > 0 (default 60), or None for none (``inf`` is None
too; InvalidArgument for anything else, ``kdn.client.rpc.check_timeout``). Calls that fail
with UNAVAILABLE are retried with exponential backoff (``Retry``); nothing else is retried,
and a delete (evict, pin, unpin too) only where it never reached the server (its count). A
server that does not answer (stopped, hung, cut off) costs a call its deadline once, on
whichever path it goes (gRPC, the same-host fast path, the network data path), and ``close``
gives its calls to the server (segment and ticket given back) ``kdn.client.dataplane.CLOSE_S``
in all.
From asyncio code use ``AsyncClient(client)``, which runs the same methods on worker threads:
there is one copy of the logic.

Every RPC method takes ``request_id`` (sent as ``x-request-id``, logged by the server; a fresh
one when None, the same for all retries of the call; 1-128 ASCII letters, digits and ``._:-``,
as the server keeps it, else InvalidArgument). ``last_request_id`` is the id of the
calling thread's latest call, so threads sharing a Client never see each other's ids.

A Client belongs to the process that made it: its channel, its connections and its shared
segment do not survive ``fork()``. In a child, each of its calls raises InvalidArgument at once
(``close`` does nothing there): the child makes a Client of its own. What it returned before
the fork is the child's own copy there (``kdn.client.forked``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kdn import tracing as _tracing
from kdn.checks import MAX_BYTES, flag, shown, whole
from kdn.client.blend import RemotePiece, blend_request
from kdn.client.dataplane import DataPlane
from kdn.client.deadline import time_left
from kdn.client.pending import PendingStore
from kdn.client.reads import Reader
from kdn.client.received import LOCAL_TIER, Fetched
from kdn.client.rpc import (
    CLOSED,
    Retry,
    Rpc,
    TLSOptions,
    check_timeout,
    settles,
    traced,
)
from kdn.client.writes import Writer
from kdn.codec import EncodedParts
from kdn.errors import Closed, ConfigError, Corrupt, InvalidArgument
from kdn.extras import model_side
from kdn.keys import DEFAULT_NAMESPACE, check_key, check_namespace
from kdn.layout import KVLayout
from kdn.names import call_batches, check_scope, request_namespace
from kdn.options import StoreOptions
from kdn.transport.addresses import address_problem, data_host, same_host
from kdn.transport.buffers import tune_allocator
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:  # the tensor side loads on first use: admin tools run without torch
    import torch

    from kdn.cache import KVCache
    from kdn.client.staged import Staged
    from kdn.client.stream import LayerStream

__all__ = ["Client", "Fetched", "KeyInfo", "LookupResult", "PendingStore", "Retry",
           "TLSOptions", "same_host"]

DEFAULT_MAX_MESSAGE = 256 << 20  # the server's default: a frame (>= one layer) is one message
DEFAULT_SHM_BYTES = 1 << 30
"""Size of the shared segment a client on the server's host uses by default."""
DEFAULT_STREAMS = 1
F = TypeVar("F", bound=Callable[..., Any])


WRITES = frozenset({"store", "store_many", "delete"})
"""The Client's calls that change what the server holds: one cut short by a close may or may
not have been done (its Closed says so); ``AsyncClient`` waits for one whose await was
cancelled."""


def in_its_process(fn: F) -> F:
    """A method of ``Client`` that raises InvalidArgument, before it touches anything, in a
    child of ``fork()`` (module docstring): there the channel would hang and the segment is
    the parent's. Closed once ``close`` began, and for a call that fails after it began on
    another thread: whatever broke under it (its connection, its segment, its channel) broke
    for the close (a write so cut says it may or may not have been done). A call reading into
    tensors without kdn's model extra raises MissingExtra (``kdn.extras``)."""
    @functools.wraps(fn)
    def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != self.pid:
            raise InvalidArgument("a Client cannot be used after fork(): make a new one in "
                                  "the child")
        if self.closing:  # (calls answered without the server too: flush, stage, ...)
            raise Closed(CLOSED)
        try:
            with model_side(f"Client.{fn.__name__}"):
                return fn(self, *args, **kwargs)
        except Exception as exc:
            if not self.closing:
                raise
            if fn.__name__ in WRITES:  # (the server may have done it before the cut)
                raise Closed(f"{CLOSED}: Client.{fn.__name__} was cut short by the close; it "
                             "may or may not have reached the server (lookup tells)") from None
            if isinstance(exc, Closed):
                raise
            raise Closed(CLOSED) from None
    return call  # type: ignore[return-value]


@dataclass(frozen=True)
class KeyInfo:
    present: bool
    tier: str
    size_bytes: int

    @property
    def in_process(self) -> bool:
        """The entry is in the client's in-process tier (``Client(local_bytes=...)``)."""
        return self.tier == LOCAL_TIER


@dataclass(frozen=True)
class LookupResult:
    infos: list[KeyInfo]
    prefix_hits: int


class Client:
    """The client of one server (module docstring). It holds its channel (``kdn.client.rpc``),
    its data plane (``kdn.client.dataplane``), its in-process tier (``local``) and the two
    sides that use them: reads (``kdn.client.reads``) and writes (``kdn.client.writes``)."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = 60.0,
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
        data_connections: int = 0,
    ) -> None:
        self.pid = os.getpid()
        """The process this client belongs to (module docstring)."""
        self.closing = False
        """``close`` began: a call that fails from now on raises Closed (``in_its_process``)."""
        check_flags(insecure, tracing, data_path)
        if tracing and not _tracing.enable():  # spans per call, the trace carried to the server
            raise ConfigError("tracing: needs the opentelemetry-api package (pip install "
                              "'kdn[tracing]')")
        tune_allocator()  # received messages must not fault in fresh pages (kdn.transport.buffers)
        if insecure is None:
            insecure = os.environ.get("KDN_INSECURE", "").strip().lower() in (
                "1", "true", "yes", "on")
        if not isinstance(address, str):
            raise InvalidArgument(f"address must be a string HOST:PORT, e.g. 127.0.0.1:50051; "
                                  f"got {type(address).__name__}")
        if problem := address_problem(address):
            raise InvalidArgument(problem)
        if ":" not in address.rstrip(":"):  # gRPC would dial a bare host on port 443
            raise InvalidArgument(f"address {address!r} has no port; write HOST:PORT, e.g. "
                                  "127.0.0.1:50051")
        if api_key and tls is None and not same_host(address) and not insecure:
            raise InvalidArgument(
                f"refusing to send an API key in plaintext to {address}: pass tls=TLSOptions("
                "ca=...) (the server's --tls-cert), or insecure=True (KDN_INSECURE=1) on a "
                "network you trust")
        self.address = address
        if not 1024 <= _whole("max_message_bytes", max_message_bytes, "") <= 2**31 - 1:
            raise InvalidArgument(f"max_message_bytes must be in 1KiB..2GiB-1 (as the server's), "
                                  f"got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        for name, value in (("shm_bytes", shm_bytes), ("keep_leases_bytes", keep_leases_bytes)):
            if value is not None:
                _size(name, value, "0: none; None: the default")
        self.streams = max(1, _whole("streams", streams, "0 or 1: one"))
        """gRPC streams one retrieve reads side by side, in layer groups, when the entry comes
        over gRPC and the caller gave its layout (``kdn.client.parallel``)."""
        self.data_connections = _whole("data_connections", data_connections,
                                       "0: chosen by the entries' size")
        """Connections a batch read on the network data path (a client on another host) is
        striped over, side by side; 0 (default): one per ``kdn.client.netpath.
        STRIPE_MIN_BYTES`` of entries, by the size of those read before (1 at first)."""
        self.timeout_s = timeout_s = check_timeout("timeout_s", timeout_s)
        self.retry = retry or Retry()
        self.namespace = request_namespace(namespace)  # "": the default namespace
        self._features: frozenset[str] | None = None  # what the server takes (``scoped``)
        self.rpc = Rpc(address, timeout_s=timeout_s, retry=self.retry,
                       max_message_bytes=max_message_bytes, api_key=api_key, tls=tls)
        """The channel and the calls made on it (``kdn.client.rpc``)."""
        if shm_bytes is None:
            shm_bytes = DEFAULT_SHM_BYTES if same_host(address) else 0
        if _size("local_bytes", local_bytes, "0: no in-process tier"):
            from kdn.client.local import LocalTier

            self.local: Any = LocalTier(local_bytes)
        else:
            self.local = None
        """The in-process tier (``kdn.client.local``), when ``local_bytes`` is set."""
        # without a shared segment, batches go by the server's network data path where it
        # offers one (``data_path``; over TLS where the channel has it: kdn.server.netpath)
        self.dataplane = DataPlane(self.rpc.stub, self.rpc.call, self.rpc.metadata,
                                   timeout_s, shm_bytes, max_message_bytes, keep_leases_bytes,
                                   data_host(address) if data_path else "",
                                   tls.data_path_tls() if tls is not None else None,
                                   data_connections)
        self._reads = Reader(self.rpc, self.dataplane, self.local, self.namespace,
                             self.streams)
        self._writes = Writer(self.rpc, self.dataplane, self.local, self.namespace,
                              max_message_bytes)

    @property
    def last_request_id(self) -> str:
        """The request id of this thread's latest call ("" before its first)."""
        return self.rpc.last_request_id

    @in_its_process
    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Metadata of one call: the API key and ``request_id`` (a fresh one when None), which
        becomes this thread's ``last_request_id``."""
        return self.rpc.metadata(request_id)

    def close(self) -> None:
        """Close the channels, give the segment back and empty the in-process tier, after
        this thread's asynchronous stores are answered (another thread's: ``flush`` there
        first; those the server answered before it still read their answers). Any call after
        it, or cut short by it on another thread, raises Closed.
        Nothing in a child of ``fork()``: they are the parent's."""
        if os.getpid() != self.pid:
            return
        if self.dataplane.has_pending():
            self.dataplane.settle_async()
        self.closing = True
        self.dataplane.close()
        self.rpc.close()
        if self.local is not None:
            self.local.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, namespace: str | None) -> str:
        return check_namespace(namespace or self.namespace)

    # -- store ----------------------------------------------------------------------------------

    @in_its_process
    def store(self, key: bytes, kv: KVCache | EncodedParts | Staged, *, mode: str = "lossless",
              level: str = "", namespace: str | None = None,
              options: StoreOptions | None = None, layers_per_frame: int = 0,
              request_id: str | None = None) -> pb.StoreResponse:
        """Store ``kv`` (encoded here with ``mode``/``level`` unless already encoded); TTL, pin
        and durability come from ``options`` (defaults: ``StoreOptions()``). Frames hold
        ``layers_per_frame`` layers, or with 0 enough to fill ``codec.FRAME_TARGET_BYTES``."""
        return self._writes.store(key, kv, mode=mode, level=level, namespace=namespace,
                                  options=options, layers_per_frame=layers_per_frame,
                                  request_id=request_id)

    @in_its_process
    def store_many(self, items: Sequence[tuple[bytes, KVCache | EncodedParts | Staged]], *,
                   mode: str = "lossless", level: str = "", namespace: str | None = None,
                   options: StoreOptions | None = None, layers_per_frame: int = 0,
                   request_id: str | None = None) -> list[pb.StoreResponse]:
        """Store many entries in as few calls as fit (``Writer.store_many``). Each call's items
        are all checked before any is stored: a bad item (not a (key, entry) pair, a key given
        twice) raises and stores none of them."""
        return self._writes.store_many(items, mode=mode, level=level, namespace=namespace,
                                       options=options, layers_per_frame=layers_per_frame,
                                       request_id=request_id)

    @in_its_process
    def store_async(self, key: bytes, kv: KVCache | EncodedParts | Staged, *,
                    mode: str = "lossless", level: str = "", namespace: str | None = None,
                    options: StoreOptions | None = None, layers_per_frame: int = 0
                    ) -> PendingStore:
        """``store`` without waiting for the server's answer (``Writer.store_async``): its
        answer is read by ``result()``, by this thread's next call of this client, or by
        ``flush()`` (``close`` too). A process that exits without either may lose it: the
        server drops a store whose client left before it got to it."""
        return self._writes.store_async(key, kv, mode=mode, level=level, namespace=namespace,
                                        options=options, layers_per_frame=layers_per_frame)

    @in_its_process
    def flush(self) -> None:
        """Wait for this thread's asynchronous stores (``store_async``); raise the first error
        among those answered since the last flush (each also raises from its ``result()``)."""
        self._writes.flush()

    @in_its_process
    def stage(self, layout: KVLayout, tokens: int, *, start_position: int = 0) -> Staged:
        """A ``raw`` entry of ``tokens`` tokens of ``layout`` to fill in place and store without
        this client copying or hashing it (``kdn.client.staged``)."""
        return self._writes.stage(layout, tokens, start_position=start_position)

    # -- retrieve -------------------------------------------------------------------------------
    # ``layout``, ``tokens``: what each entry read must be (None / 0: any); one that is not
    # fails the read (LayoutMismatch) before any of it is decoded (``kdn.layout.Expected``)

    @in_its_process
    def fetch(self, key: bytes, *, namespace: str | None = None,
              layout: KVLayout | None = None, tokens: int = 0,
              request_id: str | None = None) -> Fetched | None:
        """The stored container of ``key`` (header + frames, undecoded), or None on a miss."""
        return self._reads.fetch(key, namespace=namespace, layout=layout, tokens=tokens,
                                 request_id=request_id)

    @in_its_process
    def retrieve_stream(self, key: bytes, *, namespace: str | None = None,
                        layout: KVLayout | None = None, tokens: int = 0,
                        device: torch.device | str | None = None,
                        first_layer: int = 0, last_layer: int = 0,
                        request_id: str | None = None) -> LayerStream | None:
        """Start retrieving ``key``; layers become usable one by one (``wait_for_layer``).

        None on a miss. The header arrives before this returns; frames keep arriving and are
        decoded on worker threads while the caller works on earlier layers.
        """
        return self._reads.retrieve_stream(key, namespace=namespace, layout=layout,
                                           tokens=tokens, device=device, first_layer=first_layer,
                                           last_layer=last_layer, request_id=request_id)

    @in_its_process
    def layer_stream(self, start: Callable[..., Any], request: Any,
                     device: torch.device | str | None = None,
                     request_id: str | None = None,
                     on_complete: Callable[[EncodedParts], object] | None = None
                     ) -> LayerStream:
        """Issue a server-streaming call that answers a header then frames (Retrieve, Blend)
        and hand its frames to a LayerStream, once the header has arrived. ``on_complete``
        gets the whole entry once its last frame has arrived."""
        return self._reads.layer_stream(start, request, device, request_id, on_complete)

    @in_its_process
    def retrieve(self, key: bytes, *, namespace: str | None = None,
                 layout: KVLayout | None = None, tokens: int = 0,
                 device: torch.device | str | None = None,
                 request_id: str | None = None) -> KVCache | None:
        """Retrieve and decode ``key``. None on a miss."""
        return self._reads.retrieve(key, namespace=namespace, layout=layout, tokens=tokens,
                                    device=device, request_id=request_id)

    @in_its_process
    def fetch_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                   layout: KVLayout | None = None, tokens: int = 0,
                   request_id: str | None = None) -> list[Fetched | None]:
        """Stored containers of ``keys`` (None for a miss) in as few calls as fit."""
        return self._reads.fetch_many(keys, namespace=namespace, layout=layout, tokens=tokens,
                                      request_id=request_id)

    @in_its_process
    def retrieve_streams(self, keys: Sequence[bytes], *, namespace: str | None = None,
                         layout: KVLayout | None = None, tokens: int = 0,
                         device: torch.device | str | None = None,
                         request_id: str | None = None) -> list[LayerStream | None]:
        """``retrieve_stream`` of many keys at once (None for a miss), all started before this
        returns."""
        return self._reads.retrieve_streams(keys, namespace=namespace, layout=layout,
                                            tokens=tokens, device=device, request_id=request_id)

    @in_its_process
    def retrieve_joined(self, keys: Sequence[bytes], *, namespace: str | None = None,
                        layout: KVLayout | None = None, tokens: int = 0,
                        device: torch.device | str | None = None) -> LayerStream | None:
        """Consecutive blocks of one context, every one in the in-process tier, as one
        LayerStream of the whole context; None when any is not there or the join does not
        apply (then ``retrieve_streams``)."""
        return self._reads.retrieve_joined(keys, namespace=namespace, layout=layout,
                                           tokens=tokens, device=device)

    @in_its_process
    def retrieve_many(self, keys: Sequence[bytes], *, namespace: str | None = None,
                      layout: KVLayout | None = None, tokens: int = 0,
                      device: torch.device | str | None = None,
                      request_id: str | None = None) -> list[KVCache | None]:
        """``fetch_many``, decoded (frame checksums verified) on ``device``."""
        return self._reads.retrieve_many(keys, namespace=namespace, layout=layout,
                                         tokens=tokens, device=device, request_id=request_id)

    # -- blend ----------------------------------------------------------------------------------

    @in_its_process
    @settles
    def blend_stream(self, pieces: Sequence[RemotePiece], *, ratio: float | None = None,
                     select_layer: int = 0, head_tokens: int = 0, per_chunk: bool = False,
                     store: bool = False, mode: str = "", level: str = "",
                     namespace: str | None = None, layout: KVLayout | None = None,
                     device: torch.device | str | None = None,
                     query_share: float | None = None,
                     request_id: str | None = None) -> LayerStream:
        """Start a Blend of ``pieces`` on the server (see ``kdn.client.blend``); the blended KV
        arrives layer by layer. ``stream.tier`` is "blend" when computed now, or the tier a
        stored combination (``store=True``) was read from. ``ratio`` and ``query_share``
        travel as 32-bit floats, read by the server as the shortest decimal of each: 0.1 is
        0.1, 1/3 is 0.33333334 (up to 7 significant digits arrive as written)."""
        req = blend_request(pieces, namespace=self._ns(namespace), ratio=ratio,
                            select_layer=select_layer, head_tokens=head_tokens,
                            per_chunk=per_chunk, store=store, mode=mode, level=level,
                            layout=layout, query_share=query_share)
        return self.layer_stream(self.rpc.stub.Blend, req, device, request_id)

    @in_its_process
    def blend(self, pieces: Sequence[RemotePiece], **options: Any) -> KVCache:
        """Blended KV of ``pieces`` computed by the server; options as ``blend_stream``."""
        return self.blend_stream(pieces, **options).result()

    # -- lookup / delete / stats ----------------------------------------------------------------

    @in_its_process
    @traced("kdn.client.lookup")
    def lookup(self, keys: Sequence[bytes], *, namespace: str | None = None,
               prefix_chain: bool = False, request_id: str | None = None,
               timeout_s: float | None = None, server_only: bool = False) -> LookupResult:
        """Which ``keys`` are stored, where (``inproc`` for the in-process tier) and how big;
        with ``prefix_chain`` also how many leading keys are present. ``timeout_s``: this
        call's deadline (None: the client's; else a number of seconds > 0, inf: none);
        ``server_only``: the in-process tier is not asked (what the server holds, for other
        processes)."""
        budget = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        ns = self._ns(namespace)
        ks = [check_key(k) for k in keys]
        asks_local = self.local is not None and not server_only
        sizes = [self.local.contains(ns, k) if asks_local else None for k in ks]
        infos = [KeyInfo(True, LOCAL_TIER, s) if s is not None else None for s in sizes]
        ask = [k for k, info in zip(ks, infos) if info is None]
        if ask or not ks:
            md = self.rpc.metadata(request_id)
            answered: list[pb.KeyInfo] = []
            for part in call_batches(ask):
                req = pb.LookupRequest(namespace=ns, keys=part, prefix_chain=prefix_chain)
                resp = self.rpc.call(lambda req=req: self.rpc.stub.Lookup(  # type: ignore[misc]
                    req, timeout=time_left(budget), metadata=md), timeout_s=budget)
                if len(resp.infos) != len(part):  # (too few: a bare StopIteration below)
                    raise Corrupt(f"Lookup answered {len(resp.infos)} keys of the {len(part)} "
                                  "asked")
                answered.extend(resp.infos)
            remote = iter(answered)
            infos = [info or _key_info(next(remote)) for info in infos]
        done = [i for i in infos if i is not None]
        hits = next((j for j, i in enumerate(done) if not i.present), len(done))
        return LookupResult(done, hits if prefix_chain else 0)

    @in_its_process
    @settles
    def contains(self, key: bytes, *, namespace: str | None = None,
                 request_id: str | None = None) -> bool:
        return self.lookup([key], namespace=namespace, request_id=request_id).infos[0].present

    @in_its_process
    @traced("kdn.client.delete")
    def delete(self, key: bytes | Sequence[bytes], *, namespace: str | None = None,
               tenant: str = "", request_id: str | None = None) -> int:
        """Delete entries from every tier; the count deleted. ``tenant``: admins only, that
        tenant's entries ("": the caller's own; ``kdn.names.UNSCOPED``: those stored before the
        server had tenants)."""
        keys = [key] if isinstance(key, (bytes, bytearray)) else list(key)
        req = pb.DeleteRequest(namespace=self._ns(namespace), keys=[check_key(k) for k in keys],
                               tenant=self.scoped(tenant, request_id))
        # the local copies (the caller's) go first; none read or stored meanwhile is kept
        writes = [self.local.write(req.namespace, k) for k in req.keys] \
            if self.local is not None and not tenant else []
        try:
            md = self.rpc.metadata(request_id)
            deleted = 0
            for batch in call_batches(req.keys):
                part = pb.DeleteRequest(namespace=req.namespace, tenant=req.tenant, keys=batch)
                deleted += int(self.rpc.call(lambda part=part: self.rpc.stub.Delete(  # type: ignore[misc]
                    part, timeout=time_left(self.timeout_s), metadata=md),
                    once=f"it may have reached the server: the keys may have been deleted "
                         f"({deleted} counted before); lookup tells which are left").deleted)
            return deleted
        finally:
            for write in writes:
                write.end()

    @in_its_process
    def scoped(self, tenant: str, request_id: str | None = None) -> str:
        """``tenant`` checked, for a request that acts on another tenant's entries: "" (the
        caller's own) passes; a name only where the server says it takes one (``features``
        in Stats, asked once): an older server would act on the caller's own entries
        instead, so InvalidArgument says so before anything is sent."""
        if not tenant:
            return ""
        check_scope(tenant)
        if self._features is None:
            self._features = frozenset(self.stats(request_id=request_id).features)
        if "tenant-scope" not in self._features:
            raise InvalidArgument(f"this server does not act on another tenant's entries (an "
                                  f"older kdn): it would act on yours; leave out tenant "
                                  f"{tenant!r}, or use that tenant's API key")
        return tenant

    @in_its_process
    @settles
    def stats(self, *, request_id: str | None = None) -> pb.StatsResponse:
        md = self.rpc.metadata(request_id)
        return self.rpc.call(lambda: self.rpc.stub.Stats(
            pb.StatsRequest(), timeout=time_left(self.timeout_s), metadata=md))

    @in_its_process
    @settles
    def health(self, service: str = "") -> str:
        """The standard gRPC health status name (SERVING, NOT_SERVING, ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # the stub made inside the call: on a closed channel making one crashed the process
        resp = self.rpc.call(lambda: health_pb2_grpc.HealthStub(self.rpc.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=time_left(self.timeout_s)))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def check_flags(insecure: object, tracing: object, data_path: object) -> None:
    """InvalidArgument naming the first of ``Client``'s switches that is no bool (``insecure``
    may be None too): ``insecure="false"``, from a settings file, was true, and sent the API
    key in plaintext off this host."""
    flag("insecure", insecure, none=True)
    flag("tracing", tracing)
    flag("data_path", data_path)


def _whole(name: str, value: object, zero: str) -> int:
    """``value`` when it is a whole number >= 0, else InvalidArgument naming ``name`` (``zero``
    says what 0 means)."""
    return whole(name, value, 0, f" ({zero})" if zero else "")


def _size(name: str, value: object, zero: str) -> int:
    """``_whole``, at most ``MAX_BYTES`` (2**63 overflowed ``os.ftruncate``: a raw
    OverflowError at every same-host call)."""
    got = _whole(name, value, zero)
    if got > MAX_BYTES:
        raise InvalidArgument(f"{name} must be at most {MAX_BYTES} bytes, got {shown(value)}")
    return got


def _key_info(info: pb.KeyInfo) -> KeyInfo:
    return KeyInfo(info.present, info.tier, info.size_bytes)
