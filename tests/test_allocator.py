"""kdn.transport.buffers.tune_allocator: fixed glibc thresholds, once per process, and a way out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import json
from kdn.transport import buffers
first = buffers.tune_allocator()
kept = [buffers.kept_free_bytes()]
again = buffers.tune_allocator()
for trim in (512 << 20, 256 << 20):  # a server's raises it; a smaller one leaves it
    buffers.tune_allocator(trim)
    kept.append(buffers.kept_free_bytes())
print(json.dumps([first, again, *kept]))
"""


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, check=True, timeout=60)
    return out.stdout.strip()


def _glibc() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc: nothing to tune")


BASE = {k: v for k, v in os.environ.items() if k != "KDN_MALLOC_TUNING"}


def test_the_allocator_is_tuned_once_its_trim_only_raised_and_it_can_be_left_alone() -> None:
    _glibc()
    base = BASE
    mib = 1 << 20
    assert _run(base) == f"[true, true, {128 * mib}, {512 * mib}, {512 * mib}]"
    # left alone: nothing set; a server keeps Stores as frames up to what it kept before
    assert _run({**base, "KDN_MALLOC_TUNING": "off"}) == \
        f"[false, false, {128 * mib}, {128 * mib}, {128 * mib}]"


def test_a_client_tunes_the_allocator_of_its_process() -> None:
    _glibc()
    code = ("from kdn.transport import buffers\nfrom kdn.client import Client\n"
            "assert buffers._tuned is None\nClient('127.0.0.1:1').close()\n"
            "print(buffers._tuned)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=BASE, check=True, timeout=60)
    assert out.stdout.strip() == "True"


def test_a_server_keeps_the_free_heap_its_ram_tier_warrants() -> None:
    """``start_server`` raises its process's trim threshold to ``server_trim_bytes``: half
    the RAM tier (here 600 MiB: 300 MiB), so a Store kept as its messages finds the memory
    of the one it replaced still in the heap."""
    _glibc()
    code = ("import tempfile\nfrom kdn.transport import buffers\n"
            "from kdn.server import ServerConfig, ServerThread\n"
            "with tempfile.TemporaryDirectory() as d, ServerThread(ServerConfig(\n"
            "        port=0, data_dir=d, ram_bytes=600 << 20, disk_bytes=0)):\n"
            "    print(buffers.kept_free_bytes() >> 20)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=BASE, check=True, timeout=120)
    assert out.stdout.strip() == "300"
