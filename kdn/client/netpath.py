"""The client side of the network data path (``kdn.server.netpath``): GetMany / PutMany with
the entries' bytes on a TCP connection of this thread's, for a client on another host.

``DataPlane`` asks for a ticket (``Attach`` with ``remote``) when it has no shared segment and
sends its batches here once it has one; a connection that can not be made, or breaks (a new
one the server closed before its answer is tried once more, on a fresh one), sends the plane
back to gRPC for good (it says so once in the log), except on a path that worked before:
there the server may have restarted (another port, its tickets forgotten), so the path is asked
for again once (``RemotePath``), and the call made on the new one. A PutMany's items go from
their frames straight into the kernel (``kdn.transport.wire.send_pieces``); a GetMany's entries
are read into one recycled buffer each (the process's ``LANDED`` pool), its first frame at
a multiple of 64 bytes so decoded tensors view it in place, each frame checked the moment it
lands (in cache). Each thread calls on a connection of its own, closed when the thread ends
(``kdn.client.perthread``); a new one the server refuses for its connection limits sends that
call by gRPC (the path stays).

A GetMany of several large entries is striped: its keys are cut into runs, one per
connection (``NetPath.stripes``: ``connections`` of the client, or chosen by the size of
the entries this path has brought, ``STRIPE_MIN_BYTES`` a connection, at most
``MAX_STRIPES`` and one per two cores), each run asked for on a connection of its own,
side by side; every entry whole from one answer (one stored version). ``get_many`` returns
them all; ``start_get_many`` returns once the answers say which keys are present, and the
path's threads land each entry after (``kdn.client.landing.PendingStream``: what
``Client.retrieve_streams`` hands a remote caller, so that its first layers compute while
the rest streams).
Entries bound for a CUDA device (``pinned``) land in page-locked memory, so that one
host-to-device copy per entry reads them where they lie. A stripe that fails (its
connection dropped inside an entry, a damaged or wrong answer) fails the whole ``get_many``
call: the other stripes are read to their end or their connections closed, and nothing of
the call is returned; under ``start_get_many`` it fails its entries from the one it failed
in on (raised from their streams' waits), Unavailable for a dropped connection (Closed for
one the client's ``close`` shut). A failed stripe's connection is closed; the path goes on
with new ones.

Every call has one deadline for all of its sends and receives (``kdn.client.deadline``):
``timeout_s`` from its start, or a thread's ``deadline_within`` if sooner; an asynchronous
store's answer is read within the same from when it is waited for. An entry's future
cancelled before it landed (``PendingStream.cancel``) shuts its stripe's connection once no
other entry of the stripe is awaited (until then its bytes are read and dropped).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

from kdn.client.deadline import Until, awaited_after, call_cap, deliver, unbound, watch_stripe
from kdn.client.fastwire import (
    answer_bound,
    entry_refs,
    fast_answer,
    fast_error,
    get_request,
    put_results,
    read_entry,
    streamed_put,
    unusable,
)
from kdn.client.parallel import stream_cores
from kdn.client.perthread import Crowded, PerThread, refused
from kdn.codec import EncodedParts
from kdn.errors import (
    Cancelled,
    Closed,
    DeadlineExceeded,
    KDNError,
    Unavailable,
    again,
    kept,
)
from kdn.layout import Expected
from kdn.transport.buffers import BufferPool
from kdn.transport.wire import (
    FAST_HEAD,
    NET_GET_MANY,
    NET_MAX_KEYS,
    NET_PUT_MANY,
    send_pieces,
)
from kdn.v1 import kdn_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")
CONNECT_S = 2.0
"""Seconds a connection may take to open (a firewalled port: gRPC instead)."""
STRIPE_MIN_BYTES = 16 << 20
"""Entry bytes per connection below which a GetMany is not striped (its calls and threads
cost more than the connections side by side gain)."""
STRIPE_MAX_BYTES = 1 << 30
"""Entry bytes one stripe's call asks for at most, by the size of the last entry brought (a
server holds at most 2 GiB read from its disk tiers for one answer)."""
MAX_STRIPES = 8
"""Connections one GetMany is striped over at most, chosen by size (``connections`` may
ask for more, up to ``MAX_CONNECTIONS``)."""
MAX_CONNECTIONS = 32
"""Connections one GetMany may be striped over at most, asked for (the server serves 256
at once, a thread each)."""
LANDING_BYTES = 1 << 30
"""Bytes of landed entries' buffers the process keeps for the next ones once nothing views
them (an 8k-token Llama-3-8B context): fresh memory is faulted in at 1.2-1.9 GB/s (0.3 while
the kernel compacts it for huge pages), slower than loopback, so a context read again lands in
memory that is already there, as a socket loop's kept buffer. One pool for every path of the
process (``LANDED``): a new client's first hit lands where an earlier one's entries lay."""
LANDED = BufferPool(LANDING_BYTES)


class NetPath:
    """Calls on the network data path at ``(host, port)`` acting as ``ticket``'s holder."""

    def __init__(self, host: str, port: int, ticket: str, timeout_s: float | None,
                 tls: ssl.SSLContext | None = None, server_name: str = "",
                 connections: int = 0) -> None:
        self.host, self.port, self.ticket = host.strip("[]"), port, ticket
        self.timeout_s = timeout_s
        self._tls, self._server_name = tls, server_name or self.host
        self.connections = max(0, min(connections, MAX_CONNECTIONS))
        """Connections a GetMany of several keys is striped over; 0: chosen by size
        (``stripes``)."""
        self.threads = PerThread(self._orphaned)
        """Each thread's connection (``kdn.client.perthread``: closed when its thread ends)."""
        self._all: list[socket.socket] = []  # the stripes' connections
        self._spare: list[socket.socket] = []  # those idle
        self.landing = LANDED
        """Where entries land (host memory; page-locked ones come from torch's caching host
        allocator, which keeps them too)."""
        self._stripers: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.entry_bytes = 0
        """The size of the last entry this path brought (what ``stripes`` counts with)."""
        self.worked = False
        """The server answered a call on this path (a later failure may be a restart)."""
        self.closed_by: KDNError | None = None
        self._calls = itertools.count(1)  # a striped GetMany's number (its stripes: one answer)

    def _open(self) -> socket.socket:
        """A new connection for a stripe (kept in ``_all`` until closed)."""
        conn = self._connect()
        with self._lock:
            self._all.append(conn)
        return conn

    def _connect(self) -> socket.socket:
        """A new connection to the data path."""
        conn = socket.create_connection((self.host, self.port), timeout=CONNECT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:  # the server's certificate checked as gRPC checks it
            try:
                conn = self._tls.wrap_socket(conn, server_hostname=self._server_name)
            except BaseException:
                conn.close()
                raise
        conn.settimeout(self.timeout_s)
        return conn

    def _until(self, conn: socket.socket, until: float | None) -> socket.socket:
        """``conn`` bound to end by ``until`` (``kdn.client.deadline.Until``); itself
        where there is no deadline."""
        return conn if until is None else cast(socket.socket, Until(conn, until))

    def _deadline(self) -> float | None:
        """When a call starting now must end: ``timeout_s`` from now, or this thread's
        ``kdn.client.deadline.deadline_within`` if that is sooner (None: neither)."""
        own = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        cap: float | None = call_cap()
        return cap if own is None else own if cap is None else min(own, cap)

    def _conn(self, *, check: bool = False) -> tuple[socket.socket, bool]:
        """(this thread's connection, whether it is new). ``check`` (no answer is due on it):
        a connection the server closed while it was idle (a restart, its idle timeout), or
        that holds bytes no call asked for (``fastwire.unusable``), is opened again first.
        Crowded where the server refused this thread a connection a moment ago."""
        held = self.threads.mine()
        conn = held.conn
        if conn is not None and check and unusable(conn):
            self._drop_conn_only()
            conn = None
        if conn is not None:
            return conn, False
        if held.crowded:
            raise Crowded("the data path refused this thread a connection a moment ago")
        conn = self._connect()
        self.threads.hold(held, conn)
        return conn, True

    def _drop(self) -> None:
        self._drop_conn_only()
        self._lose_pending("the data path connection closed")

    # -- asynchronous stores (``Client.store_async`` of a client without a segment) -------------

    def has_pending(self) -> bool:
        held = self.threads.peek()
        return held is not None and bool(held.pending)

    def put_async(self, namespace: str, key: bytes, parts: EncodedParts,
                  opts: pb.StoreOptions, pending: Any, depth: int) -> bool | None:
        """Send one store on this thread's connection without reading its answer (at most
        ``depth`` unanswered: past it the oldest is read). False when the path failed; None
        where this thread has no connection open (the store goes as ``store`` does, which
        opens one: a server that refuses it answers that call, not a later one)."""
        req, pieces = streamed_put(namespace, self.ticket, [(key, parts, opts)])
        body = req.SerializeToString()
        held = self.threads.mine()
        q = held.pending
        if held.conn is not None and not q and unusable(held.conn):
            self._drop_conn_only()  # nothing unanswered on it: closed, or out of step
        if held.conn is None:
            return None
        try:
            conn, _ = self._conn()
            send_pieces(conn, [FAST_HEAD.pack(len(body), NET_PUT_MANY) + body, *pieces])
        except OSError:
            self._drop()
            return False
        q.append(pending)
        while len(q) > depth:
            self._settle_one(q)
        return True

    def settle(self, until: Any = None) -> None:
        """Read this thread's unanswered stores' answers, oldest first (up to ``until``)."""
        held = self.threads.peek()
        q = held.pending if held is not None else None
        while q:
            first = q[0]
            self._settle_one(q)
            if first is until:
                return

    def take_failed(self) -> list[KDNError]:
        held = self.threads.peek()
        if held is None:
            return []
        failed, held.failed = held.failed, []
        return failed

    def _settle_one(self, q: Any) -> None:
        pending = q[0]
        conn = self.threads.mine().conn
        try:
            if conn is None:
                raise OSError("the data path connection closed")
            ok, out = fast_answer(self._until(conn, self._deadline()),  # as a call's
                                  answer_bound(1))
            conn.settimeout(self.timeout_s)
        except OSError as exc:
            self._drop_conn_only()
            self._lose_pending(str(exc), timed_out=isinstance(exc, TimeoutError))
            return
        q.popleft()
        self.worked = True
        error = pending.answer(ok, out)
        if error is not None:
            self.threads.mine().failed.append(error)

    def _orphaned(self, conn: socket.socket | None, q: deque[Any]) -> None:
        """The stores a thread sent and left unanswered as it ended (``kdn.client.
        perthread``; on a thread of their own): their answers read on its connection
        (``conn``; None: closed with the client)."""
        while q:
            try:
                if conn is None:
                    raise OSError("the client was closed")
                ok, out = fast_answer(self._until(conn, self._deadline()), answer_bound(1))
            except OSError as exc:
                while q:
                    p = q.popleft()
                    p.resolve(None, self._unanswered(p, str(exc), isinstance(exc, TimeoutError)))
                return
            q.popleft().answer(ok, out)

    def _drop_conn_only(self) -> None:
        self.threads.drop(self.threads.peek())

    def _fail(self, pending: Any, error: KDNError) -> None:
        pending.resolve(None, error)
        self.threads.mine().failed.append(error)

    def _lose_pending(self, why: str, timed_out: bool = False) -> None:
        """No answer will come for this thread's unanswered stores: each fails UNAVAILABLE
        (DEADLINE_EXCEEDED where ``timed_out``: the server did not answer in time)."""
        held = self.threads.peek()
        q = held.pending if held is not None else None
        while q:
            p = q.popleft()
            self._fail(p, self._unanswered(p, why, timed_out))

    def _unanswered(self, p: Any, why: str, timed_out: bool) -> KDNError:
        """The error of a store whose answer will not come (Closed: cut by ``close``)."""
        return DeadlineExceeded(
            f"the data path did not answer the store of {p.key!r} within the call's "
            f"deadline (timeout_s={self.timeout_s}); it may or may not be stored") \
            if timed_out else Closed(
            f"the client was closed before the store of {p.key!r} was answered; it may or "
            "may not be stored") if self.threads.closed else Unavailable(
            f"the data path closed before the store of {p.key!r} was answered ({why}); "
            "it may or may not be stored")

    def _call(self, op: int, req: pb.GetManyRequest | pb.PutManyRequest,
              after: Sequence[bytes | memoryview] = (), until: float | None = None
              ) -> tuple[socket.socket, bytes]:
        """Send one call and read its answer's body: (the connection, the body), its entries
        (GetMany) still to be read off the connection. A connection the server closed (while
        it was idle, or a new one before its call was read: evicted among silent strangers',
        ``kdn.server.fastpath``) is opened again once, not one that timed out (a hung server
        would cost another ``timeout_s``); OSError when the path is gone, the error the
        server answered otherwise; a connection holding bytes no call asked for is not used.
        ``until``: the call's deadline (``_deadline``), its connection returned bound to it."""
        if self.has_pending():  # the answers on this connection are theirs first
            self.settle()
        until = self._deadline() if until is None else until
        body = req.SerializeToString()
        pieces = [FAST_HEAD.pack(len(body), op) + body, *after]
        most = answer_bound(len(req.items) if isinstance(req, pb.PutManyRequest)
                            else len(req.keys))
        for attempt in (0, 1):
            raw, new = self._conn(check=True)
            conn = self._until(raw, until)
            try:
                sent = self._sent(conn, pieces, most)
                ok, out = fast_answer(conn, most) if sent is None else sent
                self.worked = True
                break
            except OSError as exc:
                self._drop()
                if attempt or isinstance(exc, TimeoutError):
                    raise
        if not ok:
            self._drop()  # a refused call may close the connection (kdn.server.netpath)
            raise self._refused(out, new)
        return conn, out

    @staticmethod
    def _sent(conn: socket.socket, pieces: Sequence[bytes | memoryview], most: int
              ) -> tuple[int, bytes] | None:
        """``pieces`` sent on ``conn``: None, or where the sending failed, the refusal the
        server answered before it closed (an entry over its ``max_entry_bytes``: answered
        and closed as the rest came, ``kdn.server.netpath``); the send's OSError where there
        is none to read (the path gave up for good on a refused entry)."""
        try:
            send_pieces(conn, pieces)
            return None
        except TimeoutError:
            raise
        except OSError as exc:
            try:
                ok, out = fast_answer(conn, most)
            except (OSError, KDNError):
                raise exc from None
            if ok:
                raise
            return ok, out

    def _refused(self, out: bytes, new: bool) -> KDNError:
        """The error a refused call (``out``: its answer's body) raises, counted against
        this thread's share of the server's calls where it was crowded out."""
        error = refused(fast_error(out), new)
        if isinstance(error, Crowded):
            self.threads.mine().refused()
        return error

    def put_many(self, namespace: str,
                 items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]]
                 ) -> list[pb.StoreResponse]:
        """Store ``items`` in one call (each checked by the server before any is stored)."""
        req, pieces = streamed_put(namespace, self.ticket, items)
        conn, out = self._call(NET_PUT_MANY, req, pieces)
        conn.settimeout(self.timeout_s)  # its next call's
        return put_results(out, len(items))

    def stripes(self, count: int) -> int:
        """Connections a GetMany of ``count`` keys is striped over: ``connections``, or
        where that is 0, one per ``STRIPE_MIN_BYTES`` of entries the size of the last one
        brought, at most ``MAX_STRIPES`` and no more than this process's cores receive side
        by side (``parallel.stream_cores``: a connection's receive and checks keep a core
        busy); at least one per ``NET_MAX_KEYS`` keys and ``STRIPE_MAX_BYTES`` of entries;
        never more than the keys."""
        n = self.connections or min(MAX_STRIPES, stream_cores(),
                                    count * self.entry_bytes // STRIPE_MIN_BYTES)
        # and as many as the server's limits per call take (keys; bytes read from its disk)
        n = max(n, -(-count // NET_MAX_KEYS), -(-count * self.entry_bytes // STRIPE_MAX_BYTES))
        return max(1, min(n, count, MAX_CONNECTIONS))

    def get_many(self, namespace: str, keys: Sequence[bytes], want: Expected,
                 *, pinned: bool = False) -> list[tuple[memoryview, str] | None]:
        """(entry bytes, tier) of each key, None for a miss: one call, or one per stripe
        (``stripes``) side by side. ``pinned``: the entries land in page-locked memory (they
        are bound for a CUDA device)."""
        n = self.stripes(len(keys))
        if n == 1:
            return self._get_one(namespace, keys, want, pinned)
        if self.has_pending():  # this thread's stores first: a read sees what it wrote
            self.settle()
        bounds = [round(i * len(keys) / n) for i in range(n + 1)]
        runs = [keys[a:b] for a, b in zip(bounds, bounds[1:])]
        pool, call = self._pool(), next(self._calls)
        later: list[Future[list[tuple[memoryview, str] | None]]] = [
            pool.submit(self._get_stripe, namespace, run, want, pinned, call)
            for run in runs[1:]]
        got: list[tuple[memoryview, str] | None] = []
        failed: BaseException | None = None
        try:
            got = self._get_one(namespace, runs[0], want, pinned, call)
        except BaseException as exc:  # the other stripes still end (or fail) first
            failed = kept(exc)  # its traceback holds this frame, which holds it
        for fut in later:
            try:
                part = fut.result()
            except BaseException as exc:  # its traceback holds this frame, which holds
                kept(exc)  # ``later``, which holds it
                failed = failed or exc
                continue
            got += part
        if failed is not None:
            raise again(failed)
        return got

    def start_get_many(self, namespace: str, keys: Sequence[bytes], want: Expected,
                       *, pinned: bool = False) -> list[tuple[str, Future[memoryview]] | None]:
        """``get_many`` that returns once every stripe's answer is in (which keys are
        present, not their bytes): per key None (a miss) or (tier, the future of its
        bytes), which the path's threads fill as each entry lands, in order within a
        stripe. A stripe whose connection drops inside an entry, or whose entry is
        damaged, fails that entry's future and the stripe's later ones (Unavailable,
        Corrupt). OSError or the server's error when the calls could not be made."""
        if self.has_pending():  # this thread's stores first: a read sees what it wrote
            self.settle()
        n = self.stripes(len(keys))
        bounds = [round(i * len(keys) / n) for i in range(n + 1)]
        runs = [keys[a:b] for a, b in zip(bounds, bounds[1:])]
        call = next(self._calls) if n > 1 else 0
        conns: list[socket.socket] = []
        until = self._deadline()
        try:
            news = []
            for run in runs:  # every call sent before any answer is read: served side by side
                raw, new = self._spare_conn()
                conn = self._until(raw, until)
                conns.append(conn)
                news.append(new)
                body = get_request(namespace, run, want, self.ticket, call).SerializeToString()
                send_pieces(conn, [FAST_HEAD.pack(len(body), NET_GET_MANY) + body])
            refs = []
            for conn, new, run in zip(conns, news, runs):
                ok, out = fast_answer(conn, answer_bound(len(run)))
                self.worked = True
                if not ok:
                    raise refused(fast_error(out), new)
                refs.append(entry_refs(out, len(run)))
        except BaseException:
            for conn in conns:  # answers left unread on them: lost
                self._forget(unbound(conn))
            raise
        pool = self._pool()
        got: list[tuple[str, Future[memoryview]] | None] = []
        for conn, stripe in zip(conns, refs):
            futures: list[Future[memoryview] | None] = [
                Future() if ref.present else None for ref in stripe]
            got += [None if f is None else (ref.tier, f) for ref, f in zip(stripe, futures)]
            watch_stripe(unbound(conn), futures)  # all let go: the landing stops there
            pool.submit(self._land, conn, [r.length for r in stripe], futures, pinned)
        return got

    def _land(self, conn: socket.socket, lengths: list[int],
              futures: list[Future[memoryview] | None], pinned: bool) -> None:
        """One stripe's entries read off ``conn`` into their futures, in order."""
        raw = unbound(conn)
        for j, (length, fut) in enumerate(zip(lengths, futures)):
            if fut is None:
                continue
            try:
                if fut.cancelled() and not awaited_after(futures, j):
                    raise Cancelled("the entry was let go before it landed")
                # let go with later entries awaited: read and dropped (the connection stays)
                deliver(fut, read_entry(conn, length, pinned and not fut.cancelled(),
                                        self.landing))
                self.entry_bytes = length
            except BaseException as exc:
                self._forget(raw)
                if isinstance(exc, TimeoutError):
                    exc = DeadlineExceeded(f"the data path did not bring an entry within "
                                           f"the call's deadline (timeout_s="
                                           f"{self.timeout_s}, or the caller's "
                                           "deadline_within)")
                elif isinstance(exc, OSError) and self.closed_by is not None:
                    exc = again(self.closed_by)  # shut by the client's close, not the network
                elif isinstance(exc, OSError):
                    exc = Unavailable(f"the data path connection dropped inside an entry "
                                      f"({exc}); nothing of it is used")
                kept(exc)  # its traceback holds this frame, which holds the futures
                for later in futures[j:]:
                    if later is not None and not later.done():
                        later.set_exception(exc)
                return
        raw.settimeout(self.timeout_s)
        with self._lock:
            if raw in self._all:
                self._spare.append(raw)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._stripers is None:
                self._stripers = ThreadPoolExecutor(MAX_CONNECTIONS,
                                                    thread_name_prefix="kdn-stripe")
            return self._stripers

    def _spare_conn(self) -> tuple[socket.socket, bool]:
        """(an idle connection of the stripes', or a new one; whether it is new)."""
        with self._lock:
            while self._spare:
                conn = self._spare.pop()
                if not unusable(conn):  # the server's idle timeout, a restart, out of step
                    return conn, False
                self._all.remove(conn)
                conn.close()
        return self._open(), True

    def _get_one(self, namespace: str, keys: Sequence[bytes], want: Expected,
                 pinned: bool, call: int = 0) -> list[tuple[memoryview, str] | None]:
        """One GetMany on this thread's connection (``call``: of a striped one's, 0: none)."""
        conn, out = self._call(NET_GET_MANY, get_request(namespace, keys, want, self.ticket,
                                                           call))
        try:
            got = self._entries(conn, out, len(keys), pinned)
        except BaseException:
            self._drop()  # whatever of the answer is left unread: the connection is lost
            raise
        conn.settimeout(self.timeout_s)
        return got

    def _get_stripe(self, namespace: str, keys: Sequence[bytes], want: Expected,
                    pinned: bool, call: int) -> list[tuple[memoryview, str] | None]:
        """One stripe's GetMany, on a spare connection of the path's (given back once its
        answer is read whole; closed when the call fails: what is left of it is unread)."""
        raw, new = self._spare_conn()
        conn = self._until(raw, self._deadline())
        try:
            body = get_request(namespace, keys, want, self.ticket, call).SerializeToString()
            send_pieces(conn, [FAST_HEAD.pack(len(body), NET_GET_MANY) + body])
            ok, out = fast_answer(conn, answer_bound(len(keys)))
            self.worked = True
            if not ok:
                raise refused(fast_error(out), new)
            got = self._entries(conn, out, len(keys), pinned)
        except BaseException:
            self._forget(raw)
            raise
        raw.settimeout(self.timeout_s)
        with self._lock:
            if raw in self._all:  # not closed meanwhile (``close``)
                self._spare.append(raw)
        return got

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def _entries(self, conn: socket.socket, out: bytes, count: int, pinned: bool
                 ) -> list[tuple[memoryview, str] | None]:
        """The entries of a GetMany answer (``out``, its body) for ``count`` keys, read off
        ``conn``. Corrupt when the answer does not add up."""
        got: list[tuple[memoryview, str] | None] = []
        for ref in entry_refs(out, count):
            if not ref.present:
                got.append(None)
                continue
            got.append((read_entry(conn, ref.length, pinned, self.landing), ref.tier))
            self.entry_bytes = ref.length
        return got

    def close(self, closed_by: KDNError | None = None) -> None:
        """Close the connections; ``closed_by``: the error an entry still landing raises (the
        client's Closed), else Unavailable (the path was lost)."""
        self.closed_by = closed_by
        with self._lock:
            conns, self._all, self._spare = self._all, [], []
            pool, self._stripers = self._stripers, None
        self.threads.close()
        for conn in conns:  # shut first: a thread waiting on one wakes (close alone: not)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if pool is not None:
            pool.shutdown(wait=False)

