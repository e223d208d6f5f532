"""Per-request plumbing: authentication, rate limits, request ids, access logs and metrics.

Lifecycle: ``start_server`` builds one ``Metrics`` (its own Prometheus registry, served over
HTTP when ``metrics_port`` is set) and one ``RequestInterceptor``. For every RPC the interceptor
identifies the caller (``Authenticator.identify``) and applies the tenant's rate limit from the
call's metadata, before gRPC reads its request: a refused call gets a handler that answers it
and never reads the request (under mutual TLS a call without an API key is identified in the
handler wrapper instead, where its certificate is known). The wrapper publishes the principal
in ``kdn.server.auth.current_principal`` for the handler, times the call and records its status
code (a call refused by its rate limit too; an unauthenticated one goes to
``kdn_auth_failures_total`` and the rate-limited ``kdn.audit`` log instead), and writes one
structured (JSON) access-log line carrying the request id the client sent in ``x-request-id``
(or a fresh one), which is also returned in the trailing metadata.

Every method's request deserializer is wrapped (``kdn.server.requests.checked``): a request
message that does not parse, or that holds a malformed namespace, tenant or key, is answered
INVALID_ARGUMENT with a one-line message (after the caller is admitted), on every RPC, unary
or streamed, before or instead of its handler.

A call that moves no request message for ``idle_s`` (the server's idle_timeout_s) is ended
DEADLINE_EXCEEDED: a streamed one between messages, a unary one before its request is whole,
which is read as a request stream of one (gRPC reads a unary request with no bound, and a
connection with a call open is never idle).

The standard health service stays open without credentials, so probes need no API key; its
and reflection's requests may hold ``OPEN_MESSAGE_BYTES`` and must be whole within ``open_s``
(handshake_timeout_s), so a keyless caller holds little for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kdn import tracing
from kdn.errors import KDNError
from kdn.server import logs
from kdn.server.auth import Authenticator, AuthFailed, Principal, current_principal
from kdn.server.metrics_http import MetricsHTTPServer
from kdn.server.requests import BadRequest, checked
from kdn.status import grpc_code
from kdn.transport.metadata import REQUEST_ID, REQUEST_ID_HEADER

access_log = logging.getLogger("kdn.access")
PROBE_RPC = "Stats"
"""The RPC ``kdn admin health`` calls: without any key, a container's health probe."""
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
OPEN_MESSAGE_BYTES = 8 << 10
"""The largest request message the open services take (their requests name a service or a
symbol): a bigger one is answered INVALID_ARGUMENT."""
_Admission = tuple[Principal | None, KDNError | None]
"""A call's caller and why it is refused, or None (``RequestInterceptor._admission``)."""
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30)


class _SourceCollector(Collector):
    """Reads tier stats, queue depths and servicer counters at scrape time."""

    def __init__(self, sources: Callable[[], dict[str, Any]]) -> None:
        self.sources = sources

    def collect(self) -> Iterable[Any]:
        src = self.sources()
        per_tier = {
            "hits": CounterMetricFamily("kdn_tier_hits", "Reads served by a tier", labels=["tier"]),
            "misses": CounterMetricFamily("kdn_tier_misses", "Reads a tier missed",
                                          labels=["tier"]),
            "evictions": CounterMetricFamily("kdn_tier_evictions", "Entries evicted",
                                             labels=["tier"]),
            "corrupt": CounterMetricFamily("kdn_tier_corrupt", "Corrupt entries found and removed",
                                           labels=["tier"]),
        }
        entries = GaugeMetricFamily("kdn_tier_entries", "Entries held", labels=["tier"])
        nbytes = GaugeMetricFamily("kdn_tier_bytes", "Bytes held", labels=["tier"])
        healthy = GaugeMetricFamily("kdn_tier_healthy", "1 when the tier is reachable",
                                    labels=["tier"])
        for t in src.get("tiers", []):
            for name, fam in per_tier.items():
                fam.add_metric([t.name], float(getattr(t, name)))
            entries.add_metric([t.name], float(t.entries))
            nbytes.add_metric([t.name], float(t.bytes))
            healthy.add_metric([t.name], 1.0 if t.healthy else 0.0)
        yield from per_tier.values()
        yield from (entries, nbytes, healthy)
        queues = GaugeMetricFamily("kdn_queue_depth", "Items waiting in a queue", labels=["queue"])
        for name, depth in src.get("queues", {}).items():
            queues.add_metric([name], float(depth))
        yield queues
        if "in_flight" in src:  # the load a node reports to fleet clients (kdn.client.fleet)
            yield GaugeMetricFamily("kdn_rpc_in_flight", "Unary-answer calls running now",
                                    value=float(src["in_flight"]))
        events = CounterMetricFamily("kdn_events", "Server event counters", labels=["event"])
        for name, n in src.get("counters", {}).items():
            events.add_metric([name], float(n))
        yield events
        usage = src.get("usage")
        if usage is not None:  # tokens and bytes by tier, tenant, model (kdn.server.usage)
            yield from usage.families()


