"""OpenTelemetry spans across Client -> server -> tiers (kdn.tracing): one trace from the
application's span through the client's call, the server's RPC and the tier calls it made,
with a real gRPC server on loopback. Off by default: nothing is traced without asking."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from kdn import keys, tracing  # noqa: E402
from kdn.client import Client  # noqa: E402
from kdn.server import ServerConfig, ServerThread  # noqa: E402
from tests.helpers import random_kv, uniform_layout  # noqa: E402

LAY = uniform_layout(layers=2, heads=2, dim=8)
EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # once per process, as OpenTelemetry allows
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    yield EXPORTER
    tracing.disable()


def test_one_trace_from_the_application_to_the_tiers(tmp_path: Path,
                                                     spans: InMemorySpanExporter) -> None:
    key = keys.chunk_key([1, 2], LAY)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", tracing=True)
    with ServerThread(cfg) as st, \
            Client(st.address, shm_bytes=0, data_path=False, tracing=True) as c:
        with trace.get_tracer("app").start_as_current_span("app.request") as app:
            c.store(key, random_kv(LAY, 4))
            assert c.retrieve(key) is not None
    got = {s.name: s for s in spans.get_finished_spans()}
    trace_id = app.get_span_context().trace_id
    names = set(got)
    assert {"kdn.client.store", "kdn.client.retrieve"} <= names
    server = [s for s in got.values() if s.name.startswith("kdn.server.")]
    tiers = [s for s in got.values() if s.name.startswith("kdn.tier.")]
    assert server and tiers, names
    everything = spans.get_finished_spans()
    during = [s for s in everything if s.name.startswith("kdn.") and not s.name.endswith(
        ".close")]  # (the server's shutdown closes its tiers outside any request)
    assert all(s.context.trace_id == trace_id for s in during), \
        "one trace, from the application's span down"
    by_id = {s.context.span_id: s for s in everything}
    store_rpc = next(s for s in server if s.name in ("kdn.server.Store", "kdn.server.PutMany"))
    assert by_id[store_rpc.parent.span_id].name == "kdn.client.store"  # across the wire
    assert any(by_id[t.parent.span_id].name.startswith("kdn.server.") for t in tiers
               if t.parent is not None and t.parent.span_id in by_id)
    assert store_rpc.attributes.get("kdn.code") == "OK"


def test_nothing_is_traced_unless_asked(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    key = keys.chunk_key([3], LAY)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as st, \
            Client(st.address, shm_bytes=0, data_path=False) as c:
        c.store(key, random_kv(LAY, 4))
        c.retrieve(key)
    assert not tracing.enabled()
    assert not [s for s in spans.get_finished_spans() if s.name.startswith("kdn.")]


def test_a_callers_tracestate_and_baggage_are_not_read(tmp_path: Path, spans: InMemorySpanExporter,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The server continues a trace from ``traceparent`` alone: a caller's malformed
    ``tracestate`` and ``baggage`` (an unauthenticated one's too) made OpenTelemetry WARNING
    lines echoing kilobytes of them, one per call. An unauthenticated call's span has its
    ``kdn.code``."""
    import grpc

    auth = tmp_path / "t.yaml"
    auth.write_text('tenants:\n  a: {api_keys: ["key-a"]}\n')
    auth.chmod(0o600)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, auth_file=str(auth),
                       tracing=True)
    with ServerThread(cfg) as st, grpc.insecure_channel(st.address) as channel:
        call = channel.unary_unary("/kdn.v1.KDN/Lookup")
        for api_key in ("wrong", "key-a"):
            try:
                call(b"", timeout=10, metadata=(
                    ("x-kdn-api-key", api_key), ("traceparent", parent),
                    ("tracestate", "x=" + "HOSTILE" * 900),
                    ("baggage", ",".join(f"k{i}=v" for i in range(200)))))
            except grpc.RpcError as exc:  # the wrong key's
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert "HOSTILE" not in caplog.text
    served = [s for s in spans.get_finished_spans() if s.name == "kdn.server.Lookup"]
    assert [s.context.trace_id for s in served] == [0x0af7651916cd43dd8448eb211c80319c] * 2
    assert served[0].attributes.get("kdn.code") == "UNAUTHENTICATED"  # it had none


def _run(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_client_leaves_the_tracer_provider_to_the_application() -> None:
    """``Client(tracing=True)`` uses the API only: with ``OTEL_TRACES_EXPORTER`` set (for the
    application's own SDK set-up) it installed kdn's provider, and the application's was
    refused; ``kdn serve``'s process gets the one the environment names."""
    code = ("from opentelemetry import trace\nfrom kdn.client import Client\n"
            "Client('127.0.0.1:1', tracing=True, data_path=False, shm_bytes=0).close()\n"
            "print(type(trace.get_tracer_provider()).__name__)")
    assert _run(code, OTEL_TRACES_EXPORTER="console") == "ProxyTracerProvider"


@pytest.mark.parametrize("env,name", [
    ({}, "kdn"), ({"OTEL_SERVICE_NAME": "svc-a"}, "svc-a"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=svc-b,deployment.environment=prod"}, "svc-b"),
])
def test_kdn_serves_service_name_is_the_environments(env: dict[str, str], name: str) -> None:
    """``service.name`` from ``OTEL_RESOURCE_ATTRIBUTES`` was overridden with ``kdn``."""
    code = ("from opentelemetry import trace\nfrom kdn import tracing\n"
            "assert tracing.enable(from_env=True)\n"
            "print(trace.get_tracer_provider().resource.attributes['service.name'])")
    env = {"OTEL_SERVICE_NAME": "", "OTEL_RESOURCE_ATTRIBUTES": "", **env}
    assert _run(code, OTEL_TRACES_EXPORTER="console", **env) == name


def test_tracing_without_opentelemetry_is_refused_by_a_client() -> None:
    """``Client(tracing=True)`` without the ``tracing`` extra traced nothing, silently."""
    code = ("import sys\nsys.modules['opentelemetry'] = None\nfrom kdn.client import Client\n"
            "from kdn.errors import ConfigError\ntry:\n"
            "    Client('127.0.0.1:1', tracing=True, data_path=False, shm_bytes=0)\n"
            "except ConfigError as exc:\n    print(exc)\n")
    assert "pip install 'kdn[tracing]'" in _run(code)
