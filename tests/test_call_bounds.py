"""What one call may make a server do: at most ``MAX_CALL_KEYS`` keys a request (a Lookup of a
million keys held about a gigabyte of the server's memory, and its answer was built on the
event loop), which kdn's client sends in several calls; and a GetMany reads each key once
and reads nothing it has no room to answer with (a 27 KB request naming one 16 MiB disk
entry 800 times took the server's worker threads for seconds, and every other call waited)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kdn.client import Client
from kdn.names import MAX_CALL_KEYS
from kdn.server import ServerConfig, ServerThread, batch
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import numbered_key, random_kv, uniform_layout

KEYS = [numbered_key(i) for i in range(MAX_CALL_KEYS + 5)]


def test_a_request_of_too_many_keys_is_refused_before_it_is_served(
        server: ServerThread) -> None:
    with grpc.insecure_channel(server.address,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.KDNStub(ch)
        calls = {"Lookup": (stub.Lookup, pb.LookupRequest),
                 "Delete": (stub.Delete, pb.DeleteRequest),
                 "GetMany": (stub.GetMany, pb.GetManyRequest)}
        for name, (rpc, request) in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                rpc(request(keys=KEYS))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert f"{len(KEYS)} names in one call; at most {MAX_CALL_KEYS}" in \
                (err.value.details() or ""), name

        with pytest.raises(grpc.RpcError) as err:  # keys in items, one each
            stub.PutMany(pb.PutManyRequest(items=[pb.PutItem(key=k) for k in KEYS]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"items: {len(KEYS)} keys in one call; at most {MAX_CALL_KEYS}" in \
            (err.value.details() or "")


def test_the_client_stores_a_long_list_in_several_calls(server_config: ServerConfig) -> None:
    kv = random_kv(uniform_layout(layers=1, heads=1, dim=2), 1)
    with ServerThread(dataclasses.replace(server_config, disk_bytes=0)) as st, \
            Client(st.address, timeout_s=30) as c:  # PutMany through its segment
        results = c.store_many([(k, kv) for k in KEYS], mode="raw")
        assert len(results) == len(KEYS)
        assert all(i.present for i in c.lookup([KEYS[0], KEYS[-1]]).infos)


def test_the_client_sends_a_long_key_list_in_several_calls(client: Client) -> None:
    kv = random_kv(uniform_layout(), 4)
    client.store(KEYS[3], kv)
    client.store(KEYS[-1], kv)
    present = [i for i, info in enumerate(client.lookup(KEYS).infos) if info.present]
    assert present == [3, len(KEYS) - 1]
    got = client.fetch_many(KEYS)
    assert [i for i, g in enumerate(got) if g is not None] == [3, len(KEYS) - 1]
    assert client.delete(KEYS) == 2
    assert not any(i.present for i in client.lookup([KEYS[3], KEYS[-1]]).infos)


def test_getmany_reads_a_key_once_and_nothing_it_has_no_room_for(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inline (no segment), a budget of 1 MiB here: a key named 40 times is read once; once
    an entry found no room, the next ones are asked their size first and not read where
    they would not fit: each is answered present, with its size, for the client to ask
    again."""
    monkeypatch.setattr(batch, "INLINE_BUDGET", 1 << 20)
    lay = uniform_layout(layers=4, heads=8, dim=64)
    with Client(server.address, shm_bytes=0, timeout_s=60) as c:
        for i in range(6):  # about 400 KB each: two fit
            c.store(KEYS[i], random_kv(lay, 50, seed=i), mode="raw")
    reads: list[bytes] = []
    hit = batch.BatchReads._hit  # noqa: SLF001

    def counted(self: batch.BatchReads, skey: bytes, *args: object, **kw: object) -> object:
        reads.append(skey)
        return hit(self, skey, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(batch.BatchReads, "_hit", counted)
    with grpc.insecure_channel(server.address,
                               options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        stub = pb_grpc.KDNStub(ch)
        resp = stub.GetMany(pb.GetManyRequest(keys=[KEYS[0]] * 40 + KEYS[1:6]))
    assert all(ref.present for ref in resp.entries)
    assert [ref.written for ref in resp.entries] == [True] * 2 + [False] * 43
    assert len(reads) == 1  # KEYS[0], once; the others would not fit: not read at all
    sizes = {ref.length for ref in resp.entries[40:]}
    assert len(sizes) == 1 and 300_000 < sizes.pop() < 500_000
