"""Streaming delivery into the engine on SmolLM2-135M: retrieve throughput vs raw gRPC, TTFT per
path and context length, and retrieve latency under concurrency.

    python -m bench.delivery [--quick] --out bench/results/delivery.json

Rows (one JSON list, ``section`` tells them apart):
* ``throughput``: ``retrieve_gb_s`` (kdn Retrieve of a stored 2048-token lossless entry, decoded
  into tensors) and ``fetch_gb_s`` (same, undecoded) next to ``raw_grpc_gb_s``, a bare gRPC
  service streaming the same stored bytes in messages of the same size, same run.
* ``ttft``: ``path`` x ``tokens`` with ``ttft_s`` and its split (lookup, transfer, decode not
  hidden behind transfer, cache build, first-token compute). Paths: ``full-prefill``;
  ``{ram,redis,lmdb}-{lossless,kdn}`` (a server whose only tier is that one); ``half-prefix``
  (first half cached, lossless, RAM). Each prompt is the context plus a 16-token question.
* ``concurrency``: 1, 8, 64 clients retrieving 256-token lossless blocks: aggregate GB/s and
  per-request p50/p99 latency.
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.baselines import RawServer, raw_client
from bench.common import (
    arg_parser,
    figure,
    median,
    percentile,
    print_table,
    save_figure,
    timed,
    write_json,
)
from kdn import keys
from kdn.client import Client
from kdn.codec.modes import get_mode, mode_names
from kdn.engine import EngineConfig, KDNEngine
from kdn.model import hf
from kdn.model.data import english_token_ids
from kdn.model.models import load_model
from kdn.server import ServerConfig, ServerThread
from kdn.store.base import Tier
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import TieredStore

QUESTION_TOKENS = 16
CHUNK = 256


def best_kdn_level() -> tuple[str, str] | None:
    """The most compressed level of the ``kdn`` mode, if that mode exists."""
    if "kdn" not in mode_names():
        return None
    levels = get_mode("kdn").levels
    return ("kdn", levels[len(levels) // 2]) if levels else None


def make_tier(kind: str, workdir: Path, redis_url: str) -> Tier:
    if kind == "ram":
        return RamTier(8 << 30)
    if kind == "lmdb":
        return LmdbTier(workdir / f"lmdb-{time.time_ns()}", capacity_bytes=8 << 30)
    from kdn.store.redis import RedisTier

    return RedisTier(redis_url, part_bytes=8 << 20, timeout_s=10.0)


def server_on(tier: Tier, workdir: Path) -> ServerThread:
    cfg = ServerConfig(port=0, data_dir=workdir, disk_bytes=0, max_message_bytes=256 << 20,
                       max_entry_bytes=8 << 30, ram_bytes=8 << 30)
    from kdn.server.service import verify_entry

    return ServerThread(cfg, TieredStore([tier], verify=verify_entry)).start()


def prefill_blocks(model: Any, ids: list[int], encodings: tuple[tuple[str, str], ...]
                   ) -> tuple[float, dict[str, list[tuple[bytes, Any]]]]:
    """Full prefill once (timed: the full-prefill TTFT) and every block of its KV encoded in
    every encoding, ready to store into any server: {encoding: [(chain key, parts), ...]}."""
    from kdn import codec
    from kdn.delivery import encoding_name
    from kdn.layout import DType
    from kdn.model.hf import model_layout

    layout = model_layout(model, DType.FLOAT32)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
    full_s = time.perf_counter() - t0
    kv = hf.from_transformers(out.past_key_values, layout)
    chain = keys.prefix_keys(ids, layout, chunk_tokens=CHUNK)
    blocks: dict[str, list[tuple[bytes, Any]]] = {}
    for mode, level in encodings:
        name = encoding_name(mode, level)
        blocks[name] = [
            (keys.variant_key(k, name),
             codec.encode_parts(kv.slice(i * CHUNK, (i + 1) * CHUNK), mode, level))
            for i, k in enumerate(chain)]
    return full_s, blocks


def ttft_rows(model: Any, tok: Any, sizes: list[int], paths: list[str], workdir: Path,
              redis_url: str, kdn_level: tuple[str, str] | None) -> list[dict[str, Any]]:
    """TTFT per path; every hit path serves blocks stored from one full prefill per size."""
    rows: list[dict[str, Any]] = []
    encodings = (("lossless", ""),) + ((kdn_level,) if kdn_level else ())
    for n in sizes:
        ids = [int(t) for t in english_token_ids(n + QUESTION_TOKENS, tok)]
        full_s, blocks = prefill_blocks(model, ids, encodings)
        rows.append({"section": "ttft", "path": "full-prefill", "tokens": n, "ttft_s": full_s,
                     "lookup_s": 0.0, "transfer_s": 0.0, "decode_s": 0.0, "cache_build_s": 0.0,
                     "first_token_compute_s": full_s, "reused_tokens": 0,
                     "decision": "recompute"})
        print(rows[-1], flush=True)
        for path in paths:
            if path == "full-prefill":
                continue
            tier_kind, _, enc = path.partition("-")
            if path == "half-prefix":
                tier_kind, enc = "ram", "lossless"
            if enc == "kdn":
                if kdn_level is None:
                    continue
                enc = f"{kdn_level[0]}-{kdn_level[1]}"
            wanted = blocks[enc][: (n // 2) // CHUNK] if path == "half-prefix" else blocks[enc]
            st = server_on(make_tier(tier_kind, workdir, redis_url), workdir)
            try:
                with Client(st.address, max_message_bytes=256 << 20) as client:
                    for key, parts in wanted:
                        client.store(key, parts)
                    eng = KDNEngine(model, tok, client, EngineConfig(
                        chunk_tokens=CHUNK, encodings=encodings, store_back=False))
                    runs = [eng.generate(ids, max_new_tokens=1, force=enc).timings
                            for _ in range(2)]
                    t = min(runs, key=lambda r: r.ttft_s)
            finally:
                st.stop()
            rows.append({"section": "ttft", "path": path, "tokens": n, "ttft_s": t.ttft_s,
                         "lookup_s": t.lookup_s, "transfer_s": t.transfer_s,
                         "decode_s": t.decode_s, "cache_build_s": t.cache_build_s,
                         "first_token_compute_s": t.first_token_compute_s,
                         "reused_tokens": t.reused_tokens, "decision": t.decision})
            print(rows[-1], flush=True)
    full = {r["tokens"]: r["ttft_s"] for r in rows if r["path"] == "full-prefill"}
    for r in rows:
        r["speedup_vs_full"] = full.get(r["tokens"], float("nan")) / r["ttft_s"]
    return rows


def throughput_rows(model: Any, tok: Any, workdir: Path, tokens: int,
                    repeat: int) -> list[dict[str, Any]]:
    """kdn retrieve of a real stored entry vs raw gRPC streaming of the same bytes."""
    from kdn.layout import DType
    from kdn.model.hf import model_layout

    layout = model_layout(model, DType.FLOAT32)
    ids = english_token_ids(tokens, tok).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    kv = hf.from_transformers(out.past_key_values, layout)
    key = keys.chunk_key(ids[0], layout)
    raw = RawServer()
    put, get, ch = raw_client(raw.port)
    st = server_on(RamTier(8 << 30), workdir)
    rows = []
    try:
        with Client(st.address, max_message_bytes=256 << 20) as client:
            client.store(key, kv, mode="lossless")
            fetched = client.fetch(key)
            assert fetched is not None
            stored = fetched.parts
            put(iter([key, stored.header, *map(bytes, stored.frames)]))  # views of the segment
            nbytes = stored.nbytes
            t_raw = timed(lambda: list(get(key)), repeat)
            t_fetch = timed(lambda: client.fetch(key), repeat)
            t_get = timed(lambda: client.retrieve(key, layout=layout), repeat)
            raw_gbs = nbytes / median(t_raw) / 1e9
            rows.append({"section": "throughput", "tokens": tokens, "stored_mib": nbytes / 2**20,
                         "frames": len(stored.frames),
                         "retrieve_gb_s": nbytes / median(t_get) / 1e9,
                         "fetch_gb_s": nbytes / median(t_fetch) / 1e9,
                         "raw_grpc_gb_s": raw_gbs,
                         "retrieve_vs_raw": nbytes / median(t_get) / 1e9 / raw_gbs,
                         "fetch_vs_raw": nbytes / median(t_fetch) / 1e9 / raw_gbs})
    finally:
        st.stop()
        ch.close()
        raw.stop()
    return rows


def concurrency_rows(model: Any, tok: Any, workdir: Path, clients_list: list[int],
                     seconds: float) -> list[dict[str, Any]]:
    from kdn.layout import DType
    from kdn.model.hf import model_layout

    layout = model_layout(model, DType.FLOAT32)
    ids = english_token_ids(CHUNK * 4, tok).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    kv = hf.from_transformers(out.past_key_values, layout)
    st = server_on(RamTier(8 << 30), workdir)
    rows = []
    try:
        with Client(st.address, max_message_bytes=256 << 20) as admin:
            blocks = keys.prefix_keys(ids[0], layout, chunk_tokens=CHUNK)
            for i, k in enumerate(blocks):
                admin.store(k, kv.slice(i * CHUNK, (i + 1) * CHUNK), mode="lossless")
            size = admin.lookup(blocks).infos[0].size_bytes
        for n in clients_list:
            lat: list[float] = []
            lock = threading.Lock()
            stop = time.perf_counter() + seconds

            def worker(w: int, stop: float = stop, lat: list[float] = lat,
                       lock: threading.Lock = lock) -> None:
                with Client(st.address, max_message_bytes=256 << 20) as c:
                    j = w
                    while time.perf_counter() < stop:
                        t = time.perf_counter()
                        got = c.retrieve(blocks[j % len(blocks)], layout=layout)
                        assert got is not None
                        with lock:
                            lat.append(time.perf_counter() - t)
                        j += 1

            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(worker, range(n)))
            wall = time.perf_counter() - t0
            rows.append({"section": "concurrency", "clients": n, "requests": len(lat),
                         "gb_s": len(lat) * size / wall / 1e9,
                         "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                         "entry_mib": size / 2**20})
            print(rows[-1], flush=True)
    finally:
        st.stop()
    return rows


def agreement_rows(model: Any, tok: Any, workdir: Path, tokens: int, new_tokens: int,
                   encodings: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """Greedy tokens generated from each retrieved encoding vs from a full prefill."""
    from kdn.delivery import encoding_name

    ids = [int(t) for t in english_token_ids(tokens + QUESTION_TOKENS, tok)]
    st = server_on(RamTier(8 << 30), workdir)
    rows = []
    try:
        with Client(st.address, max_message_bytes=256 << 20) as client:
            eng = KDNEngine(model, tok, client, EngineConfig(chunk_tokens=CHUNK,
                                                             encodings=encodings))
            ref = eng.generate(ids, max_new_tokens=new_tokens, force="recompute")
            if ref.store_thread is not None:
                ref.store_thread.join()
            for mode, level in encodings:
                name = encoding_name(mode, level)
                got = eng.generate(ids, max_new_tokens=new_tokens, force=name)
                same = sum(a == b for a, b in zip(got.token_ids, ref.token_ids))
                rows.append({"section": "agreement", "encoding": name, "tokens": tokens,
                             "new_tokens": len(ref.token_ids),
                             "token_agreement": same / max(1, len(ref.token_ids)),
                             "identical": got.token_ids == ref.token_ids,
                             "reused_tokens": got.timings.reused_tokens})
                print(rows[-1], flush=True)
    finally:
        st.stop()
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = figure(7, 4.5)
    ttft = [r for r in rows if r["section"] == "ttft"]
    for p in sorted({r["path"] for r in ttft}):
        pts = sorted((r["tokens"], r["ttft_s"]) for r in ttft if r["path"] == p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                linestyle="--" if p == "full-prefill" else "-", label=p)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M TTFT: full prefill vs kdn hits (CPU, loopback)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "delivery")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis paths")
    ap.add_argument("--only", choices=["agreement"],
                    help="run one section and merge it into the existing --out file "
                         "(its time as agreement_when)")
    ns = ap.parse_args(argv)
    if ns.only and not ns.out.is_file():  # checked before minutes of measuring
        ap.error(f"--only merges into an existing --out; no such file: {str(ns.out)!r}")
    model, tok = load_model("smollm2-135m")
    kdn_level = best_kdn_level()
    encodings = (("lossless", ""),) + ((kdn_level,) if kdn_level else ())
    if ns.only == "agreement":
        import json

        with tempfile.TemporaryDirectory() as tmp:
            new = agreement_rows(model, tok, Path(tmp), 512, 32, encodings)
        doc = json.loads(ns.out.read_text())
        doc["rows"] = [r for r in doc["rows"] if r.get("section") != "agreement"] + new
        doc["agreement_when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ns.out.write_text(json.dumps(doc, indent=2) + "\n")
        return
    sizes = [512] if ns.quick else [512, 2048, 4096]
    tiers = ["ram"] if ns.quick else ["ram", "redis", "lmdb"]
    if ns.no_redis:
        tiers = [t for t in tiers if t != "redis"]
    paths = ["full-prefill", *(f"{t}-{e}" for t in tiers for e in ("lossless", "kdn")),
             "half-prefix"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis_srv = None
        redis_url = ""
        if "redis" in tiers:
            from tests.redis_servers import RedisServer

            redis_srv = RedisServer(workdir, appendonly=False,
                                    extra=("--maxmemory", "8gb")).start()
            redis_url = redis_srv.url
        try:
            rows += throughput_rows(model, tok, workdir, 2048, 3 if ns.quick else 7)
            rows += ttft_rows(model, tok, sizes, paths, workdir, redis_url, kdn_level)
            rows += concurrency_rows(model, tok, workdir, [1, 8] if ns.quick else [1, 8, 64],
                                     2.0 if ns.quick else 6.0)
            rows += agreement_rows(model, tok, workdir, 512, 8 if ns.quick else 32, encodings)
        finally:
            if redis_srv is not None:
                redis_srv.kill()
    print_table([r for r in rows if r["section"] == "throughput"],
                ["tokens", "stored_mib", "retrieve_gb_s", "fetch_gb_s", "raw_grpc_gb_s",
                 "retrieve_vs_raw", "fetch_vs_raw"])
    print_table([r for r in rows if r["section"] == "ttft"],
                ["path", "tokens", "ttft_s", "speedup_vs_full", "lookup_s", "transfer_s",
                 "decode_s", "cache_build_s", "first_token_compute_s", "reused_tokens"])
    print_table([r for r in rows if r["section"] == "concurrency"],
                ["clients", "requests", "gb_s", "p50_ms", "p99_ms", "entry_mib"])
    write_json(ns.out, "delivery", rows, kdn_level=list(kdn_level) if kdn_level else None,
               chunk_tokens=CHUNK, question_tokens=QUESTION_TOKENS, kv_dtype="float32")
    plot(rows, ns.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
