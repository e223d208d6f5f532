"""RAG on SmolLM2-135M: in-context learning vs prefix caching vs kdn blending (KDN paper Table 1).

    python -m bench.rag [--quick] --out bench/results/rag.json

Corpus: the first ``--paragraphs`` paragraphs of ``--articles`` SQuAD v1.1 dev articles (seeded
shuffle), one document per article (paragraphs joined by blank lines), ingested with
``kdn.rag.KnowledgeBase`` into a kdn server started for the run (``kdn serve`` subprocess: RAM +
LMDB tiers): ~``--chunk-tokens``-token chunks on paragraph/sentence boundaries, MiniLM
embeddings, each chunk's KV prefilled alone and stored ``lossless``. The corpus is then
ingested a second time to check that nothing is recomputed.

Cases: questions about those articles (seeded sample); the ``--k`` chunks retrieved for each
question (MiniLM, cosine) in retrieval order make the prompt (SmolLM2 chat template, the same
token ids for every method): ``head | chunk 1 | ... | chunk k | question + assistant header``.

Methods, one after another on each case, all with SDPA attention:
* ``in-context``: the whole prompt prefilled (the retrieved text is the knowledge);
* ``prefix-only``: prefix caching's best case in RAG: the KV of the head and the first
  retrieved chunk is already in memory (it was the prefix of an earlier prompt), the rest of
  the prompt is prefilled on top;
* ``kdn-blend``: ``KnowledgeBase``'s path: every chunk's KV streamed from the kdn server and
  blended with the uncached text by selective recompute (``--ratio``).

Per method: ``ttft_s`` (question to first token, retrieval included, mean), ``ttft_vs_in_context``
(mean per-case ratio), ``compute_s`` (model compute seconds per request: prompt processing +
decoding the answer, excluding waits for KV on the wire), ``cpu_s`` (process CPU seconds per
request), ``f1`` (SQuAD token F1 of the greedy answer, <= 16 tokens), ``answer_nll`` (mean
per-token NLL of the gold answer, teacher-forced), ``agreement_with_in_context``, and
``ingest_s_per_1k_tokens``: the time to inject new knowledge, per 1,000 corpus tokens:
embedding only for in-context and prefix-only (their knowledge is the text itself; a prefix
cache fills lazily), embedding + prefill + store for kdn-blend. JSON is written after every case
(``complete`` false until the end), plus a PNG.

Threads: ``--threads`` (default 1) intra-op threads for the model. On a machine whose few cores
are shared with other busy processes, two spinning OpenMP threads run a prefill about five times
slower than one; every method runs under the same setting.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.blend import HEAD, MAX_NEW, TAIL, Outcome, agreement, f1, full_prefill, prefix_only
from bench.common import figure, positive_int, print_table, save_figure, write_json
from kdn.client import Client
from kdn.model import hf
from kdn.model.data import load_squad_dev
from kdn.rag import Document, KnowledgeBase, RagConfig, RagEngine
from kdn.rag.corpus import chunk_ids

METHODS = ("in-context", "prefix-only", "kdn-blend")


@contextmanager
def kdn_server(data_dir: Path) -> Any:
    """A ``kdn serve`` subprocess on a free port; yields its address once it answers health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KDN_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kdn", "serve", "--port", str(port),
                             "--data-dir", str(data_dir), "--ram-bytes", "3GiB",
                             "--disk-bytes", "8GiB"], env=env)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address, timeout_s=2) as probe:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if probe.health() == "SERVING":
                        break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("kdn serve did not start") from None
                    time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def squad_documents(n_articles: int, n_paragraphs: int, seed: int
                    ) -> tuple[list[Document], list[Any]]:
    """(one document per article: its first paragraphs, every qa of those paragraphs)."""
    import random

    articles = list(load_squad_dev())
    random.Random(seed).shuffle(articles)
    docs: list[Document] = []
    qas: list[Any] = []
    for art in articles[:n_articles]:
        paras = art.paragraphs[:n_paragraphs]
        docs.append(Document(art.title, "\n\n".join(p.context for p in paras)))
        qas.extend(qa for p in paras for qa in p.qas)
    return docs, qas


@torch.inference_mode()
def answer_nll(model: Any, out: Outcome, answer: list[int]) -> float:
    """Mean per-token NLL of ``answer`` teacher-forced after a prompt's KV and logits."""
    nll = [-float(torch.log_softmax(out.logits.float(), -1)[answer[0]])]
    if len(answer) > 1:
        o = model(torch.tensor([answer[:-1]]), past_key_values=hf.to_transformers(out.kv))
        lp = torch.log_softmax(o.logits[0].float(), -1)
        nll += [-float(lp[i, t]) for i, t in enumerate(answer[1:])]
    return sum(nll) / len(nll)


