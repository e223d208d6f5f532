"""``bench.blend --gpu``: blending's TTFT on the device against the full prefill, at 8B shape.

    python -m bench.blend --gpu [--quick] [--out bench/results/blend_gpu.json]

A Llama-3-8B-shaped model with random weights (``AutoModelForCausalLM.from_config``; timing
does not depend on the weights: quality is measured on CPU with the real model, ``bench.blend``)
in fp16 with sdpa attention on a GPU. Prompts are a 16-token head, ``--chunks`` chunks of each
size in ``--chunk-tokens`` (default 4 x 2,048 and 4 x 8,192: 8k and 32k of context) and a
32-token question, random ids. Each chunk's KV is prefilled alone from position 0 once.
Measured in one run, per context, each the best of ``--runs`` (synchronised):

- ``full-prefill``: the model's own forward over the whole prompt (``use_cache``, last logits),
  the baseline of ``ttft_vs_full``;
- ``naive``: ``kdn.blend`` at ratio 0 (chunks re-positioned and concatenated, only the text
  computed);
- ``blend`` at ``--ratio`` (default 0.15) with each selection rule: ``question`` (kdn's
  default: the question's attention in a first pass), ``deviation`` (CacheBlend: K/V deviation
  at layer 1) and ``chunk-head`` (EPIC: each chunk's first ratio x chunk tokens, no scoring).

Each method runs with the chunks' KV from two sources: ``resident`` (already on the device,
``KVCache``) and ``streamed`` (stored in a kdn server process on this host, ``--encoding``,
default ``raw``; each run opens one Retrieve stream per chunk onto the device and the blend
takes layer i as it lands, so the time includes delivery). ``vs_resident`` is a streamed row's
TTFT over the resident one's. ``--quick`` (what CI runs on a CPU) uses a small random shape,
4 x 128 tokens, 2 runs.

Rows: ``method``, ``selection``, ``ratio``, ``context_tokens``, ``chunks``, ``chunk_tokens``,
``source``, ``ttft_s``, ``ttft_vs_full``, ``recomputed_tokens``, ``device``; a PNG of
``ttft_vs_full`` beside the JSON.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import arg_parser, figure, print_table, save_figure, write_json
from bench.gpu import SHAPES, best_s, kdn_server, model_dtype, sync
from kdn.blend import BlendConfig, Piece, blend
from kdn.cache import KVCache
from kdn.client import Client
from kdn.keys import chunk_key
from kdn.layout import KVLayout
from kdn.model import hf
from kdn.model.hf import model_layout

QUICK_SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                   rope_theta=10000.0)
"""A small Llama for ``--quick`` on a CPU (the code path, not a timing anyone quotes)."""
HEAD_TOKENS, QUESTION_TOKENS = 16, 32
RULES = {"question": dict(query_share=1.0), "deviation": dict(query_share=0.0),
         "chunk-head": {}}
COLUMNS = ["method", "selection", "ratio", "context_tokens", "chunks", "source", "ttft_s",
           "ttft_vs_full", "vs_resident", "recomputed_tokens", "device"]


def build(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(1, vocab, (n,), generator=g)]


def config_of(rule: str, ratio: float, chunk_tokens: int) -> BlendConfig:
    """The ``BlendConfig`` of a selection rule at ``ratio`` ("" is naive concatenation)."""
    if not rule:
        return BlendConfig(ratio=0.0)
    if rule == "chunk-head":
        return BlendConfig(ratio=0.0, head_tokens=max(1, round(ratio * chunk_tokens)))
    return BlendConfig(ratio=ratio, **RULES[rule])


@dataclass
class Prompt:
    head: list[int]
    chunks: list[list[int]]
    question: list[int]
    kv: list[KVCache]
    """Each chunk's KV, prefilled alone, on the device."""
    keys: list[bytes]
    """Each chunk's key in the kdn server (``chunk_key``)."""

    @property
    def ids(self) -> list[int]:
        return self.head + [t for c in self.chunks for t in c] + self.question

    def pieces(self, sources: list[Any]) -> list[Piece]:
        return [Piece(self.head)] + [Piece(c, s) for c, s in zip(self.chunks, sources)] + [
            Piece(self.question)]


def prepare(model: Any, layout: KVLayout, client: Client | None, chunks: int,
            chunk_tokens: int, encoding: str, namespace: str) -> Prompt:
    vocab = int(model.config.vocab_size)
    ids = [random_ids(chunk_tokens, vocab, seed=chunk_tokens + j) for j in range(chunks)]
    kv, keys = [], []
    with torch.inference_mode():
        for c in ids:
            kv.append(hf.prefill(model, c, layout)[0])
            keys.append(chunk_key(c, layout, namespace))
            if client is not None:
                client.store(keys[-1], kv[-1], mode=encoding, namespace=namespace)
    return Prompt(random_ids(HEAD_TOKENS, vocab, 1), ids, random_ids(QUESTION_TOKENS, vocab, 2),
                  kv, keys)


