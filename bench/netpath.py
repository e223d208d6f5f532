"""The network data path on a whole context, next to a bare socket moving the same bytes.

    python -m bench.netpath [--quick] [--tokens 8192] [--connections 1,2,4] [--label L]

A remote client (no shared segment: ``Client(shm_bytes=0)``) reads a Llama-3-8B-shaped
context (32 layers, 8 KV heads x 128, fp16, ``raw``; blocks of 256 tokens, 32 MiB each, as
``KDNEngine`` stores them: 8k tokens = 1 GiB) from a ``kdn serve`` process (RAM tier) over
loopback, striped over ``--connections`` connections (``Client(data_connections=N)``). Rows:

    raw-tcp-N     the baseline: a bare TCP service (``bench.baselines.RawTcp``, a process of
                  its own) sending the context's bytes as N equal parts, each ``recv_into`` a
                  kept buffer on its own connection (``sendall``/``recv_into``, nothing
                  checked)
    fetch-N       ``Client.fetch_many`` of every block: the entries in one GetMany striped
                  over N connections, each frame checked as it lands
    load-N        ``Client.retrieve_streams`` (what ``KDNEngine.start_load`` calls) then every
                  layer of every block waited for, on ``--device`` (default cpu):
                  ``host_start_s`` is the time ``retrieve_streams`` took to return (the host
                  time before the first copy can start), ``seconds`` until every layer is in

``ratio_to_raw_tcp``: GB/s against ``raw-tcp-1`` of the same run (the one-connection socket
loop). Timings are medians of ``--repeat`` runs taken in turns. ``--label`` names the run;
the kdn under test is whatever ``kdn`` imports (run with another tree on ``PYTHONPATH`` to
measure it: a kdn without ``data_connections`` runs the 1-connection rows only).
"""

from __future__ import annotations

import hashlib
import inspect
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.baselines import RawTcp, raw_service
from bench.common import arg_parser, kdn_server, median, print_table, write_json
from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import KVLayout, LayerLayout
from kdn.transport.wire import recv_into_all

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 256


def layout() -> KVLayout:
    return KVLayout("llama3-8b-shape", tuple(LayerLayout(HEADS, DIM, DIM) for _ in range(LAYERS)),
                    head_dim=DIM, model_name="Llama-3-8B shape")


def block(lay: KVLayout, j: int) -> codec.EncodedParts:
    g = torch.Generator().manual_seed(j)
    # k, v: [kv_heads, tokens, dim] fp16
    layers = [(torch.randn(HEADS, BLOCK, DIM, generator=g).half(),
               torch.randn(HEADS, BLOCK, DIM, generator=g).half()) for _ in range(LAYERS)]
    return codec.encode_parts(KVCache(lay, layers, j * BLOCK), "raw", wire=True)


def raw_get(port: int, nbytes: int, n: int) -> Callable[[], None]:
    """A read of ``nbytes`` as ``n`` equal parts side by side, one connection each (the
    service keeps the last put of each size: one put of each part's size first)."""
    part = nbytes // n
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    bufs = [memoryview(np.empty(part, np.uint8)) for _ in range(n)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conns[0].sendall(RawTcp.HEAD.pack(1, part))
    conns[0].sendall(bufs[0])
    assert conns[0].recv(1) == b"k"

    def one(c: socket.socket, buf: memoryview) -> None:
        c.sendall(RawTcp.HEAD.pack(2, part))
        assert recv_into_all(c, buf)

    def get() -> None:
        threads = [threading.Thread(target=one, args=(c, b)) for c, b in zip(conns[1:], bufs[1:])]
        for t in threads:
            t.start()
        one(conns[0], bufs[0])
        for t in threads:
            t.join()

    return get


def run(tokens: int, connections: list[int], repeat: int, device: str, label: str,
        out: Path) -> list[dict[str, Any]]:
    lay = layout()
    n_blocks = tokens // BLOCK
    striped = "data_connections" in inspect.signature(Client).parameters
    if not striped:
        connections = [1]
    ops: list[tuple[str, int, Callable[[], Any]]] = []
    host: dict[int, list[float]] = {}
    clients: list[Client] = []
    with tempfile.TemporaryDirectory() as tmp, raw_service("process") as (_, tcp_port), \
            kdn_server(Path(tmp), "--ram-bytes", str(3 * tokens * lay.bytes_per_token),
                       "--max-entry-bytes", str(1 << 30)) as address:
        writer = Client(address, shm_bytes=0, timeout_s=300)
        keys = [hashlib.sha256(b"ctx-block-%d" % j).digest() for j in range(n_blocks)]
        nbytes = 0
        for j, k in enumerate(keys):
            parts = block(lay, j)
            writer.store(k, parts)
            nbytes += parts.nbytes
        for n in connections:
            ops.append((f"raw-tcp-{n}", n, raw_get(tcp_port, nbytes, n)))
        for n in connections:
            c = Client(address, shm_bytes=0, timeout_s=300,
                       **({"data_connections": n} if striped else {}))
            clients.append(c)
            ops.append((f"fetch-{n}", n, lambda c=c: c.fetch_many(keys)))
            host[n] = []

            def load(c: Client = c, n: int = n) -> None:
                t0 = time.perf_counter()
                streams = c.retrieve_streams(keys, layout=lay, device=device)
                host[n].append(time.perf_counter() - t0)
                for i in range(LAYERS):
                    for s in streams:
                        assert s is not None
                        s.wait_for_layer(i)
                for s in streams:
                    s.cancel()

            ops.append((f"load-{n}", n, load))
        for _, _, fn in ops:  # untimed round: connections opened, buffers faulted in
            fn()
        for n in host:
            host[n].clear()
        times: dict[str, list[float]] = {name: [] for name, _, _ in ops}
        for _ in range(repeat):
            for name, _, fn in ops:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        for c in [writer, *clients]:
            c.close()
    base = nbytes / median(times["raw-tcp-1"]) / 1e9
    rows = []
    for name, n, _ in ops:
        s = median(times[name])
        row: dict[str, Any] = {"run": label, "path": name, "connections": n, "tokens": tokens,
                               "bytes": nbytes, "seconds": s, "gb_s": nbytes / s / 1e9,
                               "ratio_to_raw_tcp": nbytes / s / 1e9 / base}
        if name.startswith("load-"):
            row["host_start_s"] = median(host[n])
            row["device"] = device
        rows.append(row)
    print_table(rows, ["run", "path", "tokens", "gb_s", "ratio_to_raw_tcp", "seconds",
                       "host_start_s"])
    write_json(out, "netpath", rows, label=label, repeat=repeat, blocks=n_blocks,
               layout="32 layers x 8 kv heads x 128, fp16, raw, 256-token blocks")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "netpath", "2k tokens, 1 and 2 connections, 2 runs")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--connections", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--label", default="")
    ns = ap.parse_args(argv)
    conns = [int(x) for x in ns.connections.split(",")]
    if ns.quick:
        ns.tokens, conns, ns.repeat = 2048, [1, 2], 2
    run(ns.tokens, conns, ns.repeat, ns.device, ns.label, ns.out)


if __name__ == "__main__":
    main()
