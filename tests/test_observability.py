"""The token-level metrics an operator charts (tokens requested, stored and served by tier,
tenant and model; entries hit and missed; bytes by encoding; tier read and entry check
latency; the same-host fast path's calls), counted exactly on a real server through each read
path (the Retrieve stream, GetMany over gRPC and over the fast path), and the request id (and,
with tracing on, the trace) on the server's own log lines."""

from __future__ import annotations

import logging
import re
import urllib.request
from pathlib import Path

import grpc
import pytest

from kdn import keys
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout

LAY = uniform_layout(layers=2, heads=2, dim=8, model="model-a")


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels}")


def _scrape(st: ServerThread) -> str:
    assert st.server is not None
    return urllib.request.urlopen(  # type: ignore[no-any-return]
        f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()


def test_tokens_and_entries_are_counted_on_every_read_path(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0)
    a, b = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    with ServerThread(cfg) as st:
        with Client(st.address, shm_bytes=0, data_path=False) as c:
            c.store(a, random_kv(LAY, 8), mode="raw")
            c.store(b, random_kv(LAY, 4), mode="lossless")
            assert c.retrieve_stream(a).result() is not None  # the Retrieve stream
            assert c.retrieve(b) is not None  # GetMany
            assert c.retrieve(keys.chunk_key([3], LAY)) is None  # a miss: never stored
            c.delete(a)
            assert c.retrieve(a) is None  # a miss on a key stored before: 8 tokens asked
        text = _scrape(st)
    assert _sample(text, "kdn_tokens_stored_total", tenant="", model="model-a") == 12
    assert _sample(text, "kdn_tokens_served_total", tier="ram", model="model-a") == 12
    assert _sample(text, "kdn_tokens_requested_total", tenant="", model="model-a") == 20
    assert _sample(text, "kdn_entries_requested_total", model="model-a", result="hit") == 2
    assert _sample(text, "kdn_entries_requested_total", model="model-a", result="miss") == 1
    assert _sample(text, "kdn_entries_requested_total", model="unknown", result="miss") == 1
    assert "kdn_tokens_requested_total{model=\"unknown\"" not in text  # its size is unknown
    assert _sample(text, "kdn_bytes_stored_total", encoding="raw") > 0
    assert _sample(text, "kdn_bytes_served_total", encoding="lossless") > 0
    assert _sample(text, "kdn_tier_read_seconds_count", tier="ram") == 2
    assert _sample(text, "kdn_tier_read_seconds_bucket", tier="ram", le="+Inf") == 2
    assert _sample(text, "kdn_entry_check_seconds_count", encoding="raw") == 1
    assert _sample(text, "kdn_entry_check_seconds_count", encoding="lossless") == 1
    assert _sample(text, "kdn_entry_check_seconds_sum", encoding="raw") > 0


def test_a_key_asked_for_twice_in_one_batch_counts_twice_and_is_read_once(tmp_path: Path
                                                                           ) -> None:
    """A GetMany naming a key twice (over gRPC and over the network data path): a present
    key's repeat is a hit and a missing key's a miss, as RetrieveMany counts them; the tier
    read timed is only the one made."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0)
    k, m = keys.chunk_key([1], LAY), keys.chunk_key([9], LAY)
    names = [("kdn_entries_requested_total", {"result": "hit"}),
             ("kdn_entries_requested_total", {"result": "miss"}),
             ("kdn_tier_read_seconds_count", {"tier": "ram"}),
             ("kdn_tier_hits_total", {"tier": "ram"})]
    with ServerThread(cfg) as st, grpc.insecure_channel(st.address) as ch, \
            Client(st.address, shm_bytes=0) as c:  # the network data path
        c.store(k, random_kv(LAY, 8), mode="raw")
        c.retrieve_many([k, m])  # every sample there before the counts
        by_grpc = pb_grpc.KDNStub(ch).GetMany
        for way in ("grpc", "data path"):
            text = _scrape(st)
            before = [_sample(text, n, **labels) for n, labels in names]
            if way == "grpc":
                got = [e.present for e in by_grpc(pb.GetManyRequest(keys=[k, k, m, m]),
                                                  timeout=30).entries]
            else:
                got = [g is not None for g in c.retrieve_many([k, k, m, m])]
            assert got == [True, True, False, False]
            text = _scrape(st)
            hit, miss, timed, read = (_sample(text, n, **labels) - was
                                      for (n, labels), was in zip(names, before))
            assert (hit, miss) == (2, 2), way
            assert timed == read == 1, way


def test_a_retrieve_counts_every_byte_of_the_entry_it_sends(tmp_path: Path) -> None:
    """``bytes_out`` of a Retrieve stream is the entry's size, header and frames, as a GetMany
    of the same entry counts it (the stream counted its frames only)."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d")
    kv, key = random_kv(LAY, 8), keys.chunk_key([1], LAY)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        assert st.server is not None
        c.store(key, kv, mode="raw")
        out = [st.server.servicer.counters.get("bytes_out", 0)]
        assert c.retrieve_stream(key).result() is not None  # the Retrieve stream
        out.append(st.server.servicer.counters.get("bytes_out", 0))
        assert c.retrieve(key) is not None  # GetMany
        out.append(st.server.servicer.counters.get("bytes_out", 0))
    assert out[1] - out[0] == out[2] - out[1] > 0


