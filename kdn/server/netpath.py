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
an egress cap (``kdn.server.egress``) in slices, each when the cap allows; the stripes of one
striped GetMany (its ``call``) count as one answer in the bound of disk and Redis reads being
sent (``kdn.server.reader.Sending``), so they never refuse each other. A call refused before
its items arrived
has them read and dropped, so the connection stays in step; one whose items can not be
skipped (more than a PutMany may carry), or that names no live ticket on a connection not yet
admitted, is answered, then the connection closes.

Who may call: anyone who can reach the port and names a live ticket; a ticket is 128 random
bits handed only to the authenticated client that asked (``Segments.ticket``), and a call acts
as that client (its tenant's key space, rate limit and quota). A server with ``tls_cert`` speaks
TLS here too, with the same certificate (``kdn.server.app.data_path_tls``; no client
certificate is asked for: the ticket came over the authenticated channel); ``data_port = -1``
offers no path.

Holding a connection: anyone who reaches the port may open one, so until a connection's call
names a live ticket it is *pending*, under the same bounds as the fast path's
(``kdn.server.fastpath``: its TLS handshake and first call within ``first_call_s``, a first
body of at most ``FIRST_BODY`` bytes, ``MAX_PENDING`` pending at once). A connection admitted
by a ticket is served until it stays silent ``idle_s`` between calls (the server's
``idle_timeout_s``); at most ``max_connections`` (``MAX_CONNECTIONS``) are admitted at once,
and ``MAX_PER_TICKET`` of one ticket's (a client stripes a read over 8 by default, 32 at
most, plus one per thread), so that no one client holds every slot.

Lifecycle: the server starts one ``NetPath`` (a listening thread) once it listens, bound to
its gRPC host, and closes it at shutdown; each connection is served by a daemon thread of its
own.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

from kdn.errors import InvalidArgument
from kdn.server.auth import Principal
from kdn.server.fastpath import FIRST_CALL_S, FastPath, Handlers, Reply
from kdn.server.streamed import Desynced, parse_request, put_streamed
from kdn.transport.wire import NET_GET_MANY, NET_PUT_MANY
from kdn.v1 import kdn_pb2 as pb

MAX_CONNECTIONS = 256
"""Connections admitted by a ticket at once; past it a new one is closed (each holds a
thread)."""
MAX_PER_TICKET = 64
"""Connections one ticket may hold admitted at once."""
IDLE_S = 300.0
"""Seconds an admitted connection may stay silent between calls (default of ``idle_s``)."""
_RPCS = {NET_GET_MANY: "NetGetMany", NET_PUT_MANY: "NetPutMany"}


class NetPath(FastPath):
    """The TCP listener (see the module docstring)."""

    kind = "net"
    grouped = False  # its PutMany's bytes follow the request on the connection
    max_connections = MAX_CONNECTIONS
    max_per_owner = MAX_PER_TICKET
    names = "ticket"
    timed_when_admitted = True
    path_name = "data path"

    def __init__(self, servicer: Handlers, host: str, port: int,
                 tls: ssl.SSLContext | None = None, *, idle_s: float = IDLE_S,
                 first_call_s: float = FIRST_CALL_S) -> None:
        self._host, self._want_port, self._tls = host, port, tls
        super().__init__(servicer, idle_s=idle_s, first_call_s=first_call_s)
        servicer.segments.busy = lambda ticket: ticket in self._per_owner  # not evicted

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

    def opened(self, conn: socket.socket) -> socket.socket:
        conn = super().opened(conn)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn if self._tls is None else self._tls.wrap_socket(conn, server_side=True)

    def owner_of(self, name: str) -> Principal:
        return self.servicer.segments.ticket_owner(name)

    @staticmethod
    def rpc_name(op: int) -> str:
        return _RPCS.get(op, "unknown")

    def _answer(self, conn: socket.socket, op: int, call: Callable[[], Reply],
                started: float) -> bool:
        with self.servicer.reads.sending.answer() as sending:  # a GetMany's reads from disk
            self._here.sending = sending  # or redis: counted until they are sent (``Sending``)
            return super()._answer(conn, op, call, started)

    def call(self, conn: socket.socket, op: int, body: bytes) -> Reply:
        s = self.servicer
        if op == NET_GET_MANY:
            req = parse_request(pb.GetManyRequest, body)
            principal = self._owner(req.segment_id)
            s.auth.admit(principal)
            s.count("net.GetMany")
            if req.call:  # a stripe: the call's stripes are one answer in the read bound
                s.reads.sending.join(self._here.sending, (req.segment_id, req.call))
            answer, pieces = s.reads.get_sent(principal, req, self._here.sending)
            pacer = s.egress.pacer(principal.tenant, f"net:{conn.getpeername()}") \
                if s.egress.on else None
            return Reply(answer.SerializeToString(), after=tuple(pieces), pacer=pacer)
        if op != NET_PUT_MANY:
            raise Desynced(InvalidArgument(f"unknown data path op {op}"))
        return Reply(put_streamed(s, conn, body, self._owner, "net", self._pending_by
                                  ).SerializeToString())

