"""kdn.buffers.tune_allocator: fixed glibc thresholds, once per process, and a way out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import json
from kdn import buffers
first = buffers.tune_allocator()
print(json.dumps([first, buffers.tune_allocator()]))
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


def test_the_allocator_is_tuned_once_and_can_be_left_alone() -> None:
    _glibc()
    base = BASE
    assert _run(base) == "[true, true]"
    assert _run({**base, "KDN_MALLOC_TUNING": "off"}) == "[false, false]"


def test_a_client_tunes_the_allocator_of_its_process() -> None:
    _glibc()
    code = ("from kdn import buffers\nfrom kdn.client import Client\n"
            "assert buffers._tuned is None\nClient('127.0.0.1:1').close()\n"
            "print(buffers._tuned)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=BASE, check=True, timeout=60)
    assert out.stdout.strip() == "True"
