"""Staged entries (kdn.client.staged): a raw entry filled in place in the client's segment and
stored by where it lies, the server copying it out and making its checksums on the copy
(kdn.codec.sealing.copy_sealed). Over a real server: what is stored is byte for byte what
``encode_parts`` writes for the same tensors (uniform and pruned layouts); the client neither
copies nor writes the segment; a staged entry filled again and stored again leaves the first
value as it was; mixed batches; a remote client and a client with an in-process tier seal on
their side; a writer scribbling on the staged tensors while they are stored never gets an
entry stored whose checksums do not hold; damaged headers, records and lengths, a seal asked
for on bytes that came with the call, and a closed entry are refused, nothing stored."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.shm import SharedSegment
from kdn.client.staged import Staged, skeleton
from kdn.codec.format import parse_container, parse_header
from kdn.codec.sealing import copy_sealed, seal_in_place
from kdn.errors import Corrupt, InvalidArgument, InvalidLayout, KDNError, Truncated
from kdn.layout import DType
from kdn.server import ServerThread
from kdn.server.auth import Principal, Role
from kdn.transport.wire import FAST_HEAD, NET_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key as _key
from tests.helpers import pruned_layout, random_kv, uniform_layout

LAYOUT = uniform_layout()


def _fill(st: Staged, kv: KVCache) -> None:
    for (k, v), (a, b) in zip(st.layers, kv.layers):
        k.copy_(a)
        v.copy_(b)


def _unsealed(kv: KVCache) -> bytearray:
    """``kv`` as a staged entry's bytes before any seal (sums UNSEALED)."""
    st = Staged(kv.layout, kv.num_tokens, kv.start_position)
    _fill(st, kv)
    return bytearray(st._view)


@pytest.mark.parametrize("layout", [LAYOUT, pruned_layout()], ids=["uniform", "pruned"])
def test_a_sealed_skeleton_is_what_encode_parts_writes(layout: object) -> None:
    kv = random_kv(layout, 70, seed=1, start=128)  # type: ignore[arg-type]
    want = codec.encode_parts(kv, "raw", layers_per_frame=0).to_bytes()
    raw = _unsealed(kv)
    assert bytes(raw) != want  # the sums are not there yet
    out = bytearray(len(raw))
    header = copy_sealed(memoryview(out), bytes(raw))
    assert bytes(out) == want and header.tokens == 70
    parsed = codec.parse_header(want)  # the sealed header is built, not parsed: the same
    assert (header.raw, header.checksum, header.version, header.layout, header.entry) == \
        (parsed.raw, parsed.checksum, parsed.version, parsed.layout, parsed.entry)
    seal_in_place(memoryview(raw))
    assert bytes(raw) == want
    head, prefixes, frames = skeleton(layout, 70, 128)  # type: ignore[arg-type]
    assert len(head) + frames == len(want) and prefixes[0][0] == 0


def test_copy_sealed_refuses_what_it_can_not_seal() -> None:
    kv = random_kv(LAYOUT, 40, seed=2)
    raw = _unsealed(kv)
    head = len(parse_header(bytes(raw)).raw)
    bad_magic = bytearray(raw)
    bad_magic[0] ^= 0xFF
    cut = bytes(raw[:-5])
    long = bytes(raw) + b"\0" * 8
    record = bytearray(raw)
    record[head + 16] ^= 0x01  # the first record's kv_heads: the layout says otherwise
    frame_len = bytearray(raw)
    frame_len[head + 8] ^= 0x04  # the first frame's payload length
    header_body = bytearray(raw)
    header_body[20] ^= 0x01  # inside the header: its own checksum no longer holds
    for value, err in ((bad_magic, Corrupt), (cut, Truncated), (long, Corrupt),
                       (record, InvalidLayout), (frame_len, Truncated),
                       (header_body, Corrupt)):
        with pytest.raises(err):
            copy_sealed(memoryview(bytearray(len(value))), bytes(value))
    v1 = codec.encode_parts(kv, "raw", layers_per_frame=0).to_bytes()
    from kdn.codec.format import seal

    entry = parse_header(v1).entry
    h1, f1 = seal(entry, list(parse_container(v1).frames), version=1)
    old = h1 + b"".join(f1)
    with pytest.raises(InvalidArgument, match="version 2"):
        copy_sealed(memoryview(bytearray(len(old))), old)
    with pytest.raises(InvalidArgument):
        copy_sealed(memoryview(bytearray(3)), bytes(raw))
    with pytest.raises(InvalidArgument, match="token"):
        skeleton(LAYOUT, 0)