def measure(model: Any, prompt: Prompt, layout: KVLayout, client: Client | None,
            device: torch.device, ratio: float, runs: int, namespace: str,
            sources: list[str]) -> list[dict[str, Any]]:
    """Every row of one context size."""
    ids = torch.tensor([prompt.ids], device=device)
    chunk_tokens = len(prompt.chunks[0])
    base = {"context_tokens": len(prompt.ids), "chunks": len(prompt.chunks),
            "chunk_tokens": chunk_tokens, "device": str(device)}

    @torch.inference_mode()
    def full() -> None:
        out = model(ids, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())

    full_s = best_s(full, device, runs)
    rows = [{"method": "full-prefill", "selection": "", "ratio": 1.0, "source": "",
             "ttft_s": full_s, "ttft_vs_full": 1.0, "recomputed_tokens": len(prompt.ids),
             **base}]
    resident: dict[str, float] = {}
    for source in sources:
        for rule in ["", *RULES]:
            cfg = config_of(rule, ratio, chunk_tokens)
            recomputed: list[int] = []

            def run(cfg: BlendConfig = cfg, source: str = source,
                    recomputed: list[int] = recomputed) -> None:
                if source == "resident":
                    got: list[Any] = list(prompt.kv)
                else:
                    assert client is not None
                    got = [client.retrieve_stream(k, namespace=namespace, layout=layout,
                                                  device=device) for k in prompt.keys]
                    if any(s is None for s in got):
                        raise SystemExit("a chunk stored in the kdn server was not found")
                r = blend(model, prompt.pieces(got), cfg)
                int(r.logits.argmax())
                recomputed[:] = [r.timings.recomputed_tokens]

            t = best_s(run, device, runs)
            name = rule or "naive"
            if source == "resident":
                resident[name] = t
            rows.append({"method": "blend" if rule else "naive", "selection": rule,
                         "ratio": ratio if rule else 0.0, "source": source, "ttft_s": t,
                         "ttft_vs_full": t / full_s,
                         "vs_resident": t / resident[name] if name in resident and
                         source != "resident" else None,
                         "recomputed_tokens": recomputed[0], **base})
            print(f"{len(prompt.ids)} tokens, {source} {name}: {t:.3f} s "
                  f"({t / full_s:.3f}x full)", flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """TTFT over full prefill per method, one group of bars per context and source."""
    contexts = sorted({r["context_tokens"] for r in rows})
    fig, axes = figure(6 * len(contexts), 4, ncols=len(contexts))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, ctx in zip(axes, contexts):
        mine = [r for r in rows if r["context_tokens"] == ctx and r["method"] != "full-prefill"]
        names = list(dict.fromkeys(r["selection"] or r["method"] for r in mine))
        sources = list(dict.fromkeys(r["source"] for r in mine))
        width = 0.8 / max(1, len(sources))
        for j, src in enumerate(sources):
            got = {r["selection"] or r["method"]: r["ttft_vs_full"] for r in mine
                   if r["source"] == src}
            ax.bar([i + j * width for i in range(len(names))],
                   [got.get(n, 0.0) for n in names], width, label=src)
        ax.set_xticks([i + width * (len(sources) - 1) / 2 for i in range(len(names))], names)
        ax.axhline(1.0, color="g", ls="--", label="full prefill")
        ax.set_ylabel("TTFT / full prefill")
        ax.set_title(f"{ctx} tokens ({rows[0]['device']})")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "blend_gpu", "small random shape, 4 x 128 tokens, 2 runs (CPU ok)")
    ap.prog = "python -m bench.blend --gpu"
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="model shape (random weights); --quick uses a small one")
    ap.add_argument("--chunk-tokens", default="2048,8192", help="chunk sizes, one context each")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="", help="float16, bfloat16, float32 (default: fp16 on "
                                                "a GPU, fp32 on a CPU)")
    ap.add_argument("--encoding", default="raw", help="kdn encoding of the streamed chunks")
    ap.add_argument("--sources", default="resident,streamed")
    ap.add_argument("--ram", default="", help="kdn server RAM tier (default: 3x the chunks)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        shape, sizes, runs = QUICK_SHAPE, [128], min(args.runs, 2)
    else:
        shape, runs = SHAPES[args.shape], args.runs
        sizes = [int(s) for s in args.chunk_tokens.split(",")]
        if device.type != "cuda" and args.shape == "llama3-8b":
            raise SystemExit("the 8B shape needs a CUDA device: run --quick on a CPU")
    sources = [s for s in args.sources.split(",") if s]
    if not set(sources) <= {"resident", "streamed"} or not sources:
        raise SystemExit(f"--sources takes resident and/or streamed, got {args.sources!r}")
    dtype = model_dtype(device, args.dtype)
    t0 = time.perf_counter()
    model = build(shape, device, dtype)
    layout = model_layout(model)
    print(f"model {'quick' if args.quick else args.shape} {dtype} on {device}: "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    kv_bytes = max(sizes) * args.chunks * layout.bytes_per_token
    ram = args.ram or str(max(3 * kv_bytes, 256 << 20))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        client = None
        if "streamed" in sources:
            address = stack.enter_context(kdn_server(Path(tmp), ram,
                                                     str(max(2 * kv_bytes, 64 << 20))))
            client = stack.enter_context(Client(address, timeout_s=120))
        for size in sizes:
            ns = f"blend-gpu-{size}"
            prompt = prepare(model, layout, client, args.chunks, size, args.encoding, ns)
            rows += measure(model, prompt, layout, client, device, args.ratio, runs, ns,
                            sources)
            del prompt
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_json(args.out, "blend_gpu", rows, device=_device_name(device),
                       complete=False, config=_config(args, shape, dtype, runs, ram))
    write_json(args.out, "blend_gpu", rows, device=_device_name(device), complete=True,
               config=_config(args, shape, dtype, runs, ram))
    plot(rows, args.out.with_suffix(".png"))
    print_table(rows, COLUMNS)
    sync(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _config(args: argparse.Namespace, shape: dict[str, Any], dtype: torch.dtype, runs: int,
            ram: str) -> dict[str, Any]:
    return {"shape": "quick" if args.quick else args.shape, "model": shape,
            "dtype": str(dtype).removeprefix("torch."), "ratio": args.ratio, "runs": runs,
            "head_tokens": HEAD_TOKENS, "question_tokens": QUESTION_TOKENS,
            "encoding": args.encoding, "server_ram": ram, "weights": "random (timing only)",
            "attention": "sdpa"}
