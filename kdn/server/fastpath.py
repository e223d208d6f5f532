"""The same-host fast path: GetMany / PutMany over a unix socket, without gRPC.

A client that attached a shared segment (``kdn.server.segments``) learns the name of this socket
from ``AttachResponse.fast_path`` and may send its GetMany / PutMany there: the same protobuf
messages, the same handlers, the same checks, but none of the per-call cost of a gRPC stack
(HTTP/2 framing, the event loop, a thread hop), which dominates small entries.

Wire, per call, on one connection (calls on a connection are sequential; ``kdn.transport.wire``):

    request   u32 body length | u8 op (1 GetMany, 2 PutMany, 3 Arena) | body (the serialized
              request; for Arena the segment id)
    response  u32 body length | u8 ok (1) or error (0) | body (the serialized response, or
              "STATUS_NAME" NUL message for an error)

Arena hands the caller the descriptor of its tenant's read arena (``kdn.server.arena``) as
SCM_RIGHTS ancillary data of the response, whose body is the arena's size (u64): a unix socket
is the one way to give a process a descriptor it may not open by path (another user's).

Who may call: the socket is in Linux's abstract namespace (no file), so any local process can
connect; a call is served only when its ``segment_id`` names an attached segment, and the call
then acts as the caller that attached it (with its tenant's rate limit and quota). A segment id
is 128 random bits handed only to the authenticated client that attached the segment, so it is
the capability; requests without one are refused.

Holding a connection (both paths; the network data path, ``kdn.server.netpath``, names a
ticket where this one names a segment): until one of its calls names a live segment a
connection is *pending*: its first call must arrive within ``first_call_s`` (the server's
``handshake_timeout_s``), its body may hold at most ``FIRST_BODY`` bytes, and at most
``MAX_PENDING`` connections are pending at once (a new one past that closes the oldest silent
one: a client names its segment in its first call, so only those that sit silent lose out).
Once admitted, on the network path each call's request must still arrive whole within
``first_call_s`` of its first byte (a body that stops short holds no memory for long; here
an admitted caller is a tenant's own client, read as it sends); at most ``max_connections``
are admitted at once, ``max_per_owner`` of one segment's (a client holds one per thread
that calls) and, where callers are authenticated, ``TENANT_SHARE`` percent of them one
tenant's, so that no one client, nor one tenant's, holds every slot; an admitted
connection may then stay silent ``idle_s`` between calls (0 here: a same-host client keeps
one to learn of the server's exit). Each connection is a thread: these bounds are the
server's threads too (one whose thread can not start is closed, ``<kind>.thread_errors``).

A call that fails not on purpose (a bug, not a ``KDNError``) is answered INTERNAL and logged
with its traceback, and its connection then closes (its stream may be out of step).

Calls here do not pass the gRPC interceptor: they are counted (``fast.<rpc>``, and by status
code and latency in ``kdn_fastpath_requests_total`` / ``kdn_fastpath_request_seconds``,
``kdn.server.usage``) but have no access-log line.

Lifecycle: the server starts one ``FastPath`` (a listening thread) once it listens; each
connection is served by its own daemon thread. At shutdown ``stop_accepting`` closes the
listener, the pending connections and those waiting for a call (a call whose first bytes come
later is not read: its client hears the connection close, and nothing of it is applied);
``drain`` waits up to the server's ``shutdown_grace_s`` for the calls in flight to be answered,
as gRPC's do; ``close`` then closes what is left.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kdn.errors import InvalidArgument, KDNError, NotFound, TooLarge, kept
from kdn.server.arena import Arenas
from kdn.server.auth import Principal
from kdn.server.batch import BatchReads, copy_pool
from kdn.server.door import Door, Peer, cut_conn, queued, recv_by, still_there
from kdn.server.egress import Egress, Pacer
from kdn.server.requests import check_names
from kdn.server.segments import Segments
from kdn.server.streamed import Desynced, Putting
from kdn.transport.wire import (
    ARENA_SIZE,
    FAST_ARENA,
    FAST_GET_MANY,
    FAST_HEAD,
    FAST_PUT_MANY,
    read_exact,
    send_pieces,
    serialize_passthrough,
)
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.server.usage import Usage

log = logging.getLogger(__name__)
_RPCS = {FAST_GET_MANY: "GetMany", FAST_PUT_MANY: "PutMany", FAST_ARENA: "Arena"}
MAX_BODY = 64 << 20
"""Largest request accepted (descriptors only: entries travel in the segment)."""
MAX_PENDING = 64
"""Connections at once that have not yet named a live segment (or ticket); a new one past
it closes the oldest."""
FIRST_BODY = 1 << 20
"""Largest request body read before the connection's segment (or ticket) is known (a GetMany
of ~25,000 keys); later calls may send up to ``MAX_BODY``."""
FIRST_CALL_S = 10.0
"""Seconds for a new connection's handshake and first call, and for any call's request once
its first byte came (default of ``first_call_s``)."""


class Handlers(Putting, Protocol):
    """What the fast path and the network data path need of the servicer
    (``kdn.server.service.KDNServicer``): its segments, read arenas and batch reads, besides
    what a streamed PutMany needs (``Putting``)."""

    segments: Segments
    arenas: Arenas
    usage: Usage
    reads: BatchReads
    egress: Egress


class Reply(NamedTuple):
    """What one call answers: the body, descriptors to pass along (SCM_RIGHTS) and bytes
    that follow the body on the connection (the network data path's entries)."""

    body: bytes
    fds: tuple[int, ...] = ()
    after: tuple[bytes | memoryview, ...] = ()
    pacer: Pacer | None = None
    """The egress cap that paces sending them (``kdn.server.egress``); None: none."""


ACCEPT_PAUSE_S = 0.05
"""Seconds the listener waits after a failed ``accept`` (out of descriptors: they free up as
connections end) before it accepts again."""
GROUP_CALLS = 8
"""PutMany calls at most that the fast path copies together (those its client sent before it
was answered: ``kdn.client.puts.ASYNC_DEPTH`` of them at most from one thread)."""


def _raise(exc: Exception) -> Reply:
    try:
        raise exc
    finally:  # its traceback holds this frame
        del exc


TENANT_SHARE = 75
"""Percent of ``max_connections`` one tenant's clients may hold admitted at once, where the
server authenticates its callers (a tenant asking for more segments or tickets, each within
``max_per_owner``, does not take every slot)."""


class FastPath:
    """The unix socket listener (see the module docstring). The network data path
    (``kdn.server.netpath.NetPath``) serves its own transport by overriding ``listen``,
    ``opened``, ``rpc_name`` and ``call``."""

    kind = "fast"
    """The label of this path's counters (``fast.<rpc>``, ``fast.<status>``)."""
    max_connections = 1024
    """Connections admitted at once (module docstring); past it a new one is refused."""
    max_per_owner = 256
    """Connections one segment (or ticket) may hold admitted at once."""
    grouped = True
    """Whether PutMany calls queued on a connection are copied together (``_put_group``)."""
    timed_when_admitted = False
    """Whether an admitted connection's requests must still arrive whole within
    ``first_call_s`` of their first byte (the network path's peers; a same-host client that
    named its segment is read as it sends, with the fewest system calls)."""

    def __init__(self, servicer: Handlers, *, idle_s: float = 0.0,
                 first_call_s: float = FIRST_CALL_S) -> None:
        self.servicer = servicer
        self.idle_s, self.first_call_s = idle_s, first_call_s or FIRST_CALL_S
        self._peers: dict[socket.socket, Peer] = {}  # by the socket as accepted
        self._pending: dict[socket.socket, Peer] = {}  # those not admitted, oldest first
        self._per_owner: dict[str, int] = {}
        self._per_tenant: dict[str, int] = {}  # admitted, by tenant (auth on: module docstring)
        self._admitted = 0
        self._here = threading.local()  # the peer of the connection this thread serves
        self._sock = self.listen()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._busy: set[socket.socket] = set()  # (as accepted) in a call, not yet answered
        self._answered = threading.Condition(self._lock)  # each time ``_busy`` empties
        self._closed = False
        self._quiet_until = 0.0  # (``_lost``)
        self._door = Door(self.kind, self._due, self._arrived)  # (once listening)
        threading.Thread(target=self._accept, name=f"kdn-{self.kind}-accept", daemon=True
                         ).start()

    def listen(self) -> socket.socket:
        """The listening socket (its name in ``name``)."""
        self.name = f"kdn-fast-{secrets.token_hex(12)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self.name)
        sock.listen(128)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors (EMFILE), memory, a connection reset before it was
                # taken: this one is lost, the path is not; a pause lets descriptors free up
                self._lost("accept_errors", "accepting a connection", exc)
                time.sleep(ACCEPT_PAUSE_S)
                continue
            with self._lock:
                if self._closed or not self._room(conn):
                    conn.close()
                    if self._closed:
                        return
                    self.servicer.count(f"{self.kind}.refused_connections")
                    continue
                self._conns.add(conn)
            self._door.wait_for(conn)

    def _arrived(self, conn: socket.socket, now: float) -> None:
        """A pending connection the door held spoke (or ended, or was cut): served by a
        thread of its own from now, unless it was cut or is past its deadline."""
        with self._lock:
            peer = self._peers.get(conn)
            late = peer is None or peer.deadline <= now  # (deadline 0: cut)
            if late:
                self._gone(conn)
            elif peer is not None:
                peer.heard = True  # (its first call is being read: not evicted, ``_room``)
        try:
            if not late:
                threading.Thread(target=self._serve, args=(conn,), name=f"kdn-{self.kind}",
                                 daemon=True).start()
                return
        except RuntimeError as exc:  # no thread to be had (a pids limit, memory): this one
            with self._lock:  # connection is lost, not the path
                self._gone(conn)
            self._lost("thread_errors", "starting a connection's thread", exc)
        conn.close()

    def _lost(self, counter: str, what: str, exc: BaseException) -> None:
        """A connection lost to the host's limits (descriptors, threads, memory): counted,
        and logged at most once a minute."""
        self.servicer.count(f"{self.kind}.{counter}")
        if time.monotonic() >= self._quiet_until:
            log.warning("%s path: %s failed (%s); still listening", self.kind, what, exc)
            self._quiet_until = time.monotonic() + 60.0

    def _due(self, conn: socket.socket) -> float:
        """When the door lets ``conn`` go unheard (its deadline; 0: now)."""
        with self._lock:
            peer = self._peers.get(conn)
        return peer.deadline if peer is not None else 0.0

    def _room(self, conn: socket.socket) -> bool:
        """Whether a new connection is served (under ``_lock``), pending from now: the
        module docstring's bounds."""
        if self._admitted >= self.max_connections \
                or len(self._peers) >= self.max_connections + 2 * MAX_PENDING:
            return False
        peer = Peer(conn, time.monotonic() + self.first_call_s)
        self._peers[conn] = self._pending[conn] = peer
        if len(self._pending) > MAX_PENDING:  # the oldest silent one makes room (the oldest
            silent = (c for c, p in self._pending.items() if not p.heard and c is not conn)
            self._pending.pop(next(silent, next(iter(self._pending)))).cut()  # where none is)
            self.servicer.count(f"{self.kind}.evicted_connections")
        return True

    def _gone(self, conn: socket.socket) -> None:
        """A connection's serving ended (under ``_lock``; ``conn`` as accepted)."""
        self._conns.discard(conn)
        self._call_ends(conn)
        peer = self._peers.pop(conn, None)
        self._pending.pop(conn, None)
        if peer is not None and peer.owner is not None:
            self._admitted -= 1
            for table, name in ((self._per_owner, peer.owner), (self._per_tenant, peer.tenant)):
                left = table.get(name, 0) - 1
                if left > 0:
                    table[name] = left
                else:
                    table.pop(name, None)

    def _serve(self, conn: socket.socket) -> None:
        accepted = conn
        try:
            conn = self.opened(conn)
            ahead: tuple[int, bytes] | None = None  # a call read while gathering PutManys
            while (call := ahead or self._next_call(accepted, conn)) is not None:
                ahead = None
                op, body = call
                started = time.perf_counter()
                if op == FAST_PUT_MANY and self.grouped and self._here.peer.owner is not None \
                        and queued(conn):  # (admitted: a group's later half admits nothing)
                    group = [(body, started)]  # the PutManys sent before this one's answer
                    while len(group) < GROUP_CALLS and queued(conn):
                        nxt = self._read_call(conn)
                        if nxt is None or nxt[0] != FAST_PUT_MANY:
                            ahead = nxt
                            break
                        group.append((nxt[1], time.perf_counter()))
                    if len(group) > 1:
                        if not self._put_group(conn, group):
                            return
                        continue
                if not self._answer(conn, op, partial(self.call, conn, op, body), started):
                    return
        except (OSError, KDNError) as exc:
            log.debug("%s-path connection closed: %s", self.kind, exc)
        finally:
            with self._lock:
                self._gone(accepted)
            conn.close()
            peer = getattr(self._here, "peer", None)
            if peer is not None and peer.owner is not None:
                self.ended(peer.owner)

    def ended(self, owner: str) -> None:
        """A connection admitted by segment ``owner`` closed: the segment is detached where
        its client exited (``Segments.reap``: a client killed gives no Detach; its leases and
        pages would stay held until another client attached). A ticket: nothing."""
        self.servicer.segments.reap(only=(owner,))

    def _next_call(self, accepted: socket.socket, conn: socket.socket
                   ) -> tuple[int, bytes] | None:
        """The next call on a connection whose calls so far were answered; None once it
        closed, or the path stopped taking calls."""
        with self._lock:
            self._call_ends(accepted)
            if self._closed:
                return None
        return self._read_call(conn)

    def _call_begins(self, conn: socket.socket) -> bool:
        """Whether a call whose first bytes came on ``conn`` (as accepted) is read and served
        (a stop's ``drain`` waits for it): not once the path stopped taking calls, unless its
        connection is in a call already (PutManys sent one after another, gathered)."""
        with self._lock:
            if conn not in self._busy and self._closed:
                return False
            self._busy.add(conn)
            return True

    def _call_ends(self, conn: socket.socket) -> None:
        """``conn``'s calls were answered, or it ended (under ``_lock``)."""
        self._busy.discard(conn)
        if not self._busy:
            self._answered.notify_all()

    def _read_call(self, conn: socket.socket) -> tuple[int, bytes] | None:
        """The next call on ``conn`` (op, body), read within the limits of the module
        docstring (``socket.timeout`` past them, which ends the connection); None once it
        closed."""
        peer: Peer = self._here.peer
        admitted = peer.owner is not None
        if admitted and not self.timed_when_admitted:  # blocking: the fewest system calls
            head = read_exact(conn, FAST_HEAD.size)
            if head is None or not self._call_begins(peer.conn):
                return None
            n, op = FAST_HEAD.unpack(head)
            if n > MAX_BODY:
                raise InvalidArgument(f"{self.kind}-path request of {n} bytes (limit "
                                      f"{MAX_BODY})")
            body = read_exact(conn, n)
            return None if body is None else (op, body)
        if admitted:
            conn.settimeout(self.idle_s or None)
        else:
            left = peer.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no call named a live {self.names} in time")
            conn.settimeout(left)
        first = conn.recv(1)  # waiting for a call
        if not first or not self._call_begins(peer.conn):
            return None
        by = time.monotonic() + self.first_call_s
        if not admitted:
            by = min(by, peer.deadline)
        rest = recv_by(conn, FAST_HEAD.size - 1, by)
        if rest is None:
            return None
        n, op = FAST_HEAD.unpack(first + rest)
        limit = MAX_BODY if admitted else FIRST_BODY
        if n > limit:
            raise InvalidArgument(f"{self.kind}-path request of {n} bytes (limit {limit}"
                                  + ("" if admitted else f" before a call names a live "
                                     f"{self.names}") + ")")
        body = recv_by(conn, n, by)
        conn.settimeout(self.idle_s or None)  # a PutMany's items, the answer's sends
        return None if body is None else (op, body)

    names = "segment"
    """What a call names to be served: a segment here, a ticket on the network path."""
    path_name = "fast path"
    """The path in a refusal's words."""

    def owner_of(self, name: str) -> Principal:
        """The caller a call naming ``name`` (a segment id) acts as."""
        return self.servicer.segments.owner(name)

    def _owner(self, name: str) -> Principal:
        """The caller ``name`` acts as (``owner_of``), and the connection admitted by it if
        it was not yet (TooLarge past ``max_connections`` or ``max_per_owner``). A call run
        off its connection's thread (the later half of a PutMany group, its connection
        admitted by the first) admits nothing."""
        principal = self.owner_of(name)
        peer: Peer | None = getattr(self._here, "peer", None)
        if peer is None or peer.owner is not None:
            return principal
        with self._lock:
            mine = self._per_owner.get(name, 0)
            if mine >= self.max_per_owner:
                raise TooLarge(f"this {self.names} holds {mine} {self.path_name} connections "
                               f"already (at most {self.max_per_owner})")
            tenant, share = principal.tenant, self.max_connections * TENANT_SHARE // 100
            ours = self._per_tenant.get(tenant, 0)
            if tenant and ours >= share:  # (no auth: every caller is tenant "")
                raise TooLarge(f"tenant {tenant!r} holds {ours} {self.path_name} connections "
                               f"already (at most {share}, so that other tenants' clients "
                               "find room)")
            if self._admitted >= self.max_connections:
                raise TooLarge(f"the {self.path_name} serves {self.max_connections} "
                               "connections at once")
            if self._pending.pop(peer.conn, None) is None:
                raise TimeoutError("closed while pending")
            peer.owner, peer.tenant = name, tenant
            self._per_owner[name] = mine + 1
            self._per_tenant[tenant] = ours + 1
            self._admitted += 1
        return principal

    def _pending_by(self) -> float:
        """The deadline of the first call of the connection this thread serves while none
        admitted it; 0 once one did."""
        peer: Peer = self._here.peer
        return peer.deadline if peer.owner is None else 0.0

    def _answer(self, conn: socket.socket, op: int, call: Callable[[], Reply],
                started: float) -> bool:
        """Send ``call``'s reply (or the error it raised) on ``conn``; False when the
        connection must end after it (a desynchronised stream)."""
        code, last = "OK", False
        try:
            reply, ok = call(), 1
        except OSError:  # the connection's: it ends
            raise
        except Exception as raised:
            exc = raised if isinstance(raised, KDNError) else self._internal(op, raised)
            self.servicer.count(f"{self.kind}.{exc.status.value}")
            reply = Reply(f"{exc.status.value}\0{exc}".encode())
            ok, code, last = 0, exc.status.value, isinstance(exc, Desynced)
            del exc  # (its traceback holds this frame: a cycle, freed only by the collector)
        self.servicer.usage.fast_call(self.rpc_name(op), code, time.perf_counter() - started)
        answer = FAST_HEAD.pack(len(reply.body), ok) + reply.body
        if reply.fds:
            socket.send_fds(conn, [answer], reply.fds)
        elif reply.pacer is not None:
            reply.pacer.send(conn, [answer, *reply.after])
        elif reply.after:
            send_pieces(conn, [answer, *reply.after])
        else:
            conn.sendall(answer)
        return not last

    def _internal(self, op: int, bug: Exception) -> Desynced:
        """What a call that failed not on purpose answers (INTERNAL, the connection closed
        after it: its stream may be out of step), logged with its traceback."""
        log.error("%s-path %s failed", self.kind, self.rpc_name(op), exc_info=bug)
        return Desynced(KDNError(f"internal error: {type(bug).__name__}: {bug}"))

    def _put_group(self, conn: socket.socket, group: list[tuple[bytes, float]]) -> bool:
        """PutMany calls a client sent one after another without waiting (``store_async``)
        on a connection already admitted, answered in order as each alone would be (each
        stored whole or refused whole), but copied out of the segment two at a time: the later
        half on the copy thread while this one copies the earlier half and then stores and
        answers it. False when the connection must end."""
        half = (len(group) + 1) // 2
        later = copy_pool().submit(lambda: [self._put_first(b, conn) for b, _ in group[half:]])
        calls = [self._put_first(b, conn) for b, _ in group[:half]]
        for (_, started), call in zip(group[:half], calls):
            if not self._answer(conn, FAST_PUT_MANY, call, started):
                later.result()
                return False
        for (_, started), call in zip(group[half:], later.result()):
            if not self._answer(conn, FAST_PUT_MANY, call, started):
                return False
        return True

    def _put_first(self, body: bytes, conn: socket.socket) -> Callable[[], Reply]:
        """A PutMany call's first half (parsed, checked, its entries copied out of the
        segment: ``PutMany.copy``), on this thread alone; its second half (stored,
        answered), or the error the first raised."""
        s = self.servicer
        try:
            req, principal = self._request(FAST_PUT_MANY, body)
            assert isinstance(req, pb.PutManyRequest)
            s.count("fast.PutMany")
            copies = s.puts.copy(principal, req, alone=True)
        except Exception as exc:  # (a bug's: answered INTERNAL, by ``_answer``)
            return partial(_raise, kept(exc))  # not the frames of the copy it came from

        def finish() -> Reply:
            still_there(conn, "PutMany")  # (its client gone: not applied late)
            return Reply(s.puts.finish(principal, req, copies).SerializeToString())

        return finish

    def opened(self, conn: socket.socket) -> socket.socket:
        """A new connection set up, as it is served: its first call due by its deadline
        (a subclass wraps it: TLS)."""
        with self._lock:
            peer = self._peers.get(conn)
        if peer is None or not peer.deadline:
            raise OSError("closed before it was served (pending too long, or many pending)")
        self._here.peer = peer
        conn.settimeout(max(peer.deadline - time.monotonic(), 1e-3))  # the TLS handshake too
        return conn

    @staticmethod
    def rpc_name(op: int) -> str:
        """The RPC an op is counted as."""
        return _RPCS.get(op, "unknown")

    def call(self, conn: socket.socket, op: int, body: bytes) -> Reply:
        """One call's reply; KDNError to refuse it."""
        if op == FAST_ARENA:
            fd, size = self._arena(body)
            return Reply(ARENA_SIZE.pack(size), (fd,))
        return Reply(self._handle(op, body, conn))

    def _arena(self, body: bytes) -> tuple[int, int]:
        """(descriptor, size) of the read arena of the tenant that attached segment ``body``."""
        s = self.servicer
        principal = self._owner(body.decode("utf-8", "replace"))
        s.auth.admit(principal)
        arena = s.arenas.get(principal.tenant)
        if arena is None:
            raise NotFound("this server keeps no read arenas (shm_arena_bytes = 0)")
        s.count("fast.Arena")
        return arena.fd, arena.size

    def _request(self, op: int, body: bytes
                 ) -> tuple[pb.GetManyRequest | pb.PutManyRequest, Principal]:
        """A GetMany / PutMany request parsed and checked, and the caller it acts as."""
        s = self.servicer
        if op not in (FAST_GET_MANY, FAST_PUT_MANY):
            raise InvalidArgument(f"unknown fast-path op {op}")
        try:
            req: pb.GetManyRequest | pb.PutManyRequest = (
                pb.GetManyRequest.FromString(body) if op == FAST_GET_MANY
                else pb.PutManyRequest.FromString(body))
        except Exception as exc:  # protobuf's DecodeError
            raise InvalidArgument(f"malformed fast-path request: {exc}") from None
        check_names(req)  # the same name rules as over gRPC (kdn.server.requests)
        if not req.segment_id:
            raise NotFound("fast-path calls must name an attached segment")
        principal = self._owner(req.segment_id)
        s.auth.admit(principal)
        return req, principal

    def _handle(self, op: int, body: bytes, conn: socket.socket) -> bytes:
        s = self.servicer
        req, principal = self._request(op, body)
        if isinstance(req, pb.GetManyRequest):
            s.count("fast.GetMany")
            return serialize_passthrough(s.reads.get_many(principal, req))
        s.count("fast.PutMany")
        copies = s.puts.copy(principal, req)
        still_there(conn, "PutMany")  # (its client gone while copying: not applied late)
        return s.puts.finish(principal, req, copies).SerializeToString()

    def stop_accepting(self) -> None:
        """Take no new connection nor call: the listener, the pending connections and those
        waiting for a call are closed; the calls in flight go on (``drain``). Idempotent."""
        with self._lock:
            first, self._closed = not self._closed, True
            idle = [c for c in self._conns if c not in self._busy]
        if not first:
            return
        self._door.close()
        try:  # wakes the accepting thread: a listener closed under it would accept once more
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in idle:
            cut_conn(c)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the calls in flight to be answered (after
        ``stop_accepting``); whether they all were."""
        with self._answered:
            return self._answered.wait_for(lambda: not self._busy, max(timeout_s, 0.0))

    def close(self) -> None:
        """``stop_accepting``, and every connection closed, calls in flight or not."""
        self.stop_accepting()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            cut_conn(c)
