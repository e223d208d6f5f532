"""A streamed call that stops moving is ended after the server's ``idle_timeout_s`` (the
request interceptor, ``kdn.server.observe``): a read whose client stops reading held what it
read (a disk entry's copy, a RetrieveMany's run: hundreds of MB a stream) for as long as the
client liked, and gRPC's idle timeout counts only connections with no stream open; a write
whose client stops sending held what it had sent. Each now ends DEADLINE_EXCEEDED, naming
why, and stores nothing; a slow but moving call is not ended. A unary call whose request
message never comes whole is ended too (gRPC read it with no bound, the connection held), and
for the open services (health, reflection: no key needed) sooner, and only small requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kdn import codec
from kdn.client import Client
from kdn.keys import store_key
from kdn.server import ServerConfig, ServerThread
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import numbered_key, random_kv, uniform_layout

LAY = uniform_layout(layers=8, heads=8, dim=128)


@pytest.fixture
def quick(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, idle_timeout_s=1.0)
    with ServerThread(cfg) as st:
        yield st


def _stub(st: ServerThread) -> tuple[grpc.Channel, pb_grpc.KDNStub]:
    ch = grpc.insecure_channel(st.address, options=[  # windows that do not grow: a client
        ("grpc.max_receive_message_length", 256 << 20), ("grpc.http2.bdp_probe", 0)])  # that
    # stops reading stops the sending (a grown one took in a whole test entry unread)
    return ch, pb_grpc.KDNStub(ch)


def test_a_read_its_client_stopped_reading_is_ended(quick: ServerThread) -> None:
    with Client(quick.address) as c:
        c.store(numbered_key(1), random_kv(LAY, 4096), mode="raw")  # 64 MiB, many messages
    for rpc, request in (("Retrieve", pb.RetrieveRequest(key=numbered_key(1))),
                         ("RetrieveMany", pb.RetrieveManyRequest(keys=[numbered_key(1)] * 4))):
        ch, stub = _stub(quick)
        with ch:
            call = getattr(stub, rpc)(request)
            next(call)
            time.sleep(1.6)  # reads nothing (the connection is let go 1 s after: idle)
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            # ended by the stream's own deadline, or, on a busy host, by the connection's
            # idle limit that the same 1 s passed first: either way the server let it go
            details = err.value.details() or ""
            if err.value.code() == grpc.StatusCode.UNAVAILABLE:
                assert "idle" in details, (rpc, details)
                continue
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, rpc
            assert f"{rpc}: the client took no message for 1 s" in details


def test_a_write_its_client_stopped_sending_is_ended_and_stores_nothing(
        quick: ServerThread) -> None:
    parts = codec.encode_parts(random_kv(LAY, 256), "raw", layers_per_frame=1)
    head = pb.StoreRequest(header=pb.StoreHeader(
        key=numbered_key(2), container_header=parts.header,
        total_bytes=len(parts.header) + sum(len(f) for f in parts.frames)))
    go_on = threading.Event()

    def requests() -> Iterator[pb.StoreRequest]:
        yield head
        yield pb.StoreRequest.FromString(frame_message(0, parts.frames[0]))
        go_on.wait(10)  # stops sending, the call left open

    ch, stub = _stub(quick)
    with ch:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            stub.Store(requests(), timeout=30)
        go_on.set()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no message came for 1 s" in (err.value.details() or "")
        assert time.perf_counter() - t0 < 5
    with Client(quick.address) as c:
        assert not c.lookup([numbered_key(2)]).infos[0].present


def _silent(stop: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until ``stop``: the call's headers only."""
    stop.wait(20)
    yield from ()


def _never_sent(st: ServerThread, method: str) -> grpc.RpcError:
    """A unary ``method`` called with its headers only (as a stream that sends nothing): the
    error it ends with."""
    stop = threading.Event()
    ch = grpc.insecure_channel(st.address)
    with ch:
        call = ch.stream_unary(method)
        try:
            with pytest.raises(grpc.RpcError) as err:
                call(_silent(stop), timeout=20)
        finally:
            stop.set()
    return err.value