def run_case(kb: KnowledgeBase, question: str, answers: tuple[str, ...]) -> dict[str, Any]:
    engine = kb.engine
    model, tok, layout = engine.model, engine.tokenizer, engine.layout
    t0 = time.perf_counter()
    sources = kb.retrieve(question)
    retrieval_s = time.perf_counter() - t0
    texts = [s.text for s in sources]
    ids = engine.head_ids + [t for c in texts for t in chunk_ids(tok, c)] + engine.tail_ids(
        question)
    prefix = len(engine.head_ids) + len(chunk_ids(tok, texts[0]))
    gold = chunk_ids(tok, answers[0])
    res: dict[str, dict[str, Any]] = {}

    def finish(name: str, out: Outcome, prompt_compute_s: float, cpu0: float) -> None:
        tg = time.perf_counter()
        gen = hf.greedy(hf.CacheDecoder(model, hf.to_transformers(out.kv)), out.logits,
                        MAX_NEW, engine.stop)
        gen_s = time.perf_counter() - tg
        cpu = time.process_time() - cpu0
        text = tok.decode([t for t in gen if t not in engine.stop], skip_special_tokens=True)
        res[name] = {"ttft": retrieval_s + out.ttft_s, "compute": prompt_compute_s + gen_s,
                     "cpu": cpu, "gen": gen, "text": text.strip(), "f1": f1(text, answers),
                     "nll": answer_nll(model, out, gold)}

    c0 = time.process_time()
    full = full_prefill(model, ids, layout)
    finish("in-context", full, full.ttft_s, c0)
    c0 = time.process_time()
    pre = prefix_only(model, ids, full.kv.slice(0, prefix), layout)
    finish("prefix-only", pre, pre.ttft_s, c0)
    c0 = time.process_time()
    prepared = engine.prepare(question, texts, salt=kb.manifest.salt)  # the keys it stored
    t = prepared.timings
    finish("kdn-blend", Outcome(t.ttft_s, prepared.kv, prepared.logits),
           t.prefill_missing_s + t.blend_s, c0)
    res["kdn-blend"].update(fetch=t.fetch_s, blend=t.blend_s, missing=t.missing_chunks,
                            recomputed=t.recomputed_tokens, cached=t.cached_tokens)
    ref = res["in-context"]["gen"]
    for r in res.values():
        r["agree"] = agreement(r.pop("gen"), ref)
    hit = any(a.lower() in c.lower() for a in answers for c in texts)
    return {"prompt_tokens": len(ids), "answer_in_context": hit, "methods": res}


def summarize(cases: list[dict[str, Any]], ingest: dict[str, Any]) -> list[dict[str, Any]]:
    n = len(cases)
    rows = []
    for m in METHODS:
        rs = [c["methods"][m] for c in cases]
        row: dict[str, Any] = {
            "method": m, "cases": n,
            "ttft_s": sum(r["ttft"] for r in rs) / n,
            "ttft_vs_in_context": sum(r["ttft"] / c["methods"]["in-context"]["ttft"]
                                      for r, c in zip(rs, cases)) / n,
            "compute_s": sum(r["compute"] for r in rs) / n,
            "cpu_s": sum(r["cpu"] for r in rs) / n,
            "f1": sum(r["f1"] for r in rs) / n,
            "answer_nll": sum(r["nll"] for r in rs) / n,
            "agreement_with_in_context": sum(r["agree"] for r in rs) / n,
            "ingest_s_per_1k_tokens": ingest["kdn_s_per_1k"] if m == "kdn-blend"
            else ingest["embed_s_per_1k"],
        }
        if m == "kdn-blend":
            row["fetch_s"] = sum(r["fetch"] for r in rs) / n
            row["blend_s"] = sum(r["blend"] for r in rs) / n
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    names = [r["method"] for r in rows]
    colors = ["tab:gray", "tab:blue", "tab:green"]
    fig, axes = figure(15, 3.6, ncols=4)
    panels = [("ttft_s", "time to first token (s)"), ("compute_s", "compute s / request"),
              ("f1", "answer F1"), ("ingest_s_per_1k_tokens", "inject knowledge: s / 1k tokens")]
    for ax, (key, label) in zip(axes, panels):
        vals = [r[key] for r in rows]
        bars = ax.bar(names, vals, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 article of 8 paragraphs, 2 cases")
    ap.add_argument("--cases", type=positive_int, default=12)
    ap.add_argument("--articles", type=int, default=3)
    ap.add_argument("--paragraphs", type=int, default=6, help="first paragraphs per article")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--k", type=int, default=4, help="chunks retrieved per question")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--address", default="", help="use this kdn server instead of starting one")
    ap.add_argument("--out", type=Path, default=Path("bench/results/rag.json"))
    args = ap.parse_args()
    n_cases, n_articles, n_paras = (2, 1, 8) if args.quick else (args.cases, args.articles,
                                                                  args.paragraphs)
    torch.set_num_threads(args.threads)

    from kdn.model.embed import Embedder
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    model.set_attn_implementation("sdpa")
    docs, qas = squad_documents(n_articles, n_paras, args.seed)
    import random

    picked = random.Random(args.seed).sample(qas, n_cases)
    cfg = RagConfig(top_k=args.k, target_tokens=args.chunk_tokens,
                    max_tokens=args.chunk_tokens + args.chunk_tokens // 2,
                    blend_ratio=args.ratio, max_new_tokens=MAX_NEW, namespace="bench-rag",
                    head=HEAD, tail=TAIL.replace("{q}", "{question}"))
    with tempfile.TemporaryDirectory(prefix="kdn-bench-rag-") as tmp:
        server = kdn_server(Path(tmp) / "data") if not args.address else None
        address = server.__enter__() if server is not None else args.address
        try:
            with Client(address, timeout_s=120) as client:
                kb = KnowledgeBase(RagEngine(model, tok, client, cfg), Path(tmp) / "state",
                                   Embedder())
                _run(args, kb, docs, picked, n_cases)
        finally:
            if server is not None:
                server.__exit__(None, None, None)


