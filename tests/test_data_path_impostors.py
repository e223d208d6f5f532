"""The same-host client facing another process on its fast path's name: the name is in Linux's
abstract namespace (no permissions), so once the server's listener is gone any local process
may bind it. A connection it accepts is refused (its peer is not the process seen at attach)
and the read goes by gRPC, never taking the impostor's answer as the server's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kdn import codec
from kdn.client import Client
from kdn.server import ServerThread
from kdn.transport.wire import FAST_HEAD
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key, random_kv, uniform_layout

IMPOSTOR = r'''
import socket, struct, sys, time
name, frame = sys.argv[1], sys.stdin.buffer.read()
imp = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
for _ in range(200):  # the server's listener goes once its accepting thread wakes
    try:
        imp.bind("\0" + name)
        break
    except OSError:
        time.sleep(0.02)
imp.listen(8)
print("bound", flush=True)
while True:
    conn, _ = imp.accept()
    head = conn.recv(5)
    if len(head) == 5:
        n = struct.unpack("<IB", head)[0]
        got = b""
        while len(got) < n:
            got += conn.recv(n - len(got))
        conn.sendall(frame)
'''


@pytest.mark.no_arena
def test_a_process_that_took_the_fast_paths_name_is_not_answered_from(
        server: ServerThread) -> None:
    layout = uniform_layout()
    evil = codec.encode_parts(random_kv(layout, 16, seed=666), "raw").to_bytes()
    resp = pb.GetManyResponse()
    resp.entries.add(present=True, tier="ram", written=True, verified=True, length=len(evil),
                     data=evil)
    body = resp.SerializeToString()
    with Client(server.address, timeout_s=10, shm_bytes=8 << 20) as c:
        c.store(numbered_key(1), random_kv(layout, 16, seed=1), mode="raw")
        name = c.dataplane.same_host._fast_path
        assert name and server.server is not None and server.server.fast_path is not None
        server.server.fast_path.close()  # as when the server process goes away
        imp = subprocess.Popen([sys.executable, "-c", IMPOSTOR, name], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
        try:
            assert imp.stdin is not None and imp.stdout is not None
            imp.stdin.write(FAST_HEAD.pack(len(body), 1) + body)
            imp.stdin.close()
            assert imp.stdout.readline().strip() == b"bound"
            out: dict[str, object] = {}
            # a thread with no connection to the fast path yet opens one
            t = threading.Thread(target=lambda: out.update(got=c.fetch(numbered_key(66))))
            start = time.monotonic()
            t.start()
            t.join(10)
            assert time.monotonic() - start < 10
            assert "got" in out and out["got"] is None  # the server's answer, by gRPC: a miss
            assert not c.dataplane.same_host.fast  # the path is given up
        finally:
            imp.kill()
            imp.wait()
