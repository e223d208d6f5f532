"""One error tree for kdn; each kind names the status a server answers with.

Every failure kdn raises on purpose is a ``KDNError``. Callers catch the narrowest kind they
can handle. Each kind carries a ``Status`` (the gRPC status names, as plain strings), so this
module needs no grpc: the mapping to and from ``grpc.StatusCode`` lives in one place,
``kdn.status``, used by server and client alike. A cache miss is never an error: it is ``None``.
"""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    """The gRPC status names (``grpc.StatusCode`` member names), without importing grpc."""

    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class KDNError(Exception):
    """Root of every error kdn raises on purpose."""

    status: Status = Status.INTERNAL


class InvalidArgument(KDNError):
    """The request itself is malformed: bad key, bad shape, unknown codec, truncated stream."""

    status = Status.INVALID_ARGUMENT


class InvalidLayout(InvalidArgument):
    """A layout is inconsistent, or tensors do not match the layout they claim."""


class Corrupt(KDNError):
    """Stored or transmitted bytes fail their checksum or structural checks."""

    status = Status.DATA_LOSS


class Truncated(Corrupt):
    """Bytes end before the structure they describe does."""


class LayoutMismatch(KDNError):
    """The data belongs to another model or layout than the caller expects."""

    status = Status.FAILED_PRECONDITION


class TooLarge(KDNError):
    """A message, entry or declared size exceeds a configured limit."""

    status = Status.RESOURCE_EXHAUSTED


class RateLimited(TooLarge):
    """A tenant exceeded its request rate."""


class Unauthenticated(KDNError):
    """The call carries no valid credentials."""

    status = Status.UNAUTHENTICATED


class PermissionDenied(KDNError):
    """The caller is known but may not do this (e.g. an admin RPC without the admin role)."""

    status = Status.PERMISSION_DENIED


class NotFound(KDNError):
    """Raised only where absence is an error (e.g. admin inspect); lookups return None."""

    status = Status.NOT_FOUND


class TierUnavailable(KDNError):
    """A storage tier (Redis, disk) can not be reached right now."""

    status = Status.UNAVAILABLE


class Unavailable(KDNError):
    """The service can not be reached or is shutting down."""

    status = Status.UNAVAILABLE


class DeadlineExceeded(KDNError):
    """The call did not finish before its deadline."""

    status = Status.DEADLINE_EXCEEDED


class ConfigError(KDNError, ValueError):
    """A configuration value is invalid; the message names the setting."""

    status = Status.INVALID_ARGUMENT
