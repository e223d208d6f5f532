"""The host's share of a whole-entry GPU decode, measured on any host: what a same-host hit
spends on the CPU before the device has anything to do.

    python -m bench.plan_host [--quick] [--out bench/results/plan_host.json]

A hit of a context on a GPU decodes all its blocks' entries together
(``kdn.client.landing.decoded_together``): the entries' frames are walked for their layer
bodies (``codec.api.entry_bodies``), then the mode's whole-entry decoder
(``Mode.decode_layers``: ``kdn.codec.gpu_batch``) plans on the host what its kernels read
(``kdn``: sections, tables decompressed, checked and counted, per-blob and per-group
descriptors; ``int8``: sections) and queues copies and launches. Those host steps are timed
here on device ``cpu`` with the kernels not launched (``host_only``): their cost does not
depend on the device, and the device's share is ``bench.gpu``'s (a GPU host).

Each row: one context of ``tokens`` in blocks of 256 tokens (the engine's chunk), KV of the
model's real shape (random values: the planner's work follows the layout, not the values),
every entry framed as clients store it (frames of about 1 MiB) and viewed as the read arena
gives it (an array of its own over the arena's one buffer); the best of ``--runs`` (7) of
``bodies_s`` (the walk) and ``plan_s`` (``decode_layers``; the copies to the device are not
made: a GPU's copy engine makes them), ``host_s`` their sum, and ``phases_s`` the steps
(``kdn.codec.gpu_source.SECONDS``). The baseline, measured in the same run: ``memcpy_s``, one
thread copying the stored bytes once (the least host work that touches each byte), and
``ratio_to_memcpy``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from bench.common import arg_parser, machine, print_table, write_json
from kdn import codec
from kdn.cache import KVCache
from kdn.codec import gpu_batch, gpu_source
from kdn.codec.api import entry_bodies
from kdn.codec.format import parse_container
from kdn.codec.modes import get_mode
from kdn.layout import DType, KVLayout, LayerLayout

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (30, 3, 64)}
"""Layers, KV heads, head dim of each model."""
BLOCK_TOKENS = 256
ENCODINGS = (("kdn", "default"), ("int8", ""))


@contextmanager
def host_only() -> Iterator[list[int]]:
    """Whole-entry decodes whose kernels are counted, not launched, and whose pinned bodies
    are taken as on a GPU (``gpu_source.DIRECT``), their copies to the "device" not made (on a
    GPU the copy engine makes them, not the host); all restored after."""
    launches = [0]
    kept = gpu_batch._launch  # noqa: SLF001

    def count(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        launches[0] += all(grid)

    gpu_batch._launch = count  # noqa: SLF001
    copy = gpu_source.queue_copy
    gpu_source.queue_copy = lambda dst, src: None  # a GPU's copy engine's work, not the host's
    direct = "cpu" in gpu_source.DIRECT
    gpu_source.DIRECT.add("cpu")  # pinned bodies taken as a GPU takes them (read in place)
    try:
        yield launches
    finally:
        gpu_batch._launch = kept  # noqa: SLF001
        gpu_source.queue_copy = copy
        if not direct:
            gpu_source.DIRECT.discard("cpu")


def context(shape: str, tokens: int, mode: str, level: str) -> tuple[bytearray, list[int]]:
    """The stored entries of a context's blocks, one after another in one buffer, and each
    one's length."""
    layers, heads, dim = SHAPES[shape]
    lay = KVLayout(shape, tuple(LayerLayout(heads, dim, dim) for _ in range(layers)),
                   head_dim=dim, dtype=DType.FLOAT16)
    gen = torch.Generator().manual_seed(0)
    blobs = []
    for b in range(tokens // BLOCK_TOKENS):
        kv = KVCache(lay, [(torch.randn(heads, BLOCK_TOKENS, dim, generator=gen).half(),
                            torch.randn(heads, BLOCK_TOKENS, dim, generator=gen).half())
                           for _ in range(layers)], b * BLOCK_TOKENS)
        blobs.append(codec.encode(kv, mode, level, layers_per_frame=0))  # as clients store
    return bytearray(b"".join(blobs)), [len(b) for b in blobs]


def measure(shape: str, tokens: int, mode: str, level: str, runs: int) -> dict[str, Any]:
    buf, sizes = context(shape, tokens, mode, level)
    arena = np.frombuffer(buf, np.uint8)
    ends = np.cumsum(sizes)
    # each entry a view of its own array over the one buffer, as the read arena gives them
    entries = [memoryview(arena[e - n : e]) for n, e in zip(sizes, ends.tolist())]
    dec = get_mode(mode)
    device = torch.device("cpu")
    best: dict[str, Any] = {}
    with host_only() as launches:
        for _ in range(runs + 1):  # the first compiles and warms
            before = dict(gpu_source.SECONDS)
            launches[0] = 0
            t0 = time.perf_counter()
            bodies, addresses, specs = [], [], []
            for e in entries:
                c = parse_container(e, verify=False)
                got = entry_bodies(c.header, c.frames, hashed=True)
                bodies += got.bodies
                addresses += got.addresses
                specs += got.specs
            t1 = time.perf_counter()
            dec.decode_layers(bodies, specs, level, device, pinned=True, addresses=addresses)
            t2 = time.perf_counter()
            if not best or t2 - t0 < best["host_s"]:
                best = {"bodies_s": t1 - t0, "plan_s": t2 - t1, "host_s": t2 - t0,
                        "launches": launches[0],
                        "phases_s": {k: v - before.get(k, 0.0)
                                     for k, v in sorted(gpu_source.SECONDS.items())
                                     if v > before.get(k, 0.0)}}
    dst = np.empty_like(arena)
    copies = []
    for _ in range(runs):
        t = time.perf_counter()
        np.copyto(dst, arena)
        copies.append(time.perf_counter() - t)
    memcpy_s = min(copies)
    encoding = f"{mode}-{level}" if level else mode
    row = {"model": shape, "tokens": tokens, "encoding": encoding, "entries": len(sizes),
           "layers": len(specs), "stored_bytes": len(buf), **best, "memcpy_s": memcpy_s,
           "ratio_to_memcpy": best["host_s"] / memcpy_s}
    print(f"  {shape} {tokens} {encoding}: host {best['host_s'] * 1e3:.1f} ms (bodies "
          f"{best['bodies_s'] * 1e3:.1f}, plan {best['plan_s'] * 1e3:.1f}; "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in best["phases_s"].items())
          + f"), memcpy {memcpy_s * 1e3:.1f} ms", flush=True)
    return row


def main() -> None:
    ap = arg_parser(__doc__, "plan_host", "SmolLM2's shape at 2048 tokens, 2 runs")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    cases = ([("smollm2-135m", 2048)] if args.quick else
             [("llama3-8b", 8192), ("llama3-8b", 32768), ("smollm2-135m", 8192)])
    runs = 2 if args.quick else args.runs
    rows = [measure(shape, tokens, mode, level, runs)
            for shape, tokens in cases for mode, level in ENCODINGS]
    print_table(rows, ["model", "tokens", "encoding", "stored_bytes", "bodies_s", "plan_s",
                       "host_s", "memcpy_s", "ratio_to_memcpy", "launches"])
    write_json(args.out, "plan_host", rows, device=f"cpu ({machine()['cpus']} cores)",
               threads=gpu_source.THREADS, block_tokens=BLOCK_TOKENS, runs=runs)


if __name__ == "__main__":
    main()
