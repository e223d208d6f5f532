"""Strict names (kdn.names): one rule per kind of name, matched against the whole string, used by
every RPC of both services, the clients, the CLI, the auth file and the admin import path.

The property test drives a real server through raw gRPC stubs (no client-side checks) with
arbitrary namespaces, tenants and keys: each name is either refused with INVALID_ARGUMENT by
every RPC that takes it, or accepted everywhere and stored, listed, inspected, exported and
looked up under exactly that name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kdn import codec, names
from kdn.cli.main import main as cli_main
from kdn.client.admin import AdminClient, Record, encode_record
from kdn.errors import InvalidArgument
from kdn.server import ServerConfig, ServerThread
from kdn.server.requests import NAME_RULES, NOT_NAMES, check_names
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import pruned_layout, random_kv

PARTS = codec.encode_parts(random_kv(pruned_layout(), 4, seed=3), "raw", layers_per_frame=2)
VALUE = PARTS.to_bytes()
INVALID = grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- the rules themselves

@pytest.mark.parametrize("bad", ["default\n", "\ndefault", "default\r", "a\x00", "", " a",
                                 "a b", "-a", ".a", "_a", "a" * 65, "d\u00e9faut", "\uff41",
                                 "a/b", "a:b", "default\n\n", "a\u2028"])
def test_namespace_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="namespace .* is malformed"):
        names.check_namespace(bad)


@pytest.mark.parametrize("good", ["a", "default", "A.b_c-d", "0", "x" * 64, "rag"])
def test_namespace_accepted_as_is(good: str) -> None:
    assert names.check_namespace(good) == good


def test_tenant_key_and_hex_rules() -> None:
    for bad in ("team-a\n", "Team", "team a", "", "t" * 33, "-t", "a:b", "a/b"):
        with pytest.raises(InvalidArgument, match="tenant .* is malformed"):
            names.check_tenant(bad)
    assert names.check_tenant("team-a_1") == "team-a_1"
    for bad_key in (b"", b"x" * 31, b"x" * 33, "x" * 32, None):
        with pytest.raises(InvalidArgument, match="key must be 32 bytes"):
            names.check_key(bad_key)
    assert names.check_key(bytearray(b"\n" * 32)) == b"\n" * 32
    hexkey = "ab" * 32
    assert names.parse_hex_key(hexkey) == bytes.fromhex(hexkey)
    for bad in (hexkey + "\n", " " + hexkey, hexkey[:-2] + " ab", hexkey[:-1], hexkey + "ab",
                "zz" * 32):
        with pytest.raises(InvalidArgument, match="key .* is malformed"):
            names.parse_hex_key(bad)
    assert names.parse_hex_prefix("") == b"" and names.parse_hex_prefix("0aFF") == b"\x0a\xff"
    for bad in ("0", "0a\n", "0a 0b", "00" * 33):
        with pytest.raises(InvalidArgument, match="key prefix"):
            names.parse_hex_prefix(bad)


def test_refused_names_are_quoted_on_one_line() -> None:
    with pytest.raises(InvalidArgument) as info:
        names.check_namespace("evil\nname" + "x" * 500)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 250 and "evil\\nname" in msg


def _text_fields(desc: object, seen: set[str]) -> Iterator[str]:
    """Full names of every string/bytes field of ``desc`` and the messages it holds."""
    full = desc.full_name  # type: ignore[attr-defined]
    if full in seen:
        return
    seen.add(full)
    for f in desc.fields:  # type: ignore[attr-defined]
        if f.type == f.TYPE_MESSAGE:
            yield from _text_fields(f.message_type, seen)
        elif f.type in (f.TYPE_STRING, f.TYPE_BYTES):
            yield f.full_name


def test_every_request_field_is_a_checked_name_or_listed_as_none() -> None:
    """A string or bytes field added to a request message must be classified: a name (checked
    by its rule before any handler runs) or explicitly not a name."""
    seen: set[str] = set()
    fields = {f for svc in ("KDN", "KDNAdmin")
              for m in pb.DESCRIPTOR.services_by_name[svc].methods
              for f in _text_fields(m.input_type, seen)}
    unclassified = {f for f in fields
                    if f.rsplit(".", 1)[1] not in NAME_RULES and f not in NOT_NAMES}
    assert unclassified == set()
    assert NOT_NAMES <= fields, NOT_NAMES - fields  # no stale entries


def test_check_names_reaches_nested_and_repeated_fields() -> None:
    good = b"k" * 32
    check_names(pb.PutManyRequest(namespace="ns", items=[pb.PutItem(key=good)]))
    check_names(pb.StoreRequest(frame=pb.Frame(index=0, data=b"x")))  # no header: no names
    check_names(pb.BlendRequest(pieces=[pb.BlendPiece(text="hi")]))  # "" chunk_key: text
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.key: key must be 32 bytes"):
        check_names(pb.PutManyRequest(items=[pb.PutItem(key=good), pb.PutItem(key=b"k")]))
    with pytest.raises(InvalidArgument, match=r"header\.namespace: namespace 'a\\n'"):
        check_names(pb.StoreRequest(header=pb.StoreHeader(namespace="a\n", key=good)))
    with pytest.raises(InvalidArgument, match=r"pieces\[0\]\.chunk_key"):
        check_names(pb.BlendRequest(pieces=[pb.BlendPiece(chunk_key=b"short")]))
    with pytest.raises(InvalidArgument, match="key prefix"):
        check_names(pb.ListRequest(key_prefix=b"p" * 33))
    with pytest.raises(InvalidArgument, match="tenant"):
        check_names(pb.ListRequest(tenant="a:b"))


# ---------------------------------------------------------------- every RPC, against a server

@pytest.fixture(scope="module")
def names_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path_factory.mktemp("names"), disk_bytes=0,
                       ram_bytes=64 << 20)
    with ServerThread(cfg) as server:
        yield server


@pytest.fixture(scope="module")
def stubs(names_server: ServerThread) -> Iterator[tuple[pb_grpc.KDNStub, pb_grpc.KDNAdminStub]]:
    with grpc.insecure_channel(names_server.address) as ch:
        yield pb_grpc.KDNStub(ch), pb_grpc.KDNAdminStub(ch)


def _code(fn: object, *args: object) -> tuple[grpc.StatusCode, object]:
    """(status, answer) of a call; a streamed answer is read to its end."""
    try:
        out = fn(*args, timeout=10)  # type: ignore[operator]
        if not isinstance(out, grpc.Call) or hasattr(out, "SerializeToString"):
            return grpc.StatusCode.OK, out
        return grpc.StatusCode.OK, list(out)
    except grpc.RpcError as exc:
        assert "Traceback" not in (exc.details() or "")
        return exc.code(), exc.details()


def _store_msgs(namespace: str, key: bytes) -> Iterator[pb.StoreRequest]:
    yield pb.StoreRequest(header=pb.StoreHeader(namespace=namespace, key=key,
                                                container_header=PARTS.header,
                                                total_bytes=len(VALUE)))
    for i, f in enumerate(PARTS.frames):
        yield pb.StoreRequest(frame=pb.Frame(index=i, data=bytes(f)))


def _calls(kdn: pb_grpc.KDNStub, admin: pb_grpc.KDNAdminStub, ns: str, key: bytes
           ) -> dict[str, tuple[object, ...]]:
    """Every call that names (ns, key), by name: the stub method and its request."""
    keys_req = pb.KeysRequest(namespace=ns, keys=[key])
    return {
        "Store": (kdn.Store, _store_msgs(ns, key)),
        "Retrieve": (kdn.Retrieve, pb.RetrieveRequest(namespace=ns, key=key)),
        "Lookup": (kdn.Lookup, pb.LookupRequest(namespace=ns, keys=[key])),
        "GetMany": (kdn.GetMany, pb.GetManyRequest(namespace=ns, keys=[key])),
        "PutMany": (kdn.PutMany, pb.PutManyRequest(
            namespace=ns, items=[pb.PutItem(key=key, data=VALUE)])),
        "Blend": (kdn.Blend, pb.BlendRequest(namespace=ns, pieces=[
            pb.BlendPiece(chunk_key=key, token_ids=[1])])),
        "Inspect": (admin.Inspect, pb.InspectRequest(namespace=ns, key=key)),
        "Pin": (admin.Pin, keys_req),
        "Unpin": (admin.Unpin, keys_req),
        "Import": (admin.Import, iter([pb.ImportItem(namespace=ns, key=key, value=VALUE)])),
        "Evict": (admin.Evict, keys_req),
        "Delete": (kdn.Delete, pb.DeleteRequest(namespace=ns, keys=[key])),
    }


_VALID_NS = st.from_regex(names.NAMESPACE_PATTERN, fullmatch=True)
_VALID_TENANT = st.from_regex(names.TENANT_PATTERN, fullmatch=True)
_WEIRD = st.characters(codec="utf-8")  # any code point protobuf can carry: controls, unicode


def _near(valid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Valid names with one character added or put in: the near misses."""
    extra = st.sampled_from(["\n", "\r", "\x00", " ", "\t", "/", ":", "\u00e9", "\u2028", "\n\n"])
    return st.one_of(
        st.tuples(valid, extra).map(lambda t: t[0] + t[1]),
        st.tuples(extra, valid).map(lambda t: t[0] + t[1]),
        st.tuples(valid, extra, st.integers(0, 64)).map(
            lambda t: t[0][: t[2]] + t[1] + t[0][t[2]:]),
    )


