"""``RetrieveMany``: many entries in one stream, the remote form of a batch read. Each key's
header, then its frames, a message each; or grouped (``_runs``): the headers of a run of keys
in one message, small entries whole inside them, then the others' frames."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from kdn.errors import KDNError
from kdn.keys import store_key
from kdn.server.auth import current_principal
from kdn.server.batch import STREAM_MIN_FRAME_BYTES, inline_room
from kdn.server.reader import Reader, expected
from kdn.server.rpc import end_call
from kdn.store.framed import Framed
from kdn.transport.wire import GROUP_INLINE_BYTES, retrieve_headers_message
from kdn.v1 import kdn_pb2 as pb

HEADER_BYTES = 64
"""What a grouped RetrieveMany counts for a header's own fields (and its container header's
bytes, where it carries one) against the run's message budget."""
GROUP_HOLD_BYTES = 256 << 20
"""Bytes of entries a grouped RetrieveMany's run holds to stream after its headers' message."""
GROUP_KEYS = 1024
"""Keys a grouped RetrieveMany's run answers at most."""


def _run_messages(run: list[tuple[pb.RetrieveHeader, list[bytes | memoryview]]],
                  streamed: list[tuple[list[tuple[int, bytes | memoryview]],
                                       Iterator[list[bytes]]]],
                  sent: list[int]) -> Iterator[bytes]:
    """One run of a grouped RetrieveMany: its headers' message, then each streamed entry's
    frame messages (built as they are sent where they are not kept)."""
    if not run:
        return
    yield retrieve_headers_message(run)
    for sel, memo in streamed:
        for (_, frame), msgs in zip(sel, memo):
            yield from msgs
            sent[0] += len(frame)


