"""The deployment files: docker-compose.yml (kdn + Redis) and deploy/docker-compose.cluster.yml
(several kdn servers on one Redis Cluster) parse, hang together, and carry settings that kdn's
own config loader accepts; ``docker compose config`` validates them where docker compose is
installed."""

from __future__ import annotations

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
    used = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}
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
