"""Audit and limits (issue 24 item 3), against real servers and a real ``kdn serve`` process:
every failed authentication is an audit line (rate-limited, with the peer, never the key) and a
count by reason in ``kdn_auth_failures_total``; connections that carry no call are closed by the
idle timeout, connections that never finish their handshake by the handshake timeout, old ones
are asked to go (GOAWAY max_age); connections are capped, and so are calls per connection.

The speed side of the 1,000-idle-connections target (a legitimate client's p99) is a benchmark,
``bench/security.py``, not a timed test."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.client import TLSOptions
from kdn.errors import RateLimited, TooLarge, Unauthenticated
from kdn.server import ServerConfig, ServerThread
from kdn.server.app import grpc_options
from kdn.server.auth import digest
from kdn.server.observe import AuditLog
from tests.helpers import eventually, make_certs, random_kv, uniform_layout
from tests.test_mtls_identity import issue

ROOT = Path(__file__).resolve().parents[1]
LAY = uniform_layout(layers=2, heads=2, dim=8)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + SETTINGS
TENANTS = ('tenants:\n  team-a: {api_keys: ["key-a"]}\n'
           '  ops: {api_keys: ["sha256:' + digest("key-ops") + '"], role: admin}\n')


def _auth_file(tmp: Path, text: str = TENANTS) -> Path:
    path = tmp / "tenants.yaml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def _scrape_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _scrape(port: int) -> dict[str, float]:
    text = _scrape_text(port)
    return {line.split("{")[1].split("}")[0].split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("kdn_auth_failures_total{")}


def _audit(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kdn.audit"]


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (reading what it sent so far)."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


# ------------------------------------------------------------- failed authentications


def test_failed_authentications_are_logged_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(_auth_file(tmp_path)),
                       metrics_port=0, disk_bytes=0)
    key = keys.chunk_key([3], LAY)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"), ServerThread(cfg) as st:
        for api_key in ("wrong-key-123", None, "wrong-key-456"):
            with Client(st.address, api_key=api_key, retry=None) as cl:
                with pytest.raises(Unauthenticated):
                    cl.lookup([key])
        with grpc.insecure_channel(st.address) as ch:  # a bearer token, on the admin service
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary("/kdn.v1.KDNAdmin/Gc")(
                    b"", metadata=(("authorization", "Bearer wrong-bearer-789"),
                                   ("x-request-id", "probe-1")), timeout=10)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with Client(st.address, api_key="key-a", retry=None) as ok:  # a success: no line
            ok.lookup([key])
        assert st.server is not None
        counts = _scrape(st.server.metrics_port)
    assert counts == {"unknown_key": 3.0, "missing_key": 1.0}
    lines = _audit(caplog)
    assert [x["reason"] for x in lines] == ["unknown_key", "missing_key", "unknown_key",
                                           "unknown_key"]
    assert all(x["event"] == "auth_failed" and "127.0.0.1" in str(x["peer"]) and x["request_id"]
               for x in lines)
    assert lines[-1]["request_id"] == "probe-1"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "wrong-key" not in text and "wrong-bearer" not in text  # never the key
    assert digest("wrong-key-123") not in text  # nor its digest


def test_keyless_health_probes_are_counted_apart_and_not_audited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kdn admin health`` without a key (the shipped container probes) calls Stats: refused
    as ever, but counted as reason ``probe`` with no audit warning (each probe was a
    missing_key failure and a warning); a keyless Lookup is still a missing_key failure."""
    from kdn.cli.main import main as cli

    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(_auth_file(tmp_path)),
                       metrics_port=0, disk_bytes=0)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"), ServerThread(cfg) as st:
        assert [cli(["admin", "health", "--address", st.address]) for _ in range(3)] == [0] * 3
        assert st.server is not None
        assert _scrape(st.server.metrics_port) == {"probe": 3.0}
        assert _audit(caplog) == []
        with Client(st.address, retry=None) as cl, pytest.raises(Unauthenticated):
            cl.lookup([keys.chunk_key([8], LAY)])
        assert _scrape(st.server.metrics_port) == {"probe": 3.0, "missing_key": 1.0}
        # the probe says the tiers are hidden, not that there are none (a DEGRADED one unseen)
        with AdminClient(st.address, retry=None) as anon:
            report = anon.health_report()
        assert report["tiers"] is None and report["tiers_hidden"] == "no API key"
        with AdminClient(st.address, api_key="key-a", retry=None) as keyed:
            assert keyed.health_report()["tiers_hidden"] is None
        capsys.readouterr()
        assert cli(["admin", "health", "--address", st.address]) == 0
        assert "tiers hidden: no API key" in capsys.readouterr().err
    assert [x["reason"] for x in _audit(caplog)] == ["missing_key"]


