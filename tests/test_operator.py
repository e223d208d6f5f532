"""Operator surface against real servers: tenants and API keys, roles, rate limits, quotas, TLS
and mutual TLS, Prometheus metrics, request ids, and the admin CLI end to end."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kdn import StoreOptions, keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.client.admin import AdminClient, read_records
from kdn.client.client import TLSOptions
from kdn.errors import NotFound, PermissionDenied, TooLarge, Unauthenticated, Unavailable
from kdn.server import ServerConfig, ServerThread
from kdn.server.rpc import IN_FLIGHT
from tests.helpers import make_certs, random_kv, uniform_layout

LAY = uniform_layout()
TENANTS = """
tenants:
  team-a: {api_keys: ["key-a"]}
  team-b: {api_keys: ["key-b"]}
  ops: {api_keys: ["sha256:%s"], role: admin}
  slow: {api_keys: ["key-slow"], rate_rps: 1, burst: 2}
  small: {api_keys: ["key-small"], quota_bytes: 30KiB}
"""


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[ServerThread]:
    from kdn.server.auth import digest

    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS % digest("key-ops"))
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth), metrics_port=0)
    with ServerThread(cfg) as st:
        yield st


def test_unauthenticated_calls_are_rejected(secured: ServerThread) -> None:
    key = keys.chunk_key([1], LAY)
    for api_key in (None, "wrong"):
        with Client(secured.address, api_key=api_key, retry=None) as c:
            with pytest.raises(Unauthenticated):
                c.lookup([key])
            with pytest.raises(Unauthenticated):
                c.store(key, random_kv(LAY, 4))
            with pytest.raises(Unauthenticated):
                c.retrieve(key)
            assert c.health() == "SERVING"  # probes need no key


def test_tenants_can_not_reach_each_other(secured: ServerThread) -> None:
    key = keys.chunk_key([7, 7], LAY)
    kv_a, kv_b = random_kv(LAY, 8, seed=1), random_kv(LAY, 8, seed=2)
    with AdminClient(secured.address, api_key="key-a") as a, \
            AdminClient(secured.address, api_key="key-b") as b:
        a.store(key, kv_a)
        # team-b knows the key hash, and still sees nothing of team-a's
        assert b.retrieve(key) is None
        assert not b.lookup([key]).infos[0].present
        assert b.delete(key) == 0
        with pytest.raises(NotFound):
            b.inspect(key)
        assert list(b.ls()) == []
        with pytest.raises(PermissionDenied):
            list(b.ls(tenant="team-a"))
        # the same key hash in team-b's space is a different entry
        b.store(key, kv_b)
        assert a.retrieve(key).equal(kv_a)  # type: ignore[union-attr]
        assert b.retrieve(key).equal(kv_b)  # type: ignore[union-attr]
        assert [e.tenant for e in a.ls()] == ["team-a"]
        # admin RPCs need the admin role (an evict of another tenant's entries too)
        for call in (lambda: b.evict([key], tenant="team-a"), lambda: b.pin([key]),
                     lambda: b.unpin([key]),
                     lambda: list(b.verify()), lambda: b.gc()):
            with pytest.raises(PermissionDenied):
                call()
        export = Path(secured.config.data_dir) / "b.kdnx"
        assert b.export_to(export) == 1
        assert [r.value for r in read_records(export)[0]] == [
            b.fetch(key).parts.to_bytes()]  # type: ignore[union-attr]
    with AdminClient(secured.address, api_key="key-ops") as ops:
        assert sorted(e.tenant for e in ops.ls()) == ["team-a", "team-b"]
        assert [e.tenant for e in ops.ls(tenant="team-b")] == ["team-b"]
        assert ops.pin([key]) == 0  # the admin's own (unscoped) space has no such key
        st = ops.stats()
        assert {t.tenant: t.entries for t in st.tenants} == {"team-a": 1, "team-b": 1}
    with AdminClient(secured.address, api_key="key-b") as b:  # a tenant evicts its own entries
        assert b.evict([key], tier="ram") == 1


def test_a_tenant_sees_its_own_share_of_the_stats_not_the_servers(secured: ServerThread
                                                                   ) -> None:
    """Stats from a tenant's key: its own entries, the tiers' health and the calls in flight;
    no server-wide counts (entries, hits, requests), which tell other tenants' traffic. An
    admin sees them all."""
    with Client(secured.address, api_key="key-a") as a:
        for i in range(3):
            a.store(keys.chunk_key([i], LAY), random_kv(LAY, 4, seed=i))
        assert a.retrieve(keys.chunk_key([0], LAY)) is not None
    with Client(secured.address, api_key="key-b") as b:
        b.store(keys.chunk_key([9], LAY), random_kv(LAY, 4))
        st = b.stats()
        assert {t.tenant: t.entries for t in st.tenants} == {"team-b": 1}
        ram = {t.name: t for t in st.tiers}["ram"]
        assert ram.healthy and ram.capacity_bytes > 0
        assert (ram.entries, ram.bytes, ram.hits, ram.misses) == (0, 0, 0, 0)
        assert set(st.counters) == {IN_FLIGHT} and st.health == "serving"
    with Client(secured.address, api_key="key-ops") as ops:
        st = ops.stats()
        assert {t.name: t for t in st.tiers}["ram"].entries == 4
        assert {t.tenant: t.entries for t in st.tenants} == {"team-a": 3, "team-b": 1}
        assert len(st.counters) > 1


def test_an_admin_reaches_tenants_entries_by_key(secured: ServerThread,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What an admin's ``ls`` shows it can inspect, pin, evict and delete by key (``tenant``,
    ``--tenant``); its namespace filter spans every tenant; a tenant naming another one is
    refused (PERMISSION_DENIED)."""
    key = keys.chunk_key([5, 5], LAY)
    kvs = {api_key: random_kv(LAY, 8, seed=i) for i, api_key in enumerate(("key-a", "key-b"))}
    for api_key, kv in kvs.items():
        with Client(secured.address, api_key=api_key) as c:
            c.store(key, kv)
    with AdminClient(secured.address, api_key="key-ops") as ops:
        assert sorted(e.tenant for e in ops.ls("default")) == ["team-a", "team-b"]
        assert [e.tenant for e in ops.ls("default", tenant="team-b")] == ["team-b"]
        with pytest.raises(NotFound):
            ops.inspect(key)  # the admin's own key space
        info = ops.inspect(key, tenant="team-b")
        assert (info.tenant, info.num_layers) == ("team-b", LAY.num_layers)
        assert ops.pin([key], tenant="team-a") == 1
        assert [e.pinned for e in ops.ls(tenant="team-a")] == [True]
        assert ops.unpin([key], tenant="team-a") == 1
        assert ops.evict([key], tenant="team-a") == 1
        assert list(ops.inspect(key, tenant="team-a").tiers) == ["disk"]
        assert ops.delete(key, tenant="team-b") == 1
        assert [e.tenant for e in ops.ls()] == ["team-a"]
    with AdminClient(secured.address, api_key="key-a") as a:
        assert a.inspect(key, tenant="team-a").tenant == "team-a"  # its own: as without
        for call in (lambda: a.inspect(key, tenant="team-b"),
                     lambda: list(a.ls(tenant="team-b")),
                     lambda: a.delete(key, tenant="team-b"),
                     lambda: a.pin([key], tenant="team-a")):  # pin: admins only
            with pytest.raises(PermissionDenied):
                call()
    for api_key, kv in kvs.items():  # both back, each in RAM
        with Client(secured.address, api_key=api_key) as c:
            c.store(key, kv)
    ops_cli = ["--address", secured.address, "--api-key", "key-ops", "-o", "json"]
    code, out = _run(capsys, "ls", "--namespace", "default", *ops_cli)
    assert code == 0 and sorted(r["tenant"] for r in json.loads(out)) == ["team-a", "team-b"]
    code, out = _run(capsys, "inspect", key.hex()[:8], "--tenant", "team-b", *ops_cli)
    assert code == 0 and json.loads(out)["tenant"] == "team-b"
    for cmd, word in (("pin", "pinned"), ("unpin", "unpinned"), ("evict", "evicted"),
                      ("delete", "deleted")):
        code, out = _run(capsys, cmd, key.hex()[:8], "--tenant", "team-a", *ops_cli)
        assert code == 0 and json.loads(out) == {word: 1}, (cmd, out)
    code, out = _run(capsys, "ls", *ops_cli)
    assert [r["tenant"] for r in json.loads(out)] == ["team-b"]
    # the prefix ls printed, without --tenant: the admin's own key space, and the tenant named
    assert cli(["admin", "inspect", key.hex()[:8], *ops_cli]) == 1
    assert "it is tenant team-b's; add --tenant team-b" in capsys.readouterr().err
    with AdminClient(secured.address, api_key="key-ops") as ops:
        ops.store(key, kvs["key-a"])  # its own copy too: that is the one acted on
    code, out = _run(capsys, "inspect", key.hex()[:8], *ops_cli)
    assert code == 0 and json.loads(out)["tenant"] == "ops"
    a_cli = ["--address", secured.address, "--api-key", "key-a"]
    assert cli(["admin", "delete", key.hex(), "--tenant", "team-b", *a_cli]) == 1
    assert "only admins can" in capsys.readouterr().err


