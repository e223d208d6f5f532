"""The write half of ``kdn.client.dataplane.DataPlane``: PutMany through the shared segment
(pipelined on the fast path for large batches) or inline, and the fast path's framing.

A same-host ``store_many`` of more than ``PIPE_BYTES`` goes as several PutMany calls of about
that size on this thread's fast-path connection, the next one written into the segment while
the server copies the last one out (``PutsMixin._put_pipelined``); smaller batches, and every
batch without the fast path, are one PutMany per ``BATCH_BYTES`` (inline: per message).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from kdn.client.netpath import NetMixin, fast_answer, fast_error, fast_send
from kdn.codec import EncodedParts
from kdn.errors import InvalidArgument, KDNError, Unavailable
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import FAST_PUT_MANY

log = logging.getLogger(__name__)


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
ASYNC_DEPTH = 8
"""Asynchronous stores a thread has sent and not had answered; past it each new one first
reads the oldest answer (``PutsMixin.put_async``)."""


class PendingStore:
    """What ``Client.store_async`` gives back: ``result()`` waits for the server's answer and
    raises its error; ``done()`` says whether it came. Answers are read on the thread that
    stored (its fast-path connection answers in order): ``result()`` on another thread works
    once that thread's next call or ``flush`` has read it."""

    __slots__ = ("key", "_plane", "_thread", "_on_ok", "_response", "_error", "_done")

    def __init__(self, plane: Any, key: bytes, on_ok: Any = None) -> None:
        self.key, self._plane, self._on_ok = key, plane, on_ok
        self._thread = threading.get_ident()
        self._response: pb.StoreResponse | None = None
        self._error: KDNError | None = None
        self._done = False

    @classmethod
    def answered(cls, key: bytes, response: pb.StoreResponse) -> PendingStore:
        """One stored synchronously (no way to send it ahead)."""
        p = cls(None, key)
        p._response, p._done = response, True
        return p

    def done(self) -> bool:
        return self._done

    def result(self) -> pb.StoreResponse:
        if not self._done:
            if threading.get_ident() != self._thread:
                raise InvalidArgument("an asynchronous store is answered on the thread that "
                                      "sent it: read result() there, or after its flush()")
            self._plane.settle_async(self)
        if not self._done:  # its connection is gone and nothing holds its answer any more
            self._finish(None, Unavailable(f"the store of {self.key!r} was not answered; it "
                                           "may or may not be stored"))
        if self._error is not None:
            raise self._error
        assert self._response is not None
        return self._response

    def _finish(self, response: pb.StoreResponse | None, error: KDNError | None) -> None:
        self._response, self._error, self._done = response, error, True
        on_ok, self._on_ok = self._on_ok, None
        if error is None and on_ok is not None:
            try:  # keeping a copy in the in-process tier: a later call reads this answer,
                on_ok()  # and must not fail for it
            except Exception as exc:  # noqa: BLE001
                log.warning("kdn: the in-process tier did not keep %r: %s", self.key, exc)

