"""kdn.transport.buffers.tune_allocator: fixed glibc thresholds, once per process, and a way out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kdn.transport.buffers import SERVER_ARENAS

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


ARENAS = """
import asyncio, ctypes, os, sys, tempfile, threading
from kdn.server import ServerConfig, ServerThread
from kdn.server.app import serve
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def allocate_at_once():
    go = threading.Barrier(16)
    def alloc():
        go.wait()
        libc.free(libc.malloc(1000))
    threads = [threading.Thread(target=alloc) for _ in range(16)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc.malloc_stats()  # to stderr: an "Arena N:" block per arena
    sys.stderr.flush()

with tempfile.TemporaryDirectory() as d:
    config = ServerConfig(port=0, data_dir=d, disk_bytes=0)
    if sys.argv[1] == "serve":  # kdn serve's process
        async def main():
            asyncio.ensure_future(serve(config))
            await asyncio.sleep(0.5)
            allocate_at_once()
            os._exit(0)
        asyncio.run(main())
    with ServerThread(config):  # a server inside another program's process
        allocate_at_once()
"""


def _arenas(env: dict[str, str], how: str = "serve") -> int:
    out = subprocess.run([sys.executable, "-c", ARENAS, how], capture_output=True, text=True,
                         env=env, check=True, timeout=120)
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_kdn_serve_allocates_from_few_heaps() -> None:
    """Each glibc heap (arena) keeps up to the trim threshold free, and glibc makes one per
    new thread up to eight per core: a loaded server held 0.7-0.9 GiB with a 64 MiB RAM tier,
    long after its clients left. ``kdn serve`` caps them (``SERVER_ARENAS``); sixteen threads
    allocating at once share them. ``MALLOC_ARENA_MAX`` in the environment is left to glibc,
    and so is the process of a program that runs a server inside it (``ServerThread``): its
    own threads' heaps are not the server's to cap."""
    _glibc()
    capped = SERVER_ARENAS
    env = {k: v for k, v in BASE.items() if k != "MALLOC_ARENA_MAX"}
    assert _arenas(env) <= capped
    assert _arenas({**BASE, "MALLOC_ARENA_MAX": "64"}) > capped
    assert _arenas(env, "thread") > capped
