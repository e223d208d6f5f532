"""The write half of ``kdn.client.dataplane.DataPlane``: PutMany through the shared segment
(pipelined on the fast path for large batches) or inline, and the fast path's framing.

A same-host ``store_many`` of more than ``PIPE_BYTES`` goes as several PutMany calls of about
that size on this thread's fast-path connection, the next one written into the segment while
the server copies the last one out (``PutsMixin._put_pipelined``); smaller batches, and every
batch without the fast path, are one PutMany per ``BATCH_BYTES`` (inline: per message).
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

from kdn.client.netpath import NetMixin, fast_answer, fast_error, fast_send
from kdn.codec import EncodedParts
from kdn.errors import KDNError
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import FAST_PUT_MANY


class TooBig:
    """Marks an entry a batch can not carry (larger than the segment or a message)."""


TOO_BIG = TooBig()
PUT_INLINE_BYTES = 4 << 20
"""Bytes of one entry an inline PutMany carries at most (``store_many`` sends larger ones as
Store streams): past it the entry's joins into one message cost more than a stream's
messages (one 11.8 MB entry: 0.38x the raw service's stream inline, 0.49x streamed; 2.9 MB:
1.03x inline against 0.65x streamed)."""
PIPE_BYTES = 8 << 20
"""Bytes of entries a pipelined PutMany call carries (``PutsMixin._put_pipelined``)."""
PIPE_DEPTH = 1
"""Pipelined PutMany calls sent and not yet answered, besides the one being written."""
BATCH_BYTES = 1 << 30
"""Bytes of entries one PutMany through the segment carries at most (server limit: 2 GiB)."""

class PutsMixin(NetMixin):
    """``DataPlane``'s writes; it provides ``segment``, ``inline_budget``, ``_fast_path``,
    ``_fast_conn``, ``_fast_lost`` and ``_put``."""

    inline_budget: int
    _fast_path: str

    def segment(self) -> tuple[Any, str]:
        raise NotImplementedError

    def _fast_conn(self) -> socket.socket:
        raise NotImplementedError

    def _fast_lost(self, exc: OSError) -> None:
        raise NotImplementedError

    def _put(self, req: pb.PutManyRequest, request_id: str | None) -> pb.PutManyResponse:
        raise NotImplementedError


    def put_many(self, namespace: str, items: Sequence[tuple[bytes, EncodedParts,
                                                             pb.StoreOptions]],
                 request_id: str | None) -> list[pb.StoreResponse | TooBig]:
        """Store every item (each checked by the server before any is stored, per call);
        TOO_BIG for items no batch can carry."""
        out: list[pb.StoreResponse | TooBig] = [TOO_BIG] * len(items)
        seg, seg_id = self.segment()
        net = self.net() if seg is None else None
        if net is not None and self._net_put(net, namespace, items, out, BATCH_BYTES):
            return out
        if seg is not None and self._fast_path and len(items) > 1 and \
                sum(parts.nbytes for _, parts, _ in items) > PIPE_BYTES:
            self._put_pipelined(namespace, items, out)  # what it left: as below
            rest = [i for i, r in enumerate(out) if r is TOO_BIG]
            if len(rest) < len(items):
                for i, r in zip(rest, self.put_many(namespace, [items[i] for i in rest],
                                                    request_id) if rest else []):
                    out[i] = r
                return out
        limit = min(seg.size // 2, BATCH_BYTES) if seg is not None else self.inline_budget
        most = limit if seg is not None else min(limit, PUT_INLINE_BYTES)  # one item
        batch: list[int] = []
        size = 0
        for i, (_, parts, _) in enumerate(items):
            n = parts.nbytes
            if n > most:
                continue
            if batch and size + n > limit:
                self._put_batch(namespace, items, batch, out, request_id)
                batch, size = [], 0
            batch.append(i)
            size += (n + 63) // 64 * 64
        if batch:
            self._put_batch(namespace, items, batch, out, request_id)
        return out

    def _put_pipelined(self, namespace: str,
                       items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                       out: list[pb.StoreResponse | TooBig]) -> None:
        """Store ``items`` in PutMany calls of about ``PIPE_BYTES`` on the fast path, the next
        call's entries written into the segment while the server copies the last call's out
        (a same-host store is a copy in by the client, then a copy out by the server: one
        after the other, each core waits on the other). Each answer frees its call's region.
        Entries larger than a call, and those the segment had no room for or that were not
        answered when the path went away, are left in ``out`` as TOO_BIG (the caller stores
        them another way). A call's error is raised once every call sent was answered (the
        calls before and after it stored theirs)."""
        seg, seg_id = self.segment()
        most = min(seg.size // 4, PIPE_BYTES)
        batches: list[list[int]] = [[]]
        size = 0
        for i, (_, parts, _) in enumerate(items):
            n = (parts.nbytes + 63) // 64 * 64
            if parts.nbytes > most:
                continue
            if batches[-1] and size + n > PIPE_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += n
        pending: deque[tuple[list[int], tuple[int, int]]] = deque()
        error: KDNError | None = None
        try:
            conn = self._fast_conn()
            for batch in batches:
                if error is not None:
                    break  # the ones not sent stay unstored: the error is raised
                total = sum((items[i][1].nbytes + 63) // 64 * 64 for i in batch)
                start = seg.regions.alloc(total)
                while start is None and pending:  # room comes back with the answers
                    error = self._put_answered(conn, pending.popleft(), out, error)
                    start = seg.regions.alloc(total)
                if start is None:
                    break  # the segment is busy with reads: the rest another way
                req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id)
                at = start
                for i in batch:
                    key, parts, opts = items[i]
                    pos = at
                    for piece in (parts.header, *parts.frames):
                        seg.write(pos, piece)
                        pos += len(piece)
                    item = req.items.add(key=key, options=opts)
                    item.region.offset, item.region.length = at, parts.nbytes
                    at += (parts.nbytes + 63) // 64 * 64
                pending.append((batch, (start, total)))
                fast_send(conn, FAST_PUT_MANY, req)
                if len(pending) > PIPE_DEPTH:
                    error = self._put_answered(conn, pending.popleft(), out, error)
            while pending:
                error = self._put_answered(conn, pending.popleft(), out, error)
        except OSError as exc:  # the path went away: the unanswered ones go another way
            self._fast_lost(exc)
        finally:
            for _, block in pending:
                seg.regions.free(*block)
        if error is not None:
            raise error

    def _put_answered(self, conn: socket.socket, sent: tuple[list[int], tuple[int, int]],
                      out: list[pb.StoreResponse | TooBig], error: KDNError | None
                      ) -> KDNError | None:
        """Read the answer to a pipelined PutMany, free its region, record its results;
        the first error (kept, not raised: the later answers must still be read)."""
        batch, block = sent
        try:
            ok, body = fast_answer(conn)
        finally:
            self.segment()[0].regions.free(*block)
        if not ok:
            return error or fast_error(body)
        for i, r in zip(batch, pb.PutManyResponse.FromString(body).results):
            out[i] = r
        return error

    def _put_batch(self, namespace: str,
                   items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                   batch: list[int], out: list[pb.StoreResponse | TooBig],
                   request_id: str | None) -> None:
        seg, seg_id = self.segment()
        req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id if seg else "")
        block: tuple[int, int] | None = None
        if seg is not None:
            total = sum((items[i][1].nbytes + 63) // 64 * 64 for i in batch)
            start = seg.regions.alloc(total)
            if start is None:  # the segment is busy with reads: send these inline
                seg = None
                req.segment_id = ""
            else:
                block = (start, total)
        at = block[0] if block is not None else 0
        for i in batch:
            key, parts, opts = items[i]
            item = req.items.add(key=key, options=opts)
            if seg is not None:
                pos = at
                for piece in (parts.header, *parts.frames):
                    seg.write(pos, piece)
                    pos += len(piece)
                item.region.offset, item.region.length = at, parts.nbytes
                at += (parts.nbytes + 63) // 64 * 64
            else:
                item.data = parts.to_bytes()
        try:
            resp = self._put(req, request_id)
        finally:
            if seg is not None and block is not None:
                seg.regions.free(*block)
        for i, r in zip(batch, resp.results):
            out[i] = r
