"""The deployment files: docker-compose.yml (kdn + Redis) and deploy/docker-compose.cluster.yml
(several kdn servers on one Redis Cluster) parse, hang together, and carry settings that kdn's
own config loader accepts; ``docker compose config`` validates them where docker compose is
installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdn.server.config import load_config
from tests.test_compose import TENANTS, _seconds, interpolate

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ROOT / "docker-compose.yml"
CLUSTER = ROOT / "deploy" / "docker-compose.cluster.yml"


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


def kdn_services(doc: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in doc["services"].items() if "build" in s}


def test_cluster_file_runs_several_kdn_servers_on_a_redis_cluster() -> None:
    doc = load(CLUSTER)
    services = doc["services"]
    nodes = {n: s for n, s in services.items() if "--cluster-enabled" in s.get("command", [])}
    assert len(nodes) >= 3, "a Redis Cluster needs at least three masters"
    for s in nodes.values():
        cmd = s["command"]
        assert cmd[cmd.index("--cluster-enabled") + 1] == "yes"
        assert "healthcheck" in s
    init = services["redis-cluster-init"]
    script = " ".join(init["command"])
    assert "--cluster create" in script
    assert all(f"{n}:6379" in script for n in nodes), "the init job must join every node"
    assert all(init["depends_on"][n]["condition"] == "service_healthy" for n in nodes)

    kdns = kdn_services(doc)
    assert len(kdns) >= 2
    host_ports = []
    for name, s in kdns.items():
        build = s["build"]
        context = (CLUSTER.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repository root"
        assert (context / build["dockerfile"]).is_file()
        assert s["depends_on"]["redis-cluster-init"]["condition"] == \
            "service_completed_successfully"
        env = {k: interpolate(str(v), {"KDN_AUTH_TENANTS": TENANTS})
               for k, v in s["environment"].items()}
        cfg = load_config(env=env)  # kdn's own loader: types, URLs, cluster flag
        assert cfg.auth_tenants and cfg.metrics_host == "0.0.0.0"  # auth on, scrapeable
        assert _seconds(s["stop_grace_period"]) > cfg.shutdown_grace_s
        assert cfg.redis_cluster and cfg.host == "0.0.0.0"
        assert {u.split("//")[1].split(":")[0] for u in cfg.redis_urls} == set(nodes)
        host_ports += [str(p).rsplit(":", 2)[-2] for p in s["ports"]]
        assert all(str(p).startswith("127.0.0.1:") for p in s["ports"])  # plaintext: host only
        assert str(s["ports"][0]).endswith(f":{cfg.port}")
        # the data path: clients learn its port from the server, so published at that number
        assert f"127.0.0.1:{cfg.data_port}:{cfg.data_port}" in s["ports"]
    assert len(set(host_ports)) == len(host_ports), "two kdn servers on one host port"
    used = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])
            if not v.startswith((".", "/"))}  # bind mounts apart
    assert used <= set(doc.get("volumes") or {}), "undeclared named volume"


def test_single_file_settings_load() -> None:
    doc = load(SINGLE)
    (kdn,) = kdn_services(doc).values()
    cfg = load_config(env={k: interpolate(str(v), {"KDN_AUTH_TENANTS": TENANTS})
                           for k, v in kdn["environment"].items()})
    assert not cfg.redis_cluster and list(cfg.redis_urls) == ["redis://redis:6379/0"]
    assert cfg.host == "0.0.0.0" and cfg.ram_bytes > 0


def _compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is not None:
        ok = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if ok.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None


@pytest.mark.parametrize("path", [SINGLE, CLUSTER], ids=["single", "cluster"])
def test_docker_compose_config_validates(path: Path) -> None:
    compose = _compose()
    if compose is None:
        pytest.skip("docker compose is not installed")
    res = subprocess.run([*compose, "-f", str(path), "config", "--quiet"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- examples, image, Kubernetes

KUBE = ROOT / "deploy" / "kubernetes" / "kdn.yaml"
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


def test_example_config_and_tenants_files_load(tmp_path: Path) -> None:
    from kdn.server.auth import tenants_from_text

    cfg = load_config(ROOT / "deploy" / "kdn.example.yaml", env={})
    assert (cfg.port, cfg.data_port, cfg.metrics_port) == (50051, 50055, 9464)
    text = (ROOT / "deploy" / "tenants.example.yaml").read_text()
    auth = tenants_from_text(text)  # digests only: also good as $KDN_AUTH_TENANTS
    assert auth is not None
    private = tmp_path / "tenants.yaml"
    private.write_text(text)
    private.chmod(0o600)
    assert load_config(env={}, flags={"auth_file": str(private)}).auth_file


def _expand(command: str, env: dict[str, str]) -> list[str]:
    """A CMD-SHELL healthcheck's words after the shell expanded them in ``env``."""
    import shlex

    out = subprocess.run(["sh", "-c", f"printf '%s\\n' {command}"], env=env,
                         capture_output=True, text=True, timeout=30, check=True)
    words = out.stdout.splitlines()
    assert words == shlex.split(out.stdout.replace("\n", " ")), words
    return words


