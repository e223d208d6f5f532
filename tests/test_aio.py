"""AsyncClient over a real server: stores sent by ``store_async`` (on the AsyncClient's one
store thread) are all answered by ``await flush()``, which raises a damaged one's error, and by
``await close()``, after which each ``result()`` has its answer or its error; a call made after
them sees them; ``async with`` closes the client. Both asynchronous paths: the fast path of a
client on the server's host, the network data path of one without a segment."""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from typing import Any

import pytest

from kdn import codec
from kdn.client import AsyncClient, Client
from kdn.client.pending import ASYNC_DEPTH
from kdn.codec import EncodedParts
from kdn.errors import Closed, InvalidArgument
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()
PATHS = pytest.mark.parametrize("path", [{"data_path": False}, {"shm_bytes": 0}],
                                ids=["same-host", "network"])


def damaged(kv: Any) -> EncodedParts:
    """``kv`` encoded, its last frame's bytes changed (the server refuses it)."""
    good = codec.encode_parts(kv, "raw")
    frame = bytearray(good.frames[-1])
    frame[-3] ^= 0x10
    return EncodedParts(good.header, [*good.frames[:-1], bytes(frame)])


@PATHS
def test_flush_answers_every_async_store(server: ServerThread, path: dict[str, Any]) -> None:
    kvs = [random_kv(LAYOUT, 16, seed=i) for i in range(20)]

    async def main() -> None:
        ac = AsyncClient(Client(server.address, timeout_s=30, **path))
        pending = await asyncio.gather(*(ac.store_async(numbered_key(100 + i), kv, mode="raw")
                                         for i, kv in enumerate(kvs)))
        await ac.flush()
        assert [p.done() for p in pending] == [True] * len(kvs)
        assert all(p.result().stored_bytes > 0 for p in pending)  # on the loop's thread
        got = await asyncio.gather(*(ac.retrieve(numbered_key(100 + i), layout=LAYOUT)
                                     for i in range(len(kvs))))
        assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
        await ac.close()

    asyncio.run(main())


@PATHS
def test_flush_raises_a_damaged_store_and_close_answers_the_rest(
        server: ServerThread, path: dict[str, Any]) -> None:
    kvs = [random_kv(LAYOUT, 40, seed=10 + i) for i in range(3)]

    async def main() -> None:
        ac = AsyncClient(Client(server.address, timeout_s=30, **path))
        first = [await ac.store_async(numbered_key(20), kvs[0]),
                 await ac.store_async(numbered_key(21), damaged(kvs[1])),
                 await ac.store_async(numbered_key(22), kvs[2])]
        with pytest.raises(InvalidArgument, match="corrupt"):
            await ac.flush()
        await ac.flush()  # reported once
        then = [await ac.store_async(numbered_key(23), damaged(kvs[1])),
                await ac.store_async(numbered_key(24), kvs[0])]
        await ac.close()  # no flush: close answers them
        for p in (first[1], then[0]):
            with pytest.raises(InvalidArgument, match="corrupt"):
                p.result()
        assert all(p.result().stored_bytes for p in (first[0], first[2], then[1]))

    asyncio.run(main())
    with Client(server.address, timeout_s=30) as c:
        assert [c.contains(numbered_key(i)) for i in range(20, 25)] == [
            True, False, True, False, True]


@PATHS
def test_a_call_after_async_stores_sees_them(server: ServerThread,
                                             path: dict[str, Any]) -> None:
    old, new = random_kv(LAYOUT, 64, seed=1), random_kv(LAYOUT, 64, seed=2)

    async def main() -> None:
        ac = AsyncClient(Client(server.address, timeout_s=30, **path))
        await ac.store(numbered_key(30), old, mode="raw")
        for i in range(5):
            p = await ac.store_async(numbered_key(30), new if i % 2 == 0 else old, mode="raw")
            got = await ac.retrieve(numbered_key(30), layout=LAYOUT)
            assert p.done() and got is not None and got.equal(new if i % 2 == 0 else old)
        await ac.close()

    asyncio.run(main())


