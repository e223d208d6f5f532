"""How a servicer answers a ``KDNError``: counted as ``<rpc>.<STATUS>``, then the call ended
with its gRPC status code (``kdn.status.grpc_code``), in one place for every handler."""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kdn.errors import InvalidArgument, KDNError
from kdn.status import grpc_code

T = TypeVar("T")
IN_FLIGHT = "rpc.in_flight"


class Counters(dict[str, int]):
    """A server's event counts (``<rpc>.<STATUS>``, ``bytes_out``, ...), one set for its
    servicers, the Stats answer and ``/metrics`` alike: bumped from the event loop, its
    worker threads and the data paths' threads at once, so under a lock (unlocked, a
    read-modify-write lost counts under load)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self[name] = self.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        """The counts now, as a plain dict (iterating the live one may meet a new name)."""
        with self._lock:
            return dict(self)


class Counting(Protocol):
    """A servicer: it counts what its handlers did, and the calls running now."""

    in_flight: int

    def count(self, name: str, n: int = 1) -> None: ...


def end_call(context: grpc.aio.ServicerContext, count: Callable[[str], None], name: str,
             exc: KDNError) -> None:
    """Count ``exc`` against RPC ``name`` and set the call's status to its own; the handler
    returns right after (a unary one None), and the call ends with that status. Nothing is
    raised: gRPC's abort raises an error that it keeps with the call, whose traceback holds
    the handler's frames, which hold the call: a cycle with every variable of those frames
    in it (the entries read, the request), freed only by the garbage collector."""
    count(f"{name}.{grpc_code(exc).name}")
    context.set_code(grpc_code(exc))
    context.set_details(str(exc))


def rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary-answer handler whose ``KDNError`` ends the call (``end_call``); a streamed
    request message that is not protobuf is a bad request. While it runs, the call counts
    in the servicer's ``in_flight`` (the load a node reports to fleet clients in Stats'
    ``rpc.in_flight``: ``kdn.client.fleet``)."""
    @functools.wraps(fn)
    async def wrapper(self: Counting, request: Any, context: grpc.aio.ServicerContext) -> T:
        self.in_flight += 1
        try:
            try:
                return await fn(self, request, context)
            except DecodeError as exc:  # a streamed request message that is not protobuf
                raise InvalidArgument(f"malformed request message: {exc}") from exc
        except KDNError as exc:
            end_call(context, self.count, fn.__name__, exc)
            return None  # type: ignore[return-value]
        finally:
            self.in_flight -= 1

    return wrapper