def _run(args: argparse.Namespace, kb: KnowledgeBase, docs: list[Document], picked: list[Any],
         n_cases: int) -> None:
    first = kb.ingest(docs, progress=True)
    print(first.summary(), flush=True)
    again = kb.ingest(docs)
    print(f"re-ingest: {again.summary()}", flush=True)
    tokens = max(1, first.computed_tokens)
    ingest = {
        "first": asdict(first), "reingest": asdict(again),
        "reingest_recomputed_chunks": again.computed,
        "kdn_s_per_1k": 1000 * first.total_s / tokens,
        "embed_s_per_1k": 1000 * first.embed_s / tokens,
        "prefill_s_per_1k": 1000 * first.prefill_s / tokens,
        "store_s_per_1k": 1000 * first.store_s / tokens,
    }
    cases: list[dict[str, Any]] = []
    config = {
        "model": "smollm2-135m (fp32, sdpa attention for every method)",
        "articles": len(docs), "chunks": first.chunks,
        "chunk_tokens_mean": first.tokens / max(1, first.chunks), "k": args.k,
        "blend_ratio": args.ratio, "select_layer": kb.engine.config.select_layer,
        "codec": "lossless", "max_new_tokens": MAX_NEW, "seed": args.seed,
        "torch_threads": torch.get_num_threads(), "corpus_tokens": first.tokens,
        "server": "kdn serve subprocess (RAM + LMDB tiers), loopback gRPC",
    }
    for ci, qa in enumerate(picked):
        tc = time.perf_counter()
        case = run_case(kb, qa.question, qa.answers)
        cases.append({"question": qa.question, "answers": list(qa.answers), **case})
        rows = summarize(cases, ingest)
        m = case["methods"]
        print(f"case {ci + 1}/{n_cases}: {case['prompt_tokens']} tokens, "
              f"{time.perf_counter() - tc:.0f} s; ttft in-context {m['in-context']['ttft']:.1f}"
              f" prefix {m['prefix-only']['ttft']:.1f} kdn {m['kdn-blend']['ttft']:.1f} s; f1 "
              f"{m['in-context']['f1']:.2f}/{m['prefix-only']['f1']:.2f}/"
              f"{m['kdn-blend']['f1']:.2f}; {m['in-context']['text']!r} vs "
              f"{m['kdn-blend']['text']!r}", flush=True)
        done = ci + 1 == n_cases
        config.update(
            prompt_tokens_mean=sum(c["prompt_tokens"] for c in cases) / len(cases),
            answer_in_retrieved_chunks=sum(c["answer_in_context"] for c in cases) / len(cases))
        write_json(args.out, "rag", rows, complete=done, cases_done=ci + 1, config=config,
                   ingest=ingest, targets=_targets(rows), per_case=cases)
    rows = summarize(cases, ingest)
    print_table(rows, ["method", "cases", "ttft_s", "ttft_vs_in_context", "compute_s", "cpu_s",
                       "f1", "answer_nll", "agreement_with_in_context",
                       "ingest_s_per_1k_tokens"])
    print(_targets(rows))
    plot(rows, args.out.with_suffix(".png"),
         f"kdn RAG on SmolLM2-135M (CPU): {len(cases)} SQuAD questions, k={args.k} retrieved "
         f"chunks of ~{config['chunk_tokens_mean']:.0f} tokens, blend ratio {args.ratio}")


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["method"]: r for r in rows}
    icl, kdn = by["in-context"], by["kdn-blend"]
    return {
        "ttft_ratio_mean_of_means": kdn["ttft_s"] / icl["ttft_s"],
        "ttft_ratio_per_case_mean": kdn["ttft_vs_in_context"],
        "ttft_target_met": kdn["ttft_s"] <= icl["ttft_s"] / 3,
        "f1_gap": kdn["f1"] - icl["f1"],
        "f1_target_met": abs(kdn["f1"] - icl["f1"]) <= 0.02,
    }


if __name__ == "__main__":
    main()