def test_a_unary_call_whose_request_never_comes_is_ended(quick: ServerThread) -> None:
    t0 = time.perf_counter()
    err = _never_sent(quick, "/kdn.v1.KDN/Lookup")
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "Lookup: its request message did not come whole within 1 s" in (err.details() or "")
    assert time.perf_counter() - t0 < 5
    with Client(quick.address) as c:  # and calls that send theirs are served as before
        assert not c.lookup([numbered_key(1)]).infos[0].present


def test_the_open_services_take_small_requests_that_come_soon(tmp_path: Path) -> None:
    """Keyless callers of the health service (auth on) are ended after handshake_timeout_s,
    not idle_timeout_s, and a request over a few KiB is refused."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text('tenants:\n  team-a: {api_keys: ["key-a"]}\n')
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth),
                       idle_timeout_s=300, handshake_timeout_s=1)
    with ServerThread(cfg) as st:
        t0 = time.perf_counter()
        err = _never_sent(st, "/grpc.health.v1.Health/Check")
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - t0 < 5
        ch = grpc.insecure_channel(st.address)
        with ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check",
                                   request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                   response_deserializer=health_pb2.HealthCheckResponse.FromString)
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == 1  # SERVING
            with pytest.raises(grpc.RpcError) as big:
                check(health_pb2.HealthCheckRequest(service="s" * (16 << 10)), timeout=10)
            assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is over the 8192 this service takes" in (big.value.details() or "")


def test_a_slow_but_moving_read_is_not_ended(quick: ServerThread) -> None:
    with Client(quick.address) as c:
        c.store(numbered_key(3), random_kv(LAY, 512), mode="raw")  # 8 MiB, a message a frame
    ch, stub = _stub(quick)
    with ch:
        got = 0
        for _msg in stub.Retrieve(pb.RetrieveRequest(key=numbered_key(3)), timeout=30):
            got += 1
            time.sleep(0.4)  # slower than a fast client, faster than the bound
        assert got > 3


def test_writes_being_received_hold_a_bounded_amount_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Store that declares its bytes counts them while they arrive: past the server's
    ``max_receiving`` (its RAM budget, or one entry of its largest size) a new one is refused at its
    header, RESOURCE_EXHAUSTED, until those in flight are in (each passed its own quota
    check: six stopped Stores held six times the quota)."""
    parts = codec.encode_parts(random_kv(LAY, 128), "raw", layers_per_frame=1)  # 4 MiB
    total = len(parts.header) + sum(len(f) for f in parts.frames)

    def stream(key: bytes, stop: threading.Event | None) -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(key=key, container_header=parts.header,
                                                    total_bytes=total))
        for i, frame in enumerate(parts.frames):
            yield pb.StoreRequest.FromString(frame_message(i, frame))
            if stop is not None and i == 0:
                stop.wait(20)  # the rest only once told

    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=64 << 20, ram_bytes=6 << 20,
                       max_entry_bytes=5 << 20)
    with ServerThread(cfg) as st:
        ch, stub = _stub(st)
        with ch:
            stop = threading.Event()
            slow = stub.Store.future(stream(numbered_key(4), stop), timeout=30)
            time.sleep(0.5)  # its header is in: its bytes are counted
            with pytest.raises(grpc.RpcError) as err:
                stub.Store(stream(numbered_key(5), None), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the server is receiving" in (err.value.details() or "")
            stop.set()
            slow.result(30)
            stub.Store(stream(numbered_key(5), None), timeout=30)  # room again
        with Client(st.address) as c:
            assert all(i.present for i in c.lookup([numbered_key(4), numbered_key(5)]).infos)


def test_an_import_counts_the_pieces_it_holds(tmp_path: Path) -> None:
    """An Import joins a value's pieces before it checks it: those pieces count as bytes
    being received (a slow Import held up to max_entry_bytes a stream, counted nowhere), so
    a Store past the budget meanwhile is refused, and they are let go with the value."""
    parts = codec.encode_parts(random_kv(LAY, 128), "raw", layers_per_frame=1)  # 4 MiB
    value = parts.to_bytes()
    go_on = threading.Event()

    def pieces() -> Iterator[pb.ImportItem]:
        half = len(value) // 2
        yield pb.ImportItem(key=numbered_key(6), value=value[:half], more=True)
        go_on.wait(20)
        yield pb.ImportItem(key=numbered_key(6), value=value[half:], offset=half)

    def store(key: bytes) -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(key=key, container_header=parts.header,
                                                    total_bytes=len(value)))
        for i, frame in enumerate(parts.frames):
            yield pb.StoreRequest.FromString(frame_message(i, frame))

    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=64 << 20, ram_bytes=5 << 20,
                       max_entry_bytes=5 << 20)
    with ServerThread(cfg) as st:
        ch, stub = _stub(st)
        with ch:
            imported = pb_grpc.KDNAdminStub(ch).Import.future(pieces(), timeout=30)
            time.sleep(0.5)  # its first half is in: 2 MiB held
            with pytest.raises(grpc.RpcError) as err:
                stub.Store(store(numbered_key(7)), timeout=30)  # 4 MiB more: past 5 MiB
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            go_on.set()
            assert imported.result(30).imported == 1
            stub.Store(store(numbered_key(7)), timeout=30)  # the pieces were let go


