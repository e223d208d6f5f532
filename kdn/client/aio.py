"""``AsyncClient``: the asyncio face of ``kdn.client.Client``.

    async with AsyncClient("127.0.0.1:50051") as ac:     # or AsyncClient(client)
        kv = await ac.retrieve(key)
        pending = [await ac.store_async(k, kv) for k, kv in items]
        await ac.flush()                                  # every one answered; the first error
        pending[0].result()                               # answered: readable on any thread

Each call runs the Client's method on a worker thread, so the logic exists once. The calls
bound to the thread that makes them (an asynchronous store is answered on the thread that sent
it: ``store_async``, ``flush``, ``close``) all run on one thread of the AsyncClient's own, so
``flush`` and ``close`` answer every store it sent; the other calls run on a pool of its own
(CALL_THREADS), after the stores it sent are answered (one whose await was cancelled too: it
still runs on that thread). A call whose await was cancelled is not stopped: it runs until it
ends (at most the Client's ``timeout_s``) on one of the AsyncClient's threads, not the loop's
default executor's (the application's). Every call, ``store_async`` and ``flush`` too
(``close`` for a bounded time), waits until each ``store``, ``store_many`` or ``delete`` whose
await was cancelled has run (it still runs: a later write of its key would lose to it), as a
Client's calls on one thread do (a read then sees them). A store's ``result()`` is read once
``flush`` (or ``close``) returned; its ``done()`` any time. The worker thread's
``last_request_id`` is not the caller's: pass ``request_id`` to correlate. As a Client, an
AsyncClient belongs to the process that made it: in a child of ``fork()`` its calls raise
InvalidArgument (``close`` does nothing there).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kdn.client.client import WRITES, Client
from kdn.client.pending import PendingStore
from kdn.errors import Closed, Corrupt, InvalidArgument

if TYPE_CHECKING:
    from kdn.cache import KVCache
    from kdn.client.staged import Staged
    from kdn.codec import EncodedParts

T = TypeVar("T")


class AsyncClient:
    """asyncio face of a Client (module docstring): ``await AsyncClient(client).retrieve(key)``;
    ``async with`` closes it (and the Client where it made it from an address)."""

    def __init__(self, client: Client | str) -> None:
        self.client = client if isinstance(client, Client) else Client(client)
        self._owns = not isinstance(client, Client)
        """Whether ``close`` closes the Client too: one made here from an address; a Client
        handed in stays open for its owner (its stores sent here are answered)."""
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kdn-aio-stores")
        """The one thread asynchronous stores are sent, answered and flushed on."""
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kdn-aio-calls")
        """The threads the other calls run on (module docstring)."""
        self._unanswered: list[PendingStore] = []
        self._abandoned = False
        """Whether a ``store_async`` whose await was cancelled may have sent a store since the
        last wait: it runs on the store thread all the same, its PendingStore never handed
        back (a later call would otherwise run beside it, and a later write of its key lose
        to it)."""
        self._writing: list[Future[None]] = []
        """Calls that change what the server holds (``WRITES``) whose await was cancelled: each
        still runs on its worker thread, and a later call waits for it (a later write of its
        key would otherwise lose to it, a later delete be undone by it)."""
        self._flushing: Future[None] | None = None
        """A flush whose await was cancelled: it still runs and takes the stores' errors; the
        next flush waits for it and raises its error."""
        self._closing: Future[None] | None = None
        """``close``'s work on the store thread, once asked for (the AsyncClient closed): it runs
        to its end."""
        self._pid = os.getpid()  # its store thread is not in a child of fork()

    def _usable(self) -> None:
        """Closed once closed; InvalidArgument in a child of ``fork()``, as a Client's calls
        (its store thread is the parent's: a call queued for it never ran)."""
        if os.getpid() != self._pid:
            raise InvalidArgument("an AsyncClient cannot be used after fork(): make a new "
                                  "one in the child")
        if self._closing is not None:
            raise Closed("the AsyncClient is closed: make a new one")

    def _submit(self, threads: ThreadPoolExecutor, fn: Callable[..., T], *args: Any,
                **kwargs: Any) -> asyncio.Future[T]:
        """``fn(...)`` run on ``threads`` (Closed once closed: they are ended)."""
        self._usable()
        ctx = contextvars.copy_context()  # as asyncio.to_thread: the caller's context
        return asyncio.get_running_loop().run_in_executor(
            threads, functools.partial(ctx.run, fn, *args, **kwargs))

    async def _on_store_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self._submit(self._stores, fn, *args, **kwargs)

    async def _answered(self) -> None:
        """Wait until the stores sent so far are answered (their errors kept for ``flush``),
        and the writes whose await was cancelled have run."""
        await self._writes_ran()
        self._unanswered = [p for p in self._unanswered if not p.done()]
        if self._unanswered or self._abandoned:  # queued behind every store sent so far
            self._abandoned = False
            try:
                await self._on_store_thread(self.client.dataplane.settle_async)
            except BaseException:
                self._abandoned = True  # (cancelled itself: the next call waits again)
                raise
            self._forget_answered()

    async def _writes_ran(self, timeout_s: float | None = None) -> None:
        """Wait until the writes whose await was cancelled have run (at most ``timeout_s``);
        cancelled itself, the next call waits again."""
        self._writing = [f for f in self._writing if not f.done()]
        if self._writing:
            await asyncio.wait([asyncio.wrap_future(f) for f in self._writing],
                               timeout=timeout_s)
            self._writing = [f for f in self._writing if not f.done()]

    def _forget_answered(self) -> None:
        """(Those sent meanwhile, after the wait on the store thread, are kept.)"""
        self._unanswered = [p for p in self._unanswered if not p.done()]

    async def store_async(self, key: bytes, kv: KVCache | EncodedParts | Staged,
                          **options: Any) -> PendingStore:
        """``Client.store_async`` (its options) on the AsyncClient's store thread: sent, not
        waited for, after the writes whose await was cancelled have run (a store of their
        key would lose to them)."""
        self._usable()
        await self._writes_ran()
        try:
            pending = await self._on_store_thread(self.client.store_async, key, kv, **options)
        except asyncio.CancelledError:  # it may still run (and send) on the store thread
            self._abandoned = True
            raise
        if not pending.done():
            self._forget_answered()  # (kept until answered only: a producer never flushing)
            self._unanswered.append(pending)
        return pending

    async def flush(self) -> None:
        """``Client.flush``: every store sent by ``store_async`` answered; the first error
        among those answered since the last flush is raised (by the next flush where the one
        that took it was cancelled); the writes whose await was cancelled have run too."""
        self._usable()
        await self._writes_ran()
        try:
            kept, self._flushing = self._flushing, None
            if kept is not None:  # its error first: it was taken before this flush's
                await self._flushed(kept)
            self._usable()  # (closed while it waited: the store thread is ended)
            await self._flushed(self._stores.submit(contextvars.copy_context().run,
                                                    self.client.flush))
        finally:
            self._forget_answered()

    async def _flushed(self, flushing: Future[None]) -> None:
        """Wait for ``flushing`` (a ``Client.flush`` on the store thread), raise its error;
        cancelled, it is kept for the next ``flush``: it still runs and takes the errors."""
        waited = asyncio.wrap_future(flushing)
        try:
            await asyncio.shield(waited)
        except asyncio.CancelledError:
            waited.add_done_callback(_retrieved)
            self._flushing = flushing
            raise

    async def close(self) -> None:
        """The stores sent answered (each ``result()`` then has its answer or error), the store
        thread ended, and the Client closed where this AsyncClient made it (from an address;
        one handed in is its owner's to close), after the writes whose await was cancelled
        have run (waited for at most the Client's ``timeout_s``, else CLOSE_WAIT_S). Once
        asked for, that runs to its end on the store thread, this await cancelled or not;
        closing again waits for it (quietly: its error is the first close's). Any other call
        after it raises Closed. Nothing in a child of ``fork()``: the Client is the parent's."""
        if os.getpid() != self._pid:
            return
        first = self._closing is None
        if self._closing is None:
            self._closing = self._stores.submit(
                contextvars.copy_context().run, self._close_on_store_thread, list(self._writing),
                self.client.timeout_s or CLOSE_WAIT_S)
            self._stores.shutdown(wait=False)  # (after the close, queued before it)
            self._calls.shutdown(wait=False)  # (the calls running end as they would)
        closing = asyncio.wrap_future(self._closing)
        closing.add_done_callback(_retrieved)  # (raised by the first close only)
        if first:
            await asyncio.shield(closing)
        else:
            await asyncio.wait([closing])
        self._forget_answered()

    def _close_on_store_thread(self, writing: list[Future[None]], wait_s: float) -> None:
        """``close``'s work: ``writing`` (cancelled writes) waited for at most ``wait_s``, then
        the Client closed (made here) or its stores sent here answered (handed in)."""
        futures.wait(writing, timeout=wait_s)
        if self._owns:
            self.client.close()
        else:
            self.client.dataplane.settle_async()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # (an instance copy.copy made has no client yet: looked up here, it recursed for ever)
        if name.startswith("__") or "client" not in self.__dict__:
            raise AttributeError(f"'AsyncClient' object has no attribute {name!r}")
        fn = getattr(self.client, name)
        if not callable(fn):
            return fn

        async def call(*args: Any, **kwargs: Any) -> Any:
            self._usable()  # (a Client handed in stays open after close)
            await self._answered()
            if name not in WRITES:
                return await self._submit(self._calls, _no_stop, fn, *args, **kwargs)
            ran: Future[None] = Future()
            ran.set_running_or_notify_cancel()
            running = self._submit(self._calls, _ran, ran, fn, *args, **kwargs)
            try:  # shielded: once asked for, it runs, and ``ran`` tells when it has
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                running.add_done_callback(_retrieved)
                self._writing.append(ran)
                raise

        return call


CALL_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""Threads an AsyncClient runs its calls on (but the stores': one thread), as many as the
loop's default executor has."""
CLOSE_WAIT_S = 60.0
"""How long ``close`` waits for the writes whose await was cancelled, for a Client without
a deadline (``timeout_s`` None)."""

def _ran(ran: Future[None], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``_no_stop(fn, ...)``; ``ran`` done when it returned or raised."""
    try:
        return _no_stop(fn, *args, **kwargs)
    finally:
        ran.set_result(None)


def _retrieved(done: asyncio.Future[Any]) -> None:
    """Its error read (a cancelled write's: its caller gave up on it)."""
    if not done.cancelled():
        done.exception()


def _no_stop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, a StopIteration escaping it raised as Corrupt: asyncio can not set one on
    a future (the awaiting coroutine would wait for ever). kdn's reads raise none of their
    own; one from a stream cut short is a server's fault."""
    try:
        return fn(*args, **kwargs)
    except StopIteration:
        raise Corrupt(f"{getattr(fn, '__name__', 'call')}: a stream of the server's answer "
                      "ended early") from None
