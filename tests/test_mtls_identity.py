"""mTLS identities (issue 24 item 2), with real servers and certificates generated here: a
client certificate's subject CN or SAN names a tenant and role in the tenants file (typed as
``cn:``/``dns:``/``uri:``/``email:``/``ip:`` or untyped); a certificate naming two tenants is
refused; a certificate alone is never admin unless the operator says so (``mtls_role``); an API
key, when sent, decides alone; a rogue CA's certificate with a listed name never gets in."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.client import TLSOptions
from kdn.errors import ConfigError, PermissionDenied, Unauthenticated, Unavailable
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import Authenticator, Role, parse_tenants
from tests.helpers import make_certs, random_kv, uniform_layout

LAY = uniform_layout(layers=2, heads=2, dim=8)


def issue(certs: dict[str, Path], name: str, cn: str, *, dns: tuple[str, ...] = (),
          uri: tuple[str, ...] = (), email: tuple[str, ...] = (), ip: tuple[str, ...] = ()
          ) -> TLSOptions:
    """A client certificate signed by ``certs``' CA with this CN and SANs, as client TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate(certs["ca.crt"].read_bytes())
    ca_key = serialization.load_pem_private_key(certs["ca.key"].read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [
        *(x509.DNSName(d) for d in dns), *(x509.UniformResourceIdentifier(u) for u in uri),
        *(x509.RFC822Name(e) for e in email),
        *(x509.IPAddress(ipaddress.ip_address(a)) for a in ip)]
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
         .issuer_name(ca.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(days=1))
         .not_valid_after(now + datetime.timedelta(days=1)))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return TLSOptions(ca=certs["ca.crt"].read_bytes(),
                      cert=cert.public_bytes(serialization.Encoding.PEM),
                      key=key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))


def _mtls(c: dict[str, Path], name: str) -> TLSOptions:
    return TLSOptions(ca=c["ca.crt"].read_bytes(), cert=c[f"{name}.crt"].read_bytes(),
                      key=c[f"{name}.key"].read_bytes())


def _server(tmp: Path, c: dict[str, Path], tenants: str | None = None, **kw: object
            ) -> ServerConfig:
    auth = ""
    if tenants is not None:
        path = tmp / "tenants.yaml"
        path.write_text(tenants)
        path.chmod(0o600)
        auth = str(path)
    return ServerConfig(port=0, data_dir=tmp / "d", disk_bytes=0, auth_file=auth,  # type: ignore[arg-type]
                        tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]),
                        tls_client_ca=str(c["ca.crt"]), **kw)


def test_a_certificate_alone_is_never_admin_by_default(tmp_path: Path) -> None:
    c = make_certs(tmp_path, clients=("engine-1",))
    key, kv = keys.chunk_key([1], LAY), random_kv(LAY, 4)
    assert ServerConfig().mtls_role == "tenant"
    with ServerThread(_server(tmp_path / "1", c)) as st:
        with AdminClient(st.address, tls=_mtls(c, "engine-1"), retry=None) as cl:
            cl.store(key, kv)  # a tenant of the unscoped key space
            assert cl.retrieve(key).equal(kv)  # type: ignore[union-attr]
            with pytest.raises(PermissionDenied):
                cl.gc()  # not an admin
    with ServerThread(_server(tmp_path / "2", c, mtls_role="admin")) as st, \
            AdminClient(st.address, tls=_mtls(c, "engine-1")) as cl:
        cl.gc()  # the operator said so
    with ServerThread(_server(tmp_path / "3", c, mtls_role="none")) as st:
        with Client(st.address, tls=_mtls(c, "engine-1"), retry=None) as cl:
            with pytest.raises(Unauthenticated, match="needs an API key besides"):
                cl.lookup([key])
    with pytest.raises(ConfigError, match="mtls_role: expected tenant, admin or none"):
        ServerConfig(mtls_role="root")


def test_certificate_subjects_name_tenants(tmp_path: Path) -> None:
    c = make_certs(tmp_path, clients=("engine-a", "ops-console", "stranger"),
                   client_sans={"engine-a": ["engine-a.internal"]})
    cfg = _server(tmp_path, c, 'tenants:\n  team-a: {subjects: ["engine-a.internal"]}\n'
                               '  ops: {subjects: ["ops-console"], role: admin}\n'
                               '  team-b: {api_keys: ["key-b"]}\n')
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


