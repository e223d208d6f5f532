"""What the Redis tier's errors mean: each redis-py error (``REDIS_ERRORS``) leaves the
transport (``kdn.store.redis_transport``) as a kdn one (``wrap``), and ``unanswered`` tells, of
those, the ones where a node did not answer (the cluster transport remembers that master).

Kinds: Redis not reached (refused, reset or timed-out connections) is ``TierUnavailable``
(``PartlyUnavailable`` in a cluster: one slot's master; the probe decides whether the whole tier
is gone); Redis refusing kdn's credentials or TLS is ``TierUnavailable`` too, its message
saying so (``access_refused``: no answer comes until redis_url is fixed); every pooled
connection of this client busy past the pool's wait (``pool_full``) is ``PartlyUnavailable``:
Redis answers, this call is worth retrying, the tier is not marked down; out of memory is
``TooLarge``; a write Redis takes no more for now (MISCONF, NOREPLICAS) is
``PartlyUnavailable``; a cluster node's MOVED to a client that takes it for a standalone Redis
is a ``KDNError`` saying to set redis_cluster; anything else is a plain ``KDNError``.
"""

from __future__ import annotations

import re
import ssl

import redis

from kdn.errors import KDNError, PartlyUnavailable, TierUnavailable, TooLarge

__all__ = ["REDIS_ERRORS", "access_refused", "pool_full", "said", "unanswered", "wrap"]

_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
         redis.exceptions.ClusterDownError, redis.exceptions.BusyLoadingError,
         redis.exceptions.TryAgainError, redis.exceptions.MaxConnectionsError,
         redis.exceptions.MasterDownError, redis.exceptions.SlotNotCoveredError,
         redis.exceptions.ReadOnlyError, redis.exceptions.ClusterError)


REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)
"""What redis-py raises: its cluster client raises ``RedisClusterException`` (no ``RedisError``)
when no node of the cluster can be reached, or a slot has no master in its map."""

_REFUSAL = re.compile(r"(?:^|-)(OOM|MISCONF|NOREPLICAS) ")
"""The error codes of Redis refusing a write, at the start of its error or (from a command a
Lua script called) after a ``-`` inside "Error running script ..."."""

_POOL_WAIT = "No connection available."
"""The message of the ``ConnectionError`` redis-py's ``BlockingConnectionPool`` raises when
every connection stayed busy for its ``timeout`` (it has no error type of its own)."""

_ACCESS = re.compile(r"NOAUTH|WRONGPASS|invalid username-password|invalid password|"
                     r"AUTH <password> called without any password|"
                     r"HELLO must be called with the client already authenticated|\bSSL\b|TLS")
"""Words of a refused login or a failed TLS handshake in an error redis-py raises without a
type of its own for it (the cluster client's, which carries only the message)."""


