"""Secure by default (issue 24 items 1–3), against real servers and processes: no API key
crosses a non-loopback plaintext connection unless both sides say so; secrets readable by
others are refused; a client certificate names a tenant and is never admin by default; failed
authentications are logged and counted; idle connections are closed and connections capped;
unusable certificates stop the start with a sentence naming the file."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.client import TLSOptions
from kdn.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import digest
from tests.helpers import eventually, make_certs, random_kv, uniform_layout

ROOT = Path(__file__).resolve().parents[1]
LAY = uniform_layout(layers=2, heads=2, dim=8)


def _auth_file(tmp: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp / "tenants.yaml"
    path.write_text(text)
    path.chmod(mode)
    return path


TENANTS = ('tenants:\n  team-a: {api_keys: ["key-a"]}\n'
           '  ops: {api_keys: ["sha256:' + digest("key-ops") + '"], role: admin}\n')


# ------------------------------------------------------------- plaintext keys


def test_a_server_with_keys_and_no_tls_on_the_network_needs_insecure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    auth = _auth_file(tmp_path, TENANTS)
    with pytest.raises(ConfigError, match=r"API keys would cross the network in plaintext on "
                                          r"0\.0\.0\.0; set tls_cert"):
        ServerConfig(host="0.0.0.0", auth_file=str(auth), data_dir=tmp_path / "d")
    ServerConfig(host="127.0.0.1", auth_file=str(auth), data_dir=tmp_path / "d")  # loopback
    cfg = ServerConfig(host="0.0.0.0", port=0, auth_file=str(auth), insecure=True,
                       data_dir=tmp_path / "d")
    with caplog.at_level(logging.WARNING, logger="kdn.server.app"):
        with ServerThread(cfg):
            pass
    assert any("insecure: API keys travel in plaintext" in r.getMessage()
               for r in caplog.records)
    run = subprocess.run([sys.executable, "-m", "kdn", "serve", "--host", "0.0.0.0",
                          "--auth-file", str(auth), "--data-dir", str(tmp_path / "e")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "plaintext" in run.stderr and "Traceback" not in run.stderr


def test_a_client_does_not_send_a_key_in_plaintext_off_this_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KDN_INSECURE", raising=False)
    with pytest.raises(InvalidArgument, match="refusing to send an API key in plaintext to "
                                              "10.0.0.7:50051"):
        Client("10.0.0.7:50051", api_key="secret")
    Client("10.0.0.7:50051", api_key="secret", insecure=True).close()  # said so: allowed
    Client("10.0.0.7:50051").close()  # no key: nothing to leak
    Client("127.0.0.1:50051", api_key="secret").close()  # loopback
    Client("10.0.0.7:50051", api_key="secret", tls=TLSOptions()).close()
    monkeypatch.setenv("KDN_INSECURE", "1")
    Client("10.0.0.7:50051", api_key="secret").close()
    monkeypatch.delenv("KDN_INSECURE")
    run = subprocess.run([sys.executable, "-m", "kdn", "admin", "stats", "--address",
                          "10.0.0.7:50051", "--api-key", "secret"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT,
                         env={"PATH": "", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and "refusing to send an API key" in run.stderr
    assert "--insecure" in run.stderr and "secret" not in run.stderr


def test_secrets_readable_by_others_are_refused(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    auth = _auth_file(tmp_path, TENANTS, mode=0o644)
    with pytest.raises(ConfigError, match=rf"auth_file: {auth} can be read by other users "
                                          rf"\(mode 0o644\); run chmod 600 {auth}"):
        ServerConfig(auth_file=str(auth))
    certs = make_certs(tmp_path)
    certs["server.key"].chmod(0o604)
    with pytest.raises(ConfigError, match="tls_key: .* can be read by other users"):
        ServerConfig(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    certs["server.key"].chmod(0o640)  # shared with a group (Kubernetes' fsGroup): a warning
    with caplog.at_level(logging.WARNING, logger="kdn.server.config"):
        ServerConfig(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    assert any("can be read by its group" in r.getMessage() for r in caplog.records)


def test_tenants_from_an_environment_variable_hold_digests_only(tmp_path: Path) -> None:
    env = {"KDN_AUTH_TENANTS": '{team-a: {api_keys: ["sha256:' + digest("key-a") + '"]}}'}
    from kdn.server.config import load_config

    cfg = load_config(env=env, flags={"port": 0, "data_dir": str(tmp_path / "d")})
    key = keys.chunk_key([4], LAY)
    with ServerThread(cfg) as st:
        with Client(st.address, api_key="key-a", retry=None) as c:
            assert c.lookup([key]).infos[0].present is False
        with Client(st.address, api_key="nope", retry=None) as c:
            with pytest.raises(Unauthenticated):
                c.lookup([key])
    with pytest.raises(ConfigError, match="must be sha256:HEX digests"):
        from kdn.server.auth import tenants_from_text

        tenants_from_text('{team-a: {api_keys: ["key-a"]}}')


def test_unusable_certificates_stop_the_start_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = make_certs(tmp_path / "a"), make_certs(tmp_path / "b")
    run = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", "0",
                          "--data-dir", str(tmp_path / "d"), "--tls-cert", str(a["server.crt"]),
                          "--tls-key", str(b["server.key"])], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert f"tls_key {b['server.key']} is not the private key of the certificate" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="not a usable PEM certificate and key"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "e", tls_cert=str(garbage),
                                       tls_key=str(a["server.key"]))):
            pass


# ------------------------------------------------------------- mTLS identities


def _mtls(c: dict[str, Path], name: str) -> TLSOptions:
    return TLSOptions(ca=c["ca.crt"].read_bytes(), cert=c[f"{name}.crt"].read_bytes(),
                      key=c[f"{name}.key"].read_bytes())


def test_a_certificate_alone_is_never_admin_by_default(tmp_path: Path) -> None:
    c = make_certs(tmp_path, clients=("engine-1",))
    key, kv = keys.chunk_key([1], LAY), random_kv(LAY, 4)
    base = dict(port=0, tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]),
                tls_client_ca=str(c["ca.crt"]), disk_bytes=0)
    with ServerThread(ServerConfig(data_dir=tmp_path / "d1", **base)) as st:  # type: ignore[arg-type]
        with AdminClient(st.address, tls=_mtls(c, "engine-1"), retry=None) as cl:
            cl.store(key, kv)  # a tenant of the unscoped key space
            assert cl.retrieve(key).equal(kv)  # type: ignore[union-attr]
            with pytest.raises(PermissionDenied):
                cl.gc()  # not an admin
    cfg = ServerConfig(data_dir=tmp_path / "d2", mtls_role="admin", **base)  # type: ignore[arg-type]
    with ServerThread(cfg) as st, AdminClient(st.address, tls=_mtls(c, "engine-1")) as cl:
        cl.gc()  # the operator said so
    cfg = ServerConfig(data_dir=tmp_path / "d3", mtls_role="none", **base)  # type: ignore[arg-type]
    with ServerThread(cfg) as st:
        with Client(st.address, tls=_mtls(c, "engine-1"), retry=None) as cl:
            with pytest.raises(Unauthenticated, match="needs an API key besides"):
                cl.lookup([key])


def test_certificate_subjects_name_tenants(tmp_path: Path) -> None:
    c = make_certs(tmp_path, clients=("engine-a", "ops-console", "stranger"),
                   client_sans={"engine-a": ["engine-a.internal"]})
    auth = _auth_file(tmp_path, 'tenants:\n  team-a: {subjects: ["engine-a.internal"]}\n'
                                '  ops: {subjects: ["ops-console"], role: admin}\n'
                                '  team-b: {api_keys: ["key-b"]}\n')
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth),
                       tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]),
                       tls_client_ca=str(c["ca.crt"]))
    key, kv = keys.chunk_key([2], LAY), random_kv(LAY, 4)
    with ServerThread(cfg) as st:
        with Client(st.address, tls=_mtls(c, "engine-a"), retry=None) as a:  # by its SAN
            a.store(key, kv)
        with Client(st.address, tls=_mtls(c, "stranger"), api_key="key-b", retry=None) as b:
            assert b.retrieve(key) is None  # team-b can not see team-a's entry
        with AdminClient(st.address, tls=_mtls(c, "ops-console"), retry=None) as ops:  # CN
            assert {e.tenant for e in ops.ls()} == {"team-a"}
            ops.gc()
        with Client(st.address, tls=_mtls(c, "stranger"), retry=None) as s:
            with pytest.raises(Unauthenticated, match="is no tenant's"):
                s.lookup([key])


# ------------------------------------------------------------- audit, limits


def test_failed_authentications_are_logged_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    auth = _auth_file(tmp_path, TENANTS)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth), metrics_port=0)
    key = keys.chunk_key([3], LAY)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"), ServerThread(cfg) as st:
        for api_key in ("wrong-key-123", None, "wrong-key-456"):
            with Client(st.address, api_key=api_key, retry=None) as cl:
                with pytest.raises(Unauthenticated):
                    cl.lookup([key])
        assert st.server is not None
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'kdn_auth_failures_total{reason="unknown_key"} 2.0' in text
    assert 'kdn_auth_failures_total{reason="missing_key"} 1.0' in text
    lines = [r.getMessage() for r in caplog.records if r.name == "kdn.audit"]
    assert len(lines) == 3 and all('"event": "auth_failed"' in x and "127.0.0.1" in x
                                   for x in lines)
    assert not any("wrong-key" in x for x in lines)  # never the key


def test_the_audit_log_is_rate_limited_and_says_what_it_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    from kdn.server.observe import AuditLog

    audit = AuditLog(per_second=5)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"):
        for _ in range(50):
            audit.log("unknown_key", "ipv4:10.1.2.3:5555", "r")
        time.sleep(0.5)
        audit.log("unknown_key", "ipv4:10.1.2.3:5555", "r")
    lines = [r.getMessage() for r in caplog.records]
    assert 5 <= len(lines) <= 7
    assert '"not_logged_before": 45' in lines[-1] or '"not_logged_before": 44' in lines[-1]


def test_idle_connections_are_closed_and_connections_capped(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", idle_timeout_s=1, max_connections=4)
    with ServerThread(cfg) as st:
        port = int(st.address.rsplit(":", 1)[1])
        # HTTP/2 connections that never make a call (no key needed to open one)
        socks = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
            socks.append(s)

        def all_closed() -> bool:
            for s in socks:
                s.settimeout(0.05)
                try:
                    while s.recv(65536):
                        pass
                except (TimeoutError, BlockingIOError):
                    return False
            return True

        assert eventually(all_closed, timeout=10, interval=0.2)
        channels = [grpc.insecure_channel(st.address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(6)]
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        codes = []
        for ch in channels:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
        assert codes[:4] == ["OK"] * 4 and "UNAVAILABLE" in codes[4:], codes
        for ch in channels:
            ch.close()
        for s in socks:
            s.close()