class Metrics:
    def __init__(self, sources: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kdn_requests", "RPCs by method and status code",
                                ["rpc", "code"], registry=self.registry)
        self.latency = Histogram("kdn_request_seconds", "RPC latency", ["rpc"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.blend_ratio = Histogram("kdn_blend_recompute_ratio",
                                     "Fraction of cached tokens a blend recomputed",
                                     buckets=(0.01, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
                                     registry=self.registry)
        self.auth_failures = Counter("kdn_auth_failures", "Calls refused before their handler "
                                     "ran: authentication failed, by reason", ["reason"],
                                     registry=self.registry)
        self.registry.register(_SourceCollector(sources))
        self._http: MetricsHTTPServer | None = None

    def serve_http(self, host: str, port: int, *, request_s: float = 10.0) -> int:
        """Expose /metrics; returns the bound port. A connection's request must be whole
        within ``request_s`` (0: 10 s); few are served at once (``kdn.server.metrics_http``)."""
        try:
            server = MetricsHTTPServer(host, port, self.registry, request_s=request_s or 10.0)
        except OSError as exc:  # a host that does not resolve, or is not this machine's
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(exc.errno, f"can not listen on the metrics host {host!r}: "
                              f"{exc.strerror}; give an address of this machine with "
                              "--metrics-host (127.0.0.1; 0.0.0.0 for all)") from None
            raise OSError(exc.errno, f"can not listen on the metrics port {host}:{port}: "
                          f"{exc.strerror}; pick another with --metrics-port") from None
        self._http = server
        return server.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


_CERT_NAMES = (("cn", "x509_common_name"), ("dns", "peer_dns"), ("uri", "peer_uri"),
               ("email", "peer_email"), ("ip", "peer_ip"))


def _identities(context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
    """The verified client certificate's names as (kind, value): its subject CN and its SANs
    by type (``kdn.server.auth.SUBJECT_KINDS``)."""
    ctx = context.auth_context() or {}
    return [(kind, v.decode(errors="replace") if isinstance(v, bytes) else str(v))
            for kind, prop in _CERT_NAMES for v in ctx.get(prop, ())]


class AuditLog:
    """Failed authentications as ``kdn.audit`` warnings: at most ``per_second`` lines a
    second; the lines left out are counted into the next one (brute force stays visible
    without flooding the log)."""

    def __init__(self, per_second: float = 10.0) -> None:
        self.per_second = per_second
        self._allowance, self._stamp, self._dropped = per_second, time.monotonic(), 0
        self._log = logging.getLogger("kdn.audit")

    def probe(self, peer: str, request_id: str) -> None:
        """A keyless health probe (``RequestInterceptor._refused``): a DEBUG line, if any."""
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug(json.dumps({"event": "auth_failed", "reason": "probe",
                                        "peer": peer, "request_id": request_id}))

    def log(self, reason: str, peer: str, request_id: str) -> None:
        now = time.monotonic()
        self._allowance = min(self.per_second,
                              self._allowance + (now - self._stamp) * self.per_second)
        self._stamp = now
        if self._allowance < 1:
            self._dropped += 1
            return
        self._allowance -= 1
        dropped, self._dropped = self._dropped, 0
        self._log.warning(json.dumps({"event": "auth_failed", "reason": reason, "peer": peer,
                                      "request_id": request_id, "not_logged_before": dropped}))


class RequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, metrics: Metrics | None = None, *,
                 idle_s: float = 0.0, open_s: float = 0.0) -> None:
        self.auth = auth
        self.metrics = metrics
        self.idle_s = idle_s  # a stream that moves no message this long ends (module docstring)
        self.open_s = open_s  # an open service's request must be whole this soon (ditto)
        self.audit = AuditLog()
        self._parsers: dict[str, tuple[Callable[[bytes], Any], Callable[[bytes], Any]]] = {}

    async def intercept_service(self, continuation: Callable[..., Any],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method  # "/kdn.v1.KDN/Store"
        service, _, rpc = method.lstrip("/").partition("/")
        open_call = service in OPEN_SERVICES
        md = details.invocation_metadata or ()  # type: ignore[attr-defined]
        admission = (None, None) if open_call else self._admission(md)
        if admission[1] is not None:  # refused on its metadata: its request is never read
            return self._refusing(handler, rpc, md, admission)
        if handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=self._checked(
                method, rpc, handler.request_deserializer, OPEN_MESSAGE_BYTES if open_call else 0))
        streaming = bool(handler.request_streaming)
        if not streaming and self._first_s(open_call):  # read as a stream of one: bounded
            handler = handler._replace(
                request_streaming=True, unary_unary=None, unary_stream=None,
                stream_unary=handler.unary_unary, stream_stream=handler.unary_stream)
        for kind, wrap in (("unary_unary", self._unary), ("stream_unary", self._unary),
                           ("unary_stream", self._stream), ("stream_stream", self._stream)):
            fn = getattr(handler, kind)
            if fn:
                return handler._replace(**{kind: wrap(fn, rpc, md, open_call, streaming,
                                                      admission)})
        return handler

    def _admission(self, md: Any) -> _Admission:
        """The caller and, where it is refused (not authenticated, or past its tenant's rate
        limit), why: decided from the call's metadata alone, before gRPC reads its request (a
        keyless caller made the server read and parse messages of up to max_message_bytes
        only to refuse them). (None, None) where only the client certificate can decide
        (mutual TLS and no API key: the certificate is known to the handler's context)."""
        if self.auth.mtls and not self.auth.supplied_key(md):
            return None, None
        try:
            principal = self.auth.identify(md)
        except AuthFailed as exc:
            return None, exc
        try:
            self.auth.admit(principal)
        except KDNError as exc:
            return principal, exc
        return principal, None

    def _refusing(self, handler: Any, rpc: str, md: Any, admission: _Admission) -> Any:
        """A handler that answers the refusal in ``admission`` (as ``_observed`` does) and
        never reads the request: a request-streaming one that does not iterate its requests
        (gRPC reads a unary request whole, and parses it, before its handler runs)."""
        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            async with self._observed(context, rpc, md, False, admission):
                pass  # (not reached: ``_observed`` aborts the call)

        make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        return make(refuse, request_deserializer=None,
                    response_serializer=handler.response_serializer)

    def _checked(self, method: str, rpc: str, deserialize: Callable[[bytes], Any],
                 max_bytes: int) -> Callable[[bytes], Any]:
        """``deserialize`` answering malformed messages and names, and messages over
        ``max_bytes`` (0: no bound), with a ``BadRequest`` (``kdn.server.requests``), made
        once per method."""
        got = self._parsers.get(method)
        if got is None or got[0] is not deserialize:
            got = self._parsers[method] = (deserialize, checked(deserialize, rpc, max_bytes))
        return got[1]

    def _first_s(self, open_call: bool) -> float:
        """How long a unary request may take to arrive whole (0: no bound): ``idle_s``, and
        for the open services at most ``open_s`` (their callers are not known)."""
        return min((s for s in (self.idle_s, self.open_s if open_call else 0.0) if s),
                   default=0.0)

    async def _request(self, request: Any, context: grpc.aio.ServicerContext, streaming: bool,
                       rpc: str, open_call: bool) -> Any:
        """The request for the handler: a ``BadRequest`` is answered INVALID_ARGUMENT (for a
        stream, when the handler reaches it). A unary request is read from its stream of one
        here (``intercept_service``), ended DEADLINE_EXCEEDED where it is not whole in time."""
        if streaming:
            return _checked_stream(request, context, self.idle_s)
        within = self._first_s(open_call)
        if within:
            try:
                async with asyncio.timeout(within):
                    request = await anext(aiter(request), None)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{rpc}: its request message did not come whole within "
                                    f"{within:g} s (the server's idle_timeout_s, or "
                                    "handshake_timeout_s for an open service); the call is "
                                    "ended")
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{rpc}: the call ended without its request message")
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    @staticmethod
    def _request_id(context: grpc.aio.ServicerContext, md: Any) -> str:
        rid = next((str(v) for k, v in md if k == REQUEST_ID_HEADER), "")
        if not REQUEST_ID.fullmatch(rid):  # on every log line: never the caller's free text
            rid = uuid.uuid4().hex
        context.set_trailing_metadata(((REQUEST_ID_HEADER, rid),))
        logs.request_id.set(rid)  # on every log line this call's handler writes
        return rid

    async def _enter(self, context: grpc.aio.ServicerContext, rpc: str, rid: str, md: Any,
                     admission: _Admission) -> tuple[Principal, KDNError | None]:
        """The caller and why it is refused past authentication (its rate limit), or None;
        an unauthenticated one is counted, audited and aborted here."""
        principal, refusal = admission
        if principal is None and refusal is None:  # mutual TLS, no key: the certificate
            try:
                principal = self.auth.identify(md, _identities(context))
            except AuthFailed as exc:
                refusal = exc
            else:
                try:
                    self.auth.admit(principal)
                except KDNError as exc:
                    refusal = exc
        if isinstance(refusal, AuthFailed):
            self._refused(context, rid, refusal.reason, rpc)
            await context.abort(grpc_code(refusal), str(refusal))
        assert principal is not None  # (only an AuthFailed leaves the caller unknown)
        return principal, refusal

    def _refused(self, context: grpc.aio.ServicerContext, rid: str, reason: str, rpc: str
                 ) -> None:
        """Count a failed authentication and log it (rate-limited; the peer, never the key).
        A Stats call without any key is a health probe (``kdn admin health`` in a container's
        health check): counted as reason ``probe`` and logged at DEBUG only, so that probes
        every few seconds neither look like failed logins nor crowd them out of the log."""
        probe = reason == "missing_key" and rpc == PROBE_RPC
        if self.metrics is not None:
            self.metrics.auth_failures.labels("probe" if probe else reason).inc()
        if probe:
            self.audit.probe(context.peer(), rid)
        else:
            self.audit.log(reason, context.peer(), rid)

    def _done(self, rpc: str, rid: str, tenant: str, t0: float, code: str, peer: str) -> None:
        seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.requests.labels(rpc, code).inc()
            self.metrics.latency.labels(rpc).observe(seconds)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(json.dumps({
                "rpc": rpc, "code": code, "ms": round(seconds * 1e3, 3), "request_id": rid,
                "tenant": tenant, "peer": peer,
            }))

    @staticmethod
    def _code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
        """The call's status name. A call its client cancelled is not asked: its context may
        be gone in gRPC's core (``context.peer()`` of a cancelled stream crashed the process
        with SIGSEGV)."""
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED"
        code = context.code() if hasattr(context, "code") else None
        if isinstance(code, grpc.StatusCode):
            return code.name
        return "OK" if exc is None else "UNKNOWN"

    @contextlib.asynccontextmanager
    async def _observed(self, context: grpc.aio.ServicerContext, rpc: str, md: Any,
                        open_call: bool, admission: _Admission) -> AsyncIterator[None]:
        """Admit the caller (an unauthenticated one is aborted and not recorded here: it is
        ``kdn_auth_failures_total`` and the audit log; its span has ``kdn.code`` only), then
        time the call and record its outcome, also when it is refused by its rate limit,
        raises or is cancelled."""
        t0 = time.perf_counter()
        with tracing.span(f"kdn.server.{rpc}", md if tracing.enabled() else None,
                          rpc=rpc) as span:  # the client's trace continues here (if on)
            rid = self._request_id(context, md)
            tenant, refusal = "", None
            if not open_call:
                try:
                    principal, refusal = await self._enter(context, rpc, rid, md, admission)
                except BaseException as e:  # unauthenticated: aborted, its span says so too
                    if span is not None:
                        span.set_attribute("kdn.code", self._code(context, e))
                    raise
                tenant = principal.tenant
                current_principal.set(principal)
            peer = context.peer() if access_log.isEnabledFor(logging.INFO) else ""  # now,
            exc: BaseException | None = None  # while the call is alive (``_code``)
            try:
                if refusal is not None:  # past the tenant's rate limit: answered, recorded
                    await context.abort(grpc_code(refusal), str(refusal))
                yield
            except BaseException as e:
                exc = e
                raise
            finally:
                code = self._code(context, exc)
                exc = None  # its traceback holds this frame
                self._done(rpc, rid, tenant, t0, code, peer)
                if span is not None:
                    span.set_attribute("kdn.code", code)
                    span.set_attribute("kdn.tenant", tenant)

    def _unary(self, fn: Callable[..., Any], rpc: str, md: Any, open_call: bool,
               streaming: bool, admission: _Admission) -> Callable[..., Any]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._observed(context, rpc, md, open_call, admission):
                request = await self._request(request, context, streaming, rpc, open_call)
                return await fn(request, context)

        return wrapper

    def _stream(self, fn: Callable[..., Any], rpc: str, md: Any, open_call: bool,
                streaming: bool, admission: _Admission) -> Callable[..., Any]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> None:
            async with self._observed(context, rpc, md, open_call, admission):
                out = fn(await self._request(request, context, streaming, rpc, open_call),
                         context)
                if inspect.isawaitable(out):  # a handler that answers with context.write()
                    await out  # (grpc's own health Watch): it has written what it sends
                    return
                try:
                    async for item in out:  # each written once the client took the last one
                        try:
                            async with asyncio.timeout(self.idle_s or None):
                                await context.write(item)
                        except TimeoutError:
                            await out.aclose()  # what it holds goes now
                            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                f"{rpc}: the client took no message for "
                                                f"{self.idle_s:g} s (the server's "
                                                "idle_timeout_s); the call is ended")
                finally:
                    await out.aclose()

        return wrapper


async def _checked_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                          idle_s: float = 0.0) -> AsyncIterator[Any]:
    """A request stream that ends the call with INVALID_ARGUMENT at a ``BadRequest``, and
    with DEADLINE_EXCEEDED where no request comes for ``idle_s`` (0: no bound)."""
    it = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_s or None):
                request = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no message came for {idle_s:g} s (the server's "
                                "idle_timeout_s); the call is ended")
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request
