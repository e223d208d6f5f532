"""vLLM connector: a hit loaded through ``KDNConnector`` into vLLM's paged cache, against kdn's
own engine path, and how long the scheduler's lookup call takes while the server is held.

    python -m bench.vllm_connector [--quick] [--device cpu|cuda] [--tokens N]
        --out bench/results/vllm_connector.json

Load rows: ``--tokens`` tokens of an 8B-shaped KV cache (32 layers, 8 KV heads, head size 128,
fp16) are saved through the connector itself (vLLM's call sequence: a miss, then
``save_kv_layer`` per layer, ``wait_for_save``), into a kdn server on this host (RAM tier, the
shared segment), in chunks of 256 tokens, vLLM blocks of 16. Then, alternately, ``--repeat``
times each:

* ``engine``: kdn's engine path, what ``KDNEngine.start_load`` / ``wait_for_layer`` do: every
  chunk's Retrieve stream, and per layer the chunks' K/V joined into ``[H, T, D]`` tensors;
* ``connector``: the worker connector with the step's metadata bound: ``start_load_kv``,
  ``wait_for_layer_load`` for every layer (each chunk's layer scattered into the paged cache by
  block id, blocks shuffled as in a pool after churn), ``wait_for_save``.

Both end with the device synchronised; ``speed_vs_engine`` is engine seconds / connector
seconds (the target on a GPU host: >= 0.8 at 8k tokens). The paged blocks are compared with the
saved ones bit for bit.

Lookup row: ``get_num_new_matched_tokens`` of ``--lookups`` new requests (2k-token prompts)
while the server's lookups are held (a gate in front of its tier lookup): every call must
answer None ("ask again") without waiting; p50 / p99 / max microseconds.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config infers a platform

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from bench.common import arg_parser, median, percentile, print_table, write_json  # noqa: E402
from kdn.integrations.vllm import KDNConnector, KDNConnectorMetadata  # noqa: E402
from kdn.server import ServerConfig, ServerThread  # noqa: E402
from kdn.server.app import build_store  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def connectors(address: str, blocks: int, encoding: str) -> tuple[KDNConnector, KDNConnector]:
    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KDNConnector", kv_connector_module_path="kdn.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={
            "address": address, "chunk_tokens": CHUNK, "encodings": [encoding]}))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.float16)
    kcc = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    s = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    assert isinstance(s, KDNConnector) and isinstance(w, KDNConnector)
    return s, w


def asked(s: KDNConnector, req: Request) -> int:
    while True:
        n, _ = s.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        time.sleep(0.001)


def output(req: Request, block_ids: list[int], computed: int, scheduled: int
           ) -> SchedulerOutput:
    new = NewRequestData(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                         mm_features=[], sampling_params=req.sampling_params,
                         pooling_params=None, block_ids=(block_ids,),
                         num_computed_tokens=computed, lora_request=None)
    return SchedulerOutput(scheduled_new_reqs=[new],
                           scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={req.request_id: scheduled},
                           total_num_scheduled_tokens=scheduled,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_rows(address: str, tokens: int, repeat: int, device: torch.device, encoding: str
              ) -> dict[str, Any]:
    nblk = tokens // BLOCK
    blocks = 2 * nblk + 1
    s, w = connectors(address, blocks, encoding)
    assert s.scheduler is not None and w.worker is not None
    g = torch.Generator().manual_seed(0)
    kv = {n: torch.zeros(2, blocks, BLOCK, HEADS, DIM, dtype=torch.float16, device=device)
          for n in NAMES}
    w.register_kv_caches(kv)
    ids = [int(t) % 32000 for t in torch.randint(0, 32000, (tokens + 1,), generator=g)]
    perm = [int(b) for b in torch.randperm(blocks, generator=g)]
    first, second = perm[: nblk + 1], perm[nblk + 1 :] + perm[:1]
    # the prefill: a miss, then every layer's blocks written and saved
    req = Request("prefill", ids, SamplingParams(max_tokens=1), None)
    assert asked(s, req) == 0
    s.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(b) for b in first),)), 0)
    meta = s.build_connector_meta(output(req, first, 0, len(ids)))
    w.bind_connector_metadata(meta)
    for n in NAMES:
        kv[n][:, first] = torch.randn(2, len(first), BLOCK, HEADS, DIM, generator=g
                                      ).half().to(device)
        w.save_kv_layer(n, kv[n], None)  # type: ignore[arg-type]
    w.wait_for_save()
    w.clear_connector_metadata()
    w.worker.wait_saves(600)
    s.request_finished(req, first)
    # the hit: planned once by the scheduler, replayed by the worker each repeat
    hit = Request("hit", ids, SamplingParams(max_tokens=1), None)
    n = asked(s, hit)
    assert n == tokens, (n, tokens)
    s.update_state_after_alloc(hit, KVCacheBlocks((tuple(KVCacheBlock(b) for b in second),)), n)
    meta = s.build_connector_meta(output(hit, second, 0, 1))
    assert isinstance(meta, KDNConnectorMetadata) and meta.loads
    load_meta = KDNConnectorMetadata(loads=meta.loads)
    keys_ = meta.loads[0].keys_by_rank[0]
    lay = w.layout
    client = w.worker.client

    def engine() -> None:
        streams = [st for st in client.retrieve_streams(keys_, namespace="vllm", layout=lay,
                                                        device=device) if st is not None]
        assert len(streams) == len(keys_)
        on = torch.cuda.current_stream(device) if device.type == "cuda" else None
        for i in range(LAYERS):
            parts = [st.wait_for_layer(i, stream=on) for st in streams]
            torch.cat([p[0] for p in parts], dim=1)  # k: [H, T, D]
            torch.cat([p[1] for p in parts], dim=1)
        sync(device)
        for st in streams:
            st.cancel()

    def connector() -> None:
        w.bind_connector_metadata(load_meta)
        w.start_load_kv(None)  # type: ignore[arg-type]
        for n in NAMES:
            w.wait_for_layer_load(n)
        w.wait_for_save()
        sync(device)
        w.clear_connector_metadata()

    times: dict[str, list[float]] = {"engine": [], "connector": []}
    for fn in (engine, connector):  # warm-up
        fn()
    for _ in range(repeat):
        for name, fn in (("engine", engine), ("connector", connector)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    assert not w.get_block_ids_with_load_errors()
    same = all(torch.equal(kv[n][:, second[:nblk]].view(torch.int16),
                           kv[n][:, first[:nblk]].view(torch.int16)) for n in NAMES)
    s.shutdown()
    w.shutdown()
    gb = tokens * lay.bytes_per_token / 1e9
    e, c = median(times["engine"]), median(times["connector"])
    return {"kind": "load", "device": device.type, "encoding": encoding, "tokens": tokens,
            "engine_s": e, "connector_s": c, "speed_vs_engine": e / c,
            "connector_gb_s": gb / c, "engine_gb_s": gb / e, "bit_identical": same}


def lookup_row(lookups: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp) / "kdn", ram_bytes=64 << 20, disk_bytes=0)
        store = build_store(cfg)
        gate = threading.Event()
        real = store.lookup

        def held(skeys: Any) -> Any:
            gate.wait(120)
            return real(skeys)

        store.lookup = held  # type: ignore[method-assign]
        with ServerThread(cfg, store) as st:
            s, w = connectors(st.address, 64, "lossless")
            g = torch.Generator().manual_seed(1)
            took, answers = [], []
            for j in range(lookups):
                ids = [int(t) for t in torch.randint(0, 32000, (2048,), generator=g)]
                req = Request(f"r{j}", ids, SamplingParams(max_tokens=1), None)
                t0 = time.perf_counter()
                n, _ = s.get_num_new_matched_tokens(req, 0)
                took.append(time.perf_counter() - t0)
                answers.append(n)
            gate.set()
            s.shutdown()
            w.shutdown()
    us = [t * 1e6 for t in took]
    return {"kind": "lookup", "device": "cpu", "encoding": "", "tokens": 2048,
            "lookups": lookups, "all_none": all(a is None for a in answers),
            "p50_us": median(us), "p99_us": percentile(us, 99), "max_us": max(us)}


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "vllm_connector", "512 tokens, 2 repeats, 50 lookups")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=0, help="hit length (default: 8192 on a "
                    "GPU, 2048 on a CPU; --quick: 512)")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--lookups", type=int, default=0)
    ns = ap.parse_args(argv)
    device = torch.device(ns.device)
    if ns.tokens < 0 or ns.tokens % CHUNK:
        ap.error(f"--tokens must be a whole number of {CHUNK}-token chunks, got {ns.tokens}")
    tokens = ns.tokens or (512 if ns.quick else 8192 if device.type == "cuda" else 2048)
    repeat = ns.repeat or (2 if ns.quick else 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp) / "kdn",
                           ram_bytes=max(1 << 30, 6 * tokens * LAYERS * HEADS * DIM * 4),
                           disk_bytes=0)
        with ServerThread(cfg) as st:
            for enc in ("raw", "lossless"):
                rows.append(load_rows(st.address, tokens, repeat, device, enc))
    rows.append(lookup_row(ns.lookups or (50 if ns.quick else 500)))
    cols = ["kind", "device", "encoding", "tokens", "engine_s", "connector_s",
            "speed_vs_engine", "connector_gb_s", "bit_identical", "p50_us", "p99_us", "max_us",
            "all_none"]
    print_table(rows, cols)
    import vllm

    write_json(ns.out, "vllm_connector", rows, repeat=repeat, vllm=vllm.__version__,
               shape=f"{LAYERS} layers x {HEADS} KV heads x {DIM} fp16, chunk {CHUNK}, "
                     f"block {BLOCK}",
               server="in this process (ServerThread), RAM tier only, shared segment")


if __name__ == "__main__":
    main()
