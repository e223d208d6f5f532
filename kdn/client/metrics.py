"""Client-side load and decode latency, as Prometheus histograms in the application's registry.

The server never decodes a tensor (it checks containers and moves bytes: its own histograms are
``kdn_tier_read_seconds`` and ``kdn_entry_check_seconds``); decoding happens in the process that
uses the KV, so that is where its latency is measured. Off by default; an engine turns it on
once and exposes the registry as it already does (``prometheus_client.start_http_server``, its
web framework's /metrics, vLLM's own endpoint):

    from kdn.client import metrics
    metrics.enable()                        # prometheus_client's default REGISTRY, or registry=

    kdn_client_load_seconds{source}         a retrieve: the call until every layer is ready
    kdn_client_first_layer_seconds{source}  the call until layer 0 is ready (what layer-wise
                                            attention waits for before it starts)
    kdn_client_decode_seconds{encoding}     decoding one entry's frames (summed over frames)
    kdn_client_tokens_loaded_total{source}  tokens of the entries loaded
    kdn_client_ttft_seconds{decision,kind}  an engine request's time to first token: ``kind``
                                            ``predicted`` (the loading controller's estimate
                                            when it decided) or ``measured``
    kdn_client_ttft_error_ratio{decision}   ``|predicted / measured - 1|`` of each request
    kdn_fleet_calls_total{node,outcome}     calls a ``FleetClient`` routed to a node: ``ok``, or
                                            ``failover`` (the node failed; the call moved on)
    kdn_fleet_node_up{node}                 1 while the fleet client counts the node live
    kdn_fleet_node_load{node}               the load the router sees on the node

``source`` is where the entry came from (``inproc``, the server's ``ram``/``redis``/``disk``,
or ``blend``); ``encoding`` is the codec's mode-level, ``decision`` an encoding name or
``recompute``. All are bounded sets. An engine calls ``record_ttft`` once per request, also
for one whose lookup or load failed (its decision then ``recompute``). Each finished
``LayerStream`` (every read path ends in one) calls ``record(stream)``; while off, that is one
global lookup.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.0, 5.0)
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0)

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None  # the families recorded into now (None: off)
_made: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
"""The families registered in each registry enabled so far: a registry takes a name once, so
enabling it again (after ``disable`` or another registry) takes up the same ones."""


def enable(registry: Any = None) -> bool:
    """Record into ``registry`` (default: prometheus_client's global REGISTRY) from now on.
    Enabling a registry again (also after ``disable`` or another registry) records into the
    families made the first time, counts kept; False when prometheus_client is not
    installed."""
    global _metrics
    try:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    except ImportError:
        return False
    registry = REGISTRY if registry is None else registry
    with _lock:
        made = _made.get(registry)
        if made is not None:
            _metrics = made
            return True
        _metrics = _made[registry] = {
            "load": Histogram("kdn_client_load_seconds", "A retrieve, from the call until "
                              "every layer is decoded and ready, by where the entry came from",
                              ["source"], buckets=LOAD_BUCKETS, registry=registry),
            "first": Histogram("kdn_client_first_layer_seconds", "A retrieve, from the call "
                               "until layer 0 is ready", ["source"], buckets=LOAD_BUCKETS,
                               registry=registry),
            "decode": Histogram("kdn_client_decode_seconds", "Decoding one entry's frames "
                                "(summed over its frames), by encoding", ["encoding"],
                                buckets=LOAD_BUCKETS, registry=registry),
            "ttft": Histogram("kdn_client_ttft_seconds", "An engine request's time to first "
                              "token, as the loading controller predicted it and as measured",
                              ["decision", "kind"], buckets=LOAD_BUCKETS, registry=registry),
            "ttft_error": Histogram("kdn_client_ttft_error_ratio", "|predicted / measured - 1| "
                                    "of an engine request's time to first token",
                                    ["decision"], buckets=ERROR_BUCKETS, registry=registry),
            "tokens": Counter("kdn_client_tokens_loaded", "Tokens of the entries loaded, by "
                              "where they came from", ["source"], registry=registry),
            "fleet_calls": Counter("kdn_fleet_calls", "Calls a fleet client routed to a node, "
                                   "by outcome (ok, failover)", ["node", "outcome"],
                                   registry=registry),
            "fleet_up": Gauge("kdn_fleet_node_up", "1 while the fleet client counts the node "
                              "live", ["node"], registry=registry),
            "fleet_load": Gauge("kdn_fleet_node_load", "The load the fleet's router sees on "
                                "the node", ["node"], registry=registry),
        }
    return True


def disable() -> None:
    """Stop recording (the families stay registered, with what they counted: ``enable``
    records into them again)."""
    global _metrics
    with _lock:
        _metrics = None


def enabled() -> bool:
    return _metrics is not None


def record(stream: Any) -> None:
    """Observe one finished ``kdn.client.stream.LayerStream`` (its ``timings``, ``tier`` and
    header): a no-op while off, or for a stream that failed before its last layer."""
    m = _metrics
    if m is None:
        return
    t = stream.timings
    if not t.started or not t.done:
        return
    source = stream.tier or "unknown"
    m["load"].labels(source).observe(t.done - t.started)
    if t.first_layer:
        m["first"].labels(source).observe(t.first_layer - t.started)
    header = stream.decoder.header
    decode_s = getattr(t, "decode_s", None)
    if decode_s is not None:
        codec = header.entry.codec
        m["decode"].labels(f"{codec.mode}-{codec.level}" if codec.level else codec.mode
                           ).observe(decode_s)
    m["tokens"].labels(source).inc(header.tokens)


def record_ttft(decision: str, predicted_s: float, measured_s: float) -> None:
    """Observe one engine request's predicted and measured TTFT (seconds): a no-op while
    off."""
    m = _metrics
    if m is None or measured_s <= 0:
        return
    m["ttft"].labels(decision, "predicted").observe(predicted_s)
    m["ttft"].labels(decision, "measured").observe(measured_s)
    m["ttft_error"].labels(decision).observe(abs(predicted_s / measured_s - 1))


def record_fleet_call(node: str, outcome: str) -> None:
    """Count one call a ``FleetClient`` routed to ``node``: a no-op while off."""
    m = _metrics
    if m is not None:
        m["fleet_calls"].labels(node, outcome).inc()


def record_fleet_node(node: str, up: bool, load: float) -> None:
    """Set a fleet node's liveness and load gauges: a no-op while off."""
    m = _metrics
    if m is not None:
        m["fleet_up"].labels(node).set(1.0 if up else 0.0)
        m["fleet_load"].labels(node).set(load)
