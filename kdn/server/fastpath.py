"""The same-host fast path: GetMany / PutMany over a unix socket, without gRPC.

A client that attached a shared segment (``kdn.server.batch``) learns the name of this socket
from ``AttachResponse.fast_path`` and may send its GetMany / PutMany there: the same protobuf
messages, the same handlers, the same checks, but none of the per-call cost of a gRPC stack
(HTTP/2 framing, the event loop, a thread hop), which dominates small entries.

Wire, per call, on one connection (calls on a connection are sequential; ``kdn.wire``):

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
the capability; requests without one are refused. Calls here do not pass the gRPC interceptor:
they are counted (``fast.<rpc>``, and by status code and latency in
``kdn_fastpath_requests_total`` / ``kdn_fastpath_request_seconds``, ``kdn.server.usage``) but
have no access-log line.

Lifecycle: the server starts one ``FastPath`` (a listening thread) once it listens, and closes
it at shutdown; each connection is served by its own daemon thread.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Protocol

from kdn.errors import InvalidArgument, KDNError, NotFound
from kdn.server.arena import Arenas
from kdn.server.auth import Authenticator, Principal
from kdn.server.batch import Segments
from kdn.server.requests import check_names
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import (
    ARENA_SIZE,
    FAST_ARENA,
    FAST_GET_MANY,
    FAST_HEAD,
    FAST_PUT_MANY,
    read_exact,
    serialize_passthrough,
)

if TYPE_CHECKING:
    from kdn.server.usage import Usage

log = logging.getLogger(__name__)
_RPCS = {FAST_GET_MANY: "GetMany", FAST_PUT_MANY: "PutMany", FAST_ARENA: "Arena"}
MAX_BODY = 64 << 20
"""Largest request accepted (descriptors only: entries travel in the segment)."""


class Handlers(Protocol):
    """What the fast path needs of the servicer (``kdn.server.service.KDNServicer``)."""

    segments: Segments
    arenas: Arenas
    auth: Authenticator
    usage: Usage

    def count(self, name: str, n: int = 1) -> None: ...

    def _get_many(self, p: Principal, request: pb.GetManyRequest
                  ) -> pb.GetManyResponse | bytes: ...

    def _put_many(self, p: Principal, request: pb.PutManyRequest) -> pb.PutManyResponse: ...


class FastPath:
    def __init__(self, servicer: Handlers) -> None:
        self.servicer = servicer
        self.name = f"kdn-fast-{secrets.token_hex(12)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(128)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="kdn-fast-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kdn-fast", daemon=True
                             ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while (head := read_exact(conn, FAST_HEAD.size)) is not None:
                n, op = FAST_HEAD.unpack(head)
                if n > MAX_BODY:
                    raise InvalidArgument(f"fast-path request of {n} bytes (limit {MAX_BODY})")
                body = read_exact(conn, n)
                if body is None:
                    return
                started, code = time.perf_counter(), "OK"
                fds: list[int] = []
                try:
                    if op == FAST_ARENA:
                        fd, size = self._arena(body)
                        out, ok, fds = ARENA_SIZE.pack(size), 1, [fd]
                    else:
                        out, ok = self._handle(op, body), 1
                except KDNError as exc:
                    self.servicer.count(f"fast.{exc.status.value}")
                    out, ok, code = f"{exc.status.value}\0{exc}".encode(), 0, exc.status.value
                self.servicer.usage.fast_call(_RPCS.get(op, "unknown"), code,
                                              time.perf_counter() - started)
                if fds:
                    socket.send_fds(conn, [FAST_HEAD.pack(len(out), ok) + out], fds)
                else:
                    conn.sendall(FAST_HEAD.pack(len(out), ok) + out)
        except (OSError, KDNError) as exc:
            log.debug("fast-path connection closed: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _arena(self, body: bytes) -> tuple[int, int]:
        """(descriptor, size) of the read arena of the tenant that attached segment ``body``."""
        s = self.servicer
        principal = s.segments.owner(body.decode("utf-8", "replace"))
        s.auth.admit(principal)
        arena = s.arenas.get(principal.tenant)
        if arena is None:
            raise NotFound("this server keeps no read arenas (shm_arena_bytes = 0)")
        s.count("fast.Arena")
        return arena.fd, arena.size

    def _handle(self, op: int, body: bytes) -> bytes:
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
        principal = s.segments.owner(req.segment_id)
        s.auth.admit(principal)
        if isinstance(req, pb.GetManyRequest):
            s.count("fast.GetMany")
            return serialize_passthrough(s._get_many(principal, req))
        s.count("fast.PutMany")
        return s._put_many(principal, req).SerializeToString()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