class RetrieveMany:
    """RetrieveMany's streams: entries read through ``reader``, ``count`` counting the
    servicer's counters."""

    def __init__(self, reader: Reader, count: Callable[..., None]) -> None:
        self.reader = reader
        self.usage = reader.usage
        self.count = count

    async def stream(self, request: pb.RetrieveManyRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.RetrieveResponse | bytes]:
        """Many entries in one stream: each key's header, then its frames, one message each
        (a miss: a header with ``missing``). The remote form of a batch read: messages of
        about a frame each, which gRPC moves far faster than GetMany's one large answer.

        ``grouped``: the headers of a run of keys in one message (``RetrieveHeaders``), small
        entries whole inside their headers, then the frames of the run's other entries
        (``_runs``): a header message per entry and the GetMany that learnt which entries
        are small cost ~0.2 ms an entry on the two sides."""
        tenant, ns = current_principal.get().tenant, request.namespace or "default"
        sent = [0]  # entries are read one after another: memory holds one run's answer
        sending = self.reader.sending
        answer = sending.open()  # ... its lower-tier copies counted until sent
        try:
            if request.grouped:
                async for msg in self._runs(request, context, tenant, ns, sent, answer):
                    yield msg
                return
            for key in request.keys:
                skey = store_key(tenant, ns, key)
                try:
                    hit, read_s = await self.reader.read(skey)
                    if hit is None:
                        self.count("retrievemany.miss")
                        self.usage.missed(skey)
                        yield pb.RetrieveResponse(header=pb.RetrieveHeader(missing=True))
                        continue
                    sending.hold(answer, hit)
                    head, sel, memo = self.reader.answer(skey, hit, read_s,
                                                         expected(request), cuts=False)
                except KDNError as exc:
                    end_call(context, self.count, "RetrieveMany", exc)
                    return
                yield pb.RetrieveResponse(header=head)
                for (_, frame), msgs in zip(sel, memo):
                    for msg in msgs:
                        yield msg  # type: ignore[misc]  # waits for flow control, as Retrieve
                    sent[0] += len(frame)
                sending.let_go(answer)
                self.count("retrievemany.hit")
        except (asyncio.CancelledError, GeneratorExit):
            self.count("retrievemany.cancelled")
            raise
        finally:
            sending.close(answer)
            self.count("bytes_out", sent[0])

    async def _runs(self, request: pb.RetrieveManyRequest, context: grpc.aio.ServicerContext,
                    tenant: str, ns: str, sent: list[int], answer: int
                    ) -> AsyncIterator[bytes]:
        """A grouped RetrieveMany's messages: runs of keys, each one ``RetrieveHeaders``
        (an entry of up to ``inline_max_entry_bytes``, or of small frames, whole in its
        header while the run carries under its budget) and then the frames of the run's
        other entries, a message each. A run ends where its message would pass its budget
        (entries carried whole, and the headers: ``HEADER_BYTES`` each and their container
        headers), at ``GROUP_HOLD_BYTES`` of entries still to stream (held in memory
        meanwhile: a lower tier's reads) or at ``GROUP_KEYS`` keys. A run's lower-tier copies
        count for ``answer`` until it is sent; one past the server's bound ends the run first
        (``kdn.server.reader.Sending``)."""
        sending = self.reader.sending
        budget = min(request.inline_budget_bytes or GROUP_INLINE_BYTES, GROUP_INLINE_BYTES,
                     inline_room(self.reader.message_bytes))  # the server's messages too
        run: list[tuple[pb.RetrieveHeader, list[bytes | memoryview]]] = []
        streamed: list[tuple[list[tuple[int, bytes | memoryview]], Iterator[list[bytes]]]] = []
        inline = held_run = 0  # the run's message's bytes so far; its entries' to stream
        for i, key in enumerate(request.keys):
            skey = store_key(tenant, ns, key)
            try:
                hit, read_s = await self.reader.read(skey)
                if hit is not None:
                    if sending.holds(answer) and not sending.fits(answer, hit):  # the run's
                        for msg in _run_messages(run, streamed, sent):  # copies go first
                            yield msg
                        run, streamed, inline, held_run = [], [], 0, 0
                        sending.let_go(answer)
                    sending.hold(answer, hit)
                    header = self.reader.served(skey, hit, read_s,
                                                expected(request))
            except KDNError as exc:
                end_call(context, self.count, "RetrieveMany", exc)
                return
            n = len(hit.value) if hit is not None else 0
            whole = hit is not None and n <= budget and (n <= request.inline_max_entry_bytes
                                                         or n < len(header.entry.frames)
                                                         * STREAM_MIN_FRAME_BYTES)
            size = n if whole else HEADER_BYTES + (len(header.raw) if hit is not None else 0)
            if run and inline + size > budget:  # it starts the next run
                for msg in _run_messages(run, streamed, sent):
                    yield msg
                run, streamed, inline, held_run = [], [], 0, 0
            if hit is None:
                self.count("retrievemany.miss")
                self.usage.missed(skey)
                run.append((pb.RetrieveHeader(missing=True), []))
            elif whole:  # its header is inside: the RetrieveHeader says the rest
                value = hit.value
                run.append((pb.RetrieveHeader(total_bytes=n, tier=hit.tier,
                                              frame_count=len(header.entry.frames)),
                            [value.header, *value.frames] if isinstance(value, Framed)
                            else [value]))
                sent[0] += n
            else:
                try:
                    head, sel, memo = self.reader.frames_answer(skey, hit, header, 0, 0, 0,
                                                                cuts=False)
                except KDNError as exc:  # a frame past the server's messages
                    end_call(context, self.count, "RetrieveMany", exc)
                    return
                run.append((head, []))
                streamed.append((sel, memo))
                held_run += n
            inline += size
            if hit is not None:
                self.count("retrievemany.hit")
            if inline >= budget or held_run >= GROUP_HOLD_BYTES or len(run) >= GROUP_KEYS \
                    or i == len(request.keys) - 1:
                for msg in _run_messages(run, streamed, sent):
                    yield msg
                run, streamed, inline, held_run = [], [], 0, 0
                sending.let_go(answer)