def test_typed_subjects_match_only_their_kind(tmp_path: Path) -> None:
    """SPIFFE IDs (URI SANs), IP and e-mail SANs name tenants; a typed ``cn:`` name is not
    matched by a DNS SAN that spells the same (a CA that lets a party pick its DNS names does
    not let it pick a CN-mapped tenant)."""
    c = make_certs(tmp_path)
    cfg = _server(tmp_path, c, 'tenants:\n'
                  '  team-a: {subjects: ["uri:spiffe://kdn.test/ns/a/sa/engine"]}\n'
                  '  team-b: {subjects: ["ip:10.9.8.7", "dns:Engine-B.Example."]}\n'
                  '  ops: {subjects: ["email:ops@kdn.test", "cn:root-console"], role: admin}\n')
    key, kv = keys.chunk_key([3], LAY), random_kv(LAY, 4)
    spiffe = issue(c, "a", "whatever", uri=("spiffe://kdn.test/ns/a/sa/engine",))
    by_ip = issue(c, "b", "anything", ip=("10.9.8.7",))
    by_dns = issue(c, "b2", "else", dns=("engine-b.example",))  # DNS names ignore case
    by_mail = issue(c, "o", "ops-person", email=("ops@kdn.test",))
    lookalike = issue(c, "x", "not-root", dns=("root-console",))  # DNS, not the CN
    spelled = issue(c, "z", "not-root", dns=("cn:root-console",))  # a name that spells one
    spelled_cn = issue(c, "w", "uri:spiffe://kdn.test/ns/a/sa/engine")
    near_spiffe = issue(c, "y", "y", uri=("spiffe://kdn.test/ns/a/sa/engine-2",))
    with ServerThread(cfg) as st:
        with Client(st.address, tls=spiffe, retry=None) as a:
            a.store(key, kv)
        with Client(st.address, tls=by_ip, retry=None) as b:
            assert b.retrieve(key) is None  # another tenant
            b.store(key, kv)
        with Client(st.address, tls=by_dns, retry=None) as b2:
            assert b2.retrieve(key) is not None  # team-b again, by its DNS SAN
        with AdminClient(st.address, tls=by_mail, retry=None) as ops:
            assert sorted(e.tenant for e in ops.ls()) == ["team-a", "team-b"]
        for who in (lookalike, near_spiffe, spelled, spelled_cn):
            with Client(st.address, tls=who, retry=None) as x:
                with pytest.raises(Unauthenticated, match="is no tenant's"):
                    x.lookup([key])


def test_a_certificate_naming_two_tenants_is_refused(tmp_path: Path) -> None:
    c = make_certs(tmp_path)
    cfg = _server(tmp_path, c, 'tenants:\n  team-a: {subjects: ["cn:engine"]}\n'
                               '  ops: {subjects: ["dns:ops.internal"], role: admin}\n')
    both = issue(c, "both", "engine", dns=("ops.internal",))
    with ServerThread(cfg) as st, Client(st.address, tls=both, retry=None) as cl:
        with pytest.raises(Unauthenticated, match=r"names several tenants \(ops, team-a\)"):
            cl.lookup([keys.chunk_key([4], LAY)])


def test_an_api_key_decides_alone(tmp_path: Path) -> None:
    c = make_certs(tmp_path, clients=("engine-a",))
    cfg = _server(tmp_path, c, 'tenants:\n  team-a: {subjects: ["engine-a"]}\n'
                               '  team-b: {api_keys: ["key-b"]}\n')
    key, kv = keys.chunk_key([5], LAY), random_kv(LAY, 4)
    with ServerThread(cfg) as st:
        with Client(st.address, tls=_mtls(c, "engine-a"), api_key="key-b", retry=None) as b:
            b.store(key, kv)  # as team-b: the key, not the certificate
        with Client(st.address, tls=_mtls(c, "engine-a"), retry=None) as a:
            assert a.retrieve(key) is None  # team-a has nothing
        with Client(st.address, tls=_mtls(c, "engine-a"), api_key="wrong", retry=None) as w:
            with pytest.raises(Unauthenticated, match="unknown API key"):
                w.lookup([key])  # a wrong key is not rescued by a known certificate


def test_a_rogue_ca_with_the_same_names_gets_nothing(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "rogue").mkdir()
    real = make_certs(tmp_path / "real", clients=("ops-console",))
    rogue = make_certs(tmp_path / "rogue", clients=("ops-console",))  # same CA and client names
    cfg = _server(tmp_path, real, 'tenants:\n  ops: {subjects: ["ops-console"], role: admin}\n')
    with ServerThread(cfg) as st:
        tls = TLSOptions(ca=real["ca.crt"].read_bytes(), cert=rogue["ops-console.crt"].read_bytes(),
                         key=rogue["ops-console.key"].read_bytes())
        with AdminClient(st.address, tls=tls, retry=None, timeout_s=5) as cl:
            with pytest.raises(Unavailable):  # the handshake fails: no call is made
                cl.gc()
        with AdminClient(st.address, tls=_mtls(real, "ops-console"), retry=None) as ok:
            ok.gc()


