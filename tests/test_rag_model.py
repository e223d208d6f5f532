"""kdn rag on the real SmolLM2-135M and MiniLM against an in-process server: the CLI round trip
(ingest, idempotent re-ingest, ask, rm) and the drop-in API at ratio 1 equal to a full prefill."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn.cli.main import main
from kdn.client import Client
from kdn.model import hf
from kdn.rag import RagConfig, RagEngine
from kdn.rag.corpus import chunk_ids
from kdn.server import ServerThread

pytestmark = pytest.mark.model

DOCS = {
    "warsaw.md": "Warsaw is the capital and largest city of Poland. It stands on the Vistula "
                 "River in east-central Poland.\n\nThe city has about 1.8 million residents.",
    "nile.md": "The Nile is a major north-flowing river in northeastern Africa. It flows into "
               "the Mediterranean Sea.\n\nThe Nile is among the longest rivers in the world.",
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a few shared cores, spinning OpenMP threads are much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol() -> Any:
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    model.set_attn_implementation("sdpa")
    return model, tok


def test_cli_ingest_ask_rm(smol: Any, server: ServerThread, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text)
    base = ["rag", "--address", server.address, "--state", str(tmp_path / "state"), "--json"]

    assert main([*base, "ingest", str(corpus), "--chunk-tokens", "24"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["computed"] == first["chunks"] >= 4 and first["stored_bytes"] > 0
    assert main([*base, "ingest", str(corpus), "--chunk-tokens", "24"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["computed"], again["unchanged"]) == (0, 2)

    assert main([*base, "ask", "Which river flows into the Mediterranean Sea?", "-k", "2",
                 "--max-new-tokens", "8"]) == 0
    ans = json.loads(capsys.readouterr().out)
    assert ans["answer"] and ans["sources"][0]["doc_id"] == "nile.md"
    t = ans["timings"]
    assert t["missing_chunks"] == 0 and t["ttft_s"] >= t["blend_s"] > 0

    assert main([*base, "rm", "nile.md"]) == 0
    assert "deleted" in capsys.readouterr().out
    capsys.readouterr()
    assert main([*base, "rm", f"{corpus}/nile.md"]) == 1  # named by its path: told the names
    err = capsys.readouterr().err
    assert "not in the manifest" in err and "relative to the ingested folder" in err
    assert "warsaw.md" in err.split("folder:")[1]  # what is left to name


def test_drop_in_answer_exact_at_ratio_one(smol: Any, client: Client) -> None:
    model, tok = smol
    engine = RagEngine(model, tok, client, RagConfig(blend_ratio=1.0, max_new_tokens=6))
    chunks = [text + "\n\n" for text in DOCS.values()]
    question = "What is the capital of Poland?"
    ans = engine.answer(question, chunks)
    assert ans.timings.missing_chunks == 2  # computed on the request path, then stored
    assert engine.ensure(chunks) == 0
    again = engine.answer(question, chunks)
    assert again.timings.missing_chunks == 0 and again.token_ids == ans.token_ids
    # the reference prompt: the same pieces, each tokenized alone, prefilled in one pass
    ids = engine.head_ids + [t for c in chunks for t in chunk_ids(tok, c)] + chunk_ids(
        tok, engine.tail.replace("{question}", question))
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    kv = hf.from_transformers(out.past_key_values, engine.layout)
    decoder = hf.CacheDecoder(model, hf.to_transformers(kv))
    assert hf.greedy(decoder, out.logits[0, -1], 6, engine.stop) == ans.token_ids
    assert ans.text  # (a 135M model: its answer quality is not what this test checks)
