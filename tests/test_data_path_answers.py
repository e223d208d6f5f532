"""The client facing data-path answers that do not keep to the protocol: a network data path
(``kdn.client.netpath``) served by a scripted listener, and the same-host fast path of a real
server made to answer wrongly (``kdn.server.fastpath.FastPath.call`` replaced for the test).
Each is a typed kdn error, or a call made again on a connection that is in step; none hands
out another key's entry or loses the shared segment's regions."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash

from kdn import codec
from kdn.client import Client
from kdn.client.netpath import NetPath
from kdn.codec.format import header_size
from kdn.errors import Corrupt, DeadlineExceeded, InvalidArgument, TooLarge
from kdn.layout import Expected
from kdn.server import ServerConfig, ServerThread
from kdn.server.fastpath import FastPath
from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, FAST_PUT_MANY, NET_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import numbered_key, random_kv, uniform_layout
from tests.test_lying_server import OPTIONS, Lying

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


class Ticketing(Lying):
    """A lying server (``tests.test_lying_server``) that hands a client without a segment a
    ticket to the data path at ``data_port``."""

    data_port = 0

    def Attach(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        if not req.remote or not self.data_port:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no shared segment through this one")
        return pb.AttachResponse(data_port=self.data_port, segment_id="t" * 32)


@pytest.fixture
def ticketing(tmp_path: Path) -> Iterator[tuple[Ticketing, str]]:
    """(the servicer, its address), a real server behind it."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=64 << 20)
    with ServerThread(cfg) as real:
        servicer = Ticketing(real.address)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
        pb_grpc.add_KDNServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield servicer, f"127.0.0.1:{port}"
        finally:
            server.stop(0)
            servicer.channel.close()


@contextlib.contextmanager
def fast_answers(monkeypatch: pytest.MonkeyPatch, change: Callable[[int, Any], Any],
                 ops: tuple[int, ...] = (FAST_GET_MANY,)) -> Iterator[dict[str, bool]]:
    """The same-host fast path's replies to calls of ``ops`` passed through
    ``change(op, reply)`` while the flag yielded is on."""
    on = {"on": False}
    real = FastPath.call

    def call(self: FastPath, conn: socket.socket, op: int, body: bytes) -> Any:
        reply = real(self, conn, op, body)
        return change(op, reply) if on["on"] and op in ops else reply

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


# -- answers that are not what they say ------------------------------------------------------

NOT_A_MESSAGE = b"\x0a\xff\xff\xff\xff\xff\xff"  # a field cut off


def test_a_network_answer_that_is_no_message_is_corrupt(
        ticketing: tuple[Ticketing, str]) -> None:
    def garbage(op: int, req: Any, conn: socket.socket) -> None:
        conn.sendall(FAST_HEAD.pack(len(NOT_A_MESSAGE), 1) + NOT_A_MESSAGE)

    servicer, address = ticketing
    kv = random_kv(LAYOUT, 16, seed=1)
    with scripted(garbage) as servicer.data_port:
        with Client(address, timeout_s=5, shm_bytes=0) as c:
            for call in (lambda: c.fetch(A), lambda: c.fetch_many([A, B]),
                         lambda: c.retrieve_streams([A, B], layout=LAYOUT),
                         lambda: c.store(A, kv, mode="raw"),
                         lambda: c.store_many([(A, kv), (B, kv)], mode="raw")):
                with pytest.raises(Corrupt, match="not a valid message"):
                    call()
            c.store_async(A, kv, mode="raw")
            with pytest.raises(Corrupt, match="not a valid message"):
                c.flush()


@pytest.mark.parametrize("damage", [(b"\xfd\x00", Corrupt), (b"\x09\x00", None)],
                         ids=["damaged", "newer"])
