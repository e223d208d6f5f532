"""The fleet simulator of ``bench/fleet.py``: a request trace replayed through
``kdn.client.routing`` (the code ``FleetClient`` routes real calls with) over N nodes, each
with an LRU RAM tier of a byte budget, sharing one Redis tier.

    trace = load_trace(Path("../shared/traces/conversation_trace.jsonl"))
    row = simulate(trace, Sim(policy="prefix-affinity", nodes=10, ram_per_node_bytes=...,
                              entry_bytes=...))

Model, per request (``hash_ids``: one id per 512-token block, chained by prefix):

- routing: ``random`` (a uniform live node), ``key-hash`` (every block to the node its own key
  picks by rendezvous: ``Router.owner``; a request fans out), or ``prefix-affinity``
  (``Router.choose`` on the route key of the first ``affinity_blocks`` blocks with the load
  bound, the request's blocks as its amount, and ``Affinity``, as ``FleetClient`` does; load =
  blocks routed, decayed with ``half_life_s`` of trace time: ``LoadMeter``). One router stands
  for every engine's client: real clients each keep their own ``Affinity`` and agree through
  rendezvous;
- lookup: the longest prefix of blocks stored before (the Redis tier holds every block ever
  stored: it is the unbounded cache, so its prefix is the bound). Each block of that prefix is
  a RAM hit when its node's RAM holds it (LRU touch), else a Redis hit, read into that node's
  RAM (its bytes counted in ``moved_bytes``: bytes read from Redis into nodes);
- the rest are misses: prefilled by the engine and stored through to RAM and Redis.

Every block has the same size, ``entry_bytes`` (the trace gives only block ids; a partial last
block counts whole), so an LRU of ``ram_per_node_bytes // entry_bytes`` entries is a byte LRU.

Failure (``fail_at``): at that fraction of the trace the node with the most load dies and its
RAM is lost. The routers do not know: a request sent to it fails over to its next node
(``failovers``), which marks it down, as ``FleetClient`` does. ``failed_requests`` counts the
requests no live node could take. Per window of ``WINDOW`` of the trace the RAM hit ratio is
kept (``windows``), to see how fast the fleet recovers.

Hit ratios are over blocks: ``ram_hit_ratio + redis_hit_ratio + miss_ratio = 1`` and
``ram + redis = bound_hit_ratio``. ``load_max_over_mean``: blocks served per node, max over
mean of the nodes alive at the end.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kdn.client.fleet import FleetConfig
from kdn.client.routing import Affinity, LoadMeter, Router, key_hash

POLICIES = ("random", "key-hash", "prefix-affinity")
WINDOW = 0.025
"""Fraction of the trace per window of the hit-ratio series."""


@dataclass(frozen=True)
class Request:
    t_s: float
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int = 0) -> list[Request]:
    """Requests of a trace file (JSON lines: ``timestamp`` ms, ``hash_ids``; gzip when the name
    ends in .gz), the first ``limit`` (0 = all); a line without them is an error naming it."""
    out = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(Request(float(d["timestamp"]) / 1000.0,
                                   tuple(int(h) for h in d["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace record "
                                 f"(timestamp, hash_ids): {exc}") from None
            if limit and len(out) >= limit:
                break
    return out


def working_set(trace: list[Request]) -> int:
    """Distinct blocks of the trace."""
    return len({b for r in trace for b in r.blocks})


def bound_hit_ratio(trace: list[Request]) -> float:
    """Prefix hit ratio of an unbounded cache."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        p = 0
        while p < len(r.blocks) and r.blocks[p] in seen:
            p += 1
        hits += p
        total += len(r.blocks)
        seen.update(r.blocks)
    return hits / max(1, total)


_FLEET = {f.name: f.default for f in dataclasses.fields(FleetConfig)}
"""``FleetClient``'s routing defaults: the simulation routes as it does unless a row says."""


@dataclass(frozen=True)
class Sim:
    policy: str
    nodes: int
    ram_per_node_bytes: int
    entry_bytes: int
    encoding: str = "raw"
    affinity_blocks: int = _FLEET["affinity_blocks"]
    load_bound: float = _FLEET["load_bound"]
    load_floor: float = _FLEET["load_floor"]
    half_life_s: float = _FLEET["load_half_life_s"]
    fail_at: float = 0.0
    """Fraction of the trace at which a node dies (0 = none)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.nodes < 1 or self.entry_bytes < 1 or self.ram_per_node_bytes < 0:
            raise ValueError("nodes and entry_bytes must be >= 1, ram_per_node_bytes >= 0")
        if not 0 <= self.fail_at < 1:
            raise ValueError(f"fail_at is a fraction of the trace in [0, 1), got {self.fail_at}")


class _Lru:
    """One node's RAM tier: block ids, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()

    def hit(self, b: int) -> bool:
        if b in self.items:
            self.items.move_to_end(b)
            return True
        return False

    def put(self, b: int) -> None:
        if self.capacity <= 0:
            return
        self.items[b] = None
        self.items.move_to_end(b)
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)