def test_health_ready_with_a_refused_key_is_not_ready(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A readiness probe whose key was revoked checks no tier: ``--ready`` exits 1 saying the
    key was refused and where it came from, never the key (it exited 0, '--api-key shows
    them', though one was given); keyless it still goes by the services."""
    from kdn.cli.main import main as cli

    monkeypatch.delenv("KDN_API_KEY", raising=False)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(_auth_file(tmp_path)),
                       disk_bytes=0)
    with ServerThread(cfg) as st:
        with AdminClient(st.address, api_key="revoked-key-9", retry=None) as stale:
            hidden = stale.health_report()["tiers_hidden"]
        assert hidden.startswith("the API key was refused") and "revoked" not in hidden
        capsys.readouterr()
        base = ["admin", "health", "--address", st.address]
        assert cli([*base, "--ready", "--api-key", "revoked-key-9"]) == 1
        err = capsys.readouterr().err
        assert "API key was refused" in err and "check the key --api-key gives" in err
        assert "--api-key shows them" not in err and "revoked-key-9" not in err
        assert cli([*base, "--api-key", "revoked-key-9"]) == 0  # liveness: the server answers
        monkeypatch.setenv("KDN_API_KEY", "revoked-key-9")
        assert cli([*base, "--ready", "-o", "json"]) == 1
        monkeypatch.setenv("KDN_API_KEY", "key-a")
        assert cli([*base, "--ready"]) == 0
        monkeypatch.delenv("KDN_API_KEY")
        assert cli([*base, "--ready"]) == 0  # a keyless probe: the services decide


def test_failed_certificate_identities_are_counted_by_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    c = make_certs(tmp_path, clients=("stranger",))
    auth = _auth_file(tmp_path, 'tenants:\n  team-a: {subjects: ["cn:engine"]}\n'
                                '  ops: {subjects: ["dns:ops.internal"], role: admin}\n')
    tls = dict(tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]),
               tls_client_ca=str(c["ca.crt"]), metrics_port=0, disk_bytes=0)
    stranger = TLSOptions(ca=c["ca.crt"].read_bytes(), cert=c["stranger.crt"].read_bytes(),
                          key=c["stranger.key"].read_bytes())
    both = issue(c, "both", "engine", dns=("ops.internal",))
    key = keys.chunk_key([4], LAY)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth),
                                       **tls)) as st:  # type: ignore[arg-type]
            for who in (stranger, both, stranger):
                with Client(st.address, tls=who, retry=None) as cl, \
                        pytest.raises(Unauthenticated):
                    cl.lookup([key])
            assert st.server is not None
            assert _scrape(st.server.metrics_port) == {"unknown_certificate": 2.0,
                                                       "ambiguous_certificate": 1.0}
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "e", mtls_role="none",
                                       **tls)) as st:  # type: ignore[arg-type]
            with Client(st.address, tls=stranger, retry=None) as cl, \
                    pytest.raises(Unauthenticated):
                cl.lookup([key])
            assert st.server is not None
            assert _scrape(st.server.metrics_port) == {"certificate_not_enough": 1.0}
    assert [x["reason"] for x in _audit(caplog)] == [
        "unknown_certificate", "ambiguous_certificate", "unknown_certificate",
        "certificate_not_enough"]


def test_the_audit_log_is_rate_limited_and_says_what_it_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    audit = AuditLog(per_second=5)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"):
        for _ in range(50):
            audit.log("unknown_key", "ipv4:10.1.2.3:5555", "r")
        time.sleep(0.5)
        audit.log("unknown_key", "ipv4:10.1.2.3:5555", "r")
    lines = [r.getMessage() for r in caplog.records]
    assert 5 <= len(lines) <= 7
    assert '"not_logged_before": 45' in lines[-1] or '"not_logged_before": 44' in lines[-1]


