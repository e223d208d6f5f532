"""OpenTelemetry spans across Client -> server -> tiers; off by default.

Turned on per process (``kdn serve --tracing true``; ``Client(tracing=True)``) when the
``opentelemetry-api`` package is installed (the ``tracing`` extra); kdn only uses the API, so
the exporter and sampling are the application's own ``TracerProvider`` (OTLP, Jaeger, ...),
as OpenTelemetry intends: a ``Client`` never installs one. ``kdn serve``, a process with no
provider of its own, gets one from the standard environment when it names an exporter
(``enable(from_env=True)``): ``OTEL_TRACES_EXPORTER=otlp`` (OTLP over gRPC:
``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-grpc`` installed;
``OTEL_EXPORTER_OTLP_*`` say where), ``otlp_proto_http`` (with
``opentelemetry-exporter-otlp-proto-http``), or ``console``; its service is named by
``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES``, else ``kdn``. Running under
``opentelemetry-instrument`` works as well (its provider is then the process's). The client
injects W3C ``traceparent`` into each call's metadata and opens a span per call; the server
continues that trace with a span per RPC (from ``traceparent`` only: a caller's
``tracestate`` and ``baggage`` are not read, nor logged), and every tier call it makes
(``kdn.store.health.TierHealth.attempt``) is a child span named
``kdn.tier.<tier>.<operation>``. Off, each hook is one global lookup. The same-host fast
path and the network data path (a default ``Client``'s stores and reads) carry no trace: their
calls make client spans only, no server or tier spans (``data_path=False, shm_bytes=0`` sends
every call over gRPC, traced end to end).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

_tracer: Any = None
log = logging.getLogger(__name__)


def enable(from_env: bool = False) -> bool:
    """Start making spans (False, and nothing changes, when opentelemetry is absent);
    ``from_env`` (``kdn serve``'s own process): install the provider the environment names
    (``_provider_from_env``), where the process has none."""
    global _tracer
    try:
        from opentelemetry import trace
    except ImportError:
        return False
    if from_env:
        _provider_from_env()
    _tracer = trace.get_tracer("kdn")
    return True


def _provider_from_env() -> None:
    """Install the SDK's TracerProvider with the exporters ``OTEL_TRACES_EXPORTER`` names
    (comma-separated entry points of ``opentelemetry_traces_exporter``: otlp, console, ...),
    batched, when the process has no provider yet and names one. A name that no installed
    package provides is logged and skipped."""
    from importlib.metadata import entry_points

    from opentelemetry import trace

    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
             if n.strip() and n.strip() != "none"]
    if not names or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s: spans need the opentelemetry-sdk package; "
                    "none are exported", ",".join(names))
        return
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name" in [  # as the SDK reads it
        item.split("=", 1)[0].strip()
        for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if "=" in item]
    attributes = {} if named else {"service.name": "kdn"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
        if not found:
            log.warning("OTEL_TRACES_EXPORTER: no exporter %r installed (otlp: pip install "
                        "opentelemetry-exporter-otlp-proto-grpc; otlp_proto_http: "
                        "opentelemetry-exporter-otlp-proto-http)", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(found[0].load()()))
    trace.set_tracer_provider(provider)


def disable() -> None:
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def span(name: str, metadata: Sequence[tuple[str, Any]] | None = None,
         **attributes: Any) -> Iterator[Any]:
    """A span named ``name`` (the current one's child, or the remote parent carried in gRPC
    ``metadata``), or nothing when tracing is off."""
    if _tracer is None:
        yield None
        return
    ctx = None
    if metadata is not None:  # traceparent only: the caller's tracestate or baggage, malformed,
        from opentelemetry.trace.propagation.tracecontext import (  # was a WARNING echoing
            TraceContextTextMapPropagator,  # it, each call, before any API key was checked
        )

        parent = [str(v) for k, v in metadata if k == "traceparent"][:1]
        ctx = TraceContextTextMapPropagator().extract({"traceparent": parent[0]} if parent else {})
    with _tracer.start_as_current_span(name, context=ctx) as current:
        for key, value in attributes.items():
            current.set_attribute(f"kdn.{key}", value)
        yield current


def current_ids() -> tuple[str, str] | None:
    """The current span's (trace id, span id) in hex, for log lines; None when tracing is off
    or no span is open."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def inject(metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``metadata`` plus the current trace's ``traceparent`` (unchanged when tracing is off)."""
    if _tracer is None:
        return metadata
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return metadata + list(carrier.items())
