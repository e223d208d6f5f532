"""The one mapping between kdn's error tree and gRPC status codes, for server and client.

The server answers a ``KDNError`` with ``grpc_code(exc)`` (anything else is INTERNAL); the
client turns a failed RPC back into the kind of its code with ``from_grpc(err)``, keeping the
status name in the message. ``kdn.errors`` itself imports no grpc.
"""

from __future__ import annotations

import grpc

from kdn.errors import (
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    KDNError,
    LayoutMismatch,
    NotFound,
    PermissionDenied,
    RateLimited,
    Status,
    TooLarge,
    Unauthenticated,
    Unavailable,
)

_BY_CODE: dict[grpc.StatusCode, type[KDNError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DATA_LOSS: Corrupt,
    grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooLarge,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _kind(code: grpc.StatusCode, details: str) -> type[KDNError]:
    """The kind of a server's answer: its code's, or the narrower kind that shares the code
    and marks its message (a rate limit is RESOURCE_EXHAUSTED, as a size limit is)."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(RateLimited.MARK):
        return RateLimited
    return _BY_CODE.get(code, KDNError)


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code a server answers for ``exc``."""
    if isinstance(exc, KDNError):
        return grpc.StatusCode[exc.status.value]
    return grpc.StatusCode.INTERNAL


def error_of(status: str, message: str) -> KDNError:
    """The kdn error a server answered with on the same-host fast path or the network data
    path: its status name and message (``answered``: the call is over on the server)."""
    code = grpc.StatusCode.__members__.get(status, grpc.StatusCode.UNKNOWN)
    out = _kind(code, message)(f"{code.name}: {message}")
    out.status = Status.__members__.get(code.name, Status.UNKNOWN)
    out.answered = True
    return out


GRPC_OWN_DEADLINE = "Deadline Exceeded"
"""The details gRPC's client gives a call its own deadline ended (the server's aborts say more)."""


def from_grpc(err: grpc.RpcError, deadline: str | None = None) -> KDNError:
    """The kdn error a client raises for a failed RPC; one that ran past the client's own
    deadline says which (``deadline``: what set it, e.g. "timeout_s=5 s"), which gRPC's
    text does not."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if (code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None
            and details == GRPC_OWN_DEADLINE):
        details = f"the server did not answer within the client's deadline ({deadline})"
    out = _kind(code, details or "")(f"{code.name}: {details}")
    out.status = Status.__members__.get(code.name, Status.UNKNOWN)
    return out
