"""Hostile input: random and mutated bytes into the container parser, the frame decoder and the
Store handler. Every input is answered with a typed kdn error (or a clean gRPC status), never a
crash, an untyped exception, an oversized allocation, or wrong tensors."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn import codec, keys
from kdn.client import Client
from kdn.codec import StreamDecoder
from kdn.codec.format import build_header, parse_container, parse_header
from kdn.errors import KDNError
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import pruned_layout, random_kv

KV = random_kv(pruned_layout(), 6, seed=5)
BLOB = {m: codec.encode(KV, m, layers_per_frame=2) for m in codec.mode_names()
        if m in ("raw", "lossless")}
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _decode_or_typed_error(blob: bytes) -> None:
    try:
        out = codec.decode(blob)
    except KDNError:
        return
    assert out.equal(KV), "a damaged container decoded to different tensors"


@SETTINGS
@given(st.binary(max_size=4096))
def test_random_bytes_never_crash_the_parser(data: bytes) -> None:
    for fn in (parse_header, parse_container, codec.decode):
        try:
            fn(data)  # type: ignore[operator]
        except KDNError:
            pass


@SETTINGS
@given(st.sampled_from(sorted(BLOB)), st.data())
def test_mutated_containers_are_rejected_or_exact(mode: str, data: st.DataObject) -> None:
    blob = bytearray(BLOB[mode])
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
    pos = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        del blob[pos:]
    elif kind == "insert":
        blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        blob[pos:pos + len(chunk)] = chunk
    _decode_or_typed_error(bytes(blob))


@SETTINGS
@given(tokens=st.integers(0, 2**40), heads=st.integers(0, 2**20),
       channels=st.integers(0, 2**20))
def test_lying_shape_fields_are_refused_before_allocation(tokens: int, heads: int,
                                                          channels: int) -> None:
    header = parse_header(codec.encode_parts(KV, "raw").header)
    entry = pb.EntryHeader()
    entry.CopyFrom(header.entry)
    entry.tokens = min(tokens, 2**64 - 1)
    entry.layout.layers[0].kv_heads = min(heads, 2**32 - 1)
    entry.layout.layers[0].k_channels = min(channels, 2**32 - 1)
    try:
        h = parse_header(build_header(entry))
    except KDNError:
        return
    # accepted: the declared layer must be within the decode limit, and frames must match it
    dec = StreamDecoder(h)
    for i, frame in enumerate(codec.encode_parts(KV, "raw", layers_per_frame=2).frames):
        try:
            dec.decode_frame(i, frame)
        except KDNError:
            pass


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kdn.server import ServerConfig

    cfg = ServerConfig(port=0, data_dir=tmp_path_factory.mktemp("hostile"), disk_bytes=0,
                       max_message_bytes=1 << 20)
    with ServerThread(cfg) as server:
        yield server


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=2048), min_size=0, max_size=4))
def test_store_handler_survives_garbage_messages(hostile_server: ServerThread,
                                                 msgs: list[bytes]) -> None:
    """Raw bytes as StoreRequest messages (malformed protobufs included) get a status, and the
    server keeps serving what it stored before."""
    with grpc.insecure_channel(hostile_server.address) as ch:
        store = ch.stream_unary("/kdn.v1.KDN/Store", request_serializer=lambda b: b,
                                response_deserializer=pb.StoreResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            store(iter(msgs), timeout=10)
        assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                     grpc.StatusCode.INTERNAL,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
    with Client(hostile_server.address) as c:
        key = keys.chunk_key([1], KV.layout)
        if not c.contains(key):
            c.store(key, KV)
        back = c.retrieve(key)
        assert back is not None and back.equal(KV)


def test_lying_total_bytes_and_huge_declared_sizes(hostile_server: ServerThread) -> None:
    parts = codec.encode_parts(KV, "raw")
    with Client(hostile_server.address) as c:
        stub = c._stub
        hdr = pb.StoreHeader(key=b"k" * 32, container_header=parts.header, total_bytes=2**62)
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter([pb.StoreRequest(header=hdr)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        entry = parse_header(parts.header).entry
        entry.tokens = 2**40
        hdr = pb.StoreHeader(key=b"k" * 32, container_header=build_header(entry))
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter([pb.StoreRequest(header=hdr)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer limit" in (info.value.details() or "")


def test_atheris_fuzz_target_runs_clean() -> None:
    """A bounded run of the libFuzzer target (fuzz/fuzz_container.py) finds nothing."""
    import subprocess
    import sys
    from pathlib import Path

    target = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_container.py"
    out = subprocess.run([sys.executable, str(target), "-runs=20000", "-seed=1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done 20000 runs" in out.stderr
