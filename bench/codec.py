"""Codec benchmark: size vs quality vs speed of every mode/level on SmolLM2-135M, one run.

    python -m bench.codec [--quick] [--out bench/results/codec.json] [--png PATH]

1. Prefill ``ctx`` tokens of English prose (SQuAD dev) and time it; keep the float16 cache.
2. For each of ``lossless``, ``int8``, ``cachegen`` (the baseline) and every ``kdn`` level:
   encode and decode the cache (best of ``--repeats``), then let the model run the next ``eval``
   tokens on the decoded cache and compare with the original (``kdn.codec.quality``).
3. Print a table, write JSON rows (and the targets, met or not, with their numbers) and a PNG
   of size vs quality.

Speeds are in fp16-equivalent bytes per second; ``decode_vs_prefill`` is the decode time of the
whole context's cache over an sdpa prefill of the same tokens (the best a user gets from
transformers on this machine; threads stated), measured in this run. The quality evaluation
runs on the eager model kdn loads (the two agree on this model, ``tests/test_models.py``).
Rows carry ``device`` (where the decode ran) and ``decode_gb_s``; on a CUDA host every
compressed mode gets a second row decoded on the GPU (``kdn.codec.gpu``).

The context is one entry above; an engine stores it in blocks (256 tokens by default:
``EngineConfig.chunk_tokens``), each entry with its own tables and exact sink tokens. So each
row also gives the bytes of the context as 256-token entries (``block_bytes``,
``block_ratio_vs_fp16``: what a store holds), and for the entropy-coded modes the same in the
earlier blob formats, encoded in this run (``kdn.codec.entropy``): ``block_bytes_format3``
(4-bit count codes inside zstd) and ``block_bytes_exact_counts`` (format 2: whole counts).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import figure, print_table, save_figure, write_json
from kdn.cache import KVCache
from kdn.codec import decode, encode
from kdn.codec.modes import get_mode
from kdn.codec.quality import Reference, evaluate, prepare
from kdn.model.models import ensure_smollm2_folder, load_model

RESULTS = Path(__file__).parent / "results"
COLUMNS = ["mode", "device", "bits_per_element", "ratio_vs_fp16", "delta_ppl_pct",
           "top1_agreement", "kl", "encode_mb_s", "decode_mb_s", "decode_gb_s",
           "decode_vs_prefill", "block_ratio_vs_fp16", "block_bytes", "block_bytes_format3",
           "block_bytes_exact_counts"]


@dataclass(frozen=True)
class Row:
    mode: str
    bits_per_element: float
    ratio_vs_fp16: float
    delta_ppl_pct: float
    top1_agreement: float
    kl: float
    encode_mb_s: float
    decode_mb_s: float
    decode_vs_prefill: float
    bytes: int
    bit_exact: bool
    device: str = "cpu"
    decode_gb_s: float = 0.0
    block_bytes: int = 0
    block_ratio_vs_fp16: float = 0.0
    block_bytes_format3: int = 0
    block_bytes_exact_counts: int = 0


def codecs() -> list[tuple[str, str, str]]:
    """(row name, mode, level) in table order."""
    out = [("lossless", "lossless", ""), ("int8", "int8", ""), ("cachegen", "cachegen", "")]
    return out + [(f"kdn-{lv}", "kdn", lv) for lv in get_mode("kdn").levels]


def _best_time(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def sdpa_prefill_s(ids: torch.Tensor, runs: int) -> float:
    """Best prefill time of ``ids`` with transformers' sdpa attention (the baseline)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ensure_smollm2_folder()), dtype=torch.float32, attn_implementation="sdpa",
        local_files_only=True).eval()
    best = float("inf")
    with torch.inference_mode():
        for _ in range(max(1, runs)):
            t0 = time.perf_counter()
            model(ids[None, :], use_cache=True, logits_to_keep=1)
            best = min(best, time.perf_counter() - t0)
    return best


def _decode_timed(blob: bytes, device: str, repeats: int) -> tuple[float, KVCache]:
    def run() -> KVCache:
        out = decode(blob, device=device)
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    run()  # first call: kernels compiled / loaded
    return _best_time(run, repeats)  # type: ignore[no-any-return]


BLOCK_TOKENS = 256


def block_bytes(kv: KVCache, mode: str, level: str, fmt: int = 4) -> int:
    """Bytes of ``kv`` stored as entries of ``BLOCK_TOKENS`` tokens (an engine's blocks), the
    entropy tables in blob format ``fmt`` (``entropy.encode_streams``)."""
    from kdn.codec import entropy

    with entropy.writing_format(fmt):
        return sum(len(encode(KVCache(kv.layout, [(k[:, a : a + BLOCK_TOKENS].contiguous(),
                                                   v[:, a : a + BLOCK_TOKENS].contiguous())
                                                  for k, v in kv.layers], a), mode, level))
                   for a in range(0, kv.num_tokens, BLOCK_TOKENS))


