"""The same-host data path: a client on the server's host shares memory with it.

``SameHostPath`` creates a ``kdn.client.shm.SharedSegment`` on first use and attaches it
(``Attach``); a server that can not map it (another host, another container, no permission)
leaves the path without a segment for good, and says so once in the log. A server that answers
that it knows no such segment (NOT_FOUND for a call naming it: it restarted) gets the same
segment attached again (``renew``, once whichever threads saw it): a new id, its fast path and
its read arena; the old server's arena, its kept leases and connections are dropped. Attached,
the server names a fast path (a Unix socket, ``kdn.server.fastpath``): GetMany / PutMany go
there on a connection per thread (closed when the thread ends: ``kdn.client.perthread``)
instead of gRPC, and the server's read arena of this tenant (``kdn.server.arena``) is handed
over on it (``arena``). The path's name is in Linux's abstract namespace (no permissions: once
the server's listener is gone, any local process may bind it), so each connection made to it
must be accepted by the process seen listening there at attach (its pid and uid,
``SO_PEERCRED``); another one sends the client to gRPC. A call there ends within ``timeout_s``
of its start, all of its sends and receives together (a server that trickles its answer does
not hold it longer), or by the thread's ``kdn.client.deadline.deadline_within`` if sooner; one
the server does not answer in time raises DeadlineExceeded (not made again by gRPC: one
deadline per call) and the path stays. An asynchronous store's answer is read likewise.

Writes on this path: asynchronous stores (``put_async``: written into the segment and sent
without waiting; answers read in order on the sending thread's connection) and pipelined
batches (``put_pipelined``: a ``store_many`` of more than ``kdn.client.pipelined.PIPE_BYTES``
as several PutMany calls of about that size, the next one written into the segment while the
server copies the last one out; ``put_staged_pipelined`` likewise for entries written into
staged entries as they go, ``store_many`` of ``KVCache``s), on this thread's connection, by
``kdn.client.pipelined``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from kdn.client.deadline import Until, call_cap, time_left
from kdn.client.fastwire import (
    answer_bound,
    fast_answer,
    fast_error,
    fast_send,
    unusable,
)
from kdn.client.pending import ASYNC_DEPTH, PendingStore, Sent
from kdn.client.perthread import PerThread
from kdn.client.pipelined import put_pipelined, put_staged_pipelined, write_parts
from kdn.codec import EncodedParts
from kdn.errors import Closed, DeadlineExceeded, KDNError, Unavailable
from kdn.transport.wire import ARENA_SIZE, FAST_ARENA, FAST_HEAD, FAST_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb

log = logging.getLogger(__name__)

class SameHostPath:
    """The shared segment, the fast path and the read arena of a client on the server's host
    (module docstring). ``call``/``metadata``: the client's retrying call and call metadata."""

    def __init__(self, stub: Any, call: Callable[[Callable[[], Any]], Any],
                 metadata: Callable[[str | None], Any], timeout_s: float | None, shm_bytes: int,
                 keep_leases_bytes: int | None = None) -> None:
        self._stub = stub
        self._call = call
        self._metadata = metadata
        self.timeout_s = timeout_s
        self.shm_bytes = shm_bytes
        self.keep_leases_bytes = keep_leases_bytes
        self._lock = threading.Lock()
        self._segment: Any = None
        self._segment_id = ""
        self._tried = shm_bytes <= 0
        self._arena: Any = None  # kdn.client.shm.LeasedArena, where the server lends one
        self._arena_conn: socket.socket | None = None  # the connection it came on (kept open)
        self._fast_path = ""
        self._server: tuple[int, int] | None = None
        """(pid, uid) of the process that listened on the fast path at attach
        (``shm.peer_of``): a later connection to another is refused (``_fast_conn``)."""
        self.threads = PerThread(self._orphaned)
        """Each thread's fast-path connection (``kdn.client.perthread``: closed when its
        thread ends, its stores settled first) and the asynchronous stores sent on it."""
        self._dropped: list[Any] = []  # segments a new server could not map (closed at close)
        self.server_seals = False
        """The server seals staged entries (``AttachResponse.seals``)."""

    def segment(self) -> tuple[Any, str]:
        """(segment, id) once attached; (None, "") when there is none."""
        if self._tried:
            return self._segment, self._segment_id
        with self._lock:
            if not self._tried:
                self._attach()  # a server that can not be reached now raises: ask again later
                self._tried = True
        return self._segment, self._segment_id

    @property
    def arena(self) -> Any:
        """The server's read arena (``kdn.client.shm.LeasedArena``), or None."""
        return self._arena

    @property
    def fast(self) -> bool:
        """Whether calls go on the fast path (attached, and the path still usable)."""
        return bool(self._fast_path)

    def _attach(self) -> None:
        from kdn.client.shm import SharedSegment

        try:
            seg = SharedSegment(self.shm_bytes)
        except (OSError, ValueError, AttributeError) as exc:  # no memfd on this platform
            log.info("kdn: no shared segment (%s); batches go inline", exc)
            return
        try:
            attached = self._attach_segment(seg)
        except BaseException:
            seg.close()
            raise
        if not attached:
            seg.close()

    def _attach_segment(self, seg: Any) -> bool:
        """``Attach`` ``seg``: its id, the server's fast path and read arena. False where the
        server can not map it (another host or container, no permission, an older server);
        Unavailable / DeadlineExceeded where it can not be reached."""
        req = pb.AttachRequest(pid=seg.pid, fd=seg.fd, size=seg.size, nonce=seg.nonce)
        md = self._metadata(None)
        try:
            resp = self._call(lambda: self._stub.Attach(req, timeout=time_left(self.timeout_s),
                                                        metadata=md))
        except (Unavailable, DeadlineExceeded):
            raise
        except KDNError as exc:  # another host or container, no permission, an older server
            log.info("kdn: the server can not map this client's memory (%s); using gRPC", exc)
            return False
        fast_path = resp.fast_path
        if fast_path:
            self._arena, self._arena_conn = self._open_arena(resp.segment_id, fast_path)
            seg.server_gone = self._watch(fast_path, self._arena_conn)
            if self._server is None:
                log.info("kdn: the fast path did not answer at attach; using gRPC")
                fast_path = ""
        self._fast_path = fast_path
        self.server_seals = resp.seals
        # the id last: a thread that reads it reads this server's fast path and arena too
        self._segment, self._segment_id = seg, resp.segment_id
        return True

    def renew(self, seg_id: str) -> None:
        """The server answered NOT_FOUND to a call naming segment ``seg_id``: it knows no such
        segment (it restarted). Attach the same segment again, once whichever threads saw it
        (a call naming an older id returns at once): a new id, the new server's fast path and
        read arena; the old server's arena (its kept leases with it) and connections are
        dropped. Regions in use stay theirs (the memory is the client's). Unavailable /
        DeadlineExceeded where the server can not be reached (a later call naming ``seg_id``
        tries again); where the new server can not map the segment, the client goes on
        without one."""
        with self._lock:
            seg = self._segment
            if seg is None or seg_id != self._segment_id:
                return  # no segment, or attached again by another thread already
            log.info("kdn: the server knows no segment %s (it restarted?); attaching again",
                     seg_id)
            self._let_go()
            seg.server_gone = None  # until the new server is known
            if not self._attach_segment(seg):
                self._segment, self._segment_id = None, ""
                self._dropped.append(seg)  # views of it may still be read: closed at close
            else:
                seg.reclaim()  # what the old server left unanswered, where it has exited

    def _let_go(self) -> None:
        """Drop what the attached server lent: its read arena (closed; views of it stay
        readable until they die), the connection it came on, and the fast path (each thread
        closes its own connection to it when it next calls: ``_fast_conn``)."""
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()
        conn, self._arena_conn = self._arena_conn, None
        if conn is not None:
            conn.close()
        self._fast_path = ""

    def _watch(self, fast_path: str, kept: socket.socket | None) -> Callable[[], bool] | None:
        """Whether the server process behind ``fast_path`` has exited (``shm.server_watch``
        of ``kept``, the read arena's connection, else of one made to ask), or None where
        that is not known. Who that process is (``_server``) is learnt from the same
        connection: the server listens on ``fast_path`` while it answers ``Attach``."""
        from kdn.client.shm import peer_of, server_watch

        self._server = None
        if kept is not None:
            self._server = peer_of(kept)
            return server_watch(kept)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(time_left(self.timeout_s))
            conn.connect("\0" + fast_path)
            self._server = peer_of(conn)
            return server_watch(conn)
        except OSError:
            return None
        finally:
            conn.close()

    def _open_arena(self, seg_id: str, fast_path: str) -> tuple[Any, socket.socket | None]:
        """The server's read arena of this tenant (``kdn.server.arena``), handed over the fast
        path, and the connection it came on (kept open: ``server_alive``); (None, None) where
        the server keeps none or it can not be mapped (reads then copy)."""
        from kdn.client.shm import LeasedArena

        body = seg_id.encode()
        fds: list[int] = []
        ok, body_in = 0, b""
        kept: socket.socket | None = None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                conn.settimeout(time_left(self.timeout_s))
                conn.connect("\0" + fast_path)
                with self._bounded(conn) as call:  # one deadline for the whole exchange
                    call.sendall(FAST_HEAD.pack(len(body), FAST_ARENA) + body)
                    first, fds, _, _ = socket.recv_fds(call, FAST_HEAD.size + ARENA_SIZE.size, 1)
                    head = first[: FAST_HEAD.size]
                    if len(head) < FAST_HEAD.size:
                        head += read_exact(call, FAST_HEAD.size - len(head)) or b""
                    n, ok = FAST_HEAD.unpack(head)
                    body_in = first[FAST_HEAD.size :]
                    body_in += read_exact(call, n - len(body_in)) or b""
            finally:
                if ok and len(fds) == 1 and len(body_in) == ARENA_SIZE.size:
                    conn.settimeout(None)  # kept open, blocking: ``server_alive`` peeks it
                    kept = conn
                else:
                    conn.close()
            if not ok or len(fds) != 1 or len(body_in) != ARENA_SIZE.size:
                log.info("kdn: no read arena from the server (%s)",
                         body_in.decode("utf-8", "replace") if not ok else "malformed answer")
                for fd in fds:
                    os.close(fd)
                return None, kept
            (size,) = ARENA_SIZE.unpack(body_in)
            return LeasedArena(fds[0], size, self.keep_leases_bytes), kept
        except (OSError, ValueError) as exc:
            log.info("kdn: no read arena (%s); reads copy into the segment", exc)
            if kept is not None:
                kept.close()
            return None, None

    def server_alive(self) -> bool:
        """Whether the server that lent the arena still runs: the connection it was handed
        over on is still open (a server that exited, even killed, closed it). Kept leases of
        a gone server are not read again: a new one knows nothing of its words."""
        conn = self._arena_conn
        if conn is None:
            return False
        try:
            return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True  # open, nothing said: alive
        except OSError:
            return False

    def close(self) -> None:
        """Give the arena's leases and the segment back (``Detach``) and close the connections.
        Views of the arena the caller still holds keep what they show: their pages are made
        this process's own first (``LeasedArena.close``); where that fails, the segment stays
        attached, its leases held, until this process exits."""
        seg, seg_id = self._segment, self._segment_id
        self._segment, self._segment_id, self._tried = None, "", True
        kept = True
        if self._arena is not None:  # Detach gives its leases back on the server
            kept = self._arena.close()
            self._arena = None
        if self._arena_conn is not None:
            self._arena_conn.close()
            self._arena_conn = None
        self._fast_path = ""
        self.threads.close()
        for old in self._dropped:
            old.close()
        self._dropped = []
        if seg is None:
            return
        if not kept:
            log.warning("kdn: views of the read arena still read the server's pages; the "
                        "segment stays attached (its leases held) until this process exits")
            return
        try:
            md = self._metadata(None)
            self._call(lambda: self._stub.Detach(pb.DetachRequest(segment_id=seg_id),
                                                 timeout=time_left(self.timeout_s),
                                                 metadata=md))
        except KDNError:
            pass  # the server unmaps it at shutdown anyway
        seg.close()

    # -- the fast path --------------------------------------------------------------------------

    def call(self, op: int, req: pb.GetManyRequest | pb.PutManyRequest) -> bytes | None:
        """One call on this thread's fast-path connection (``kdn.server.fastpath``); None when
        the path is gone (the call then goes by gRPC, and so do later ones, until the segment
        is attached again: ``renew``); DeadlineExceeded when the server did not answer within
        the call's deadline (``_fast_failed``)."""
        path = self._fast_path
        try:
            with self._bounded(self._fast_conn(path)) as conn:
                fast_send(conn, op, req)
                ok, out = fast_answer(conn, answer_bound(
                    len(req.items) if isinstance(req, pb.PutManyRequest) else len(req.keys),
                    0 if isinstance(req, pb.PutManyRequest) else req.inline_below_bytes))
        except OSError as exc:
            self._fast_failed(exc, path)
            return None
        if not ok:
            raise fast_error(out)
        return out

    @contextlib.contextmanager
    def _bounded(self, conn: socket.socket) -> Iterator[socket.socket]:
        """``conn`` for one call, bound to end (``Until``: all its sends and receives
        together) ``timeout_s`` from now, or by the calling thread's ``kdn.client.deadline.
        deadline_within`` if sooner; its own timeout given back after. As it is where there
        is neither."""
        until = self._until()
        if until is None:
            yield conn
            return
        try:
            yield cast(socket.socket, Until(conn, until))
        finally:
            with contextlib.suppress(OSError):
                conn.settimeout(self.timeout_s)

    def _until(self) -> float | None:
        """When a call starting now must end (``time.monotonic``): ``timeout_s`` from now,
        or this thread's ``deadline_within`` if sooner; None where there is neither."""
        cap = call_cap()
        own = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        return own if cap is None else cap if own is None else min(own, cap)

    def _fast_conn(self, path: str | None = None, *, settle: bool = True) -> socket.socket:
        """This thread's connection to the fast path ``path`` (default: the current one;
        calls on it are answered in order; with ``settle``, after this thread's asynchronous
        stores' answers are read). A connection to another path (a server before a restart:
        ``renew``), or one with no answer due that holds bytes no call asked for (a server out
        of step: ``fastwire.unusable``) or was closed, is closed first."""
        if path is None:
            path = self._fast_path
        if settle and self.has_pending():
            self.settle()
        held = self.threads.mine()
        conn = held.conn
        if conn is not None and (held.path != path or (not held.pending and unusable(conn))):
            self._close_conn()
            conn = None
        if conn is None:
            if not path:
                raise OSError("no fast path")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.settimeout(self.timeout_s)
                conn.connect("\0" + path)
                self._check_server(conn)
            except OSError:
                conn.close()
                raise
            self.threads.hold(held, conn, path)
        return conn

    def _check_server(self, conn: socket.socket) -> None:
        """OSError (the fast path is then given up: gRPC) where the process that accepted
        ``conn`` is not the server seen at attach (``_server``): the path's name is in the
        abstract namespace, which has no permissions; once the server's listener is gone any
        local process may bind it and answer with entries of its own."""
        from kdn.client.shm import peer_of

        peer = peer_of(conn)
        if peer is None or peer != self._server:
            log.warning("kdn: the same-host fast path is held by another process (pid, uid "
                        "%s, not the server's %s); using gRPC", peer, self._server)
            raise OSError("the fast path is not held by the server attached")

    def _close_conn(self) -> None:
        """Close this thread's fast-path connection."""
        self.threads.drop(self.threads.peek())

    def _fast_failed(self, exc: OSError, path: str) -> None:
        """A call on the fast path ``path`` failed on this thread, to go another way (gRPC):
        ``_fast_lost``; but DeadlineExceeded where it timed out (a server stopped, hung or
        too slow for the call's deadline): this thread's connection, whose answer may still
        come, is closed, and the path stays for later calls; the call is not made again by
        gRPC, which would wait out a whole deadline more."""
        if isinstance(exc, TimeoutError):
            self._close_conn()
            raise DeadlineExceeded(f"the server did not answer on the same-host fast path "
                                   f"within the call's deadline (timeout_s={self.timeout_s}, "
                                   "or the caller's deadline_within)") from exc
        self._fast_lost(exc, path)

    def _fast_lost(self, exc: OSError, path: str) -> None:
        """The fast path ``path`` failed on this thread: gRPC from now on, unless the segment
        was attached again meanwhile (another path: ``renew``)."""
        if path and path == self._fast_path:
            log.info("kdn: fast path unusable (%s); using gRPC", exc)
            self._fast_path = ""
        self._close_conn()

    # -- asynchronous stores (``Client.store_async``) -------------------------------------------

    def _pending(self) -> deque[Sent]:
        return self.threads.mine().pending

    def has_pending(self) -> bool:
        held = self.threads.peek()
        return held is not None and bool(held.pending)

    def put_async(self, namespace: str, key: bytes, opts: pb.StoreOptions, *,
                  parts: EncodedParts | None = None, staged: Any = None,
                  on_done: Any = None) -> PendingStore | None:
        """Send one store on this thread's fast-path connection without waiting for its
        answer: ``parts`` written into a region of the segment (freed when answered), or a
        staged entry named where it lies (sealed by the server; its region kept until then,
        closed or not, and retired, the entry closed, where no answer comes: ``_lost``). None
        where it can not go this way (no segment or fast path, too large, no room): the
        caller stores it as ``store`` does."""
        self.segment()  # attached on first use
        path = self._fast_path  # read before the id: a renewed id comes with its own path
        seg, seg_id = self.segment()
        if seg is None or not path:
            return None
        q = self._pending()
        block: tuple[int, int] | None = None
        lent = staged.lend(seg) if staged is not None else None
        if staged is not None:
            if lent is None:
                return None
            start, length = lent.region
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
        try:  # the region goes back whatever fails before the call is sent
            if parts is not None:
                write_parts(seg, start, parts)
            req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id)
            item = req.items.add(key=key, options=opts, seal=staged is not None)
            item.region.offset, item.region.length = start, length
        except BaseException:
            if block is not None:
                seg.regions.free(*block)
            raise
        pending = PendingStore(self, key, on_done)
        held = self.threads.mine()
        if q and (held.conn is None or held.path != path):
            self.settle()  # their connection went (or is an old server's): read them first
        try:
            conn = self._fast_conn(path, settle=False)
            fast_send(conn, FAST_PUT_MANY, req)
        except OSError as exc:
            if block is not None:  # part of the call may have reached the server
                seg.give_back(*block, failed=exc)
            if lent is not None:  # (the entry stays open: stored another way, as it is)
                seg.retire_owned(lent.start)
            self._fast_failed(exc, path)
            return None
        q.append((pending, block, lent))
        while len(q) > ASYNC_DEPTH:
            self._settle_one(q)
        return pending

    def settle(self, until: PendingStore | None = None) -> None:
        """Read this thread's unanswered asynchronous stores' answers, oldest first (up to
        ``until`` when given)."""
        held = self.threads.peek()
        q = held.pending if held is not None else None
        while q:
            first = q[0][0]
            self._settle_one(q)
            if first is until:
                return

    def take_failed(self) -> list[KDNError]:
        """The errors of this thread's asynchronous stores answered since the last call."""
        held = self.threads.peek()
        if held is None:
            return []
        failed, held.failed = held.failed, []
        return failed

    def _settle_one(self, q: deque[Sent]) -> None:
        pending, block, lent = q.popleft()
        seg = self.segment()[0]
        try:
            conn = self.threads.mine().conn
            if conn is None:
                raise OSError("the fast path is gone")
            with self._bounded(conn) as bounded:
                ok, body = fast_answer(bounded, answer_bound(1))
        except OSError as exc:  # the connection went: no answer will come for any of them
            failed = self.threads.mine().failed
            failed += self._lost([(pending, block, lent), *q], seg, exc)
            q.clear()
            if isinstance(exc, TimeoutError):  # the path stays (``_fast_failed``): this
                self._close_conn()  # connection goes
            else:
                self._fast_lost(exc, self.threads.mine().path)
            return
        if block is not None and seg is not None:
            seg.regions.free(*block)
        error = pending.answer(ok, body)
        if error is not None:
            self.threads.mine().failed.append(error)

    def _lost(self, lost: list[Sent], seg: Any, exc: OSError) -> list[KDNError]:
        """Fail stores whose answers will not come (``exc``: why), their regions given back
        (retired: the server may still read them); their errors (Closed: cut by ``close``)."""
        errors: list[KDNError] = []
        for p, b, lent in lost:
            if b is not None and seg is not None:
                seg.give_back(*b, failed=exc)
            if lent is not None:
                lent.lost()
            errors.append(DeadlineExceeded(
                f"the server did not answer the store of {p.key!r} on the same-host fast "
                f"path within timeout_s={self.timeout_s}; it may or may not be stored")
                if isinstance(exc, TimeoutError) else Closed(
                f"the client was closed before the store of {p.key!r} was answered; it may "
                "or may not be stored") if self.threads.closed else Unavailable(
                f"the fast path closed before the store of {p.key!r} was answered "
                f"({exc}); it may or may not be stored"))
            p.resolve(None, errors[-1])
        return errors

    def _orphaned(self, conn: socket.socket | None, q: deque[Sent]) -> None:
        """The stores a thread sent and left unanswered as it ended (``kdn.client.
        perthread``; on a thread of their own): their answers read on its connection
        (``conn``; None: closed with the client), so that their regions come back."""
        seg = self._segment
        while q:
            pending, block, _ = q[0]
            try:
                if conn is None:
                    raise OSError("the client was closed")
                with self._bounded(conn) as bounded:
                    ok, body = fast_answer(bounded, answer_bound(1))
            except OSError as exc:
                self._lost(list(q), seg, exc)
                q.clear()
                return
            q.popleft()
            if block is not None and seg is not None:
                seg.regions.free(*block)
            pending.answer(ok, body)

    # -- pipelined batches (``kdn.client.pipelined``) -------------------------------------------

    def put_pipelined(self, namespace: str,
                      items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]]
                      ) -> list[pb.StoreResponse | None] | None:
        """``pipelined.put_pipelined`` on this thread's fast-path connection: each item's
        answer, or None for those to store another way; None where the batch is not
        pipelined (no fast path, one item, ``PIPE_BYTES`` or less in all)."""
        path = self._fast_path
        if not path:
            return None
        seg, seg_id = self.segment()
        return put_pipelined(namespace, items, seg, seg_id, lambda: self._fast_conn(path),
                             lambda exc: self._fast_failed(exc, path))

    def put_staged_pipelined(self, namespace: str,
                             items: Sequence[tuple[bytes, pb.StoreOptions]],
                             stage: Callable[[int], Any]) -> list[pb.StoreResponse | None] | None:
        """``pipelined.put_staged_pipelined`` on this thread's fast-path connection: each
        item's answer, or None for those to store another way; None where there is no fast
        path."""
        path = self._fast_path
        seg, seg_id = self.segment()
        if not path or seg is None:
            return None
        return put_staged_pipelined(namespace, items, stage, seg, seg_id,
                                    lambda: self._fast_conn(path),
                                    lambda exc: self._fast_failed(exc, path))

