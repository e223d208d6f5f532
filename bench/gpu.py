"""Does a kdn hit beat prefill on the device the engine runs on? Real model shapes, one run.

    python -m bench.gpu [--quick] [--out bench/results/gpu.json]

Models of the real shapes with random weights (no weights travel; timing does not depend on
them): Llama-3-8B (32 layers, 8 KV heads x 128, GQA) and SmolLM2-135M, fp16 with sdpa
attention on a GPU (fp32 on a CPU). For each model and context length, measured in this run:

- ``prefill``: the model's full prefill of the context (best of 3), the baseline;
- per encoding (``raw``, ``lossless``, ``int8``, ``kdn-default``) and path (``shm``: a client on
  the server's host, the default; ``inproc``: the same with an in-process tier, which the
  store fills, so loads are hits there; ``grpc-1``: a remote client, gRPC only): ``ttft_s`` of a hit
  through ``KDNEngine`` (every block of the context stored, one token left to compute) and
  ``load_s``, the time until every layer of the context is on the model's device
  (``start_load`` + ``wait_for_layer`` of every layer, synchronised);
- the limits each row is bound by: pinned host->device copy and device->device copy (GPU), or
  memcpy (CPU): ``load_gb_s`` next to ``limit_gb_s`` gives ``ratio_to_limit``.

``ratio_vs_prefill`` = hit TTFT / full-prefill time of the same context, same run. The kdn
server runs as its own process (``python -m kdn serve``, RAM tier) on this host.
``--quick`` (what CI smoke-tests on CPU) runs SmolLM2's shape at 256 tokens over ``shm`` and
``inproc``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    HOST,
    arg_parser,
    figure,
    free_port,
    machine,
    print_table,
    process,
    save_figure,
    wait_until,
    write_json,
)
from kdn.client import Client
from kdn.delivery import encoding_name
from kdn.engine import EngineConfig, KDNEngine

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
}
ENCODINGS = (("raw", ""), ("lossless", ""), ("int8", ""), ("kdn", "default"))


class _Ids:
    """A tokenizer stand-in: prompts are token ids; decoded text is not needed here."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def build(shape: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn: Any, device: torch.device, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def limits(device: torch.device, nbytes: int = 256 << 20) -> dict[str, float]:
    """Copy rates this machine can reach: pinned H2D and D2D on a GPU, memcpy on a CPU."""
    if device.type != "cuda":
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        return {"memcpy_gb_s": nbytes / best_s(lambda: np.copyto(dst, src), device, 5) / 1e9}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    return {"h2d_pinned_gb_s": nbytes / best_s(lambda: dev.copy_(host, non_blocking=True),
                                                device, 5) / 1e9,
            "d2d_gb_s": nbytes / best_s(lambda: dev2.copy_(dev), device, 5) / 1e9}


@contextmanager
def kdn_server(tmp: Path, ram: str) -> Iterator[str]:
    port = free_port()
    with process([sys.executable, "-m", "kdn", "serve", "--host", HOST, "--port", str(port),
                  "--data-dir", str(tmp / "data"), "--ram-bytes", ram, "--disk-bytes", "0",
                  "--max-message-bytes", str(512 << 20), "--max-entry-bytes", str(8 << 30),
                  "--log-level", "WARNING"], tmp / "kdn-server.log") as proc:
        address = f"{HOST}:{port}"
        with Client(address, timeout_s=2) as probe:
            wait_until(lambda: probe.health() == "SERVING", "kdn server", proc, 120)
        yield address


