"""Idle connections without a key against a legitimate client (issue 24's limits target).

A `kdn serve` process with its default connection settings except a short idle timeout
(`--idle-timeout-s`, default 5 s here; 300 s by default). Rows: a legitimate client's Lookup
and 1 MiB Retrieve latency (p50, p99 over `--calls` calls) alone, then while `--idle` HTTP/2
connections that never send a call (nor a key) are held open; then how many of those the
server closed within the idle timeout plus 2 s. Target: p99 no more than 20% above alone.

    python -m bench.security [--idle 1000] [--calls 400] [--quick]
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    HOST,
    arg_parser,
    free_port,
    median,
    percentile,
    port_open,
    print_table,
    process,
    wait_until,
    write_json,
)
from kdn import keys
from kdn.client import Client
from tests.helpers import random_kv, uniform_layout

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + SETTINGS


def _latencies(client: Client, key: bytes, calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"lookup": [], "retrieve_1mib": []}
    for _ in range(calls):
        t = time.perf_counter()
        client.lookup([key])
        out["lookup"].append(time.perf_counter() - t)
        t = time.perf_counter()
        client.fetch(key)
        out["retrieve_1mib"].append(time.perf_counter() - t)
    return out


def _closed(socks: list[socket.socket]) -> int:
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while True:
                if not s.recv(65536):
                    n += 1
                    break
        except (BlockingIOError, ConnectionResetError) as exc:
            n += isinstance(exc, ConnectionResetError)
    return n


def main() -> None:
    ap = arg_parser(__doc__, "security", "100 idle connections, 100 calls")
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--idle-timeout-s", type=float, default=5.0)
    args = ap.parse_args()
    idle, calls = (100, 100) if args.quick else (args.idle, args.calls)
    lay = uniform_layout(layers=4, heads=8, dim=64)
    kv = random_kv(lay, 256)  # 1 MiB of fp16 KV
    key = keys.chunk_key(list(range(8)), lay)
    port = free_port()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).with_name("kdn")), "serve", "--port", str(port),
               "--data-dir", tmp, "--idle-timeout-s", str(args.idle_timeout_s)]
        with process(cmd, Path(tmp) / "server.log") as server:
            wait_until(lambda: port_open(port), "kdn serve", server)
            with Client(f"{HOST}:{port}", shm_bytes=0) as client:
                client.store(key, kv, mode="raw")
                _latencies(client, key, 20)  # warm
                alone = _latencies(client, key, calls)
                socks = []
                for _ in range(idle):
                    s = socket.create_connection((HOST, port))
                    s.sendall(PREFACE)
                    socks.append(s)
                opened = time.monotonic()
                crowded = _latencies(client, key, calls)
                elapsed = time.monotonic() - opened
                if elapsed < args.idle_timeout_s + 2:
                    time.sleep(args.idle_timeout_s + 2 - elapsed)
                closed = _closed(socks)
                after = _latencies(client, key, 20)
                for s in socks:
                    s.close()
    for what in ("lookup", "retrieve_1mib"):
        p99_alone = percentile(alone[what], 99)
        for case, xs in (("alone", alone[what]), (f"{idle} idle connections", crowded[what])):
            p99 = percentile(xs, 99)
            rows.append({"call": what, "case": case, "p50_ms": median(xs) * 1e3,
                         "p99_ms": p99 * 1e3, "p99_vs_alone": p99 / p99_alone})
    print_table(rows, ["call", "case", "p50_ms", "p99_ms", "p99_vs_alone"])
    worst = max(r["p99_vs_alone"] for r in rows)
    print(f"idle connections closed by the server within {args.idle_timeout_s + 2:.0f} s: "
          f"{closed} of {idle}; calls after: {len(after['lookup'])} ok")
    write_json(args.out, "security", rows, idle_connections=idle, calls=calls,
               idle_timeout_s=args.idle_timeout_s, idle_closed=closed,
               target={"p99_vs_alone_max": 1.2, "met": worst <= 1.2 and closed == idle,
                       "worst_p99_vs_alone": worst})


if __name__ == "__main__":
    main()
