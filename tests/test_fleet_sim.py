"""The fleet simulator (bench/fleet_sim.py) on the first 800 requests of the conversation trace
(tests/data): its accounting adds up, it agrees with an unbounded cache computed apart, the
policies order as routing says they should, and a node lost mid-trace fails no request."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.fleet_sim import (
    Request,
    Sim,
    bound_hit_ratio,
    load_trace,
    recovery,
    simulate,
    working_set,
)
from kdn.client.routing import Affinity, LoadMeter, Router, key_hash

TRACE = Path(__file__).parent / "data" / "conversation_trace_head.jsonl.gz"
BLOCK = 64 << 20


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return load_trace(TRACE)


def run(trace: list[Request], policy: str, fraction: float, nodes: int = 8,
        block: int = BLOCK, **kw: object) -> dict[str, object]:
    ram = int(fraction * working_set(trace) * BLOCK / nodes)
    return simulate(trace, Sim(policy, nodes, ram, block, **kw))  # type: ignore[arg-type]


def test_the_trace_slice_reads_back(trace: list[Request]) -> None:
    with gzip.open(TRACE, "rt") as f:
        first = json.loads(f.readline())
    assert len(trace) == 800
    assert trace[0].blocks == tuple(first["hash_ids"])
    assert trace[0].t_s == first["timestamp"] / 1000


def test_ratios_add_up_and_match_an_unbounded_cache(trace: list[Request]) -> None:
    bound = bound_hit_ratio(trace)
    assert 0.1 < bound < 0.5
    for policy in ("random", "key-hash", "prefix-affinity"):
        row = run(trace, policy, 0.25)
        assert row["bound_hit_ratio"] == pytest.approx(bound)
        total = row["ram_hit_ratio"] + row["redis_hit_ratio"] + row["miss_ratio"]  # type: ignore[operator]
        assert total == pytest.approx(1.0)
        assert row["failed_requests"] == 0
        assert row["moved_bytes"] == round(row["redis_hit_ratio"] * row["blocks"]) * BLOCK  # type: ignore[operator]


def test_routing_policies_order_as_expected(trace: list[Request]) -> None:
    rnd = run(trace, "random", 0.25)
    aff = run(trace, "prefix-affinity", 0.25)
    assert aff["ram_hit_ratio"] > 1.5 * rnd["ram_hit_ratio"]  # type: ignore[operator]
    assert aff["load_max_over_mean"] <= 1.3  # type: ignore[operator]
    # with RAM for all of it, affinity keeps nearly every reusable block in RAM
    full = run(trace, "prefix-affinity", 2.0)
    assert full["ram_hit_ratio"] > 0.9 * full["bound_hit_ratio"]  # type: ignore[operator]
    # no RAM: every hit comes from Redis
    none = run(trace, "prefix-affinity", 0.0)
    assert none["ram_hit_ratio"] == 0 and none["redis_hit_ratio"] == none["bound_hit_ratio"]


def test_smaller_entries_hit_more_at_equal_ram(trace: list[Request]) -> None:
    raw = run(trace, "prefix-affinity", 1 / 16)
    small = run(trace, "prefix-affinity", 1 / 16, block=BLOCK // 7)
    assert small["ram_hit_ratio"] > raw["ram_hit_ratio"]  # type: ignore[operator]


@pytest.mark.parametrize("policy", ["random", "key-hash", "prefix-affinity"])
def test_a_node_lost_mid_trace_fails_no_request(trace: list[Request], policy: str) -> None:
    base = run(trace, policy, 0.5)
    lost = run(trace, policy, 0.5, fail_at=0.5)
    assert lost["failed_requests"] == 0
    assert lost["failovers"] >= 1  # requests did go to the dead node first
    assert lost["bound_hit_ratio"] == base["bound_hit_ratio"]  # Redis still has every block
    if policy != "random":  # (random on fewer nodes meets its own RAM more often)
        assert lost["ram_hit_ratio"] < base["ram_hit_ratio"]  # type: ignore[operator]
    rec = recovery(lost["windows"], base["windows"], 0.5)  # type: ignore[arg-type]
    assert 0 < rec["worst_window_vs_baseline"] <= rec["first_span_vs_baseline"]
    assert rec["recovered"] == (rec["second_span_vs_baseline"] >= 0.95)


@pytest.mark.parametrize("nodes", [3, 30])
def test_prefix_affinity_routes_as_the_routing_lifecycle_says(trace: list[Request],
                                                              nodes: int) -> None:
    """The simulator's prefix-affinity policy is the lifecycle of ``kdn.client.routing`` that
    FleetClient follows (route key, ``choose`` with the request's blocks as its amount, load
    added, keys remembered): the blocks each node served, replayed apart, come out the same."""
    sim = Sim("prefix-affinity", nodes, 0, BLOCK)
    router = Router([f"node-{i}" for i in range(nodes)], affinity_blocks=sim.affinity_blocks,
                    load_bound=sim.load_bound, load_floor=sim.load_floor)
    load = LoadMeter(nodes, half_life_s=sim.half_life_s)
    affinity = Affinity(1 << 22)
    for req in trace:
        chain = [key_hash(b.to_bytes(8, "little")) for b in req.blocks]
        route = router.route_key(chain)  # type: ignore[arg-type]
        node = router.choose(route, load, req.t_s, prefer=affinity.get(route),
                             amount=float(len(chain)))[0]
        load.add(node, float(len(chain)), req.t_s)
        affinity.remember(chain, node)
    row = simulate(trace, sim)
    assert row["load_max_over_mean"] == load.total.max() / load.total.mean()


def test_recovery_reads_spans_after_the_loss() -> None:
    base = [0.4] * 40
    lost = [0.4] * 20 + [0.1, 0.2, 0.3, 0.4] + [0.39] * 16
    rec = recovery(lost, base, 0.5)
    assert rec["first_span_vs_baseline"] == pytest.approx(0.625)
    assert rec["second_span_vs_baseline"] == pytest.approx(0.975) and rec["recovered"]
    assert rec["worst_window_vs_baseline"] == pytest.approx(0.25)
    assert not recovery([0.4] * 20 + [0.1] * 20, base, 0.5)["recovered"]


def test_bad_traces_and_settings_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace record"):
        load_trace(bad)
    with pytest.raises(ValueError, match="policy 'fastest'"):
        Sim("fastest", 3, 1, 1)
    with pytest.raises(ValueError, match="fail_at"):
        Sim("random", 3, 1, 1, fail_at=1.5)