def measure(model: Any, shape: str, tokens: int, client: Client, path: str,
            device: torch.device, prefill_s: float, limit: float, runs: int
            ) -> list[dict[str, Any]]:
    rows = []
    ids = [int(x) for x in torch.randint(1, SHAPES[shape]["vocab_size"], (tokens + 1,),
                                         generator=torch.Generator().manual_seed(tokens))]
    for mode, level in ENCODINGS:
        enc = encoding_name(mode, level)
        engine = KDNEngine(model, _Ids(), client, EngineConfig(
            namespace=f"{shape}-{tokens}-{mode}{level}", encodings=((mode, level),)))
        first = engine.generate(ids, max_new_tokens=1)  # computes, then stores every block
        if first.store_thread is not None:
            first.store_thread.join()
        kv_bytes = tokens * engine.layout.bytes_per_token

        def load(e: KDNEngine = engine, c: str = enc) -> None:
            got = e.start_load(ids, force=c)
            assert got == tokens, f"{c}: {got} of {tokens} tokens stored"
            for i in range(e.layout.num_layers):
                e.wait_for_layer(i)
            e.finish()

        load_s = best_s(load, device, runs)
        ttfts = []
        for _ in range(runs):
            hit = engine.generate(ids, max_new_tokens=1, force=enc)
            assert hit.timings.reused_tokens == tokens, enc
            ttfts.append(hit.timings.ttft_s)
        ttft = min(ttfts)
        rows.append({"model": shape, "tokens": tokens, "path": path, "encoding": enc,
                     "ttft_s": ttft, "prefill_s": prefill_s, "ratio_vs_prefill": ttft / prefill_s,
                     "load_s": load_s, "load_gb_s": kv_bytes / load_s / 1e9,
                     "limit_gb_s": limit, "ratio_to_limit": kv_bytes / load_s / 1e9 / limit,
                     "kv_bytes": kv_bytes, "chunk_tokens": engine.config.chunk_tokens})
        print(f"  {shape} {tokens} {path} {enc}: ttft {ttft * 1e3:.1f} ms "
              f"({ttft / prefill_s:.2f}x prefill), load {kv_bytes / load_s / 1e9:.2f} GB/s",
              flush=True)
    return rows


def run(plan: dict[str, list[int]], paths: list[str], runs: int, out: Path) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lim = limits(device)
    limit = lim.get("h2d_pinned_gb_s", lim.get("memcpy_gb_s", 0.0))
    rows: list[dict[str, Any]] = []
    ram = "64GiB" if device.type == "cuda" else "6GiB"
    local = (24 << 30) if device.type == "cuda" else (2 << 30)  # the in-process tier's bytes
    with tempfile.TemporaryDirectory() as tmp, kdn_server(Path(tmp), ram) as address:
        for shape, lengths in plan.items():
            model = build(shape, device)
            for tokens in lengths:
                ids = torch.randint(1, SHAPES[shape]["vocab_size"], (1, tokens), device=device)
                with torch.inference_mode():
                    prefill_s = best_s(lambda m=model, x=ids: m(x, use_cache=True,
                                                                  logits_to_keep=1), device, 3)
                print(f"{shape}: prefill of {tokens} tokens {prefill_s * 1e3:.1f} ms", flush=True)
                for path in paths:
                    with Client(address, shm_bytes=0 if path == "grpc-1" else None,
                                local_bytes=local if path == "inproc" else 0,
                                max_message_bytes=512 << 20) as client:
                        rows += measure(model, shape, tokens, client, path, device, prefill_s,
                                        limit, runs)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, ["model", "tokens", "path", "encoding", "ttft_s", "prefill_s",
                       "ratio_vs_prefill", "load_gb_s", "ratio_to_limit"])
    info = machine()
    write_json(out, "gpu", rows, device=info["cuda"] or f"cpu ({info['cpus']} cores)",
               torch=torch.__version__, limits=lim, attention="sdpa",
               dtype="float16" if device.type == "cuda" else "float32",
               torch_threads=torch.get_num_threads())
    plot(rows, out.with_suffix(".png"))
    return {"rows": rows, "limits": lim}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    groups = sorted({(r["model"], r["tokens"]) for r in rows})
    series = sorted({(r["path"], r["encoding"]) for r in rows})
    fig, ax = figure(10, 4.5)
    width = 0.8 / max(1, len(series))
    for j, (p, enc) in enumerate(series):
        ys = [next((r["ratio_vs_prefill"] for r in rows if (r["model"], r["tokens"]) == g
                    and r["path"] == p and r["encoding"] == enc), 0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=f"{p} {enc}")
    ax.axhline(1.0, color="k", linestyle="--", label="full prefill")
    ax.set_xticks([i + 0.4 for i in range(len(groups))], [f"{m}\n{t} tok" for m, t in groups])
    ax.set_ylabel("hit TTFT / prefill")
    ax.set_yscale("log")
    ax.set_title("kdn hit vs full prefill (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ns = arg_parser(__doc__, "gpu", "SmolLM2 shape, 256 tokens, shm and inproc paths"
                    ).parse_args(argv)
    if ns.quick:
        plan, paths, runs = {"smollm2-135m": [256]}, ["shm", "inproc"], 2
    elif torch.cuda.is_available():
        plan = {"llama3-8b": [2048, 8192, 32768], "smollm2-135m": [2048, 8192]}
        paths, runs = ["shm", "inproc", "grpc-1"], 3
    else:
        plan, paths, runs = {"smollm2-135m": [2048]}, ["shm", "inproc", "grpc-1"], 2
    run(plan, paths, runs, ns.out)


if __name__ == "__main__":
    main()