def simulate(trace: list[Request], sim: Sim) -> dict[str, Any]:
    """Replay ``trace`` under ``sim``; one report row (module docstring)."""
    t0 = time.perf_counter()
    names = [f"node-{i}" for i in range(sim.nodes)]
    router = Router(names, affinity_blocks=sim.affinity_blocks, load_bound=sim.load_bound,
                    load_floor=sim.load_floor)
    load = LoadMeter(sim.nodes, half_life_s=sim.half_life_s)
    rams = [_Lru(sim.ram_per_node_bytes // sim.entry_bytes) for _ in range(sim.nodes)]
    dead = np.zeros(sim.nodes, dtype=bool)  # the truth; ``router.live`` is what routing knows
    rng = random.Random(sim.seed)
    affinity = Affinity(1 << 22)
    owner_of: dict[int, int] = {}  # key-hash: block -> Router.owner, while membership holds
    hashes: dict[int, int] = {}

    def h(b: int) -> int:
        v = hashes.get(b)
        if v is None:
            v = hashes[b] = key_hash(b.to_bytes(8, "little"))
        return v

    stored: set[int] = set()
    ram_hits = redis_hits = misses = failovers = failed = 0
    fail_index = int(sim.fail_at * len(trace)) if sim.fail_at else -1
    failed_node = -1
    window = max(1, int(WINDOW * len(trace)))
    windows: list[float] = []
    w_ram = w_total = 0

    def first_alive(order: list[int]) -> int:
        """The first node of ``order`` that answers; the dead ones tried are marked down."""
        nonlocal failovers
        for n in order:
            if not dead[n]:
                return n
            failovers += 1
            router.mark(n, live=False)
            affinity.forget_node(n)
        return -1

    for i, req in enumerate(trace):
        if i == fail_index:
            failed_node = int(np.argmax(load.values(req.t_s)))
            dead[failed_node] = True
            rams[failed_node] = _Lru(0)
        blocks = req.blocks
        p = 0
        while p < len(blocks) and blocks[p] in stored:
            p += 1
        if sim.policy == "key-hash":
            owners = []
            for b in blocks:
                n = owner_of.get(b, -1)
                if n < 0:
                    n = owner_of[b] = router.owner(h(b))
                while dead[n]:
                    failovers += 1
                    router.mark(n, live=False)
                    owner_of.clear()  # membership changed: owners are computed again
                    n = owner_of[b] = router.owner(h(b)) if router.live.any() else -1
                    if n < 0:
                        break
                owners.append(n)
            if any(n < 0 for n in owners):
                failed += 1
                continue
            for n in owners:
                load.add(n, 1.0, req.t_s)
        else:
            if sim.policy == "random":
                node = -1
                while node < 0 and router.live.any():
                    pick = rng.choice(router.live_nodes())
                    node = first_alive([pick])
            else:
                route = h(blocks[min(sim.affinity_blocks, len(blocks)) - 1])
                node = first_alive(router.choose(route, load, req.t_s,
                                                 prefer=affinity.get(route),
                                                 amount=float(len(blocks))))
                if node >= 0:
                    affinity.remember([h(b) for b in blocks], node)
            if node < 0:
                failed += 1
                continue
            load.add(node, float(len(blocks)), req.t_s)
            owners = [node] * len(blocks)
        r_hits = 0
        for j, b in enumerate(blocks):
            ram = rams[owners[j]]
            if j < p:
                if ram.hit(b):
                    r_hits += 1
                else:
                    redis_hits += 1
                    ram.put(b)
            else:
                ram.put(b)
                stored.add(b)
        ram_hits += r_hits
        misses += len(blocks) - p
        w_ram += r_hits
        w_total += len(blocks)
        if (i + 1) % window == 0:
            windows.append(w_ram / max(1, w_total))
            w_ram = w_total = 0
    total = ram_hits + redis_hits + misses
    alive = ~dead
    served = load.total[alive]
    row = {k: v for k, v in asdict(sim).items() if k not in ("seed",)}
    row.update(
        ram_hit_ratio=ram_hits / max(1, total),
        redis_hit_ratio=redis_hits / max(1, total),
        miss_ratio=misses / max(1, total),
        bound_hit_ratio=(ram_hits + redis_hits) / max(1, total),
        load_max_over_mean=float(served.max() / served.mean()) if served.mean() else 0.0,
        moved_bytes=redis_hits * sim.entry_bytes,
        failed_requests=failed,
        failovers=failovers,
        requests=len(trace),
        blocks=total,
        replay_s=round(time.perf_counter() - t0, 3),
        windows=[round(w, 4) for w in windows],
    )
    if sim.fail_at:
        row["failed_node"] = names[failed_node]
    return row


def recovery(windows: list[float], baseline: list[float], fail_at: float,
             span: float = 0.10) -> dict[str, Any]:
    """How the RAM hit ratio of a run with a failure compares with the same run without it
    (``baseline``, same windows), over spans of ``span`` of the trace after the failure: the
    first span's ratio to the baseline's, the second's (the fleet is "back" when it is within
    5%: ``recovered``), and the worst single window's."""
    k = int(round(fail_at / WINDOW))
    per = max(1, int(round(span / WINDOW)))

    def ratio(j: int) -> float:
        got, base = windows[k + j * per : k + (j + 1) * per], baseline[k + j * per :
                                                                         k + (j + 1) * per]
        return sum(got) / sum(base) if sum(base) else 1.0

    worst = min((w / b for w, b in zip(windows[k:], baseline[k:]) if b), default=1.0)
    first, second = ratio(0), ratio(1)
    return {"first_span_vs_baseline": round(first, 4),
            "second_span_vs_baseline": round(second, 4),
            "recovered": second >= 0.95,
            "worst_window_vs_baseline": round(worst, 4)}
