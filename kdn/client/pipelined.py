"""Pipelined PutMany calls on the same-host fast path (``kdn.client.samehost.SameHostPath``).

A same-host store is a copy in by the client, then a copy out by the server: one after the
other, each core waits on the other. Here a batch goes as several PutMany calls of about
``PIPE_BYTES`` (and at most ``kdn.names.MAX_CALL_KEYS`` entries, the first call
``fastwire.BATCH_ITEMS``: ``call_items``), the next call's entries written into the shared
segment while the server copies the last call's out, ``PIPE_DEPTH`` calls unanswered besides
the one being written:

* ``put_pipelined``: encoded entries (``EncodedParts``) copied into a region of the segment
  per call (``write_parts``), each region freed by its call's answer;
* ``put_staged_pipelined``: entries written into staged entries of the segment
  (``kdn.client.staged.Staged``) as they go, sealed by the server, closed once answered.

Both run on the one fast-path connection ``connect()`` gives (the path's connection of the
calling thread) and tell ``lost(exc)`` when it fails: the entries not answered by then come
back as None, for the caller to store another way. A call's error is raised once every call
sent was answered. ``write_parts``, an entry's bytes copied into the segment, serves every
same-host store.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kdn.client.fastwire import (
    BATCH_ITEMS,
    answer_bound,
    fast_answer,
    fast_error,
    fast_send,
    parsed,
)
from kdn.codec import EncodedParts
from kdn.errors import Corrupt, KDNError
from kdn.names import MAX_CALL_KEYS
from kdn.transport.wire import FAST_PUT_MANY
from kdn.v1 import kdn_pb2 as pb

PIPE_BYTES = 8 << 20
"""Bytes of entries a pipelined PutMany call carries (``put_pipelined``)."""
PIPE_DEPTH = 1
"""Pipelined PutMany calls sent and not yet answered, besides the one being written."""


def call_items(sent: int) -> int:
    """Entries a pipelined call may carry after ``sent`` calls: as many as a server takes in
    one (``MAX_CALL_KEYS``), the first ``BATCH_ITEMS``, its request within what a server
    reads on a connection not yet admitted (``kdn.server.fastpath.FIRST_BODY``: a longer
    one closed the connection)."""
    return BATCH_ITEMS if sent == 0 else MAX_CALL_KEYS


def write_parts(seg: Any, at: int, parts: EncodedParts) -> None:
    """Copy an entry's header and frames into the segment, one after another from ``at``."""
    for piece in (parts.header, *parts.frames):
        seg.write(at, piece)
        at += len(piece)