def test_subjects_in_the_tenants_file_are_checked() -> None:
    for bad, why in (([""], "malformed"), (["cn:"], "malformed"), (["ip:not-an-ip"], "malformed"),
                     (["dns:a.example", "dns:A.Example."], "duplicate"), ([7], "malformed")):
        with pytest.raises(ConfigError, match=f"malformed or duplicate subject.*{why}|{why}"):
            parse_tenants({"t": {"subjects": bad}}, "auth file x")
    cfg = parse_tenants({"t": {"subjects": ["ip:[::1]", "URI:spiffe://x/y", "plain"]},
                         "o": {"subjects": ["cn:ops"], "role": "admin"}}, "auth file x")
    auth = Authenticator(cfg, mtls=True)
    assert auth.by_certificate([("ip", "0:0:0:0:0:0:0:1")]) == {("t", Role.TENANT)}
    assert auth.by_certificate([("uri", "spiffe://x/y")]) == {("t", Role.TENANT)}
    assert auth.by_certificate([("dns", "plain")]) == {("t", Role.TENANT)}  # untyped: any kind
    assert auth.by_certificate([("cn", "plain")]) == {("t", Role.TENANT)}
    assert auth.by_certificate([("dns", "ops")]) == set()  # typed: its kind only
    assert auth.by_certificate([("cn", "ops")]) == {("o", Role.ADMIN)}


def test_certificate_settings_a_server_would_ignore_are_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant named only by ``subjects`` on a server that asks no client certificate could
    never enter (its clients got 'missing API key'): the start is refused naming it and
    tls_client_ca; subjects beside API keys are a warning. ``mtls_role`` beside a tenants file,
    or without mutual TLS, did nothing: refused naming it."""
    import logging

    c = make_certs(tmp_path)
    tls = dict(port=0, data_dir=tmp_path / "d", disk_bytes=0, tls_cert=str(c["server.crt"]),
               tls_key=str(c["server.key"]))
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants:\n  engines: {subjects: ["cn:engine-1"]}\n'
                    '  ops: {api_keys: ["key-ops"], role: admin}\n')
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"tenant 'engines': named only by subjects .* set "
                                          r"tls_client_ca"):
        ServerThread(ServerConfig(auth_file=str(path), **tls)).start()  # type: ignore[arg-type]
    path.write_text('tenants:\n  engines: {subjects: ["cn:engine-1"], api_keys: ["key-e"]}\n')
    with caplog.at_level(logging.WARNING, logger="kdn.server"), \
            ServerThread(ServerConfig(auth_file=str(path), **tls)):  # type: ignore[arg-type]
        pass
    assert any("subjects of tenants engines go unused" in r.getMessage()
               for r in caplog.records)
    for role in ("admin", "none"):
        with pytest.raises(ConfigError, match=rf"mtls_role: {role} applies only without a "
                                              r"tenants file \(auth_file is set"):
            ServerConfig(auth_file=str(path), tls_client_ca=str(c["ca.crt"]), mtls_role=role,
                         **tls)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=rf"mtls_role: {role} applies only under mutual "
                                              "TLS; set tls_client_ca"):
            ServerConfig(mtls_role=role, **tls)  # type: ignore[arg-type]


def test_a_certificate_of_the_unscoped_key_space_sees_only_its_own(tmp_path: Path) -> None:
    """Without a tenants file a certificate is a tenant of the unscoped key space (""), whose
    tier keys have no tenant part: ls, export and stats show it its own entries only, not
    those named tenants stored (under a tenants file before, or another server on the tier),
    and no server-wide counts."""
    c = make_certs(tmp_path, clients=("engine-1",))
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants:\n  secret-co: {api_keys: ["key-a"]}\n')
    path.chmod(0o600)
    base = dict(port=0, data_dir=tmp_path / "d", disk_bytes=64 << 20,
                tls_cert=str(c["server.crt"]), tls_key=str(c["server.key"]))
    theirs, mine, kv = keys.chunk_key([7], LAY), keys.chunk_key([8], LAY), random_kv(LAY, 4)
    with ServerThread(ServerConfig(auth_file=str(path), **base)) as st:  # type: ignore[arg-type]
        with Client(st.address, api_key="key-a", retry=None,
                    tls=TLSOptions(ca=c["ca.crt"].read_bytes())) as a:
            a.store(theirs, kv, namespace="private")
    with ServerThread(ServerConfig(tls_client_ca=str(c["ca.crt"]), **base)) as st:  # type: ignore[arg-type]
        with AdminClient(st.address, tls=_mtls(c, "engine-1"), retry=None) as cl:
            cl.store(mine, kv)
            assert [(e.tenant, e.key) for e in cl.ls()] == [("", mine)]
            assert cl.export_to(tmp_path / "x.kdnx") == 1
            stats = cl.stats()
            assert set(stats.counters) <= {"rpc.in_flight"}, stats.counters
            assert all(t.entries == 0 for t in stats.tiers)
            assert [(t.tenant, t.entries) for t in stats.tenants] == [("", 1)]
