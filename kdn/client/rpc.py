"""How a ``Client`` calls its server: one gRPC channel (``Rpc``) on a connection of its own
(not shared with the process's other Clients), reused by every call and thread, every call
with a deadline and retried with backoff only for the named status codes (``Retry``), its
metadata (the API key, ``x-request-id``, the trace), and the channel's TLS (``TLSOptions``).
A connection that calls wait on and that brings nothing is pinged, and replaced where the
ping goes unanswered (``KEEPALIVE_S``: one that died silently failed every call after it).
``traced`` and ``settles`` wrap the client's calls: each first reads this thread's
asynchronous stores' answers, and ``traced`` puts a span around it when tracing is on.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from os import PathLike
from typing import Any, Literal, TypeVar

import grpc

from kdn import tracing as _tracing
from kdn.checks import MAX_WAIT_S, shown, within
from kdn.client.deadline import NO_DEADLINE_S, call_cap, deadline_within, own_cap
from kdn.errors import Closed, InvalidArgument, Unavailable, kept
from kdn.status import from_grpc
from kdn.transport.metadata import API_KEY_HEADER, REQUEST_ID, REQUEST_ID_HEADER
from kdn.transport.wire import get_many_response, retrieve_response, serialize_passthrough
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

RECONNECT_MS = 100
"""Most milliseconds the channel waits between attempts to connect to a server that is gone
(gRPC's default grows to 120 s: a server back after a long outage would then go unused for up
to that long, every call failing UNAVAILABLE at once). Below the shortest span of a call's
default retries (``Retry``: 175 ms), so a call made once the server is back reaches it; a
refused connection costs the client next to nothing."""


KEEPALIVE_S = (2.0, 20.0)
"""Seconds a connection that calls wait on may bring nothing before the client pings the
server: the client's ``timeout_s`` within these bounds. A ping (gRPC's own too) unanswered
as long closes the connection, and the next call goes on a new one: a peer gone without a
reset (a crashed host, dropped NAT state, a proxy that still acks) failed every call
DEADLINE_EXCEEDED for good. A connection that brings bytes is never pinged."""


def keepalive_ms(timeout_s: float | None) -> int:
    """``KEEPALIVE_S`` for a client of ``timeout_s``, in milliseconds."""
    low, high = KEEPALIVE_S
    return int(1000 * (high if timeout_s is None else min(high, max(low, timeout_s))))


CLOSED = "this client was closed (Client.close()); make a new Client"
"""What a call on a closed client is refused with (``Closed``)."""
LOST = ("the server's answer was lost: the call ended OK without a message (damaged on the "
        "way?); it may or may not have been done")
"""What a call that ended OK with no answer raises (``Unavailable``)."""


def check_timeout(name: str, value: object) -> float | None:
    """``value`` as a call's timeout in seconds: a number > 0, or None for no deadline (an
    infinite one, or one of ``NO_DEADLINE_S`` or more, is None too); InvalidArgument naming
    ``name`` otherwise (0, a negative number, NaN, a string: each made every call fail at
    once, or deep inside gRPC)."""
    if value is None:
        return None
    seconds = float(value) if isinstance(value, numbers.Real) and not isinstance(
        value, bool) else math.nan
    if not seconds > 0:  # NaN too
        raise InvalidArgument(f"{name} must be a number of seconds > 0, or None for no "
                              f"deadline; got {value!r}")
    return None if seconds >= NO_DEADLINE_S else seconds


MAX_RETRIES = 1000
"""The most ``Retry.retries``: a pause is ``base_s * 2**attempt``, a float (past 2**1023 an
OverflowError), and the call's deadline ends them long before."""


