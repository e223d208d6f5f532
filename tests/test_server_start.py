"""Start-up truths: a port another process holds is refused (no silent SO_REUSEPORT split),
gRPC server reflection lets a generic client list and call the services, and a ServerThread
that stopped (or did not start) leaves none of its event loop behind."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory

from kdn import keys
from kdn.client import Client
from kdn.errors import InUse, TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import eventually, random_kv, uniform_layout

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_server_on_a_held_port_is_refused(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a")) as first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match=f"can not listen on 127.0.0.1:{port}: is another"):
            with ServerThread(ServerConfig(port=port, data_dir=tmp_path / "b")):
                pass
        run = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", str(port),
                              "--data-dir", str(tmp_path / "c")], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 1, run.stderr
        assert f"can not listen on 127.0.0.1:{port}" in run.stderr
        assert "Traceback" not in run.stderr
        with Client(first.address) as c:  # the first server still answers everything
            assert c.health() == "SERVING"


def test_a_second_server_on_a_held_data_dir_is_refused(tmp_path: Path) -> None:
    """Two servers on one data_dir shared its LMDB environment: the second's map growth made
    the first's reads fail MDB_MAP_RESIZED, its disk tier went down and its queued writes
    were dropped (166 of 300 stored entries lost). The second is refused at start, in code
    and as ``kdn serve`` (one line naming the folder and the holder's pid, exit 1); the
    first keeps serving every entry; once it stops, the folder opens again with them."""
    lay = uniform_layout(layers=2, heads=2, dim=8)
    entries = {keys.chunk_key([i], lay): random_kv(lay, 4, seed=i) for i in range(20)}
    data = tmp_path / "data"
    with ServerThread(ServerConfig(port=0, data_dir=data, disk_bytes=64 << 20)) as first:
        with Client(first.address) as c:
            for key, kv in entries.items():
                c.store(key, kv)
        second = subprocess.Popen([sys.executable, "-m", "kdn", "serve", "--port", "0",
                                   "--data-port", "-1", "--data-dir", str(data)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        try:
            _, err = second.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            second.kill()
            raise AssertionError("a second kdn serve on the data_dir started") from None
        assert second.returncode == 1, err
        assert err.startswith(f"kdn serve: data_dir {data}: "), err
        assert f"pid {os.getpid()}" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
        with pytest.raises(InUse, match=rf"data_dir {data}: .* \(pid {os.getpid()} holds "):
            with ServerThread(ServerConfig(port=0, data_dir=data, disk_bytes=64 << 20)):
                pass
        with Client(first.address) as c:  # the first server still holds and serves them all
            assert c.health() == "SERVING"
            for key, kv in entries.items():
                back = c.retrieve(key, layout=lay)
                assert back is not None and back.equal(kv)
    with ServerThread(ServerConfig(port=0, data_dir=data, disk_bytes=64 << 20)) as again:
        with Client(again.address) as c:  # from the disk tier: a new server's RAM is empty
            for key, kv in entries.items():
                back = c.retrieve(key, layout=lay)
                assert back is not None and back.equal(kv)


@pytest.mark.parametrize("host,says", [
    ("999.1.1.1", "the host '999.1.1.1' does not resolve"),
    ("192.0.2.1", "192.0.2.1 is not an address of this machine"),  # TEST-NET-1
])
def test_a_host_that_can_not_be_bound_is_named(tmp_path: Path, host: str, says: str) -> None:
    """A host that does not resolve, or is no address of this machine, was reported as "is
    another process (another kdn serve?) on that port?"."""
    cfg = ServerConfig(host=host, port=0, data_port=-1, data_dir=tmp_path / "d", disk_bytes=0)
    with pytest.raises(OSError, match=re.escape(f"can not listen on {host}:0: {says}")):
        with ServerThread(cfg):
            pass


def test_an_entry_larger_than_every_tier_is_too_large_not_internal(tmp_path: Path) -> None:
    """``--ram-bytes 1 --disk-bytes 0``: every store failed INTERNAL "no tier accepted the
    entry"; the entry is too large for the tiers (RESOURCE_EXHAUSTED), and the error says so."""
    lay = uniform_layout(layers=2, heads=2, dim=8)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=1, disk_bytes=0)
    with ServerThread(cfg) as server, Client(server.address) as c:
        with pytest.raises(TooLarge, match="RESOURCE_EXHAUSTED: no tier accepted the entry: it "
                                           "is larger than each takes .*1-byte budget"):
            c.store(keys.chunk_key([1], lay), random_kv(lay, 4))