def test_a_staged_store_is_sent_where_it_lies_and_sealed_by_the_server(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    kvs = [random_kv(LAYOUT, 300, seed=10 + i) for i in range(2)]
    writes: list[int] = []
    real = SharedSegment.write

    def counted(self: SharedSegment, offset: int, data: bytes | memoryview) -> None:
        writes.append(len(data))
        real(self, offset, data)

    monkeypatch.setattr(SharedSegment, "write", counted)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        with c.stage(LAYOUT, 300) as st:
            assert st.region(c.dataplane.segment()[0]) is not None
            _fill(st, kvs[0])
            c.store(_key(1), st)
            _fill(st, kvs[1])  # filled again: the first value stays as stored
            c.store(_key(2), st)
        assert writes == []  # nothing copied into the segment by the client
        counters = c.stats().counters
        assert counters["fast.PutMany"] >= 2 and counters["store.ok"] == 2
        for i, kv in enumerate(kvs):
            got = c.fetch(_key(1 + i))
            assert got is not None
            assert got.parts.to_bytes() == \
                codec.encode_parts(kv, "raw", layers_per_frame=0).to_bytes()
            back = c.retrieve(_key(1 + i), layout=LAYOUT)
            assert back is not None and back.equal(kv)
        with pytest.raises(InvalidArgument, match="closed"):
            c.store(_key(3), st)
        assert not c.contains(_key(3))


def test_store_many_mixes_staged_and_other_entries_in_order(server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 200, seed=20 + i) for i in range(4)]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        staged = [c.stage(LAYOUT, 200) for _ in range(2)]
        _fill(staged[0], kvs[0])
        _fill(staged[1], kvs[2])
        got = c.store_many([(_key(10), staged[0]), (_key(11), kvs[1]),
                            (_key(12), staged[1]), (_key(13), kvs[3])], mode="raw")
        assert [r.stored_bytes > 0 for r in got] == [True] * 4
        assert [r.replaced for r in got] == [False] * 4
        for i, kv in enumerate(kvs):
            back = c.retrieve(_key(10 + i), layout=LAYOUT)
            assert back is not None and back.equal(kv)
        for st in staged:
            st.close()


@pytest.mark.parametrize("opts", [{"shm_bytes": 0}, {"shm_bytes": 0, "data_path": False},
                                  {"local_bytes": 8 << 20}],
                         ids=["remote-data-path", "remote-grpc", "in-process-tier"])
def test_clients_that_send_the_bytes_seal_them_first(server: ServerThread,
                                                     opts: dict[str, int]) -> None:
    kv = random_kv(LAYOUT, 150, seed=30)
    with Client(server.address, timeout_s=30, **opts) as c:  # type: ignore[arg-type]
        st = c.stage(LAYOUT, 150, start_position=150)
        if opts.get("shm_bytes") == 0:
            assert st.region(c.dataplane.segment()[0]) is None  # in this process's memory
        _fill(st, kv)
        c.store(_key(20), st)
        c.store_many([(_key(21), st)])
        want = KVCache(LAYOUT, kv.layers, 150)
        for k in (_key(20), _key(21)):
            back = c.retrieve(k, layout=LAYOUT)
            assert back is not None and back.equal(want) and back.start_position == 150
        if "local_bytes" in opts:
            assert c.lookup([_key(20)]).infos[0].tier == "inproc"