def _entry_stream(key: bytes, parts: codec.EncodedParts, declared: int,
                  stop: threading.Event | None = None, at: int = 0) -> Iterator[pb.StoreRequest]:
    """A Store stream's messages for ``parts`` declaring ``declared`` bytes; with ``stop``,
    it waits for it before frame ``at``."""
    yield pb.StoreRequest(header=pb.StoreHeader(key=key, container_header=parts.header,
                                                total_bytes=declared))
    for i, frame in enumerate(parts.frames):
        if stop is not None and i == at:
            stop.wait(20)
        yield pb.StoreRequest.FromString(frame_message(i, frame))


def _held_then_refused(tmp_path: Path, slow_call: str,
                       slow: Iterator[pb.StoreRequest], stop: threading.Event) -> int:
    """Start ``slow_call`` with ``slow`` (it stops sending at ``stop``), check that a declared
    4 MiB Store is refused meanwhile past a 6 MiB bound, then let it end: the entries stored
    by it."""
    parts = codec.encode_parts(random_kv(LAY, 128), "raw", layers_per_frame=1)  # 4 MiB
    total = len(parts.header) + sum(len(f) for f in parts.frames)
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=64 << 20, ram_bytes=6 << 20,
                       max_entry_bytes=5 << 20)
    with ServerThread(cfg) as st:
        ch, stub = _stub(st)
        with ch:
            held = getattr(stub, slow_call).future(slow, timeout=30)
            time.sleep(0.5)  # what it sent is in, and counted
            with pytest.raises(grpc.RpcError) as err:
                stub.Store(_entry_stream(numbered_key(8), parts, total), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the server is receiving" in (err.value.details() or "")
            stop.set()
            answer = held.result(30)
            stub.Store(_entry_stream(numbered_key(8), parts, total), timeout=30)  # room again
    return len(answer.results) if slow_call == "StoreMany" else 1


def test_a_store_declaring_too_few_bytes_counts_its_frames_as_they_arrive(
        tmp_path: Path) -> None:
    """A Store that declares under 1 MiB (here 0) may still send up to max_entry_bytes: its
    frames count as bytes being received as they arrive (four such stopped Stores held 14 MiB
    against a 6 MiB bound, counted as nothing)."""
    parts = codec.encode_parts(random_kv(LAY, 128), "raw", layers_per_frame=1)  # 4 MiB
    stop = threading.Event()
    _held_then_refused(tmp_path, "Store", _entry_stream(numbered_key(9), parts, 0, stop, 7),
                       stop)  # 3.5 MiB sent, then it waits


def test_a_store_many_counts_its_received_entries_until_they_are_stored(
        tmp_path: Path) -> None:
    """A StoreMany's entries stay in memory until all are in and committed: they count as
    bytes being received until then, not only while each one's own frames arrive."""
    parts = codec.encode_parts(random_kv(LAY, 32), "raw", layers_per_frame=1)  # 1 MiB
    total = len(parts.header) + sum(len(f) for f in parts.frames)
    stop = threading.Event()

    def many() -> Iterator[pb.StoreRequest]:
        for j in range(4):
            yield from _entry_stream(numbered_key(20 + j), parts, total)
        stop.wait(20)  # four whole entries in, then it waits

    assert _held_then_refused(tmp_path, "StoreMany", many(), stop) == 4



def _sending_goes_to_zero(st: ServerThread) -> None:
    sending = st.server.servicer.sending
    for _ in range(100):
        if sending.nbytes == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{sending.nbytes} bytes still counted as being sent")


def test_reads_being_sent_hold_a_bounded_amount_of_lower_tier_copies(tmp_path: Path) -> None:
    """A read from disk is a copy of its own for each reader, held until its answer is sent:
    stalled readers held one each (24 of a 32 MiB entry: 0.9 GiB on a 64 MiB server). Past
    the bound of writes being received (the RAM budget or one max_entry_bytes)
    of such copies a Retrieve is refused, RESOURCE_EXHAUSTED, naming why, and
    a GetMany answers the entry unwritten (asked again); one answer is always let in, a RAM
    hit is never refused, and the count goes back to 0 with the streams."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=256 << 20, ram_bytes=8 << 20,
                       max_entry_bytes=4 << 20, data_port=-1)
    keys = [numbered_key(10 + i) for i in range(4)]
    with ServerThread(cfg) as st:
        with Client(st.address) as c:
            for k in keys:
                c.store(k, random_kv(LAY, 96), mode="raw")  # 3 MiB each, 8 frames
            c.store(numbered_key(20), random_kv(LAY, 8), mode="raw")  # small: stays in RAM
        ram = st.server.servicer.store.tiers[0]
        ram.delete(store_key("", "default", keys[0]))  # only on disk
        ram.delete(store_key("", "default", keys[1]))
        sending = st.server.servicer.sending
        ch, stub = _stub(st)
        with ch:
            first = stub.Retrieve(pb.RetrieveRequest(key=keys[0]), timeout=30)
            assert next(first).header.tier == "disk"  # stalled after its header
            second = stub.RetrieveMany(pb.RetrieveManyRequest(keys=[keys[1]]), timeout=30)
            assert next(second).header.tier == "disk"
            assert sending.nbytes > 6 << 20
            ram.delete(store_key("", "default", keys[0]))  # on disk only (read: promoted)
            with pytest.raises(grpc.RpcError) as err:
                next(stub.Retrieve(pb.RetrieveRequest(key=keys[0])))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the server is sending" in (err.value.details() or "")
            ram.delete(store_key("", "default", keys[0]))
            ref = stub.GetMany(pb.GetManyRequest(keys=[keys[0]])).entries[0]
            assert ref.present and not ref.written  # the client asks again (or streams it)
            hot = stub.Retrieve(pb.RetrieveRequest(key=numbered_key(20)), timeout=30)
            assert next(hot).header.tier == "ram"  # a RAM hit: nothing counted, let in
            hot.cancel()
            first.cancel()
            second.cancel()
            _sending_goes_to_zero(st)
            assert len(list(stub.Retrieve(pb.RetrieveRequest(key=keys[0]), timeout=30))) > 1
        with Client(st.address) as c:
            assert all(kv is not None for kv in c.fetch_many(keys))  # one after another
        _sending_goes_to_zero(st)