class PutsMixin(NetMixin):
    """``DataPlane``'s writes; it provides ``segment``, ``inline_budget``, ``_fast_path``,
    ``_fast_conn``, ``_fast_lost`` and ``_put``."""

    inline_budget: int
    _fast_path: str

    def segment(self) -> tuple[Any, str]:
        raise NotImplementedError

    def _fast_conn(self, *, settle: bool = True) -> socket.socket:
        raise NotImplementedError

    def _fast_lost(self, exc: OSError) -> None:
        raise NotImplementedError

    def _put(self, req: pb.PutManyRequest, request_id: str | None) -> pb.PutManyResponse:
        raise NotImplementedError

    _conns: threading.local

    # -- asynchronous stores (``Client.store_async``) -------------------------------------------

    def _pending(self) -> deque[tuple[PendingStore, tuple[int, int] | None]]:
        q = getattr(self._conns, "pending", None)
        if q is None:
            q = self._conns.pending = deque()
            self._conns.failed = []
        return q  # type: ignore[no-any-return]

    def has_pending(self) -> bool:
        net = getattr(self._conns, "net_async", None)
        return bool(getattr(self._conns, "pending", None)) or \
            (net is not None and net.has_pending())

    def put_async_net(self, namespace: str, key: bytes, opts: pb.StoreOptions,
                      parts: EncodedParts, on_ok: Any = None) -> PendingStore | None:
        """``put_async`` for a client without a segment: the store sent on this thread's
        network data path connection without waiting (it answers in order too). None where
        there is no data path or it failed (the caller stores it as ``store`` does)."""
        net = self.net()
        if net is None or parts.nbytes > BATCH_BYTES:
            return None
        pending = PendingStore(self, key, on_ok)
        if not net.put_async(namespace, key, parts, opts, pending, ASYNC_DEPTH):
            self._net_lost(OSError("the data path connection failed"))
            return None
        self._conns.net_async = net  # kept: its unanswered stores are read through it
        return pending

    def put_async(self, namespace: str, key: bytes, opts: pb.StoreOptions, *,
                  parts: EncodedParts | None = None, staged: Any = None,
                  on_ok: Any = None) -> PendingStore | None:
        """Send one store on this thread's fast-path connection without waiting for its
        answer: ``parts`` written into a region of the segment (freed when answered), or a
        staged entry named where it lies (sealed by the server). None where it can not go
        this way (no segment or fast path, too large, no room): the caller stores it as
        ``store`` does."""
        seg, seg_id = self.segment()
        if seg is None or not self._fast_path:
            return None
        q = self._pending()
        block: tuple[int, int] | None = None
        if staged is not None:
            at = staged.region(seg)
            if at is None:
                return None
            start, length = at
        else:
            assert parts is not None
            length = parts.nbytes
            n = (length + 63) // 64 * 64
            if length > seg.size // 4:
                return None
            start = seg.regions.alloc(n)
            while start is None and q:  # room comes back with the answers
                self._settle_one(q)
                start = seg.regions.alloc(n)
            if start is None:
                return None
            block = (start, n)
            _write_parts(seg, start, parts)
        req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id)
        item = req.items.add(key=key, options=opts, seal=staged is not None)
        item.region.offset, item.region.length = start, length
        pending = PendingStore(self, key, on_ok)
        if q and getattr(self._conns, "conn", None) is None:
            self.settle_async()  # their connection went: they fail, a new one starts afresh
        try:
            conn = self._fast_conn(settle=False)
            fast_send(conn, FAST_PUT_MANY, req)
        except OSError as exc:
            if block is not None:
                seg.regions.free(*block)
            self._fast_lost(exc)
            return None
        q.append((pending, block))
        while len(q) > ASYNC_DEPTH:
            self._settle_one(q)
        return pending

    def settle_async(self, until: PendingStore | None = None) -> None:
        """Read this thread's unanswered asynchronous stores' answers, oldest first (up to
        ``until`` when given)."""
        q = getattr(self._conns, "pending", None)
        while q:
            first = q[0][0]
            self._settle_one(q)
            if first is until:
                return
        net = getattr(self._conns, "net_async", None)
        if net is not None:
            net.settle(until)

    def take_async_errors(self) -> list[KDNError]:
        """The errors of this thread's asynchronous stores answered since the last call."""
        failed: list[KDNError] = getattr(self._conns, "failed", [])
        self._conns.failed = []
        net = getattr(self._conns, "net_async", None)
        return failed + (net.take_failed() if net is not None else [])

    def _settle_one(self, q: deque[tuple[PendingStore, tuple[int, int] | None]]) -> None:
        pending, block = q.popleft()
        seg = self.segment()[0]
        try:
            conn = getattr(self._conns, "conn", None)
            if conn is None:
                raise OSError("the fast path is gone")
            ok, body = fast_answer(conn)
        except OSError as exc:  # the connection went: no answer will come for any of them
            lost = [(pending, block), *q]
            q.clear()
            for p, b in lost:
                if b is not None and seg is not None:
                    seg.regions.free(*b)
                self._failed(p, Unavailable(f"the fast path closed before the store of "
                                            f"{p.key!r} was answered ({exc}); it may or may "
                                            "not be stored"))
            if self._fast_path:
                self._fast_lost(exc)
            return
        if block is not None and seg is not None:
            seg.regions.free(*block)
        if not ok:
            self._failed(pending, fast_error(body))
            return
        results = pb.PutManyResponse.FromString(body).results
        if len(results) != 1:
            self._failed(pending, KDNError(f"PutMany answered {len(results)} results for 1"))
            return
        pending._finish(results[0], None)

    def _failed(self, pending: PendingStore, error: KDNError) -> None:
        pending._finish(None, error)
        failed = getattr(self._conns, "failed", None)
        if failed is None:
            failed = self._conns.failed = []
        failed.append(error)


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
                    _write_parts(seg, at, parts)
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
                _write_parts(seg, at, parts)
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


def _write_parts(seg: Any, at: int, parts: EncodedParts) -> None:
    """Copy an entry's header and frames into the segment, one after another from ``at``."""
    for piece in (parts.header, *parts.frames):
        seg.write(at, piece)
        at += len(piece)