def test_a_server_that_does_not_seal_gets_entries_sealed_by_the_client(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that does not say it seals (``AttachResponse.seals``: an older one) is sent
    staged entries sealed in place, still by where they lie, and checks them as any store."""
    import kdn.client.staged as staged_mod

    sealed: list[int] = []
    real = staged_mod.seal_in_place

    def counted(buf: memoryview) -> object:
        sealed.append(len(buf))
        return real(buf)

    monkeypatch.setattr(staged_mod, "seal_in_place", counted)
    kv = random_kv(LAYOUT, 90, seed=35)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        st = c.stage(LAYOUT, 90)
        assert c.dataplane.server_seals  # this server does
        c.dataplane.same_host.server_seals = False
        _fill(st, kv)
        c.store(_key(35), st)
        c.store_async(_key(36), st).result()
        assert len(sealed) == 2
        for k in (_key(35), _key(36)):
            back = c.retrieve(k, layout=LAYOUT)
            assert back is not None and back.equal(kv)


def test_a_writer_scribbling_while_entries_are_stored_never_breaks_a_checksum(
        server: ServerThread) -> None:
    """The sums are made on the server's copy: whatever the caller writes meanwhile, every
    stored entry reads back whole (its checksums hold on every read) and is one of the
    values the tensors held at some instant for each layer body written whole."""
    with Client(server.address, timeout_s=30, data_path=False) as c:
        st = c.stage(LAYOUT, 400)
        stop = threading.Event()

        def scribble() -> None:
            v = 0
            while not stop.is_set():
                v = (v + 1) % 200
                for k, val in st.layers:
                    k.fill_(v)
                    val.fill_(-v)

        t = threading.Thread(target=scribble)
        t.start()
        try:
            for i in range(150):
                c.store(_key(100 + i % 5), st)
                got = c.fetch(_key(100 + i % 5))  # every checksum checked on the way
                assert got is not None
                parse_container(got.parts.to_bytes(), verify=True)
        finally:
            stop.set()
            t.join()
        st.close()


def test_hostile_sealed_items_are_refused_and_nothing_is_stored(server: ServerThread) -> None:
    old = random_kv(LAYOUT, 100, seed=40)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        c.store(_key(50), old, mode="raw")
        seg, seg_id = c.dataplane.segment()
        servicer = server.server.servicer  # type: ignore[union-attr]

        def put(data: bytes, key: bytes = _key(50)) -> None:
            at = seg.regions.alloc(len(data))
            seg.write(at, data)
            try:
                req = pb.PutManyRequest(segment_id=seg_id)
                item = req.items.add(key=key, seal=True)
                item.region.offset, item.region.length = at, len(data)
                c.dataplane._put(req, None)
            finally:
                seg.regions.free(at, len(data))

        raw = _unsealed(random_kv(LAYOUT, 100, seed=41))
        head = len(parse_header(bytes(raw)).raw)
        record = bytearray(raw)
        record[head + 16] ^= 0x01
        magic = bytearray(raw)
        magic[head] ^= 0xFF  # the first frame's magic
        for data, match in ((record, "layer 0"), (magic, "bad frame magic"),
                            (raw[:-1], "needs")):
            with pytest.raises(KDNError, match=match):
                put(bytes(data))
        back = c.retrieve(_key(50), layout=LAYOUT)
        assert back is not None and back.equal(old)
        with pytest.raises(InvalidArgument, match="shared segment only"):  # bytes inline
            servicer.puts.put(Principal("default", Role.TENANT), pb.PutManyRequest(
                items=[pb.PutItem(key=_key(51), data=bytes(raw), seal=True)]))
        assert not c.contains(_key(51))
    with Client(server.address, timeout_s=30, shm_bytes=0) as remote:  # the network data path
        net = remote.dataplane.net()
        assert net is not None
        req = pb.PutManyRequest(namespace="default", segment_id=net.ticket)
        item = req.items.add(key=_key(52), seal=True)
        item.region.offset, item.region.length = 0, len(raw)
        body = req.SerializeToString()
        with socket.create_connection(("127.0.0.1", servicer.data_port), timeout=10) as conn:
            conn.sendall(FAST_HEAD.pack(len(body), NET_PUT_MANY) + body + bytes(raw))
            head = read_exact(conn, FAST_HEAD.size)
            assert head is not None
            n, ok = FAST_HEAD.unpack(head)
            answer = read_exact(conn, n)
        assert not ok and answer is not None and b"shared segment only" in answer
        assert not remote.contains(_key(52))


def test_stage_refuses_what_has_no_entry() -> None:
    with pytest.raises(InvalidArgument):
        Staged(LAYOUT, 0)
    with pytest.raises(InvalidArgument, match="float32 KV can not be staged"):
        Staged(uniform_layout(dtype=DType.FLOAT32), 4)
    with pytest.raises(InvalidArgument):
        Staged(LAYOUT, 4, start_position=-1)
    # a whole number of tokens; a whole position in [0, 2**63)
    for tokens in (1.5, True, "4"):
        with pytest.raises(InvalidArgument, match=f"whole number of tokens.*got {tokens!r}"):
            Staged(LAYOUT, tokens)  # type: ignore[arg-type]
    for position in (0.5, True, 2**70):
        with pytest.raises(InvalidArgument, match=f"start_position must be a whole number.*"
                           f"got {position!r}"):
            Staged(LAYOUT, 4, start_position=position)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="last past the largest position"):
        Staged(LAYOUT, 4, start_position=2**63 - 3)
    with pytest.raises(InvalidArgument, match="layout must be a KVLayout, got str"):
        Staged("test-model", 4)  # type: ignore[arg-type]
    st = Staged(LAYOUT, 4)
    assert not st.closed and len(st.layers) == LAYOUT.num_layers
    assert st.layers[0][0].shape == torch.Size([2, 4, 16])
    st.close()
    assert st.closed and st.layers == []
    with pytest.raises(InvalidArgument, match="closed"):
        st.sealed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_staged_entry_filled_from_the_gpu_by_dma(server: ServerThread) -> None:
    """On a CUDA host ``stage`` registers the segment with CUDA: the tensors are pinned, so
    non-blocking copies from the device land there directly; what is stored reads back equal,
    into CUDA tensors too."""
    kv = random_kv(LAYOUT, 256, seed=60)
    on_gpu = [(k.cuda(), v.cuda()) for k, v in kv.layers]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        with c.stage(LAYOUT, 256) as st:
            assert c.dataplane.segment()[0].register_with_cuda()
            assert all(k.is_pinned() and v.is_pinned() for k, v in st.layers)
            for (k, v), (a, b) in zip(st.layers, on_gpu):
                k.copy_(a, non_blocking=True)
                v.copy_(b, non_blocking=True)
            torch.cuda.synchronize()
            c.store(_key(70), st)
            c.store_async(_key(71), st).result()
        for key in (_key(70), _key(71)):
            back = c.retrieve(key, layout=LAYOUT, device="cuda")
            assert back is not None and all(k.is_cuda for k, _ in back.layers)
            assert back.to("cpu").equal(kv)