@pytest.mark.parametrize("path", [SINGLE, CLUSTER], ids=["single", "cluster"])
def test_compose_healthchecks_dial_the_configured_port(path: Path) -> None:
    """The healthcheck follows KDN_PORT (it dialled the admin CLI's default 50051 before), is
    liveness (no --ready: a Redis outage must not restart a server answering from RAM and
    disk), and parses with kdn's own CLI."""
    from kdn.cli.main import build_parser

    for name, s in kdn_services(load(path)).items():
        test = s["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL", name
        for port in ("50051", "50071"):
            env = {k: str(v) for k, v in s["environment"].items() if k != "KDN_AUTH_TENANTS"}
            env["KDN_PORT"] = port
            words = _expand(test[1].replace("$$", "$"), env)
            assert words[:3] == ["kdn", "admin", "health"] and "--ready" not in words
            ns = build_parser().parse_args(words[1:])
            assert ns.address == f"127.0.0.1:{port}", (name, words)


def test_dockerfile_exposes_the_ports_it_sets_and_checks_its_own_port() -> None:
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    steps = re.sub(r"\\\n", " ", "\n".join(x for x in docker.splitlines()
                                          if not x.lstrip().startswith("#")))
    env = dict(re.findall(r"(KDN_[A-Z_]+)=(\S+)", " ".join(
        line for line in steps.splitlines() if line.startswith("ENV "))))
    exposed = set(re.search(r"^EXPOSE (.*)$", steps, re.M).group(1).split())  # type: ignore[union-attr]
    cfg = load_config(env=env)
    assert {str(cfg.port), str(cfg.data_port), str(cfg.metrics_port)} <= exposed
    check = re.search(r"^HEALTHCHECK .* CMD (.*)$", steps, re.M).group(1)  # type: ignore[union-attr]
    words = _expand(check, {**env, "KDN_PORT": "50071"})
    assert words[-2:] == ["--address", "127.0.0.1:50071"]


def _kube_docs() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(KUBE.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)
    return docs


CONTAINER_FIELDS = {"name", "image", "command", "args", "env", "ports", "livenessProbe",
                    "readinessProbe", "startupProbe", "resources", "volumeMounts",
                    "securityContext", "imagePullPolicy", "workingDir", "envFrom"}
PROBE_HANDLERS = {"exec", "grpc", "httpGet", "tcpSocket"}


def _check_object(doc: dict[str, Any]) -> None:
    """The fields the Kubernetes API requires of every object, and of ours by kind."""
    assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    assert re.fullmatch(DNS_LABEL, doc["metadata"]["name"]), doc["metadata"]
    expected = {"ConfigMap": "v1", "Service": "v1", "StatefulSet": "apps/v1",
                "Deployment": "apps/v1"}
    assert expected.get(doc["kind"]) == doc["apiVersion"], (doc["kind"], doc["apiVersion"])
    if doc["kind"] == "ConfigMap":
        assert all(isinstance(v, str) for v in doc["data"].values())
    if doc["kind"] == "Service":
        for p in doc["spec"]["ports"]:
            assert {"name", "port", "targetPort"} <= set(p) and 1 <= p["port"] <= 65535
    if doc["kind"] == "StatefulSet":
        spec = doc["spec"]
        assert {"selector", "serviceName", "template"} <= set(spec)
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        pod = spec["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for c in pod["containers"]:
            assert set(c) <= CONTAINER_FIELDS, set(c) - CONTAINER_FIELDS
            assert {"name", "image"} <= set(c)
            for p in c.get("ports", []):
                assert len(p["name"]) <= 15 and 1 <= p["containerPort"] <= 65535
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes and m["mountPath"].startswith("/")
            for probe in ("livenessProbe", "readinessProbe"):
                assert len(set(c[probe]) & PROBE_HANDLERS) == 1, probe
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert "value" in e or (ref and {"name", "key"} <= set(ref)), e


def test_kubernetes_manifests_pass_the_schema_check_and_kdns_own_loaders() -> None:
    from kdn.cli.main import build_parser

    docs = _kube_docs()
    for doc in docs:
        _check_object(doc)
    by_kind = {d["kind"]: d for d in docs}
    sts, svc, cm = by_kind["StatefulSet"], by_kind["Service"], by_kind["ConfigMap"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    pod = sts["spec"]["template"]["spec"]
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"][
        "labels"].items()
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:  # named target ports exist; same numbers (clients learn
        assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"]  # data_port)
    # the server's command, its config from the mounted ConfigMap, the tenants from the Secret
    ns = build_parser().parse_args(c["command"][1:])
    assert ns.cmd == "serve"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    config_key = Path(str(ns.config)).relative_to(mount["mountPath"]).as_posix()
    vol = next(v for v in pod["volumes"] if v["name"] == "config")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    text = cm["data"][config_key]
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        tenants = (ROOT / "deploy" / "tenants.example.yaml").read_text()
        cfg = load_config(f.name, env={"KDN_AUTH_TENANTS": tenants})
    assert (ports["grpc"], ports["data"], ports["metrics"]) == (cfg.port, cfg.data_port,
                                                               cfg.metrics_port)
    assert cfg.host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0" and cfg.auth_tenants
    assert pod["terminationGracePeriodSeconds"] > 2 * cfg.shutdown_grace_s
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    # the Service kdn's links (KDN_PORT=tcp://IP:50051, KDN_PORT_50051_TCP...) are not
    # injected: they would replace the image's KDN_PORT
    assert pod["enableServiceLinks"] is False
    assert any(m["mountPath"] == str(cfg.data_dir) for m in c["volumeMounts"])
    # liveness is `kdn admin health`, readiness `... --ready`, both on the server's port
    live = build_parser().parse_args(c["livenessProbe"]["exec"]["command"][1:])
    ready = build_parser().parse_args(c["readinessProbe"]["exec"]["command"][1:])
    assert (live.admin_cmd, live.ready, ready.admin_cmd, ready.ready) == (
        "health", False, "health", True)
    assert live.address == ready.address == f"127.0.0.1:{cfg.port}"


def test_kubeconform_accepts_the_manifests_where_installed() -> None:
    kubeconform = shutil.which("kubeconform")
    if kubeconform is None:
        pytest.skip("kubeconform is not installed (the schema check above runs everywhere)")
    res = subprocess.run([kubeconform, "-strict", "-summary", str(KUBE)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("path", [SINGLE, CLUSTER], ids=["single", "cluster"])
def test_monitoring_profile_scrapes_every_kdn_server(path: Path) -> None:
    doc = load(path)
    services = doc["services"]
    monitoring = {n for n, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    mount = next(v for v in services["prometheus"]["volumes"]
                 if v.split(":")[1] == "/etc/prometheus/prometheus.yml")
    prom = yaml.safe_load((path.parent / mount.split(":")[0]).read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    want = []
    for name, s in kdn_services(doc).items():
        env = {k: interpolate(str(v), {"KDN_AUTH_TENANTS": TENANTS})
               for k, v in s["environment"].items()}
        want.append(f"{name}:{load_config(env=env).metrics_port}")
    assert sorted(targets) == sorted(want)
    for n in monitoring:
        for v in services[n].get("volumes", []):
            src = v.split(":")[0]
            assert src in (doc.get("volumes") or {}) or (path.parent / src).exists(), v
        assert all(str(p).startswith("127.0.0.1:") for p in services[n].get("ports", []))


def test_the_image_pins_every_server_dependency_within_its_range() -> None:
    import tomllib

    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "deploy" / "constraints-server.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        req = Requirement(dep)
        assert req.name.lower() in pins, f"{req.name} is not pinned for the image"
        assert req.specifier.contains(pins[req.name.lower()]), (req, pins[req.name.lower()])
    assert len(pins) == len(deps)
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY deploy/constraints-server.txt" in docker
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()
    assert "!deploy/constraints-server.txt" in ignore.splitlines()


def _self_signed(tmp: Path, dns: str, ip: str = "") -> tuple[Path, Path]:
    """A self-signed server certificate naming ``dns`` only (not 127.0.0.1), or the address
    ``ip`` only where given (``dns`` its common name), and its key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(ip)) if ip else x509.DNSName(dns)]),
                critical=False)
            .sign(key, hashes.SHA256()))
    (tmp / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp / "tls.key").chmod(0o600)
    return tmp / "tls.crt", tmp / "tls.key"


def test_every_health_probe_passes_on_a_tls_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files say: to serve other hosts set KDN_TLS_CERT/KDN_TLS_KEY. The probes (the
    Dockerfile's HEALTHCHECK, the compose healthchecks, the Kubernetes liveness and readiness
    probes) dialled 127.0.0.1 in plaintext: a healthy TLS server was reported dead. `kdn
    admin` on a loopback address now trusts $KDN_TLS_CERT and expects its name; a certificate
    from a CA passes as a chain that holds the CA."""
    from kdn.cli.main import main
    from kdn.server import ServerConfig, ServerThread
    from tests.helpers import make_certs

    docker = re.sub(r"\\\n", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    probes = [re.search(r"^HEALTHCHECK .* CMD (.*)$", docker, re.M).group(1)]  # type: ignore[union-attr]
    probes += [s["healthcheck"]["test"][1].replace("$$", "$")
               for path in (SINGLE, CLUSTER) for s in kdn_services(load(path)).values()]
    sts = next(d for d in _kube_docs() if d["kind"] == "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    kube = [c[p]["exec"]["command"] for p in ("livenessProbe", "readinessProbe")]
    certs = make_certs(tmp_path)
    chain = tmp_path / "chain.crt"  # the server's certificate, then its CA's
    chain.write_bytes(certs["server.crt"].read_bytes() + certs["ca.crt"].read_bytes())
    for cert, key in (_self_signed(tmp_path, "kdn.example.internal"),
                      (chain, certs["server.key"])):
        cfg = ServerConfig(port=0, data_port=-1, data_dir=tmp_path / "d", disk_bytes=0,
                           tls_cert=str(cert), tls_key=str(key))
        with ServerThread(cfg) as st:
            port = st.address.rpartition(":")[2]
            env = {"KDN_PORT": port, "KDN_TLS_CERT": str(cert), "KDN_TLS_KEY": str(key)}
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            runs = [_expand(p, env) for p in probes] + [
                [w.replace(":50051", f":{port}") for w in k] for k in kube]
            for words in runs:
                assert words[:3] == ["kdn", "admin", "health"], words
                assert main(words[1:]) == 0, (cert.name, words)
            monkeypatch.delenv("KDN_TLS_CERT")  # plaintext against TLS: still refused
            assert main(runs[0][1:]) == 1


def test_the_probe_expects_an_ipv6_loopback_certificate_by_its_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A certificate whose only name is the IP ::1: `kdn admin health --address [::1]:PORT`
    trusting $KDN_TLS_CERT compared '::1' with Python's '0:0:0:0:0:0:0:1', found no match and
    expected that text as a name, which no IP SAN matches ('Hostname Verification Check
    failed'; --tls-ca passed)."""
    import socket

    from kdn.cli.main import main
    from kdn.server import ServerConfig, ServerThread

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    cert, key = _self_signed(tmp_path, "kdn", ip="::1")
    cfg = ServerConfig(host="::1", port=0, data_port=-1, data_dir=tmp_path / "d",
                       disk_bytes=0, tls_cert=str(cert), tls_key=str(key))
    with ServerThread(cfg) as st:
        address = f"[::1]:{st.address.rpartition(':')[2]}"
        monkeypatch.setenv("KDN_TLS_CERT", str(cert))
        assert main(["admin", "health", "--timeout", "5", "--address", address]) == 0
