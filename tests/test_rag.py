"""kdn.rag on a tiny random Llama, a character tokenizer and a bag-of-words embedder, against a
real in-process kdn server: chunking, idempotent and resumable ingest, exact invalidation of a
changed or deleted document's entries, asking (with evicted chunks), and the drop-in API."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.model import hf
from kdn.rag import KnowledgeBase, RagConfig, RagEngine, load_corpus
from kdn.rag.corpus import chunk_ids
from kdn.rag.index import (
    EMBEDDINGS,
    MANIFEST,
    StateLocked,
    VectorIndex,
    embeddings_name,
    state_lock,
)

VOCAB = 128


class CharTokenizer:
    """One token per ASCII character (others become '?'); id 0 is EOS."""

    eos_token_id = 0

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) if 0 < ord(c) < VOCAB else ord("?") for c in text]}

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i)


class WordEmbedder:
    """Hashed bag of words, unit norm: texts sharing words are similar."""

    dim = 64

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, texts: list[str]) -> torch.Tensor:
        self.calls += 1
        out = torch.zeros(len(texts), self.dim, dtype=torch.float32, device="cpu")
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z]+", t.lower()):
                h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little")
                out[i, h % self.dim] += 1.0
        return torch.nn.functional.normalize(out + 1e-6, dim=1)


def tiny_llama() -> Any:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


class Counted:
    """Counts forward calls of a model (a forward pre-hook; the model itself is untouched)."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        self.fail_after: int | None = None
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("simulated crash")
        self.calls += 1


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def counted(model: Any) -> Iterator[Counted]:
    c = Counted(model)
    yield c
    model._forward_pre_hooks.clear()


CONFIG = RagConfig(target_tokens=64, max_tokens=96, max_new_tokens=4, top_k=2)


def make_kb(model: Any, client: Client, state: Path, config: RagConfig = CONFIG,
            embedder: WordEmbedder | None = None) -> KnowledgeBase:
    return KnowledgeBase(RagEngine(model, CharTokenizer(), client, config), state,
                         embedder or WordEmbedder())


def corpus(root: Path) -> Path:
    docs = root / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "cats.md").write_text(
        "Cats purr when content. Cats sleep most of the day.\n\n"
        "A cat has whiskers that sense the air. Kittens are young cats.\n\n"
        "Lions are big cats living in prides on the savanna.")
    (docs / "sub" / "rivers.txt").write_text(
        "The Nile is a long river in Africa. It flows north into the sea.\n\n"
        "The Amazon river carries the most water of any river on earth.")
    (docs / "shared.md").write_text("Shared paragraph about nothing in particular at all.")
    (docs / "copy.md").write_text("Shared paragraph about nothing in particular at all.")
    (docs / ".hidden.md").write_text("never read")
    (docs / "image.png").write_bytes(b"\x89PNG")
    return docs


def stored(client: Client, kb: KnowledgeBase, keys: list[str] | set[str]) -> dict[str, bool]:
    keys = sorted(keys)
    infos = client.lookup([bytes.fromhex(k) for k in keys], namespace="rag").infos
    return {k: i.present for k, i in zip(keys, infos)}


def doc_keys(kb: KnowledgeBase, doc_id: str) -> list[str]:
    return [c.key for c in kb.manifest.documents[doc_id].chunks]


# -- corpus ---------------------------------------------------------------------------------


