"""scripts/gpu-checks.sh and scripts/gpu-blend.sh report a failed step in their exit status:
they ran with ``set -u`` alone and each step's status was lost in ``| tee | tail``, so a host
whose every check failed (a broken torch) exited 0. Run here with a fake Python (no GPU
needed): one that fails every command, one that passes them all."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,args", [("gpu-checks.sh", ["1"]), ("gpu-blend.sh", [])])
@pytest.mark.parametrize("status", [1, 0])
def test_a_failed_step_fails_the_script(tmp_path: Path, script: str, args: list[str],
                                        status: int) -> None:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho 'fake python'\nexit {status}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    env.update(PYTHON=str(fake), OUT=str(tmp_path / "out"), NO_HEAP="", LINK_S="5")
    run = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    if status:
        assert run.returncode == 1, run.stdout + run.stderr
        assert "failed: " in run.stderr and "bench." in run.stderr  # every step ran
        if script == "gpu-checks.sh":
            assert all(s in run.stderr for s in ("pytest -m gpu (exit 1)", "bench.gpu",
                                                 "bench.heap", "bench.link"))
    else:
        assert run.returncode == 0, run.stdout + run.stderr
