"""Secure by default (issue 24 item 1, and the start-up checks of item 3), against real servers
and processes: no API key crosses a non-loopback plaintext connection unless both sides say so;
secrets others can read are refused; certificates and keys that can not work stop the start
with one line naming the file. (mTLS identities: test_mtls_identity.py; failed
authentications and connection limits: test_auth_audit.py.)"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.client.client import TLSOptions, same_host
from kdn.errors import ConfigError, InvalidArgument, Unauthenticated
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import digest
from tests.helpers import make_certs, uniform_layout

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
    for local_looking in ("127.0.0.1.nip.io:50051", "127.evil.example:50051",
                          "dns:///evil.example:50051", "dns://10.0.0.1/localhost:50051",
                          "ipv4:127.0.0.1:50051,10.0.0.7:50051", "[::ffff:10.0.0.7]:50051"):
        assert not same_host(local_looking)
        with pytest.raises(InvalidArgument, match="refusing to send an API key"):
            Client(local_looking, api_key="secret")
    for local in ("localhost:1", "127.3.4.5:1", "[::1]:1", "ipv6:[::1]:1", "dns:///localhost:1",
                  "unix:/tmp/kdn.sock", "unix-abstract:kdn"):
        assert same_host(local), local
    for yes in ("1", "true", "yes", "on"):
        monkeypatch.setenv("KDN_INSECURE", yes)
        Client("10.0.0.7:50051", api_key="secret").close()
    monkeypatch.setenv("KDN_INSECURE", "0")
    with pytest.raises(InvalidArgument):
        Client("10.0.0.7:50051", api_key="secret")
    monkeypatch.delenv("KDN_INSECURE")
    run = subprocess.run([sys.executable, "-m", "kdn", "admin", "stats", "--address",
                          "10.0.0.7:50051", "--api-key", "secret"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT,
                         env={"PATH": "", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and "refusing to send an API key" in run.stderr
    assert "--insecure" in run.stderr and "secret" not in run.stderr


def test_secrets_another_ordinary_user_owns_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An auth file or TLS key owned by a user other than the server's or root: that user
    could rewrite it and give itself an admin key, whatever its mode. Refused, naming the
    owner; the server's user and root own it (a configuration manager runs as root)."""
    auth = _auth_file(tmp_path, TENANTS, mode=0o600)
    certs = make_certs(tmp_path)
    key = certs["server.key"]
    if os.geteuid() == 0:  # root: give them to nobody
        for path in (auth, key):
            os.chown(path, 65534, 65534)
        owner = 65534
    else:  # the suite's user owns them: the server runs as another one
        owner = os.geteuid()
        monkeypatch.setattr("kdn.server.secretfile.os.geteuid", lambda: owner + 1)
    for mode in (0o600, 0o640):
        for path in (auth, key):
            path.chmod(mode)
        with pytest.raises(ConfigError, match=rf"auth_file: {auth} is owned by uid {owner}, "
                                              rf"neither this server's user .* nor root"):
            ServerConfig(auth_file=str(auth))
        with pytest.raises(ConfigError, match=rf"tls_key: .* is owned by uid {owner}"):
            ServerConfig(tls_cert=str(certs["server.crt"]), tls_key=str(key))