def test_an_entry_of_a_version_not_read_is_corrupt_where_its_checksum_says_so(
        ticketing: tuple[Ticketing, str], damage: tuple[bytes, Any]) -> None:
    """An entry whose header's version field is one this kdn does not read: Corrupt where
    the header's checksum says it was damaged on the way (it said InvalidArgument, the
    caller's mistake, from the version alone), InvalidArgument for a newer kdn's."""
    version, kind = damage
    entry = bytearray(_entry(1))
    entry[4:6] = version  # (after the magic)
    if kind is None:  # a newer kdn's: its checksum made over its own bytes
        head = header_size(memoryview(_entry(1)))
        entry[head - 8:head] = xxhash.xxh3_64_intdigest(bytes(entry[:head - 8])).to_bytes(
            8, "little")

    def answer(op: int, req: Any, conn: socket.socket) -> None:
        conn.sendall(_get_answer([bytes(entry)]))

    servicer, address = ticketing
    with scripted(answer) as servicer.data_port, Client(address, timeout_s=5,
                                                        shm_bytes=0) as c:
        with pytest.raises(kind or InvalidArgument,
                           match="checksum" if kind else "unsupported container version 9"):
            c.fetch(A)


@pytest.mark.no_arena
def test_a_fast_path_answer_that_is_no_message_is_corrupt_and_frees_its_region(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 16, seed=1)
    with fast_answers(monkeypatch, lambda op, reply: reply._replace(body=NOT_A_MESSAGE),
                      (FAST_GET_MANY, FAST_PUT_MANY)) as on, \
            Client(server.address, timeout_s=10, shm_bytes=8 << 20) as c:
        c.store(A, kv, mode="raw")
        seg = c.dataplane.segment()[0]
        free = seg.regions.largest_free()
        on["on"] = True
        for call in (lambda: c.fetch(A), lambda: c.fetch_many([A, B]),
                     lambda: c.fetch(A), lambda: c.store(B, kv, mode="raw")):
            with pytest.raises(Corrupt, match="not a valid message"):
                call()
        c.store_async(B, kv, mode="raw")
        with pytest.raises(Corrupt, match="not a valid message"):
            c.flush()
        assert seg.regions.retired_bytes() == 0  # answered: the server is done with them
        assert seg.regions.largest_free() == free
        on["on"] = False
        assert c.retrieve(A).equal(kv)  # type: ignore[union-attr]


