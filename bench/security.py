"""Idle connections without a key against a legitimate client (target: the client's p99 within
1.2x of the same calls alone).

A `kdn serve` process with auth on (a tenants file) and its default connection settings except
a shorter idle timeout (`--idle-timeout-s`, 10 s here; 300 s by default), in three modes:
plaintext, TLS (a certificate made here), and `fastpath`: a client on the server's host
(shared segment, fast path) while the idle connections go to the fast path's unix socket,
found as any local process finds it (`/proc/net/unix`), where they never name a segment (the
server keeps 64 such at once, closing the oldest, and the rest at `handshake_timeout_s`).
Per round: a legitimate client (with its key) makes `--calls` Lookups and 1 MiB Retrieves
alone; then `--idle` connections are opened that never make a call nor send a key (plaintext:
the HTTP/2 preface; TLS: a full handshake and the preface; fastpath: nothing) and the client
makes the same calls while they are all open (checked right after);
then the bench waits for the server to close them and notes how long that took. Samples of
`--rounds` rounds are pooled (alone and crowded alternate, so drift hits both alike). In TLS
mode, `--idle` more connections that never even start their handshake are opened last; the
handshake timeout (10 s) should close them.

Target: the client's p99 with the idle connections open is no more than 20% above alone, and
the server closes every idle connection by the idle timeout.

    python -m bench.security [--idle 1000] [--calls 500] [--rounds 3] [--quick]
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
from kdn.client.client import TLSOptions
from tests.helpers import make_certs, random_kv, uniform_layout

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + SETTINGS
HANDSHAKE_TIMEOUT_S = 10.0  # the server's default (handshake_timeout_s)


def _latencies(client: Client, key: bytes, calls: int, out: dict[str, list[float]]) -> None:
    for _ in range(calls):
        t = time.perf_counter()
        client.lookup([key])
        out["lookup"].append(time.perf_counter() - t)
        t = time.perf_counter()
        client.fetch(key)
        out["retrieve_1mib"].append(time.perf_counter() - t)


def _is_closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True


def _open(port: int, n: int, tls: ssl.SSLContext | None) -> list[socket.socket]:
    """``n`` connections that reach HTTP/2 (and TLS) and then say nothing more."""
    out = []
    for _ in range(n):
        s = socket.create_connection((HOST, port))
        if tls is not None:
            s = tls.wrap_socket(s, server_hostname="localhost")
        s.sendall(PREFACE)
        out.append(s)
    return out


def _fast_path_name(pid: int) -> str:
    """The abstract unix socket the server ``pid`` listens on (its fast path), as a local
    process finds it: the server's socket inodes among ``/proc/net/unix``'s listeners."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if len(cols) >= 8 and cols[6] in inodes and cols[7].startswith("@kdn-fast-"):
                return cols[7][1:]
    raise RuntimeError(f"no fast path socket of process {pid}")


