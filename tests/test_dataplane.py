"""Batches and the same-host data plane (kdn.server.batch, kdn.client.dataplane, kdn.client.shm)
against a real server on loopback: round trips through the shared segment and inline, the
fallbacks, hostile descriptors and segments, tenancy, and reads racing overwrites."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from kdn import codec
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.shm import RegionAllocator, SharedSegment
from kdn.errors import InvalidArgument, NotFound, TooLarge
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import (
    count_staging_copies,
    pruned_layout,
    random_kv,
    read_while_churned,
    uniform_layout,
    without_directory,
)

LAYOUT = uniform_layout()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def server_config(server_config: ServerConfig, request: pytest.FixtureRequest) -> ServerConfig:
    """Marked ``no_arena``: the server keeps no read arenas, so same-host reads are copied into
    the client's segment (the path of entries outside the RAM tier and of a full arena;
    kdn.server.arena)."""
    if request.node.get_closest_marker("no_arena"):
        return dataclasses.replace(server_config, shm_arena_bytes=0)
    return server_config


@pytest.fixture
def shm_client(server: ServerThread) -> Iterator[Client]:
    c = Client(server.address, timeout_s=30, shm_bytes=8 << 20)
    yield c
    c.close()


def test_region_allocator_reuses_and_merges() -> None:
    regions = RegionAllocator(16, 1024)
    a, b, c = regions.alloc(100), regions.alloc(100), regions.alloc(100)
    assert (a, b, c) == (64, 192, 320)  # 64-byte aligned, after the nonce
    regions.free(b, 100)
    assert regions.alloc(200) == 448  # b's hole is too small
    regions.free(a, 100)
    regions.free(c, 100)
    assert regions.alloc(380) == 64  # a, b and c merged back into one range
    assert regions.alloc_largest(10_000) == (448 + 256, 1024 - 448 - 256)
    assert regions.alloc(1) is None


def test_store_and_retrieve_through_the_segment(shm_client: Client) -> None:
    kv = random_kv(LAYOUT, 40, seed=1)
    shm_client.store(_key(1), kv, mode="raw")
    assert shm_client.dataplane.attached
    assert shm_client.retrieve(_key(1), layout=LAYOUT).equal(kv)  # type: ignore[union-attr]
    stream = shm_client.retrieve_stream(_key(1))
    assert stream is not None and stream.tier == "ram"
    assert torch_equal(stream.wait_for_layer(2), kv.layers[2])
    got = shm_client.fetch(_key(1))
    assert got is not None and codec.decode(got.parts.to_bytes()).equal(kv)
    assert shm_client.retrieve(_key(2)) is None and shm_client.fetch(_key(2)) is None
    counters = shm_client.stats().counters  # the second fetch: from the kept lease
    reused = shm_client.dataplane.same_host.arena.reused
    assert counters["getmany.hit"] + reused >= 3 and counters.get("retrieve.hit", 0) == 0
    seg = shm_client.dataplane.segment()[0]
    del stream, got
    assert seg.regions.free_bytes() == seg.size - 64  # every region given back


def torch_equal(a: tuple, b: tuple) -> bool:
    return bool((a[0] == b[0]).all() and (a[1] == b[1]).all())


@pytest.mark.parametrize(("shm", "net"), [(8 << 20, True), (0, True), (0, False)],
                         ids=["segment", "data-path", "inline"])
def test_many_entries_per_call(server: ServerThread, shm: int, net: bool) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=shm, data_path=net) as c:
        items = [(_key(i), random_kv(pruned_layout(), 16 + i, seed=i)) for i in range(24)]
        results = c.store_many(items, mode="lossless")
        assert [r.stored_bytes > 0 for r in results] == [True] * 24
        keys = [k for k, _ in items] + [_key(999)]
        got = c.retrieve_many(keys, layout=pruned_layout())
        assert got[-1] is None
        assert all(g is not None and g.equal(kv) for g, (_, kv) in zip(got, items))
        assert c.dataplane.attached == bool(shm)
        counters = c.stats().counters
        batch = "getmany" if shm or net else "retrievemany"  # gRPC: one grouped RetrieveMany
        assert counters[f"{batch}.hit"] == 24 and counters[f"{batch}.miss"] == 1


@pytest.mark.no_arena
def test_entries_larger_than_the_segment_stream_instead(server: ServerThread) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=64 << 10) as c:
        small, big = random_kv(LAYOUT, 8, seed=2), random_kv(LAYOUT, 400, seed=3)
        assert codec.encode_parts(big, "raw").nbytes > 64 << 10
        c.store_many([(_key(3), small), (_key(4), big)], mode="raw")
        assert c.dataplane.attached
        got = c.retrieve_many([_key(3), _key(4)])
        assert got[0].equal(small) and got[1].equal(big)  # type: ignore[union-attr]
        many = [(_key(100 + i), random_kv(LAYOUT, 40, seed=i)) for i in range(12)]
        c.store_many(many, mode="raw")  # more than the segment holds at once: several calls
        assert all(g.equal(kv) for g, (_, kv) in  # type: ignore[union-attr]
                   zip(c.retrieve_many([k for k, _ in many]), many))
        assert c.stats().counters["retrieve.hit"] >= 1  # the big one came by stream


def _stub(server: ServerThread) -> tuple[grpc.Channel, pb_grpc.KDNStub]:
    ch = grpc.insecure_channel(server.address)
    return ch, pb_grpc.KDNStub(ch)


def test_attach_refuses_what_is_not_the_clients_sealed_segment(server: ServerThread) -> None:
    seg = SharedSegment(1 << 20)
    ch, stub = _stub(server)
    good = pb.AttachRequest(pid=os.getpid(), fd=seg.fd, size=seg.size, nonce=seg.nonce)
    cases = {
        "nonce differs": pb.AttachRequest(pid=os.getpid(), fd=seg.fd, size=seg.size,
                                          nonce=secrets.token_bytes(16)),
        "has 1048576 bytes": pb.AttachRequest(pid=os.getpid(), fd=seg.fd, size=4096,
                                              nonce=seg.nonce),
        "can not open": pb.AttachRequest(pid=os.getpid(), fd=9999, size=seg.size,
                                         nonce=seg.nonce),
    }
    for match, req in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Attach(req)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert match in (err.value.details() or "")
    unsealed = os.memfd_create("kdn-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 1 << 20)
    os.pwrite(unsealed, seg.nonce, 0)
    with pytest.raises(grpc.RpcError, match="not sealed"):
        stub.Attach(pb.AttachRequest(pid=os.getpid(), fd=unsealed, size=1 << 20,
                                     nonce=seg.nonce))
    assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    seg_id = stub.Attach(good).segment_id
    # descriptors outside the segment, or into the nonce, are refused
    for offset, length in ((0, 100), (seg.size - 10, 100), (1 << 40, 1)):
        with pytest.raises(grpc.RpcError) as err:
            stub.GetMany(pb.GetManyRequest(keys=[_key(1)], segment_id=seg_id,
                                           region=pb.Region(offset=offset, length=length)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Detach(pb.DetachRequest(segment_id=seg_id))
    with pytest.raises(grpc.RpcError) as err:
        stub.Detach(pb.DetachRequest(segment_id=seg_id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()
    os.close(unsealed)
    seg.close()


def test_a_bad_item_stores_nothing_of_its_batch(shm_client: Client) -> None:
    old = random_kv(LAYOUT, 10, seed=5)
    shm_client.store(_key(5), old)
    seg, seg_id = shm_client.dataplane.segment()
    good = codec.encode_parts(random_kv(LAYOUT, 10, seed=6), "raw").to_bytes()
    bad = bytearray(codec.encode_parts(random_kv(LAYOUT, 10, seed=7), "raw").to_bytes())
    bad[-3] ^= 0xFF  # a flipped byte in the last frame
    seg.write(4096, good)
    seg.write(65536, bytes(bad))
    req = pb.PutManyRequest(segment_id=seg_id, items=[
        pb.PutItem(key=_key(6), region=pb.Region(offset=4096, length=len(good))),
        pb.PutItem(key=_key(5), region=pb.Region(offset=65536, length=len(bad)))])
    ch, stub = _stub_of(shm_client)
    with pytest.raises(grpc.RpcError) as err:
        stub.PutMany(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 1" in (err.value.details() or "")
    assert shm_client.fetch(_key(6)) is None
    assert shm_client.retrieve(_key(5)).equal(old)  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="key must be 32 bytes"):
        shm_client.store_many([(b"short", old)])
    ch.close()


def test_bytearray_keys_are_stored_as_bytes_and_a_batch_that_fails_gives_its_region_back(
        server: ServerThread) -> None:
    """A bytearray key passed check_key, then failed in the data plane (TypeError) with its
    region of the segment kept: 50 such stores took 400 KB of a 1 MiB segment. Keys are the
    bytes check_key gives back, and a batch whose items fail to be made (here: a key the
    data plane is handed unchecked) frees its region, on every way a store goes."""
    c = Client(server.address, timeout_s=30, shm_bytes=64 << 20)
    try:
        kv = random_kv(LAYOUT, 16, seed=8)
        c.store(bytearray(_key(9)), kv)
        c.store_many([(bytearray(_key(10)), kv), (bytearray(_key(11)), kv)])
        c.store_async(bytearray(_key(12)), kv).result()
        assert all(i.present for i in c.lookup([_key(i) for i in (9, 10, 11, 12)]).infos)
        assert c.retrieve(bytearray(_key(9))).equal(kv)  # type: ignore[union-attr]
        with AdminClient(server.address, timeout_s=30) as admin:
            assert [e.key for e in admin.ls(key_prefix=bytearray(_key(9)))] == [_key(9)]
        seg = c.dataplane.segment()[0]
        free = seg.regions.free_bytes()
        opts = pb.StoreOptions()
        one = codec.encode_parts(kv, "lossless")
        big = codec.encode_parts(random_kv(LAYOUT, 4096, seed=9), "raw")  # 2 MiB each
        for items in ([(bytearray(_key(13)), one, opts)],  # one batch
                      [(_key(14), big, opts)] * 4 + [(bytearray(_key(13)), big, opts)]):
            with pytest.raises(TypeError):  # pipelined, past PIPE_BYTES
                c.dataplane.put_many("default", items, None)  # type: ignore[arg-type]
            assert seg.regions.free_bytes() == free
        with pytest.raises(TypeError):
            c.dataplane.put_async("default", bytearray(_key(13)), opts,  # type: ignore[arg-type]
                                  parts=one)
        assert seg.regions.free_bytes() == free
    finally:
        c.close()


def _stub_of(client: Client) -> tuple[grpc.Channel, pb_grpc.KDNStub]:
    ch = grpc.insecure_channel(client.address)
    return ch, pb_grpc.KDNStub(ch)


def test_segments_and_entries_stay_with_their_tenant(tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  a: {api_keys: [key-a]}\n  b: {api_keys: [key-b]}\n")
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth))
    with ServerThread(cfg) as st, \
            Client(st.address, api_key="key-a", shm_bytes=4 << 20) as a, \
            Client(st.address, api_key="key-b", shm_bytes=4 << 20) as b:
        kv = random_kv(LAYOUT, 12, seed=8)
        a.store_many([(_key(8), kv)])
        assert a.dataplane.attached and b.dataplane.attached
        assert b.fetch_many([_key(8)]) == [None]  # b's key space has no such entry
        assert a.retrieve_many([_key(8)])[0].equal(kv)  # type: ignore[union-attr]
        a_id = a.dataplane.segment()[1]
        ch = grpc.insecure_channel(st.address)
        stub = pb_grpc.KDNStub(ch)
        md = (("x-kdn-api-key", "key-b"),)
        with pytest.raises(grpc.RpcError) as err:  # b names a's segment
            stub.GetMany(pb.GetManyRequest(keys=[_key(8)], segment_id=a_id,
                                           region=pb.Region(offset=64, length=4096)),
                         metadata=md)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(NotFound):
            b.dataplane._call(lambda: stub.Detach(pb.DetachRequest(segment_id=a_id),
                                                  metadata=md))
        ch.close()


def test_reads_racing_overwrites_and_evictions_return_whole_entries(server: ServerThread
                                                                     ) -> None:
    versions = [random_kv(LAYOUT, 24, seed=s) for s in range(3)]
    with Client(server.address, timeout_s=30) as writer, \
            Client(server.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        writer.store(_key(9), versions[0], mode="raw")
        seen = read_while_churned(writer, reader, _key(9), versions, 1500, LAYOUT)
    assert len(set(seen)) >= 3  # the race really happened: several versions and misses seen


def test_limits_through_the_segment(tmp_path: Path) -> None:
    """Message limits are gRPC's and do not apply to the segment; max_entry_bytes does."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       max_message_bytes=64 << 10, max_entry_bytes=1 << 20)
    lay = uniform_layout(layers=2, heads=4, dim=64)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=8 << 20) as c:
        big = random_kv(lay, 200)  # 200 KiB per frame > 64 KiB per message
        c.store(_key(10), big, mode="raw")
        assert c.dataplane.attached and c.retrieve(_key(10)).equal(big)  # type: ignore[union-attr]
        huge = random_kv(uniform_layout(layers=40, heads=4, dim=64), 60)  # ~2.4 MiB entry
        with pytest.raises(TooLarge, match="max_entry_bytes"):
            c.store(_key(11), huge, mode="raw")
        assert c.fetch(_key(11)) is None


