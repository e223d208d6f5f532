"""What pyproject.toml declares matches what kdn imports and what its build needs: dependency
floors that admit no release kdn fails on, the build backend's floor, the files a wheel and an
sdist carry. Nothing is installed; the archives are built from a copy of the tracked files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(name: str, extra: str | None = None) -> Requirement:
    project = PYPROJECT["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_redis_floor_has_the_backoff_kdn_imports() -> None:
    # kdn.store.redis_transport imports redis.backoff.ExponentialWithJitterBackoff, first in
    # redis-py 5.3.0: with 5.0-5.2 `kdn serve` died at import, even with no Redis tier
    assert "ExponentialWithJitterBackoff" in (ROOT / "kdn/store/redis_transport.py").read_text()
    spec = _requirement("redis").specifier
    assert not spec.contains("5.2.1") and spec.contains("5.3.0")


def test_transformers_floor_is_a_release_kdn_runs_on() -> None:
    # 4.56 and 4.57 were allowed and failed: 4.57.6's DynamicLayer.lazy_initialization takes
    # the keys alone (hf.to_transformers raised TypeError); 5.0.0 runs the adapter
    spec = _requirement("transformers", "model").specifier
    assert not spec.contains("4.57.6") and spec.contains("5.0.0")


def test_the_model_extra_kdn_checks_is_the_one_declared() -> None:
    # kdn.extras.MODEL: what the CLI checks before loading a model and what MissingExtra
    # tells apart from any other missing module (a slim install's 'No module named torch')
    from kdn.extras import MODEL

    declared = {Requirement(d).name for d in PYPROJECT["project"]["optional-dependencies"]["model"]}
    assert declared == set(MODEL)


def test_the_build_backend_floor_reads_the_license_field() -> None:
    # license = "Apache-2.0" (a PEP 639 SPDX string) is read from setuptools 77 on: 68-76 (a
    # distro's, with --no-build-isolation) failed the build ('project.license must be valid')
    assert isinstance(PYPROJECT["project"]["license"], str)
    (backend,) = map(Requirement, PYPROJECT["build-system"]["requires"])
    assert backend.name == "setuptools"
    assert not backend.specifier.contains("76.1.0") and backend.specifier.contains("77.0.0")


def _built(tmp: Path, kind: str) -> list[str]:
    """The names in kdn's ``kind`` ("sdist" or "wheel") built by setuptools (this
    environment's, no isolation: nothing is downloaded) from a copy of the tracked files."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    tree = tmp / "tree"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    out = tmp / "out"
    out.mkdir()
    code = f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    archive = out / run.stdout.strip().splitlines()[-1]
    if kind == "wheel":
        return zipfile.ZipFile(archive).namelist()
    return [n.partition("/")[2] for n in tarfile.open(archive).getnames()]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout (git ls-files)")
def test_the_wheel_is_typed_and_the_sdist_carries_what_tests_and_regenerates_kdn(
        tmp_path: Path) -> None:
    # the wheel had no py.typed (users' type checkers took kdn as untyped); the sdist had the
    # test files but not their conftest, helpers and bench, nor the .proto kdn.v1 comes from
    wheel = _built(tmp_path / "w", "wheel")
    assert "kdn/py.typed" in wheel and not any(n.startswith(("tests/", "bench/")) for n in wheel)
    sdist = set(_built(tmp_path / "s", "sdist"))
    for name in ("protos/kdn/v1/kdn.proto", "scripts/gen_proto.py", "tests/conftest.py",
                 "tests/helpers.py", "bench/common.py", "deploy/Dockerfile"):
        assert name in sdist, name
    assert not any("__pycache__" in n for n in sdist)
