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