NAMESPACES = st.one_of(_VALID_NS, _VALID_NS, _near(_VALID_NS), st.just(""),
                       st.text(_WEIRD, max_size=70),
                       st.text(min_size=60, max_size=70, alphabet="abc"),
                       st.text(_WEIRD, min_size=1000, max_size=4000))
TENANTS = st.one_of(_VALID_TENANT, _near(_VALID_TENANT), st.just(""), st.text(_WEIRD, max_size=40))
KEYS = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40),
                 st.binary(min_size=33, max_size=4000),
                 st.sampled_from([b"\n" * 32, b"/" * 32, b":" * 32, b"\x00" * 32]))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(ns=NAMESPACES, key=KEYS, tenant=TENANTS)
def test_names_are_refused_everywhere_or_round_trip_exactly(
        stubs: tuple[pb_grpc.KDNStub, pb_grpc.KDNAdminStub], ns: str, key: bytes,
        tenant: str) -> None:
    kdn, admin = stubs
    ns_ok = ns == "" or re.fullmatch(names.NAMESPACE_PATTERN, ns) is not None
    key_ok = len(key) == 32
    tenant_ok = tenant == "" or re.fullmatch(names.TENANT_PATTERN, tenant) is not None
    ns_of_entry = ns or "default"  # proto3's unset string names the default namespace
    calls = _calls(kdn, admin, ns, key)

    # the listings take a namespace filter, a tenant filter and a key prefix
    listing = {
        "List": (admin.List, pb.ListRequest(namespace=ns, key_prefix=key, tenant=tenant),
                 ns_ok and len(key) <= 32 and tenant_ok),
        "Export": (admin.Export, pb.ExportRequest(namespace=ns, key_prefix=key),
                   ns_ok and len(key) <= 32),
        "Lookup of no keys": (kdn.Lookup, pb.LookupRequest(namespace=ns), ns_ok),
        "Delete of no keys": (kdn.Delete, pb.DeleteRequest(namespace=ns), ns_ok),
        "Pin of no keys": (admin.Pin, pb.KeysRequest(namespace=ns), ns_ok),
    }
    for what, (fn, req, ok) in listing.items():
        code, _ = _code(fn, req)
        assert (code == grpc.StatusCode.OK) if ok else (code == INVALID), (what, code)

    event("accepted" if ns_ok and key_ok else "refused")
    if not (ns_ok and key_ok):
        for what, (fn, req) in calls.items():
            if what == "Blend" and key == b"" and ns_ok:
                continue  # a piece's empty chunk_key makes it a text piece: not a bad key
            code, details = _code(fn, req)
            assert code == INVALID, (what, code, details)
            assert isinstance(details, str) and "\n" not in details
            assert ("namespace" if not ns_ok else "key") in details, (what, details)
        return

    # accepted: stored under exactly (ns, key), seen under exactly that name by every RPC
    def ok(what: str) -> object:
        code, out = _code(*calls[what])
        assert code == grpc.StatusCode.OK, (what, code, out)
        return out

    stored = ok("Store")
    assert stored.stored_bytes == len(VALUE)  # type: ignore[attr-defined]
    found = ok("Lookup")
    assert found.infos[0].present and found.infos[0].size_bytes == len(VALUE)  # type: ignore[attr-defined]
    parts = ok("Retrieve")
    assert parts[0].header.container_header == PARTS.header  # type: ignore[index]
    assert b"".join(p.frame.data for p in parts[1:]) == b"".join(PARTS.frames)  # type: ignore[index]
    got = ok("GetMany")
    assert got.entries[0].present and got.entries[0].data == VALUE  # type: ignore[attr-defined]
    code, _ = _code(*calls["Blend"])
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # names accepted: this server has no model
    info = ok("Inspect")
    assert (info.namespace, info.key, info.tenant) == (ns_of_entry, key, "")  # type: ignore[attr-defined]
    for flt in ("", ns):
        entries = list(_code(admin.List, pb.ListRequest(namespace=flt, limit=100000))[1].entries)  # type: ignore[attr-defined]
        assert [(e.namespace, e.tenant) for e in entries if e.key == key] == [(ns_of_entry, "")]
    exported = _code(admin.Export, pb.ExportRequest(namespace=ns, key_prefix=key))[1]
    assert [(x.namespace, x.key, x.value) for x in exported] == [(ns_of_entry, key, VALUE)]  # type: ignore[attr-defined]
    assert ok("Import").skipped == 1  # type: ignore[attr-defined]
    assert ok("PutMany").results[0].replaced  # type: ignore[attr-defined]
    assert ok("Pin").count == 1 and ok("Unpin").count == 1  # type: ignore[attr-defined]
    # the same key under a near-miss namespace is refused, not a second entry
    for near in (ns_of_entry + "\n", ns_of_entry + " "):
        assert _code(kdn.Lookup, pb.LookupRequest(namespace=near, keys=[key]))[0] == INVALID
    assert ok("Delete").deleted == 1  # type: ignore[attr-defined]
    assert ok("Evict").count == 0  # type: ignore[attr-defined]
    assert not ok("Lookup").infos[0].present  # type: ignore[attr-defined]


