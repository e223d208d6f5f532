"""The Blend RPC: a server that hosts a model composes stored chunks and text into one prompt's KV.

The storage server runs no model code itself: whoever builds it hands it a ``Blender`` (the
model side, ``kdn.blend.host.ModelBlender``: ``kdn serve --model`` does, tests set
``servicer.blender``). A server without one answers FAILED_PRECONDITION. This module does the
I/O around the blender:

1. ``blender.plan(request, read_chunk, max_pieces)`` on a worker thread checks the pieces
   (``max_blend_pieces`` of them at most, the model's context of tokens) and reads each
   chunk entry through ``read_chunk``, which scopes the key to the calling tenant and namespace
   (``kdn.keys.store_key``), so a tenant blends only its own chunks;
2. with ``store`` set, the plan names the combination's content key: a repeated combination is
   served from the store like a Retrieve (tier = the tier it was read from), once its entry
   is seen to hold the planned prompt's tokens in the planned layout (else it is computed
   again and overwritten);
3. otherwise ``job.run()`` computes and encodes the blend on a worker thread, one blend at a
   time (waiting on the event loop, not in a thread) and stopped when its call is. A plan holds
   its chunk entries' bytes until its blend ends, so at most ``PLANNED`` calls are planned or
   blending at once; others wait their turn to plan, holding nothing but their request. The
   result is
   stored under the combination key when asked, through the one write path every Store takes
   (``kdn.server.ingest.Ingest``: size and codec checks, the tenant's quota, the memoised
   messages and arena copies of an older value dropped, usage counted), and streamed back as
   a Retrieve stream: header (tier ``blend``), then frames.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from kdn.codec import EncodedParts
from kdn.codec.format import parse_header, split_frames
from kdn.errors import KDNError, Status
from kdn.keys import check_namespace, store_key
from kdn.server.auth import Principal, current_principal
from kdn.server.ingest import Ingest
from kdn.server.rpc import end_call
from kdn.v1 import kdn_pb2 as pb

PLANNED = 4
"""Blend calls planned at once (each holds the bytes of the chunk entries it names, up to the
model's context of KV, until its blend ends): calls queued for the model are bounded by this,
not by how many clients wait."""


class NoModel(KDNError):
    """This server hosts no model, so it can not blend."""

    status = Status.FAILED_PRECONDITION


class BlendJob(Protocol):
    """A planned blend."""

    @property
    def combination_key(self) -> bytes:
        """Content key to store the result under (b"": not stored)."""
        ...

    @property
    def tokens(self) -> int:
        """Tokens of the prompt: those of its blended KV."""
        ...

    @property
    def layout_fingerprint(self) -> str:
        """Fingerprint of the blended KV's layout."""
        ...

    def run(self, cancelled: Callable[[], bool] | None = None) -> EncodedParts:
        """Compute and encode the blended KV; stop (Cancelled) soon after ``cancelled()`` is
        true."""
        ...


class Blender(Protocol):
    """The model side of the Blend RPC (``kdn.blend.host.ModelBlender``)."""

    def plan(self, request: pb.BlendRequest, read_chunk: Callable[[bytes], bytes | None],
             max_pieces: int) -> BlendJob:
        """Check ``request`` and resolve its pieces; ``read_chunk(key)`` is the stored entry
        of a chunk key in the request's namespace, or None. More than ``max_pieces`` pieces
        (the server's ``max_blend_pieces``), or more tokens than the model's context, are
        refused before any piece is read."""
        ...


def store_result(ingest: Ingest, principal: Principal, namespace: str, key: bytes,
                 parts: EncodedParts) -> None:
    """Store a computed blend under its combination ``key`` as a Store of it would be: checked
    (size, codec, model) and charged to the tenant before it is put (TooLarge past
    ``max_entry_bytes`` or the quota), so that deleting it later refunds what was charged."""
    value = parts.to_bytes()
    msg = pb.StoreHeader(namespace=namespace, key=key, container_header=parts.header,
                         total_bytes=len(value))
    skey, header = ingest.check_header(principal.tenant, msg)
    ingest.commit(principal, skey, value, msg.options, header)


def combination_of(job: BlendJob, value: bytes | memoryview
                   ) -> tuple[bytes, list[bytes]] | None:
    """(header, frames) of the entry ``value`` stored under ``job``'s combination key, or None
    where it is not the blend ``job`` plans (unreadable, another token count or layout): a
    key names content, but whatever was stored under it is served only once it matches."""
    try:
        header = parse_header(value)
    except KDNError:
        return None
    if header.entry.tokens != job.tokens or header.layout.fingerprint != job.layout_fingerprint:
        return None
    return bytes(header.raw), [bytes(f) for f in split_frames(value, len(header.raw))]


async def run_in_turn(job: BlendJob, turn: asyncio.Lock) -> EncodedParts:
    """``job.run()`` on a worker thread once ``turn`` is ours: blends waiting for the model
    wait on the event loop, not in threads of the executor every other call needs. A call
    cancelled meanwhile (its client gone, or past its deadline) tells the running job to stop,
    and keeps the turn until it has (within a layer)."""
    async with turn:
        stop = threading.Event()
        running = asyncio.ensure_future(asyncio.to_thread(job.run, stop.is_set))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait([running])
            if not running.cancelled():
                running.exception()  # its Cancelled (or result) is no one's now: taken here
            raise


async def blend_stream(blender: Blender | None, ingest: Ingest, request: pb.BlendRequest,
                       context: grpc.aio.ServicerContext, turn: asyncio.Lock,
                       planned: asyncio.Semaphore) -> AsyncIterator[pb.RetrieveResponse]:
    """The Blend RPC's answer, blended by ``blender`` (None: this server does not blend) from
    chunks of ``ingest.store``, one blend at a time (``turn``), planned by at most ``PLANNED``
    calls at once (``planned``); a result asked to be stored goes through ``ingest``."""
    store, count = ingest.store, ingest.count
    try:
        if blender is None:
            raise NoModel("this server hosts no model (start it with `kdn serve --model "
                          "NAME`) and can not blend")
        ns = check_namespace(request.namespace or "default")
        principal = current_principal.get()
        tenant = principal.tenant

        def read_chunk(key: bytes) -> bytes | None:
            hit = store.get(store_key(tenant, ns, key))
            return None if hit is None else bytes(hit.value)

        async with planned:  # (the module docstring: a plan holds its chunks' bytes)
            job = await asyncio.to_thread(blender.plan, request, read_chunk,
                                          ingest.config.max_blend_pieces)
            skey = store_key(tenant, ns, job.combination_key) if job.combination_key else b""
            hit = await asyncio.to_thread(store.get, skey) if skey else None
            stored = None if hit is None else combination_of(job, hit.value)
            if hit is not None and stored is not None:
                count("blend.hit")
                (head, frames), tier = stored, hit.tier
            else:
                if hit is not None:  # not this prompt's KV: computed again, and overwritten
                    count("blend.stale")
                parts = await run_in_turn(job, turn)
                head, frames, tier = parts.header, [bytes(f) for f in parts.frames], "blend"
                if skey:
                    await asyncio.to_thread(store_result, ingest, principal, ns,
                                            job.combination_key, parts)
                count("blend.computed")
            del job, hit  # its chunks' bytes: let go before the turn to plan is
    except KDNError as exc:
        end_call(context, count, "Blend", exc)
        return
    total = len(head) + sum(len(f) for f in frames)
    yield pb.RetrieveResponse(header=pb.RetrieveHeader(
        container_header=head, total_bytes=total, tier=tier, frame_count=len(frames)))
    for i, frame in enumerate(frames):
        yield pb.RetrieveResponse(frame=pb.Frame(index=i, data=frame))
    count("blend.frames_sent", len(frames))