def test_async_with_closes_the_client(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 16, seed=3)

    async def main() -> tuple[AsyncClient, list[Any]]:
        async with AsyncClient(server.address) as ac:
            pending = [await ac.store_async(numbered_key(40 + i), kv) for i in range(4)]
            assert await ac.contains(numbered_key(40))
        return ac, pending

    ac, pending = asyncio.run(main())
    assert all(p.done() and p.result().stored_bytes for p in pending)
    with pytest.raises(Closed):
        ac.client.stats()


def test_a_closed_async_client_refuses_calls_by_kind_and_closes_once(
        server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 16, seed=5)

    async def main() -> None:
        ac = AsyncClient(server.address)
        await ac.store_async(numbered_key(60), kv)
        await ac.close()
        await ac.close()  # a second close does nothing
        with pytest.raises(Closed):
            await ac.store_async(numbered_key(61), kv)
        with pytest.raises(Closed):
            await ac.flush()
        with pytest.raises(Closed):
            await ac.retrieve(numbered_key(60))

    asyncio.run(main())


def test_a_client_handed_in_stays_open_for_its_owner(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 16, seed=6)
    with Client(server.address) as c:

        async def main() -> list[Any]:
            async with AsyncClient(c) as ac:
                return [await ac.store_async(numbered_key(70 + i), kv) for i in range(3)]

        pending = asyncio.run(main())
        assert all(p.done() and p.result().stored_bytes for p in pending)  # answered at exit
        assert c.retrieve(numbered_key(70)).equal(kv)  # type: ignore[union-attr]

        async def after_close() -> None:  # the AsyncClient's calls, not its Client's
            ac = AsyncClient(c)
            await ac.close()
            with pytest.raises(Closed):
                await ac.retrieve(numbered_key(70))
            with pytest.raises(Closed):
                await ac.stats()

        asyncio.run(after_close())
        assert c.retrieve(numbered_key(70)) is not None