def measure(ref: Reference, name: str, mode: str, level: str, repeats: int,
            prefill_s: float, device: str = "cpu") -> Row:
    kv = ref.kv
    elements = sum(k.numel() + v.numel() for k, v in kv.layers)
    fp16_mb = elements * 2 / 1e6
    t_enc, blob = _best_time(lambda: encode(kv, mode, level), repeats)
    t_dec, out = _decode_timed(blob, device, repeats)
    out = out.to("cpu")
    q = evaluate(ref, out)
    blocks = block_bytes(kv, mode, level)
    coded = mode in ("kdn", "cachegen")
    return Row(
        mode=name,
        bits_per_element=len(blob) * 8 / elements,
        ratio_vs_fp16=elements * 2 / len(blob),
        delta_ppl_pct=q.delta_ppl_pct,
        top1_agreement=q.top1,
        kl=q.kl,
        encode_mb_s=fp16_mb / t_enc,
        decode_mb_s=fp16_mb / t_dec,
        decode_vs_prefill=t_dec / prefill_s,
        bytes=len(blob),
        bit_exact=out.equal(kv),
        device=device,
        decode_gb_s=fp16_mb / 1e3 / t_dec,
        block_bytes=blocks,
        block_ratio_vs_fp16=elements * 2 / blocks,
        block_bytes_format3=(block_bytes(kv, mode, level, fmt=3) if coded else blocks),
        block_bytes_exact_counts=(block_bytes(kv, mode, level, fmt=2) if coded else blocks),
    )


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets, each with the numbers that decide it."""
    by = {r.mode: r for r in rows}
    rows = [r for r in rows if r.device == "cpu"]
    by = {r.mode: r for r in rows}
    kdn = [r for r in rows if r.mode.startswith("kdn-")]
    cg = by["cachegen"]
    near = [r for r in kdn if r.delta_ppl_pct <= 1.0 and r.bits_per_element <= 16 / 6]
    beat = [r for r in kdn if r.bits_per_element <= 0.8 * cg.bits_per_element
            and r.delta_ppl_pct <= cg.delta_ppl_pct and r.top1_agreement >= cg.top1_agreement]
    smallest_decode = min(r.decode_vs_prefill for r in kdn)
    return [
        {"target": "kdn level with dPPL <= 1% at <= 2.67 bits/element (>= 6x)",
         "met": bool(near), "levels": [r.mode for r in near]},
        {"target": "kdn level <= 0.8x cachegen bits with dPPL and top-1 no worse",
         "met": bool(beat), "levels": [r.mode for r in beat],
         "cachegen_bits": cg.bits_per_element, "limit_bits": 0.8 * cg.bits_per_element},
        {"target": "decode of the context <= 10% of prefill (aim 5%), every kdn level",
         "met": max(r.decode_vs_prefill for r in kdn) <= 0.10,
         "worst": max(r.decode_vs_prefill for r in kdn), "best": smallest_decode},
        {"target": "lossless bit-exact", "met": by["lossless"].bit_exact},
    ]


def plot(rows: list[Row], path: Path, title: str) -> None:
    fig, axes = figure(12, 4.8, ncols=2)
    import matplotlib.ticker

    for ax, key, label in ((axes[0], "delta_ppl_pct", "ΔPPL (%)"), (axes[1], "kl", "mean KL")):
        for family, marker in (("kdn-", "o"), ("cachegen", "s"), ("int8", "^"),
                               ("lossless", "D")):
            pts = [r for r in rows if r.mode.startswith(family)]
            xs = [r.bits_per_element for r in pts]
            ys = [max(getattr(r, key), 1e-5) if key == "kl" else getattr(r, key) for r in pts]
            ax.plot(xs, ys, marker=marker, linestyle="-" if family == "kdn-" else "",
                    label=family.rstrip("-"))
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(r.mode.removeprefix("kdn-"), (x, y), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_xscale("log")
        ax.set_xticks([1.5, 2, 3, 4, 6, 8, 12, 16])
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("bits per element (all bytes stored)")
        ax.set_ylabel(label)
        if key == "kl":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="512 context + 128 eval tokens")
    ap.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    ap.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--repeats", type=int, default=2, help="encode/decode timing runs (best)")
    args = ap.parse_args(argv)
    ctx, n_eval = (512, 128) if args.quick else (2048, 512)
    model, tok = load_model("smollm2-135m")
    t0 = time.perf_counter()
    ref = prepare(model, tok, ctx, n_eval, prefill_runs=1 if args.quick else 2)
    from kdn.model.data import english_token_ids

    ids = torch.as_tensor(english_token_ids(ctx + n_eval + 1, tok)[:ctx])  # prepare()'s context
    prefill_s = sdpa_prefill_s(ids, 1 if args.quick else 2)
    print(f"SmolLM2-135M: sdpa prefill of {ctx} tokens {prefill_s:.2f}s "
          f"(eager {ref.prefill_s:.2f}s), "
          f"PPL of the next {n_eval} tokens {ref.ppl:.3f} (original fp16 KV); "
          f"cache {ref.kv.nbytes / 1e6:.1f} MB fp16 ({ref.kv.layout.bytes_per_token} B/token)")
    rows = []
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    for name, mode, level in codecs():
        for device in devices:
            if device != "cpu" and mode == "lossless":
                continue  # no GPU decoder for zstd: it decodes on the CPU either way
            rows.append(measure(ref, name, mode, level, args.repeats, prefill_s, device))
        print(f"  {name}: done ({time.perf_counter() - t0:.0f}s)", flush=True)
    print_table([asdict(r) for r in rows], COLUMNS)
    goals = targets(rows)
    for t in goals:
        print(("MET    " if t["met"] else "MISSED ") + json.dumps(t))
    write_json(args.out, "codec", [asdict(r) for r in rows], model="smollm2-135m",
               context_tokens=ctx, eval_tokens=n_eval, prefill_s=prefill_s,
               prefill_attention="sdpa", eager_prefill_s=ref.prefill_s,
               ppl_original=ref.ppl, fp16_bytes=ref.kv.nbytes,
               torch_threads=torch.get_num_threads(), targets=goals)
    png = args.png or args.out.with_suffix(".png")
    plot(rows, png, f"SmolLM2-135M KV codecs: {ctx}-token context, {n_eval} eval tokens")


if __name__ == "__main__":
    main()
