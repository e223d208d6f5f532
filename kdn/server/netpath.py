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

A PutMany's items are read straight into buffers of their own, each checked (every checksum,
as an inline PutMany is) and stored only once every item passed, by the same code as the
other PutMany forms; a GetMany's entries are sent from where the store keeps them (RAM values
as the frames they came in: no copy in Python on either side). The client checks what it
reads when it decodes, as it does an inline answer. A call refused before its items arrived
has them read and dropped, so the connection stays in step; one whose items can not be
skipped (more than a PutMany may carry) is answered, then the connection closes.

Who may call: anyone who can reach the port and names a live ticket; a ticket is 128 random
bits handed only to the authenticated client that asked (``Segments.ticket``), and a call acts
as that client (its tenant's key space, rate limit and quota). The path speaks no TLS: a server
with ``tls_cert`` set offers none (its clients stay on gRPC), as does ``data_port = -1``.

Lifecycle: the server starts one ``NetPath`` (a listening thread) once it listens, bound to
its gRPC host, and closes it at shutdown; each connection is served by a daemon thread of its
own (at most ``MAX_CONNECTIONS``), and closed after ``IDLE_S`` without a byte.
"""

from __future__ import annotations

import socket
from typing import Any

from kdn.buffers import BufferPool
from kdn.codec.format import Header, check_frame
from kdn.errors import InvalidArgument, KDNError, TooLarge
from kdn.netio import recv_container
from kdn.server.fastpath import Desynced, FastPath, Handlers, Reply
from kdn.server.requests import check_names
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import NET_GET_MANY, NET_PUT_MANY

MAX_CONNECTIONS = 256
"""Connections served at once; past it a new one is closed (each holds a thread)."""
IDLE_S = 300.0
"""Seconds a connection may stay silent (between calls or within one) before it is closed."""
DRAIN_BYTES = 1 << 20
"""Bytes read at a time when a refused PutMany's items are dropped."""
_RPCS = {NET_GET_MANY: "NetGetMany", NET_PUT_MANY: "NetPutMany"}


class NetPath(FastPath):
    """The TCP listener (see the module docstring)."""

    kind = "net"
    max_connections = MAX_CONNECTIONS

    def __init__(self, servicer: Handlers, host: str, port: int) -> None:
        self._host, self._want_port = host, port
        super().__init__(servicer)

    def _listen(self) -> socket.socket:
        host = self._host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self._want_port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self.name = f"tcp:{self.port}"
        return sock

    def _opened(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(IDLE_S)

    @staticmethod
    def _rpc(op: int) -> str:
        return _RPCS.get(op, "unknown")

    def _call(self, conn: socket.socket, op: int, body: bytes) -> Reply:
        s = self.servicer
        if op == NET_GET_MANY:
            req = _parse(pb.GetManyRequest, body)
            principal = s.segments.ticket_owner(req.segment_id)
            s.auth.admit(principal)
            s.count("net.GetMany")
            answer, pieces = s._get_sent(principal, req)
            return Reply(answer.SerializeToString(), after=tuple(pieces))
        if op != NET_PUT_MANY:
            raise Desynced(InvalidArgument(f"unknown data path op {op}"))
        try:
            put = _parse(pb.PutManyRequest, body)
        except KDNError as exc:  # its items' length is unknown
            raise Desynced(exc) from None
        total = self._payload(put)  # Desynced when it can not be skipped
        try:
            principal = s.segments.ticket_owner(put.segment_id)
            s.auth.admit(principal)
        except KDNError:
            _drain(conn, total)
            raise
        s.count("net.PutMany")
        values, faults = _received(conn, put, s.buffers)  # in step again from here

        def value_of(j: int, _: pb.PutItem) -> memoryview:
            if faults[j] is not None:
                raise faults[j]  # type: ignore[misc]  # named with its item by _put_items
            return values[j]

        return Reply(s._put_items(principal, put, value_of).SerializeToString())

    def _payload(self, put: pb.PutManyRequest) -> int:
        """The bytes following ``put`` on the connection: its items' lengths, which must lie
        one after another from 0. Desynced when they do not, or exceed what a PutMany may
        carry (the call is refused and its bytes could not be skipped safely)."""
        at = 0
        for j, item in enumerate(put.items):
            if item.data:
                raise Desynced(InvalidArgument(f"item {j}: data inline on the data path"))
            if item.region.offset != at:
                raise Desynced(InvalidArgument(
                    f"item {j} at offset {item.region.offset}; the items' bytes follow one "
                    f"another, so it must be at {at}"))
            at += item.region.length
        try:
            self.servicer._put_sizes(put)
        except TooLarge as exc:
            raise Desynced(exc) from None
        return at


def _parse(cls: Any, body: bytes) -> Any:
    try:
        req = cls.FromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidArgument(f"malformed data path request: {exc}") from None
    check_names(req)  # the same name rules as over gRPC (kdn.server.requests)
    return req


def _received(conn: socket.socket, put: pb.PutManyRequest, pool: BufferPool
              ) -> tuple[list[memoryview], list[KDNError | None]]:
    """Each item's bytes, read off the connection into a buffer of its own from ``pool``
    (read-only views: the RAM tier keeps them as they are), checked as they land (every
    frame's checksum and records, the moment its last byte arrives), and each item's fault
    (None: sound). Every item is read whole either way; OSError when the connection closed
    first (nothing is stored)."""
    values: list[memoryview] = []
    faults: list[KDNError | None] = []
    for item in put.items:
        view = memoryview(pool.take(item.region.length)  # type: ignore[arg-type]
                          ) if item.region.length else memoryview(bytearray())
        faults.append(recv_container(conn, view, 0, _check_stored))
        values.append(view.toreadonly())
    return values, faults


def _check_stored(header: Header, index: int, frame: memoryview) -> None:
    check_frame(header, index, frame, records=False)  # what Store checks of each frame


def _drain(conn: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (a refused call's items)."""
    buf = memoryview(bytearray(min(n, DRAIN_BYTES)))
    while n > 0:
        got = conn.recv_into(buf, min(n, len(buf)))
        if not got:
            raise OSError("the data path connection closed inside a PutMany's items")
        n -= got
