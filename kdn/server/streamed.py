"""PutMany whose items' bytes follow the call on its connection (the network data path's,
``kdn.server.netpath``).

The items are read straight off the socket into recycled buffers of their own, each frame
checked (its checksum and records, as Store checks them) the moment its last byte lands,
while it is in cache (``kdn.transport.netio.recv_container``); none is stored unless every one
passed, by the code every PutMany form shares (``kdn.server.putmany.PutMany.put_items``).

A call refused before its items arrived has them read and dropped, so the connection stays in
step; one whose items can not be skipped (unparsable, misplaced, more than a PutMany may
carry) raises ``Desynced``: answered, then the connection closes. So does one naming no live
ticket on a connection that none admitted yet (its items are not waited for: a pending
connection is bounded by its first call's deadline); one refused admission on such a
connection has its items dropped only until that deadline.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kdn.codec.format import Header, check_frame
from kdn.errors import InvalidArgument, KDNError, NotFound, TooLarge, again
from kdn.server.auth import Authenticator, Principal
from kdn.server.door import still_there
from kdn.server.ingest import written
from kdn.server.putmany import PutMany
from kdn.server.requests import check_names
from kdn.transport.netio import recv_container
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.transport.buffers import BufferPool

DRAIN_BYTES = 1 << 20
"""Bytes read at a time when a refused call's items are dropped."""


class Putting(Protocol):
    """What a streamed PutMany needs of the servicer (``kdn.server.service.KDNServicer``)."""

    auth: Authenticator
    puts: PutMany

    def count(self, name: str, n: int = 1) -> None: ...


class Desynced(KDNError):
    """A refused call whose bytes can not be skipped: answered, then the connection closes."""

    def __init__(self, exc: KDNError) -> None:
        super().__init__(str(exc))
        self.status = exc.status


def parse_request(cls: Any, body: bytes) -> Any:
    """``body`` as a ``cls`` message, its names checked as gRPC's are; InvalidArgument."""
    try:
        req = cls.FromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidArgument(f"malformed request: {exc}") from None
    check_names(req)  # the same name rules as over gRPC (kdn.server.requests)
    return req


def put_streamed(servicer: Putting, conn: socket.socket, body: bytes,
                 owner: Callable[[str], Principal], label: str,
                 pending: Callable[[], float]) -> pb.PutManyResponse:
    """One PutMany (``body``) whose items follow on ``conn``, acting as ``owner`` of its
    ``segment_id``; counted as ``<label>.PutMany``. ``pending``: the deadline of ``conn``'s
    first call while no call admitted it (0 once one did)."""
    try:
        put = parse_request(pb.PutManyRequest, body)
    except KDNError as exc:  # its items' length is unknown
        raise Desynced(exc) from None
    total = _payload(servicer.puts, put)  # Desynced when it can not be skipped
    with contextlib.ExitStack() as held:
        try:
            principal = owner(put.segment_id)
        except NotFound as exc:  # no live ticket: a pending connection is not held longer
            if pending():
                raise Desynced(exc) from None
            _drain(conn, total)
            raise
        except KDNError:
            _drain(conn, total, pending())
            raise
        try:
            servicer.auth.admit(principal)
            servicer.puts.within_quota(principal, put)  # before the items are read
            held.enter_context(servicer.puts.ingest.receiving(
                principal, total, written(len(put.items))))
        except KDNError:
            _drain(conn, total)
            raise
        servicer.count(f"{label}.PutMany")
        values, faults = _received(conn, put, servicer.puts.buffers)  # in step from here

    def value_of(j: int, _: pb.PutItem) -> memoryview:
        fault = faults[j]
        if fault is not None:  # named with its item by ``PutMany.put_items``; a copy, as
            raise again(fault)  # ``faults`` is in its traceback's frames
        return values[j]

    still_there(conn, "PutMany")  # its client gone: not applied late
    return servicer.puts.put_items(principal, put, value_of)


def _payload(puts: PutMany, put: pb.PutManyRequest) -> int:
    """The bytes following ``put`` on the connection: its items' lengths, which must lie one
    after another from 0. Desynced when they do not, or exceed what a PutMany may carry."""
    at = 0
    for j, item in enumerate(put.items):
        if item.data:
            raise Desynced(InvalidArgument(f"item {j}: data inline in a streamed PutMany"))
        if item.region.offset != at:
            raise Desynced(InvalidArgument(
                f"item {j} at offset {item.region.offset}; the items' bytes follow one "
                f"another, so it must be at {at}"))
        at += item.region.length
    try:
        puts.sizes(put)
    except TooLarge as exc:
        raise Desynced(exc) from None
    return at


def _received(conn: socket.socket, put: pb.PutManyRequest, pool: BufferPool
              ) -> tuple[list[memoryview], list[KDNError | None]]:
    """Each item's bytes read off the connection into a buffer of its own from ``pool``
    (read-only views: the RAM tier keeps them as they are), checked as they land, and each
    item's fault (None: sound). Every item is read whole either way; OSError when the
    connection closed first (nothing is stored)."""
    values: list[memoryview] = []
    faults: list[KDNError | None] = []
    for item in put.items:
        n = item.region.length
        view = memoryview(pool.take(n)) if n else memoryview(bytearray())  # type: ignore[arg-type]
        faults.append(recv_container(conn, view, 0, _check_stored))
        values.append(view.toreadonly())
    return values, faults


def _check_stored(header: Header, index: int, frame: memoryview) -> None:
    check_frame(header, index, frame, records=False)  # what Store checks of each frame


def _drain(conn: socket.socket, n: int, by: float = 0.0) -> None:
    """Read and drop ``n`` bytes (a refused call's items), by the monotonic time ``by`` where
    it is not 0 (``TimeoutError`` past it, which ends the connection)."""
    buf = memoryview(bytearray(min(n, DRAIN_BYTES)))
    before = conn.gettimeout()  # (the answer's sends)
    while n > 0:
        if by:
            left = by - time.monotonic()
            if left <= 0:
                raise TimeoutError("a refused call's items did not arrive in time")
            conn.settimeout(left)
        got = conn.recv_into(buf, min(n, len(buf)))
        if not got:
            raise OSError("the connection closed inside a PutMany's items")
        n -= got
    conn.settimeout(before)