def test_same_host_addresses_and_a_server_that_is_not_there_yet(tmp_path: Path) -> None:
    from kdn.client import Retry
    from kdn.client.client import same_host
    from kdn.errors import Unavailable

    assert all(same_host(a) for a in ("127.0.0.1:5", "localhost:5", "[::1]:5", "unix:/x.sock"))
    assert not any(same_host(a) for a in ("10.0.0.7:5", "kdn.example:5", "[2001:db8::1]:5"))
    with Client("127.0.0.1:1", timeout_s=1, retry=Retry(retries=0)) as c:
        with pytest.raises(Unavailable):
            c.store(_key(12), random_kv(LAYOUT, 4))
        assert not c.dataplane.same_host._tried  # asks again once the server answers


def test_the_fast_path_serves_same_host_batches_and_refuses_strangers(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    without_directory(monkeypatch)  # its read is a call on the fast path
    import socket

    from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, read_exact

    with Client(server.address, shm_bytes=4 << 20, keep_leases_bytes=0) as c:  # every read
        kv = random_kv(LAYOUT, 12, seed=13)  # asks
        c.store(_key(13), kv)
        assert c.retrieve(_key(13)).equal(kv)  # type: ignore[union-attr]
        counters = c.stats().counters
        assert counters["fast.PutMany"] >= 1 and counters["fast.GetMany"] >= 1
        assert server.server is not None and server.server.fast_path is not None
        name = server.server.fast_path.name

        def ask(op: int, body: bytes) -> tuple[int, bytes]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect("\0" + name)
                s.sendall(FAST_HEAD.pack(len(body), op) + body)
                head = read_exact(s, FAST_HEAD.size)
                assert head is not None
                n, ok = FAST_HEAD.unpack(head)
                return ok, read_exact(s, n) or b""

        no_segment = pb.GetManyRequest(keys=[_key(13)]).SerializeToString()
        forged = pb.GetManyRequest(keys=[_key(13)], segment_id="0" * 32).SerializeToString()
        for op, body, status in ((FAST_GET_MANY, no_segment, "NOT_FOUND"),
                                 (FAST_GET_MANY, forged, "NOT_FOUND"),
                                 (FAST_GET_MANY, b"\xff\xff\xff", "INVALID_ARGUMENT"),
                                 (9, no_segment, "INVALID_ARGUMENT")):
            ok, out = ask(op, body)
            assert ok == 0 and out.startswith(status.encode())
        server.server.fast_path.close()  # the path goes away: calls fall back to gRPC
        assert c.retrieve(_key(13)).equal(kv)  # type: ignore[union-attr]
        assert c.stats().counters["getmany.hit"] >= 2


def test_sizes_are_checked_before_anything_is_copied_out_of_a_segment(server: ServerThread
                                                                      ) -> None:
    from kdn.server.batch import MAX_BATCH_BYTES

    cap = server.config.max_entry_bytes
    seg = SharedSegment(cap + (1 << 30))  # address space, untouched (sparse)
    ch, stub = _stub(server)
    seg_id = stub.Attach(pb.AttachRequest(pid=os.getpid(), fd=seg.fd, size=seg.size,
                                          nonce=seg.nonce)).segment_id
    gib = MAX_BATCH_BYTES // 2 + 1  # three of them: past the batch limit, each under the cap
    for items, match in (
            ([pb.PutItem(key=_key(16), region=pb.Region(offset=64, length=cap + 1))],
             "max_entry_bytes"),
            ([pb.PutItem(key=_key(16 + i), region=pb.Region(offset=64 + i * gib, length=gib))
              for i in range(3)], "at most")):
        with pytest.raises(grpc.RpcError) as err:
            stub.PutMany(pb.PutManyRequest(segment_id=seg_id, items=items))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert match in (err.value.details() or "")
    ch.close()
    seg.close()


def test_an_entry_larger_than_the_first_region_comes_in_a_second_call(server: ServerThread
                                                                      ) -> None:
    from kdn.client.dataplane import FIRST_REGION

    lay = uniform_layout(layers=2, heads=8, dim=64)
    with Client(server.address, shm_bytes=FIRST_REGION * 3) as c:
        big = random_kv(lay, FIRST_REGION // (2 * 8 * 64 * 2 * 2) + 512)  # > FIRST_REGION
        c.store(_key(20), big, mode="raw")
        before = c.stats().counters
        assert c.retrieve(_key(20)).equal(big)  # type: ignore[union-attr]
        after = c.stats().counters
        assert after["getmany.hit"] == before["getmany.hit"] + 1
        assert after.get("retrieve.hit", 0) == before.get("retrieve.hit", 0)  # no stream


def test_segments_of_clients_that_went_away_are_detached(server: ServerThread) -> None:
    import subprocess
    import sys

    code = ("import os, sys; from kdn.client import Client; from tests.helpers import "
            "random_kv, uniform_layout\n"
            f"c = Client({server.address!r}, shm_bytes=1 << 20)\n"
            "c.store(bytes(32), random_kv(uniform_layout(), 4))\n"
            "assert c.dataplane.attached\n"
            "os._exit(0)  # no close, no Detach\n")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
    assert server.server is not None
    segments = server.server.servicer.segments
    assert len(segments) == 1  # still mapped: nobody told the server
    with Client(server.address, shm_bytes=1 << 20) as c:
        c.store(_key(21), random_kv(LAYOUT, 4))  # attaching reaps the dead client's segment
        assert c.dataplane.attached and len(segments) == 1


def _in_segment(t: torch.Tensor, seg: SharedSegment) -> bool:
    base = seg.array.ctypes.data
    return base <= t.data_ptr() < base + seg.size


@pytest.mark.no_arena
def test_reads_through_the_segment_are_checked_by_the_server_and_viewed_in_place(
        shm_client: Client) -> None:
    kv = random_kv(LAYOUT, 160, seed=3)  # 80 KiB: larger ones than SMALL_ENTRY_BYTES come so
    shm_client.store(_key(20), kv, mode="raw")
    seg = shm_client.dataplane.segment()[0]
    got = shm_client.fetch(_key(20))
    assert got is not None and got.owned and got.checked  # the server hashed what it wrote
    frame0 = np.frombuffer(got.parts.frames[0], dtype=np.uint8)
    assert frame0.ctypes.data % 64 == 0  # first frame aligned: raw bodies can be viewed
    del got, frame0
    back = shm_client.retrieve(_key(20), layout=LAYOUT)
    assert back is not None and back.equal(kv)
    assert all(_in_segment(k, seg) and _in_segment(v, seg) for k, v in back.layers)  # no copy
    back.layers[0][0].zero_()  # the caller's own bytes: the next read is not affected
    again = shm_client.retrieve(_key(20), layout=LAYOUT)
    assert again is not None and again.equal(kv)
    assert seg.regions.free_bytes() < seg.size - 64  # the regions live while the tensors do
    del back, again
    assert seg.regions.free_bytes() == seg.size - 64
    lossless = random_kv(LAYOUT, 40, seed=4)  # a mode that decodes: fresh tensors
    shm_client.store(_key(21), lossless, mode="lossless")
    dec = shm_client.retrieve(_key(21), layout=LAYOUT)
    assert dec is not None and dec.equal(lossless)
    assert not any(_in_segment(k, seg) for k, _ in dec.layers)


@pytest.mark.parametrize("split", [False, True], ids=["one-run", "runs"])
@pytest.mark.no_arena
def test_damage_to_a_checked_value_in_server_memory_is_caught_by_the_segment_copy(
        server: ServerThread, shm_client: Client, monkeypatch: pytest.MonkeyPatch,
        split: bool) -> None:
    if split:  # every entry large enough to be copied in runs of frames (PutMany and GetMany)
        import kdn.codec.copies as copies

        monkeypatch.setattr(copies, "PARALLEL_COPY_BYTES", 1)
    kv = random_kv(LAYOUT, 40, seed=5)
    shm_client.store(_key(22), kv, mode="raw", options=StoreOptions(durability=Durability.DISK),
                     layers_per_frame=1)  # frames to split
    assert shm_client.retrieve(_key(22), layout=LAYOUT) is not None  # RAM copy checked once
    assert server.server is not None
    store = server.server.store
    ram = next(t for t in store.tiers if t.name == "ram")
    skey = next(k for k in ram._data if k.endswith(_key(22).hex().encode()))  # noqa: SLF001
    bad = bytearray(ram._data[skey])  # noqa: SLF001
    bad[-100] ^= 0x10  # a flipped bit in a value already checked (same stamp: not re-hashed)
    ram._data[skey] = bytes(bad)  # noqa: SLF001
    back = shm_client.retrieve(_key(22), layout=LAYOUT)
    assert back is not None and back.equal(kv)  # the disk copy, checked on the second read
    counters = shm_client.stats().counters
    assert counters["getmany.corrupt"] == 1
    assert any("corrupt" in name and n for name, n in counters.items() if name != "getmany.corrupt")
    assert shm_client.retrieve(_key(22), layout=LAYOUT).equal(kv)  # type: ignore[union-attr]
    ram._data[skey] = bytes(bad)  # noqa: SLF001  # and with no sound copy left anywhere:
    for tier in store.tiers:
        if tier.name != "ram":
            tier.delete(skey)
    assert shm_client.retrieve(_key(22), layout=LAYOUT) is None  # a miss, not damaged tensors


@pytest.mark.no_arena
def test_a_batch_copied_on_several_threads_lands_whole_and_catches_damage(
        server: ServerThread, shm_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """GetMany's parallel segment copy (forced for small batches): every entry lands at its
    offset bit for bit, and a damaged RAM value among them is read again from disk; with no
    sound copy left it is a miss while the others still land."""
    from kdn.server import batch

    monkeypatch.setattr(batch, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(batch, "COPY_THREADS", 2)
    ks = [_key(60 + i) for i in range(6)]
    kvs = [random_kv(LAYOUT, 24 + 8 * i, seed=60 + i) for i in range(6)]
    for k, kv in zip(ks, kvs):
        shm_client.store(k, kv, mode="raw", options=StoreOptions(durability=Durability.DISK))
    got = shm_client.retrieve_many(ks, layout=LAYOUT)
    assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
    assert server.server is not None
    store = server.server.store
    ram = next(t for t in store.tiers if t.name == "ram")
    skey = next(k for k in ram._data if k.endswith(ks[3].hex().encode()))  # noqa: SLF001
    bad = bytearray(ram._data[skey])  # noqa: SLF001
    bad[-100] ^= 0x10
    ram._data[skey] = bytes(bad)  # noqa: SLF001
    before = shm_client.stats().counters.get("getmany.corrupt", 0)
    got = shm_client.retrieve_many(ks, layout=LAYOUT)
    assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))  # k3 from disk
    assert shm_client.stats().counters["getmany.corrupt"] == before + 1
    ram._data[skey] = bytes(bad)  # noqa: SLF001
    for tier in store.tiers:
        if tier.name != "ram":
            tier.delete(skey)
    got = shm_client.retrieve_many(ks, layout=LAYOUT)
    assert got[3] is None
    assert all(g is not None and g.equal(kv) for i, (g, kv) in enumerate(zip(got, kvs))
               if i != 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_retrieve_into_cuda_through_a_registered_segment(shm_client: Client,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 40, seed=8)
    shm_client.store(_key(23), kv, mode="raw")
    staged = count_staging_copies(monkeypatch)
    back = shm_client.retrieve(_key(23), layout=LAYOUT, device="cuda")
    assert back is not None and all(k.is_cuda for k, _ in back.layers)
    assert back.to("cpu").equal(kv)
    seg = shm_client.dataplane.segment()[0]
    assert seg.register_with_cuda()  # registered on the first CUDA read: views are pinned
    assert not staged  # copied to the device from the segment itself, no pinned staging copy


@pytest.mark.gpu
@pytest.mark.no_arena  # through the segment's regions
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_context_larger_than_the_segment_reaches_the_gpu_without_streams(
        server: ServerThread) -> None:
    """Bound for a GPU, many entries are read in groups whose regions go back once copied:
    ten entries of 800 KB through a 4 MiB segment, none streamed, every one whole."""
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 400, seed=50 + i) for i in range(10)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        for i, kv in enumerate(kvs):
            c.store(_key(50 + i), kv, mode="raw")
        before = dict(c.stats().counters).get("retrieve.hit", 0)
        streams = c.retrieve_streams([_key(50 + i) for i in range(10)], layout=lay,
                                     device="cuda")
        assert all(s is not None for s in streams)
        for s, kv in zip(streams, kvs):
            got = s.result()  # type: ignore[union-attr]
            assert got.layers[0][0].is_cuda and got.to("cpu").equal(kv)
        assert dict(c.stats().counters).get("retrieve.hit", 0) == before


def test_a_batch_larger_than_one_region_takes_few_calls(server: ServerThread,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.client import dataplane

    monkeypatch.setattr(dataplane, "FIRST_REGION", 1 << 20)
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 96, seed=i) for i in range(24)]  # ~200 KB each, ~4.7 MB in all
    with Client(server.address, timeout_s=30, shm_bytes=16 << 20) as c:
        c.store_many([(_key(40 + i), kv) for i, kv in enumerate(kvs)], mode="raw")
        calls = []
        real = c.dataplane._get
        monkeypatch.setattr(c.dataplane, "_get",
                            lambda req, rid: calls.append(len(req.keys)) or real(req, rid))
        got = c.retrieve_many([_key(40 + i) for i in range(24)], layout=lay)
        assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
        total = sum(kv.nbytes for kv in kvs)
        assert len(calls) <= total // (1 << 20) + 2, calls  # ~1 MiB per call, not one call
        assert len(calls) < len(kvs) // 3  # per entry left over


def test_layers_viewing_one_span_are_copied_as_one() -> None:
    """``one_span``: the layers of an entry viewed in place lie in one span of its bytes; a
    copy of the span rebuilt with each layer's offset and strides gives every layer back (what
    a GPU-bound hit does with one host-to-device copy). Tensors of other storages, dtypes or
    spans with wide gaps are refused."""
    from kdn.client.stream import one_span
    from kdn.codec import encode_parts, inplace
    from kdn.codec.format import parse_header

    lay = uniform_layout(layers=5, heads=2, dim=32)
    kv = random_kv(lay, 17, seed=3)
    parts = encode_parts(kv, "raw")
    got = inplace.copied(parse_header(parts.header), parts.to_bytes())
    assert got is not None
    flat = [t for pair in got for t in pair]
    found = one_span(flat)
    assert found is not None
    span, offsets = found
    copy = span.clone()  # stands for the device copy
    back = [copy.as_strided(t.shape, t.stride(), at) for t, at in zip(flat, offsets)]
    assert all(torch.equal(a, b) for a, b in zip(back, (t for p in kv.layers for t in p)))
    assert span.numel() * span.element_size() < 1.25 * kv.nbytes
    assert one_span([flat[0], flat[1].clone()]) is None  # another storage
    assert one_span([flat[0], flat[1].float()]) is None  # another dtype
    base = torch.zeros(10_000, dtype=torch.float16)
    assert one_span([base[:10], base[-10:]]) is None  # mostly gap
    assert one_span([]) is None
    assert one_span([base[:0], base[5:5]]) is None  # nothing to copy


def test_the_gpu_bound_batch_read_returns_every_entry_in_order(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """``retrieve_streams`` bound for a GPU (faked: its grouped path run into CPU tensors):
    in-process hits and server reads mixed, groups sized by the first entry, a miss, every
    entry back whole and in order."""
    from kdn.client import reads as client_mod

    monkeypatch.setattr(client_mod, "on_cuda", lambda device: True)
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 100 + 7 * i, seed=60 + i) for i in range(9)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20, local_bytes=1 << 20) as c:
        for i, kv in enumerate(kvs):
            c.store(_key(60 + i), kv, mode="raw")  # the tier keeps the last few (1 MiB)
        assert c.local is not None and 0 < c.local.stats.entries < len(kvs)
        hits = c.local.stats.hits
        keys = [_key(60 + i) for i in range(9)] + [_key(99)]
        streams = c.retrieve_streams(keys, layout=lay, device="cpu")
        assert streams[-1] is None and len(streams) == 10
        for s, kv in zip(streams, kvs):
            assert s is not None and s.result().equal(kv)
        assert c.local.stats.hits > hits  # some came from the tier, the rest from the server
