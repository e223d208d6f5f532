"""Malformed request messages: every method of both services (and the health service), unary
and streamed, answers bytes that are not its request message with INVALID_ARGUMENT and a
one-line message, never UNKNOWN with a Python exception's text, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import symbol_database
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kdn import codec, keys
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from kdn.transport.metadata import API_KEY_HEADER
from kdn.transport.wire import store_request
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import pruned_layout, random_kv

KV = random_kv(pruned_layout(), 4, seed=9)
PARTS = codec.encode_parts(KV, "raw", layers_per_frame=2)


def _methods() -> list[tuple[str, bool, bool, Callable[[bytes], Any]]]:
    """(path, client streaming, server streaming, the request parser the server uses) of every
    method the server registers: both kdn services and the standard health service."""
    from grpc_health.v1 import health_pb2

    out = []
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR):
        for svc in file.services_by_name.values():
            for m in svc.methods:
                cls = symbol_database.Default().GetSymbol(m.input_type.full_name)
                parse = store_request if m.full_name == "kdn.v1.KDN.Store" else cls.FromString
                out.append((f"/{svc.full_name}/{m.name}", m.client_streaming,
                            m.server_streaming, parse))
    return out


METHODS = _methods()
# bytes no protobuf parser accepts, whatever the message type: wire type 7 (field 0 and field
# 1); a length past the end; a varint that never ends; a tag that never ends
GARBAGE = [b"\x07", b"\x0f\x01", b"\x0a\x05ab", b"\x08" + b"\xff" * 11,
           b"\xff\xff\xff\xff\xff\xff"]


@pytest.fixture(scope="module")
def garbage_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path_factory.mktemp("garbage"), disk_bytes=0,
                       ram_bytes=64 << 20)
    with ServerThread(cfg) as server:
        yield server


@pytest.fixture(scope="module")
def channel(garbage_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(garbage_server.address) as ch:
        yield ch


def _call(ch: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
          messages: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """Send raw ``messages`` (one for a unary request) to ``path``; (status, details)."""
    raw: dict[str, Any] = dict(request_serializer=None, response_deserializer=None)
    try:
        if client_streaming and server_streaming:
            list(ch.stream_stream(path, **raw)(iter(messages), timeout=10))
        elif client_streaming:
            ch.stream_unary(path, **raw)(iter(messages), timeout=10)
        elif server_streaming:
            list(ch.unary_stream(path, **raw)(messages[0], timeout=10))
        else:
            ch.unary_unary(path, **raw)(messages[0], timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _refused(code: grpc.StatusCode, details: str, path: str) -> None:
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
    rpc = path.rsplit("/", 1)[1]
    assert details.startswith(f"malformed {rpc} request message"), (path, details)
    assert "\n" not in details and "Traceback" not in details and len(details) < 300


def test_the_garbage_is_garbage() -> None:
    for _path, _, _, parse in METHODS:
        for g in GARBAGE:
            with pytest.raises(Exception):  # noqa: B017 - whatever each parser raises
                parse(g)


@pytest.mark.parametrize("path,client_streaming,server_streaming,parse", METHODS,
                         ids=[m[0] for m in METHODS])
def test_every_method_refuses_garbage(channel: grpc.Channel, path: str, client_streaming: bool,
                                      server_streaming: bool, parse: object) -> None:
    for g in GARBAGE:
        _refused(*_call(channel, path, client_streaming, server_streaming, [g]), path)
    if client_streaming:  # garbage after a good first message is refused at that message
        first = (pb.StoreRequest(header=pb.StoreHeader(key=b"k" * 32,
                                                       container_header=PARTS.header))
                 if path.endswith("/Store") else pb.ImportItem(namespace="x", key=b"k" * 32))
        _refused(*_call(channel, path, True, server_streaming,
                        [first.SerializeToString(), GARBAGE[0]]), path)


def test_a_name_that_is_not_utf8_is_malformed(channel: grpc.Channel) -> None:
    """Field 1 of these requests is the namespace, a proto3 string: bytes that are not UTF-8
    make the message malformed."""
    bad_ns = b"\x0a\x08default\xff"
    for path, cs, ss in (("/kdn.v1.KDN/Lookup", False, False),
                         ("/kdn.v1.KDN/Retrieve", False, True),
                         ("/kdn.v1.KDNAdmin/Inspect", False, False),
                         ("/kdn.v1.KDNAdmin/Import", True, False)):
        _refused(*_call(channel, path, cs, ss, [bad_ns]), path)
    header = b"\x0a" + bytes([len(bad_ns)]) + bad_ns  # StoreRequest.header = 1
    _refused(*_call(channel, "/kdn.v1.KDN/Store", True, False, [header]), "/kdn.v1.KDN/Store")


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(METHODS), data=st.binary(min_size=1, max_size=512))
def test_random_bytes_are_parsed_or_refused(channel: grpc.Channel,
                                            method: tuple[Any, ...], data: bytes) -> None:
    """Random bytes: refused as malformed exactly when the method's parser refuses them;
    bytes that happen to parse get the method's own answer, never UNKNOWN."""
    path, client_streaming, server_streaming, parse = method
    try:
        parse(data)
        parses = True
    except Exception:
        parses = False
    event("parses" if parses else "malformed")
    if parses and path.endswith(("/Attach", "/Verify", "/Gc")):
        return  # a random but valid request to these could act on the host or the store
    code, details = _call(channel, path, client_streaming, server_streaming, [data])
    if parses:
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (path, details)
        assert "Traceback" not in details
    else:
        _refused(code, details, path)


def test_server_keeps_serving_after_garbage(garbage_server: ServerThread,
                                            channel: grpc.Channel) -> None:
    for path, cs, ss, _ in METHODS:
        _call(channel, path, cs, ss, [GARBAGE[-1]])
    with Client(garbage_server.address) as c:
        key = keys.chunk_key([7], KV.layout)
        c.store(key, KV)
        back = c.retrieve(key)
        assert back is not None and back.equal(KV)
        assert c.health() == "SERVING"
        counters = c.stats().counters
    assert not any(k.endswith(".UNKNOWN") for k in counters), counters


def test_callers_are_admitted_before_their_requests_are_read(tmp_path: Path) -> None:
    """With auth on, garbage without an API key is UNAUTHENTICATED (nothing about the message
    is told to an unknown caller); with a key it is INVALID_ARGUMENT."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  team-a: {api_keys: [secret-a]}\n")
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth))
    with ServerThread(cfg) as server, grpc.insecure_channel(server.address) as ch:
        lookup = ch.unary_unary("/kdn.v1.KDN/Lookup")
        with pytest.raises(grpc.RpcError) as info:
            lookup(GARBAGE[0], timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            lookup(GARBAGE[0], timeout=10, metadata=((API_KEY_HEADER, "secret-a"),))
        _refused(info.value.code(), info.value.details() or "", "/kdn.v1.KDN/Lookup")
