"""RAG state folders against a real in-process kdn server: two states on one namespace keep
each other's chunks, a state of the earlier format (shared keys) is read and deletes nothing, an
interrupted ingest leaves the state it started from and a rerun completes it, and no crash
leaves a state naming a deleted chunk. The tiny random Llama, character tokenizer and
bag-of-words embedder of ``test_rag``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn.client import Client
from kdn.errors import Corrupt, InvalidArgument, Unavailable
from kdn.rag import Document, KnowledgeBase, RagConfig, chunk_document, load_corpus
from kdn.rag.index import EMBEDDINGS, MANIFEST, Manifest, embeddings_name
from tests.test_rag import CharTokenizer, Counted, corpus, make_kb, stored, tiny_llama


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def counted(model: Any) -> Iterator[Counted]:
    c = Counted(model)
    yield c
    model._forward_pre_hooks.clear()


def doc_keys(kb: KnowledgeBase) -> dict[str, list[str]]:
    return {i: [c.key for c in d.chunks] for i, d in kb.manifest.documents.items()}


def consistent(client: Client, kb: KnowledgeBase) -> None:
    """The state as on disk names only chunks kdn holds, each with its vector."""
    back = make_kb(kb.engine.model, client, kb.state)
    assert back.manifest.keys() and all(stored(client, back, back.manifest.keys()).values())
    assert set(back.index.keys) == back.manifest.keys()


def test_two_states_on_one_namespace_keep_each_others_chunks(
        model: Any, counted: Counted, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    more = tmp_path / "more"
    more.mkdir()  # b: an overlapping corpus (one document of a's, one of its own)
    (more / "cats.md").write_text((docs / "cats.md").read_text())
    (more / "boats.md").write_text("Boats float on the water of the harbour.")
    a, b = make_kb(model, client, tmp_path / "a"), make_kb(model, client, tmp_path / "b")
    a.ingest(docs)
    b.ingest(more)
    assert a.manifest.owner != b.manifest.owner and len(a.manifest.owner) == 32
    assert not a.manifest.keys() & b.manifest.keys()  # no entry of one is the other's
    b_keys = b.manifest.keys()

    # a forgets, then changes the document b holds too
    assert a.remove(["cats.md"]) > 0
    assert all(stored(client, b, b_keys).values()), "a's rm deleted b's chunks"
    a.ingest(docs)
    (docs / "cats.md").write_text((docs / "cats.md").read_text().replace("Lions", "Tigers"))
    (docs / "copy.md").unlink()
    rep = a.ingest(docs)
    assert rep.deleted > 0 and rep.kept == 0
    assert all(stored(client, b, b_keys).values()), "a's ingest deleted b's chunks"
    ans = b.ask("Do cats purr when content?")
    assert {s.doc_id for s in ans.sources} == {"cats.md"} and ans.timings.missing_chunks == 0
    consistent(client, a)
    consistent(client, b)


def as_format_1(state: Path) -> None:
    """Rewrite a shared state as a kdn without owners wrote it: manifest format 1, the
    embeddings in ``embeddings.safetensors``."""
    raw = json.loads((state / MANIFEST).read_text())
    (state / embeddings_name(raw["generation"])).rename(state / EMBEDDINGS)
    (state / MANIFEST).write_text(json.dumps(
        {"format": 1, "settings": raw["settings"], "documents": raw["documents"]}))


def test_a_state_of_format_1_is_read_and_deletes_nothing(model: Any, counted: Counted,
                                                         client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    states = [tmp_path / "a", tmp_path / "b"]
    for state in states:
        state.mkdir()
        (state / MANIFEST).write_text('{"format": 1, "settings": null, "documents": {}}')
        make_kb(model, client, state).ingest(docs)
        as_format_1(state)
    a, b = (make_kb(model, client, s) for s in states)
    assert a.manifest.shared and not a.manifest.owner
    keys = a.manifest.keys()
    assert keys == b.manifest.keys()  # unsalted: the two states hold the same entries
    tok = CharTokenizer()
    cats = chunk_document(next(d for d in load_corpus(docs) if d.id == "cats.md"), tok, 64, 96)
    assert [c.key for c in a.manifest.documents["cats.md"].chunks] == [
        a.engine.key(c.ids).hex() for c in cats]

    ans = b.ask("Do cats purr when content?")  # read as written
    assert ans.sources and ans.timings.missing_chunks == 0
    assert a.remove(["cats.md"]) == 0 and a.kept == len(cats)
    (docs / "shared.md").write_text("Another paragraph entirely.")
    rep = a.ingest(docs)
    assert (rep.deleted, rep.kept) == (0, 0)  # shared.md's chunk is copy.md's too
    (docs / "copy.md").unlink()
    (docs / "shared.md").unlink()
    rep = a.ingest(docs)
    assert rep.deleted == 0 and rep.kept == 2 and "kept 2 another state may use" in rep.summary()
    assert all(stored(client, b, keys).values())
    ans = b.ask("Do cats purr when content?")
    assert ans.sources and ans.timings.missing_chunks == 0
    back = Manifest.load(states[0])
    assert back.shared and not back.owner  # still shared, in the new format
    assert json.loads((states[0] / MANIFEST).read_text())["format"] == 2


def test_a_chunk_moved_to_a_later_document_stays_stored(model: Any, client: Client,
                                                        tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    p1 = "The first paragraph of a talks of apples and of pears."
    p2 = "The second paragraph of a talks of plums and of cherries."
    q1 = "The only paragraph of b talks of boats and of harbours."
    (docs / "a.md").write_text(f"{p1}\n\n{p2}")
    (docs / "b.md").write_text(q1)
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(docs)
    assert len(kb.manifest.documents["a.md"].chunks) == 2
    (docs / "a.md").write_text(p1)
    (docs / "b.md").write_text(f"{q1}\n\n{p2}")  # a's second chunk, now b's
    rep = kb.ingest(docs)
    assert rep.changed == 2 and rep.computed == 0 and rep.deleted == 0
    assert all(stored(client, kb, kb.manifest.keys()).values())
    consistent(client, kb)


@pytest.mark.parametrize("flush_s", [0.0, 60.0])
def test_an_interrupted_settings_change_leaves_the_old_state_and_a_rerun_completes_it(
        model: Any, counted: Counted, client: Client, tmp_path: Path, flush_s: float) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    kb = make_kb(model, client, state)
    kb.ingest(docs)
    before, old_keys = kb.manifest.settings, doc_keys(kb)
    small = RagConfig(target_tokens=32, max_tokens=48, max_new_tokens=4, top_k=2,
                      flush_s=flush_s)
    tok = CharTokenizer()
    first = [d for d in load_corpus(docs) if d.id != "sub/rivers.txt"]  # ingested before it
    done = len({c.ids for d in first for c in chunk_document(d, tok, 32, 48)})
    counted.fail_after = counted.calls + done  # the prefill of the last document's first chunk
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state, small).ingest(docs)
    counted.fail_after = None
    back = make_kb(model, client, state)
    assert back.manifest.settings == before and doc_keys(back) == old_keys
    consistent(client, back)
    assert back.ask("Which river flows north?").timings.missing_chunks == 0

    calls = counted.calls
    new = make_kb(model, client, state, small)
    rep = new.ingest(docs)
    assert rep.reused >= done and rep.computed == counted.calls - calls  # the crashed run's
    s = new.manifest.settings
    assert s is not None and (s.target_tokens, s.max_tokens) == (32, 48)
    for d in load_corpus(docs):
        chunks = chunk_document(d, tok, 32, 48)
        assert doc_keys(new)[d.id] == [new.engine.key(c.ids, new.manifest.owner).hex()
                                       for c in chunks]
    gone = {k for ks in old_keys.values() for k in ks} - new.manifest.keys()
    assert gone and rep.deleted == len(gone) and not any(stored(client, new, gone).values())
    consistent(client, new)
    assert [f.name for f in state.glob("embeddings*")] == [
        embeddings_name(new.manifest.generation)]


@pytest.mark.parametrize("flush_s", [0.0, 60.0])
def test_no_crash_leaves_the_state_naming_a_deleted_chunk(
        model: Any, counted: Counted, client: Client, tmp_path: Path, flush_s: float) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    cfg = RagConfig(target_tokens=64, max_tokens=96, max_new_tokens=4, top_k=2, flush_s=flush_s)
    make_kb(model, client, state, cfg).ingest(docs)
    for name in ("cats.md", "sub/rivers.txt"):  # two documents change; the second one fails
        (docs / name).write_text((docs / name).read_text().replace("the", "a"))
    cats = next(d for d in load_corpus(docs) if d.id == "cats.md")
    counted.fail_after = counted.calls + len(chunk_document(cats, CharTokenizer(), 64, 96))
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state, cfg).ingest(docs)
    counted.fail_after = None
    consistent(client, make_kb(model, client, state, cfg))


class NoDeletes:
    """A client whose Delete calls fail (the server went away after the commit)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def delete(self, *_: Any, **__: Any) -> int:
        raise Unavailable("the server went away")