def test_load_corpus_folder_and_jsonl(tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    (docs / ".kdn-rag").mkdir()
    (docs / ".kdn-rag" / "manifest.md").write_text("state, not corpus")
    assert [d.id for d in load_corpus(docs)] == ["cats.md", "copy.md", "shared.md",
                                                 "sub/rivers.txt"]
    jl = tmp_path / "c.jsonl"
    jl.write_text(json.dumps({"id": "a", "title": "T", "text": "body"}) + "\n\n"
                  + json.dumps({"text": "second"}) + "\n")
    got = load_corpus(jl)
    assert [(d.id, d.text) for d in got] == [("3", "second"), ("a", "T\n\nbody")]
    jl.write_text(json.dumps({"id": "a", "text": "x"}) + "\n" + json.dumps({"id": "a",
                                                                           "text": "y"}))
    with pytest.raises(InvalidArgument, match="duplicate"):
        load_corpus(jl)
    jl.write_text(json.dumps({"id": None, "text": "x"}) + "\n" + json.dumps({"id": 7,
                                                                               "text": "y"}))
    assert [d.id for d in load_corpus(jl)] == ["1", "7"]  # null: the line number
    for bad in (True, {"a": 1}, [1, 2], 1.5):  # were the ids "True", "{'a': 1}", ...
        jl.write_text(json.dumps({"id": bad, "text": "x"}))
        with pytest.raises(InvalidArgument, match=f"c.jsonl:1: 'id' must be a string or a whole "
                                                  f"number .*got {re.escape(repr(bad))}"):
            load_corpus(jl)
    with pytest.raises(InvalidArgument):
        load_corpus(tmp_path / "missing")


def test_a_corpus_file_that_is_not_utf8_is_named_and_links_out_are_skipped(
        tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the corpus")
    (docs / "link.txt").symlink_to(secret)
    (docs / "sub" / "inside.txt").symlink_to(docs / "cats.md")
    ids = [d.id for d in load_corpus(docs)]
    assert "link.txt" not in ids and "sub/inside.txt" in ids
    (docs / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(InvalidArgument, match=r"latin1.txt: not UTF-8 text \(byte 3"):
        load_corpus(docs)
    jl = tmp_path / "c.jsonl"
    jl.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(InvalidArgument, match="c.jsonl: not UTF-8"):
        load_corpus(jl)


def test_a_manifest_of_the_wrong_shape_is_corrupt(tmp_path: Path) -> None:
    from kdn.errors import Corrupt
    from kdn.rag.index import Manifest

    settings = {"layout": "x", "namespace": "rag", "target_tokens": 256, "max_tokens": 384,
                "mode": "lossless", "level": ""}
    chunk = {"key": "ab" * 32, "tokens": 3, "text": "abc"}
    doc = {"sha256": "0", "source": "/c", "chunks": [chunk]}
    good = {"format": 1, "settings": settings, "documents": {"a.md": doc}}
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    assert Manifest.load(tmp_path).documents["a.md"].chunks[0].text == "abc"
    for bad in ([], None, 5, {**good, "documents": []}, {**good, "settings": []},
                {**good, "settings": {**settings, "target_tokens": "256"}},
                {**good, "settings": {**settings, "max_tokens": True}},
                {**good, "documents": {"a.md": []}},
                {**good, "documents": {"a.md": {**doc, "chunks": {}}}},
                {**good, "documents": {"a.md": {**doc, "source": None}}},
                {**good, "documents": {"a.md": {**doc, "chunks": [{**chunk, "tokens": "3"}]}}},
                {**good, "documents": {"a.md": {**doc, "chunks": ["ab"]}}}):
        (tmp_path / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(Corrupt, match="malformed manifest"):
            Manifest.load(tmp_path)


def test_a_jsonl_line_with_a_lone_surrogate_is_named(tmp_path: Path) -> None:
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "Hello \\ud800 world."}\n')
    with pytest.raises(InvalidArgument, match=r"c.jsonl:2: not UTF-8 text"):
        load_corpus(jl)


def test_jsonl_lines_end_at_newlines_only(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 may stand unescaped in a JSON string (json.dumps writes them
    so with ensure_ascii=False): str.splitlines cut the line there, and it was "not JSON"."""
    texts = ["first line\u2028second line", "para\u2029next", "a\x85b"]
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\r\n"
                          for i, t in enumerate(texts)), encoding="utf-8")
    assert [d.text for d in load_corpus(jl)] == texts


def test_a_jsonl_id_past_pythons_digits_limit_is_named(tmp_path: Path) -> None:
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"id": "ok", "text": "fine"}\n{"id": ' + "9" * 5000 + ', "text": "t"}\n')
    with pytest.raises(InvalidArgument, match=r"c.jsonl:2: a value that can not be read"):
        load_corpus(jl)  # was a raw ValueError (int's 4300 digits limit)


def test_vector_index_round_trip(tmp_path: Path) -> None:
    k = [f"{i:064x}" for i in range(5)]  # chunk keys' hex
    idx = VectorIndex()
    v = torch.nn.functional.normalize(torch.randn(5, 8), dim=1)
    idx.add(k, v)
    idx.add([k[1]], v[4:5])  # replace
    assert idx.search(v[4], 2)[0][0] in (k[1], k[4])
    idx.retain([k[0], k[1], k[4]])
    idx.save(tmp_path)
    back = VectorIndex.load(tmp_path)
    assert back is not None and back.keys == [k[0], k[1], k[4]] and back.dim == 8
    assert [key for key, _ in back.search(v[0], 1)] == [k[0]]
    assert b"pickle" not in (tmp_path / EMBEDDINGS).read_bytes()[:200]


# -- ingest ---------------------------------------------------------------------------------


def test_ingest_then_reingest_computes_nothing(model: Any, counted: Counted, client: Client,
                                               tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    emb = WordEmbedder()
    kb = make_kb(model, client, state, embedder=emb)
    rep = kb.ingest(docs)
    n_keys = len(kb.manifest.keys())
    assert rep.documents == 4 and rep.changed == 4 and rep.chunks >= 6
    assert rep.computed == n_keys == counted.calls  # copy.md's chunk is shared.md's: one prefill
    assert rep.computed_tokens > 0 and rep.stored_bytes > 0 and rep.tokens >= rep.computed_tokens
    assert all(stored(client, kb, kb.manifest.keys()).values())
    assert (state / MANIFEST).exists()
    assert [f.name for f in state.glob("embeddings*")] == [embeddings_name(kb.manifest.generation)]
    assert len(kb.index) == n_keys
    assert "4 documents" in rep.summary()

    # again, same process and a fresh one (state reloaded from disk): no model call at all
    for again in (kb, make_kb(model, client, state, embedder=emb)):
        emb_calls = emb.calls
        rep2 = again.ingest(docs)
        assert counted.calls == n_keys, "re-ingest of an unchanged corpus called the model"
        assert emb.calls == emb_calls, "re-ingest re-embedded unchanged chunks"
        assert (rep2.unchanged, rep2.changed, rep2.computed, rep2.deleted) == (4, 0, 0, 0)
        assert rep2.chunks == rep.chunks and rep2.stored_bytes == rep.stored_bytes


def test_update_and_delete_invalidate_exactly_their_chunks(model: Any, counted: Counted,
                                                          client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(docs)
    cats_before = doc_keys(kb, "cats.md")
    rivers = doc_keys(kb, "sub/rivers.txt")
    shared = doc_keys(kb, "shared.md")
    assert shared == doc_keys(kb, "copy.md")
    assert len(cats_before) >= 2

    # change only the last paragraph of cats.md: its first chunk survives, the rest are replaced
    text = (docs / "cats.md").read_text()
    (docs / "cats.md").write_text(text.replace("Lions are big cats", "Tigers are big cats"))
    calls = counted.calls
    rep = kb.ingest(docs)
    cats_after = doc_keys(kb, "cats.md")
    gone = set(cats_before) - set(cats_after)
    new = set(cats_after) - set(cats_before)
    assert gone and new and cats_before[0] == cats_after[0]
    assert counted.calls - calls == len(new) == rep.computed
    assert rep.reused == len(cats_after) - len(new) and rep.deleted == len(gone)
    assert rep.changed == 1 and rep.unchanged == 3
    assert not any(stored(client, kb, gone).values())
    assert all(stored(client, kb, set(cats_after) | set(rivers) | set(shared)).values())

    # delete a file: exactly its chunks go; a chunk another document shares stays
    (docs / "sub" / "rivers.txt").unlink()
    (docs / "copy.md").unlink()
    rep = kb.ingest(docs)
    assert rep.removed == 2 and rep.deleted == len(rivers)
    assert not any(stored(client, kb, rivers).values())
    assert all(stored(client, kb, shared).values())
    assert "sub/rivers.txt" not in kb.manifest.documents
    assert set(kb.index.keys) == kb.manifest.keys()

    # rm through the API
    assert kb.remove(["shared.md"]) == len(shared)
    assert not any(stored(client, kb, shared).values())


def test_a_renamed_corpus_folder_prunes_what_left_it(model: Any, client: Client,
                                                    tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(docs)
    rivers = doc_keys(kb, "sub/rivers.txt")
    moved = docs.rename(tmp_path / "renamed")
    (moved / "cats.md").unlink()  # before the first ingest of the new folder
    rep = kb.ingest(moved)
    assert rep.removed == 1 and "cats.md" not in kb.manifest.documents
    assert {d.source for d in kb.manifest.documents.values()} == {str(moved.resolve())}
    (moved / "sub" / "rivers.txt").unlink()  # after it
    kb = make_kb(model, client, tmp_path / "state")  # a new process: the state from disk
    rep = kb.ingest(moved)
    assert rep.removed == 1 and rep.unchanged == 2
    assert sorted(kb.manifest.documents) == ["copy.md", "shared.md"]
    assert not any(stored(client, kb, rivers).values())


def test_one_writer_at_a_time_and_each_sees_the_others_updates(model: Any, client: Client,
                                                              tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    more = tmp_path / "more"
    more.mkdir()
    (more / "boats.md").write_text("Boats float on the water of the harbour.")
    state = tmp_path / "state"
    first, second = make_kb(model, client, state), make_kb(model, client, state)
    first.ingest(docs)
    second.ingest(more)  # loaded before first's ingest: its update is kept all the same
    back = make_kb(model, client, state)
    assert sorted(back.manifest.documents) == ["boats.md", "cats.md", "copy.md", "shared.md",
                                               "sub/rivers.txt"]
    assert set(back.index.keys) == back.manifest.keys()
    with state_lock(state):  # another process's ingest or rm holds it
        for call in (lambda: first.ingest(docs), lambda: first.remove(["cats.md"])):
            with pytest.raises(StateLocked, match=f"another kdn rag command holds {state}"):
                call()
        assert first.ask("Which river flows north?").sources  # asking reads without it
    assert first.remove(["boats.md"]) > 0


def test_two_corpora_with_a_file_of_one_name_are_refused(model: Any, client: Client,
                                                         tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root, word in ((a, "Alpha"), (b, "Beta")):
        root.mkdir()
        (root / "README.md").write_text(f"{word} readme. {word} facts live here.")
    (a / "notes.md").write_text("Alpha notes.")
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(a)
    keys = doc_keys(kb, "README.md")
    with pytest.raises(InvalidArgument, match=f"README.md: {b.resolve()} and {a.resolve()} "
                                              "both have a document of this id"):
        kb.ingest(b)
    back = make_kb(model, client, tmp_path / "state")
    assert doc_keys(back, "README.md") == keys and all(stored(client, kb, keys).values())
    assert back.manifest.documents["README.md"].source == str(a.resolve())
    (a / "README.md").unlink()  # the file moved from a to b: b's now, a's other file stays
    rep = kb.ingest(b)
    assert rep.removed == 0 and sorted(kb.manifest.documents) == ["README.md", "notes.md"]
    assert kb.manifest.documents["README.md"].source == str(b.resolve())
    assert kb.manifest.documents["notes.md"].source == str(a.resolve())


def test_interrupted_ingest_resumes_without_recomputing(model: Any, counted: Counted,
                                                        client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    counted.fail_after = 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state).ingest(docs)
    assert counted.calls == 3
    counted.fail_after = None
    kb = make_kb(model, client, state)
    rep = kb.ingest(docs)
    total = len(kb.manifest.keys())
    assert rep.reused >= 3 and rep.computed == total - 3 == counted.calls - 3
    assert all(stored(client, kb, kb.manifest.keys()).values())


def test_settings_changes(model: Any, counted: Counted, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    make_kb(model, client, state).ingest(docs)
    other_ns = RagConfig(target_tokens=64, max_tokens=96, namespace="other")
    with pytest.raises(InvalidArgument, match=r"another namespace \('rag' there, 'other'"):
        make_kb(model, client, state, other_ns).ingest(docs)
    # a new codec mode re-encodes every chunk
    calls = counted.calls
    kb = make_kb(model, client, state, RagConfig(target_tokens=64, max_tokens=96, mode="int8"))
    rep = kb.ingest(docs)
    assert rep.computed == len(kb.manifest.keys()) == counted.calls - calls
    info = client.lookup([bytes.fromhex(next(iter(kb.manifest.keys())))], namespace="rag")
    assert info.infos[0].present


def test_ask_and_rm_refuse_another_model(model: Any, counted: Counted, client: Client,
                                         tmp_path: Path) -> None:
    state = tmp_path / "state"
    kb = make_kb(model, client, state)
    kb.ingest(corpus(tmp_path))
    keys = kb.manifest.keys()
    other = tiny_llama()
    other.name_or_path = str(tmp_path / "other")  # same shapes, weights from another folder
    other.save_pretrained(tmp_path / "other")
    other_kb = make_kb(other, client, state)
    calls = counted.calls
    for call in (lambda: other_kb.ask("Which river flows north?"),
                 lambda: other_kb.remove(["cats.md"])):
        with pytest.raises(InvalidArgument, match=r"another model \(layout"):
            call()
    assert counted.calls == calls and "cats.md" in other_kb.manifest.documents
    assert all(stored(client, kb, keys).values())
    cfg = RagConfig(target_tokens=64, max_tokens=96, namespace="other")
    with pytest.raises(InvalidArgument, match="another namespace"):
        make_kb(model, client, state, cfg).ask("Which river flows north?")


def test_a_state_an_older_kdn_ingested_is_named_as_such(model: Any, counted: Counted,
                                                        client: Client, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A state an older kdn ingested, when it named this model's weights otherwise ("" for a
    model built from a config), is refused as such, to be ingested again into a new folder
    (not as 'not the same model or weights'); one whose manifest records no config and weights
    id but the layout of today's is ingested on as before, nothing computed again."""
    docs, state = corpus(tmp_path), tmp_path / "state"

    def as_older_kdn() -> None:  # a manifest written before kdn recorded config and weights
        raw = json.loads((state / MANIFEST).read_text())
        del raw["settings"]["config"], raw["settings"]["weights"]
        (state / MANIFEST).write_text(json.dumps(raw))

    with monkeypatch.context() as m:
        m.setattr(hf, "default_weights_id", lambda _: "")
        make_kb(model, client, state).ingest(docs)
    as_older_kdn()
    kb = make_kb(model, client, state)
    calls = counted.calls
    for call in (lambda: kb.ask("Which river flows north?"), lambda: kb.ingest(docs),
                 lambda: kb.remove(["cats.md"])):
        with pytest.raises(InvalidArgument, match=r"an older kdn named this model .*changed on "
                                                  r"upgrade.*ingest the corpus again into a new"):
            call()
    assert counted.calls == calls and "cats.md" in kb.manifest.documents

    fresh = tmp_path / "fresh"
    state = fresh / "state"
    make_kb(model, client, state).ingest(corpus(fresh))
    as_older_kdn()
    calls = counted.calls
    rep = make_kb(model, client, state).ingest(fresh / "docs")
    assert (rep.changed, rep.computed, counted.calls) == (0, 0, calls)
    settings = json.loads((state / MANIFEST).read_text())["settings"]
    assert settings["config"] and settings["weights"].startswith("params#")


# -- asking ---------------------------------------------------------------------------------


def test_ask_retrieves_blends_and_refills_evicted_chunks(model: Any, counted: Counted,
                                                         client: Client, tmp_path: Path) -> None:
    kb = make_kb(model, client, tmp_path / "state")
    kb.ingest(corpus(tmp_path))
    ans = kb.ask("Which river flows north in Africa, the Nile?")
    assert ans.sources[0].doc_id == "sub/rivers.txt" and len(ans.sources) == 2
    assert ans.sources[0].score >= ans.sources[1].score
    t = ans.timings
    assert t.missing_chunks == 0 and t.ttft_s > 0 and t.blend_s > 0 and t.retrieval_s > 0
    assert t.ttft_s >= t.retrieval_s + t.blend_s
    assert 1 <= len(ans.token_ids) <= CONFIG.max_new_tokens
    assert t.cached_tokens == sum(len(s.text) for s in ans.sources)

    # an entry kdn lost is computed on the request path and stored back afterwards
    key = bytes.fromhex(ans.sources[0].key)
    client.delete(key, namespace="rag")
    calls = counted.calls
    again = kb.ask("Which river flows north in Africa, the Nile?")
    assert again.timings.missing_chunks == 1 and counted.calls > calls
    assert client.contains(key, namespace="rag")
    assert again.token_ids == ans.token_ids  # lossless: the same KV either way


def test_drop_in_answer_matches_full_prefill_at_ratio_one(model: Any, client: Client) -> None:
    cfg = RagConfig(blend_ratio=1.0, max_new_tokens=6)
    engine = RagEngine(model, CharTokenizer(), client, cfg)
    chunks = ["Alpha beta gamma.\n\n", "Delta epsilon zeta eta.\n\n", "Theta iota.\n\n"]
    assert engine.ensure(chunks) == 3
    assert engine.ensure(chunks) == 0
    ans = engine.answer("What comes after gamma?", chunks)
    assert ans.timings.missing_chunks == 0 and ans.timings.fetch_s > 0
    assert [s.text for s in ans.sources] == chunks
    # reference: the whole prompt prefilled by transformers, greedy decoding
    tok = CharTokenizer()
    prompt = engine.head + "".join(chunks) + engine.tail.replace("{question}",
                                                                 "What comes after gamma?")
    with torch.inference_mode():
        out = model(torch.tensor([tok(prompt)["input_ids"]]), use_cache=True)
    kv = hf.from_transformers(out.past_key_values, engine.layout)
    ref = hf.greedy(hf.CacheDecoder(model, hf.to_transformers(kv)), out.logits[0, -1], 6,
                    engine.stop)
    assert ans.token_ids == ref
    with pytest.raises(InvalidArgument):
        engine.answer("q", [])


def test_chunks_past_the_models_context_are_left_out(client: Client) -> None:
    short = tiny_llama()
    short.config.max_position_embeddings = 200
    engine = RagEngine(short, CharTokenizer(), client, RagConfig(max_new_tokens=4))
    chunks = [f"Chunk {i} says something about rivers and cats.\n\n" for i in range(5)]
    room = 200 - len(engine.head) - len(engine.tail.replace("{question}", "Why?")) - 4
    fit = room // len(chunks[0])
    assert 0 < fit < len(chunks)
    ans = engine.answer("Why?", chunks)
    assert [s.text for s in ans.sources] == chunks[:fit]
    assert ans.timings.dropped_chunks == len(chunks) - fit
    assert ans.timings.prompt_tokens + 4 <= 200
    with pytest.raises(InvalidArgument, match="context of 200 tokens even with one chunk"):
        engine.answer("Why?" * 60, chunks)
    with pytest.raises(InvalidArgument, match="context of 200 tokens"):
        engine.answer("Why?", chunks, max_new_tokens=200)


def test_an_ingest_of_chunks_past_the_models_context_is_refused(client: Client,
                                                                  tmp_path: Path) -> None:
    """Chunks that can not fit the model's context with the prompt around them are refused
    before any is prefilled or stored (every ask would fail), naming the chunk size."""
    short = tiny_llama()
    short.config.max_position_embeddings = 200
    big = RagConfig(target_tokens=120, max_tokens=180, max_new_tokens=4)
    c = Counted(short)
    kb = make_kb(short, client, tmp_path / "state", big)
    with pytest.raises(InvalidArgument, match=r"max_tokens 180.*context of 200 tokens"):
        kb.ingest(corpus(tmp_path))
    assert c.calls == 0 and not kb.manifest.documents
    small = make_kb(short, client, tmp_path / "state")  # CONFIG's chunks fit
    assert small.ingest(tmp_path / "docs").chunks > 0


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
    for call in (engine.ensure, lambda c: engine.fitting(question, c)):
        with pytest.raises(InvalidArgument, match="chunks must be a list of texts, got one str"):
            call("xyz")  # each character would be a chunk, prefilled and stored
    with pytest.raises(InvalidArgument, match="chunk 1 must be text .str., got int"):
        engine.ensure(["ok", 7])  # type: ignore[list-item]
    docs = sorted(kb.manifest.documents)
    with pytest.raises(InvalidArgument, match="doc_ids must be a list of texts, got one str"):
        kb.remove(docs[0] + docs[1])  # the ids of its characters would be removed
    assert sorted(kb.manifest.documents) == docs
    assert counted.calls == calls  # nothing was computed
    assert not client.contains(engine.key(chunk_ids(engine.tokenizer, "T")), namespace="rag")
    assert len(engine.answer(question, chunks, max_new_tokens=2).token_ids) <= 2
    assert len(kb.ask(question, k=1, max_new_tokens=1).sources) == 1
