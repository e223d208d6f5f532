"""A read that says how many tokens its entries hold (``tokens=``, ``expect_tokens`` on the
wire) is refused, before anything is decoded, where an entry holds another number: on every
way an entry reaches a client (gRPC streams, the same-host segment, the network data path, the
in-process tier). An engine reads its blocks so: an entry written under a block's key with
another shape (a 687-byte ``kdn`` entry can declare 512 MiB of KV) never reaches a decoder."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kdn.client import Client
from kdn.errors import InvalidArgument, LayoutMismatch
from kdn.layout import Expected
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import count_decoders, numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=3, heads=2, dim=16)
KINDS = {
    "grpc": dict(shm_bytes=0, data_path=False),
    "same-host": {},
    "network": dict(shm_bytes=0),
    "in-process": dict(shm_bytes=0, data_path=False, local_bytes=64 << 20),
}


@pytest.fixture(params=sorted(KINDS))
def reader(request: pytest.FixtureRequest, server: ServerThread) -> Iterator[Client]:
    """A client of each kind, with entries 1 and 2 of 32 tokens and entry 3 of 40 (written by
    another client: the in-process tier fills on the first read)."""
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as writer:
        for i, tokens in ((1, 32), (2, 32), (3, 40)):
            writer.store(numbered_key(i), random_kv(LAYOUT, tokens, seed=i), mode="raw")
    with Client(server.address, timeout_s=30, **KINDS[request.param]) as c:  # type: ignore[arg-type]
        if request.param == "in-process":
            for i in (1, 2, 3):
                assert c.retrieve(numbered_key(i)) is not None  # now in the tier
        yield c


@pytest.fixture
def decoders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_decoders(monkeypatch)


def test_entries_of_the_tokens_asked_for_are_read(reader: Client) -> None:
    streams = reader.retrieve_streams([numbered_key(1), numbered_key(2)], layout=LAYOUT,
                                      tokens=32)
    for i, s in zip((1, 2), streams):
        assert s is not None and s.result().equal(random_kv(LAYOUT, 32, seed=i))
    got = reader.retrieve(numbered_key(3), layout=LAYOUT, tokens=40)
    assert got is not None and got.equal(random_kv(LAYOUT, 40, seed=3))
    assert reader.fetch(numbered_key(3), tokens=0) is not None  # 0: any


def test_an_entry_of_other_tokens_is_refused_before_it_is_decoded(
        reader: Client, decoders: list[int]) -> None:
    ks = [numbered_key(1), numbered_key(3)]
    with pytest.raises(LayoutMismatch, match="holds 40 tokens, caller expects 32"):
        reader.retrieve_streams(ks, layout=LAYOUT, tokens=32)
    with pytest.raises(LayoutMismatch, match="40 tokens"):
        reader.retrieve_stream(numbered_key(3), layout=LAYOUT, tokens=32)
    with pytest.raises(LayoutMismatch, match="40 tokens"):
        reader.fetch_many(ks, tokens=32)
    with pytest.raises(LayoutMismatch, match="40 tokens"):
        reader.retrieve(numbered_key(3), tokens=32)
    assert 40 not in decoders  # (entry 1 may have started: a stream a key, over gRPC)
    # the refusal is the entry's, not the read's: the client reads on
    got = reader.retrieve(numbered_key(1), layout=LAYOUT, tokens=32)
    assert got is not None and got.equal(random_kv(LAYOUT, 32, seed=1))


def test_the_server_refuses_each_read_rpc(server: ServerThread) -> None:
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.store(numbered_key(1), random_kv(LAYOUT, 40, seed=1), mode="raw")
    with grpc.insecure_channel(server.address) as ch:
        calls = {
            "Retrieve": (ch.unary_stream("/kdn.v1.KDN/Retrieve",
                                         request_serializer=pb.RetrieveRequest.SerializeToString,
                                         response_deserializer=pb.RetrieveResponse.FromString),
                         pb.RetrieveRequest, dict(key=numbered_key(1))),
            "RetrieveMany": (ch.unary_stream(
                "/kdn.v1.KDN/RetrieveMany",
                request_serializer=pb.RetrieveManyRequest.SerializeToString,
                response_deserializer=pb.RetrieveResponse.FromString),
                pb.RetrieveManyRequest, dict(keys=[numbered_key(1)])),
            "GetMany": (ch.unary_unary("/kdn.v1.KDN/GetMany",
                                       request_serializer=pb.GetManyRequest.SerializeToString,
                                       response_deserializer=pb.GetManyResponse.FromString),
                        pb.GetManyRequest, dict(keys=[numbered_key(1)])),
        }
        for name, (call, message, fields) in calls.items():
            answer = call(message(expect_tokens=40, **fields), timeout=30)
            assert answer if name == "GetMany" else list(answer), name
            with pytest.raises(grpc.RpcError) as info:
                answer = call(message(expect_tokens=32, **fields), timeout=30)
                if name != "GetMany":
                    list(answer)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert "holds 40 tokens, caller expects 32" in (info.value.details() or ""), name


def test_expected_says_what_differs() -> None:
    want = Expected.of(LAYOUT, 32)
    want.check(LAYOUT, 32)
    Expected().check(uniform_layout(layers=5), 7)  # nothing expected: anything passes
    with pytest.raises(LayoutMismatch, match="has layout"):
        want.check(uniform_layout(layers=5), 32)
    with pytest.raises(LayoutMismatch, match="holds 31 tokens"):
        want.check(LAYOUT, 31)
    with pytest.raises(InvalidArgument, match="tokens must be a whole number >= 0"):
        Expected.of(LAYOUT, -1)


def test_expected_tokens_are_any_whole_number_below_2_to_the_32() -> None:
    """np.int64(5) was refused as 'not a whole number', and 2**32 by the same message, which
    never named the bound."""
    assert Expected.of(LAYOUT, np.int64(5)) == Expected.of(LAYOUT, 5)  # type: ignore[arg-type]
    assert type(Expected.of(None, np.uint32(2**32 - 1)).tokens) is int  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"tokens must be below 2\*\*32, got 4294967296"):
        Expected.of(LAYOUT, 2**32)
    for bad in (True, 5.0, "5", None):
        with pytest.raises(InvalidArgument, match="tokens must be a whole number >= 0 .0: any."):
            Expected.of(LAYOUT, bad)  # type: ignore[arg-type]
