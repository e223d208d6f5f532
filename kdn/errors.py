"""One error tree for kdn; each kind names the status a server answers with.

Every failure kdn raises on purpose is a ``KDNError``. Callers catch the narrowest kind they
can handle. Each kind carries a ``Status`` (the gRPC status names, as plain strings), so this
module needs no grpc: the mapping to and from ``grpc.StatusCode`` lives in one place,
``kdn.status``, used by server and client alike. A cache miss is never an error: it is ``None``.
"""

from __future__ import annotations

import copy
import enum
import traceback
from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)


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
    """Root of every error kdn raises on purpose.

    A kind names its status in its class line, ``class NotFound(KDNError,
    status=Status.NOT_FOUND)``; a kind that names none has its parent's.
    """

    status: Status = Status.INTERNAL
    answered: bool = False
    """Whether a server sent this error as its answer to a call (``kdn.status.error_of``):
    the call is over on the server, which acts on it no more. False for an error this process
    made, whatever its status (a lost connection is UNAVAILABLE too)."""

    def __init_subclass__(cls, status: Status | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status


class InvalidArgument(KDNError, status=Status.INVALID_ARGUMENT):
    """The request itself is malformed: bad key, bad shape, unknown codec, truncated stream."""


class InvalidRequest(InvalidArgument, ValueError):
    """A model-side request refused before any work (``KDNEngine.generate``: its prompt,
    ``max_new_tokens``, ``force``, a prompt that does not fit the model's context): kdn's
    InvalidArgument, and the ValueError transformers' ``generate`` raises for the same."""


class InvalidLayout(InvalidArgument):
    """A layout is inconsistent, or tensors do not match the layout they claim."""


class Corrupt(KDNError, status=Status.DATA_LOSS):
    """Stored or transmitted bytes fail their checksum or structural checks."""


class Truncated(Corrupt):
    """Bytes end before the structure they describe does."""


class LayoutMismatch(KDNError, status=Status.FAILED_PRECONDITION):
    """The data belongs to another model or layout than the caller expects, or holds another
    number of tokens than the caller asked for (``kdn.layout.Expected``)."""


class TooLarge(KDNError, status=Status.RESOURCE_EXHAUSTED):
    """A message, entry or declared size exceeds a configured limit."""


class RateLimited(TooLarge):
    """A tenant exceeded its request rate. A server's message for it begins with ``MARK``, which
    is how a client tells it from another RESOURCE_EXHAUSTED answer (``kdn.status``): back off and
    retry, rather than send less."""

    MARK = "rate limited: "


class Unauthenticated(KDNError, status=Status.UNAUTHENTICATED):
    """The call carries no valid credentials."""


class PermissionDenied(KDNError, status=Status.PERMISSION_DENIED):
    """The caller is known but may not do this (e.g. an admin RPC without the admin role)."""


class NotFound(KDNError, status=Status.NOT_FOUND):
    """Raised only where absence is an error (e.g. admin inspect); lookups return None."""


class TierUnavailable(KDNError, status=Status.UNAVAILABLE):
    """A storage tier (Redis, disk) can not be reached right now."""


class PartlyUnavailable(TierUnavailable):
    """Part of a tier can not be reached or written (a Redis Cluster slot whose master does not
    answer, a Redis that takes no writes for now, a disk tier whose writes fail): that part
    fails, the tier stays up for the rest."""


class InUse(TierUnavailable):
    """A tier's files are held by another process (a second server on one disk tier's folder):
    refused at start, never shared."""


class DiskFull(TierUnavailable):
    """A disk tier's filesystem has no room for the files it needs to open (refused at start:
    a server error, not a bad configuration)."""


class Unavailable(KDNError, status=Status.UNAVAILABLE):
    """The service can not be reached or is shutting down."""


class Closed(KDNError, status=Status.FAILED_PRECONDITION):
    """The object was closed and takes no more calls: a ``Client`` after ``close()`` (its
    in-process tier included)."""


class DeadlineExceeded(KDNError, status=Status.DEADLINE_EXCEEDED):
    """The call did not finish before its deadline."""


class Cancelled(KDNError, status=Status.CANCELLED):
    """The work was stopped: whoever asked for it is gone."""


class MissingExtra(KDNError, ModuleNotFoundError, status=Status.FAILED_PRECONDITION):
    """A package of an optional extra of kdn's (``kdn[model]``) is not installed; the message
    names what needs it and the command that installs it (``kdn.extras``)."""


class ConfigError(KDNError, ValueError, status=Status.INVALID_ARGUMENT):
    """A configuration value is invalid; the message names the setting."""


def kept(exc: _E) -> _E:
    """``exc`` fit to outlive the handler that caught it (kept on an object or a future, for
    another thread or a later call to raise): its traceback let go, and those of the errors
    it was raised from or during. A traceback holds its frames, each frame every variable it
    had (the handler's ``self``, the buffers being read), and the object keeping ``exc`` is
    among them: a reference cycle, freed only by the garbage collector, with those buffers
    in it. An error that is no ``KDNError`` (a bug, an OS or transport error) keeps where it
    was raised as a note, printed with it (``BaseException.add_note``)."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        if tb is not None:
            if not isinstance(e, KDNError):
                e.add_note("raised at:\n" + "".join(traceback.format_tb(tb)).rstrip())
            e.__traceback__ = None
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return exc


def again(exc: _E) -> _E:
    """An error an object keeps (``kept``), to raise from it once more: a copy of it, so
    that the traceback gathered on the way up (the frames of whoever holds that object) is
    the copy's, and no cycle goes through the object; ``exc`` itself where it can not be
    copied (an error whose arguments are not its constructor's)."""
    try:
        out = copy.copy(exc)
    except Exception:
        return exc
    if type(out) is not type(exc):
        return exc
    out.__cause__, out.__context__ = exc.__cause__, exc.__context__
    out.__suppress_context__ = exc.__suppress_context__
    return out
