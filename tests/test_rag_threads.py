"""One KnowledgeBase used from several threads of one process: an ask while an ingest
updates a document answers from the last commit (its chunk's document and position as they
were committed), and a second writer waits for the first instead of writing beside it
outside the state lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn.client import Client
from kdn.rag import KnowledgeBase, RagConfig, RagEngine
from kdn.rag.corpus import Document
from tests.test_rag import CharTokenizer, WordEmbedder, tiny_llama


class SlowEmbedder(WordEmbedder):
    """The tests' embedder, slow (a second) on texts naming a zebra: a window in the middle
    of an ingest, after its documents were claimed and before it commits."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = threading.Event()

    def embed(self, texts: list[str]) -> list[list[float]]:  # type: ignore[override]
        if any("zebra" in t for t in texts):
            self.slow.set()
            time.sleep(1.0)
        return super().embed(texts)  # type: ignore[no-any-return]


@pytest.fixture
def kb(client: Client, tmp_path: Path) -> Iterator[tuple[KnowledgeBase, SlowEmbedder]]:
    embedder = SlowEmbedder()
    engine = RagEngine(tiny_llama(), CharTokenizer(), client,
                       RagConfig(target_tokens=64, max_tokens=96, max_new_tokens=4, top_k=2))
    yield KnowledgeBase(engine, tmp_path / "state", embedder), embedder


def _meanwhile(kb: KnowledgeBase, embedder: SlowEmbedder, docs: list[Document]
               ) -> threading.Thread:
    """An ingest of ``docs`` on another thread, returned once it is in its slow part."""
    t = threading.Thread(target=kb.ingest, args=(docs,))
    t.start()
    assert embedder.slow.wait(30)
    return t


def test_an_ask_during_an_ingest_answers_from_the_last_commit(
        kb: tuple[KnowledgeBase, SlowEmbedder]) -> None:
    base, embedder = kb
    base.ingest([Document("cats", "Cats purr when content. Cats sleep most of the day.")])
    before = base.ask("Do cats purr?")
    t = _meanwhile(base, embedder, [
        Document("cats", "Dogs bark at the mailman every single morning."),
        Document("slow", "The zebra has stripes.")])
    try:
        during = base.ask("Do cats purr?")  # it raised StopIteration
    finally:
        t.join(60)
    assert [(s.doc_id, s.chunk_index, s.text) for s in during.sources] == \
        [(s.doc_id, s.chunk_index, s.text) for s in before.sources]
    after = base.retrieve("Do dogs bark?")
    assert any("Dogs bark" in s.text for s in after)


def test_a_second_writer_thread_waits_for_the_first(
        kb: tuple[KnowledgeBase, SlowEmbedder], client: Client) -> None:
    """A remove from another thread during an ingest ran beside it, outside the state lock:
    its flush deleted a chunk the ingest was reusing (another document's old text), and the
    committed manifest named a chunk kdn no longer held."""
    base, embedder = kb
    base.ingest([Document("p", "Alpha beta gamma."), Document("r", "Rivers flow to the sea.")])
    t = _meanwhile(base, embedder, [
        Document("p", "Delta epsilon."),  # p's chunk is retired ...
        Document("s", "The zebra has stripes."),
        Document("q", "Alpha beta gamma.")])  # ... and reused by q
    try:
        base.remove(["r"])
    finally:
        t.join(60)
    assert sorted(base.manifest.documents) == ["p", "q", "s"]
    keys = [bytes.fromhex(c.key) for d in base.manifest.documents.values() for c in d.chunks]
    ns = base.engine.config.namespace
    assert all(i.present for i in client.lookup(keys, namespace=ns).infos)


def test_an_ask_during_an_ingest_ranks_only_committed_chunks(
        kb: tuple[KnowledgeBase, SlowEmbedder]) -> None:
    """The ingest's new chunks, added to the live index before their commit, were ranked into
    the top k and then dropped as not committed: an ask of k=1 found no source at all ("the
    knowledge base is empty")."""
    base, embedder = kb
    base.ingest([Document("cats", "Cats purr when content. Cats sleep most of the day.")])
    t = _meanwhile(base, embedder, [Document("dogs", "Dogs bark at the mailman."),
                                    Document("slow", "The zebra has stripes.")])
    try:
        during = base.ask("Do dogs bark at the mailman?", k=1)
    finally:
        t.join(60)
    assert [s.doc_id for s in during.sources] == ["cats"]
    assert [s.doc_id for s in base.retrieve("Do dogs bark at the mailman?", k=1)] == ["dogs"]
