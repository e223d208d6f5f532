"""A write whose client gave up is not applied late: a server that was stopped or slow past a
PutMany's deadline, on the same-host fast path or the network data path, finds its client
gone when it gets to the call, and stores nothing (as gRPC drops a call its client
cancelled); otherwise it lands after the client reported it failed, perhaps over a newer
value written elsewhere. A fleet does not send such a write on to another node either."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from kdn.client import Client
from kdn.errors import DeadlineExceeded, KDNError
from kdn.server import ServerThread, streamed
from kdn.server.door import hung_up
from kdn.server.fastpath import FastPath
from kdn.transport.wire import FAST_PUT_MANY
from tests.helpers import numbered_key, random_kv, uniform_layout

KV = random_kv(uniform_layout(), 16)


def test_a_hung_up_connection_is_told_from_a_quiet_one() -> None:
    a, b = socket.socketpair()
    try:
        assert not hung_up(a)
        b.sendall(b"the next call")  # data waiting is no hang-up
        assert not hung_up(a)
        b.close()
        assert hung_up(a)
    finally:
        a.close()


@pytest.mark.parametrize("path", ["fast", "net"])
def test_a_putmany_its_client_gave_up_on_is_not_stored(
        server: ServerThread, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stalls on the PutMany past the client's deadline (as a stopped server
    does): the client fails, and the server, when it gets to the call, stores nothing."""
    stalled = threading.Event()
    if path == "fast":
        request = FastPath._request  # noqa: SLF001

        def slow_request(self: FastPath, op: int, body: bytes) -> Any:
            if op == FAST_PUT_MANY:
                stalled.set()
                time.sleep(1.5)
            return request(self, op, body)

        monkeypatch.setattr(FastPath, "_request", slow_request)
    else:  # the stall after the items' bytes were read (they came before the deadline)
        received = streamed._received  # noqa: SLF001

        def slow_received(*args: Any) -> Any:
            out = received(*args)
            stalled.set()
            time.sleep(1.5)
            return out

        monkeypatch.setattr(streamed, "_received", slow_received)
    key = numbered_key(7)
    shm = 8 << 20 if path == "fast" else 0
    with Client(server.address, timeout_s=0.5, shm_bytes=shm) as c:
        assert c.dataplane.attached == (path == "fast")
        with pytest.raises((DeadlineExceeded, KDNError, TimeoutError)):
            c.store(key, KV, mode="raw")
        assert stalled.is_set()  # the call reached the path it was meant for
        time.sleep(2.0)  # the server gets to the call (its segment or ticket still held)
        with Client(server.address, timeout_s=30) as other:
            assert not other.lookup([key]).infos[0].present
