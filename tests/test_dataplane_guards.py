"""What the same-host data plane refuses or survives, against a real server on loopback:
segments that are not the client's sealed one, descriptors outside a segment, sizes past the
limits, strangers on the fast path, another tenant's segment, a batch with a bad item (nothing
of it stored, its region given back), clients that went away, and values damaged in server
memory (caught by the segment copy)."""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

import grpc
import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.shm import SharedSegment
from kdn.errors import InvalidArgument, NotFound
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, without_directory
from tests.test_dataplane import LAYOUT, _key


def _stub(server: ServerThread) -> tuple[grpc.Channel, pb_grpc.KDNStub]:
    ch = grpc.insecure_channel(server.address)
    return ch, pb_grpc.KDNStub(ch)


def _stub_of(client: Client) -> tuple[grpc.Channel, pb_grpc.KDNStub]:
    ch = grpc.insecure_channel(client.address)
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
    # a segment still being made, sealed and sized before its nonce was written, read as
    # zeros: the segment holds its nonce before it has its size, and zeros name none
    half_made = os.memfd_create("kdn-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(half_made, 1 << 20)
    fcntl.fcntl(half_made, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    with pytest.raises(grpc.RpcError, match="a nonce of zeros names no segment"):
        stub.Attach(pb.AttachRequest(pid=os.getpid(), fd=half_made, size=1 << 20,
                                     nonce=bytes(16)))
    assert os.pread(seg.fd, 16, 0) == seg.nonce
    os.close(half_made)
    unsealed = os.memfd_create("kdn-client", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 1 << 20)
    os.pwrite(unsealed, seg.nonce, 0)
    with pytest.raises(grpc.RpcError, match="not sealed"):
        stub.Attach(pb.AttachRequest(pid=os.getpid(), fd=unsealed, size=1 << 20,
                                     nonce=seg.nonce))
    fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # not all the client's
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


def test_attach_opens_only_a_kdn_client_memfd(server: ServerThread, tmp_path: Path) -> None:
    """pid, fd and nonce are the caller's word and the server opens the descriptor with its own
    rights: a memfd of another program (sealed, its first bytes known to the caller), a file,
    a pipe are refused before anything is mapped or written."""
    ch, stub = _stub(server)
    nonce = b"KNOWN-HEADER-v1!"
    other = os.memfd_create("wl_shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(other, 1 << 20)
    os.pwrite(other, nonce, 0)
    fcntl.fcntl(other, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    plain = tmp_path / "kdn-client"
    plain.write_bytes(nonce + bytes((1 << 20) - 16))
    fd = os.open(plain, os.O_RDWR)
    rd, wr = os.pipe()
    for target in (other, fd, rd):
        with pytest.raises(grpc.RpcError) as err:
            stub.Attach(pb.AttachRequest(pid=os.getpid(), fd=target, size=1 << 20,
                                         nonce=nonce))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not a kdn client segment" in (err.value.details() or "")
    assert os.pread(other, 32, 0) == nonce + bytes(16)
    ch.close()
    for each in (other, fd, rd, wr):
        os.close(each)


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
    # an empty region (a ValueError inside: UNKNOWN over gRPC, the fast path's connection
    # dropped with no answer) is refused naming the item, nothing of the batch stored
    req = pb.PutManyRequest(segment_id=seg_id, items=[
        pb.PutItem(key=_key(6), region=pb.Region(offset=4096, length=len(good))),
        pb.PutItem(key=_key(7), region=pb.Region(offset=4096, length=0))])
    with pytest.raises(grpc.RpcError) as err:
        stub.PutMany(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert "item 1: its region is empty" in details and details.count("item 1") == 1
    assert shm_client.fetch(_key(6)) is None
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
    # no Detach came: its segment goes when its fast-path connection closes (or, at the
    # latest, at the next Attach: reaped there), whichever the server sees first
    with Client(server.address, shm_bytes=1 << 20) as c:
        c.store(_key(21), random_kv(LAYOUT, 4))
        assert c.dataplane.attached and len(segments) == 1


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