def test_a_brute_force_is_counted_in_full_and_logged_in_part(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(_auth_file(tmp_path)),
                       metrics_port=0, disk_bytes=0)
    key = keys.chunk_key([5], LAY)
    with caplog.at_level(logging.WARNING, logger="kdn.audit"), ServerThread(cfg) as st:
        with Client(st.address, api_key="guess", retry=None) as cl:
            for _ in range(200):
                with pytest.raises(Unauthenticated):
                    cl.lookup([key])
        assert st.server is not None
        assert _scrape(st.server.metrics_port) == {"unknown_key": 200.0}
    lines = _audit(caplog)
    assert 10 <= len(lines) < 200  # the log is bounded; the counter has them all


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def test_a_caller_without_a_key_is_refused_before_its_request_is_read(tmp_path: Path) -> None:
    """Authentication reads the call's metadata alone: keyless 64 MiB Lookup requests are
    refused without the server reading and parsing them (its peak memory grew by each whole
    message, several times over: 4 x 128 MiB took 1.1 GiB)."""
    from bench.common import free_port, port_open, process, wait_until

    port = free_port()
    cmd = [sys.executable, "-m", "kdn", "serve", "--port", str(port), "--data-dir",
           str(tmp_path / "d"), "--disk-bytes", "0", "--ram-bytes", "64MiB",
           "--auth-file", str(_auth_file(tmp_path))]

    def peak_mib(pid: int) -> int:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        return int(next(x for x in status if x.startswith("VmHWM")).split()[1]) >> 10

    size = 64 << 20
    payload = b"\x7a" + _varint(size) + bytes(size)  # an unknown bytes field of a request
    with process(cmd, tmp_path / "server.log") as proc:
        wait_until(lambda: port_open(port), "kdn serve", proc)
        with Client(f"127.0.0.1:{port}", api_key="key-a", retry=None) as ok:
            ok.lookup([keys.chunk_key([7], LAY)])  # warm: its first call's memory is not ours
        before = peak_mib(proc.pid)
        for rpc in ("Lookup", "Lookup", "Retrieve"):  # (Retrieve answers a stream)
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.max_send_message_length", 1 << 30)]) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    if rpc == "Retrieve":
                        list(ch.unary_stream(f"/kdn.v1.KDN/{rpc}")(payload, timeout=30))
                    else:
                        ch.unary_unary(f"/kdn.v1.KDN/{rpc}")(payload, timeout=30)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        grown = peak_mib(proc.pid) - before
    assert grown < 32, f"the server's peak memory grew by {grown} MiB"