def test_secrets_readable_by_others_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    auth = _auth_file(tmp_path, TENANTS, mode=0o644)
    with pytest.raises(ConfigError, match=rf"auth_file: {auth} can be read by other users "
                                          rf"\(mode 0o644\); run chmod 600 {auth}"):
        ServerConfig(auth_file=str(auth))
    certs = make_certs(tmp_path)
    tls = dict(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    certs["server.key"].chmod(0o604)
    with pytest.raises(ConfigError, match="tls_key: .* can be read by other users"):
        ServerConfig(**tls)  # type: ignore[arg-type]
    # group-readable, and the server's own user owns it: the group serves nobody but others
    certs["server.key"].chmod(0o640)
    with pytest.raises(ConfigError, match=r"tls_key: .* can be read by its group \(mode 0o640\) "
                                          r"though this server's user owns it; run chmod 600"):
        ServerConfig(**tls)  # type: ignore[arg-type]
    # owned by root (as Kubernetes mounts secrets with an fsGroup), the server another user:
    # the group is how this server reads it, as PostgreSQL accepts a root-owned key of mode
    # 0640 (only where the suite runs as root can the key be root's)
    if os.geteuid() == 0:
        monkeypatch.setattr("kdn.server.config.os.geteuid", lambda: 1)
        with caplog.at_level(logging.INFO, logger="kdn.server.config"):
            ServerConfig(**tls)  # type: ignore[arg-type]
        assert any("is read through its group" in r.getMessage() for r in caplog.records)
        for mode in (0o660, 0o620, 0o670, 0o610):  # never written through it (PostgreSQL too)
            certs["server.key"].chmod(mode)
            with pytest.raises(ConfigError, match=rf"tls_key: .* can be written or run by its "
                                                  rf"group \(mode {oct(mode)}\); its owner "
                                                  rf"should run chmod 640"):
                ServerConfig(**tls)  # type: ignore[arg-type]
        certs["server.key"].chmod(0o644)
        with pytest.raises(ConfigError, match="can be read by other users"):  # others: never
            ServerConfig(**tls)  # type: ignore[arg-type]
        monkeypatch.undo()
    auth.chmod(0o660)  # the real command: one line, exit 2, the fix named
    run = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", "0", "--auth-file",
                          str(auth), "--data-dir", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and f"run chmod 600 {auth}" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_files_that_say_who_is_who_are_refused_when_others_may_write_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client-CA bundle decides which certificates are admins (a CA added to it signs
    one), the config file which auth file and mtls_role: others may read them, but one that
    its group or other users may write, or another ordinary user owns, is refused."""
    from kdn.server.config import load_config
    from kdn.server.secretfile import check_trusted

    certs = make_certs(tmp_path)
    ca = certs["ca.crt"]
    mtls = dict(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]),
                tls_client_ca=str(ca))
    conf = tmp_path / "kdn.yaml"
    conf.write_text(f"tls_client_ca: {ca}\n")
    for path in (ca, conf):
        path.chmod(0o644)  # readable by all: accepted
    load_config(conf, env={}, flags={k: v for k, v in mtls.items() if k != "tls_client_ca"})
    shared = grp.struct_group(("staff", "x", ca.stat().st_gid, ["someone-else"]))
    monkeypatch.setattr("kdn.server.secretfile.grp.getgrgid", lambda gid: shared)
    for mode, who in ((0o666, "other users"), (0o646, "other users"), (0o664, "its group")):
        ca.chmod(mode)
        with pytest.raises(ConfigError, match=rf"tls_client_ca: {ca} can be written by {who} "
                                              rf"\(mode {oct(mode)}\).* chmod 644 {ca}"):
            ServerConfig(**mtls)  # type: ignore[arg-type]
        conf.chmod(mode)
        with pytest.raises(ConfigError, match=rf"config file: {conf} can be written by {who}"):
            load_config(conf, env={})
    monkeypatch.undo()
    ca.chmod(0o644)
    owner = os.geteuid()
    if owner == 0:  # root: give it to nobody
        os.chown(ca, 65534, 65534)
        owner = 65534
    else:  # the suite's user owns it: the server runs as another one
        monkeypatch.setattr("kdn.server.secretfile.os.geteuid", lambda: owner + 1)
    with pytest.raises(ConfigError, match=rf"tls_client_ca: {ca} is owned by uid {owner}, "
                                          rf"neither this server's user .* nor root"):
        check_trusted("tls_client_ca", ca)


def test_a_trusted_file_its_owners_private_group_may_write_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under umask 002 (a user-private group each, as Debian and Ubuntu give their users) a
    config file or client-CA bundle is made mode 0664: its group is its owner alone, so it is
    taken; the same mode with another member in the group, or writable by all, is refused."""
    from kdn.server.secretfile import check_trusted

    conf = tmp_path / "kdn.yaml"
    conf.write_text("port: 0\n")
    conf.chmod(0o664)
    st = conf.stat()
    me = pwd.getpwuid(st.st_uid)
    own = grp.struct_group((me.pw_name, "x", st.st_gid, []))
    monkeypatch.setattr("kdn.server.secretfile.pwd.getpwuid",
                        lambda uid: pwd.struct_passwd((*me[:3], st.st_gid, *me[4:])))
    monkeypatch.setattr("kdn.server.secretfile.grp.getgrgid", lambda gid: own)
    check_trusted("config file", conf)  # its own group: taken
    monkeypatch.setattr("kdn.server.secretfile.grp.getgrgid", lambda gid: grp.struct_group(
        (me.pw_name, "x", st.st_gid, ["someone-else"])))
    with pytest.raises(ConfigError, match="can be written by its group"):
        check_trusted("config file", conf)
    monkeypatch.setattr("kdn.server.secretfile.grp.getgrgid", lambda gid: own)
    conf.chmod(0o666)
    with pytest.raises(ConfigError, match="can be written by other users"):
        check_trusted("config file", conf)


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

    def start(cert: Path, key: Path, ca: Path | None = None) -> None:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "e", tls_cert=str(cert),
                           tls_key=str(key), tls_client_ca=str(ca) if ca else "")
        with ServerThread(cfg):
            pass

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    garbage.chmod(0o600)
    with pytest.raises(ConfigError, match=f"tls_cert {garbage}: holds no PEM certificate"):
        start(garbage, a["server.key"])
    with pytest.raises(ConfigError, match=f"tls_key {garbage}: holds no PEM private key"):
        start(a["server.crt"], garbage)
    crt_as_key = tmp_path / "server-crt-as-key.pem"
    crt_as_key.write_bytes(a["server.crt"].read_bytes())
    crt_as_key.chmod(0o600)
    with pytest.raises(ConfigError, match=f"tls_cert {a['server.key']}: holds no PEM certif"):
        start(a["server.key"], crt_as_key)  # the two swapped
    with pytest.raises(ConfigError, match=f"tls_client_ca {garbage}: holds no PEM certificate"):
        start(a["server.crt"], a["server.key"], garbage)
    broken = tmp_path / "broken.crt"  # the markers, but no certificate between them
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="not a usable PEM certificate and key"):
        start(broken, a["server.key"])
    # a key with a passphrase: refused at once (no passphrase prompt on the terminal)
    from cryptography.hazmat.primitives import serialization

    pem = serialization.load_pem_private_key(a["server.key"].read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"))
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(pem)
    encrypted.chmod(0o600)
    with pytest.raises(ConfigError, match=f"tls_key {encrypted}: the key is encrypted"):
        start(a["server.crt"], encrypted)


def _this_hosts_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: this only picks a route
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_keys_and_plaintext_over_a_real_network_address(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server on every interface with auth on and --insecure true: the client still refuses
    to send its key over plaintext to the machine's network address unless told so; a peer
    listening there (the "fake HTTP/2 peer" of issue 24) receives nothing."""
    addr = _this_hosts_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address")
    listener = socket.create_server((addr, 0))
    listener.settimeout(0.5)
    with pytest.raises(InvalidArgument, match="refusing to send an API key in plaintext"):
        Client(f"{addr}:{listener.getsockname()[1]}", api_key="key-a", retry=None)
    with pytest.raises(TimeoutError):
        listener.accept()  # nobody even connected
    listener.close()
    auth = _auth_file(tmp_path, TENANTS)
    cfg = ServerConfig(host="0.0.0.0", port=0, auth_file=str(auth), insecure=True,
                       data_dir=tmp_path / "d", disk_bytes=0)
    key = keys.chunk_key([9], LAY)
    with ServerThread(cfg) as st:
        port = int(st.address.rsplit(":", 1)[1])
        with pytest.raises(InvalidArgument):
            Client(f"{addr}:{port}", api_key="key-a", retry=None)
        with Client(f"{addr}:{port}", api_key="key-a", insecure=True, retry=None) as c:
            assert c.lookup([key]).infos[0].present is False  # both sides said so


def test_an_open_server_on_the_network_says_so(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    cfg = ServerConfig(host="0.0.0.0", port=0, data_dir=tmp_path / "d", disk_bytes=0)
    with caplog.at_level(logging.WARNING, logger="kdn.server"), ServerThread(cfg):
        pass
    assert any("no authentication on 0.0.0.0" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kdn.server"), \
            ServerThread(ServerConfig(port=0, data_dir=tmp_path / "e", disk_bytes=0)):
        pass  # loopback: nothing to say
    assert not any("no authentication" in r.getMessage() for r in caplog.records)
