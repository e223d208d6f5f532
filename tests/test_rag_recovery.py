"""RAG state folders after a crash or in another's hands, against a real in-process kdn server:
an interrupted codec change is completed by the next ingest whatever its mode, chunks stored
before a crash are deleted once no document uses them, another embedder is refused before any
work, damaged files are Corrupt, a killed commit's temporary files go, and an answer stands when
kdn refuses to store back the chunks it computed. The tiny random
Llama, character tokenizer and bag-of-words embedder of ``test_rag``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import Corrupt, InvalidArgument, KDNError
from kdn.rag.index import (
    DEFAULT_EMBEDDER,
    MANIFEST,
    IndexView,
    Manifest,
    VectorIndex,
    embedder_name,
    embeddings_name,
)
from kdn.server import ServerConfig, ServerThread
from tests import test_rag
from tests.test_rag import CONFIG, Counted, WordEmbedder, corpus, make_kb

model, counted = test_rag.model, test_rag.counted  # its tiny Llama, prefills counted


def held_modes(server: ServerThread, keys: set[str]) -> set[str]:
    with AdminClient(server.address, timeout_s=30) as admin:
        return {e.codec_mode for e in admin.ls(namespace="rag") if e.key.hex() in keys}


def test_an_interrupted_codec_change_is_stored_again_by_the_next_ingest(
        model: Any, counted: Counted, client: Client, server: ServerThread,
        tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    make_kb(model, client, state).ingest(docs)  # lossless
    counted.fail_after = counted.calls + 3  # int8 replaces three entries, then the crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state, dataclasses.replace(CONFIG, mode="int8")).ingest(docs)
    counted.fail_after = None
    m = Manifest.load(state)
    assert m.settings is not None and m.settings.mode == "lossless" and m.reencoding
    assert held_modes(server, m.keys()) == {"int8", "lossless"}

    rep = make_kb(model, client, state).ingest(docs)  # back to the state's own mode
    m = Manifest.load(state)
    assert rep.unchanged == 0 and not m.reencoding
    assert held_modes(server, m.keys()) == {"lossless"}
    assert make_kb(model, client, state).ingest(docs).unchanged == rep.documents


def test_an_answer_stands_when_kdn_refuses_its_computed_chunks(
        model: Any, client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    docs, state = corpus(tmp_path), tmp_path / "state"
    make_kb(model, client, state).ingest(docs)
    question = "Which river flows north in Africa, the Nile?"
    # a server that lost the data and has less room than one chunk: every store-back is refused
    small = ServerConfig(port=0, data_dir=tmp_path / "small", ram_bytes=8192, disk_bytes=0,
                         wire_memo_bytes=0, shm_arena_bytes=0, prefault_bytes=0)
    with ServerThread(small) as st, Client(st.address, timeout_s=30) as other:
        kb = make_kb(model, other, state)
        ans = kb.ask(question)
        t = ans.timings
        assert ans.token_ids and t.missing_chunks == len(ans.sources) == t.store_failed
        assert "not stored in kdn" in caplog.text and "RESOURCE_EXHAUSTED" in caplog.text
        drop_in = kb.engine.answer(question, [s.text for s in ans.sources])  # RagEngine alone
        assert drop_in.token_ids == ans.token_ids and drop_in.timings.store_failed == 2
    # once stored, nothing fails: the count is of refusals only
    assert make_kb(model, client, state).ask(question).timings.store_failed == 0


def test_chunks_stored_before_a_crash_are_deleted_once_no_document_uses_them(
        model: Any, counted: Counted, client: Client, server: ServerThread,
        tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    counted.fail_after = counted.calls + 4  # stored four chunks, committed none
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state).ingest(docs)
    counted.fail_after = None
    for f in docs.rglob("*.*"):  # every document changes before the rerun
        if f.suffix in (".md", ".txt"):
            f.write_text(f.read_text().replace("a", "o"))
    kb = make_kb(model, client, state)
    kb.ingest(docs)
    kb.remove(sorted(kb.manifest.documents))
    with AdminClient(server.address, timeout_s=30) as admin:
        assert list(admin.ls(namespace="rag")) == []


def test_a_rerun_after_a_crash_before_the_first_commit_keeps_its_namespace(
        model: Any, counted: Counted, client: Client, server: ServerThread,
        tmp_path: Path) -> None:
    """The first ingest of a state stops before its first commit: the keys it stored are
    listed with the namespace they are in, so a rerun in another one (whose deletes would miss
    them) is refused, and one in it deletes them once no document uses them."""
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    foo = dataclasses.replace(CONFIG, namespace="foo")
    counted.fail_after = counted.calls + 4  # stored four chunks, committed none
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_kb(model, client, state, foo).ingest(docs)
    counted.fail_after = None
    m = Manifest.load(state)
    assert m.retired and m.settings is not None and m.settings.namespace == "foo"
    with pytest.raises(InvalidArgument, match="namespace \\('foo' there, 'rag' here\\)"):
        make_kb(model, client, state).ingest(docs)
    kb = make_kb(model, client, state, foo)
    kb.ingest(docs)
    kb.remove(sorted(kb.manifest.documents))
    with AdminClient(server.address, timeout_s=30) as admin:
        assert list(admin.ls(namespace="foo")) == []


def test_a_first_ingest_that_stored_nothing_binds_the_state_to_nothing(
        model: Any, client: Client, tmp_path: Path) -> None:
    """The first ingest of a state fails at its first call to kdn (unreachable), before
    anything is stored: a rerun in another namespace is taken (the owner's commit had
    recorded the settings, and the rerun was refused: 'holds a corpus ingested with another
    namespace', of a state holding nothing)."""
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    dead = Client("127.0.0.1:1", timeout_s=2, retry=None)
    try:
        with pytest.raises(KDNError):
            make_kb(model, dead, state, dataclasses.replace(CONFIG, namespace="foo")).ingest(
                docs)
    finally:
        dead.close()
    m = Manifest.load(state)
    assert not m.documents and not m.retired and m.settings is None
    kb = make_kb(model, client, state)  # namespace "rag"
    assert kb.ingest(docs).chunks > 0


class Other(WordEmbedder):
    """Another embedder of the same dimension."""


class Narrow(WordEmbedder):
    dim = 32
    name = "tests.test_rag.WordEmbedder"  # claims the name: its dimension gives it away


def test_another_embedder_is_refused_before_any_work(
        model: Any, counted: Counted, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    make_kb(model, client, state).ingest(docs)
    assert Manifest.load(state).settings.embedder == "tests.test_rag.WordEmbedder"  # type: ignore[union-attr]
    (docs / "new.md").write_text("A new document about boats.")
    calls = counted.calls
    for emb, what in [(Other(), "was embedded by 'tests.test_rag.WordEmbedder', not by"),
                      (Narrow(), "64-dim embeddings, .* makes 32-dim")]:
        kb = make_kb(model, client, state, embedder=emb)
        with pytest.raises(InvalidArgument, match=what):
            kb.retrieve("Do cats purr?")
        with pytest.raises(InvalidArgument, match=what):
            kb.ingest(docs)
        assert counted.calls == calls and emb.calls == 0

    # a state written before the embedder was recorded: any of its dimension is taken
    raw = json.loads((state / MANIFEST).read_text())
    del raw["settings"]["embedder"]
    (state / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(InvalidArgument, match="64-dim embeddings, .* makes 32-dim"):
        make_kb(model, client, state, embedder=Narrow()).ingest(docs)
    rep = make_kb(model, client, state, embedder=Other()).ingest(docs)
    assert rep.changed == 1 and rep.computed == 1  # the new document only
    assert Manifest.load(state).settings.embedder == f"{__name__}.Other"  # type: ignore[union-attr]

    view = IndexView(("ab" * 32,), torch.ones(1, 64))
    with pytest.raises(Corrupt, match="a 32-dim query, but the state's embeddings are 64-dim"):
        view.search(torch.ones(32), 1)


def test_the_default_embedder_is_named_without_loading_it() -> None:
    from kdn.model.embed import MINILM_NAME

    assert embedder_name(None) == DEFAULT_EMBEDDER == MINILM_NAME
    assert embedder_name(WordEmbedder()) == "tests.test_rag.WordEmbedder"


def test_one_model_is_one_embedder_wherever_its_files_lie(tmp_path: Path) -> None:
    """An Embedder given a folder was named by its path: the bundled model given explicitly,
    or its files copied elsewhere, was 'another embedder' and its states were refused."""
    import shutil

    from kdn.model.embed import MINILM_NAME, MODEL_FILES, minilm_model_dir, model_name

    try:
        bundled = minilm_model_dir()
    except FileNotFoundError:
        pytest.skip("the bundled embedding model is not installed")
    assert model_name(bundled) == MINILM_NAME
    copies = [tmp_path / n for n in ("a", "b", "c")]
    for folder in copies:
        folder.mkdir()
        for name in MODEL_FILES:
            if (bundled / name).is_file():
                shutil.copy(bundled / name, folder / name)
    assert model_name(copies[0]) == MINILM_NAME
    for folder in copies[1:]:  # other settings: another model, the same in both folders
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    other = model_name(copies[1])
    assert other.startswith("blake2b:") and other == model_name(copies[2])


def test_a_model_saved_in_shards_is_named_by_its_weights(tmp_path: Path) -> None:
    """A model saved in shards (``model-00001-of-00002.safetensors`` and its index) had none
    of its weights in its name: two folders of one config and other weights (a fine-tune)
    were one embedder, and a state of one was taken by the other."""
    from kdn.model.embed import model_name

    folders = [tmp_path / n for n in ("a", "b", "c")]
    for i, folder in enumerate(folders):
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "bert"}')
        (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
        for shard in (1, 2):
            weights = bytes([shard, min(i, 1)]) * 64  # b and c: the same weights
            (folder / f"model-0000{shard}-of-00002.safetensors").write_bytes(weights)
    names = [model_name(folder) for folder in folders]
    assert names[0] != names[1] == names[2]
    (folders[2] / "pytorch_model-00001-of-00001.bin").write_bytes(b"other")
    assert model_name(folders[2]) != names[1]


class Renamed(WordEmbedder):
    """``WordEmbedder`` under a new name, its old one among ``former_names``."""

    name = "blake2b:0123"
    former_names = ("tests.test_rag.WordEmbedder",)


def test_a_state_naming_the_embedder_as_kdn_named_it_before_is_taken(
        model: Any, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    make_kb(model, client, state).ingest(docs)
    rep = make_kb(model, client, state, embedder=Renamed()).ingest(docs)
    assert rep.unchanged == rep.documents  # the same settings: nothing embedded again
    assert Manifest.load(state).settings.embedder == "blake2b:0123"  # type: ignore[union-attr]


def test_damaged_state_files_are_corrupt(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(Corrupt, match="nested too deeply"):
        Manifest.load(tmp_path)
    key = "ab" * 32
    cases: list[tuple[Any, torch.Tensor, str]] = [
        ([key, key], torch.ones(2, 4), "a key is listed twice"),
        ([[key], key], torch.ones(2, 4), "keys is not a list of strings"),
        ([key, "cd" * 31], torch.ones(2, 4), "is not 64 lowercase hex digits"),
        (key, torch.ones(64, 4), "keys is not a list of strings"),
        ({key: 0}, torch.ones(1, 4), "keys is not a list of strings"),
        ([key, "cd" * 32], torch.ones(2, 4, 1), r"2 keys but vectors of shape \[2, 4, 1\]"),
        ([key], torch.ones(4), r"1 keys but vectors of shape \[4\]"),
    ]
    for keys, vectors, what in cases:
        (tmp_path / embeddings_name(1)).write_bytes(
            save({"vectors": vectors}, metadata={"keys": json.dumps(keys)}))
        with pytest.raises(Corrupt, match=f"{embeddings_name(1)}: .*{what}"):
            VectorIndex.load(tmp_path, 1)


def test_a_killed_commits_temporary_files_are_removed_by_the_next_write(
        model: Any, client: Client, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    state = tmp_path / "state"
    kb = make_kb(model, client, state)
    kb.ingest(docs)
    left = [".embeddings-2.safetensors.k45nvtyl", ".manifest.json.a_b1c2d3",
            ".embeddings.safetensors.x"]
    for name in left:
        (state / name).write_bytes(b"partial")
    (state / ".notes").write_text("not kdn's")
    kb.remove(["cats.md"])
    assert sorted(f.name for f in state.iterdir() if f.name.startswith(".")) == [".lock",
                                                                                  ".notes"]