def test_calls_refused_by_a_rate_limit_are_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant's call past its rate limit is answered RESOURCE_EXHAUSTED, and counted in
    kdn_requests_total with an access-log line, as admitted calls are (it was on neither)."""
    auth = _auth_file(tmp_path, 'tenants:\n  slow: {api_keys: ["key-s"], rate_rps: 0.01, '
                                'burst: 2}\n')
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth), metrics_port=0,
                       disk_bytes=0)
    codes = []
    name = 'kdn_requests_total{code="RESOURCE_EXHAUSTED",rpc="Stats"} '

    def refused(text: str) -> float:  # the process's count (other tests' calls in it too)
        return sum(float(x[len(name):]) for x in text.splitlines() if x.startswith(name))

    with caplog.at_level(logging.INFO, logger="kdn.access"), ServerThread(cfg) as st, \
            grpc.insecure_channel(st.address) as ch:
        assert st.server is not None
        before = refused(_scrape_text(st.server.metrics_port))
        for _ in range(5):
            try:
                ch.unary_unary("/kdn.v1.KDN/Stats")(b"", metadata=(("x-kdn-api-key", "key-s"),),
                                                    timeout=10)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
        assert codes == ["OK"] * 2 + ["RESOURCE_EXHAUSTED"] * 3

        def logged() -> list[tuple[str, str]]:
            lines = [json.loads(r.getMessage()) for r in caplog.records
                     if r.name == "kdn.access"]
            return [(x["code"], x["tenant"]) for x in lines if x["rpc"] == "Stats"]

        # (recorded as the call ends on the server, which may be just after its client heard)
        assert eventually(lambda: refused(_scrape_text(st.server.metrics_port)) - before == 3
                          and len(logged()) == 5, timeout=10)
    assert logged() == [("OK", "slow")] * 2 + [("RESOURCE_EXHAUSTED", "slow")] * 3


@pytest.mark.parametrize("data_path", [False, True])
def test_a_rate_limit_reaches_the_client_as_rate_limited(tmp_path: Path, data_path: bool) -> None:
    """A call refused by the tenant's rate limit raises RateLimited, over gRPC and over the
    data path (it was TooLarge, the kind a client answers by sending less, and a GetMany
    refused so over gRPC was taken for entries too large for a message); a size refusal
    stays TooLarge."""
    auth = _auth_file(tmp_path, 'tenants:\n  slow: {api_keys: ["key-s"], rate_rps: 0.01, '
                                'burst: 3}\n')
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth), disk_bytes=0,
                       max_entry_bytes=1 << 16)
    keys_ = [bytes([i]) * 32 for i in range(3)]
    with ServerThread(cfg) as st, Client(st.address, api_key="key-s", shm_bytes=0,
                                         data_path=data_path) as c:
        with pytest.raises(TooLarge) as big:  # (one call of the burst)
            c.store(keys_[0], random_kv(uniform_layout(), 1024), mode="raw")
        assert not isinstance(big.value, RateLimited)
        c.store_many([(k, random_kv(uniform_layout(), 16, seed=i))
                      for i, k in enumerate(keys_)], mode="raw")
        with pytest.raises(RateLimited, match="exceeded 0.01 requests/s"):
            for _ in range(4):
                assert all(f is not None for f in c.fetch_many(keys_))


# ------------------------------------------------------------- connection limits


def test_connection_settings_reach_grpc() -> None:
    opts = dict(grpc_options(ServerConfig()))
    assert opts["grpc.max_connection_idle_ms"] == 300_000
    assert opts["grpc.max_allowed_incoming_connections"] == 1024
    assert opts["grpc.server_handshake_timeout_ms"] == 10_000
    assert opts["grpc.max_concurrent_streams"] == 256
    assert opts["grpc.so_reuseport"] == 0
    assert "grpc.max_connection_age_ms" not in opts  # 0 = never by default
    off = dict(grpc_options(ServerConfig(idle_timeout_s=0, max_connections=0,
                                         handshake_timeout_s=0, max_streams_per_connection=0,
                                         max_connection_age_s=60)))
    assert not {"grpc.max_connection_idle_ms", "grpc.max_allowed_incoming_connections",
                "grpc.server_handshake_timeout_ms", "grpc.max_concurrent_streams"} & set(off)
    assert off["grpc.max_connection_age_ms"] == 60_000


def test_idle_connections_are_closed_and_connections_capped(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", idle_timeout_s=1, max_connections=4)
    with ServerThread(cfg) as st:
        port = int(st.address.rsplit(":", 1)[1])
        # HTTP/2 connections that never make a call (no key needed to open one), and ones
        # that never say a word
        socks = []
        for i in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                s.sendall(PREFACE)
            socks.append(s)
        assert eventually(lambda: all(_closed(s) for s in socks), timeout=10, interval=0.2)
        channels = [grpc.insecure_channel(st.address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(6)]
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


def test_a_tls_handshake_that_never_comes_is_cut_off(tmp_path: Path) -> None:
    c = make_certs(tmp_path)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", tls_cert=str(c["server.crt"]),
                       tls_key=str(c["server.key"]), idle_timeout_s=1, handshake_timeout_s=1)
    with ServerThread(cfg) as st:
        port = int(st.address.rsplit(":", 1)[1])
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        ctx = ssl.create_default_context(cafile=str(c["ca.crt"]))
        ctx.set_alpn_protocols(["h2"])
        shaken = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                 server_hostname="localhost")
        shaken.sendall(PREFACE)  # a TLS connection that then makes no call: the idle timeout
        t0 = time.monotonic()
        assert eventually(lambda: all(_closed(s) for s in silent), timeout=10, interval=0.2)
        assert time.monotonic() - t0 < 5  # not gRPC's own 120 s

        def tls_closed() -> bool:
            shaken.setblocking(False)
            try:
                while True:
                    if not shaken.recv(65536):
                        return True
            except (ssl.SSLWantReadError, BlockingIOError):
                return False
            except (ssl.SSLError, ConnectionResetError):
                return True

        assert eventually(tls_closed, timeout=10, interval=0.2)
        with Client(st.address, tls=TLSOptions(ca=c["ca.crt"].read_bytes())) as ok:
            assert ok.health() == "SERVING"
        for s in silent:
            s.close()
        shaken.close()


def test_old_connections_are_asked_to_go(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", idle_timeout_s=0, max_connection_age_s=1)
    with ServerThread(cfg) as st:
        s = socket.create_connection(("127.0.0.1", int(st.address.rsplit(":", 1)[1])))
        s.sendall(PREFACE)
        s.settimeout(0.2)
        got, end = b"", time.monotonic() + 10
        while b"max_age" not in got and time.monotonic() < end:
            try:
                got += s.recv(65536)
            except TimeoutError:
                pass
        frames, i = [], 0  # HTTP/2 frames: u24 length, u8 type, ...
        while i + 9 <= len(got):
            n = int.from_bytes(got[i:i + 3], "big")
            frames.append((got[i + 3], got[i + 9:i + 9 + n]))
            i += 9 + n
        assert any(t == 7 and body.endswith(b"max_age") for t, body in frames), frames  # GOAWAY
        s.close()


def test_calls_per_connection_are_capped(tmp_path: Path) -> None:
    """Past ``max_streams_per_connection`` a client's call waits for another to end."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", max_streams_per_connection=2)
    with ServerThread(cfg) as st, grpc.insecure_channel(st.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected, limit known
        watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
        for w in watches:
            next(w)  # both streams open on the server
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        watches[0].cancel()
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        watches[1].cancel()


def test_idle_connections_without_a_key_are_closed_by_a_real_server(tmp_path: Path) -> None:
    """``kdn serve`` as a process, auth on: 300 HTTP/2 connections opened without a key (the
    benchmark opens 1,000) are all closed by the idle timeout, while a client with a key keeps
    working on its own connection."""
    from bench.common import free_port, port_open, process, wait_until

    port = free_port()
    cmd = [sys.executable, "-m", "kdn", "serve", "--port", str(port), "--data-dir",
           str(tmp_path / "d"), "--disk-bytes", "0", "--idle-timeout-s", "2",
           "--auth-file", str(_auth_file(tmp_path))]
    with process(cmd, tmp_path / "server.log") as proc:
        wait_until(lambda: port_open(port), "kdn serve", proc)
        key = keys.chunk_key([6], LAY)
        with Client(f"127.0.0.1:{port}", api_key="key-a", retry=None) as ok:
            ok.lookup([key])
            socks = []
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(PREFACE)
                socks.append(s)
            for _ in range(20):
                ok.lookup([key])  # busy on its own connection, so never idle
                time.sleep(0.2)
            assert eventually(lambda: sum(_closed(s) for s in socks) == len(socks), timeout=20,
                              interval=0.5), sum(_closed(s) for s in socks)
            assert ok.lookup([key]).infos[0].present is False
        for s in socks:
            s.close()


def test_the_metrics_port_closes_unfinished_requests_and_caps_connections(
        tmp_path: Path) -> None:
    """/metrics connections whose request is not whole within handshake_timeout_s are closed,
    and those past MAX_CONNECTIONS at once are closed unserved (prometheus_client's own
    server kept each open for ever, a thread each)."""
    from kdn.server.metrics_http import MAX_CONNECTIONS

    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0, disk_bytes=0,
                       handshake_timeout_s=3)
    with ServerThread(cfg) as st:
        assert st.server is not None
        port = st.server.metrics_port
        socks = []
        for _ in range(MAX_CONNECTIONS + 4):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            socks.append(s)
            time.sleep(0.01)  # (accepted in order)
        assert eventually(lambda: all(_closed(s) for s in socks[MAX_CONNECTIONS:]), timeout=2,
                          interval=0.1)
        assert not any(_closed(s) for s in socks[:MAX_CONNECTIONS])  # (their 3 s not over)
        assert eventually(lambda: all(_closed(s) for s in socks), timeout=6, interval=0.2)
        assert "kdn_requests_total" in _scrape_text(port)  # served again
        for s in socks:
            s.close()