@dataclass(frozen=True)
class Retry:
    """Bounded retries with exponential backoff and jitter, only for the named status codes."""

    retries: int = 3
    """Attempts after the first, at most ``MAX_RETRIES``."""
    base_s: float = 0.05
    """The first pause, in seconds (doubled at each attempt, with jitter), at most a day."""
    cap_s: float = 2.0
    """The longest pause, in seconds, at most a day."""
    codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)
    """The gRPC status codes retried."""

    def __post_init__(self) -> None:
        """InvalidArgument naming the field that is not as documented (retries=-1 made every
        call raise AssertionError, base_s=-1 a ValueError from the pause)."""
        within("Retry.retries", self.retries, 0, MAX_RETRIES, whole=True)
        for name in ("base_s", "cap_s"):
            within(f"Retry.{name}", getattr(self, name), 0, MAX_WAIT_S, unit=" seconds")
        codes = tuple(self.codes) if isinstance(self.codes, (tuple, list, set, frozenset)) \
            else (self.codes,)
        if not all(isinstance(c, grpc.StatusCode) for c in codes):
            raise InvalidArgument(f"Retry.codes must be grpc.StatusCode values, got "
                                  f"{shown(self.codes)}")
        object.__setattr__(self, "codes", codes)

    def call(self, fn: Callable[[], T], unsent_only: bool = False) -> T:
        """``fn()``, again after a pause while it fails with one of ``codes``; never past this
        thread's ``deadline_within`` (``Rpc.call``'s: the call's deadline is for all of its
        attempts together, so no attempt starts, nor pause ends, after it). ``unsent_only``:
        again only where it never reached a server (``never_sent``)."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as err:  # the call itself, which the frames it passed hold:
                kept(err)  # not those frames
                if err.code() not in self.codes or attempt == self.retries or (
                        unsent_only and not never_sent(err)):
                    raise
                pause = min(self.cap_s, self.base_s * 2**attempt) * (0.5 + random.random())
                until = call_cap()
                if until is not None and time.monotonic() + pause >= until:
                    raise  # no time left for another attempt
                time.sleep(pause)
        raise AssertionError("unreachable")


def _which_deadline(budget: float | None, outer: float | None, start: float) -> str | None:
    """What set the deadline of a call that began at ``start``: the client's ``timeout_s``
    (``budget``) or the sooner deadline a caller set around it (``outer``, ``call_cap``; not
    the call's own one deadline, ``own_cap``, which is ``timeout_s`` too)."""
    if outer is not None and (budget is None or outer < start + budget):
        return (f"{max(0.0, outer - start):.3g} s left of the deadline of the call around "
                f"it, set by its caller")
    return None if budget is None else (
        f"timeout_s={budget:g} s; raise timeout_s where calls this large are expected")


NEVER_SENT = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed",
              "Name resolution failure")
"""gRPC's words for a call that found no server: no connection made, no address resolved."""


def never_sent(err: grpc.RpcError) -> bool:
    """The failed call never reached a server: no connection could be made, or its host name
    did not resolve (``NEVER_SENT``, gRPC's own words); a call cut after it was sent (a
    reset, a lost answer), or one the server answered UNAVAILABLE, may have been done."""
    details = err.details() or ""
    return any(words in details for words in NEVER_SENT)


def pem_problem(name: str, data: bytes) -> str | None:
    """Why the PEM ``data`` is not what the TLS option ``name`` holds (``ca`` and ``cert``:
    a certificate, ``key``: a private key), or None: given one for the other, gRPC and the ssl
    module say only "no start line"."""
    if name == "key":
        return None if b"PRIVATE KEY-----" in data else \
            "holds no private key (no '-----BEGIN ... PRIVATE KEY-----' line)"
    if b"-----BEGIN CERTIFICATE-----" in data:
        return None
    return ("holds no certificate (no '-----BEGIN CERTIFICATE-----' line" +
            ("; it is a private key" if b"PRIVATE KEY-----" in data else "") + ")")


@dataclass(frozen=True)
class TLSOptions:
    """TLS for the channel: trust ``ca`` (PEM); present ``cert``/``key`` for mutual TLS."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""
    """Expected name in the server certificate when it differs from the address host."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):  # gRPC's core aborts the process on it
            raise InvalidArgument("TLS: a client certificate and its private key go together "
                                  f"(given: {'the certificate' if self.cert else 'the key'} "
                                  "only)")
        for name in ("ca", "cert", "key"):  # (gRPC's own word: "None: no start line")
            data = getattr(self, name)
            if isinstance(data, str) and "-----BEGIN " in data:  # PEM read as text
                data = data.encode("ascii", "replace")
                object.__setattr__(self, name, data)
            elif data is not None and not isinstance(data, (bytes, bytearray)):
                raise InvalidArgument(
                    f"TLS: {name} is the PEM's bytes (open(path, 'rb').read()), not a "
                    f"{type(data).__name__}" + (" (a file's path?)" if isinstance(
                        data, (str, PathLike)) else ""))
            if data is not None and b"-----BEGIN " not in data:
                raise InvalidArgument(f"TLS: {name} is not PEM (no '-----BEGIN' line)")
            if data is not None and (problem := pem_problem(name, data)):
                raise InvalidArgument(f"TLS: {name} {problem}")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def data_path_tls(self) -> tuple[ssl.SSLContext, str]:
        """(context, expected name) for the server's network data path: the same trust as
        the channel (``ca``, else the system's roots). No client certificate is shown there:
        its calls name a ticket the channel's authenticated caller was given."""
        try:
            ctx = ssl.create_default_context(cadata=self.ca.decode("ascii", "replace")
                                             if self.ca else None)
        except ssl.SSLError as exc:  # a damaged certificate
            raise InvalidArgument(f"TLS: ca is not a certificate the ssl module reads "
                                  f"({exc.reason or exc})") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx, self.server_name


