"""A TCP relay between a client and a real server, to make the network fail as it does in the
field: answers late and then a reset, a port that takes connections and says nothing, a peer
that stops sending, connections that die silently (no reset) while new ones work.

    with Relay(port) as r:      # r.port: the client's side
        r.fault = LateReset(0.5)  # every chunk from the client: 0.5 s, then both sides reset
        r.fault = LateReset(0, answers=True)  # the server's next chunk: both sides reset, once
        r.fault = MUTE           # new connections accepted, never answered (not dialled on)
        r.fault = FREEZE         # nothing more forwarded, either way
        r.bury()                 # the connections open now swallow everything; new ones work

Threads, a pair per connection; every socket is closed at ``close``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

MUTE = "mute"
FREEZE = "freeze"


@dataclass(frozen=True)
class LateReset:
    """A chunk the client sends is not forwarded: after ``delay_s`` both sides are reset.
    ``answers``: the next chunk the server sends instead, once (the call was made, its
    answer lost)."""

    delay_s: float
    answers: bool = False


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (waking a thread of the relay blocked on it)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    sock.close()


class Relay:
    """Connections to ``127.0.0.1:port``, relayed through ``self.port`` (module docstring)."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.fault: Any = None
        self.accepted = 0
        self._socks: list[socket.socket] = []
        self._buried: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            with self._lock:
                self._socks.append(conn)
            if self.fault == MUTE:
                continue
            try:
                up = socket.create_connection(self.target)
            except OSError:
                reset(conn)
                continue
            with self._lock:
                self._socks.append(up)
            threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                while self.fault == FREEZE:
                    time.sleep(0.02)
                if id(src) in self._buried:
                    continue  # read and dropped, never forwarded
                fault = self.fault
                if isinstance(fault, LateReset) and from_client != fault.answers:
                    if fault.answers:
                        self.fault = None  # once: the call made again is answered
                    time.sleep(fault.delay_s)
                    reset(src)
                    reset(dst)
                    return
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def bury(self) -> None:
        """The connections open now swallow every byte from here on, both ways, and never
        close (a peer gone without a reset); new connections work."""
        with self._lock:
            self._buried.update(id(s) for s in self._socks)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            reset(s)