def test_a_fleet_node_that_refuses_the_caller_is_a_row_not_the_end_of_the_view(
        secured: ServerThread) -> None:
    """A node answering UNAUTHENTICATED aborted ``kdn admin fleet`` (exit 2, "or pass
    --insecure"); it is a row of its own, every field there, the refusal its error."""
    from kdn.client.fleet import fleet_view

    rows = fleet_view([secured.address, secured.address], timeout_s=5)
    assert [r["status"] for r in rows] == ["REFUSED"] * 2
    assert rows[0]["error"].startswith("UNAUTHENTICATED") and rows[0]["ram_bytes"] is None
    ok = fleet_view([secured.address], timeout_s=5, api_key="key-a")
    assert ok[0]["status"] == "SERVING" and ok[0]["error"] == ""


def test_rate_limit_and_quota(secured: ServerThread) -> None:
    with Client(secured.address, api_key="key-slow", retry=None) as c:
        outcomes = []
        for _ in range(6):
            try:
                c.lookup([keys.chunk_key([1], LAY)])
                outcomes.append("ok")
            except TooLarge as exc:
                assert "requests/s" in str(exc)
                outcomes.append("limited")
        assert outcomes[:2] == ["ok", "ok"] and "limited" in outcomes
    with Client(secured.address, api_key="key-small") as c:
        k1, k2 = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
        c.store(k1, random_kv(LAY, 32), mode="raw")  # ~16 KiB
        with pytest.raises(TooLarge, match="quota"):
            c.store(k2, random_kv(LAY, 32), mode="raw")
        assert c.retrieve(k2) is None
        c.delete(k1)
        c.store(k2, random_kv(LAY, 32), mode="raw")  # room again


