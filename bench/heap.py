"""Do GPU hits stop for Python's garbage collector, and does freezing the heap fix it?

    python -m bench.heap [--quick] [--hits 60] [--long] [--out bench/results/heap.json]

A hit of many compressed blocks decodes them together on the GPU (``kdn.client.landing.
decoded_together``: every block's frames checked, a spec per layer, one ``Mode.decode_layers``
call, each layer's K and V views of its output). That makes thousands of short-lived Python
objects per hit, and every few hits they set off a collection of the collector's oldest
generation, which scans everything the process holds: torch, transformers, the model, kdn.

Measured in one process, the heap of an engine's (a model of SmolLM2's shape built with
random weights through transformers, and torch, kdn and numba loaded): ``hits`` hits of the
context's blocks, each ``kdn-default`` of Llama-3-8B's KV layout (32 layers, 8 KV heads x 128,
256 tokens a block; 32 blocks = 8,192 tokens, 8 with ``--quick``), laid out in one buffer as
the read arena holds them (checked by the server as they were copied in: the hit computes no
sums, as ``EntryRef.verified`` spares an engine's). On a GPU the kernels run and each hit
ends with its check (one synchronisation); on a CPU they are not launched (``kernels``: "not
run": the host's share of a GPU hit, which is what the collector stops).

Rows, ``heap``: ``as-is`` (the baseline: the process as it is) and ``frozen`` (after
``gc.collect(); gc.freeze()``, what ``KDNEngine`` does before its first request on a GPU:
``EngineConfig.freeze_heap``), one after the other in the same process:
``tracked_objects`` (what a full collection scans), ``frozen_objects`` (what it no longer
scans), ``hit_p50_ms`` / ``hit_p90_ms`` / ``hit_max_ms`` (wall time of a hit),
``full_collections`` (of the oldest generation, during the hits) and their
``full_pause_ms_max`` / ``full_pause_ms_total``. A third row, frozen too, hits the same
context written in entropy format 3 (``table_format``: the count codes inside zstd, what kdn
wrote before format 4, ``kdn.codec.entropy``): the host's share with the tables the planner
decompressed before, in the same run. A fourth (``--long``), frozen, hits a context four
times as long (128 blocks, 32,768 tokens) a third as many times.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from bench.common import arg_parser, machine, percentile, print_table, write_json
from bench.gpu import SHAPES, _decode_together, build
from kdn import codec
from kdn.cache import KVCache
from kdn.codec import gpu_batch
from kdn.layout import KVLayout

BLOCK_TOKENS = 256
COLUMNS = ["heap", "table_format", "tracked_objects", "frozen_objects", "hits", "hit_p50_ms",
           "hit_p90_ms", "hit_max_ms", "full_collections", "full_pause_ms_max",
           "full_pause_ms_total", "kernels"]


def _context(blocks: int, fmt: int = 4) -> tuple[list[memoryview], KVLayout]:
    """``blocks`` ``kdn-default`` entries of Llama-3-8B's KV layout, one after another in one
    buffer (as a read arena holds a context's blocks), in entropy blob format ``fmt``, framed
    as an engine stores them (``Client.store``: frames of about 1 MiB)."""
    from transformers import LlamaConfig

    from kdn.codec import entropy

    layout = KVLayout.from_config(LlamaConfig(**SHAPES["llama3-8b"]), dtype=torch.float16)
    blobs = []
    for b in range(blocks):
        g = torch.Generator().manual_seed(b)
        kv = KVCache(layout, [tuple(torch.randn(lay.kv_heads, BLOCK_TOKENS, ch, generator=g)
                                    .half() for ch in (lay.k_channels, lay.v_channels))
                              for lay in layout.layers])  # type: ignore[misc]
        with entropy.writing_format(fmt):
            blobs.append(codec.encode(kv, "kdn", "default", layers_per_frame=0))  # an engine's
    whole = bytearray(sum(map(len, blobs)))
    views, at = [], 0
    for blob in blobs:
        whole[at : at + len(blob)] = blob
        views.append(memoryview(whole)[at : at + len(blob)])
        at += len(blob)
    return views, layout


def _hit(entries: list[memoryview], device: torch.device) -> None:
    """What a GPU hit does with the context's blocks once their bytes are in host memory: in
    a read arena the server checked their sums as it copied them in, so none is computed."""
    _decode_together(entries, device, pinned=device.type == "cuda", checked=True)


def measure(entries: list[memoryview], device: torch.device, hits: int, heap: str,
            table_format: int = 4) -> dict[str, Any]:
    pauses: list[float] = []
    started: list[float] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    _hit(entries, device)  # warm: compiled planner, pools
    walls = []
    gc.callbacks.append(watch)
    try:
        for _ in range(hits):
            t0 = time.perf_counter()
            _hit(entries, device)
            walls.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(watch)
    row = {"heap": heap, "table_format": table_format,
           "tracked_objects": len(gc.get_objects()),
           "frozen_objects": gc.get_freeze_count(), "hits": hits,
           "hit_p50_ms": 1e3 * percentile(walls, 50), "hit_p90_ms": 1e3 * percentile(walls, 90),
           "hit_max_ms": 1e3 * max(walls), "full_collections": len(pauses),
           "full_pause_ms_max": 1e3 * max(pauses, default=0.0),
           "full_pause_ms_total": 1e3 * sum(pauses),
           "kernels": "run" if device.type == "cuda" else "not run",
           "blocks": len(entries), "tokens": len(entries) * BLOCK_TOKENS}
    print(f"  {heap}, format {table_format}: {row['tracked_objects']} objects tracked; hit p50 "
          f"{row['hit_p50_ms']:.1f} ms, p90 {row['hit_p90_ms']:.1f}, max {row['hit_max_ms']:.1f}; "
          f"{len(pauses)} full collections, longest {row['full_pause_ms_max']:.1f} ms",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "heap", "8 blocks, 12 hits a row")
    ap.add_argument("--hits", type=int, default=0, help="hits per row (default 60; 12 quick)")
    ap.add_argument("--long", action="store_true",
                    help="a fourth row: 4x the blocks (32,768 tokens), a third of the hits")
    ns = ap.parse_args(argv)
    hits = ns.hits or (12 if ns.quick else 60)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build("smollm2-135m", device)  # the heap of an engine's process
    entries, _ = _context(8 if ns.quick else 32)
    launch = gpu_batch._launch  # noqa: SLF001
    if device.type != "cuda":
        gpu_batch._launch = lambda *a, **k: None  # noqa: SLF001  (the host's share only)
    try:
        rows = [measure(entries, device, hits, "as-is")]
        gc.collect()
        gc.freeze()
        rows.append(measure(entries, device, hits, "frozen"))
        before, _ = _context(len(entries), fmt=3)
        rows.append(measure(before, device, hits, "frozen", table_format=3))
        del before
        if ns.long:  # 32,768 tokens: the host's share at 51's longer target
            rows.append(measure(_context(4 * len(entries))[0], device, max(hits // 3, 12),
                                "frozen"))
    finally:
        gc.unfreeze()
        gpu_batch._launch = launch  # noqa: SLF001
    del model
    print_table(rows, COLUMNS)
    write_json(ns.out, "heap", rows, device=torch.cuda.get_device_name(0)
               if device.type == "cuda" else f"cpu ({machine()['cpus']} cores)")


if __name__ == "__main__":
    main()
