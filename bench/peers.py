"""kdn next to its peers: LMCache's standalone server and Mooncake Store, same workloads, one run.

    python -m bench.peers [--quick] [--out bench/results/peers.json]
        [--peer-lib-path DIR[:DIR...]]             # libibverbs & co. for Mooncake (see below)
        [--kdn-client-opts "shm_bytes=0"] [--kdn-client-opts ""]   # one kdn column per flag
        [--kdn-server-args ""] [--kdn-server-args "--prefault-bytes 0"]  # one kdn server each
        [--fill-gib 1.5]                           # 0: the old best case (reused memory)
        [--systems lmcache,mooncake,kdn]

Not part of CI and not imported by tests: a program a person runs on one machine. Every system
runs on 127.0.0.1 with RAM only, as its own server process(es) next to this driving process,
which holds each system's client; the systems take turns within each run (the order rotates per
run) so that all of them see the same machine. Workloads (Llama-3-8B-shaped fp16 KV, random:
32 layers x 8 KV heads x 128 channels, 128 KiB per token):

- put / get of one entry at 1, 16 and 256 MiB (``count`` distinct keys per run, one call each;
  GB/s = bytes / summed call time, checks and releases between calls untimed);
- 64 x 1 MiB batch put / batch get (each system's batch call where it has one, else a loop),
  ``BATCH_CALLS`` (3) puts, each read back, per run (GB/s = their bytes / their summed time:
  one ~20 ms call alone says more about the machine's moment than about the system);
- 4 KiB get latency (one layer, one token) of 500 distinct keys, stored first, then each read
  once in a random order.

As a cache that fills sees them: every put (of every route, run and workload) goes to a key
no put used before, and what a system stored is kept until the next run would take it past
``--fill-gib`` (default ``FILL_GIB``: a quarter of kdn's RAM tier), only then deleted
(untimed); so puts land in memory no entry used before, as in a cache filling up. LMCache's
server has no delete: it keeps everything. ``--fill-gib 0`` is the old best case (every
route's entries deleted after its run: later puts land in memory earlier ones freed).

Each row is the best of 3 runs (``gb_s``) with the median (``median_gb_s``) and every run's
figure (``runs``); ``p50_ms``/``p99_ms`` are per-call latencies over all runs. ``memcpy`` rows
(one single-threaded copy of the same bytes, ``np.copyto``) are the machine's limit for one
copy.

How each system is driven:

- **LMCache 0.5.6**: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` and its remote
  connector (``LMCServerConnector``, the ``lm://`` backend) with its own ``LocalCPUBackend``
  allocating the received objects. Its put only sends, so a put run ends with one ``exists``
  round trip (the server handles a connection's commands in order). It has no batch call
  (``support_batched_put/get`` are False): batches are a loop, as its storage manager does.
- **Mooncake Store 0.3.13** (TCP): ``mooncake_master`` + a storage process
  (``mooncake_client``, 3 GB segment) and ``MooncakeDistributedStore`` here with no segment of
  its own, so bytes cross to the storage process. Two APIs: ``put``/``get`` (bytes) and
  ``put_from``/``get_into`` with registered buffers; batches ``put_batch``/``get_batch`` and
  ``batch_put_from``/``batch_get_into``. Its transfer listeners bind every interface on random
  ports (not configurable); every peer address used here is 127.0.0.1.
- **kdn**: ``python -m kdn serve`` (RAM tier only; one server per ``--kdn-server-args``) and
  ``kdn.client.Client``: ``store(KVCache)`` / ``store_many(KVCache)`` (the documented API:
  a user's tensors, encoded ``raw`` by the call) beside ``encode_parts+store`` /
  ``encode_parts+store_many`` (encode, then store the parts: what ``store(KVCache)`` did
  before it wrote into the segment), and with pre-encoded
  ``raw`` parts: ``store``, ``fetch`` (undecoded container; through the shared segment these
  are views of the segment, not yet copied into the caller's memory, unlike the peers' gets)
  and ``retrieve`` (decoded into tensors, the like of LMCache's get and Mooncake's get_into);
  batches through ``store_many``/``fetch_many`` when the client has them, else a loop of single
  calls; and ``store (staged)`` / ``store_many (staged)`` (``Client.stage``: entries filled in
  place in the shared segment once, as Mooncake's registered buffers are, stored by where they
  lie, the server making their checksums on its copy; one staged entry per key up to 128 MiB of
  them, beyond that reused); and ``store_async`` (sent without waiting for the answer, as
  LMCache's put is; a run ends with ``flush``, as LMCache's with its ``exists``), of encoded
  and of staged entries, single and as a loop for the batch. ``--kdn-client-opts``
  (repeatable, ``k=v,k=v``) are ``Client`` keyword arguments, one kdn column per flag (e.g.
  ``shm_bytes=0`` for a remote client: the network data path, or with ``data_path=false`` the
  gRPC stream only; ``""`` for defaults).

Installing the peers (a scratch venv, never the project's .venv; commands used on this machine,
Python 3.11, CPU torch 2.13):

    python3.11 -m venv /work/peers-venv && P=/work/peers-venv/bin/pip
    $P install torch==2.13.0 && $P install -e '.[bench]'    # kdn, its model extra (LMCache
        # imports transformers; kdn reads range-coded entries with constriction), CPU torch
    $P install --no-deps lmcache==0.5.6 mooncake-transfer-engine-non-cuda==0.3.13
    $P install --no-deps cachetools numba llvmlite py-cpuinfo aiohttp aiohappyeyeballs \\
        aiosignal attrs frozenlist multidict propcache yarl msgspec pyzmq blake3 aiofile \\
        aiofiles caio nvtx sortedcontainers requests urllib3 idna charset-normalizer certifi \\
        psutil cryptography cffi pycparser
    $P install --no-deps nvidia-cuda-runtime-cu12   # Mooncake's store.so links libcudart.so.12
    L=/work/peers-libs && mkdir -p $L && cd $L && apt-get update && \\
        apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 && \\
        for f in *.deb; do dpkg -x "$f" root; done       # libibverbs, needed even for TCP
    cd /work/main && /work/peers-venv/bin/python -m bench.peers \\
        --peer-lib-path $L/root/usr/lib/x86_64-linux-gnu:$L/root/lib/x86_64-linux-gnu \\
        --kdn-client-opts shm_bytes=0 --kdn-client-opts ""

``--peer-lib-path`` (and the libcudart folder of nvidia-cuda-runtime-cu12, found by itself)
go onto ``LD_LIBRARY_PATH`` by re-executing this program once. ``LMCACHE_TRACK_USAGE=false``
is set here (LMCache reports usage by default). Run from the repository root, never from
inside LMCache's package folder (its ``logging.py`` shadows the standard library's). A system
that is not installed or does not start is skipped with a line saying why.

This module starts the systems, runs the workloads and reports (table, summary, JSON, PNG);
the workload's shape and the peers are ``bench.peers_systems``, kdn's side
``bench.peers_kdn``, the runs and what they record ``bench.peers_measure``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import arg_parser, figure, print_table, save_figure, write_json
from bench.peers_kdn import SERVER_RAM_GIB, Kdn, kdn_server, parse_opts
from bench.peers_measure import Fill, measure
from bench.peers_systems import MIB, LMCache, Mooncake, System, lmcache_server

FILL_GIB = 1.5
"""GiB each system keeps before its entries are deleted, by default: a quarter of kdn's RAM
tier (half of Mooncake's segment); puts up to there land in memory no entry used before."""
NARROW = {"put": ("store(KVCache)",), "batch_put": ("store_many(KVCache)",),
          "get_4k": ("retrieve",)}
"""Workloads summarised also for one kdn api alone: the stores a user's KVCache takes
(encoding included), the get that hands back tensors."""


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kdn system and workload: its best api next to the best peer's (ratio > 1: kdn ahead;
    for get_4k the ratio is best peer p50 / kdn p50); and for the ``NARROW`` apis alone."""
    out = []
    work = sorted({(r["op"], r["size_mib"]) for r in rows if r["system"] != "memcpy"})
    kdns = sorted({r["system"] for r in rows if r["system"].startswith("kdn")})
    for op, mib in work:
        sel = [r for r in rows if r["op"] == op and r["size_mib"] == mib]
        peers = [r for r in sel if not r["system"].startswith("kdn")]
        for k, only in [(k, only) for k in kdns for only in ("", *NARROW.get(op, ()))]:
            mine = [r for r in sel if r["system"] == k and (not only or r["api"] == only)]
            if not mine or not peers:
                continue
            if op == "get_4k":
                a = min(mine, key=lambda r: r["p50_ms"])
                b = min(peers, key=lambda r: r["p50_ms"])
                ratio = b["p50_ms"] / a["p50_ms"]
                mine_v, peer_v = a["p50_ms"], b["p50_ms"]
            else:
                a = max(mine, key=lambda r: r["gb_s"])
                b = max(peers, key=lambda r: r["gb_s"])
                ratio = a["gb_s"] / b["gb_s"]
                mine_v, peer_v = a["gb_s"], b["gb_s"]
            out.append({"kdn": k, "op": op + (f" [{only}]" if only else ""), "size_mib": mib,
                        "kdn_api": a["api"],
                        "kdn_value": mine_v, "best_peer": f"{b['system']} {b['api']}",
                        "peer_value": peer_v, "kdn_vs_best_peer": ratio})
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (ax, ax2) = figure(13, 5, ncols=2)
    work = [(op, mib) for op in ("put", "get", "batch_put", "batch_get")
            for mib in sorted({r["size_mib"] for r in rows if r["op"] == op})]
    systems = list(dict.fromkeys(r["system"] for r in rows if r["op"] != "copy"))
    width = 0.8 / max(1, len(systems))
    for j, sysname in enumerate(systems):
        best = []
        for op, mib in work:
            sel = [r["gb_s"] for r in rows if r["system"] == sysname and r["op"] == op
                   and r["size_mib"] == mib]
            best.append(max(sel) if sel else 0.0)
        ax.bar([i + j * width for i in range(len(work))], best, width, label=sysname)
    counts = {(r["op"], r["size_mib"]): r["count"] for r in rows}
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(work))],
                  [f"{op}\n{mib:g} MiB" + (f" x{counts[op, mib]}" if op.startswith("batch")
                                           else "") for op, mib in work], fontsize=7)
    ax.set_ylabel("GB/s of fp16 KV (each system's best api)")
    ax.set_title("put / get throughput, loopback, RAM only")
    ax.legend(fontsize=7)
    lat = [r for r in rows if r["op"] == "get_4k"]
    names = [f"{r['system']}\n{r['api']}" for r in lat]
    ax2.bar(range(len(lat)), [r["p50_ms"] for r in lat], 0.4, label="p50")
    ax2.bar([i + 0.4 for i in range(len(lat))], [r["p99_ms"] for r in lat], 0.4, label="p99")
    ax2.set_xticks([i + 0.2 for i in range(len(lat))], names, fontsize=6, rotation=30)
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log scale)")
    ax2.set_title("4 KiB get latency")
    ax2.legend(fontsize=7)
    save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------


def library_path(extra: str) -> str:
    """LD_LIBRARY_PATH with ``extra`` and nvidia-cuda-runtime-cu12's libcudart folder."""
    dirs = [d for d in extra.split(":") if d]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "cuda_runtime" / "lib"
        if lib.is_dir():
            dirs.append(str(lib))
    have = os.environ.get("LD_LIBRARY_PATH", "")
    return ":".join([d for d in dirs if d not in have.split(":")] + ([have] if have else []))


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes of the machine used, those this process and its reaped
    children used) so far: their growth over a run says how much else ran meanwhile."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    t = os.times()
    return ((sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + t.children_user + t.children_system)


def wait_quiet(limit_s: float, cores: float = 0.15, window_s: float = 10.0) -> None:
    """On a shared machine: wait (at most ``limit_s``) for a ``window_s`` in which the rest of
    the machine used under ``cores`` CPUs."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        a = busy_seconds()
        time.sleep(window_s)
        b = busy_seconds()
        used = ((b[0] - a[0]) - (b[1] - a[1])) / window_s
        if used < cores:
            return
        print(f"waiting for a quiet machine: others use {used:.2f} cores", flush=True)
    print(f"no quiet {window_s:.0f} s within {limit_s:.0f} s: measuring anyway", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "peers", "1 and 16 MiB, 16 x 1 MiB batch, 200 gets, 2 runs")
    ap.add_argument("--peer-lib-path", default="",
                    help="folders with libibverbs.so.1 & co. for Mooncake (colon-separated)")
    ap.add_argument("--kdn-client-opts", action="append", default=None,
                    help="Client keyword arguments k=v,k=v; repeat for several kdn columns")
    ap.add_argument("--kdn-server-args", action="append", default=None,
                    help="extra `kdn serve` flags; repeat for one kdn server (and its "
                         "columns) per flag set")
    ap.add_argument("--fill-gib", type=float, default=FILL_GIB,
                    help="GiB each system keeps before its entries are deleted (a cache "
                         "filling up to that share of kdn's RAM tier); 0 = delete after "
                         "every route's run (the old best case, reused memory)")
    ap.add_argument("--kdn-layers-per-frame", type=int, default=0,
                    help="layers per frame of the stored entries "
                         "(0: frames of ~256 KiB, as Client.store makes them)")
    ap.add_argument("--systems", default="lmcache,mooncake,kdn")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for other processes to go quiet")
    args = sys.argv[1:] if argv is None else argv
    ns = ap.parse_args(args)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    lib = library_path(ns.peer_lib_path)
    if lib != os.environ.get("LD_LIBRARY_PATH", "") and "KDN_PEERS_REEXEC" not in os.environ:
        # the dynamic loader reads LD_LIBRARY_PATH at start only: start again with it
        env = {**os.environ, "LD_LIBRARY_PATH": lib, "KDN_PEERS_REEXEC": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "bench.peers", *args], env)
    quick = ns.quick
    sizes = [(MIB, 8), (16 * MIB, 2)] if quick else [(MIB, 64), (16 * MIB, 8), (256 * MIB, 2)]
    batch, gets = (16, 200) if quick else (64, 500)
    runs = ns.runs or (2 if quick else 3)
    wanted = set(ns.systems.split(","))
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    if ns.wait_quiet > 0:
        wait_quiet(ns.wait_quiet)
    busy_before, t_before = busy_seconds(), time.time()
    with tempfile.TemporaryDirectory(prefix="kdn-peers-") as tmpdir, ExitStack() as stack:
        tmp = Path(tmpdir)
        systems: list[System] = []
        starts: list[tuple[str, Callable[[], list[System]]]] = [
            ("lmcache", lambda: [LMCache(lmcache_server(stack, tmp))]),
            ("mooncake", lambda: [Mooncake(stack, tmp)])]
        for name, start in starts:
            if name not in wanted:
                continue
            try:
                for system in start():
                    stack.callback(system.close)
                    systems.append(system)
                    print(f"{system.name}: started", flush=True)
            except Exception as err:
                skipped[name] = f"{type(err).__name__}: {err}".splitlines()[0]
                print(f"-- {name} skipped: {skipped[name]}", flush=True)
        if "kdn" in wanted:
            tag = 0
            for server_args in ns.kdn_server_args or [""]:
                address = stack.enter_context(kdn_server(tmp, shlex.split(server_args)))
                for text in ns.kdn_client_opts or [""]:
                    k = Kdn(address, parse_opts(text), tag, ns.kdn_layers_per_frame,
                            server_args)
                    tag += 1
                    stack.callback(k.close)
                    systems.append(k)
                    print(f"{k.name}: started", flush=True)
        fill = Fill(int(ns.fill_gib * (1 << 30)))
        rows = measure(systems, sizes, batch, gets, runs, failed, fill)
        for name, why in failed.items():
            skipped[name] = f"failed during the run: {why}"
    busy_after = busy_seconds()  # after the servers were stopped and reaped
    others_s = (busy_after[0] - busy_before[0]) - (busy_after[1] - busy_before[1])
    wall_s = time.time() - t_before
    cols = ["system", "api", "op", "size_mib", "count", "gb_s", "median_gb_s", "p50_ms",
            "p99_ms"]
    print_table([{k: ("" if v is None else v) for k, v in r.items()} for r in rows], cols)
    summ = summary(rows)
    if summ:
        print()
        print_table(summ, ["kdn", "op", "size_mib", "kdn_api", "kdn_value", "best_peer",
                           "peer_value", "kdn_vs_best_peer"])
    for name, why in skipped.items():
        print(f"-- {name} skipped: {why}")
    print(f"wall {wall_s:.0f} s; other processes on this machine used {others_s:.0f} CPU-s "
          f"meanwhile ({others_s / wall_s:.2f} cores on average)")
    write_json(ns.out, "peers", rows, runs=runs, summary=summ, skipped=skipped,
               kdn_client_opts=ns.kdn_client_opts or [""],
               kdn_server_args=ns.kdn_server_args or [""], fill_gib=ns.fill_gib,
               kdn_ram_gib=SERVER_RAM_GIB,
               kdn_layers_per_frame=ns.kdn_layers_per_frame,
               wall_s=wall_s, other_processes_cpu_s=others_s,
               payload="Llama-3-8B-shaped fp16 KV (32 layers x 8 KV heads x 128), random; "
                       "4 KiB = one layer, one token",
               note="loopback, RAM only, systems take turns in each run; gb_s best of runs; "
                    "get_4k p50/p99 over all gets; summary ratio > 1 means kdn ahead; kdn fetch "
                    "through the shared segment returns views of the segment (no copy into the "
                    "caller's memory), retrieve decodes into tensors")
    plot(rows, ns.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