def test_reuse_port_shares_a_port_when_asked(tmp_path: Path) -> None:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a", reuse_port=True)) as one:
        port = int(one.address.rsplit(":", 1)[1])
        with ServerThread(ServerConfig(port=port, data_dir=tmp_path / "b", reuse_port=True)):
            pass


def test_reuse_port_on_a_port_held_unshared_says_so(tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """``reuse_port`` on a port another process holds without SO_REUSEPORT: the error says the
    port is not shared (it advised to "set reuse_port", which was set), found before gRPC's own
    attempt (whose native add_port.cc line came first)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = ServerConfig(port=port, data_port=-1, data_dir=tmp_path / "d", disk_bytes=0,
                           reuse_port=True)
        with pytest.raises(OSError, match="does not share it") as info:
            with ServerThread(cfg):
                pass
    assert "set reuse_port" not in str(info.value)
    assert "add_port" not in capfd.readouterr().err


def test_a_ram_budget_past_the_hosts_memory_is_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``ram_bytes`` (with the wire memo and a read arena) more than the host's memory (or its
    cgroup's limit) is said at start, as a disk budget past its filesystem is (it was taken
    silently: the kernel, not an eviction, bounded it); one that fits says nothing."""
    from kdn.server.app import build_store, host_memory

    memory = host_memory()
    if memory is None:
        pytest.skip("this host does not say its memory")
    for ram, said in ((memory * 2, True), (64 << 20, False)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            build_store(ServerConfig(data_dir=tmp_path / "d", ram_bytes=ram,
                                     disk_bytes=0)).close()
        warned = [r.getMessage() for r in caplog.records if "ram_bytes" in r.getMessage()]
        assert bool(warned) is said, warned
        assert not said or "more than this host's memory" in warned[0]


def test_reflection_lists_and_calls_the_services(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    lay = uniform_layout(layers=2, heads=2, dim=8)
    key = keys.chunk_key([1, 2], lay)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as server:
        with Client(server.address) as c:
            c.store(key, random_kv(lay, 4))
        with grpc.insecure_channel(server.address) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            services = set(db.get_services())
            assert {"kdn.v1.KDN", "kdn.v1.KDNAdmin", "grpc.health.v1.Health"} <= services
            # as grpcurl does: descriptors from the server, a call built from them alone
            pool = descriptor_pool.DescriptorPool(db)
            method = pool.FindServiceByName("kdn.v1.KDN").methods_by_name["Lookup"]
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            call = ch.unary_unary("/kdn.v1.KDN/Lookup",
                                  request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=response_cls.FromString)
            answer = call(request_cls(keys=[key, bytes(32)]), timeout=10)
            assert [i.present for i in answer.infos] == [True, False]


def test_health_watch_streams_through_the_interceptor(tmp_path: Path) -> None:
    """grpc's health Watch answers with ``context.write`` (a coroutine, not an async
    generator): the request interceptor must pass it through, not fail it as UNKNOWN."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as server:
        with grpc.insecure_channel(server.address) as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="kdn.v1.KDN"), timeout=10)
            first = next(stream)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            stream.cancel()


def test_a_stopped_server_thread_leaves_no_thread_behind(tmp_path: Path) -> None:
    def one(i: int) -> None:
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / str(i))) as s, \
                Client(s.address, shm_bytes=0) as c:
            assert c.health() == "SERVING"

    def loops() -> set[threading.Thread]:  # the threads of event loops' to_thread calls
        return {t for t in threading.enumerate() if t.name.startswith("asyncio_")}

    one(0)
    threads = loops()  # may still end (one(0)'s own, or an earlier test's): not a leak
    for i in range(1, 4):
        one(i)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a")) as held:
        port = int(held.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="can not listen"):
            ServerThread(ServerConfig(port=port, data_dir=tmp_path / "b")).start()
    # a loop not closed keeps that thread, and its selector's descriptors, for good
    assert eventually(lambda: loops() <= threads), loops() - threads
