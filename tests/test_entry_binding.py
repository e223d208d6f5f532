"""Frames bound to their entry (container version 2), end to end against a real server: a Store
splicing frames of two entries is refused, a spliced value planted in a tier is never served,
and frames exchanged between two entries inside LMDB's data file are found by ``verify`` and
never delivered."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kdn import codec, keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.codec import EncodedParts
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=2, dim=64)


def _pair() -> tuple[EncodedParts, EncodedParts]:
    """Two entries of one layout and length: byte-identical headers but for the frame sums."""
    return (codec.encode_parts(random_kv(LAYOUT, 24, seed=1), "raw", layers_per_frame=1),
            codec.encode_parts(random_kv(LAYOUT, 24, seed=2), "raw", layers_per_frame=1))


def _config(tmp_path: Path) -> ServerConfig:
    return ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=32 << 20,
                        disk_bytes=64 << 20, shutdown_grace_s=2)


def test_a_store_splicing_two_entries_is_refused(tmp_path: Path) -> None:
    a, b = _pair()
    key = keys.chunk_key([1], LAYOUT)
    with ServerThread(_config(tmp_path)) as st, Client(st.address, shm_bytes=0) as c:
        c.store(key, a)
        spliced = [a.frames[0], b.frames[1], a.frames[2], b.frames[3]]
        with grpc.insecure_channel(st.address) as ch:
            stub = pb_grpc.KDNStub(ch)
            msgs = [pb.StoreRequest(header=pb.StoreHeader(
                key=key, container_header=a.header, total_bytes=a.nbytes))]
            msgs += [pb.StoreRequest.FromString(frame_message(i, f))
                     for i, f in enumerate(spliced)]
            with pytest.raises(grpc.RpcError) as err:
                stub.Store(iter(msgs))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not belong to this entry" in (err.value.details() or "")
        assert c.retrieve(key, layout=LAYOUT).equal(codec.decode(a.to_bytes()))  # type: ignore[union-attr]
        # through the segment (PutMany) as well
        with Client(st.address, shm_bytes=8 << 20) as s:
            with pytest.raises(Exception, match="does not belong"):
                s.store_many([(key, EncodedParts(a.header, spliced))])
            got = s.retrieve(key, layout=LAYOUT)
            assert got is not None and got.equal(codec.decode(a.to_bytes()))


def test_a_spliced_value_in_a_tier_is_never_served(tmp_path: Path) -> None:
    a, b = _pair()
    key = keys.chunk_key([2], LAYOUT)
    with ServerThread(_config(tmp_path)) as st:
        store = st.server.store  # type: ignore[union-attr]
        skey = keys.store_key("", "default", key)
        spliced = b"".join([a.header, a.frames[0], b.frames[1], a.frames[2], a.frames[3]])
        for shm in (0, 8 << 20):
            store.tiers[0].put(skey, spliced)  # as if damaged in place: no Store checked it
            with Client(st.address, shm_bytes=shm) as c:
                assert c.retrieve(key, layout=LAYOUT) is None  # a miss, not mixed layers
                assert c.fetch(key) is None


def test_frames_exchanged_inside_lmdb_are_found_by_verify_and_never_served(
        tmp_path: Path) -> None:
    a, b = _pair()
    ka, kb = keys.chunk_key([3], LAYOUT), keys.chunk_key([4], LAYOUT)
    disk = StoreOptions(durability=Durability.DISK)
    with ServerThread(_config(tmp_path)) as st, Client(st.address) as c:
        c.store(ka, a, options=disk)
        c.store(kb, b, options=disk)
    data = tmp_path / "d" / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    ia, ib = raw.find(a.frames[1]), raw.find(b.frames[1])
    assert ia > 0 and ib > 0 and len(a.frames[1]) == len(b.frames[1])
    n = len(a.frames[1])
    raw[ia : ia + n], raw[ib : ib + n] = b.frames[1], a.frames[1]  # swap frame 1 at rest
    data.write_bytes(bytes(raw))
    with ServerThread(_config(tmp_path)) as st:
        with AdminClient(st.address) as admin:
            report = [p for p in admin.verify(dry_run=True) if p.done and p.tier == "disk"]
        assert report and report[-1].corrupt == 2
        with Client(st.address) as c:
            assert c.retrieve(ka, layout=LAYOUT) is None
            assert c.retrieve(kb, layout=LAYOUT) is None
