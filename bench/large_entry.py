"""One entry sized for a real model, stored and retrieved through a `kdn serve` process.

The default is the Llama-3-8B KV shape (32 layers, 8 KV heads x 128, fp16): 8k tokens is a 1 GiB
`raw` entry, `--tokens 32768` the 4 GiB of a 32k
context. The client stores it over the gRPC Store stream (no shared segment: the remote path)
and reads it back whole (checksums checked, tensors equal); the server runs RAM + LMDB. Rows:
store and retrieve seconds and GB/s, and the server's peak resident memory over the entry size
(a large Store is received into one buffer: no second copy of the entry). The
baseline of the same run is one memcpy of the entry's bytes.

    python -m bench.large_entry [--tokens 8192] [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    HOST,
    arg_parser,
    free_port,
    port_open,
    print_table,
    process,
    wait_until,
    write_json,
)
from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import DType, KVLayout, LayerLayout


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = arg_parser(__doc__, "large_entry", "SmolLM2-sized entry of 2k tokens (CI smoke)")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    layers, heads, dim = (30, 3, 64) if args.quick else (32, 8, 128)
    tokens = 2048 if args.quick else args.tokens
    layout = KVLayout("llama3-8b-shape", tuple(LayerLayout(heads, dim, dim)
                                               for _ in range(layers)),
                      dtype=DType.FLOAT16, head_dim=dim)
    g = torch.Generator().manual_seed(0)
    kv = KVCache(layout, [(torch.randn(heads, tokens, dim, generator=g).half(),
                           torch.randn(heads, tokens, dim, generator=g).half())
                          for _ in range(layers)])
    parts = codec.encode_parts(kv, "raw")
    nbytes = parts.nbytes
    sample = min(nbytes, 1 << 30)  # memcpy GB/s on up to 1 GiB (memory stays for the rest)
    src, dst = torch.ones(sample, dtype=torch.uint8), torch.zeros(sample, dtype=torch.uint8)
    dst.copy_(src)
    started = time.perf_counter()
    dst.copy_(src)
    memcpy_s = (time.perf_counter() - started) * nbytes / sample
    del src, dst
    key = keys.chunk_key(list(range(16)), layout)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).with_name("kdn")), "serve", "--port", str(port),
               "--data-dir", tmp, "--ram-bytes", str(nbytes + (256 << 20)),
               "--disk-bytes", str(2 * nbytes + (1 << 30))]
        with process(cmd, Path(tmp) / "server.log") as server:
            wait_until(lambda: port_open(port), "kdn serve", server)
            base_rss = _rss(server.pid)
            with Client(f"{HOST}:{port}", shm_bytes=0, timeout_s=600) as client:
                started = time.perf_counter()
                client.store(key, parts)
                store_s = time.perf_counter() - started
                started = time.perf_counter()
                got = client.retrieve(key, layout=layout)
                retrieve_s = time.perf_counter() - started
                assert got is not None and got.equal(kv), "the entry came back different"
            peak = _peak_rss(server.pid) - base_rss
    rows = [
        {"path": "memcpy (baseline)", "bytes": nbytes, "seconds": memcpy_s,
         "gb_s": nbytes / memcpy_s / 1e9},
        {"path": "store (gRPC stream)", "bytes": nbytes, "seconds": store_s,
         "gb_s": nbytes / store_s / 1e9},
        {"path": "retrieve (gRPC stream)", "bytes": nbytes, "seconds": retrieve_s,
         "gb_s": nbytes / retrieve_s / 1e9},
    ]
    print_table(rows, ["path", "bytes", "seconds", "gb_s"])
    print(f"server peak RSS above idle: {peak / 2**30:.2f} GiB = {peak / nbytes:.2f}x the entry")
    write_json(args.out, "large_entry", rows, tokens=tokens, layers=layers, kv_heads=heads,
               head_dim=dim, dtype="float16", entry_bytes=nbytes,
               server_peak_rss_over_idle=peak, server_peak_rss_ratio=peak / nbytes,
               quick=args.quick)


if __name__ == "__main__":
    main()
