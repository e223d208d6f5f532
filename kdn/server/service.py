"""The gRPC servicer: thin handlers that decode a request, call the object that does the work,
and map its errors to status codes (``kdn.server.rpc``).

The work is done by objects the servicer holds, each reached through its public methods:

* ``ingest`` (``kdn.server.ingest.Ingest``): the write path, checks and commit of every entry;
* ``receiver`` (``kdn.server.receive.Receiver``): Store and StoreMany streams into entries;
* ``puts`` (``kdn.server.putmany.PutMany``): PutMany, inline or from a shared segment;
* ``reads`` (``kdn.server.batch.BatchReads``): GetMany, inline, into a segment or leased;
* ``reader`` (``kdn.server.reader.Reader``) and ``retrieve_many``
  (``kdn.server.retrieve_many.RetrieveMany``): Retrieve and RetrieveMany streams;
* ``segments`` (``kdn.server.segments.Segments``): attached segments and data path tickets;
* ``blender`` (``kdn.server.blend_rpc.Blender``): Blend, on a server that hosts a model;
* ``egress`` (``kdn.server.egress.Egress``): the egress caps the reads (and Blend) pace their
  sends by.

The same-host fast path and the network data path (``kdn.server.fastpath``,
``kdn.server.netpath``) call ``reads`` and ``puts`` too, without gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TypeVar

import grpc

from kdn.codec.format import parse_container
from kdn.errors import KDNError, NotFound
from kdn.keys import split_store_key, store_key
from kdn.server.arena import Arenas
from kdn.server.auth import (
    AuthConfig,
    Authenticator,
    Principal,
    acting_tenant,
    current_principal,
)
from kdn.server.batch import BatchReads
from kdn.server.blend_rpc import PLANNED, Blender, blend_stream
from kdn.server.config import ServerConfig
from kdn.server.egress import Egress, Pacer
from kdn.server.ingest import Ingest, delete_entry
from kdn.server.putmany import PutMany
from kdn.server.reader import Reader, Sending, expected
from kdn.server.receive import Receiver
from kdn.server.retrieve_many import RetrieveMany
from kdn.server.rpc import IN_FLIGHT, Counters, end_call, rpc
from kdn.server.segments import Segments
from kdn.server.usage import Usage
from kdn.server.wire_memo import WireMemo
from kdn.store.base import TierStats
from kdn.store.tiered import TieredStore
from kdn.transport.buffers import BufferPool
from kdn.transport.prefault import PrefaultedHeap
from kdn.transport.wire import FEATURES, FrameMessage
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

T = TypeVar("T")


def verify_entry(value: bytes) -> None:
    """Full check of a stored entry (header and every frame checksum); raises Corrupt."""
    parse_container(value, verify=True)


class KDNServicer(pb_grpc.KDNServicer):
    """The KDN service's RPCs, each delegating to the objects it holds (module docstring)."""

    blender: Blender | None = None
    """The model side of Blend; None: this server does not blend."""
    fast_path_name: str = ""
    """The socket of the same-host fast path (``kdn.server.fastpath``); "" = none."""
    data_port: int = 0
    """The TCP port of the network data path (``kdn.server.netpath``); 0 = none."""
    in_flight: int = 0
    """Unary-answer calls running now (``kdn.server.rpc.rpc``)."""

    def __init__(self, config: ServerConfig, store: TieredStore,
                 auth: Authenticator | None = None) -> None:
        self.config = config
        self.store = store
        self.auth = auth or Authenticator(AuthConfig())
        self.counters = Counters()  # AdminServicer's too (kdn.server.app)
        self.started = time.time()
        self.segments = Segments()
        # same-host reads: each tenant's hottest RAM-tier entries, leased (kdn.server.arena)
        self.arenas = Arenas(min(config.shm_arena_bytes, config.ram_bytes // 4))
        # receive buffers of large entries, recycled: up to a quarter of the RAM tier kept free
        # and the memory of new ones faulted in ahead of demand (kdn.transport.prefault)
        ahead = min(config.prefault_bytes, config.ram_bytes // 4)
        self.heap = PrefaultedHeap(ahead, config.ram_bytes + ahead if ahead else 0)
        self.buffers = BufferPool(min(1 << 30, config.ram_bytes // 4),
                                  self.heap.take if ahead else None)
        self.usage = Usage()  # tokens stored and served, for the metrics (kdn.server.usage)
        # Retrieve's messages, kept: at most a quarter of the RAM tier on top of it
        self.wire_memo = WireMemo(min(config.wire_memo_bytes, config.ram_bytes // 4))
        self.ingest = Ingest(config, store, self.auth, self.arenas, self.wire_memo, self.usage,
                             self.count)
        self.receiver = Receiver(self.ingest, self.buffers)
        self.puts = PutMany(self.ingest, self.segments, self.arenas, self.buffers)
        # lower-tier copies held by answers being sent: at most the RAM budget (one always)
        self.sending = Sending(store, self.ingest.max_receiving)  # as writes being received
        self.reads = BatchReads(store, self.segments, self.arenas, self.usage, self.count,
                                self.sending)
        self.reader = Reader(store, self.usage, self.wire_memo, self.sending,
                             config.max_message_bytes)
        self.retrieve_many = RetrieveMany(self.reader, self.count)
        policies = self.auth.config.policies
        self.blend_turn = asyncio.Lock()  # one Blend runs the model at a time
        self.blend_plans = asyncio.Semaphore(PLANNED)  # ... and a few wait for it, planned
        self.egress = Egress(config.egress_bytes_per_s,
                             {t: p.egress_bytes_per_s for t, p in policies.items()},
                             self.usage.paced, self.usage.pace_cancelled)

    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def pacer(self, context: grpc.aio.ServicerContext) -> Pacer | None:
        """The pacing of this call's answer (None: no egress cap applies to it)."""
        return self.egress.pacer(current_principal.get().tenant, context.peer()) \
            if self.egress.on else None

    async def _answer(self, name: str, context: grpc.aio.ServicerContext,
                      fn: Callable[[Principal], T]) -> T:
        """Run ``fn(caller)`` on a worker thread; a KDNError ends the call with its status
        (``end_call``), answering None."""
        principal = current_principal.get()
        try:
            return await asyncio.to_thread(fn, principal)
        except KDNError as exc:
            end_call(context, self.count, name, exc)
            return None  # type: ignore[return-value]

    # -- writes ---------------------------------------------------------------------------------

    @rpc
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage],
                    context: grpc.aio.ServicerContext) -> pb.StoreResponse:
        return await self.receiver.store(current_principal.get(), request_iterator)

    @rpc
    async def StoreMany(self, request_iterator: AsyncIterator[pb.StoreRequest | FrameMessage],
                        context: grpc.aio.ServicerContext) -> pb.StoreManyResponse:
        return await self.receiver.store_many(current_principal.get(), request_iterator)

    async def PutMany(self, request: pb.PutManyRequest,
                      context: grpc.aio.ServicerContext) -> pb.PutManyResponse:
        return await self._answer("PutMany", context, lambda p: self.puts.put(p, request))

    # -- batch reads and segments ---------------------------------------------------------------

    async def GetMany(self, request: pb.GetManyRequest,
                      context: grpc.aio.ServicerContext) -> pb.GetManyResponse | bytes:
        sending = self.sending.open()  # an inline answer's lower-tier reads: until it is sent
        context.add_done_callback(partial(self.sending.close, sending))
        limit = self.reader.message_bytes  # an inline answer: one message at most this large
        answer = await self._answer("GetMany", context,
                                    lambda p: self.reads.get_many(p, request, sending, limit))
        if self.egress.on and isinstance(answer, bytes):  # inline: the entries are in it
            pacer = self.pacer(context)
            if pacer is not None:
                await pacer.apace(len(answer))
        return answer

    async def Attach(self, request: pb.AttachRequest,
                     context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        def run(p: Principal) -> pb.AttachResponse:
            if request.remote:  # another host: a ticket for the network data path
                if not self.data_port:
                    raise NotFound("this server has no network data path (data_port = -1)")
                self.count("net.attached")
                return pb.AttachResponse(segment_id=self.segments.ticket(p),
                                         data_port=self.data_port)
            seg_id = self.segments.attach(p, request.pid, request.fd, request.size,
                                          request.nonce)
            self.count("shm.attached")
            return pb.AttachResponse(segment_id=seg_id, fast_path=self.fast_path_name,
                                     seals=True)

        return await self._answer("Attach", context, run)

    async def Detach(self, request: pb.DetachRequest,
                     context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        def run(p: Principal) -> pb.DetachResponse:
            self.segments.detach(p.tenant, request.segment_id)
            return pb.DetachResponse()

        return await self._answer("Detach", context, run)

    # -- streamed reads -------------------------------------------------------------------------

    async def Retrieve(self, request: pb.RetrieveRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RetrieveResponse]:
        with self.sending.answer() as sending:  # a lower-tier read's copy: until it ends
            try:
                skey = store_key(current_principal.get().tenant,
                                 request.namespace or "default", request.key)
                hit, read_s = await self.reader.read(skey)
                if hit is None:
                    self.count("retrieve.miss")
                    self.usage.missed(skey)
                    raise NotFound(f"no entry for key {request.key.hex()} in "
                                   f"{request.namespace!r}")
                self.sending.hold(sending, hit)
                pieces = request.piece_bytes if len(hit.value) \
                    >= request.piece_min_entry_bytes else 0
                head, sel, memo = self.reader.answer(
                    skey, hit, read_s, expected(request), request.first_layer,
                    request.last_layer, pieces, cuts=request.piece_bytes > 0)
            except KDNError as exc:
                end_call(context, self.count, "Retrieve", exc)
                return
            pacer = self.pacer(context) if self.egress.on else None
            sent = 0  # the entry's bytes: its header, then frames (as GetMany)
            try:  # a call cancelled at its header counts as cancelled too
                yield pb.RetrieveResponse(header=head)
                sent = len(head.container_header)
                for (_, frame), msgs in zip(sel, memo):
                    for msg in msgs:
                        if pacer is not None:
                            await pacer.apace(len(msg))
                        # Each yield waits for flow control: a slow or cancelled client stops
                        # the sending here instead of the server buffering the whole entry.
                        yield msg  # type: ignore[misc]
                    sent += len(frame)
                    self.count("retrieve.frames_sent")
            except (asyncio.CancelledError, GeneratorExit):
                self.count("retrieve.cancelled")
                raise
            finally:
                self.count("bytes_out", sent)
            self.count("retrieve.hit")

    async def RetrieveMany(self, request: pb.RetrieveManyRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.RetrieveResponse | bytes]:
        pacer = self.pacer(context) if self.egress.on else None
        async for msg in self.retrieve_many.stream(request, context):
            if pacer is not None:
                await pacer.apace(len(msg) if isinstance(msg, bytes) else msg.ByteSize())
            yield msg

    async def Blend(self, request: pb.BlendRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RetrieveResponse]:
        pacer = self.pacer(context) if self.egress.on else None  # as any read of an entry
        async for msg in blend_stream(self.blender, self.ingest, request, context,
                                      self.blend_turn, self.blend_plans):
            if pacer is not None:
                await pacer.apace(msg.ByteSize())
            yield msg

    # -- Lookup / Delete / Stats ----------------------------------------------------------------

    @rpc
    async def Lookup(self, request: pb.LookupRequest,
                     context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        tenant, ns = current_principal.get().tenant, request.namespace or "default"
        skeys = [store_key(tenant, ns, k) for k in request.keys]
        found = await asyncio.to_thread(self.store.lookup, skeys)
        resp = pb.LookupResponse(
            infos=[pb.KeyInfo(present=p.present, tier=p.tier, size_bytes=p.size) for p in found]
        )
        if request.prefix_chain:
            hits = 0
            for p in found:
                if not p.present:
                    break
                hits += 1
            resp.prefix_hits = hits
        return resp

    @rpc
    async def Delete(self, request: pb.DeleteRequest,
                     context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        tenant = acting_tenant(current_principal.get(), request.tenant)  # admins: any
        ns = request.namespace or "default"
        skeys = [store_key(tenant, ns, k) for k in request.keys]
        deleted = await asyncio.to_thread(lambda: sum(delete_entry(self.store, self.auth, k)
                                                      for k in skeys))
        for k in skeys:
            self.wire_memo.drop(k)
            self.arenas.drop(k)
        return pb.DeleteResponse(deleted=deleted)

    @rpc
    async def Stats(self, request: pb.StatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        from kdn import __version__

        tiers = await asyncio.to_thread(self.store.stats)
        down = self.store.parts_down()  # remembered by the tiers' watchers: no calls out
        if self._tenant_scoped():
            return self._tenant_view(tiers, down, await asyncio.to_thread(self._tenant_stats))
        counters = self.counters.snapshot()
        counters.update({f"store.{k}": v for k, v in self.store.counters.items()})
        counters.update({"wire_memo.hits": self.wire_memo.hits,
                         "wire_memo.misses": self.wire_memo.misses,
                         "wire_memo.bytes": self.wire_memo.used_bytes})
        counters.update(self.arenas.counters())
        counters.update({"buffers.reused": self.buffers.reused,
                         "buffers.created": self.buffers.created,
                         "buffers.free_bytes": self.buffers.free_bytes})
        counters.update({f"store.{k}.queued": v for k, v in self.store.queue_depth().items()})
        counters.update({f"store.{k}.queued_bytes": v
                         for k, v in self.store.queue_bytes().items()})
        counters["store.degraded"] = int(self.store.degraded)
        counters[IN_FLIGHT] = max(0, self.in_flight - 1)  # not this Stats call
        return pb.StatsResponse(
            tiers=[
                pb.TierStats(name=t.name, entries=t.entries, bytes=t.bytes,
                             capacity_bytes=t.capacity_bytes, hits=t.hits, misses=t.misses,
                             evictions=t.evictions, corrupt=t.corrupt, healthy=t.healthy,
                             degraded=t.degraded, parts_down=down.get(t.name, []))
                for t in tiers
            ],
            counters=counters,
            version=__version__,
            tenants=await asyncio.to_thread(self._tenant_stats),
            health="degraded" if self.store.degraded or down else "serving",
            features=FEATURES,
        )

    def _tenant_scoped(self) -> bool:
        """Whether the caller sees only its own share of the server (one that is not an admin,
        where callers are identified: by a key, or by a certificate under mutual TLS, the
        unscoped key space's too): its entries, and the tiers' health."""
        p = current_principal.get()
        return not self.auth.open and not p.is_admin

    def _tenant_view(self, tiers: list[TierStats], down: dict[str, list[str]],
                     tenants: list[pb.TenantStats]) -> pb.StatsResponse:
        """Stats as a tenant sees them: each tier's health and capacity, its own entries and
        bytes (``tenants``), the calls in flight (what a fleet client weighs a node's load
        by); no server-wide counts, which tell other tenants' traffic."""
        from kdn import __version__

        return pb.StatsResponse(
            tiers=[pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes,
                                healthy=t.healthy, degraded=t.degraded,
                                parts_down=down.get(t.name, [])) for t in tiers],
            counters={IN_FLIGHT: max(0, self.in_flight - 1)},
            version=__version__, tenants=tenants,
            health="degraded" if self.store.degraded or down else "serving",
            features=FEATURES)

    def _tenant_stats(self) -> list[pb.TenantStats]:
        """Entries and bytes per tenant: the caller's own, or every tenant for an admin."""
        p = current_principal.get()
        if p.is_admin and not self.auth.enabled:
            return []
        prefix = f"{p.tenant}:".encode() if p.tenant and not p.is_admin else b""
        keys = self.store.keys(prefix)
        if not p.is_admin:  # the unscoped key space's prefix (b"") is every tenant's too
            keys = [k for k in keys if split_store_key(k)[0] == p.tenant]
        sizes = self.store.lookup(keys)
        out: dict[str, pb.TenantStats] = {}
        for k, pr in zip(keys, sizes):
            tenant = split_store_key(k)[0]
            policy = self.auth.config.policies.get(tenant)
            ts = out.setdefault(tenant, pb.TenantStats(
                tenant=tenant, quota_bytes=policy.quota_bytes if policy else 0))
            ts.entries += 1
            ts.bytes += pr.size
        return list(out.values())
