"""The limits ``bench.roundtrip`` (and ``bench.delivery``, ``bench.load``, ``bench.netpath``)
compare kdn's data-plane paths with, measured in the same run:

    RawServer     a bare gRPC service: Put/Get stream an entry's messages, PutOne/GetOne move
                  it as one message (``raw_client``, ``raw_unary``)
    RawTcp        a bare TCP service moving an entry's bytes into kept buffers
                  (``raw_tcp_client``)
    raw_service   both, in a process of their own (``python -m bench.baselines``, tuned as a
                  kdn server is) or on threads of the caller's process
    memcpy_s, memcpy_read_s, h2d_s   a copy between warm buffers (then reading every 4 KiB
                  page of it), and a pinned host-to-device copy (GPU hosts only)
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import torch

from bench.common import timed
from kdn.cache import KVCache
from kdn.transport.buffers import server_trim_bytes, tune_allocator
from kdn.transport.wire import read_exact, recv_into_all

PAGE_VALUES = 2048
"""fp16 values in a 4 KiB page."""
SERVER_RAM_BYTES = 8 << 30
"""The kdn servers' RAM tier; the raw service tunes its allocator as a server of that size
does (``kdn.transport.buffers.server_trim_bytes``)."""
OPTS = [("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20)]


class RawServer:
    """A bare gRPC service: Put (client stream of bytes) and Get (server stream of bytes)."""

    def __init__(self) -> None:
        self.data: dict[bytes, list[bytes]] = {}
        self.whole: dict[bytes, bytes] = {}  # the unary service's: one message per entry
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def put(it: AsyncIterator[bytes], ctx: Any) -> bytes:
            msgs = [m async for m in it]
            self.data[msgs[0]] = msgs[1:]
            return b""

        async def get(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
            for m in self.data[req]:
                yield m

        async def put_one(req: bytes, ctx: Any) -> bytes:  # key, then the bytes
            self.whole[req[:32]] = req[32:]
            return b""

        async def get_one(req: bytes, ctx: Any) -> bytes:
            return self.whole[req]

        async def start() -> None:
            self.server = grpc.aio.server(options=OPTS)
            handler = grpc.method_handlers_generic_handler("raw.Raw", {
                "Put": grpc.stream_unary_rpc_method_handler(put),
                "Get": grpc.unary_stream_rpc_method_handler(get),
                "PutOne": grpc.unary_unary_rpc_method_handler(put_one),
                "GetOne": grpc.unary_unary_rpc_method_handler(get_one),
            })
            self.server.add_generic_rpc_handlers((handler,))
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


class RawTcp:
    """A bare TCP service, the limit of the ``tcp`` path: a put (u8 1, u64 n, then n bytes)
    is read into a buffer kept for its size (``recv_into``, no page faults after the first)
    and answered with one byte; a get (u8 2, u64 n) is answered with the last n bytes put."""

    HEAD = struct.Struct("<BQ")

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.kept: dict[int, memoryview] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while (head := read_exact(conn, self.HEAD.size)) is not None:
                op, n = self.HEAD.unpack(head)
                if op == 1:
                    buf = self.kept.get(n) or memoryview(np.empty(n, np.uint8))
                    if not recv_into_all(conn, buf):
                        return
                    self.kept[n] = buf
                    conn.sendall(b"k")
                else:
                    conn.sendall(self.kept[n])

    def stop(self) -> None:
        self.sock.close()


def raw_tcp_client(port: int) -> tuple[Callable[[memoryview], None], Callable[[int], None],
                                         socket.socket]:
    """(put(bytes), get(n), the connection) of the raw TCP service: a get reads into a
    buffer kept for its size, as a put on the other side."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs: dict[int, memoryview] = {}

    def put(data: memoryview) -> None:
        conn.sendall(RawTcp.HEAD.pack(1, len(data)))
        conn.sendall(data)
        assert conn.recv(1) == b"k"

    def get(n: int) -> None:
        conn.sendall(RawTcp.HEAD.pack(2, n))
        buf = bufs.setdefault(n, memoryview(np.empty(n, np.uint8)))  # type: ignore[arg-type]
        assert recv_into_all(conn, buf)

    return put, get, conn


def raw_client(port: int) -> tuple[Any, Any, grpc.Channel]:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
    return ch.stream_unary("/raw.Raw/Put"), ch.unary_stream("/raw.Raw/Get"), ch


def raw_unary(ch: grpc.Channel) -> tuple[Any, Any]:
    """The raw service's unary calls: a whole entry in one message each way."""
    return ch.unary_unary("/raw.Raw/PutOne"), ch.unary_unary("/raw.Raw/GetOne")


def read_pages(kv: KVCache) -> float:
    """Read one value in every 4 KiB of each tensor: what a consumer's read of the tensors
    costs at least (pages faulted in, the cache lines of every page)."""
    return sum(float(t.view(-1)[::PAGE_VALUES].sum()) for layer in kv.layers for t in layer)


def memcpy_s(nbytes: int, repeat: int) -> list[float]:
    """Copies of ``nbytes`` between warm buffers: three times the repeats of a kdn row (a copy
    is cheap, and one slow copy moved the median of 7 by 40% on this VM)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), 3 * repeat, warmup=2)


def memcpy_read_s(nbytes: int, repeat: int) -> list[float]:
    """A copy between warm buffers, then one value read in every 4 KiB of the copy (the
    limit of a same-host read whose tensors are then read: ``shm-read``)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out = torch.frombuffer(dst, dtype=torch.float16, count=nbytes // 2)

    def copy_read() -> None:
        np.copyto(dst, src)
        float(out[::PAGE_VALUES].sum())

    return timed(copy_read, 3 * repeat, warmup=2)


def h2d_s(nbytes: int, repeat: int) -> list[float] | None:
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return timed(copy, repeat)


def serve_raw() -> None:
    """``python -m bench.baselines`` (and ``bench.roundtrip --raw-server``): the raw services
    alone in this process (their ports on stdout) until stdin closes: the baseline of a remote
    client, in a process of its own as kdn's is."""
    tune_allocator(server_trim_bytes(SERVER_RAM_BYTES))  # as ``kdn serve`` sets it
    raw, tcp = RawServer(), RawTcp()
    print(raw.port, tcp.port, flush=True)
    sys.stdin.read()
    tcp.stop()
    raw.stop()


@contextmanager
def raw_service(where: str) -> Iterator[tuple[int, int]]:
    """The raw services' ports (gRPC, TCP): in a process of their own (``process``) or on
    threads of this one (``thread``)."""
    if where == "thread":
        raw, tcp = RawServer(), RawTcp()
        try:
            yield raw.port, tcp.port
        finally:
            tcp.stop()
            raw.stop()
        return
    proc = subprocess.Popen([sys.executable, "-m", "bench.baselines"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else b""
        if not line.strip():
            raise RuntimeError(f"raw service exited with {proc.wait()}")
        grpc_port, tcp_port = map(int, line.split())
        yield grpc_port, tcp_port
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    serve_raw()