def _settle(owner: Any) -> None:
    """Read this thread's asynchronous stores' answers (``owner.dataplane``) before a call:
    its reads then see them (their errors are kept for ``flush``)."""
    plane = owner.dataplane
    if plane.has_pending():
        plane.settle_async()


def traced(name: str) -> Callable[[F], F]:
    """A method of an object with a ``dataplane`` that settles first (``_settle``), in a span
    when tracing is on (``kdn.tracing``); the call's metadata then carries it to the server."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            _settle(args[0])
            if not _tracing.enabled():
                return fn(*args, **kwargs)
            with _tracing.span(name):
                return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def settles(fn: F) -> F:
    """A method of an object with a ``dataplane`` that settles first (``_settle``)."""
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        _settle(self)
        return fn(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class Rpc:
    """The channel of one client and the calls made on it. Store and StoreMany send
    hand-encoded frame messages (``kdn.transport.wire``: one copy of each frame, not three);
    Retrieve, RetrieveMany and inline GetMany answers are read as views of the received messages,
    not copies. ``retrieve_calls`` gives Retrieve on channels of their own (parallel reads)."""

    def __init__(self, address: str, *, timeout_s: float | None, retry: Retry,
                 max_message_bytes: int, api_key: str | None, tls: TLSOptions | None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MS),
            # its own connection: in grpc's shared pool every Client of the process to one
            # server (any tenant) had one, and one connection's egress cap between them
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.keepalive_time_ms", keepalive_ms(timeout_s)),  # (only while calls wait)
            ("grpc.keepalive_timeout_ms", keepalive_ms(timeout_s)),
            ("grpc.http2.ping_timeout_ms", keepalive_ms(timeout_s)),
        ]
        if tls is not None and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        self._tls = tls
        self._options = options
        self.channel = self._new_channel()
        self._group_calls: list[Any] = []
        if api_key and not (isinstance(api_key, str) and api_key.isascii()
                            and api_key.isprintable() and api_key.strip() == api_key):
            raise InvalidArgument("api_key must be printable ASCII with no leading or trailing "
                                  "space (it travels as a gRPC header value)")  # (not shown)
        self._auth: tuple[tuple[str, str], ...] = (
            ((API_KEY_HEADER, api_key),) if api_key else ())
        self._local = threading.local()
        self.stub = pb_grpc.KDNStub(self.channel)
        self.store_call = self.channel.stream_unary(
            "/kdn.v1.KDN/Store", request_serializer=serialize_passthrough,
            response_deserializer=pb.StoreResponse.FromString)
        self.retrieve_call = self.channel.unary_stream(
            "/kdn.v1.KDN/Retrieve", request_serializer=pb.RetrieveRequest.SerializeToString,
            response_deserializer=retrieve_response)
        self.retrieve_many_call = self.channel.unary_stream(
            "/kdn.v1.KDN/RetrieveMany", request_serializer=pb.RetrieveManyRequest.SerializeToString,
            response_deserializer=retrieve_response)
        self.store_many_call = self.channel.stream_unary(
            "/kdn.v1.KDN/StoreMany", request_serializer=serialize_passthrough,
            response_deserializer=pb.StoreManyResponse.FromString)
        self.stub.GetMany = self.channel.unary_unary(
            "/kdn.v1.KDN/GetMany", request_serializer=pb.GetManyRequest.SerializeToString,
            response_deserializer=get_many_response)
        self._lock = threading.Lock()
        self._extra_channels: list[grpc.Channel] = []
        self.closed = False

    @property
    def has_key(self) -> bool:
        """Whether calls carry an API key."""
        return bool(self._auth)

    def _new_channel(self) -> grpc.Channel:
        options = self._options
        if self._tls is None:
            return grpc.insecure_channel(self.address, options=options)
        return grpc.secure_channel(self.address, self._tls.credentials(), options=options)

    def retrieve_calls(self, n: int) -> list[Any]:
        """``n`` Retrieve callables, each on a channel with its own connection (the first is
        the client's own channel)."""
        with self._lock:
            while len(self._group_calls) < n - 1:
                ch = self._new_channel()
                self._extra_channels.append(ch)
                self._group_calls.append(ch.unary_stream(
                    "/kdn.v1.KDN/Retrieve",
                    request_serializer=pb.RetrieveRequest.SerializeToString,
                    response_deserializer=retrieve_response))
            return [self.retrieve_call, *self._group_calls[: n - 1]]

    @property
    def last_request_id(self) -> str:
        """The request id of this thread's latest call ("" before its first)."""
        return str(getattr(self._local, "request_id", ""))

    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Metadata of one call: the API key and ``request_id`` (a fresh one when None), which
        becomes this thread's ``last_request_id``; InvalidArgument for one the server would
        not keep (``REQUEST_ID``: it would log another than the caller's)."""
        if request_id and not (isinstance(request_id, str) and REQUEST_ID.fullmatch(request_id)):
            raise InvalidArgument(f"request_id {shown(request_id)} is malformed: 1-128 "
                                  "characters of ASCII letters, digits and . _ : -")
        rid = request_id or uuid.uuid4().hex[:16]
        self._local.request_id = rid
        md = (*self._auth, (REQUEST_ID_HEADER, rid))
        return tuple(_tracing.inject(list(md))) if _tracing.enabled() else md

    def call(self, fn: Callable[[], T], timeout_s: float | None | Literal[False] = False,
             once: str = "") -> T:
        """``fn()`` retried as ``retry`` says, every attempt and pause within one deadline:
        ``timeout_s`` from now (False: the client's ``timeout_s``; None: none), or this
        thread's ``deadline_within`` where sooner. ``fn`` gives each gRPC call it makes the
        time left (``time_left``), not the whole timeout again. A gRPC error is raised as
        kdn's error. Closed once the channel was closed (every call of the client comes
        here); Unavailable where a call ended OK with no answer (``LOST``). ``once``: what
        the call may have done (a delete, whose count a second try would not give): made
        again only where it never reached the server, an UNAVAILABLE after it may have says
        ``once``."""
        if self.closed:
            raise Closed(CLOSED)
        budget = self.timeout_s if timeout_s is False else timeout_s
        outer, start = (None if own_cap() else call_cap()), time.monotonic()  # a caller's
        try:
            if budget is None:
                out = self.retry.call(fn, bool(once))
            else:
                with deadline_within(budget):
                    out = self.retry.call(fn, bool(once))
        except grpc.RpcError as err:  # kept as the context of kdn's error: not the frames
            if self.closed:  # cancelled by close() on another thread
                raise Closed(CLOSED) from None
            if once and err.code() == grpc.StatusCode.UNAVAILABLE and not never_sent(err):
                raise Unavailable(f"UNAVAILABLE: {err.details()}; {once}") from None
            raise from_grpc(kept(err), _which_deadline(budget, outer, start)) from None
        except ValueError:
            if self.closed:  # gRPC's refusal of a channel closed as the call began
                raise Closed(CLOSED) from None
            raise
        if out is None:  # (gRPC's unary call where its answer's bytes were damaged)
            raise Unavailable(LOST)
        return out

    def frames(self, stream: Iterator[T]) -> Iterator[T]:
        """The messages of a streamed call (a Retrieve's frames), read after ``call``
        returned: one cut by ``close`` on another thread raises Closed, as ``call`` does."""
        try:
            yield from stream
        except (grpc.RpcError, ValueError):
            if self.closed:
                raise Closed(CLOSED) from None
            raise

    def close(self) -> None:
        self.closed = True
        for ch in (self.channel, *self._extra_channels):
            ch.close()
