"""The network data path: GetMany / PutMany for clients on other hosts, over a plain TCP
connection instead of gRPC, the entries' bytes on the connection next to their descriptors.

Python gRPC moves about 1.2-1.5 GB/s on loopback with a core on each side (each message is
framed by HTTP/2, becomes a Python object and crosses the event loop); a socket read into a
buffer moves ~3 GB/s on the same machine. A client on another host asks for a ticket over
gRPC (``Attach`` with ``remote``: authenticated, rate-limited, as any call) and learns this
path's port from the answer (``AttachResponse.data_port``, on the host it reached the server
at); its GetMany / PutMany then travel here:

    request   u32 body length | u8 op (4 GetMany, 5 PutMany) | body (the serialized request,
              ``segment_id`` = the ticket) | PutMany: the items' bytes, one after another
              (item ``region``: its offset in them and length; offsets must follow on)
    response  u32 body length | u8 ok (1) or error (0) | body (the serialized response, or
              "STATUS_NAME" NUL message) | GetMany: the present entries' bytes, in order
              (``EntryRef.offset``/``length``)

A PutMany's items are read straight into buffers of their own, each frame checked (checksum
and records, as Store checks them) the moment its last byte lands (``kdn.server.streamed``),
and stored only once every item passed, by the same code as the other PutMany forms; a
GetMany's entries are sent from where the store keeps them (RAM values as the frames they came
in: no copy in Python on either side), and the client checks each frame as it lands too; under
an egress cap (``kdn.server.egress``) in slices, each when the cap allows. A
call refused before its items arrived
has them read and dropped, so the connection stays in step; one whose items can not be
skipped (more than a PutMany may carry) is answered, then the connection closes.

Who may call: anyone who can reach the port and names a live ticket; a ticket is 128 random
bits handed only to the authenticated client that asked (``Segments.ticket``), and a call acts
as that client (its tenant's key space, rate limit and quota). A server with ``tls_cert`` speaks
TLS here too, with the same certificate (``kdn.server.app.data_path_tls``; no client
certificate is asked for: the ticket came over the authenticated channel); ``data_port = -1``
offers no path.

Holding a connection: anyone who reaches the port may open one, so until a connection's call
names a live ticket it is *pending*: its TLS handshake and first call must arrive within
``first_call_s`` (the server's ``handshake_timeout_s``), that call's body may hold at most
``FIRST_BODY`` bytes, and at most ``MAX_PENDING`` connections are pending at once (a new one
past that closes the oldest: a client that has a ticket names it in its first call, so only
connections that sit silent lose out). A connection admitted by a ticket is served until it
stays silent ``idle_s`` between calls (the server's ``idle_timeout_s``); each call's request
must arrive whole within ``first_call_s`` of its first byte; at most ``max_connections``
are admitted at once, and ``MAX_PER_TICKET`` of one ticket's (a client stripes a read over 8
by default, 32 at most, plus one per thread), so that no one client holds every slot.

Lifecycle: the server starts one ``NetPath`` (a listening thread) once it listens, bound to
its gRPC host, and closes it at shutdown; each connection is served by a daemon thread of its
own.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time

from kdn.errors import InvalidArgument, TooLarge
from kdn.server.auth import Principal
from kdn.server.fastpath import MAX_BODY, FastPath, Handlers, Reply
from kdn.server.streamed import Desynced, parse_request, put_streamed
from kdn.transport.wire import FAST_HEAD, NET_GET_MANY, NET_PUT_MANY
from kdn.v1 import kdn_pb2 as pb

MAX_CONNECTIONS = 256
"""Connections admitted by a ticket at once; past it a new one is closed (each holds a
thread)."""
MAX_PENDING = 64
"""Connections at once that have not yet named a live ticket; a new one past it closes the
oldest."""
MAX_PER_TICKET = 64
"""Connections one ticket may hold admitted at once."""
FIRST_BODY = 1 << 20
"""Largest request body read before the connection's ticket is known (a GetMany of ~25,000
keys); later calls may send up to ``MAX_BODY``."""
IDLE_S = 300.0
"""Seconds an admitted connection may stay silent between calls (default of ``idle_s``)."""
FIRST_CALL_S = 10.0
"""Seconds for a new connection's handshake and first call, and for any call's request once
its first byte came (default of ``first_call_s``)."""
_RPCS = {NET_GET_MANY: "NetGetMany", NET_PUT_MANY: "NetPutMany"}


class _Peer:
    """A connection's state: its socket as accepted (the key of the path's tables) and its
    descriptor, the time by which its first call must have arrived (0: evicted), and the
    ticket that admitted it (None while pending)."""

    __slots__ = ("conn", "fd", "deadline", "ticket")

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.fd, self.deadline = conn, conn.fileno(), deadline
        self.ticket: str | None = None

    def cut(self) -> None:
        """End the connection's reads and writes (its thread then closes it): a shutdown
        of the socket through a duplicate of its descriptor, which works mid-handshake too
        (called under the path's lock, while the connection's own descriptor is open)."""
        self.deadline = 0.0
        try:
            with socket.socket(fileno=os.dup(self.fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class NetPath(FastPath):
    """The TCP listener (see the module docstring)."""

    kind = "net"
    grouped = False  # its PutMany's bytes follow the request on the connection
    max_connections = MAX_CONNECTIONS

    def __init__(self, servicer: Handlers, host: str, port: int,
                 tls: ssl.SSLContext | None = None, *, idle_s: float = IDLE_S,
                 first_call_s: float = FIRST_CALL_S) -> None:
        self._host, self._want_port, self._tls = host, port, tls
        self.idle_s, self.first_call_s = idle_s, first_call_s or FIRST_CALL_S
        self._peers: dict[socket.socket, _Peer] = {}  # by the socket as accepted
        self._pending: dict[socket.socket, _Peer] = {}  # those not admitted, oldest first
        self._per_ticket: dict[str, int] = {}
        self._admitted = 0
        self._here = threading.local()  # the peer of the connection this thread serves
        super().__init__(servicer)
        servicer.segments.busy = lambda ticket: ticket in self._per_ticket  # not evicted

    def listen(self) -> socket.socket:
        host = self._host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self._want_port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"can not listen on the data path's port "
                          f"{self._host}:{self._want_port}: {exc.strerror}; pick another "
                          "with --data-port (0: any free port, -1: off)") from None
        self.port = sock.getsockname()[1]
        self.name = f"tcp:{self.port}"
        return sock

    def _room(self, conn: socket.socket) -> bool:
        if self._admitted >= self.max_connections \
                or len(self._peers) >= self.max_connections + 2 * MAX_PENDING:
            return False
        peer = _Peer(conn, time.monotonic() + self.first_call_s)
        self._peers[conn] = self._pending[conn] = peer
        if len(self._pending) > MAX_PENDING:  # the oldest silent one makes room
            self._pending.pop(next(iter(self._pending))).cut()
            self.servicer.count("net.evicted_connections")
        return True

    def _gone(self, conn: socket.socket) -> None:
        super()._gone(conn)
        peer = self._peers.pop(conn, None)
        self._pending.pop(conn, None)
        if peer is not None and peer.ticket is not None:
            self._admitted -= 1
            left = self._per_ticket.get(peer.ticket, 0) - 1
            if left > 0:
                self._per_ticket[peer.ticket] = left
            else:
                self._per_ticket.pop(peer.ticket, None)

    def opened(self, conn: socket.socket) -> socket.socket:
        with self._lock:
            peer = self._peers.get(conn)
        if peer is None or not peer.deadline:
            raise OSError("closed before it was served (pending too long, or many pending)")
        self._here.peer = peer
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(max(peer.deadline - time.monotonic(), 1e-3))  # the TLS handshake too
        return conn if self._tls is None else self._tls.wrap_socket(conn, server_side=True)

    def _read_call(self, conn: socket.socket) -> tuple[int, bytes] | None:
        """The next call, read within the limits of the module docstring (``socket.timeout``
        past them, which ends the connection)."""
        peer: _Peer = self._here.peer
        admitted = peer.ticket is not None
        if admitted:
            conn.settimeout(self.idle_s or None)
        else:
            left = peer.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no call named a live ticket in time")
            conn.settimeout(left)
        first = conn.recv(1)  # waiting for a call
        if not first:
            return None
        by = time.monotonic() + self.first_call_s
        if not admitted:
            by = min(by, peer.deadline)
        rest = _recv_by(conn, FAST_HEAD.size - 1, by)
        if rest is None:
            return None
        n, op = FAST_HEAD.unpack(first + rest)
        limit = MAX_BODY if admitted else FIRST_BODY
        if n > limit:
            raise InvalidArgument(f"net-path request of {n} bytes (limit {limit}"
                                  + ("" if admitted else " before a call names a live ticket")
                                  + ")")
        body = _recv_by(conn, n, by)
        conn.settimeout(self.idle_s or None)  # a PutMany's items, the answer's sends
        return None if body is None else (op, body)

    def _owner(self, ticket: str) -> Principal:
        """The caller ``ticket`` acts as, and the connection admitted by it if it was not
        yet (TooLarge past ``max_connections`` or ``MAX_PER_TICKET``)."""
        principal = self.servicer.segments.ticket_owner(ticket)
        peer: _Peer = self._here.peer
        if peer.ticket is not None:
            return principal
        with self._lock:
            mine = self._per_ticket.get(ticket, 0)
            if mine >= MAX_PER_TICKET:
                raise TooLarge(f"this ticket holds {mine} data path connections already "
                               f"(at most {MAX_PER_TICKET})")
            if self._admitted >= self.max_connections:
                raise TooLarge(f"the data path serves {self.max_connections} connections "
                               "at once")
            if self._pending.pop(peer.conn, None) is None:
                raise TimeoutError("closed while pending")
            peer.ticket = ticket
            self._per_ticket[ticket] = mine + 1
            self._admitted += 1
        return principal

    @staticmethod
    def rpc_name(op: int) -> str:
        return _RPCS.get(op, "unknown")

    def call(self, conn: socket.socket, op: int, body: bytes) -> Reply:
        s = self.servicer
        if op == NET_GET_MANY:
            req = parse_request(pb.GetManyRequest, body)
            principal = self._owner(req.segment_id)
            s.auth.admit(principal)
            s.count("net.GetMany")
            answer, pieces = s.reads.get_sent(principal, req)
            pacer = s.egress.pacer(principal.tenant, f"net:{conn.getpeername()}") \
                if s.egress.on else None
            return Reply(answer.SerializeToString(), after=tuple(pieces), pacer=pacer)
        if op != NET_PUT_MANY:
            raise Desynced(InvalidArgument(f"unknown data path op {op}"))
        return Reply(put_streamed(s, conn, body, self._owner, "net").SerializeToString())


def _recv_by(conn: socket.socket, n: int, by: float) -> bytes | None:
    """``n`` bytes from ``conn`` by the monotonic time ``by`` (``socket.timeout`` past it),
    or None when it closed first."""
    buf = bytearray()
    while len(buf) < n:
        left = by - time.monotonic()
        if left <= 0:
            raise TimeoutError("a request that did not arrive whole in time")
        conn.settimeout(left)
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
