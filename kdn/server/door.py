"""What a data-path listener (``kdn.server.fastpath.FastPath``, and the network path that
extends it) keeps of a connection before and while it serves it: its state (``Peer``: its
deadline, and what admitted it), the door pending connections wait at with no thread of their
own (``Door``), a read with a deadline for the whole of it (``recv_by``) and a close that wakes
its thread (``cut_conn``). The bounds they serve are ``kdn.server.fastpath``'s module
docstring's."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kdn.errors import Cancelled

log = logging.getLogger(__name__)


class Peer:
    """A connection's state: its socket as accepted (the key of the path's tables) and its
    descriptor, the time by which its first call must have arrived (0: evicted), whether
    it spoke (its first call is being read), and the segment (or ticket) that admitted it
    (None while pending)."""

    __slots__ = ("conn", "fd", "deadline", "heard", "owner", "tenant")

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.fd, self.deadline = conn, conn.fileno(), deadline
        self.heard = False
        self.owner: str | None = None
        self.tenant = ""  # (of the owner, once admitted)

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


class Door:
    """Where pending connections wait for their first byte with no thread of their own: one
    thread polls them all (a thread each for 1,000 silent strangers, made and ended while a
    client was being served, doubled its p99), hands one that speaks to ``arrived``
    and closes one whose deadline passed."""

    def __init__(self, kind: str, due: Callable[[socket.socket], float],
                 arrived: Callable[[socket.socket, float], None]) -> None:
        self._due, self._arrived = due, arrived
        self._sel = selectors.DefaultSelector()
        self._wake, self._bell = socket.socketpair()
        self._wake.setblocking(False)
        self._sel.register(self._wake, selectors.EVENT_READ)
        self._new: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._run, name=f"kdn-{kind}-door", daemon=True).start()

    def wait_for(self, conn: socket.socket) -> None:
        with self._lock:
            self._new.append(conn)
        self._ring()

    def close(self) -> None:
        self._closed = True
        self._ring()

    def _ring(self) -> None:
        with contextlib.suppress(OSError):
            self._bell.send(b"\0")

    def _run(self) -> None:
        waiting: dict[socket.socket, float] = {}  # conn -> its deadline
        try:
            while not self._closed:
                soonest = min(waiting.values(), default=time.monotonic() + 1.0)
                events = self._sel.select(max(0.0, min(soonest - time.monotonic(), 1.0)))
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    while self._wake.recv(4096):  # before the new are taken: a ring after
                        pass  # this is for one taken now or next time round
                with self._lock:
                    new, self._new = self._new, []
                for conn in new:
                    with contextlib.suppress(ValueError, OSError):  # (closed meanwhile)
                        self._sel.register(conn, selectors.EVENT_READ)
                        waiting[conn] = self._due(conn)
                now = time.monotonic()
                heard = [c for c in waiting if any(k.fileobj is c for k, _ in events)]
                late = [c for c, due in waiting.items() if due <= now and c not in heard]
                for done in (*heard, *late):
                    del waiting[done]
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        self._sel.unregister(done)
                    try:
                        self._arrived(done, now)
                    except Exception:  # (a bug) that connection is lost, not the door
                        log.exception("data path: handing on a connection failed")
                        done.close()
        finally:
            for conn in waiting:
                conn.close()
            self._sel.close()
            self._wake.close()
            self._bell.close()


def cut_conn(conn: socket.socket) -> None:
    """Close ``conn``, waking a thread blocked on it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def recv_by(conn: socket.socket, n: int, by: float) -> bytes | None:
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


def queued(conn: socket.socket) -> bool:
    """Whether ``conn`` has bytes to read now (a call its client sent before the one being
    served was answered)."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False


def hung_up(conn: socket.socket) -> bool:
    """Whether the client closed its end of ``conn``: it gave up on its call (its deadline
    passed). A write is not applied then (as gRPC drops a call its client cancelled): a
    server that was stopped or slow would otherwise apply it late, after the client reported
    it failed and perhaps wrote a newer value elsewhere."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)  # (POLLHUP, POLLERR: always reported)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
               for _, ev in poller.poll(0))


def still_there(conn: socket.socket, what: str) -> None:
    """Cancelled where the client closed ``conn`` before its ``what`` was stored
    (``hung_up``)."""
    if hung_up(conn):
        raise Cancelled(f"the client closed the connection before its {what} was stored")
