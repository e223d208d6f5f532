"""``kdn rag ingest | ask | rm``: a corpus as KV in kdn, questions answered by blending.

    kdn rag ingest docs/ --state .kdn-rag          # chunk, embed, prefill, store (resumable)
    kdn rag ask "Who wrote ...?" --state .kdn-rag  # answer, sources, timing split
    kdn rag rm notes/old.md --state .kdn-rag       # forget documents, delete their entries

The state folder (default ``$KDN_RAG_STATE`` or ``.kdn-rag``) holds the manifest and the
embeddings; ``ask`` and ``rm`` take the chunking, namespace and codec settings from it.
Heavy imports (torch, the model) happen inside the handlers, so ``kdn --help`` stays fast.
Exit codes as ``kdn``: 0 ok, 1 operation failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kdn.errors import KDNError


def _engine(ns: argparse.Namespace) -> Any:
    """(KnowledgeBase, Client) for the command's settings."""
    from kdn.client import Client
    from kdn.rag.index import Manifest
    from kdn.rag.pipeline import KnowledgeBase, RagConfig, RagEngine

    state = Path(ns.state)
    settings = Manifest.load(state).settings
    opts: dict[str, Any] = {}
    if settings is not None and ns.cmd_rag != "ingest":
        opts = dict(namespace=settings.namespace, target_tokens=settings.target_tokens,
                    max_tokens=settings.max_tokens, mode=settings.mode, level=settings.level)
    else:
        opts = dict(namespace=ns.namespace, target_tokens=ns.chunk_tokens,
                    max_tokens=ns.max_chunk_tokens or ns.chunk_tokens + ns.chunk_tokens // 2,
                    mode=ns.mode, level=ns.level)
    if getattr(ns, "k", None):
        opts["top_k"] = ns.k
    if getattr(ns, "max_new_tokens", None):
        opts["max_new_tokens"] = ns.max_new_tokens
    if getattr(ns, "ratio", None) is not None:
        opts["blend_ratio"] = ns.ratio
    if getattr(ns, "selection", None):
        opts["query_share"] = {"question": 1.0, "deviation": 0.0}[ns.selection]
    from kdn.models import load_model

    model, tok = load_model(ns.model)
    model.set_attn_implementation("sdpa")
    client = Client(ns.address, timeout_s=ns.timeout,
                    api_key=ns.api_key or os.environ.get("KDN_API_KEY"))
    return KnowledgeBase(RagEngine(model, tok, client, RagConfig(**opts)), state), client


def _ingest(ns: argparse.Namespace) -> int:
    kb, client = _engine(ns)
    with client:
        report = kb.ingest(ns.corpus, prune=not ns.no_prune, progress=not ns.json)
    if ns.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(report.summary())
        if report.tokens:
            print(f"ingest time per 1,000 tokens computed: "
                  f"{1000 * report.total_s / max(1, report.computed_tokens):.2f} s")
    return 0


def _ask(ns: argparse.Namespace) -> int:
    kb, client = _engine(ns)
    with client:
        ans = kb.ask(ns.question)
    t = ans.timings
    if ns.json:
        print(json.dumps({"answer": ans.text, "sources": [asdict(s) for s in ans.sources],
                          "timings": {**asdict(t), "compute_s": t.compute_s}}, indent=2))
        return 0
    print(ans.text)
    print("\nsources:")
    for i, s in enumerate(ans.sources, 1):
        snippet = " ".join(s.text.split())[:90]
        print(f"  [{i}] {s.doc_id} #{s.chunk_index} (score {s.score:.3f}): {snippet}...")
    print(f"\ntiming: retrieval {t.retrieval_s:.3f} s, KV fetch {t.fetch_s:.3f} s, "
          f"missing prefill {t.prefill_missing_s:.3f} s ({t.missing_chunks} chunks), "
          f"blend {t.blend_s:.3f} s -> first token {t.ttft_s:.3f} s; generation "
          f"{t.generate_s:.3f} s; {t.prompt_tokens} prompt tokens, {t.recomputed_tokens} of "
          f"{t.cached_tokens} cached recomputed")
    return 0


def _rm(ns: argparse.Namespace) -> int:
    kb, client = _engine(ns)
    with client:
        missing = [d for d in ns.docs if d not in kb.manifest.documents]
        deleted = kb.remove(ns.docs)
    for d in missing:
        print(f"not in the manifest: {d}", file=sys.stderr)
    print(f"removed {len(ns.docs) - len(missing)} documents, deleted {deleted} entries")
    return 1 if missing else 0


def _run(ns: argparse.Namespace) -> int:
    try:
        return int(ns.rag_func(ns))
    except KDNError as exc:
        print(f"kdn rag {ns.cmd_rag}: {exc}", file=sys.stderr)
        return 1


def register(sub: Any) -> None:
    """Add ``rag`` with its subcommands to the ``kdn`` subparsers ``sub``."""
    from kdn.cli.args import NAMESPACE

    rag = sub.add_parser("rag", help="RAG: ingest a corpus as KV, answer questions",
                         description=__doc__.split("\n")[0])
    rag.add_argument("--state", default=os.environ.get("KDN_RAG_STATE", ".kdn-rag"),
                     help="state folder: manifest + embeddings (default: $KDN_RAG_STATE or "
                     ".kdn-rag)")
    rag.add_argument("--address", default=os.environ.get("KDN_ADDRESS", "127.0.0.1:50051"))
    rag.add_argument("--timeout", type=float, default=60.0)
    rag.add_argument("--api-key", help="API key (default: $KDN_API_KEY)")
    rag.add_argument("--model", default="smollm2-135m",
                     help="smollm2-135m or a local transformers folder")
    rag.add_argument("--json", action="store_true", help="machine-readable output")
    rsub = rag.add_subparsers(dest="cmd_rag", required=True)

    ing = rsub.add_parser("ingest", help="chunk, embed, prefill and store a corpus")
    ing.add_argument("corpus", help="folder of .txt/.md files, or a .jsonl of {id, text}")
    ing.add_argument("--chunk-tokens", type=int, default=256, help="target tokens per chunk")
    ing.add_argument("--max-chunk-tokens", type=int, default=0,
                     help="hard limit per chunk (default 1.5x the target)")
    ing.add_argument("--namespace", type=NAMESPACE, default="rag")
    ing.add_argument("--mode", default="lossless", help="codec mode (lossless, kdn, int8, ...)")
    ing.add_argument("--level", default="", help="codec level of lossy modes (e.g. l2)")
    ing.add_argument("--no-prune", action="store_true",
                     help="keep documents that left the corpus")
    ing.set_defaults(rag_func=_ingest)

    ask = rsub.add_parser("ask", help="answer a question from the ingested corpus")
    ask.add_argument("question")
    ask.add_argument("-k", "--k", type=int, default=0, help="chunks to retrieve (default 4)")
    ask.add_argument("--max-new-tokens", type=int, default=0)
    ask.add_argument("--ratio", type=float, default=None, help="blend recompute ratio")
    ask.add_argument("--selection", choices=["question", "deviation"], default=None,
                     help="which cached tokens the blend recomputes: those whose K/V "
                          "deviate most (CacheBlend, the default here) or those the question "
                          "attends to (better answers, a first pass more)")
    ask.set_defaults(rag_func=_ask)

    rm = rsub.add_parser("rm", help="forget documents and delete their chunks' entries")
    rm.add_argument("docs", nargs="+", help="document ids (paths relative to the corpus)")
    rm.set_defaults(rag_func=_rm)
    rag.set_defaults(func=_run)
