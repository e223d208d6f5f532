"""Calls their clients cancel mid-stream, against a `kdn serve` process with its default logging
(the access log on): reading the call's peer for the access-log line once the stream was
cancelled crashed the server (SIGSEGV in gRPC's core) within 1 to 11 cancelled Retrieve,
RetrieveMany or Export streams; `kdn admin export /dev/full` did it too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from kdn import keys
from kdn.client import Client
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import free_port
from tests.test_stopped_server import _wait_serving


def test_streams_cancelled_after_their_first_message_leave_the_server_serving(
        tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "KDN_LOG_LEVEL"}  # INFO: access log
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kdn", "serve", "--port", str(port),
                                 "--ram-bytes", "64MiB", "--disk-bytes", "0", "--data-port",
                                 "-1", "--data-dir", str(tmp_path / "data")],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_serving(address, proc)
        lay = uniform_layout(layers=4, heads=2, dim=16)
        ks = [keys.chunk_key([i], lay) for i in range(8)]
        with Client(address) as c:
            for k in ks:
                c.store(k, random_kv(lay, 32), layers_per_frame=1)  # a message per layer
        calls = [lambda kdn, _: kdn.Retrieve(pb.RetrieveRequest(key=ks[0])),
                 lambda kdn, _: kdn.RetrieveMany(pb.RetrieveManyRequest(keys=ks)),
                 lambda _, admin: admin.Export(pb.ExportRequest())]
        for i in range(24):
            with grpc.insecure_channel(address) as ch:
                call = calls[i % 3](pb_grpc.KDNStub(ch), pb_grpc.KDNAdminStub(ch))
                next(call)  # the first message, then the client goes
                call.cancel()
            assert proc.poll() is None, f"the server exited ({proc.returncode}) after {i + 1}"
        with Client(address) as c:
            assert c.health() == "SERVING" and c.fetch(ks[0]) is not None
        assert proc.poll() is None
        assert b'"code": "CANCELLED"' in (tmp_path / "server.log").read_bytes()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
