"""bench.rag's kdn-blend row reads the chunks the ingest stored: a knowledge base salts its
chunk keys with its state's id, and the row asked without it, so every chunk was missing and
prefilled on the request path (the row timed recompute, not blending of stored KV)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.rag import run_case
from kdn.client import Client
from tests.test_rag import make_kb, model  # noqa: F401  (the module's tiny model fixture)


def test_the_blend_row_finds_every_ingested_chunk(model: Any, client: Client,  # noqa: F811
                                                   tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The library holds two million items, old maps and prints.")
    (docs / "b.md").write_text("The conservatory teaches piano, violin and composition.")
    kb = make_kb(model, client, tmp_path / "state")
    assert kb.ingest(docs).chunks >= 2
    case = run_case(kb, "How many items does the library hold?", ("two million",))
    assert case["methods"]["kdn-blend"]["missing"] == 0, case["methods"]["kdn-blend"]