def _refusal(exc: BaseException) -> str | None:
    """The code of a write Redis refused (``_REFUSAL``), or None. redis-py strips the OOM code
    from the message of the ``OutOfMemoryError`` it raises for a plain command."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "OOM"
    found = _REFUSAL.search(str(exc))
    return found.group(1) if found else None


def pool_full(exc: BaseException) -> bool:
    """Whether ``exc`` says this client's own connection pool had no connection free in time
    (every one busy with other calls), not that Redis did not answer."""
    return isinstance(exc, redis.exceptions.MaxConnectionsError) \
        or (type(exc) is redis.exceptions.ConnectionError and str(exc) == _POOL_WAIT)


def access_refused(exc: BaseException) -> str | None:
    """What went wrong where Redis refused kdn's login (a wrong or missing password or user)
    or the TLS handshake failed (``rediss://`` against a plaintext Redis, or the reverse; a
    certificate refused); None for any other error."""
    seen: BaseException | None = exc
    for _ in range(4):  # the error, and what it was raised from
        if seen is None:
            break
        if isinstance(seen, (redis.exceptions.AuthenticationError,
                             redis.exceptions.AuthorizationError,
                             redis.exceptions.AuthenticationWrongNumberOfArgsError)):
            return "Redis refuses kdn's login: check the user and password in redis_url"
        if isinstance(seen, ssl.SSLError):
            return "the TLS handshake with Redis failed: check rediss:// (or redis://) in " \
                   "redis_url and the certificates"
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if _ACCESS.search(text):
        if "SSL" in text or "TLS" in text:
            return "the TLS handshake with Redis failed: check rediss:// (or redis://) in " \
                   "redis_url and the certificates"
        return "Redis refuses kdn's login: check the user and password in redis_url"
    return None


def _handshake(exc: BaseException) -> str:
    """A hint where ``exc`` came from a TLS handshake that got no answer (``rediss://`` against
    a Redis that takes no TLS looks so, as does a stopped one); else ''."""
    cause = exc.__cause__ or exc.__context__
    if cause is not None and "handshake" in str(cause):
        return (f" ({cause}: a Redis that takes no TLS gives no handshake; check rediss:// in "
                "redis_url)")
    return ""


def said(exc: BaseException) -> bool:
    """Whether ``exc`` tells more than that Redis gave no answer: a refused login or TLS, a TLS
    handshake that got none (the health probe raises these, to be logged, rather than only
    report the tier down)."""
    return access_refused(exc) is not None or bool(_handshake(exc))


_UNCOVERED = "All slots are not covered"
"""How redis-py's cluster client begins the ``RedisClusterException`` it raises when the nodes
that answered its slots query leave slots without a master (one master dead, a call's
timeout making it query the map again): some masters answer, as PartlyUnavailable says."""


def wrap(exc: BaseException, cluster: bool = False) -> KDNError:
    """The kdn error for a redis-py one (see the module docstring). In a cluster, a slot with
    no master in the map is PartlyUnavailable; no node answering at all (redis-py's
    ``RedisClusterException``) is TierUnavailable: the probe lifts it once one answers; a map
    that left some slots without a master (``_UNCOVERED``) is PartlyUnavailable."""
    if isinstance(exc, redis.exceptions.SlotNotCoveredError):
        return PartlyUnavailable(f"redis: {exc}")
    if isinstance(exc, redis.exceptions.MovedError) and not cluster:
        return KDNError(f"redis: this Redis is a node of a Redis Cluster, which sent the key to "
                        f"another node (MOVED {exc}): set redis_cluster: true")
    refused = access_refused(exc) if isinstance(
        exc, (redis.exceptions.ConnectionError, redis.exceptions.RedisClusterException)) \
        else None
    if refused is not None:
        return TierUnavailable(f"redis: {refused} ({type(exc).__name__}: {exc})")
    if isinstance(exc, redis.exceptions.RedisClusterException):
        if str(exc).startswith(_UNCOVERED):  # the nodes that answered lack some slots' master
            return PartlyUnavailable(f"redis: a master of the cluster does not answer, and "
                                     f"its slots have no other yet: {exc}")
        return TierUnavailable(f"redis: no node of the cluster answers: {exc}")
    if pool_full(exc):
        return PartlyUnavailable(
            f"redis: every pooled connection of this server stayed busy for the pool's wait "
            f"(redis_timeout_s); the call was not sent (raise redis_max_connections): {exc}")
    if isinstance(exc, _DOWN):
        down = PartlyUnavailable if cluster else TierUnavailable
        return down(f"redis: {type(exc).__name__}: {exc}{_handshake(exc)}")
    code = _refusal(exc)
    if code == "OOM":
        return TooLarge(f"redis is out of memory: {exc}")
    if code is not None:
        return PartlyUnavailable(f"redis takes no writes now ({code}): {exc}")
    return KDNError(f"redis: {type(exc).__name__}: {exc}")


def unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` (a kdn error wrapping a redis-py one) says the node did not answer: a
    refused, reset or timed-out connection (not a full client-side pool, nor a refused login:
    the node answered)."""
    cause = exc.__cause__
    return isinstance(cause, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) \
        and not pool_full(cause) and access_refused(cause) is None
