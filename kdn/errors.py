"""One error tree for kdn, and its mapping to gRPC status codes.

Every failure kdn raises on purpose is a ``KDNError``. Callers catch the narrowest kind they
can handle; the server maps kinds to status codes in exactly one place (``grpc_code``), and the
client maps status codes back (``from_grpc``). A cache miss is never an error: it is ``None``.
"""

from __future__ import annotations

import grpc


class KDNError(Exception):
    """Root of every error kdn raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KDNError):
    """The request itself is malformed: bad key, bad shape, unknown codec, truncated stream."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidLayout(InvalidArgument):
    """A layout is inconsistent, or tensors do not match the layout they claim."""


class Corrupt(KDNError):
    """Stored or transmitted bytes fail their checksum or structural checks."""

    code = grpc.StatusCode.DATA_LOSS


class Truncated(Corrupt):
    """Bytes end before the structure they describe does."""


class LayoutMismatch(KDNError):
    """The data belongs to another model or layout than the caller expects."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class TooLarge(KDNError):
    """A message, entry or declared size exceeds a configured limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimited(TooLarge):
    """A tenant exceeded its request rate."""


class Unauthenticated(KDNError):
    """The call carries no valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KDNError):
    """The caller is known but may not do this (e.g. an admin RPC without the admin role)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(KDNError):
    """Raised only where absence is an error (e.g. admin inspect); lookups return None."""

    code = grpc.StatusCode.NOT_FOUND


class TierUnavailable(KDNError):
    """A storage tier (Redis, disk) can not be reached right now."""

    code = grpc.StatusCode.UNAVAILABLE


class Unavailable(KDNError):
    """The service can not be reached or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KDNError):
    """The call did not finish before its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ConfigError(KDNError, ValueError):
    """A configuration value is invalid; the message names the setting."""

    code = grpc.StatusCode.INVALID_ARGUMENT


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


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code a server answers for ``exc``."""
    if isinstance(exc, KDNError):
        return exc.code
    return grpc.StatusCode.INTERNAL


def from_grpc(err: grpc.RpcError) -> KDNError:
    """The kdn error a client raises for a failed RPC."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    kind = _BY_CODE.get(code, KDNError)
    out = kind(f"{code.name}: {details}")
    out.code = code
    return out
