"""Blending non-prefix RAG chunks on SmolLM2-135M: quality and TTFT against full prefill.

    python -m bench.blend [--quick] --out bench/results/blend.json
    python -m bench.blend --gpu [--quick]       # TTFT at 8B shape on the device: bench.blend_gpu

Data (SQuAD v1.1 dev): the paragraphs of a set of articles are joined, in article order, into
chunks of about 512 tokens (consecutive paragraphs; a chunk closes once it reaches
``--min-chunk`` tokens or the next paragraph would pass ``--max-chunk``). Each case is a
question with the chunk holding its gold paragraph plus the ``k`` other chunks of the corpus
most similar to the question (all-MiniLM-L6-v2; a chunk's score is its best paragraph's cosine
similarity). The ``k`` retrieved chunks keep their retrieval order and the gold chunk is
inserted at a seeded random slot, so it is often not first.

Prompt (SmolLM2-Instruct chat template, tokenized piece by piece so every method sees the same
ids): ``<system + user header>`` | chunk 1 | ... | chunk k+1 | ``question + assistant header``.
Each chunk's KV is prefilled alone from position 0 once and kept in memory across cases
(chunks recur), as if delivered by kdn from RAM.

Methods, all in one run on the same model (SDPA attention for every method):
* ``full-prefill``: the whole prompt prefilled;
* ``prefix-only``: the KV of the system header + first chunk reused (exact), the rest prefilled
  (run on the first ``--prefix-cases`` cases only: its quality equals full prefill by
  construction, so only its cost is of interest);
* ``naive-concat``: re-positioned chunk KV concatenated, only the uncached text computed;
* ``blend``: ``kdn.blend`` at each ratio in ``--ratios`` with kdn's default selection
  (``selection`` ``question``: the cached tokens the question attends to most in a
  no-recompute first pass, ``--query-share 1``), and at each ratio in ``--deviation-ratios``
  with CacheBlend's selection alone (``selection`` ``deviation``: largest K/V deviation at
  ``--select-layer``), so the two are compared in the same run, and at each ratio in
  ``--head-ratios`` with EPIC's rule alone (``selection`` ``chunk-head``: each chunk's first
  ``ratio`` x mean-chunk-length tokens, no scoring pass; ``recomputed_ratio`` says the share
  it came to).

Per method: ``ttft_s`` (mean prompt-to-first-token wall seconds), ``ttft_vs_full`` (mean
per-case ratio to that case's full prefill), ``ttft_cpu_s``/``cpu_vs_full`` (the same in process
CPU seconds: on a CPU shared with other work, wall times of methods run minutes apart are not
comparable, CPU seconds are; torch runs ``--threads`` threads, default 1), ``answer_nll``
(mean per-token NLL of the gold answer, teacher-forced), ``f1`` (SQuAD token F1 of the greedy
answer, <= 16 tokens),
``agreement_with_full`` (fraction of positions where the greedy output equals full prefill's),
``first_token_kl`` (KL(full || method) of the next-token distribution after the prompt: a
finer signal than F1 when the small model rarely answers right), and both NLL gaps to full
prefill. Teacher forcing and greedy decoding run on
``kdn.blend.decode`` (same code for every method). Results are written after every case
(``complete`` false until the end), plus a PNG of quality against recompute ratio.
``nll_gap_pct_lo``/``nll_gap_pct_hi`` bound the NLL gap's 95% interval over the case sample
(paired per-case differences): how far the gap could move on another draw of questions.
``--summarize FILE`` recomputes a saved result's rows from its per-case data without running.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import figure, positive_int, print_table, save_figure, write_json
from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.decode import Continuation
from kdn.cache import KVCache
from kdn.layout import DType, KVLayout
from kdn.model import hf
from kdn.model.data import load_squad_dev
from kdn.model.data import squad_f1 as f1
from kdn.model.hf import model_layout
from kdn.model.models import load_model

HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nAnswer the question using the documents below.\n\n")
TAIL = "Question: {q}\nAnswer with a few words.<|im_end|>\n<|im_start|>assistant\n"
MAX_NEW = 16


@dataclass(frozen=True)
class Chunk:
    ids: list[int]
    paragraphs: tuple[int, ...]
    """Indices into the corpus paragraph list."""


@dataclass(frozen=True)
class Case:
    question: str
    answers: tuple[str, ...]
    chunks: tuple[int, ...]
    """Chunk indices in prompt order."""
    gold_slot: int


# -- data -----------------------------------------------------------------------------------


def build_corpus(tok: Any, n_articles: int, min_chunk: int, max_chunk: int, seed: int
                 ) -> tuple[list[str], list[Chunk], list[tuple[int, Any]]]:
    """(paragraph texts, chunks, (paragraph index, qa) for every question) of the articles."""
    articles = list(load_squad_dev())
    random.Random(seed).shuffle(articles)
    texts: list[str] = []
    chunks: list[Chunk] = []
    qas: list[tuple[int, Any]] = []
    for art in articles[:n_articles]:
        cur: list[int] = []
        cur_tokens = 0
        for para in art.paragraphs:
            n = len(tok(para.context + "\n", add_special_tokens=False)["input_ids"])
            if cur and (cur_tokens >= min_chunk or cur_tokens + n > max_chunk):
                chunks.append(_chunk(tok, texts, cur))
                cur, cur_tokens = [], 0
            texts.append(para.context)
            cur.append(len(texts) - 1)
            cur_tokens += n
            qas.extend((len(texts) - 1, qa) for qa in para.qas)
        if cur:
            chunks.append(_chunk(tok, texts, cur))
    return texts, chunks, qas


def _chunk(tok: Any, texts: list[str], paras: list[int]) -> Chunk:
    text = "\n".join(texts[i] for i in paras) + "\n\n"
    return Chunk(tok(text, add_special_tokens=False)["input_ids"], tuple(paras))


def build_cases(texts: list[str], chunks: list[Chunk], qas: list[tuple[int, Any]], n: int,
                k: int, seed: int) -> list[Case]:
    from kdn.model.embed import Embedder

    rng = random.Random(seed)
    picked = rng.sample(qas, n)
    emb = Embedder()
    para_vecs = emb.embed(texts)  # [paragraphs, 384]
    q_vecs = emb.embed([qa.question for _, qa in picked])  # [n, 384]
    owner = {p: c for c, ch in enumerate(chunks) for p in ch.paragraphs}
    sims = q_vecs @ para_vecs.T  # [n, paragraphs]
    cases = []
    for j, (para, qa) in enumerate(picked):
        scores = torch.full((len(chunks),), -1.0)
        for p, c in owner.items():
            scores[c] = max(float(scores[c]), float(sims[j, p]))
        gold = owner[para]
        scores[gold] = float("-inf")
        others = torch.topk(scores, k).indices.tolist()
        slot = rng.randrange(k + 1)
        order = others[:slot] + [gold] + others[slot:]
        cases.append(Case(qa.question, qa.answers, tuple(order), slot))
    return cases


# -- metrics --------------------------------------------------------------------------------


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where two token sequences agree."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


# -- methods --------------------------------------------------------------------------------


@dataclass
class Outcome:
    ttft_s: float
    kv: KVCache
    logits: torch.Tensor
    cpu_s: float = 0.0
    """Process CPU seconds of the same span (steadier than wall time on a shared machine)."""
    recomputed: float = 1.0
    """Fraction of the cached tokens computed (1 for a prefill, 0 for naive concatenation)."""


class Clock:
    """Wall and process-CPU seconds since creation."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