@pytest.mark.parametrize("path", ["same-host", "grpc", "data-path"])
def test_a_batch_past_the_quota_stores_nothing_of_it(secured: ServerThread, path: str) -> None:
    """store_many of 3 entries of ~16 KiB under a 30 KiB quota: the first fitted and stayed
    stored (and charged) while the call answered RESOURCE_EXHAUSTED, on every way a batch
    goes (the same-host PutMany, gRPC's StoreMany, the data path's streamed PutMany)."""
    opts = {"same-host": {}, "grpc": {"shm_bytes": 0, "data_path": False},
            "data-path": {"shm_bytes": 0, "data_path": True}}[path]
    with Client(secured.address, api_key="key-small", **opts) as c:  # type: ignore[arg-type]
        ks = [keys.chunk_key([i, 7], LAY) for i in range(3)]
        before = sum(t.bytes for t in c.stats().tenants)
        with pytest.raises(TooLarge, match="quota"):
            c.store_many([(k, random_kv(LAY, 32, seed=i)) for i, k in enumerate(ks)],
                         mode="raw")
        assert [c.fetch(k) for k in ks] == [None] * 3
        assert sum(t.bytes for t in c.stats().tenants) == before  # nothing charged
        c.store_many([(ks[0], random_kv(LAY, 32))], mode="raw")  # one fits
        assert c.fetch(ks[0]) is not None
        c.delete(ks[0])


