"""The wire contract's generated code is current, and the deployment files parse."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    fresh = gen_proto.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        checked_in = ROOT / "kdn" / "v1" / path.name
        assert checked_in.exists(), f"{checked_in} missing: run python scripts/gen_proto.py"
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"{checked_in.name} is stale: run python scripts/gen_proto.py"
        )


def test_compose_file_runs_kdn_with_redis() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"kdn", "redis"} <= set(services)
    kdn = services["kdn"]
    assert kdn["build"]["dockerfile"] == "deploy/Dockerfile"
    env = kdn["environment"]
    assert env["KDN_REDIS_URL"].startswith("redis://redis:")
    assert env["KDN_HOST"] == "0.0.0.0"
    assert any(str(p).endswith(":50051") for p in kdn["ports"])
    assert "redis" in kdn["depends_on"]


def test_dockerfile_installs_and_serves() -> None:
    lines = [ln.strip() for ln in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()]
    instr = [ln.split()[0] for ln in lines if ln and not ln.startswith("#")]
    assert instr[0] == "FROM" and "python:3.11" in lines[[i for i, ln in enumerate(lines)
                                                          if ln.startswith("FROM")][0]]
    assert not any("torch" in ln for ln in lines if ln.startswith("RUN")), \
        "the server image is the slim install: no torch"
    assert any(ln.startswith("USER ") and ln.split()[1] not in ("root", "0") for ln in lines)
    cmd = [ln for ln in lines if ln.startswith("CMD")][-1]  # (the HEALTHCHECK has one too)
    assert '"kdn"' in cmd and '"serve"' in cmd
    assert any(ln.startswith("EXPOSE ") and "50051" in ln.split() for ln in lines)