@pytest.mark.no_arena
def test_a_fast_path_answer_short_of_entries_or_placing_one_outside_is_corrupt(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer entries than keys (none is a miss: which entry is whose is not known), or one
    placed outside its region: Corrupt, and the region comes back whole."""
    how = {"lie": "short"}

    def lie(op: int, reply: Any) -> Any:
        resp = pb.GetManyResponse.FromString(reply.body)
        if how["lie"] == "short":
            del resp.entries[-1]
        else:
            resp.entries[-1].offset = 1 << 40
        return reply._replace(body=resp.SerializeToString())

    with fast_answers(monkeypatch, lie) as on, \
            Client(server.address, timeout_s=10, shm_bytes=8 << 20) as c:
        kv_a, kv_b = random_kv(LAYOUT, 16, seed=1), random_kv(LAYOUT, 16, seed=2)
        c.store(A, kv_a, mode="raw")
        c.store(B, kv_b, mode="raw")
        seg = c.dataplane.segment()[0]
        free = seg.regions.largest_free()
        on["on"] = True
        for how["lie"], match in (("short", "1 entries for 2 keys"), ("outside", "outside")):
            for _ in range(2):
                with pytest.raises(Corrupt, match=match):
                    c.fetch_many([A, B])
        on["on"] = False
        assert seg.regions.retired_bytes() == 0 and seg.regions.largest_free() == free
        got = c.fetch_many([A, B])
        assert all(g is not None for g in got)


# -- answers trickled ------------------------------------------------------------------------


def _trickle(conn: socket.socket, data: bytes) -> None:
    """``data`` a byte every 0.2 s (each receive well within any timeout), until cut."""
    with contextlib.suppress(OSError):
        for i in range(len(data)):
            conn.sendall(data[i : i + 1])
            time.sleep(0.2)


def _ends_within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """What ``call`` raised (None: nothing), checked to end within ``seconds``."""
    out: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            call()
            out["error"] = None
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    return out["error"]


def test_a_trickled_network_answer_to_a_store_async_ends_at_its_deadline(
        ticketing: tuple[Ticketing, str]) -> None:
    slow = {"on": False}

    def put(op: int, req: Any, conn: socket.socket) -> None:
        body = pb.PutManyResponse(results=[pb.StoreResponse() for _ in req.items]
                                  ).SerializeToString() + b"\x12\x00" * 50  # 100 bytes more
        answer = FAST_HEAD.pack(len(body), 1) + body
        _trickle(conn, answer) if slow["on"] else conn.sendall(answer)

    servicer, address = ticketing
    kv = random_kv(LAYOUT, 16, seed=1)
    with scripted(put) as servicer.data_port, \
            Client(address, timeout_s=1.0, shm_bytes=0) as c:
        def stores() -> None:
            c.store(A, kv, mode="raw")  # this thread's connection to the data path
            slow["on"] = True
            c.store_async(B, kv, mode="raw")
            c.flush()

        assert isinstance(_ends_within(3.0, stores), DeadlineExceeded)


@pytest.mark.no_arena
def test_a_trickled_fast_path_answer_ends_at_the_calls_deadline(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read, and an asynchronous store's answer: ``timeout_s`` for the whole answer, not
    for each of its bytes."""
    on = {"on": False}
    real = FastPath._answer

    def answer(self: FastPath, conn: socket.socket, op: int, call: Callable[[], Any],
               started: float) -> bool:
        if not on["on"] or op not in (FAST_GET_MANY, FAST_PUT_MANY):
            return real(self, conn, op, call, started)
        reply = call()
        _trickle(conn, FAST_HEAD.pack(len(reply.body), 1) + reply.body)
        return True

    monkeypatch.setattr(FastPath, "_answer", answer)
    kv = random_kv(LAYOUT, 16, seed=1)
    with Client(server.address, timeout_s=1.0, shm_bytes=8 << 20) as c:
        c.store(A, kv, mode="raw")
        assert c.dataplane.same_host.fast
        on["on"] = True

        def store() -> None:
            c.store_async(B, kv, mode="raw")
            c.flush()

        assert isinstance(_ends_within(3.0, store), DeadlineExceeded)
        assert isinstance(_ends_within(3.0, lambda: c.fetch(A)), DeadlineExceeded)


# -- answers larger than the call can bring --------------------------------------------------

EMPTY_REFS = b"\x0a\x00" * (2 << 20)  # 2M empty entries: ~100 MB once parsed


def test_a_network_answer_larger_than_its_call_can_bring_is_not_read() -> None:
    def huge(op: int, req: Any, conn: socket.socket) -> None:
        conn.sendall(FAST_HEAD.pack(len(EMPTY_REFS), 1) + EMPTY_REFS)

    with scripted(huge) as port:
        net = NetPath("127.0.0.1", port, "t" * 32, 5)
        try:
            with pytest.raises(OSError, match="at most 65792 for the call"):
                net.get_many("default", [A], Expected())
        finally:
            net.close()


@pytest.mark.no_arena
def test_a_fast_path_answer_larger_than_its_call_can_bring_is_not_read(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 16, seed=1)
    with fast_answers(monkeypatch, lambda op, reply: reply._replace(body=EMPTY_REFS)) as on, \
            Client(server.address, timeout_s=10, shm_bytes=8 << 20) as c:
        c.store(A, kv, mode="raw")
        on["on"] = True
        assert c.retrieve(A).equal(kv)  # type: ignore[union-attr]  (by gRPC)
        assert not c.dataplane.same_host.fast


def test_page_locked_memory_refused_for_an_entry_is_too_large(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry bound for a CUDA device for which CUDA has no page-locked memory: TooLarge
    (kdn's error tree), not torch's RuntimeError."""
    import torch

    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory"):
            raise torch.OutOfMemoryError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    entry = _entry(1)
    with scripted(lambda op, req, conn: conn.sendall(_get_answer([entry]))) as port:
        net = NetPath("127.0.0.1", port, "t" * 32, 5)
        try:
            with pytest.raises(TooLarge, match="no page-locked memory"):
                net.get_many("default", [A], Expected(), pinned=True)
        finally:
            net.close()