def test_a_store_past_the_quota_is_refused_from_its_header(secured: ServerThread) -> None:
    """A Store header declaring more than the tenant's quota is refused before its frames are
    received (it was received and buffered whole, then refused at commit): the stream ends
    after the header here, and the answer is the quota, not a truncated entry."""
    from kdn import codec
    from kdn.transport.metadata import API_KEY_HEADER
    from kdn.v1 import kdn_pb2 as pb
    from kdn.v1 import kdn_pb2_grpc as pb_grpc

    parts = codec.encode_parts(random_kv(LAY, 32), "raw")
    head = pb.StoreHeader(namespace="default", key=keys.chunk_key([9], LAY),
                          container_header=parts.header, total_bytes=100 << 20)
    with grpc.insecure_channel(secured.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KDNStub(ch).Store(iter([pb.StoreRequest(header=head)]), timeout=30,
                                      metadata=((API_KEY_HEADER, "key-small"),))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota: this entry adds 104857600 bytes" in (err.value.details() or "")


def test_metrics_and_request_ids(secured: ServerThread, caplog: pytest.LogCaptureFixture
                                 ) -> None:
    key = keys.chunk_key([3], LAY)
    with caplog.at_level(logging.INFO, logger="kdn.access"):
        with Client(secured.address, api_key="key-a", shm_bytes=0,  # the Store RPC
                    data_path=False) as c:
            c.store(key, random_kv(LAY, 4))
            rid = c.last_request_id
            assert c.retrieve(key) is not None  # a whole entry: GetMany
            stream = c.retrieve_stream(key)  # layer by layer: the Retrieve RPC
            assert stream is not None and stream.result() is not None
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kdn.access"]
    store_line = next(x for x in lines if x["request_id"] == rid)
    assert store_line["rpc"] == "Store" and store_line["code"] == "OK"
    assert store_line["tenant"] == "team-a"
    assert secured.server is not None
    url = f"http://127.0.0.1:{secured.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'kdn_requests_total{code="OK",rpc="Store"}' in text
    assert 'kdn_request_seconds_bucket{le="0.005",rpc="Retrieve"}' in text
    assert 'kdn_request_seconds_bucket{le="0.005",rpc="GetMany"}' in text
    assert 'kdn_tier_hits_total{tier="ram"}' in text
    assert 'kdn_queue_depth' in text and 'kdn_events_total{event="store.ok"}' in text


# ---------------------------------------------------------------- TLS


def _certs(tmp: Path) -> dict[str, Path]:
    return make_certs(tmp)


def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    c = _certs(tmp_path)
    key = keys.chunk_key([5], LAY)
    kv = random_kv(LAY, 4)
    tls = ServerConfig(port=0, data_dir=tmp_path / "d1", disk_bytes=0,
                       tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]))
    with ServerThread(tls) as st:
        with Client(st.address, tls=TLSOptions(ca=c["ca.crt"].read_bytes())) as ok:
            ok.store(key, kv)
            assert ok.retrieve(key).equal(kv)  # type: ignore[union-attr]
        with Client(st.address, timeout_s=3, retry=None) as plain:
            with pytest.raises(Unavailable):
                plain.lookup([key])
    mtls = ServerConfig(port=0, data_dir=tmp_path / "d2", disk_bytes=0,
                        tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]),
                        tls_client_ca=str(c["ca.crt"]))
    with ServerThread(mtls) as st:
        anon = TLSOptions(ca=c["ca.crt"].read_bytes())
        with Client(st.address, tls=anon, timeout_s=3, retry=None) as no_cert:
            with pytest.raises(Unavailable):
                no_cert.lookup([key])
        mine = TLSOptions(ca=c["ca.crt"].read_bytes(), cert=c["client.crt"].read_bytes(),
                          key=c["client.key"].read_bytes())
        with Client(st.address, tls=mine) as ok:
            ok.store(key, kv)
            assert ok.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_bad_security_settings_are_named(tmp_path: Path) -> None:
    from kdn.errors import ConfigError
    from kdn.server.auth import load_auth

    with pytest.raises(ConfigError, match="tls_cert/tls_key"):
        ServerConfig(tls_cert=__file__)
    with pytest.raises(ConfigError, match="auth_file: no such file"):
        ServerConfig(auth_file=str(tmp_path / "nope.yaml"))
    bad = tmp_path / "t.yaml"
    bad.write_text("tenants:\n  Team A: {api_keys: [x]}\n")
    with pytest.raises(ConfigError, match="tenant .Team A. is malformed"):
        load_auth(bad)
    bad.write_text("tenants:\n  a: {api_keys: [x], role: god}\n")
    with pytest.raises(ConfigError, match="role"):
        load_auth(bad)


