"""A fleet for real (bench/fleet_real.py): three ``kdn serve`` processes sharing a Redis Cluster
of three masters, three engine threads each routing through its own FleetClient, and the
busiest node killed (SIGKILL) half way: no request fails, every block first stored through the
killed node is read back from Redis through the survivors, and ``kdn admin fleet`` shows the
node down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fleet_real import Fleet, replay
from bench.fleet_sim import load_trace

pytestmark = pytest.mark.redis
TRACE = Path(__file__).parent / "data" / "conversation_trace_head.jsonl.gz"


def test_a_killed_node_fails_no_request_and_its_keys_come_from_redis(tmp_path: Path) -> None:
    trace = load_trace(TRACE, 150)
    with Fleet(tmp_path, nodes=3, replicas=False, ram_bytes=16 << 20) as fleet:
        result = replay(fleet, trace, engines=3, kill_at=0.5, health_interval_s=0.2)
        cli = subprocess.run([sys.executable, "-m", "kdn", "admin", "fleet", "--nodes",
                              ",".join(fleet.addresses), "--timeout", "2", "-o", "json"],
                             capture_output=True, text=True, timeout=60)
        alive = [a for i, a in enumerate(fleet.addresses) if fleet.procs[i].poll() is None]
    assert result["failed_requests"] == 0, result["failures"]
    killed = int(result["killed_node"].removeprefix("node"))
    # every engine's client took the node out of its routing: by a failed call (a failover)
    # or by its health checker, whichever saw it first (a race; failover itself is checked
    # deterministically in test_fleet_routing)
    assert result["killed_node_live_in_clients"] == [False] * 3, result
    assert result["killed_keys"] > 0
    read = result["killed_keys_read_back_from"]
    assert sum(read.values()) == result["killed_keys"] and "missing" not in read
    # read by the survivors, from the shared tier (none of them had stored those blocks; a
    # few the trace hit again after the kill are in their RAM by now)
    assert all(k.split("@")[0] in ("ram", "redis") and k.split("@")[1] != f"node{killed}"
               for k in read), read
    from_redis = sum(n for k, n in read.items() if k.startswith("redis@"))
    assert from_redis >= 0.8 * result["killed_keys"], read
    assert result["hit_ratio"] > 0
    view = {r["node"]: r for r in result["fleet_view"]}
    assert view[fleet.addresses[killed]]["status"] == "DOWN"
    assert all(view[a]["status"] == "SERVING" for a in alive) and len(alive) == 2
    assert cli.returncode == 1, cli.stderr  # not every node is SERVING
    rows = {r["node"]: r for r in json.loads(cli.stdout)}
    assert rows[fleet.addresses[killed]]["status"] == "DOWN"
    assert all(rows[a]["status"] == "SERVING" and rows[a]["ram_entries"] > 0 for a in alive)
