"""kdn.rag's arguments, on the tiny model and real in-process server of ``tests.test_rag``:
``RagConfig`` settings, a request's token counts and chunk list, and the ``kdn rag`` command
line, each refused before any work where it is not what it must be."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.rag import RagConfig
from kdn.rag.corpus import chunk_ids
from tests.test_rag import Counted, corpus, make_kb, tiny_llama


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def counted(model: Any) -> Iterator[Counted]:
    c = Counted(model)
    yield c
    model._forward_pre_hooks.clear()


def test_config_validation() -> None:
    with pytest.raises(InvalidArgument):
        RagConfig(top_k=0)
    with pytest.raises(InvalidArgument):
        RagConfig(head="x")
    with pytest.raises(InvalidArgument):
        RagConfig(head="x", tail="no placeholder")
    with pytest.raises(InvalidArgument):
        RagConfig(blend_ratio=2.0)
    with pytest.raises(InvalidArgument):
        RagConfig(namespace="bad ns")
    with pytest.raises(InvalidArgument, match="query_share"):
        RagConfig(query_share=1.5)
    assert RagConfig(query_share=0.0).blend_config().query_share == 0.0
    # whole numbers >= 1 only: no fraction, bool, text or zero
    for field, bad in (("top_k", 2.5), ("top_k", True), ("max_new_tokens", 1.5),
                       ("target_tokens", "256"), ("max_new_tokens", 0)):
        with pytest.raises(InvalidArgument, match=f"{field} must be a whole number >= 1, got "
                                                  f"{bad!r}"):
            RagConfig(**{field: bad})


def test_a_request_of_no_tokens_or_of_one_text_for_its_chunks_is_refused_before_any_work(
        model: Any, counted: Counted, client: Client, tmp_path: Path) -> None:
    """answer(..., max_new_tokens=0 / -3 / True / 2.5), ask(k=0) and a text given for the
    chunk list (which would be one chunk per character, each prefilled and stored) are
    refused before anything is retrieved or computed."""
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(corpus(tmp_path))
    engine = kb.engine
    question, chunks = "Which river flows north?", ["The Nile flows north.", "Cats purr."]
    calls = counted.calls
    for bad in (0, -3, 2.5, True):
        named = f"max_new_tokens must be a whole number >= 1 .None: RagConfig.max_new_tokens., " \
                f"got {bad!r}"
        with pytest.raises(InvalidArgument, match=named):
            engine.answer(question, chunks, max_new_tokens=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=named):
            kb.ask(question, max_new_tokens=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=f"k must be a whole number >= 1 .None: "
                                                  f"RagConfig.top_k., got {bad!r}"):
            kb.ask(question, k=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="chunks must be a list of texts, got one str"):
        engine.answer(question, chunks[0])
    assert counted.calls == calls  # nothing was computed
    assert not client.contains(engine.key(chunk_ids(engine.tokenizer, "T")), namespace="rag")
    assert len(engine.answer(question, chunks, max_new_tokens=2).token_ids) <= 2
    assert len(kb.ask(question, k=1, max_new_tokens=1).sources) == 1


def test_cli_parses_rag_commands() -> None:
    from kdn.cli.main import build_parser

    ns = build_parser().parse_args(["rag", "--state", "s", "ingest", "docs", "--mode", "kdn",
                                    "--level", "l2", "--chunk-tokens", "128"])
    assert (ns.cmd, ns.cmd_rag, ns.corpus, ns.mode, ns.level, ns.chunk_tokens) == (
        "rag", "ingest", "docs", "kdn", "l2", 128)
    ns = build_parser().parse_args(["rag", "ingest", "docs"])
    assert (ns.namespace, ns.chunk_tokens, ns.mode, ns.level) == (None, None, None, None)
    ns = build_parser().parse_args(["rag", "ask", "why?", "-k", "3"])
    assert (ns.question, ns.k, ns.selection) == ("why?", 3, None)
    ns = build_parser().parse_args(["rag", "ask", "why?", "--selection", "deviation"])
    assert ns.selection == "deviation"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rag", "ask", "why?", "--selection", "random"])
    ns = build_parser().parse_args(["rag", "rm", "a.md", "b.md"])
    assert ns.docs == ["a.md", "b.md"]
    for option in ("-k", "--max-new-tokens"):  # 0 asked for the default (4 chunks, 32 tokens)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["rag", "ask", "why?", option, "0"])
    ns = build_parser().parse_args(["rag", "ask", "why?"])
    assert (ns.k, ns.max_new_tokens) == (None, None)


def test_a_codec_mode_alone_is_its_default_level_and_unknown_ones_are_refused() -> None:
    assert RagConfig(mode="kdn").level == "default"  # what `kdn rag ingest --mode kdn` stores
    assert RagConfig(mode="int8").level == ""
    with pytest.raises(InvalidArgument, match="unknown codec mode 'zip'"):
        RagConfig(mode="zip")
    with pytest.raises(InvalidArgument, match="no level 'l2'"):
        RagConfig(mode="kdn", level="l2")
