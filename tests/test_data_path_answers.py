"""The client facing data-path answers that do not keep to the protocol: a network data path
(``kdn.client.netpath``) served by a scripted listener, and the same-host fast path of a real
server made to answer wrongly (``kdn.server.fastpath.FastPath.call`` replaced for the test).
Each is a typed kdn error, or a call made again on a connection that is in step; none hands
out another key's entry or loses the shared segment's regions."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.netpath import NetPath
from kdn.layout import Expected
from kdn.server import ServerThread
from kdn.server.fastpath import FastPath
from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, NET_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()
A, B = numbered_key(1), numbered_key(2)
Script = Callable[[int, Any, socket.socket], None]


def _entry(seed: int) -> bytes:
    return codec.encode_parts(random_kv(LAYOUT, 16, seed=seed), "raw").to_bytes()


@contextlib.contextmanager
def scripted(script: Script) -> Iterator[int]:
    """A network data path listener (its port) whose every call is answered by
    ``script(op, request, conn)``: whatever it writes on ``conn``."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while (head := read_exact(conn, FAST_HEAD.size)) is not None:
                n, op = FAST_HEAD.unpack(head)
                body = read_exact(conn, n) or b""
                if op == NET_PUT_MANY:
                    req: Any = pb.PutManyRequest.FromString(body)
                    read_exact(conn, sum(i.region.length for i in req.items))
                else:
                    req = pb.GetManyRequest.FromString(body)
                script(op, req, conn)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = sock.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _get_answer(entries: list[bytes]) -> bytes:
    """A GetMany answer of the network data path: its body, then the entries."""
    resp = pb.GetManyResponse()
    at = 0
    for e in entries:
        resp.entries.add(present=True, tier="ram", written=True, offset=at, length=len(e))
        at += len(e)
    body = resp.SerializeToString()
    return FAST_HEAD.pack(len(body), 1) + body + b"".join(entries)


@contextlib.contextmanager
def fast_answers(monkeypatch: pytest.MonkeyPatch,
                 change: Callable[[int, Any], Any]) -> Iterator[dict[str, bool]]:
    """The same-host fast path's GetMany replies passed through ``change(op, reply)`` while
    the flag yielded is on."""
    on = {"on": False}
    real = FastPath.call

    def call(self: FastPath, conn: socket.socket, op: int, body: bytes) -> Any:
        reply = real(self, conn, op, body)
        return change(op, reply) if on["on"] and op == FAST_GET_MANY else reply

    monkeypatch.setattr(FastPath, "call", call)
    yield on


# -- answers out of step ---------------------------------------------------------------------


def test_a_data_path_connection_out_of_step_is_not_used_again() -> None:
    entries = {A: _entry(1), B: _entry(2)}
    calls: list[list[bytes]] = []

    def twice_first(op: int, req: Any, conn: socket.socket) -> None:
        calls.append(list(req.keys))
        answer = _get_answer([entries[k] for k in req.keys])
        conn.sendall(answer * 2 if len(calls) == 1 else answer)  # the first one sent twice

    with scripted(twice_first) as port:
        net = NetPath("127.0.0.1", port, "t" * 32, 5)
        try:
            got = net.get_many("default", [A], Expected())
            assert got[0] is not None and bytes(got[0][0]) == entries[A]
            got = net.get_many("default", [B], Expected())  # asked on a new connection
            assert got[0] is not None and bytes(got[0][0]) == entries[B]
        finally:
            net.close()


@pytest.mark.no_arena
def test_a_fast_path_connection_out_of_step_is_not_used_again(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    def twice(op: int, reply: Any) -> Any:  # the answer, and the same again unasked
        again = FAST_HEAD.pack(len(reply.body), 1) + reply.body
        on["on"] = False
        return reply._replace(after=(again,))

    with fast_answers(monkeypatch, twice) as on, \
            Client(server.address, timeout_s=10, shm_bytes=8 << 20) as c:
        kv_a, kv_b = random_kv(LAYOUT, 16, seed=1), random_kv(LAYOUT, 16, seed=2)
        c.store(A, kv_a, mode="raw")
        c.store(B, kv_b, mode="raw")
        on["on"] = True
        assert c.retrieve(A).equal(kv_a)  # type: ignore[union-attr]
        for _ in range(2):
            assert c.retrieve(B).equal(kv_b)  # type: ignore[union-attr]
            assert c.retrieve(A).equal(kv_a)  # type: ignore[union-attr]
