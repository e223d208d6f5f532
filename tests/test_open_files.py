"""``kdn serve`` raises its soft open-files limit to the hard one at start
(``kdn.server.nofile``): every connection is a descriptor, and the 1,024 most shells and
systemd units start a process with is below what the default connection bounds let clients
hold (past it a new client waited and timed out, and nothing was logged). Where the hard limit
is short too, it says so."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

from bench.common import free_port, process, wait_until
from kdn.server import ServerConfig
from kdn.server.nofile import descriptors_needed

_LIMITED = ("import os, resource, sys; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
            "os.execv(sys.executable, [sys.executable, '-m', 'kdn', *sys.argv[3:]])")


def _serve_limited(tmp: Path, soft: int, hard: int) -> tuple[int, str]:
    """``kdn serve`` started with these limits: its soft limit once serving, and its log."""
    log = tmp / f"server-{soft}-{hard}.log"
    cmd = [sys.executable, "-c", _LIMITED, str(soft), str(hard), "serve", "--port",
           str(free_port()), "--data-dir", str(tmp / "d"), "--disk-bytes", "0",
           "--ram-bytes", "64MiB", "--prefault-bytes", "0", "--shm-arena-bytes", "0"]
    with process(cmd, log) as proc:
        wait_until(lambda: "kdn serving on" in log.read_text(), "kdn serve", proc)
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
    line = next(x for x in limits if x.startswith("Max open files"))
    return int(line.split()[3]), log.read_text()


def test_kdn_serve_raises_its_soft_open_files_limit(tmp_path: Path) -> None:
    need = descriptors_needed(ServerConfig())
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this host's hard open-files limit ({hard}) is below {need}")
    hard = need + 100
    soft, out = _serve_limited(tmp_path, 1024, hard)
    assert soft == hard
    assert "open files" not in out
    soft, out = _serve_limited(tmp_path, 1024, 1024)  # the hard limit is short too: said
    assert soft == 1024
    assert f"open files: the limit is 1024 (hard 1024), below the {need} descriptors" in out
