"""The real run of ``bench/fleet.py``: kdn server processes sharing a Redis Cluster on
loopback, engine threads each with its own ``FleetClient``, one node killed mid-run.

    with Fleet(root, nodes=3, replicas=True) as fleet:     # redis-servers + kdn processes
        result = replay(fleet, trace[:300], engines=3, kill_at=0.5)

Each engine replays its share of the trace's requests (request i goes to engine i % engines),
as an engine with a prefix cache does: keys are chained over the request's hash ids
(``chain_keys``), ``lookup(prefix_chain=True)`` finds the stored prefix, ``fetch_many`` reads
it (every entry must come back: a stored prefix that can not be read is a failed request), and
``store_many`` stores the rest. Entries are small (``ENTRY``: a 2-layer toy layout; the point
is routing and failover, not bandwidth). At ``kill_at`` of the requests the node that served
most calls is killed (SIGKILL). The result counts failed requests (any exception), and for
the keys first stored through the killed node, the trace's hits on them after the kill by tier
and node (``killed_keys_hit_from``: a survivor's ``ram`` once it holds a copy, ``redis`` the
first time); after the replay every one of them is read back through the fleet
(``killed_keys_read_back_from``, ``missing`` for one that could not be read), and each
engine's client is given ten health intervals to take the killed node out of its routing
(``killed_node_live_in_clients``: False each, by a failed call or its health checker).
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import HOST, free_port, stop, wait_until
from bench.fleet_sim import Request
from kdn.client import Client
from kdn.client.fleet import FleetClient, FleetConfig, fleet_view
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import RedisCluster3

LAYOUT = uniform_layout(layers=2, heads=2, dim=8)
ENTRY = random_kv(LAYOUT, 16)  # 1 KiB of fp16 KV per block


def chain_keys(blocks: tuple[int, ...]) -> list[bytes]:
    """32-byte keys chained over hash ids: key i names blocks 0..i (as kdn.keys.prefix_keys)."""
    out, prev = [], b""
    for b in blocks:
        prev = hashlib.blake2b(prev + b.to_bytes(8, "little"), digest_size=32).digest()
        out.append(prev)
    return out


class Fleet:
    """A Redis Cluster (``RedisCluster3``, 3 masters, with ``replicas`` one replica each) and
    ``nodes`` ``kdn serve`` processes on loopback sharing it (RAM tier ``ram_bytes``, then
    Redis; no disk)."""

    def __init__(self, root: Path, *, nodes: int = 3, replicas: bool = True,
                 ram_bytes: int = 64 << 20) -> None:
        self.root = Path(root)
        self.cluster = RedisCluster3(self.root / "cluster", replicas=replicas)
        self.n = nodes
        self.ram_bytes = ram_bytes
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self._stack = ExitStack()

    def start(self) -> Fleet:
        self._stack.enter_context(self.cluster)
        urls = ",".join(self.cluster.urls)
        for i in range(self.n):
            port = free_port()
            data = self.root / f"node{i}"
            data.mkdir(parents=True, exist_ok=True)
            log = open(self.root / f"node{i}.log", "wb")
            self._stack.callback(log.close)
            proc = subprocess.Popen(
                [sys.executable, "-m", "kdn", "serve", "--host", HOST, "--port", str(port),
                 "--data-dir", str(data), "--disk-bytes", "0", "--ram-bytes",
                 str(self.ram_bytes), "--redis-url", urls, "--redis-cluster", "true",
                 "--tier-order", "ram,redis", "--log-level", "WARNING"],
                stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(proc)
            self._stack.callback(stop, proc)
            self.addresses.append(f"{HOST}:{port}")
        for proc, address in zip(self.procs, self.addresses):
            with Client(address, timeout_s=2) as probe:
                wait_until(lambda probe=probe: probe.health() == "SERVING",  # type: ignore[misc]
                           f"kdn node {address}", proc, 60)
        return self

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(fleet: Fleet, trace: list[Request], *, engines: int = 3, kill_at: float = 0.5,
           health_interval_s: float = 0.5) -> dict[str, Any]:
    """Replay ``trace`` through ``engines`` threads, each with its FleetClient; kill a node
    at ``kill_at`` of the requests (module docstring)."""
    config = FleetConfig(nodes=tuple(fleet.addresses), health_interval_s=health_interval_s,
                         timeout_s=10.0, client_options={"shm_bytes": 0})
    clients = [FleetClient(config) for _ in range(engines)]
    lock = threading.Lock()
    done = [0]
    kill_index = int(kill_at * len(trace)) if kill_at else -1
    killed = threading.Event()
    killed_node = [-1]
    first_node: dict[bytes, int] = {}  # key -> the node its first store went to
    after = Counter[str]()  # tier:node of reads of killed-node keys after the kill
    stats = Counter[str]()
    failures: list[str] = []

    def one(fc: FleetClient, req: Request) -> None:
        chain = chain_keys(req.blocks)
        found = fc.lookup(chain, prefix_chain=True)
        hits = found.prefix_hits
        node = fc.affinity.get(fc.router.route_key(chain))
        if hits:
            got = fc.fetch_many(chain[:hits])
            if any(g is None for g in got):
                raise RuntimeError(f"{sum(g is None for g in got)} of {hits} stored blocks "
                                   "could not be read")
        with lock:
            stats["blocks"] += len(chain)
            stats["hit_blocks"] += hits
            stats["ram_hit_blocks"] += sum(i.tier == "ram" for i in found.infos[:hits])
            if killed.is_set():
                for k, info in zip(chain[:hits], found.infos[:hits]):
                    if first_node.get(k) == killed_node[0]:
                        after[f"{info.tier}@node{node}"] += 1
        if hits < len(chain):
            fc.store_many([(k, ENTRY) for k in chain[hits:]], mode="raw")
            node = fc.affinity.get(chain[hits])
            with lock:
                for k in chain[hits:]:
                    first_node.setdefault(k, -1 if node is None else node)

    def engine(e: int) -> None:
        fc = clients[e]
        for i in range(e, len(trace), engines):
            while kill_index >= 0 and i > kill_index and not killed.is_set():
                time.sleep(0.001)  # requests after the kill wait for it
            try:
                one(fc, trace[i])
            except Exception as exc:  # every failure counts; the run goes on
                with lock:
                    failures.append(f"request {i}: {type(exc).__name__}: {exc}")
            with lock:
                done[0] += 1
                if done[0] >= kill_index >= 0 and not killed.is_set():
                    calls = [sum(c.calls[j] for c in clients) for j in range(fleet.n)]
                    killed_node[0] = max(range(fleet.n), key=calls.__getitem__)
                    fleet.kill(killed_node[0])
                    killed.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=engine, args=(e,)) for e in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # every block first stored through the killed node, read back through the fleet now
    lost = [k for k, n in first_node.items() if n == killed_node[0] >= 0]
    lost_read = Counter[str]()
    fc = clients[0]
    for start in range(0, len(lost), 64):
        part = lost[start : start + 64]
        try:
            infos = fc.lookup(part).infos
            got = fc.fetch_many(part)
        except Exception as exc:
            failures.append(f"reading the killed node's keys: {type(exc).__name__}: {exc}")
            continue
        node = fc.affinity.get(part[0])
        for info, g in zip(infos, got):
            lost_read[f"{info.tier or 'absent'}@node{node}" if g is not None else "missing"] += 1
    view = fleet_view(fleet.addresses, timeout_s=2.0)
    routed = [{"node": f"node{j}", "address": a, "calls": sum(c.calls[j] for c in clients)}
              for j, a in enumerate(fleet.addresses)]
    failovers = sum(c.failovers for c in clients)
    # how each engine's client sees the killed node: a failed call or the health checker,
    # whichever comes first, marks it down (given ten health intervals, at least 2 s)
    killed_live: list[bool] = []
    if killed_node[0] >= 0:
        until = time.monotonic() + max(2.0, 10 * health_interval_s)
        while any(c.router.live[killed_node[0]] for c in clients) and time.monotonic() < until:
            time.sleep(0.02)
        killed_live = [bool(c.router.live[killed_node[0]]) for c in clients]
    for c in clients:
        c.close()
    return {
        "requests": len(trace), "engines": engines, "nodes": fleet.n,
        "redis_cluster": f"{len(fleet.cluster.nodes)} masters, "
                         f"{len(fleet.cluster.replicas)} replicas",
        "failed_requests": len(failures), "failures": failures[:10],
        "killed_node": f"node{killed_node[0]}" if killed_node[0] >= 0 else None,
        "kill_after_requests": kill_index,
        "failovers": failovers,
        "killed_node_live_in_clients": killed_live,
        "killed_keys_hit_after": sum(after.values()),
        "killed_keys_hit_from": dict(sorted(after.items())),
        "killed_keys": len(lost),
        "killed_keys_read_back_from": dict(sorted(lost_read.items())),
        "hit_ratio": stats["hit_blocks"] / max(1, stats["blocks"]),
        "ram_hit_ratio": stats["ram_hit_blocks"] / max(1, stats["blocks"]),
        "routed": routed, "fleet_view": view, "wall_s": round(wall, 2),
    }