# ---------------------------------------------------------------- CLI and admin import path

def test_cli_refuses_malformed_names_before_calling(capsys: pytest.CaptureFixture[str]) -> None:
    key = "ab" * 32
    for argv in (["lookup", key, "--namespace", "default\n"],
                 ["inspect", key + "\n"],
                 ["delete", "ab" * 33],  # 62 digits would be a key prefix
                 ["ls", "--tenant", "team-a\n"],
                 ["ls", "--prefix", "0a "],
                 ["export", "f", "--namespace", "a b"]):
        # nothing listens on port 1: a call would fail with 1, a usage error exits 2 first
        with pytest.raises(SystemExit) as info:
            cli_main(["admin", "--address", "127.0.0.1:1", *argv])
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        assert "is malformed" in err, err


def test_admin_import_refuses_a_file_with_a_malformed_name(names_server: ServerThread,
                                                           tmp_path: Path) -> None:
    from kdn.client.exportfile import MAGIC_V1 as MAGIC  # records without an end marker

    good = Record("default", b"g" * 32, b"", VALUE)
    path = tmp_path / "bad.kdnx"
    path.write_bytes(MAGIC + encode_record(good, 1) + encode_record(
        Record("default\n", b"b" * 32, b"", VALUE), 1))
    with AdminClient(names_server.address) as c:
        with pytest.raises(InvalidArgument, match=r"record 1: namespace 'default\\n'"):
            c.import_from(path)
        assert not c.contains(b"g" * 32)  # nothing of the file was sent
        with pytest.raises(InvalidArgument, match="namespace"):
            list(c.ls("default\n"))
        with pytest.raises(InvalidArgument, match="key must be 32 bytes"):
            c.inspect(b"short")


def test_the_client_names_a_newcomers_mistakes() -> None:
    from kdn.client import Client
    from kdn.names import check_key

    for bare in ("localhost", "10.0.0.5", "localhost:"):  # gRPC would dial port 443
        with pytest.raises(InvalidArgument, match="has no port; write HOST:PORT"):
            Client(bare)
    for bad in ("\udcff:50051", "ipv4:127.0.0.1:1,\udcff:2", "unix:/tmp/\udcff"):
        with pytest.raises(InvalidArgument, match="lone surrogate"):  # not gRPC's UnicodeError
            Client(bad)
    with pytest.raises(InvalidArgument, match="label empty or too long"):
        Client("a" * 64 + ".example:50051")
    with pytest.raises(InvalidArgument, match=r"bytes\.fromhex"):
        check_key("ab" * 32)  # a key as ``kdn admin ls`` prints it
    with pytest.raises(InvalidArgument, match="list of keys"):
        check_key(next(iter(b"\x01" * 32)))  # lookup(key) iterates one key's bytes
