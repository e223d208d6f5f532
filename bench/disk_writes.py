"""Many small write-through stores against a server with a disk tier, next to one without.

    python -m bench.disk_writes [--quick] [--entries 4000] [--clients 1,4,8] [--label L]

A ``kdn serve`` process (RAM tier and the LMDB disk tier on a folder under the system's
temporary directory, write-through: a store is answered once the disk tier committed it)
takes ``--entries`` distinct entries of 1-4 KiB (a tiny raw KV cache, encoded once before the
clock starts) from ``--clients`` threads, each with its own ``Client``, each storing its share
one ``Client.store`` at a time. Rows, for each path and each number of clients:

    ram       the baseline: the same stores to a server with no disk tier (``--disk-bytes 0``)
    disk      the same stores to a server with the disk tier

on two paths: ``grpc`` (``Client(shm_bytes=0, data_path=False)``: every store one gRPC call)
and ``samehost`` (``Client()`` on the server's host: its shared segment). ``ratio_to_ram``:
entries/s against the ``ram`` row of the same path and clients, in the same run; ``commits``:
the write transactions the disk tier committed (LMDB's last transaction id, read once the
server stopped), each one flushed to the disk, and ``per_commit`` the entries each held on
average. ``--label`` names the run (``before``/``after`` a change: the kdn under test is
whatever ``kdn`` imports).
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import torch

from bench.common import arg_parser, kdn_server, number_list, print_table, write_json
from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import KVLayout, LayerLayout

LAYERS, HEADS, DIM = 4, 2, 16  # 512 bytes a token in fp16: 2-8 tokens are 1-4 KiB
PATHS = {"grpc": {"shm_bytes": 0, "data_path": False}, "samehost": {}}


def entries(n: int) -> list[tuple[bytes, codec.EncodedParts]]:
    """``n`` distinct entries of 2 to 8 tokens, encoded ``raw`` as a client sends them."""
    lay = KVLayout("tiny", tuple(LayerLayout(HEADS, DIM, DIM) for _ in range(LAYERS)),
                   head_dim=DIM, model_name="tiny")
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = 2 + i % 7
        # k, v: [kv_heads, tokens, dim] fp16
        layers = [(torch.randn(HEADS, tokens, DIM, generator=g).half(),
                   torch.randn(HEADS, tokens, DIM, generator=g).half()) for _ in range(LAYERS)]
        key = hashlib.sha256(b"disk-writes-%d" % i).digest()
        out.append((key, codec.encode_parts(KVCache(lay, layers, 0), "raw", wire=True)))
    return out


def store_all(address: str, items: list[tuple[bytes, codec.EncodedParts]], clients: int,
              path: dict[str, Any]) -> float:
    """Seconds for ``clients`` threads, a Client each, to store ``items`` (its share each)."""
    conns = [Client(address, timeout_s=120, **path) for _ in range(clients)]
    try:
        for c in conns:  # untimed: connections (and segments) set up
            c.health()
        start = threading.Barrier(clients + 1)
        errors: list[BaseException] = []

        def work(c: Client, share: list[tuple[bytes, codec.EncodedParts]]) -> None:
            start.wait()
            try:
                for key, parts in share:
                    c.store(key, parts)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(c, items[i::clients]))
                   for i, c in enumerate(conns)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return seconds
    finally:
        for c in conns:
            c.close()


def commits(data_dir: Path) -> int:
    """Write transactions committed in the disk tier under ``data_dir`` (its server stopped)."""
    env = lmdb.open(str(data_dir / "lmdb"), readonly=True, lock=False, max_dbs=4)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


def run(n: int, clients: list[int], label: str, out: Path) -> list[dict[str, Any]]:
    items = entries(n)
    nbytes = sum(p.nbytes for _, p in items)
    rows: list[dict[str, Any]] = []
    for tier, flags in (("ram", ()), ("disk", ("--disk-bytes", "1GiB"))):
        for name, path in PATHS.items():
            for k in clients:  # a fresh server (and disk folder) for each row
                with tempfile.TemporaryDirectory() as tmp:
                    with kdn_server(Path(tmp) / "data", "--ram-bytes", "1GiB",
                                    "--write-policy", "write-through", *flags) as address:
                        seconds = store_all(address, items, k, path)
                    done = commits(Path(tmp) / "data") if tier == "disk" else 0
                rows.append({"path": name, "clients": k, "tier": tier, "entries": n,
                             "seconds": seconds, "entries_per_s": n / seconds,
                             "mb_s": nbytes / seconds / 1e6, "commits": done,
                             "per_commit": n / done if done else 0.0})
                print(f"  {name} {tier} x{k}: {n / seconds:.0f} entries/s", flush=True)
    ram = {(r["path"], r["clients"]): r["entries_per_s"] for r in rows if r["tier"] == "ram"}
    for r in rows:
        r["ratio_to_ram"] = r["entries_per_s"] / ram[(r["path"], r["clients"])]
    rows.sort(key=lambda r: (r["path"], r["clients"], r["tier"] != "ram"))
    print_table(rows, ["path", "clients", "tier", "entries", "seconds", "entries_per_s",
                       "mb_s", "ratio_to_ram", "commits", "per_commit"])
    write_json(out, "disk_writes", rows, label=label, entry_bytes=[min(
        p.nbytes for _, p in items), max(p.nbytes for _, p in items)])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "disk_writes", "1,000 entries, 1 and 4 clients")
    ap.add_argument("--entries", type=int, default=4000, help="entries stored in each row")
    ap.add_argument("--clients", type=number_list(int), default=[],
                    help="comma-separated numbers of client threads (default 1,4,8)")
    ap.add_argument("--label", default="", help="the run's name in its JSON")
    ns = ap.parse_args(argv)
    if ns.entries < 1:
        ap.error(f"--entries must be >= 1, got {ns.entries}")
    clients = ns.clients or ([1, 4] if ns.quick else [1, 4, 8])
    run(1000 if ns.quick else ns.entries, clients, ns.label, ns.out)


if __name__ == "__main__":
    main()
