"""How a servicer answers a ``KDNError``: counted as ``<rpc>.<STATUS>``, then aborted with its
gRPC status code (``kdn.status.grpc_code``), in one place for every handler."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kdn.errors import InvalidArgument, KDNError
from kdn.status import grpc_code

T = TypeVar("T")
IN_FLIGHT = "rpc.in_flight"


class Counting(Protocol):
    """A servicer: it counts what its handlers did, and the calls running now."""

    in_flight: int

    def count(self, name: str, n: int = 1) -> None: ...


async def abort(context: grpc.aio.ServicerContext, count: Callable[[str], None], name: str,
                exc: KDNError) -> None:
    """Count ``exc`` against RPC ``name`` and abort the call with its status (raises)."""
    count(f"{name}.{grpc_code(exc).name}")
    await context.abort(grpc_code(exc), str(exc))


def rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary-answer handler whose ``KDNError`` aborts the call (``abort``); a streamed
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
            await abort(context, self.count, fn.__name__, exc)
            raise  # unreachable: abort raises
        finally:
            self.in_flight -= 1

    return wrapper