def test_a_remote_read_that_learns_an_entry_is_large_counts_it_once(tmp_path: Path) -> None:
    """An entry too large for one inline message is read alone as a GetMany that learns its
    size, then a Retrieve stream; in a batch, by one grouped RetrieveMany. Each read counts
    the entry once: the GetMany that only learnt its size serves nothing."""
    lay = uniform_layout(layers=4, heads=4, dim=64, model="model-b")  # 4 KiB a token
    big, small = keys.chunk_key([1], lay), keys.chunk_key([2], lay)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0)) as st:
        with Client(st.address, shm_bytes=0, data_path=False) as c:
            c.store(big, random_kv(lay, 1100), mode="raw")  # 4.5 MB: past INLINE_ENTRY_BYTES
            c.store(small, random_kv(lay, 10), mode="raw")
            assert c.fetch(big) is not None  # GetMany (its size), then Retrieve
            got = c.fetch_many([big, small])  # one RetrieveMany
            assert got[0] is not None and got[1] is not None
            assert st.server is not None and st.server.servicer.counters.get("retrieve.hit")
        text = _scrape(st)
    assert _sample(text, "kdn_entries_requested_total", model="model-b", result="hit") == 3
    assert _sample(text, "kdn_tokens_served_total", tier="ram", model="model-b") == 2210
    assert _sample(text, "kdn_tier_read_seconds_count", tier="ram") == 3


def test_the_fast_path_is_counted_and_timed(tmp_path: Path) -> None:
    """Same-host batches bypass gRPC (no interceptor): their calls have families of their
    own, and their tokens count like any other read."""
    a, b = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0)) as st:
        with Client(st.address) as c:  # loopback: a shared segment and the fast path
            c.store_many([(a, random_kv(LAY, 8)), (b, random_kv(LAY, 4))], mode="raw")
            got = c.retrieve_many([a, b, keys.chunk_key([3], LAY)])
            assert got[0] is not None and got[1] is not None and got[2] is None
        assert st.server is not None and st.server.servicer.counters.get("fast.GetMany")
        text = _scrape(st)
    assert _sample(text, "kdn_fastpath_requests_total", rpc="GetMany", code="OK") >= 1
    assert _sample(text, "kdn_fastpath_requests_total", rpc="PutMany", code="OK") >= 1
    assert _sample(text, "kdn_fastpath_request_seconds_count", rpc="GetMany") >= 1
    assert _sample(text, "kdn_tokens_served_total", model="model-a") == 12
    assert _sample(text, "kdn_tokens_requested_total", model="model-a") == 12
    assert _sample(text, "kdn_entry_check_seconds_count", encoding="raw") == 2


