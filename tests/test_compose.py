"""The compose file's kdn + Redis pair, run as real processes with the compose file's own
settings (Docker is not available here: the same command lines, with loopback ports and
temporary folders for the container paths): Prometheus can scrape /metrics, the healthcheck
commands pass, auth is on (a key is needed, the admin key apart), an entry stores and comes
back, and SIGTERM drains well inside compose's stop grace. (The Grafana dashboard's queries
are checked against the exported names in tests/test_dashboard.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import yaml

from bench.common import free_port, port_open, wait_until
from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import PermissionDenied, Unauthenticated
from kdn.server.auth import digest
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import redis_server_binary

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
LAY = uniform_layout(layers=2, heads=2, dim=8)
TENANTS = ('{engines: {api_keys: ["sha256:' + digest("engine-key") + '"]}, '
           'ops: {api_keys: ["sha256:' + digest("ops-key") + '"], role: admin}}')


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` substitution."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg
    return re.sub(r"\$\{(\w+)(:[-?])?([^}]*)\}", one, value)


def _services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # type: ignore[no-any-return]


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)s", text)
    assert m, text
    return float(m.group(1))


def test_compose_settings_are_safe_as_written() -> None:
    services = _services()
    kdn, redis = services["kdn"], services["redis"]
    env = kdn["environment"]
    with pytest.raises(KeyError, match="KDN_AUTH_TENANTS"):  # auth on: no key, no start
        interpolate(env["KDN_AUTH_TENANTS"], {})
    assert env["KDN_METRICS_HOST"] == "0.0.0.0" and env["KDN_METRICS_PORT"] in kdn["expose"]
    assert all(str(p).startswith("127.0.0.1:") for p in kdn["ports"])  # plaintext: host only
    port = env["KDN_DATA_PORT"]  # the data path: clients learn its number from the server
    assert f"127.0.0.1:{port}:{port}" in kdn["ports"]
    assert "healthcheck" in kdn and "healthcheck" in redis
    # the drain (in-flight calls, KDN_SHUTDOWN_GRACE_S), then the write-behind flush (up to as
    # long again, kdn.server.app): compose must wait longer than both before its SIGKILL
    assert _seconds(kdn["stop_grace_period"]) > 2 * float(env["KDN_SHUTDOWN_GRACE_S"]) + 5
    assert any(v.endswith(":/data") for v in kdn["volumes"])   # LMDB
    assert any(v.endswith(":/data") for v in redis["volumes"])  # the AOF
    assert "--appendonly" in redis["command"]
    monitoring = {n for n, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    assert services["prometheus"]["depends_on"]["kdn"]["condition"] == "service_healthy"
    assert all(str(p).startswith("127.0.0.1:") for n in monitoring
               for p in services[n].get("ports", []))  # Grafana and Prometheus: host only
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"kdn:{env['KDN_METRICS_PORT']}"]
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    steps = re.sub(r"\\\n", " ", "\n".join(x for x in docker.splitlines()
                                          if not x.lstrip().startswith("#")))
    assert re.search(r"^USER kdn$", steps, re.M)  # not root
    installs = re.findall(r"pip install ([^&\n]*)", steps)
    assert [i.strip() for i in installs] == ["-c constraints-server.txt ."], installs  # slim,
    # pinned (tests/test_deploy.py checks the pins)
    assert "torch" not in steps
    assert re.search(r"^ENV .*KDN_METRICS_HOST=0\.0\.0\.0", steps, re.M | re.S)


def test_the_compose_pair_runs_as_written(tmp_path: Path) -> None:
    services = _services()
    redis_port, kdn_port, metrics_port = free_port(), free_port(), free_port()
    # redis: the compose command line, on a loopback port, its /data in a temporary folder
    rcmd = list(services["redis"]["command"])
    assert rcmd[0] == "redis-server"
    rdir = tmp_path / "redis-data"
    rdir.mkdir()
    redis = subprocess.Popen([redis_server_binary(), *rcmd[1:], "--port", str(redis_port),
                              "--bind", "127.0.0.1", "--dir", str(rdir), "--save", ""],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: port_open(redis_port), "redis", redis)  # type: ignore[arg-type]
        rhc = services["redis"]["healthcheck"]["test"]
        assert rhc[:2] == ["CMD", "redis-cli"]
        if shutil.which("redis-cli"):  # Redis' healthcheck, as compose runs it, on this port
            ok = subprocess.run([*rhc[1:2], "-p", str(redis_port), *rhc[2:]],
                                capture_output=True, text=True, timeout=30)
            assert ok.returncode == 0 and ok.stdout.strip() == "PONG", ok.stderr
        else:
            assert redis_lib.Redis(port=redis_port).ping()  # the same PING
        kdn = services["kdn"]
        env = {k: interpolate(str(v), {"KDN_AUTH_TENANTS": TENANTS})
               for k, v in kdn["environment"].items()}
        env["KDN_REDIS_URL"] = env["KDN_REDIS_URL"].replace("redis:6379",
                                                            f"127.0.0.1:{redis_port}")
        env["KDN_PORT"], env["KDN_METRICS_PORT"] = str(kdn_port), str(metrics_port)
        env["KDN_DATA_PORT"] = str(free_port())
        env["KDN_DATA_DIR"] = str(tmp_path / "kdn-data")  # the Dockerfile's /data volume
        env["KDN_HOST"] = "127.0.0.1"  # the container's 0.0.0.0, kept off this host's network
        env["KDN_METRICS_HOST"] = "127.0.0.1"
        bindir = str(Path(sys.executable).parent)
        proc_env = {**env, "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
                    "HOME": str(tmp_path)}
        log = tmp_path / "kdn.log"
        with open(log, "wb") as out:
            server = subprocess.Popen(["kdn", "serve"], env=proc_env, stdout=out,
                                      stderr=subprocess.STDOUT, cwd=tmp_path)
        wait_until(lambda: port_open(kdn_port) and port_open(metrics_port), "kdn", server)
        address = f"127.0.0.1:{kdn_port}"
        # the healthcheck, as compose runs it (no key): it dials the port KDN_PORT names
        hc = kdn["healthcheck"]["test"]
        assert hc[0] == "CMD-SHELL"
        run = subprocess.run(["sh", "-c", hc[1].replace("$$", "$")], env=proc_env,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr + run.stdout
        # auth is on: no key refused, the engines' key stores and reads, the admin key apart
        key, kv = keys.chunk_key([1, 2, 3], LAY), random_kv(LAY, 8)
        with Client(address, retry=None) as anon, pytest.raises(Unauthenticated):
            anon.lookup([key])
        with AdminClient(address, api_key="engine-key") as c:
            c.store(key, kv)
            got = c.retrieve(key)
            assert got is not None and got.equal(kv)
            with pytest.raises(PermissionDenied):
                c.gc()
        with AdminClient(address, api_key="ops-key") as ops:
            report = ops.health_report()
            assert report["status"] == "SERVING" and set(report["tiers"]) == {
                "ram", "redis", "disk"}
        # Prometheus' scrape: the compose network's address is the metrics port
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert 'kdn_tokens_stored_total{model="test-model",tenant="engines"} 8.0' in text
        assert 'kdn_tier_healthy{tier="redis"} 1.0' in text
        # JSON log lines with the request id
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        assert any(x.get("logger") == "kdn.access" and x.get("request_id") for x in lines)
        # SIGTERM: drained and gone well inside compose's stop grace
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=_seconds(kdn["stop_grace_period"])) == 0
        assert time.monotonic() - started < float(env["KDN_SHUTDOWN_GRACE_S"]) + 5
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        redis.kill()
        redis.wait()