@torch.inference_mode()
def continue_from(model: Any, out: Outcome, answer: list[int], stop: set[int]
                  ) -> tuple[float, list[int]]:
    """(teacher-forced mean NLL of ``answer``, greedy continuation) after a prompt's KV.

    Both run on ``kdn.blend.decode.Continuation`` (preallocated KV, the model's own modules),
    the same code for every method."""
    logp = torch.log_softmax(out.logits.float(), -1)
    nll = [-float(logp[answer[0]])]
    if len(answer) > 1:
        lp = torch.log_softmax(Continuation(model, out.kv, len(answer)).forward(answer[:-1])
                               .float(), -1)
        nll += [-float(lp[i, t]) for i, t in enumerate(answer[1:])]
    return sum(nll) / len(nll), hf.greedy(Continuation(model, out.kv, MAX_NEW), out.logits,
                                          MAX_NEW, stop)


@torch.inference_mode()
def full_prefill(model: Any, ids: list[int], layout: KVLayout) -> Outcome:
    clock = Clock()
    o = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    logits = o.logits[0, -1]
    int(logits.argmax())
    wall, cpu = clock.stop()
    return Outcome(wall, hf.from_transformers(o.past_key_values, layout), logits, cpu)


@torch.inference_mode()
def prefix_only(model: Any, ids: list[int], prefix: KVCache, layout: KVLayout) -> Outcome:
    n = prefix.num_tokens
    clock = Clock()
    o = model(torch.tensor([ids[n:]]), past_key_values=hf.to_transformers(prefix), use_cache=True,
              logits_to_keep=1)
    logits = o.logits[0, -1]
    int(logits.argmax())
    wall, cpu = clock.stop()
    return Outcome(wall, hf.from_transformers(o.past_key_values, layout), logits, cpu)