def test_model_labels_stay_bounded_and_carry_no_directories() -> None:
    from kdn.server.usage import MAX_MODELS, MODELS_PER_TENANT, Usage, model_label

    assert model_label("/home/me/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert model_label("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert len(model_label("m" * 500)) == 64
    usage = Usage()
    tenants = [f"t{i % 8}" for i in range(MAX_MODELS + 10)]  # 8 tenants, 5 names each
    assert {usage._model(f"m{i}", t) for i, t in enumerate(tenants)} == \
        {f"m{i}" for i in range(MAX_MODELS)} | {"other"}
    # one tenant's odd names take its own share, not every label
    usage = Usage()
    assert [usage._model(f"junk{i}", "a") for i in range(MODELS_PER_TENANT + 3)][-3:] == \
        ["other"] * 3
    assert usage._model("meta-llama/Llama-3-8B", "b") == "meta-llama/Llama-3-8B"
    assert usage._model("junk0", "b") == "junk0"  # labelled already: every tenant's
    usage = Usage()  # a server without tenants: every key is tenant "", all 32 its own
    assert len({usage._model(f"m{i}", "") for i in range(MAX_MODELS)}) == MAX_MODELS


def test_remembered_facts_share_their_label_strings() -> None:
    """Up to 100k keys' facts are remembered: entries of one encoding and model hold one
    string of each, not a copy per key (~6 MB of the ~32 MB at the cap)."""
    from kdn import codec
    from kdn.codec.format import parse_header
    from kdn.server.usage import Usage

    blob = codec.encode(random_kv(uniform_layout(2, 1, 4), tokens=4), "kdn", "default")
    usage = Usage()
    facts = [usage._remember(f"default/{i:064x}".encode(), parse_header(blob)) for i in range(2)]
    assert facts[0][2] == "kdn-default" and facts[0][2] is facts[1][2]
    assert facts[0][1] is facts[1][1]


def test_log_lines_carry_the_request_id(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    from kdn.server.logs import JsonLines, _RequestId

    with caplog.at_level(logging.INFO, logger="kdn.access"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as st:
            with Client(st.address) as c:
                c.lookup([keys.chunk_key([1], LAY)], request_id="req-1234")
    records = [r for r in caplog.records if r.name == "kdn.access"]
    assert records
    record = records[-1]
    _RequestId().filter(record)  # the handler's filter: the id of the call being served
    import json

    line = json.loads(JsonLines().format(record))
    assert line["rpc"] == "Lookup" and line["request_id"] == "req-1234"
    assert line["logger"] == "kdn.access" and "msg" not in line  # fields merged, not quoted


def test_a_request_id_that_is_free_text_is_replaced(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A caller's request id is on every log line of its call: one that could forge the
    front of a line (spaces, brackets, control characters, 7,000 characters) is replaced
    (a Client refuses to send one: a raw gRPC caller's)."""
    import grpc

    forged = "x] 2026-11-29 ERROR kdn.server [forged"
    with caplog.at_level(logging.INFO, logger="kdn.access"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as st, \
                grpc.insecure_channel(st.address) as channel:
            lookup = channel.unary_unary("/kdn.v1.KDN/Lookup")
            for rid in (forged, "y" * 7000, "ok-id_1.2:3"):
                lookup(b"", metadata=(("x-request-id", rid),), timeout=10)
    import json

    seen = [json.loads(r.getMessage())["request_id"] for r in caplog.records
            if r.name == "kdn.access"]
    assert seen[-1] == "ok-id_1.2:3"
    assert forged not in seen and "y" * 7000 not in seen
    assert all(len(rid) <= 128 and " " not in rid for rid in seen)


def test_json_log_lines_carry_the_trace_when_tracing_is_on(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    pytest.importorskip("opentelemetry.sdk")
    import json

    from opentelemetry.sdk.trace import TracerProvider

    from kdn import tracing
    from kdn.server.logs import JsonLines, _RequestId

    # a provider of its own (the process-wide one is tests/test_tracing.py's to set)
    monkeypatch.setattr(tracing, "_tracer", TracerProvider().get_tracer("kdn"))
    record = logging.LogRecord("kdn.server", logging.INFO, __file__, 1, "plain", None, None)
    with tracing.span("kdn.server.Lookup") as current:
        _RequestId().filter(record)
    line = json.loads(JsonLines().format(record))
    assert line["trace_id"] == f"{current.get_span_context().trace_id:032x}"
    assert line["span_id"] == f"{current.get_span_context().span_id:016x}"
    assert line["msg"] == "plain"
    monkeypatch.setattr(tracing, "_tracer", None)
    record = logging.LogRecord("kdn.server", logging.INFO, __file__, 1, "plain", None, None)
    _RequestId().filter(record)
    assert "trace_id" not in json.loads(JsonLines().format(record))  # off: no trace fields


def _client_stream(tier: str, mode: str = "raw", tokens: int = 8) -> object:
    from types import SimpleNamespace

    from kdn.v1 import kdn_pb2 as pb

    entry = pb.EntryHeader(tokens=tokens, codec=pb.Codec(mode=mode, level=""))
    header = SimpleNamespace(entry=entry, tokens=tokens)
    timings = SimpleNamespace(started=1.0, first_layer=1.002, done=1.01, decode_s=0.004)
    return SimpleNamespace(timings=timings, tier=tier, decoder=SimpleNamespace(header=header))


def test_client_load_and_decode_histograms_are_off_until_enabled() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics

    registry = CollectorRegistry()
    metrics.record(_client_stream("ram"))  # off: nothing, nowhere
    assert metrics.enable(registry) and metrics.enable(registry)  # twice: one set of families
    try:
        metrics.record(_client_stream("ram"))
        metrics.record(_client_stream("inproc", "lossless", 4))
        failed = _client_stream("redis")
        failed.timings.done = 0.0  # type: ignore[attr-defined]
        metrics.record(failed)  # never finished: not a load
        text = generate_latest(registry).decode()
    finally:
        metrics.disable()
    assert _sample(text, "kdn_client_load_seconds_count", source="ram") == 1
    assert _sample(text, "kdn_client_load_seconds_sum", source="ram") == pytest.approx(0.01)
    assert _sample(text, "kdn_client_first_layer_seconds_sum", source="ram") == \
        pytest.approx(0.002)
    assert _sample(text, "kdn_client_decode_seconds_count", encoding="lossless") == 1
    assert _sample(text, "kdn_client_tokens_loaded_total", source="inproc") == 4
    assert 'source="redis"' not in text


def test_client_metrics_enabled_again_record_into_the_families_made_first() -> None:
    """``disable`` leaves the families registered: enabling the registry again (after it, or
    after another registry) records into them, counts kept, not a second registration."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics

    first, other = CollectorRegistry(), CollectorRegistry()
    try:
        assert metrics.enable(first)
        metrics.record(_client_stream("ram"))
        metrics.disable()
        metrics.record(_client_stream("ram"))  # off: not counted
        assert metrics.enable(first)
        metrics.record(_client_stream("ram"))
        assert metrics.enable(other) and metrics.enable(first)
        metrics.record(_client_stream("ram"))
    finally:
        metrics.disable()
    assert _sample(generate_latest(first).decode(), "kdn_client_load_seconds_count",
                   source="ram") == 3
    assert 'source="ram"' not in generate_latest(other).decode()


def test_client_histograms_on_a_real_retrieve(tmp_path: Path) -> None:
    """Once kdn.client.stream calls ``metrics.record`` (the hook): every read path."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics
    from kdn.client.stream import StreamTimings

    if not hasattr(StreamTimings(), "decode_s"):
        pytest.skip("kdn.client.stream does not record into kdn.client.metrics yet")
    registry = CollectorRegistry()
    a = keys.chunk_key([1], LAY)
    metrics.enable(registry)
    try:
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as st:
            with Client(st.address, shm_bytes=0, data_path=False) as c:
                c.store(a, random_kv(LAY, 8), mode="lossless")
                assert c.retrieve_stream(a).result() is not None  # the Retrieve stream
                assert c.retrieve(a) is not None  # GetMany
            with Client(st.address) as c:  # the shared segment
                assert c.retrieve(a) is not None
        text = generate_latest(registry).decode()
    finally:
        metrics.disable()
    assert _sample(text, "kdn_client_load_seconds_count", source="ram") == 3
    assert _sample(text, "kdn_client_decode_seconds_count", encoding="lossless") == 3
    assert _sample(text, "kdn_client_decode_seconds_sum", encoding="lossless") > 0
    assert _sample(text, "kdn_client_tokens_loaded_total", source="ram") == 24


def test_kdn_serve_exports_spans_named_by_the_standard_environment(tmp_path: Path) -> None:
    """``kdn serve --tracing`` has no application to configure a TracerProvider: it takes
    the one OTEL_TRACES_EXPORTER names (console here; otlp with its exporter installed)."""
    pytest.importorskip("opentelemetry.sdk")
    import os
    import signal
    import subprocess
    import sys

    from bench.common import free_port, port_open, wait_until

    port = free_port()
    bindir = Path(sys.executable).parent
    env = {**os.environ, "KDN_PORT": str(port), "KDN_DATA_DIR": str(tmp_path / "d"),
           "KDN_TRACING": "true", "OTEL_TRACES_EXPORTER": "console", "HOME": str(tmp_path),
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        server = subprocess.Popen(["kdn", "serve"], env=env, stdout=f, stderr=subprocess.STDOUT,
                                  cwd=tmp_path)
    try:
        wait_until(lambda: port_open(port), "kdn", server)  # type: ignore[arg-type]
        with Client(f"127.0.0.1:{port}", shm_bytes=0, data_path=False) as c:
            c.store(keys.chunk_key([1], LAY), random_kv(LAY, 4))
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
    text = out.read_text()
    assert '"name": "kdn.server.Store"' in text, text[-2000:]
    assert '"name": "kdn.tier.ram.' in text
    assert '"service.name": "kdn"' in text
