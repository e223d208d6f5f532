"""A data path's connections kept one per thread (``kdn.client.netpath.NetPath``,
``kdn.client.samehost.SameHostPath``): calls on a connection are answered in order, so each
thread that calls a path gets a connection of its own.

Lifecycle: ``mine()`` gives the calling thread its ``Held`` (made on first use and kept in
thread-local storage): its connection and the stores sent on it whose answers are not read
yet. ``hold`` records a connection the thread opened, ``drop`` closes it. A thread that ends
takes its thread-local storage with it: the ``Held`` dies and a finalizer closes its
connection, so a client shared by short-lived threads holds a connection per live thread, not
one per thread it ever served (the server admits ``kdn.server.netpath.MAX_PER_TICKET`` of a
ticket's at once). Stores the thread sent and left unanswered are settled first, on a thread
of their own, by the path's ``orphaned(conn, pending)``: their answers read on the connection
where it still stands (their regions of a segment come back), each failed otherwise; where
the path itself is gone (a client dropped without ``close()``: its stores hold it weakly,
``kdn.client.pending``), each fails UNAVAILABLE. In a child of ``fork()`` (whose threads but
the forking one are gone, and their ``Held`` with them) nothing is settled: the connections
and the stores are the parent's, and an answer read in the child is lost to the parent (or
handed to another of its stores); the child only closes its copy of the connection.
``close`` shuts down every thread's connection (the client closed), and refuses one a thread
opens after it. It closes only the calling thread's own and those of threads that ended: a
connection another live thread holds is only shut down, for that thread to close (its next
call, its call under way failing, or its end). Closed under a thread still inside a call,
its descriptor's number could be given to a connection opened meanwhile (the server's, in
this process) and the call's read wait there for its deadline, or read another's bytes. So
a connection with stores sent on it and not answered yet keeps the answers the server sent
before it (shut down, it holds those and no more: a read past them ends at once), read by its
thread; the stores whose answers never came fail Closed (``closed``).

A server that refuses a thread's new connection for its limits (RESOURCE_EXHAUSTED on its
first call, not the tenant's rate limit) makes the path raise ``Crowded``: that call goes by
gRPC, and so do the thread's calls for ``CROWDED_S`` after (``Held.crowded``) rather than each
opening a connection to be refused again.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from kdn.errors import KDNError, RateLimited, TooLarge, Unavailable

log = logging.getLogger(__name__)

CROWDED_S = 1.0
"""Seconds a thread whose new connection the server refused calls by gRPC before it opens
another."""


class Crowded(TooLarge):
    """The server refused a new data path connection (RESOURCE_EXHAUSTED on its first call:
    the connections it admits per ticket or in all); the call goes by gRPC. Where the call
    itself was too large or over a quota, gRPC refuses it too and says so."""

    @classmethod
    def of(cls, error: KDNError) -> Crowded:
        out = cls(str(error))
        out.status = error.status
        return out


def refused(error: KDNError, new: bool) -> KDNError:
    """The error a server answered to a call; Crowded where it refused the call's ``new``
    connection (RESOURCE_EXHAUSTED on a connection's first call: gRPC instead). RateLimited
    stays itself: the tenant's requests are over its rate on every path (sent again by
    gRPC, the call asked the tenant's bucket twice)."""
    crowded = new and isinstance(error, TooLarge) and not isinstance(error, RateLimited)
    return Crowded.of(error) if crowded else error


class Held:
    """One thread's state on a path: its connection (None before one is opened), the path it
    leads to (``SameHostPath``: a server before a restart has another), the stores sent on it
    not yet answered, and the errors of those answered since they were last taken."""

    __slots__ = ("token", "conn", "path", "pending", "failed", "crowded_until", "thread",
                 "__weakref__")

    def __init__(self, token: int) -> None:
        self.token = token
        self.thread = threading.current_thread()  # (the one whose thread-local holds it)
        self.conn: socket.socket | None = None
        self.path = ""
        self.pending: deque[Any] = deque()
        self.failed: list[KDNError] = []
        self.crowded_until = 0.0

    @property
    def crowded(self) -> bool:
        """Whether the server refused this thread a connection less than ``CROWDED_S`` ago."""
        return time.monotonic() < self.crowded_until

    def refused(self) -> None:
        self.crowded_until = time.monotonic() + CROWDED_S


Orphaned = Callable[[socket.socket | None, deque[Any]], None]
"""A path's ``orphaned(conn, pending)``: settle the stores a dead thread left unanswered on
``conn`` (None: closed with the client), emptying ``pending`` (module docstring)."""


def _close(open_: dict[int, socket.socket], token: int, pending: deque[Any],
           orphaned: weakref.WeakMethod[Orphaned] | None, pid: int) -> None:
    """A ``Held`` died (its thread ended): its connection goes too, once the stores sent on
    it and left unanswered are settled (module docstring); in a child of ``fork()`` (not
    ``pid``, whose thread it was) the child's copy of the connection is closed, no more."""
    conn = open_.pop(token, None)
    if os.getpid() != pid:
        if conn is not None:
            conn.close()  # (the child's descriptor: the parent's connection stands)
        return
    settle = orphaned() if orphaned is not None and pending else None
    if settle is not None:
        try:  # not here: a finalizer may run on any thread, inside any of its calls
            threading.Thread(target=_settle, args=(settle, conn, pending), daemon=True,
                             name="kdn-orphaned-stores").start()
            return
        except RuntimeError:  # the interpreter is shutting down
            pass
    _settle(None, conn, pending)


def _settle(settle: Orphaned | None, conn: socket.socket | None, pending: deque[Any]) -> None:
    try:
        if settle is not None:
            settle(conn, pending)
    except Exception as exc:  # noqa: BLE001 - nobody to raise it to: the rest fail below
        log.warning("kdn: the stores of a thread that ended were not settled: %s", exc)
    finally:
        if conn is not None:
            conn.close()
        while pending:
            item = pending.popleft()
            store = item[0] if isinstance(item, tuple) else item  # (PendingStore, region)
            store.resolve(None, Unavailable(
                f"the thread that sent the store of {store.key!r} ended (or its client was "
                "dropped unclosed) before its answer was read; it may or may not be stored"))


class PerThread:
    """Each thread's ``Held`` on one path (module docstring). ``orphaned``: the path's method
    that settles a dead thread's unanswered stores (held weakly: a dead client's threads
    settle nothing)."""

    def __init__(self, orphaned: Orphaned | None = None) -> None:
        self._orphaned = weakref.WeakMethod(orphaned) if orphaned is not None else None
        self._local = threading.local()
        self._open: dict[int, socket.socket] = {}  # token -> a live thread's connection
        self._held: weakref.WeakValueDictionary[int, Held] = weakref.WeakValueDictionary()
        self._tokens = itertools.count()
        self._lock = threading.Lock()  # ``hold`` against ``close``
        self._closed = False

    def mine(self) -> Held:
        """The calling thread's ``Held``, made on first use."""
        held: Held | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = Held(next(self._tokens))
            weakref.finalize(held, _close, self._open, held.token, held.pending,
                             self._orphaned, os.getpid()).atexit = False  # (fds: the process')
        return held

    def peek(self) -> Held | None:
        """The calling thread's ``Held`` where it has one (none made)."""
        return getattr(self._local, "held", None)

    def hold(self, held: Held, conn: socket.socket, path: str = "") -> None:
        """``conn`` is now ``held``'s connection (to ``path``); one it had is closed.
        OSError, ``conn`` closed, once the path was closed (a thread that connected as
        ``close`` ran: nothing would close it, and its calls would wait on it)."""
        self.drop(held)
        with self._lock:
            if not self._closed:
                held.conn, held.path = conn, path
                self._open[held.token] = conn
                self._held[held.token] = held
                return
        conn.close()
        raise OSError("the data path was closed")

    def drop(self, held: Held | None) -> None:
        """Close ``held``'s connection, if it has one."""
        if held is None:
            return
        conn, held.conn = held.conn, None
        self._open.pop(held.token, None)
        if conn is not None:
            conn.close()

    def count(self) -> int:
        """Connections open, one per thread that holds one."""
        return len(self._open)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran: a store whose answer did not come was cut by it."""
        return self._closed

    def close(self) -> None:
        """Shut down every thread's connection (a thread's next use of it fails: OSError; one
        waiting on it for an answer wakes), and close the calling thread's and those of
        threads gone; another live thread's is closed by that thread (module docstring)."""
        with self._lock:
            self._closed = True
        me = threading.current_thread()
        for token, conn in list(self._open.items()):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            held = self._held.get(token)
            if held is not None and held.conn is conn and (
                    held.pending or held.thread is not me and held.thread.is_alive()):
                continue
            self._open.pop(token, None)
            conn.close()