def blended(model: Any, pieces: list[Piece], ratio: float, cfg: BlendConfig,
            **change: Any) -> Outcome:
    """kdn.blend at ``ratio`` with ``cfg``'s other settings, less the ones in ``change``."""
    clock = Clock()
    r = blend(model, pieces, dataclasses.replace(cfg, ratio=ratio, **change))
    int(r.logits.argmax())
    wall, cpu = clock.stop()
    share = r.timings.recomputed_tokens / max(1, r.timings.cached_tokens)
    return Outcome(wall, r.kv, r.logits, cpu, share)


def head_tokens_for(pieces: list[Piece], ratio: float) -> int:
    """Tokens per chunk head that make ``ratio`` of the prompt's cached tokens (EPIC's rule:
    recompute each chunk's first tokens only)."""
    sizes = [len(p.ids) for p in pieces if p.kv is not None]
    return max(1, round(ratio * sum(sizes) / len(sizes)))


def run_methods(model: Any, tok: Any, ids: list[int], pieces: list[Piece], layout: KVLayout,
                ratios: list[float], deviation_ratios: list[float], cfg: BlendConfig,
                prefix_tokens: int, answer: list[int], stop: set[int],
                corrected: tuple[list[float], float, float] = ([], 0.0, 0.0),
                head_ratios: tuple[float, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every method on one prompt: {name: {ttft, nll, agree, text}}."""
    full = full_prefill(model, ids, layout)
    outcomes = {"full-prefill": full}
    if prefix_tokens:
        outcomes["prefix-only"] = prefix_only(model, ids, full.kv.slice(0, prefix_tokens), layout)
    outcomes["naive-concat"] = blended(model, pieces, 0.0, cfg)
    for r in ratios:
        outcomes[f"blend@{r}"] = blended(model, pieces, r, cfg)
    for r in deviation_ratios:
        outcomes[f"blend@{r}/deviation"] = blended(model, pieces, r, cfg, query_share=0.0)
    for r in head_ratios:  # chunk heads alone (ratio 0: nothing besides the heads)
        outcomes[f"blend@{r}/chunk-head"] = blended(
            model, pieces, 0.0, cfg, head_tokens=head_tokens_for(pieces, r), per_chunk=False)
    for r in corrected[0]:
        outcomes[f"blend@{r}/corrected"] = blended(model, pieces, r, cfg, correct_k=corrected[1],
                                                   correct_v=corrected[2])
    results: dict[str, dict[str, Any]] = {}
    full_gen: list[int] = []
    ref = torch.log_softmax(full.logits.float(), -1)
    for name, out in outcomes.items():
        nll, gen = continue_from(model, out, answer, stop)
        kl = float((ref.exp() * (ref - torch.log_softmax(out.logits.float(), -1))).sum())
        full_gen = full_gen or gen
        text = tok.decode([t for t in gen if t not in stop], skip_special_tokens=True)
        results[name] = {"ttft": out.ttft_s, "cpu": out.cpu_s, "nll": nll, "kl": kl,
                         "agree": agreement(gen, full_gen), "text": text,
                         "recomputed": out.recomputed}
    return results


# -- driver ---------------------------------------------------------------------------------


def gap_interval(nll: list[float], ref: list[float], z: float = 1.96) -> tuple[float, float]:
    """Normal-approximation interval (default 95%) of the mean NLL gap in percent of the mean
    reference NLL, from the per-case paired differences: the cases are a sample of questions,
    and the same case runs under every method, so the pairing removes the case-to-case spread
    of the NLL itself."""
    n = len(nll)
    if n != len(ref) or n == 0:
        raise ValueError(f"need the same non-zero number of cases, got {n} and {len(ref)}")
    diffs = [a - b for a, b in zip(nll, ref)]
    mean = sum(diffs) / n
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5 if n > 1 else 0.0
    half = z * sd / n ** 0.5
    base = sum(ref) / n
    return 100 * (mean - half) / base, 100 * (mean + half) / base


def summarize(per: dict[str, list[dict[str, float]]], selection: str = "question"
              ) -> list[dict[str, Any]]:
    rows = []
    full = {c["case"]: c for c in per["full-prefill"]}
    for name, cases in per.items():
        name, _, sel = name.partition("/")
        method, _, ratio = name.partition("@")
        n = len(cases)
        nll = sum(c["nll"] for c in cases) / n
        ref_nll = sum(full[c["case"]]["nll"] for c in cases) / n
        lo, hi = gap_interval([c["nll"] for c in cases], [full[c["case"]]["nll"] for c in cases])
        rows.append({
            "method": method,
            "ratio": float(ratio) if ratio else (0.0 if method == "naive-concat" else 1.0),
            "selection": (sel or selection) if method == "blend" else "",
            "cases": n,
            "recomputed_ratio": (sum(c["recomputed"] for c in cases) / n
                                 if all("recomputed" in c for c in cases) else None),
            "ttft_s": sum(c["ttft"] for c in cases) / n,
            "ttft_vs_full": sum(c["ttft"] / full[c["case"]]["ttft"] for c in cases) / n,
            "ttft_cpu_s": sum(c["cpu"] for c in cases) / n,
            "cpu_vs_full": sum(c["cpu"] / full[c["case"]]["cpu"] for c in cases) / n,
            "answer_nll": nll,
            "nll_gap": nll - ref_nll,
            "nll_gap_pct": 100 * (nll - ref_nll) / ref_nll,
            "nll_gap_pct_lo": lo,
            "nll_gap_pct_hi": hi,
            "first_token_kl": sum(c["kl"] for c in cases) / n,
            "f1": sum(c["f1"] for c in cases) / n,
            "agreement_with_full": sum(c["agree"] for c in cases) / n,
        })
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    ref = {r["method"]: r for r in rows if r["method"] != "blend"}
    selections = sorted({r["selection"] for r in rows if r["method"] == "blend"})
    fig, axes = figure(13, 3.8, ncols=3)
    for ax, key, label in zip(axes, ("answer_nll", "f1", "agreement_with_full"),
                              ("answer NLL (lower is better)", "F1", "agreement with full")):
        for sel, style in zip(selections, ("o-", "s--", "^:")):
            blends = sorted((r for r in rows if r["method"] == "blend" and r["selection"] == sel),
                            key=lambda r: r["ratio"])
            xs = [0.0] + [r["ratio"] for r in blends] + [1.0]
            ys = [ref["naive-concat"][key]] + [r[key] for r in blends] + [
                ref["full-prefill"][key]]
            ax.plot(xs, ys, style, label=f"blend, {sel} selection")
        ax.axhline(ref["full-prefill"][key], color="g", ls="--", label="full prefill")
        ax.axhline(ref["naive-concat"][key], color="r", ls=":", label="naive concat")
        ax.set_xlabel("recompute ratio (0 = naive concat, 1 = full prefill)")
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("kdn.blend on SmolLM2-135M, SQuAD RAG prompts")
    save_figure(fig, path)


def main() -> None:
    if "--gpu" in sys.argv[1:]:  # the device timing mode has options of its own
        from bench.blend_gpu import main as gpu_main

        gpu_main([a for a in sys.argv[1:] if a != "--gpu"])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true",
                    help="time blending at 8B shape on the device instead (bench.blend_gpu; "
                         "--gpu --help lists its options)")
    ap.add_argument("--quick", action="store_true", help="5 cases")
    ap.add_argument("--cases", type=positive_int, default=50)
    ap.add_argument("--k", type=int, default=3, help="retrieved chunks besides the gold one")
    ap.add_argument("--articles", type=int, default=6)
    ap.add_argument("--min-chunk", type=int, default=448)
    ap.add_argument("--max-chunk", type=int, default=640)
    ap.add_argument("--ratios", default="0.05,0.1,0.15,0.2,0.3")
    ap.add_argument("--deviation-ratios", default="0.15",
                    help="ratios also run with deviation-only selection ('' for none)")
    ap.add_argument("--head-ratios", default="0.15",
                    help="ratios also run with EPIC's chunk-head rule (selection 'chunk-head': "
                         "each chunk's first ratio x mean-chunk tokens, nothing else; '' none)")
    ap.add_argument("--corrected-ratios", default="",
                    help="ratios also run with the stale-token correction (selection "
                         "'corrected': --correct-k/--correct-v on top of the --ratios rule)")
    ap.add_argument("--correct-k", type=float, default=0.3)
    ap.add_argument("--correct-v", type=float, default=1.0)
    ap.add_argument("--query-share", type=float, default=1.0,
                    help="kdn.blend query_share of the --ratios rows")
    ap.add_argument("--select-layer", type=int, default=1)
    ap.add_argument("--head-tokens", type=int, default=0)
    ap.add_argument("--per-chunk", action="store_true")
    ap.add_argument("--prefix-cases", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps timings steadier on a shared CPU)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/blend.json"))
    ap.add_argument("--summarize", type=Path, metavar="FILE",
                    help="run nothing: recompute the rows and PNG of a saved result from its "
                         "per-case data (e.g. after a change to the summary), in place")
    args = ap.parse_args()
    if args.summarize:
        resummarize(args.summarize)
        return
    n_cases = 5 if args.quick else args.cases
    ratios = [float(r) for r in args.ratios.split(",")]
    deviation_ratios = [float(r) for r in args.deviation_ratios.split(",") if r.strip()]
    head_ratios = tuple(float(r) for r in args.head_ratios.split(",") if r.strip())
    corrected = ([float(r) for r in args.corrected_ratios.split(",") if r.strip()],
                 args.correct_k, args.correct_v)
    cfg = BlendConfig(select_layer=args.select_layer, head_tokens=args.head_tokens,
                      per_chunk=args.per_chunk, query_share=args.query_share)
    selection = selection_name(cfg.query_share)

    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m")
    model.set_attn_implementation("sdpa")
    layout = model_layout(model, DType.FLOAT32)
    t0 = time.perf_counter()
    texts, chunks, qas = build_corpus(tok, args.articles, args.min_chunk, args.max_chunk,
                                      args.seed)
    cases = build_cases(texts, chunks, qas, n_cases, args.k, args.seed)
    print(f"{len(chunks)} chunks (mean {sum(len(c.ids) for c in chunks) / len(chunks):.0f} "
          f"tokens) from {args.articles} articles; {n_cases} cases; setup "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    stop = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])}
    head = tok(HEAD, add_special_tokens=False)["input_ids"]
    chunk_kv: dict[int, KVCache] = {}
    per: dict[str, list[dict[str, float]]] = {}
    prompt_tokens = []
    for ci, case in enumerate(cases):
        tc = time.perf_counter()
        for c in case.chunks:
            if c not in chunk_kv:
                with torch.inference_mode():
                    o = model(torch.tensor([chunks[c].ids]), use_cache=True, logits_to_keep=1)
                chunk_kv[c] = hf.from_transformers(o.past_key_values, layout)
        tail = tok(TAIL.format(q=case.question), add_special_tokens=False)["input_ids"]
        answer = tok(case.answers[0], add_special_tokens=False)["input_ids"]
        pieces = [Piece(head)] + [Piece(chunks[c].ids, chunk_kv[c]) for c in case.chunks] + [
            Piece(tail)]
        ids = [t for p in pieces for t in p.ids]
        prompt_tokens.append(len(ids))
        with_prefix = len(head) + len(chunks[case.chunks[0]].ids) if ci < args.prefix_cases \
            else 0
        for name, res in run_methods(model, tok, ids, pieces, layout, ratios, deviation_ratios,
                                     cfg, with_prefix, answer, stop, corrected,
                                     head_ratios).items():
            per.setdefault(name, []).append({"case": ci, "f1": f1(res.pop("text"),
                                                                   case.answers), **res})
        rows = summarize(per, selection)
        print(f"case {ci + 1}/{n_cases}: {len(ids)} tokens, gold slot {case.gold_slot}, "
              f"{time.perf_counter() - tc:.0f} s; full {per['full-prefill'][-1]['ttft']:.1f} s "
              f"f1 {per['full-prefill'][-1]['f1']:.2f}", flush=True)
        write_json(args.out, "blend", rows, complete=ci + 1 == n_cases, cases_done=ci + 1,
                   config=_config(args, n_cases, chunks, prompt_tokens, cfg), per_case=per)
        if (ci + 1) % 5 == 0 or ci + 1 == n_cases:
            plot(rows, args.out.with_suffix(".png"))
    print_table(rows, COLUMNS)


COLUMNS = ["method", "ratio", "selection", "cases", "recomputed_ratio", "ttft_s", "ttft_vs_full",
           "ttft_cpu_s", "cpu_vs_full", "answer_nll", "nll_gap", "nll_gap_pct", "nll_gap_pct_lo",
           "nll_gap_pct_hi", "first_token_kl", "f1", "agreement_with_full"]


def selection_name(query_share: float) -> str:
    return {0.0: "deviation", 1.0: "question"}.get(query_share, "mixed")


def resummarize(path: Path) -> None:
    """Rewrite ``path``'s rows (and its PNG, when complete) from its ``per_case`` data; the
    measurement's time, machine and config are kept."""
    doc = json.loads(path.read_text())
    if "per_case" not in doc:
        raise SystemExit(f"{path} holds no per_case data to summarize")
    share = float(doc.get("config", {}).get("query_share", 1.0))
    doc["rows"] = summarize(doc["per_case"], selection_name(share))
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if doc.get("complete"):
        plot(doc["rows"], path.with_suffix(".png"))
    print_table(doc["rows"], COLUMNS)


def _config(args: argparse.Namespace, n_cases: int, chunks: list[Chunk], prompt_tokens: list[int],
            cfg: BlendConfig) -> dict[str, Any]:
    return {
        "model": "smollm2-135m (fp32, sdpa attention for every method)",
        "cases": n_cases, "k_other_chunks": args.k, "articles": args.articles,
        "chunk_tokens_mean": sum(len(c.ids) for c in chunks) / len(chunks),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "prefix_only_cases": min(args.prefix_cases, n_cases),
        "select_layer": cfg.select_layer, "head_tokens": cfg.head_tokens,
        "per_chunk": cfg.per_chunk, "query_share": cfg.query_share,
        "attention_from": cfg.attention_from,
        "head_ratios": args.head_ratios, "corrected_ratios": args.corrected_ratios,
        "correct_k": args.correct_k, "correct_v": args.correct_v,
        "max_new_tokens": MAX_NEW, "seed": args.seed,
        "torch_threads": args.threads,
    }


if __name__ == "__main__":
    main()