class GatedClient(Client):
    """A Client whose ``store_async`` waits at ``gate`` once it runs (``entered`` set)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.gate = threading.Event(), threading.Event()

    def store_async(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(10)
        return super().store_async(*args, **kwargs)


@PATHS
def test_a_cancelled_async_store_is_answered_before_a_later_call(
        server: ServerThread, path: dict[str, Any]) -> None:
    """A store_async whose await was cancelled still ran on the store thread, but the next
    call did not wait for it: ``store(key, new)`` was stored first and the cancelled store of
    ``old`` overwrote it."""
    old, new = random_kv(LAYOUT, 64, seed=1), random_kv(LAYOUT, 64, seed=2)
    key = numbered_key(40)

    async def main() -> None:
        c = GatedClient(server.address, timeout_s=30, **path)
        ac = AsyncClient(c)
        sent = asyncio.ensure_future(ac.store_async(key, old, mode="raw"))
        assert await asyncio.to_thread(c.entered.wait, 10)
        sent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sent
        later = asyncio.ensure_future(ac.store(key, new, mode="raw"))
        await asyncio.sleep(0.2)  # the later store, not waiting, would be stored by now
        c.gate.set()
        await later
        await ac.flush()
        got = await ac.retrieve(key, layout=LAYOUT)
        assert got is not None and got.equal(new)
        await ac.close()
        c.close()

    asyncio.run(main())


class GatedWrites(Client):
    """A Client whose first ``store`` or ``delete`` waits for ``gate`` (``left`` once it ran)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.gate, self.left = threading.Event(), threading.Event(), \
            threading.Event()

    def _gated(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.entered.is_set():
            return fn(*args, **kwargs)
        self.entered.set()
        assert self.gate.wait(10)
        try:
            return fn(*args, **kwargs)
        finally:
            self.left.set()

    def store(self, *args: Any, **kwargs: Any) -> Any:
        return self._gated(super().store, *args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        return self._gated(super().delete, *args, **kwargs)


async def cancel_once_running(c: GatedWrites, write: Any) -> None:
    """Start ``write`` (an AsyncClient call on ``c``), and cancel its await once it runs on
    its worker thread (held at ``c``'s gate)."""
    first = asyncio.ensure_future(write)
    assert await asyncio.to_thread(c.entered.wait, 10)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


@pytest.mark.parametrize("cancelled", ["store", "delete"])
def test_a_cancelled_write_runs_before_a_later_call(server: ServerThread, cancelled: str) -> None:
    """A store (or delete) whose await was cancelled ran on its worker thread all the same,
    after a later store of its key: the old value came back (the newer one was deleted)."""
    old, new = random_kv(LAYOUT, 32, seed=3), random_kv(LAYOUT, 16, seed=4)
    key = numbered_key(41)

    async def main() -> None:
        c = GatedWrites(server.address, timeout_s=30)
        ac = AsyncClient(c)
        await ac.retrieve(key, layout=LAYOUT)  # (the data paths opened)
        await cancel_once_running(c, ac.store(key, old, mode="raw") if cancelled == "store"
                                  else ac.delete(key))
        later = asyncio.ensure_future(ac.store(key, new, mode="raw"))
        await asyncio.wait([later], timeout=1)  # not waiting, it would be stored by now
        c.gate.set()
        await later
        assert await asyncio.to_thread(c.left.wait, 10)  # the cancelled one has run
        got = await ac.retrieve(key, layout=LAYOUT)
        assert got is not None and got.equal(new)
        await ac.close()
        c.close()

    asyncio.run(main())


def test_a_cancelled_write_runs_before_a_later_async_store(server: ServerThread) -> None:
    """``store_async`` and ``flush`` did not wait for a store whose await was cancelled, as
    the other calls do: ``store_async(key, new)`` and ``flush`` were answered, then the
    cancelled store of ``old`` ran over it. ``close`` waits for it too."""
    old, new = random_kv(LAYOUT, 32, seed=5), random_kv(LAYOUT, 16, seed=6)
    key = numbered_key(42)

    async def main() -> None:
        c = GatedWrites(server.address, timeout_s=30)
        ac = AsyncClient(c)
        await ac.retrieve(key, layout=LAYOUT)  # (the data paths opened)
        await cancel_once_running(c, ac.store(key, old, mode="raw"))

        async def later() -> None:
            await ac.store_async(key, new, mode="raw")
            await ac.flush()

        sent = asyncio.ensure_future(later())
        await asyncio.wait([sent], timeout=1)  # not waiting, it would be flushed by now
        c.gate.set()
        await sent
        assert c.left.is_set()  # the cancelled one has run
        got = await ac.retrieve(key, layout=LAYOUT)
        assert got is not None and got.equal(new)
        c.left.clear()
        c.entered.clear()
        c.gate.clear()
        again = asyncio.ensure_future(ac.delete(key))
        assert await asyncio.to_thread(c.entered.wait, 10)
        again.cancel()
        with pytest.raises(asyncio.CancelledError):
            await again
        threading.Timer(0.5, c.gate.set).start()
        await ac.close()
        assert c.left.is_set()  # close waited for the cancelled delete
        c.close()

    asyncio.run(main())


class GatedFlush(Client):
    """A Client whose first ``flush`` waits for ``gate`` (``left`` once it ran)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.left = threading.Event(), threading.Event()

    def flush(self) -> None:
        if self.left.is_set():
            return super().flush()
        assert self.gate.wait(10)
        try:
            super().flush()
        finally:
            self.left.set()


@PATHS
def test_a_cancelled_flush_leaves_its_error_to_the_next(server: ServerThread,
                                                       path: dict[str, Any]) -> None:
    """A flush whose await was cancelled still ran and took the stores' errors, raising them
    where nobody read them: the next flush succeeded although a store was refused."""
    kv = random_kv(LAYOUT, 16, seed=5)

    async def main() -> None:
        c = GatedFlush(server.address, timeout_s=30, **path)
        ac = AsyncClient(c)
        c.gate.set()
        await ac.store_async(numbered_key(51), kv, mode="raw")
        await ac.flush()  # (the data paths opened)
        c.gate.clear()
        c.left.clear()
        await ac.store_async(numbered_key(50), damaged(kv))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ac.flush(), 0.1)
        c.gate.set()
        assert await asyncio.to_thread(c.left.wait, 10)  # it ran, taking the error
        with pytest.raises(InvalidArgument, match="corrupt"):
            await ac.flush()
        await ac.flush()  # reported once
        await ac.close()
        c.close()

    asyncio.run(main())


def test_an_async_client_without_its_client_has_no_attributes(server: ServerThread) -> None:
    """``copy.copy(ac)`` (an instance made without ``__init__``, then asked for
    ``__setstate__``) recursed in ``__getattr__`` until RecursionError."""
    ac = AsyncClient(Client(server.address, timeout_s=30))
    twin = copy.copy(ac)
    assert twin.client is ac.client
    bare = AsyncClient.__new__(AsyncClient)
    with pytest.raises(AttributeError, match="retrieve"):
        bare.retrieve  # noqa: B018
    ac.client.close()


def test_a_cancelled_close_still_closes_its_client(server: ServerThread) -> None:
    """A close whose await was cancelled (queued behind a store on the store thread) marked
    the AsyncClient closed but never closed its Client: a second close did nothing, and the
    Client stayed open for good."""
    kv = random_kv(LAYOUT, 16, seed=7)

    async def main() -> None:
        c = GatedClient(server.address, timeout_s=30)
        ac = AsyncClient(c)
        ac._owns = True  # as one made from an address
        sent = asyncio.ensure_future(ac.store_async(numbered_key(80), kv, mode="raw"))
        assert await asyncio.to_thread(c.entered.wait, 10)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ac.close(), 0.2)
        with pytest.raises(Closed):
            await ac.retrieve(numbered_key(80))
        c.gate.set()
        pending = await sent
        await ac.close()  # waits for the first one's work
        assert pending.done() and pending.result().stored_bytes
        with pytest.raises(Closed):
            c.stats()

    asyncio.run(main())


def test_a_flush_waiting_while_close_ran_raises_closed(server: ServerThread) -> None:
    """A flush waiting for a cancelled write while close ended the store thread raised
    RuntimeError('cannot schedule new futures after shutdown'), not Closed."""
    kv = random_kv(LAYOUT, 16, seed=8)

    async def main() -> None:
        c = GatedWrites(server.address, timeout_s=1)
        ac = AsyncClient(c)
        await ac.retrieve(numbered_key(81), layout=LAYOUT)  # (the data paths opened)
        await cancel_once_running(c, ac.store(numbered_key(81), kv, mode="raw"))
        flushing = asyncio.ensure_future(ac.flush())  # waits for the cancelled store
        await asyncio.sleep(0.1)
        await ac.close()  # waits at most timeout_s for it
        c.gate.set()
        with pytest.raises(Closed):
            await flushing
        c.close()

    asyncio.run(main())


def test_store_async_keeps_only_unanswered_stores(server: ServerThread) -> None:
    """Every PendingStore store_async handed out was kept until the next flush, answered or
    not: a producer that never flushed grew without bound."""
    enc = codec.encode_parts(random_kv(LAYOUT, 16, seed=9), "raw")

    async def main() -> None:
        async with AsyncClient(server.address) as ac:
            for i in range(200):
                await ac.store_async(numbered_key(90 + i % 10), enc)
            assert len(ac._unanswered) <= 2 * ASYNC_DEPTH

    asyncio.run(main())


class GatedLookups(Client):
    """A Client whose ``lookup`` waits for ``gate`` (a hung server's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        assert self.gate.wait(10)
        return super().lookup(*args, **kwargs)


def test_cancelled_calls_hold_the_async_clients_threads_not_the_loops(
        server: ServerThread) -> None:
    """Reads whose await was cancelled, still waiting for a hung server, held the threads of
    the loop's default executor: the application's own ``asyncio.to_thread`` waited for them
    (until the Client's timeout_s)."""

    async def main() -> None:
        c = GatedLookups(server.address, timeout_s=30)
        ac = AsyncClient(c)
        try:
            for _ in range(min(32, (os.cpu_count() or 1) + 4) + 2):  # the default executor's
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(ac.lookup([numbered_key(82)]), 0.01)
            assert await asyncio.wait_for(asyncio.to_thread(int, "1"), 3) == 1
        finally:
            c.gate.set()
        assert not (await ac.lookup([numbered_key(82)])).infos[0].present
        await ac.close()
        c.close()

    asyncio.run(main())
