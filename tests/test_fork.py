"""kdn in a child of fork() (a multiprocessing worker's start): the codec and every shared
thread pool work there as in the parent (``kdn.pools``: the child makes its own threads); a
Client made by the parent refuses every call there at once with InvalidArgument, instead of
hanging on a channel the child can not use, and a Client made in the child works. So does an
AsyncClient made by the parent (its calls were queued for a store thread the child does not
have, and never returned)."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Callable

import pytest

from kdn import codec
from kdn.client import AsyncClient, Client
from kdn.client import stream as client_stream
from kdn.codec import gpu_source
from kdn.codec.format import parse_header, sums_checked_later
from kdn.errors import InvalidArgument
from kdn.server import ServerConfig, ServerThread
from kdn.server.batch import copy_pool
from kdn.transport.buffers import copy_threads
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()
FORKED = "a Client cannot be used after fork(): make a new one in the child"


def in_child(fn: Callable[[], str], timeout_s: float = 20.0) -> str:
    """What ``fn()`` returns in a fork child (an error it raises: its kind and message), or
    "hung" when the child did not finish within ``timeout_s`` (it is killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            try:
                out = fn()
            except BaseException as exc:  # noqa: BLE001
                out = f"{type(exc).__name__}: {exc}"
            os.write(w, out.encode()[:4096])
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "hung"
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


def test_the_codec_works_in_a_fork_child() -> None:
    kv = random_kv(LAYOUT, 64, seed=1)
    assert codec.decode(codec.encode(kv)).equal(kv)  # the parent's pools have threads

    def child() -> str:
        for mode in ("lossless", "raw"):
            if not codec.decode(codec.encode(kv, mode)).equal(kv):
                return f"{mode}: decoded another value"
        return "ok"

    assert in_child(child) == "ok"


def _encoded(seed: int) -> bytes:
    return codec.encode(random_kv(LAYOUT, 16, seed=seed))


def test_multiprocessing_fork_workers_use_the_codec() -> None:
    want = [_encoded(i) for i in range(4)]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map_async(_encoded, range(4)).get(timeout=30) == want


def test_a_fork_child_leaves_the_parents_garbage_alone() -> None:
    """Garbage the parent left (reference cycles of closed clients and in-process servers,
    holding gRPC objects) was collected by a fork child's first collection, and freeing it
    there crashed the child (SIGSEGV: a multiprocessing worker died mid-encode and its Pool
    waited forever, after test_arena's servers). The child's collector now leaves it be."""
    import gc

    class Cycle:
        pass

    enabled = gc.isenabled()
    gc.disable()  # the parent's garbage stays garbage until the fork
    try:
        for _ in range(100):
            c = Cycle()
            c.me = c  # type: ignore[attr-defined]
            del c
        assert in_child(lambda: str(gc.collect())) == "0"
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def test_every_shared_pool_runs_work_in_a_fork_child() -> None:
    getters = [copy_pool, copy_threads, client_stream.pool]
    for get in getters:  # each made, with threads, in the parent
        assert get().submit(os.getpid).result(timeout=10) == os.getpid()
    ran: list[int] = []
    gpu_source.run_all(ran.append, [1, 2, 3])
    assert sorted(ran) == [1, 2, 3]
    parts = codec.encode_parts(random_kv(LAYOUT, 16), "raw")
    sums_checked_later(parse_header(parts.header), parts.frames)()  # waits on the sum threads

    def child() -> str:
        pids = {get().submit(os.getpid).result(timeout=10) for get in getters}
        staged: list[int] = []
        gpu_source.run_all(staged.append, [1, 2, 3])
        sums_checked_later(parse_header(parts.header), parts.frames)()
        return "ok" if pids == {os.getpid()} and sorted(staged) == [1, 2, 3] else \
            f"pids {pids}, staged {staged}"

    assert in_child(child) == "ok"


@pytest.mark.parametrize("remote", [False, True], ids=["same-host", "remote"])
def test_a_parents_client_refuses_in_the_child_and_a_new_one_works(
        server: ServerThread, remote: bool) -> None:
    extra = {"shm_bytes": 0} if remote else {}
    kv, kv2 = random_kv(LAYOUT, 16, seed=1), random_kv(LAYOUT, 16, seed=2)
    with Client(server.address, timeout_s=5, **extra) as c:  # type: ignore[arg-type]
        c.store(numbered_key(1), kv)
        assert c.retrieve(numbered_key(1)) is not None

        def child() -> str:
            refused = []
            t0 = time.monotonic()
            for call in (lambda: c.store(numbered_key(2), kv2),
                         lambda: c.store_async(numbered_key(2), kv2),
                         lambda: c.retrieve(numbered_key(1)),
                         lambda: c.fetch_many([numbered_key(1)]),
                         lambda: c.lookup([numbered_key(1)]),
                         lambda: c.delete(numbered_key(1)),
                         c.flush, c.stats):
                try:
                    call()
                except InvalidArgument as exc:
                    refused.append(str(exc) == FORKED)
            c.close()  # nothing: the channel and the segment are the parent's
            if refused != [True] * 8 or time.monotonic() - t0 > 2:
                return f"refused {refused} in {time.monotonic() - t0:.1f} s"
            with Client(server.address, timeout_s=5, **extra) as mine:  # type: ignore[arg-type]
                mine.store(numbered_key(2), kv2)
                got = mine.retrieve(numbered_key(2), layout=LAYOUT)
                one = mine.retrieve(numbered_key(1), layout=LAYOUT)
            return "ok" if got is not None and got.equal(kv2) and one is not None \
                and one.equal(kv) else "the child's client read other values"

        assert in_child(child) == "ok"
        got = c.retrieve(numbered_key(2), layout=LAYOUT)  # the parent's client carries on
        assert got is not None and got.equal(kv2)
        c.store(numbered_key(3), kv)
        assert c.lookup([numbered_key(3)]).infos[0].present


def test_a_parents_async_client_refuses_in_the_child(server: ServerThread) -> None:
    import asyncio

    kv = random_kv(LAYOUT, 16, seed=3)
    ac = AsyncClient(Client(server.address, timeout_s=5))

    async def parent() -> None:
        await ac.store_async(numbered_key(1), kv)  # the store thread started
        await ac.flush()

    asyncio.run(parent())
    try:
        for call in (lambda: ac.store_async(numbered_key(2), kv), ac.flush,
                     lambda: ac.retrieve(numbered_key(1))):
            out = in_child(lambda call=call: str(asyncio.run(call())))  # type: ignore[misc]
            assert out.startswith("InvalidArgument: an AsyncClient cannot be used after fork")
        assert in_child(lambda: str(asyncio.run(ac.close()))) == "None"  # nothing there
        assert asyncio.run(ac.retrieve(numbered_key(1))) is not None  # the parent's works
    finally:
        asyncio.run(ac.close())
        ac.client.close()


@pytest.mark.parametrize("remote", [False, True], ids=["same-host", "remote"])
def test_a_fork_leaves_another_threads_unanswered_stores_to_the_parent(
        server: ServerThread, remote: bool) -> None:
    """A thread's stores sent and not yet answered when another thread forks are answered in
    the parent, each with its own answer: the child, where that thread is gone, settled them
    as a dead thread's and read their answers off the connection it shares with the parent
    (the parent's flush then waited its whole deadline, and reported stored entries as maybe
    not stored)."""
    import threading

    extra = {"shm_bytes": 0} if remote else {}
    kvs = [random_kv(LAYOUT, 16, seed=10 + i) for i in range(5)]
    with Client(server.address, timeout_s=4, **extra) as c:  # type: ignore[arg-type]
        c.store(numbered_key(0), kvs[0])  # attached (same host) / connected
        sent, go, out = threading.Event(), threading.Event(), {}

        def worker() -> None:
            for i in range(1, 5):
                c.store_async(numbered_key(i), kvs[i], mode="raw")
            sent.set()
            go.wait()
            t0 = time.monotonic()
            try:
                c.flush()
                out["flush"] = "ok"
            except Exception as exc:  # noqa: BLE001
                out["flush"] = f"{type(exc).__name__}: {exc}"
            out["s"] = time.monotonic() - t0

        t = threading.Thread(target=worker)
        t.start()
        assert sent.wait(10)
        assert in_child(lambda: time.sleep(0.5) or "ok") == "ok"
        go.set()
        t.join(10)
        assert out.get("flush") == "ok" and out["s"] < 2, out
        for i in range(1, 5):
            got = c.retrieve(numbered_key(i), layout=LAYOUT)
            assert got is not None and got.equal(kvs[i])


@pytest.mark.parametrize("arena", [0, 1 << 20], ids=["segment", "arena"])
def test_results_inherited_by_a_fork_child_stay_as_they_were(
        server_config: ServerConfig, arena: int) -> None:
    """What ``retrieve`` returned before a fork views shared memory (the client's segment,
    or the server's read arena): in the child it is a snapshot (``kdn.client.forked``). The
    parent reading other entries into the same memory (the entry deleted: its arena slot
    reused) does not change the child's copy, nor the child writing its copy in place the
    parent's."""
    lay = uniform_layout(layers=2, heads=4, dim=64)  # 64 KiB an entry of 64 tokens
    kvs = [random_kv(lay, 64, seed=20 + i) for i in range(12)]
    config = dataclasses.replace(server_config, shm_arena_bytes=arena)
    with ServerThread(config) as st, Client(st.address, timeout_s=10, shm_bytes=8 << 20) as c:
        c.store_many([(numbered_key(i), kv) for i, kv in enumerate(kvs[:2])], mode="raw")
        inherited, held = c.retrieve(numbered_key(0)), c.retrieve(numbered_key(1))
        assert inherited is not None and held is not None and c.dataplane.segment()[0]
        to_child, to_parent = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                for t in (t for layer in held.layers for t in layer):
                    t.fill_(0)  # its copy of the parent's
                os.write(to_parent[1], b"w")
                os.read(to_child[0], 1)  # the parent read other entries meanwhile
                os.write(to_parent[1], b"1" if inherited.equal(kvs[0]) else b"0")
            finally:
                os._exit(0)
        try:
            assert os.read(to_parent[0], 1) == b"w"
            assert held.equal(kvs[1]), "the child's write reached the parent's result"
            del inherited
            gc.collect()
            c.delete(numbered_key(0))
            for i in range(2, 12):
                c.store(numbered_key(i), kvs[i], mode="raw")
                got = c.retrieve(numbered_key(i))  # where the parent's copy of entry 0 was
                assert got is not None and got.equal(kvs[i])
            os.write(to_child[1], b"x")
            same = os.read(to_parent[0], 1)
        finally:
            os.kill(pid, signal.SIGKILL)  # (done by now, unless the parent failed first)
            os.waitpid(pid, 0)
            for fd in (*to_child, *to_parent):
                os.close(fd)
        assert same == b"1", "the child's result changed as the parent read on"