def _open_unix(name: str, n: int) -> list[socket.socket]:
    """``n`` connections to the unix socket ``name`` that never say a word."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + name)
        out.append(s)
    return out


def _wait_closed(socks: list[socket.socket], deadline_s: float) -> tuple[int, float]:
    """How many of ``socks`` the server closed within ``deadline_s``, and when the last went."""
    t0, open_ = time.monotonic(), set(range(len(socks)))
    last = 0.0
    while open_ and time.monotonic() - t0 < deadline_s:
        for i in list(open_):
            if _is_closed(socks[i]):
                open_.discard(i)
                last = time.monotonic() - t0
        time.sleep(0.1)
    for s in socks:
        s.close()
    return len(socks) - len(open_), last


MODES = ("plaintext", "tls", "fastpath")


def run_mode(mode: str, idle: int, calls: int, rounds: int, idle_timeout_s: float
             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lay = uniform_layout(layers=4, heads=8, dim=64)
    kv = random_kv(lay, 256)  # 1 MiB of fp16 KV
    key = keys.chunk_key(list(range(8)), lay)
    port = free_port()
    alone: dict[str, list[float]] = {"lookup": [], "retrieve_1mib": []}
    crowded: dict[str, list[float]] = {"lookup": [], "retrieve_1mib": []}
    facts: dict[str, Any] = {"idle_opened": 0, "idle_open_while_measured": 0, "idle_closed": 0,
                             "close_s_after_opening": [], "open_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        auth = Path(tmp) / "tenants.yaml"
        auth.write_text('tenants:\n  bench: {api_keys: ["bench-key"]}\n')
        auth.chmod(0o600)
        cmd = [str(Path(sys.executable).with_name("kdn")), "serve", "--port", str(port),
               "--data-dir", str(Path(tmp) / "d"), "--idle-timeout-s", str(idle_timeout_s),
               "--auth-file", str(auth)]
        tls_opts, ctx = None, None
        if mode == "tls":
            certs = make_certs(Path(tmp))
            cmd += ["--tls-cert", str(certs["server.crt"]), "--tls-key", str(certs["server.key"])]
            tls_opts = TLSOptions(ca=certs["ca.crt"].read_bytes())
            ctx = ssl.create_default_context(cafile=str(certs["ca.crt"]))
            ctx.set_alpn_protocols(["h2"])
        with process(cmd, Path(tmp) / "server.log") as server:
            wait_until(lambda: port_open(port), "kdn serve", server)
            fast = mode == "fastpath"
            with Client(f"{HOST}:{port}", api_key="bench-key", tls=tls_opts,
                        shm_bytes=None if fast else 0) as client:
                client.store(key, kv, mode="raw")
                name = _fast_path_name(server.pid) if fast else ""
                _latencies(client, key, 20, {"lookup": [], "retrieve_1mib": []})  # warm
                for _ in range(rounds):
                    _latencies(client, key, calls, alone)
                    t0 = time.monotonic()
                    socks = _open_unix(name, idle) if fast else _open(port, idle, ctx)
                    opened = time.monotonic()
                    facts["open_s"].append(opened - t0)
                    _latencies(client, key, calls, crowded)
                    measured = time.monotonic() - opened
                    still = sum(not _is_closed(s) for s in socks)
                    facts["idle_opened"] += idle
                    facts["idle_open_while_measured"] += still
                    if measured > idle_timeout_s:
                        print(f"warning: measuring took {measured:.1f} s, past the idle "
                              "timeout; raise --idle-timeout-s", file=sys.stderr)
                    closed, last = _wait_closed(socks, idle_timeout_s + 10)
                    facts["idle_closed"] += closed
                    facts["close_s_after_opening"].append(round(last + measured, 2))
                if ctx is not None:  # connections that never start their handshake
                    silent = [socket.create_connection((HOST, port)) for _ in range(idle)]
                    closed, last = _wait_closed(silent, HANDSHAKE_TIMEOUT_S + 10)
                    facts["silent_opened"], facts["silent_closed"] = idle, closed
                    facts["silent_close_s"] = round(last, 2)
                after: dict[str, list[float]] = {"lookup": [], "retrieve_1mib": []}
                _latencies(client, key, 20, after)  # the server still answers
    rows = []
    for what in ("lookup", "retrieve_1mib"):
        p99_alone = percentile(alone[what], 99)
        for case, xs in (("alone", alone[what]), (f"{idle} idle connections", crowded[what])):
            p99 = percentile(xs, 99)
            rows.append({"mode": mode, "call": what, "case": case, "calls": len(xs),
                         "p50_ms": median(xs) * 1e3, "p99_ms": p99 * 1e3,
                         "p99_vs_alone": p99 / p99_alone,
                         "p50_vs_alone": median(xs) / median(alone[what])})
    return rows, facts


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "security", "100 idle connections, 100 calls, 1 round")
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-timeout-s", type=float, default=10.0)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or (unknown := [m for m in modes if m not in MODES]):
        ap.error(f"--modes: {'unknown ' + ', '.join(unknown) if modes else 'none given'} "
                 f"(known: {', '.join(MODES)})")
    idle, calls, rounds = (100, 100, 1) if args.quick else (args.idle, args.calls, args.rounds)
    rows, facts = [], {}
    load = os.getloadavg()  # the machine may be shared: a busy one widens p99 both ways
    for mode in modes:
        got, facts[mode] = run_mode(mode, idle, calls, rounds, args.idle_timeout_s)
        rows += got
        f = facts[mode]
        print(f"{mode}: {f['idle_open_while_measured']} of {f['idle_opened']} idle connections "
              f"open while measured; closed by the server: {f['idle_closed']} (the last "
              f"{max(f['close_s_after_opening'])} s after opening; idle timeout "
              f"{args.idle_timeout_s:g} s)" + (
                  f"; never-handshaken closed: {f['silent_closed']} of {f['silent_opened']} "
                  f"within {f['silent_close_s']} s" if "silent_opened" in f else ""))
    print_table(rows, ["mode", "call", "case", "calls", "p50_ms", "p99_ms", "p99_vs_alone",
                       "p50_vs_alone"])
    worst = max(r["p99_vs_alone"] for r in rows)
    all_closed = all(f["idle_closed"] == f["idle_opened"]
                     and (m == "fastpath" or f["idle_open_while_measured"] == f["idle_opened"])
                     and f.get("silent_closed") == f.get("silent_opened")
                     for m, f in facts.items())  # (the fast path keeps 64 pending at most)
    write_json(args.out, "security", rows, idle_connections=idle, calls=calls, rounds=rounds,
               idle_timeout_s=args.idle_timeout_s, connections=facts,
               load_average=[round(x, 2) for x in (*load, *os.getloadavg())],
               target={"p99_vs_alone_max": 1.2, "met": worst <= 1.2 and all_closed,
                       "worst_p99_vs_alone": worst, "all_idle_closed": all_closed})


if __name__ == "__main__":
    main()