# ---------------------------------------------------------------- admin CLI


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli(["admin", *args])
    return code, capsys.readouterr().out


def test_admin_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src_cfg = ServerConfig(port=0, data_dir=tmp_path / "src", ram_bytes=64 << 20)
    dst_cfg = ServerConfig(port=0, data_dir=tmp_path / "dst")
    kvs = {keys.chunk_key([i], LAY): random_kv(LAY, 16, seed=i) for i in range(6)}
    with ServerThread(src_cfg) as src, ServerThread(dst_cfg) as dst:
        with Client(src.address) as c:
            for k, kv in kvs.items():
                c.store(k, kv, namespace="kb")
        a = ["--address", src.address]
        code, out = _run(capsys, *a, "--json", "ls", "--namespace", "kb")
        rows = json.loads(out)
        assert code == 0 and len(rows) == 6 and all(r["tiers"] == ["ram", "disk"] for r in rows)
        assert all(isinstance(r["size_bytes"], int) and r["tokens"] == 16 for r in rows)
        assert all(0 <= r["age_seconds"] < 60 for r in rows)  # real ages, typed
        # options anywhere after their command (kubectl's convention): same answer
        code, out2 = _run(capsys, "ls", "--namespace", "kb", "-o", "json", *a)
        assert code == 0 and [r["key"] for r in json.loads(out2)] == [r["key"] for r in rows]
        first = sorted(kvs)[0].hex()
        code, out = _run(capsys, *a, "--json", "ls", "--prefix", first[:6])
        assert [r["key"] for r in json.loads(out)] == [first]
        code, out = _run(capsys, *a, "--json", "inspect", first, "--namespace", "kb")
        info = json.loads(out)
        assert code == 0 and info["tokens"] == 16 and len(info["layout"]["layers"]) == 4
        assert _run(capsys, *a, "pin", first, "--namespace", "kb")[0] == 0
        code, out = _run(capsys, *a, "--json", "ls", "--namespace", "kb")
        assert next(r for r in json.loads(out) if r["key"] == first)["pinned"] is True
        assert _run(capsys, *a, "evict", first, "--namespace", "kb")[0] == 1  # pinned: refused
        assert _run(capsys, *a, "unpin", first, "--namespace", "kb")[0] == 0
        code, out = _run(capsys, *a, "--json", "evict", first, "--namespace", "kb")
        assert code == 0 and json.loads(out) == {"evicted": 1}
        code, out = _run(capsys, *a, "--json", "inspect", first, "--namespace", "kb")
        assert json.loads(out)["tiers"] == ["disk"]
        # export, interrupted (torn tail), resumed, imported twice
        export = tmp_path / "kb.kdnx"
        assert _run(capsys, *a, "export", str(export), "--namespace", "kb")[0] == 0
        full = export.read_bytes()
        export.write_bytes(full[: len(full) * 2 // 3])  # an export cut off mid-record
        code, out = _run(capsys, *a, "--json", "export", str(export), "--namespace", "kb")
        assert code == 0 and json.loads(out)["entries"] == 6
        assert export.read_bytes() == full
        b = ["--address", dst.address]
        code, out = _run(capsys, *b, "--json", "import", str(export))
        assert code == 0 and json.loads(out)["imported"] == 6
        code, out = _run(capsys, *b, "--json", "import", str(export))
        assert json.loads(out)["skipped"] == 6
        with Client(dst.address) as d:
            for k, kv in kvs.items():
                assert d.retrieve(k, namespace="kb").equal(kv)  # type: ignore[union-attr]
        # verify finds a corrupted disk copy and removes it
        assert src.server is not None
        disk = next(t for t in src.server.store.tiers if t.name == "disk")
        victim = sorted(disk.keys(b"kb/"))[1]
        bad = bytearray(disk.get(victim) or b"")
        bad[len(bad) // 2] ^= 0xFF
        disk.put(victim, bytes(bad))
        code, out = _run(capsys, *a, "--json", "verify")
        report = json.loads(out)
        assert code == 1 and report["disk"]["corrupt"] == 1 and report["disk"]["removed"] == 1
        assert _run(capsys, *a, "verify")[0] == 0
        code, out = _run(capsys, *a, "--json", "gc")
        assert code == 0 and "removed" in json.loads(out)
        code, out = _run(capsys, *a, "delete", first, "--namespace", "kb")
        assert code == 0 and _run(capsys, *a, "delete", first, "--namespace", "kb")[0] == 1
        with pytest.raises(SystemExit) as usage:  # a malformed key is a usage error (exit 2)
            _run(capsys, *a, "inspect", "zz")
        assert usage.value.code == 2 and "key 'zz' is malformed" in capsys.readouterr().err
        assert _run(capsys, *a, "stats")[0] == 0


def test_grpc_status_for_wrong_role_is_permission_denied(secured: ServerThread) -> None:
    with grpc.insecure_channel(secured.address) as ch:
        from kdn.v1 import kdn_pb2 as pb
        from kdn.v1 import kdn_pb2_grpc as pb_grpc

        stub = pb_grpc.KDNAdminStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Gc(pb.GcRequest(), metadata=(("x-kdn-api-key", "key-a"),), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            stub.Gc(pb.GcRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_is_named_only_to_a_server_that_takes_it(
        secured: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server older than the tenant field of admin requests ignores it and would act on the
    admin's own entries: the client asks what the server takes (Stats ``features``) and
    refuses to name a tenant to one that does not say so, before anything is sent."""
    from kdn.errors import InvalidArgument
    from kdn.server import service

    key = keys.chunk_key([6, 6], LAY)
    for api_key in ("key-a", "key-ops"):
        with Client(secured.address, api_key=api_key) as c:
            c.store(key, random_kv(LAY, 8, seed=1))
    monkeypatch.setattr(service, "FEATURES", ())  # as an older server answers Stats
    with AdminClient(secured.address, api_key="key-ops") as ops:
        for act in (lambda: ops.delete(key, tenant="team-a"),
                    lambda: ops.evict([key], tenant="team-a"),
                    lambda: ops.inspect(key, tenant="team-a")):
            with pytest.raises(InvalidArgument, match="older kdn"):
                act()
        assert ops.contains(key)  # its own entry is still there
        assert ops.delete(key) == 1  # no tenant named: as before


def test_event_counts_are_exact_under_threads_and_stats_has_the_admins(tmp_path: Path) -> None:
    """The servicers' event counts are bumped from many threads at once and lose none (an
    unlocked read-modify-write lost about one in ten); an admin call's count (a refused
    Evict) is in the Stats answer as on /metrics (it was on /metrics only)."""
    import threading

    from kdn.server.rpc import Counters

    counts = Counters()
    workers = [threading.Thread(target=lambda: [counts.add("n") for _ in range(50_000)])
               for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert counts.snapshot() == {"n": 200_000}

    lay = uniform_layout(layers=1, heads=1, dim=8)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=8 << 20, metrics_port=0)
    with ServerThread(cfg) as st, AdminClient(st.address, shm_bytes=0) as c:
        assert st.server is not None and st.server.metrics_port
        k = keys.chunk_key([1], lay)
        c.store(k, random_kv(lay, 4), mode="raw")
        c.pin([k])
        with pytest.raises(Exception, match="pinned"):
            c.evict([k])
        assert dict(c.stats().counters).get("Evict.INVALID_ARGUMENT") == 1
        text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert 'kdn_events_total{event="Evict.INVALID_ARGUMENT"} 1.0' in text


def test_a_pin_whose_entry_expired_is_dropped_by_evict_and_gc(tmp_path: Path) -> None:
    """A pinned entry that expired leaves its pin in the server's pin set until something asks:
    evict of the key is not refused as pinned, and gc drops every such pin."""
    lay = uniform_layout(layers=1, heads=1, dim=8)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=8 << 20)
    with ServerThread(cfg) as st, AdminClient(st.address, shm_bytes=0) as c:
        assert st.server is not None
        store = st.server.store
        a, b, live = (keys.chunk_key([i], lay) for i in (1, 2, 3))
        for k in (a, b):
            c.store(k, random_kv(lay, 4), mode="raw", options=StoreOptions(ttl_s=1, pin=True))
        c.store(live, random_kv(lay, 4), mode="raw", options=StoreOptions(pin=True))
        assert len(store.pinned()) == 3
        time.sleep(1.1)
        assert c.evict([a]) == 0  # its entry expired: not refused as pinned
        assert len(store.pinned()) == 2
        c.gc()
        assert len(store.pinned()) == 1
        with pytest.raises(Exception, match="pinned"):
            c.evict([live])


def test_admin_key_calls_act_on_the_clients_namespace(tmp_path: Path) -> None:
    """pin, unpin, inspect and evict without a namespace act on the client's, as store and
    delete do (they acted on 'default': a count of 0, NotFound, or another entry)."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=8 << 20)
    key = keys.chunk_key([1], LAY)
    with ServerThread(cfg) as st, AdminClient(st.address, namespace="ns1", shm_bytes=0) as c:
        c.store(key, random_kv(LAY, 4), mode="raw")
        assert c.pin([key]) == 1 and c.inspect(key).pinned
        assert c.unpin([key]) == 1 and c.evict([key]) == 1
        with pytest.raises(NotFound, match="'default'"):
            c.inspect(key, "default")


@pytest.mark.redis
def test_pin_of_an_entry_only_redis_holds_is_refused(tmp_path: Path) -> None:
    """Redis evicts as its maxmemory chooses, pinned or not: an entry only it holds (evicted
    from RAM, no disk tier) is not pinned, and the store of one only it would take is refused."""
    from kdn.errors import InvalidArgument
    from tests.redis_servers import RedisServer

    lay = uniform_layout(layers=1, heads=1, dim=8)
    with RedisServer(tmp_path / "redis", appendonly=False) as r:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, redis_url=r.url,
                           ram_bytes=1 << 20, shm_arena_bytes=0)
        with ServerThread(cfg) as st, AdminClient(st.address, shm_bytes=0) as c:
            k, big = keys.chunk_key([1], lay), keys.chunk_key([2], lay)
            c.store(k, random_kv(lay, 4), mode="raw")
            assert c.evict([k], tier="ram") == 1
            with pytest.raises(InvalidArgument, match="only by a tier that does not keep pins"
                               ".*a read brings one that fits into RAM"):
                c.pin([k])
            assert not c.inspect(k).pinned
            with pytest.raises(TooLarge, match="no tier that keeps pinned entries"):
                c.store(big, random_kv(lay, 50_000), mode="raw",
                        options=StoreOptions(pin=True))
            c.store(big, random_kv(lay, 50_000), mode="raw")  # unpinned: Redis takes it
            assert c.lookup([big]).infos[0].tier == "redis"
            with pytest.raises(InvalidArgument, match="one is larger than RAM"):
                c.pin([big])  # no read brings it into RAM


@pytest.mark.redis
def test_pin_counts_a_disk_write_still_queued(tmp_path: Path) -> None:
    """Write-behind: a SHARED entry larger than RAM is acknowledged from Redis, its disk copy
    still queued; a pin then counts the disk tier (it keeps pins), not Redis alone."""
    import threading

    from tests.redis_servers import RedisServer

    lay = uniform_layout(layers=1, heads=1, dim=8)
    with RedisServer(tmp_path / "redis", appendonly=False) as r:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=64 << 20,
                           redis_url=r.url, ram_bytes=1 << 20, write_policy="write-behind",
                           shm_arena_bytes=0, data_port=-1)
        with ServerThread(cfg) as st, AdminClient(st.address, shm_bytes=0) as c:
            store = st.server.servicer.store
            disk, go = store.tiers[2], threading.Event()
            put = disk.put
            disk.put = lambda *a, **kw: go.wait(10) and put(*a, **kw)  # type: ignore[method-assign]
            k = keys.chunk_key([1], lay)
            try:
                c.store(k, random_kv(lay, 50_000), mode="raw",
                        options=StoreOptions(durability="shared"))
                assert store.queue_depth()["disk"] == 1
                assert c.pin([k]) == 1
            finally:
                go.set()
            assert store.flush(10) and c.inspect(k).pinned
            assert [t.name for t in store.where(store.keys()[0])] == ["redis", "disk"]