def test_keys_a_failed_delete_left_are_deleted_by_the_next_write(model: Any, client: Client,
                                                                 tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    kb = make_kb(model, client, state)
    kb.ingest(docs)
    rivers = [c.key for c in kb.manifest.documents["sub/rivers.txt"].chunks]
    kb.engine.client = NoDeletes(client)  # type: ignore[assignment]
    with pytest.raises(Unavailable):
        kb.remove(["sub/rivers.txt"])
    back = make_kb(model, client, state)
    assert "sub/rivers.txt" not in back.manifest.documents  # committed, then the delete failed
    assert back.manifest.retired == set(rivers) and all(stored(client, back, rivers).values())
    assert back.remove(["copy.md"]) == len(rivers)  # copy.md's chunk is shared.md's too
    assert not any(stored(client, back, rivers).values())
    assert not make_kb(model, client, state).manifest.retired  # deleted, then unlisted


def test_the_retired_keys_on_disk_are_only_those_not_yet_deleted(
        model: Any, client: Client, tmp_path: Path) -> None:
    """Each commit's deletes are followed by a commit that stops listing them: a document
    edited again and again does not grow the manifest (nor each commit's Deletes)."""
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    kb = make_kb(model, client, state)
    for i in range(3):
        (docs / "cats.md").write_text(f"Version {i} of the cats document.")
        assert kb.ingest(docs).deleted == (1 if i else 0)
        assert not Manifest.load(state).retired and not kb.manifest.retired
    kb.remove(["cats.md"])
    assert not Manifest.load(state).retired


def test_a_manifest_of_format_2_of_the_wrong_shape_is_corrupt(tmp_path: Path) -> None:
    from kdn.errors import Corrupt

    key, old = "ab" * 32, "cd" * 32
    doc = {"sha256": "0", "source": "/c", "chunks": [{"key": key, "tokens": 3, "text": "abc"}]}
    good = {"format": 2, "owner": "0f" * 16, "shared": False, "retired": [old],
            "generation": 3, "settings": None, "documents": {"a.md": doc}}
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    m = Manifest.load(tmp_path)
    assert (m.owner, m.shared, m.retired, m.generation) == ("0f" * 16, False, {old}, 3)
    # a key that is not hex failed later, in bytes.fromhex (a bad retired one at every write)
    not_keys = ["Z" * 64, "AB" * 32, "ab" * 31, "not-a-key"]
    for bad in ({**good, "owner": "0F" * 16}, {**good, "owner": 5}, {**good, "shared": 0},
                {**good, "retired": "cd"}, {**good, "retired": [1]},
                *({**good, "retired": [k]} for k in not_keys),
                *({**good, "documents": {"a.md": {**doc, "chunks": [
                    {"key": k, "tokens": 3, "text": "abc"}]}}} for k in not_keys),
                {**good, "generation": -1}, {**good, "generation": "3"},
                {**good, "owner": ""}, {k: v for k, v in good.items() if k != "owner"}):
        (tmp_path / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(Corrupt, match="malformed manifest"):
            Manifest.load(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({**good, "format": 3}))
    with pytest.raises(Corrupt, match="unknown manifest format 3"):
        Manifest.load(tmp_path)


def test_a_source_with_no_documents_removes_nothing(
        model: Any, counted: Counted, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(docs)
    before = doc_keys(kb)
    away = tmp_path / "away"
    docs.rename(away)
    docs.mkdir()  # the folder is there and empty (an unmounted drive's mount point)
    with pytest.raises(InvalidArgument, match="no documents found.*refusing"):
        kb.ingest(docs)
    assert doc_keys(make_kb(model, client, kb.state)) == before
    assert all(stored(client, kb, kb.manifest.keys()).values())
    rep = kb.ingest(docs, prune=False)  # told not to prune: nothing to add, nothing removed
    assert rep.removed == 0 and doc_keys(kb) == before
    assert kb.remove(sorted(before)) > 0  # removing them is still one command away
    assert not kb.manifest.documents


@pytest.mark.parametrize("writer", ["another object", "this object"])
def test_an_ask_answers_from_the_last_commit_and_stores_only_what_it_lists(
        model: Any, client: Client, tmp_path: Path, writer: str) -> None:
    """A KnowledgeBase loaded before another one (another process's `kdn rag rm`) removed a
    document kept answering from it; and an ask that computed a chunk stored it even when the
    document was removed meanwhile, an entry no manifest named, which nothing deleted."""
    state = tmp_path / "state"
    asker = make_kb(model, client, state)
    asker.ingest([Document("a", "Cats purr when content."),
                  Document("b", "Rivers flow to the sea.")])
    gone = [c.key for c in asker.manifest.documents["a"].chunks]
    make_kb(model, client, state).remove(["a"])
    ans = asker.ask("Do cats purr?", k=1)
    assert [s.doc_id for s in ans.sources] == ["b"]
    assert not any(stored(client, asker, gone).values())

    asker.ingest([Document("a", "Cats purr when content.")])  # back, and its KV lost
    client.delete([bytes.fromhex(k) for k in gone], namespace="rag")
    remover = make_kb(model, client, state) if writer == "another object" else asker
    removed: list[int] = []

    def remove_once(*_: Any) -> None:  # while the ask computes the missing chunk
        if not removed:
            removed.append(remover.remove(["a"]))

    hook = model.register_forward_pre_hook(remove_once)
    try:
        ans = asker.ask("Do cats purr?", k=1)
    finally:
        hook.remove()
    assert removed and [s.doc_id for s in ans.sources] == ["a"]
    assert ans.timings.missing_chunks == 1
    assert not any(stored(client, asker, gone).values())
    consistent(client, asker)


def test_a_lost_embeddings_file_is_said_and_an_ingest_embeds_every_document(
        model: Any, client: Client, tmp_path: Path) -> None:
    """Without its embeddings file a state loaded as empty: ask said "the knowledge base is
    empty", and an ingest of one corpus embedded its documents only, so another corpus's
    were never retrieved again."""
    state, a, b = tmp_path / "state", tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "cats.md").write_text("Cats purr when content.")
    (b / "rivers.md").write_text("The Nile river flows north into the sea.")
    kb = make_kb(model, client, state)
    kb.ingest(a)
    kb.ingest(b)
    for f in state.glob("embeddings*"):
        f.unlink()
    lost = make_kb(model, client, state)
    with pytest.raises(Corrupt, match="2 of the 2 chunks .* have no embedding"):
        lost.ask("Which river flows north?")
    lost.remove(["nothing"])  # a write that embeds nothing still says so
    with pytest.raises(Corrupt, match="have no embedding"):
        make_kb(model, client, state).retrieve("Which river flows north?")
    again = make_kb(model, client, state)
    again.ingest(a)
    got = [s.doc_id for s in again.retrieve("Which river flows north into the sea?", k=5)]
    assert sorted(got) == ["cats.md", "rivers.md"]
    consistent(client, again)
