"""Deadlines of calls on the data paths: on the network data path (``kdn.client.netpath``)
and the same-host fast path (``kdn.client.samehost``) one per call, for all of its sends and
receives together, not one per receive; gRPC calls are given the time left of
``deadline_within`` as their deadline (``time_left``).

``NetPath`` (``SameHostPath`` likewise) binds each call's connection to when the call must
end (``Until``: every send and receive waits only the time left, TimeoutError once none is):
``timeout_s`` from the call's start, or sooner where the calling thread runs inside
``deadline_within`` (a link probe's budget). A server that trickles its answer fails the call
then, not ``timeout_s`` after its last byte. An entry's future cancelled before it landed
(``abandoned``) shuts its stripe's connection, so the thread landing it stops waiting, once
no other entry of the stripe is awaited; until then the let-go entries are read and dropped.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

NO_DEADLINE_S = 1e9
"""A timeout of this many seconds (about 31 years) or more is no deadline: gRPC can not hold a
deadline so far off (``timeout_s=1e12`` made every call fail DEADLINE_EXCEEDED at once), nor a
socket or a thread's wait (OverflowError); a ``deadline_within`` so long bounds nothing."""
_CAP = threading.local()
"""This thread's ``deadline_within`` (``until``, ``time.monotonic``)."""


@contextlib.contextmanager
def deadline_within(seconds: float, own: bool = False) -> Iterator[None]:
    """Calls this thread makes to the server inside end within ``seconds`` from now in all
    (TimeoutError, DeadlineExceeded from the client), also where the client's ``timeout_s``
    is longer or None: on the data paths (the network data path, the same-host fast path) and
    over gRPC (``time_left``: the Attach of a client's first call, lookups, reads, stores and
    the calls that give them back). A call already bounded sooner keeps its own; ``seconds``
    of ``NO_DEADLINE_S`` or more bound nothing. ``own``: the
    bound is the client's own ``timeout_s`` (``own_cap``), not a caller's."""
    before, before_own = getattr(_CAP, "until", None), getattr(_CAP, "own", False)
    until = time.monotonic() + seconds
    if seconds < NO_DEADLINE_S and (before is None or until < before):
        _CAP.until, _CAP.own = until, own
    try:
        yield
    finally:
        _CAP.until, _CAP.own = before, before_own


class Until:
    """A connection whose sends and receives all end by ``until`` (``time.monotonic``): each
    waits only the time left (TimeoutError once none is). What is not a send or a receive
    goes to the connection as is."""

    def __init__(self, conn: socket.socket, until: float) -> None:
        self.conn, self.until = conn, until

    def _arm(self) -> None:
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self.conn.settimeout(left)

    def recv(self, n: int, flags: int = 0) -> bytes:
        self._arm()
        return self.conn.recv(n, flags)

    def recv_into(self, buf: Any, n: int = 0, flags: int = 0) -> int:
        self._arm()
        return self.conn.recv_into(buf, n, flags)

    def recvmsg(self, bufsize: int, ancbufsize: int = 0, flags: int = 0) -> Any:
        self._arm()
        return self.conn.recvmsg(bufsize, ancbufsize, flags)

    def sendmsg(self, buffers: Any) -> int:
        self._arm()
        if isinstance(self.conn, ssl.SSLSocket):  # no sendmsg on TLS: each through the records
            for buf in buffers:
                self._arm()
                self.conn.sendall(buf)
            return sum(memoryview(buf).nbytes for buf in buffers)
        return self.conn.sendmsg(buffers)

    def sendall(self, data: Any) -> None:
        self._arm()
        self.conn.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def call_cap() -> float | None:
    """This thread's ``deadline_within`` (``time.monotonic``), None outside one."""
    until: float | None = getattr(_CAP, "until", None)
    return until


def own_cap() -> bool:
    """Whether this thread's ``call_cap`` is the client's own ``timeout_s`` (a call's one
    deadline, ``RemotePath.one_deadline``), not one its caller set around it."""
    return bool(getattr(_CAP, "own", False))


def caller_deadline_passed() -> bool:
    """Whether this thread runs inside a caller's ``deadline_within`` whose time is up (not
    the client's own ``timeout_s``, ``own_cap``): a call it ended says nothing of the server."""
    cap = call_cap()
    return cap is not None and not own_cap() and time.monotonic() >= cap


def time_left(timeout_s: float | None) -> float | None:
    """The deadline, in seconds from now, of a gRPC call made with ``timeout_s``: less where
    this thread runs inside ``deadline_within`` (a millisecond once its time is up: the call
    then fails at once, with DEADLINE_EXCEEDED)."""
    cap = call_cap()
    if cap is None:
        return timeout_s
    left = max(0.001, cap - time.monotonic())
    return left if timeout_s is None else min(timeout_s, left)


def wait_span(timeout: float | None) -> float | None:
    """``timeout`` for a thread's wait: None (no end) where it is ``NO_DEADLINE_S`` or more
    (1e10 s is past ``threading.TIMEOUT_MAX``: an OverflowError, not a wait)."""
    return None if timeout is None or timeout >= NO_DEADLINE_S else timeout


def wait_end(timeout: float | None) -> float | None:
    """When (``time.monotonic``) a wait of ``timeout`` seconds from now ends; None: never
    (``wait_span``). A call that waits several times (``LayerStream.result``) gives each
    ``wait_left``, so its timeout bounds the whole call, not each wait."""
    timeout = wait_span(timeout)
    return None if timeout is None else time.monotonic() + timeout


def wait_left(end: float | None) -> float | None:
    """The seconds left until ``end`` (``wait_end``), at least 0; None for no end."""
    return None if end is None else max(0.0, end - time.monotonic())


def unbound(conn: socket.socket) -> socket.socket:
    """The connection under a ``Until``."""
    return conn.conn if isinstance(conn, Until) else conn


def watch_stripe(conn: socket.socket, stripe: list[Future[memoryview] | None]) -> None:
    """``abandoned`` called with each entry's future of a stripe once it is done (they are
    held weakly there: a future's callbacks holding the stripe would be a cycle, which keeps
    the landed entries' buffers until a collection)."""
    weak = [None if f is None else weakref.ref(f) for f in stripe]
    for f in stripe:
        if f is not None:
            f.add_done_callback(functools.partial(abandoned, conn, weak))


def abandoned(conn: socket.socket, stripe: list[weakref.ref[Future[memoryview]] | None],
              fut: Future[memoryview]) -> None:
    """An entry's future done: cancelled (let go before it landed) while every other entry
    of its stripe is done too (landed, failed or let go), the stripe's connection is shut, so
    the thread landing it stops waiting for its bytes. While another entry of the stripe is
    still awaited the connection stays: the landing thread reads the bytes of those let go
    and drops them (``awaited_after``, ``deliver``)."""
    futures = [ref() for ref in stripe if ref is not None]  # None: let go, so done
    if fut.cancelled() and all(f is None or f.done() for f in futures):
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def awaited_after(stripe: list[Future[memoryview] | None], j: int) -> bool:
    """An entry of the stripe after its ``j``-th is still awaited (its future not done)."""
    return any(f is not None and not f.done() for f in stripe[j + 1:])


def deliver(fut: Future[memoryview], data: memoryview) -> None:
    """``data`` as ``fut``'s result; dropped where the future was let go (cancelled) while
    its bytes came."""
    with contextlib.suppress(InvalidStateError):
        fut.set_result(data)