def put_pipelined(namespace: str, items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                  seg: Any, seg_id: str, connect: Callable[[], socket.socket],
                  lost: Callable[[OSError], None]) -> list[pb.StoreResponse | None] | None:
    """Store ``items`` in PutMany calls of about ``PIPE_BYTES`` through segment ``seg`` (id
    ``seg_id``), the next call's entries written into it while the server copies the last
    call's out. Each answer frees its call's region. Each item's answer, or None for those
    larger than a call, those the segment had no room for, or those not answered when the
    path went away (the caller stores them another way). A call's error is raised once every
    call sent was answered (the calls before and after it stored theirs). None where the
    batch is not pipelined: one item, or ``PIPE_BYTES`` or less in all."""
    if len(items) < 2 or sum(parts.nbytes for _, parts, _ in items) <= PIPE_BYTES:
        return None
    out: list[pb.StoreResponse | None] = [None] * len(items)
    most = min(seg.size // 4, PIPE_BYTES)
    batches: list[list[int]] = [[]]
    size = 0
    for i, (_, parts, _) in enumerate(items):
        n = (parts.nbytes + 63) // 64 * 64
        if parts.nbytes > most:
            continue
        if batches[-1] and (size + n > PIPE_BYTES
                            or len(batches[-1]) >= call_items(len(batches) - 1)):
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += n
    pending: deque[tuple[list[int], tuple[int, int]]] = deque()
    error: KDNError | None = None
    try:
        conn = connect()
        for batch in batches:
            if error is not None:
                break  # the ones not sent stay unstored: the error is raised
            total = sum((items[i][1].nbytes + 63) // 64 * 64 for i in batch)
            start = seg.regions.alloc(total)
            while start is None and pending:  # room comes back with the answers
                error = _put_answered(conn, seg, pending.popleft(), out, error)
                start = seg.regions.alloc(total)
            if start is None:
                break  # the segment is busy with reads: the rest another way
            req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id)
            at = start
            try:  # the region goes back whatever fails before it is sent
                for i in batch:
                    key, parts, opts = items[i]
                    write_parts(seg, at, parts)
                    item = req.items.add(key=key, options=opts)
                    item.region.offset, item.region.length = at, parts.nbytes
                    at += (parts.nbytes + 63) // 64 * 64
            except BaseException:
                seg.regions.free(start, total)
                raise
            pending.append((batch, (start, total)))
            fast_send(conn, FAST_PUT_MANY, req)
            if len(pending) > PIPE_DEPTH:
                error = _put_answered(conn, seg, pending.popleft(), out, error)
        while pending:
            error = _put_answered(conn, seg, pending.popleft(), out, error)
    except OSError as exc:  # the path went away: the unanswered ones go another way
        lost(exc)
    except BaseException:  # a batch failed to be made: the answers of what was sent are read
        try:
            while pending:
                _put_answered(conn, seg, pending.popleft(), out, None)
        except OSError as exc:
            lost(exc)
        raise
    finally:
        for _, block in pending:  # unanswered: the server may still read them
            seg.retire(*block, "a pipelined store")
    if error is not None:
        try:
            raise error
        finally:  # its traceback holds this frame
            del error
    return out


def put_staged_pipelined(namespace: str, items: Sequence[tuple[bytes, pb.StoreOptions]],
                         stage: Callable[[int], Any], seg: Any, seg_id: str,
                         connect: Callable[[], socket.socket],
                         lost: Callable[[OSError], None]) -> list[pb.StoreResponse | None]:
    """Store entries staged one by one as they are sent: ``stage(i)`` writes item ``i`` into
    a staged entry of segment ``seg`` and returns it, or None where the segment has no room.
    Sent in PutMany calls (``seal``: the server makes the sums on its copy) of about
    ``PIPE_BYTES``, each as soon as its entries are written, ``PIPE_DEPTH`` unanswered at
    most. A call's entries are closed once it is answered. Each item's answer, or None for
    those not stored this way (no room even with every call answered, or the path went away
    before their answer: the caller stores them another way). A call's error is raised once
    every call sent was answered (no later call is sent)."""
    out: list[pb.StoreResponse | None] = [None] * len(items)
    pending: deque[tuple[list[int], list[Any]]] = deque()
    error: KDNError | None = None
    conn = None
    batch: list[int] = []
    held: list[Any] = []
    try:
        conn = connect()
        size = calls = 0
        for i in range(len(items)):
            st = stage(i)
            while st is None and pending:  # room comes back with the answers
                error = _staged_answered(conn, pending.popleft(), out, error)
                st = stage(i)
            if error is not None:
                if st is not None:
                    st.close()
                break
            if st is None:
                continue  # no room for it: another way
            batch.append(i)
            held.append(st)
            size += st.nbytes
            if size >= PIPE_BYTES or len(batch) >= call_items(calls) or i == len(items) - 1:
                _send_staged(conn, namespace, seg, seg_id, items, batch, held)
                pending.append((batch, held))
                batch, held, size, calls = [], [], 0, calls + 1
                if len(pending) > PIPE_DEPTH:
                    error = _staged_answered(conn, pending.popleft(), out, error)
        if batch and error is None:  # the last items had no room but these
            _send_staged(conn, namespace, seg, seg_id, items, batch, held)
            pending.append((batch, held))
            batch, held = [], []
        while pending:
            error = _staged_answered(conn, pending.popleft(), out, error)
    except OSError as exc:  # the path went away: the unanswered ones go another way
        lost(exc)
    except BaseException:  # ``stage`` raised: the answers of what was sent are read
        try:
            while pending and conn is not None:
                _staged_answered(conn, pending.popleft(), out, None)
        except OSError as exc:
            lost(exc)
        raise
    finally:
        for st in held:  # not sent
            st.close()
        for _, sent in pending:  # unanswered: the server may still read them
            for st in sent:
                st.retire()
    if error is not None:
        try:
            raise error
        finally:  # its traceback holds this frame
            del error
    return out


def _send_staged(conn: socket.socket, namespace: str, seg: Any, seg_id: str,
                 items: Sequence[tuple[bytes, pb.StoreOptions]], batch: list[int],
                 held: list[Any]) -> None:
    req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id)
    for i, st in zip(batch, held):
        key, opts = items[i]
        item = req.items.add(key=key, options=opts, seal=True)
        item.region.offset, item.region.length = st.region(seg)
    fast_send(conn, FAST_PUT_MANY, req)


def _staged_answered(conn: socket.socket, sent: tuple[list[int], list[Any]],
                     out: list[pb.StoreResponse | None], error: KDNError | None
                     ) -> KDNError | None:
    """Read the answer to a pipelined PutMany of staged entries, close them, record its
    results; the first error (kept, not raised: the later answers must still be read)."""
    batch, held = sent
    try:
        ok, body = fast_answer(conn, answer_bound(len(batch)))
    except BaseException:  # unanswered: the server may still read them
        for st in held:
            st.retire()
        raise
    for st in held:
        st.close()
    if not ok:
        return error or fast_error(body)
    try:
        results = parsed(pb.PutManyResponse, body).results
    except Corrupt as exc:
        return error or exc
    return _record(batch, results, out, error)


def _put_answered(conn: socket.socket, seg: Any, sent: tuple[list[int], tuple[int, int]],
                  out: list[pb.StoreResponse | None], error: KDNError | None
                  ) -> KDNError | None:
    """Read the answer to a pipelined PutMany, free its region of ``seg``, record its
    results; the first error (kept, not raised: the later answers must still be read)."""
    batch, block = sent
    try:
        ok, body = fast_answer(conn, answer_bound(len(batch)))
    except BaseException as exc:
        seg.give_back(*block, failed=exc)  # retired where unanswered
        raise
    seg.regions.free(*block)
    if not ok:
        return error or fast_error(body)
    try:
        results = parsed(pb.PutManyResponse, body).results
    except Corrupt as exc:
        return error or exc
    return _record(batch, results, out, error)


def _record(batch: list[int], results: Sequence[pb.StoreResponse],
            out: list[pb.StoreResponse | None], error: KDNError | None) -> KDNError | None:
    """A pipelined call's results into ``out``; an answer with more or fewer results than
    the call had entries is the error (none recorded: which entry an answer is for is not
    known)."""
    if len(results) != len(batch):
        return error or KDNError(f"PutMany answered {len(results)} results for "
                                 f"{len(batch)} entries")
    for i, r in zip(batch, results):
        out[i] = r
    return error
