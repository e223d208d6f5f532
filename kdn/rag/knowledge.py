"""The knowledge base of ``kdn rag``: a corpus ingested into a state folder (manifest and
embeddings, ``kdn.rag.index``) and a kdn server (each chunk's KV, prefilled by a
``kdn.rag.pipeline.RagEngine``), asked by retrieval then blending, and kept in step with the
corpus as it changes (changed documents redone, removed ones pruned, one writer at a time).

States that share a server and a namespace (two users, two folders, one corpus ingested
twice) never share an entry: each state's first ingest gives it an owner id (random, in its
manifest) that salts its chunk keys (``kdn.keys.chunk_key``), so the entries a state deletes
(its chunks that no document of its own references any more) are its own and no other state
references them. kdn has no server-side reference count (pins only stop eviction), and a state
cannot see the others (they may be on other machines), so the cost is dedup across states:
one corpus ingested into two states is prefilled and stored twice; inside a state identical
chunks are stored once. A copy of a state folder has the same owner: it is the same state, and
the two copies must not both be written; asking writes too, so an ask from a stale copy (a
backup) can store back chunks the live state has retired, and nothing deletes those.

A state written before states had an owner (manifest format 1) is ``shared``: its keys are
unsalted, as other such states' are. It is read and written as before, except that nothing is
deleted from kdn: a chunk it stops referencing is left in kdn (``IngestReport.kept``), since
another state may use it. Ingesting into a new state folder gives the corpus a state of its own.

A write commits once per flush (``kdn.rag.index``): the manifest is the commit, and kdn entries
are deleted only after the commit that stopped referencing them (``Manifest.retired``), so a
crash never leaves the state naming a deleted chunk. Before an ingest stores anything, the
keys it is about to store are committed as retired (``_write_ahead``), a new state's settings
with them: a crash leaves no entry that no later write would delete (nor a rerun in another
namespace, which is refused). An ingest that changes the settings (chunk size, codec mode
or level) commits only at its end: interrupted, the state is the old one, and running the
ingest again completes it (the KV it stored is found by a Lookup; only a new codec mode is
encoded again). A new codec mode or level stores under the same keys, replacing the entries
the old state lists, so its ingest first marks the manifest (``Manifest.reencoding``): until an
ingest completes, the next one stores every chunk again, in whichever mode it is run. With
the settings unchanged an ingest commits every ``RagConfig.flush_s`` seconds too, each
document whole, so a rerun resumes where it stopped.

The state records the name of the embedder of its embeddings (``Settings.embedder``): an
ingest or retrieval with another one (or, in a state written before it was recorded, one of
another dimension) is refused (InvalidArgument) before anything is prefilled or searched.
It records the model too (``Settings.layout``, ``config``, ``weights``): a state of another
model or namespace is refused, and one an older kdn ingested before it named this model
otherwise (``hf.former_weights_ids``) is refused saying so, to be ingested again.

Readers (``retrieve``, ``ask``) use the last commit as one snapshot: its chunks and an
``IndexView`` of their embeddings, which a writer thread of the same object replaces at each
commit, before it deletes what the commit retired. A commit by another process (or another
KnowledgeBase on the folder) is read before the next retrieval: its manifest file is another
one. A chunk an ask had to compute is stored only where the last commit still lists it, so a
document removed meanwhile does not come back into kdn, where nothing would delete it (a
commit by another process between that check and the store can still make one). An ingest
embeds every document of the state that has no embedding (an embeddings file lost); until
then ``retrieve`` refuses (Corrupt), as it would miss them.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from kdn.blend.chunks import ChunkConnector
from kdn.errors import Corrupt, InvalidArgument
from kdn.rag.corpus import Chunk, Document, chunk_document, load_corpus
from kdn.rag.index import (
    ChunkEntry,
    DocEntry,
    Embedder,
    IndexView,
    Manifest,
    Settings,
    VectorIndex,
    embedder_name,
    embeddings_name,
    manifest_stamp,
    remove_other_embeddings,
    state_lock,
)
from kdn.rag.pipeline import Answer, AskTimings, RagEngine, Source, check_count, store_back
from kdn.rag.report import IngestReport, progress_bar
from kdn.text import check_text, check_texts

DELETE_BATCH = 4096
"""Keys per Delete call (128 KiB of keys)."""


@dataclass(frozen=True)
class _Commit:
    """The state as of one commit, what readers (``retrieve``, ``ask``) use: replaced in one
    step, so a reader holds one commit whatever a writer does meanwhile."""

    index: IndexView
    by_key: dict[str, tuple[str, ChunkEntry, int]]
    """Each chunk key's document, entry and position in it."""
    salt: str
    stamp: tuple[int, int, int] | None
    """The manifest file this commit was read from or written as (``manifest_stamp``)."""
    unembedded: str = ""
    """Why chunks the manifest lists have no embedding ("": all have one)."""


class KnowledgeBase:
    """A corpus ingested into kdn with a persisted retrieval index (module docstring).

    One state folder may hold several corpora (folders or files); each document remembers the
    corpus it came from (its ``source``), and its id is its path relative to that folder. When
    an ingest lists an id that another source holds:

    * the other source still has it on disk (a folder: the file ``<source>/<id>``; a JSONL or
      text file: the file exists): two corpora share a name, and the ingest is refused
      (InvalidArgument naming both) before anything changes;
    * it does not (the folder was renamed or moved, or the file moved from it to here): the
      document now belongs to this corpus; and when the other source is gone from disk
      altogether, a prune removes its documents this corpus does not list too (a moved
      folder's deleted files).

    Documents given as a list (``ingest([Document, ...])``, source ``api``) replace any id and
    are taken over by any corpus that lists their id.
    """

    def __init__(self, engine: RagEngine, state: Path | str,
                 embedder: Embedder | None = None) -> None:
        self.engine = engine
        self.state = Path(state)
        self._embedder = embedder
        cfg = engine.config
        self.settings = Settings(engine.layout.fingerprint, cfg.namespace, cfg.target_tokens,
                                 cfg.max_tokens, cfg.mode, cfg.level, embedder_name(embedder),
                                 engine.config_fingerprint, engine.weights_id)
        self._committed: _Commit  # what readers use (``_publish``)
        self._write = threading.RLock()  # one writer thread at a time in this process
        self._writers = 0  # how deep the writing thread is (its prune's removes)
        self.kept = 0
        """Entries the last ``remove`` left in kdn (a shared state: module docstring)."""
        self._load()

    def _load(self) -> None:
        """Read the manifest and its embeddings (a writer that commits in between replaces
        both: read them again). Embeddings still missing (a lost file) are computed by the
        next ingest; until then ``retrieve`` says so (Corrupt)."""
        for _ in range(3):
            stamp = manifest_stamp(self.state)  # before the read: a commit after it is seen as one
            self.manifest = Manifest.load(self.state)
            index = VectorIndex.load(self.state, self.manifest.generation)
            if index is not None or self.manifest.generation == 0:
                break
        self.index = index or VectorIndex()
        self._publish(stamp)

    def _refresh(self) -> None:
        """Read the state again when its manifest on disk is not the one this object last
        read or wrote (another process or KnowledgeBase committed since: a document it removed
        is not answered from). Not while a thread of this process writes: that writer's
        commits are the newest, and it publishes them itself."""
        if not self._write.acquire(blocking=False):
            return
        try:
            if not self._writers and manifest_stamp(self.state) != self._committed.stamp:
                self._load()
        finally:
            self._write.release()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the state folder's lock and work on its state as on disk now (another process
        may have written it since this one loaded it); reentrant (ingest's prune removes). A
        write that fails leaves this object with the state on disk (the last commit). A
        write from another thread of this process waits for this one to end."""
        with self._write:
            if self._writers:
                self._writers += 1
                try:
                    yield
                finally:
                    self._writers -= 1
                return
            with state_lock(self.state):
                self._writers = 1
                try:
                    self._load()
                    yield
                except BaseException:
                    self._load()
                    raise
                finally:
                    self._writers = 0

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            from kdn.model.embed import Embedder as MiniLM

            self._embedder = MiniLM()
        return self._embedder

    def _publish(self, stamp: tuple[int, int, int] | None) -> None:
        """Make the manifest and index as committed (read, or written as ``stamp``) what
        readers use, in one assignment."""
        by_key: dict[str, tuple[str, ChunkEntry, int]] = {}
        for doc_id, d in sorted(self.manifest.documents.items()):
            for i, c in enumerate(d.chunks):
                by_key.setdefault(c.key, (doc_id, c, i))
        lacking = sum(key not in self.index for key in by_key)
        unembedded = ""
        if lacking:
            name = embeddings_name(self.manifest.generation)
            unembedded = (f"{self.state}: {lacking} of the {len(by_key)} chunks its manifest "
                          f"lists have no embedding ({name} is missing or from another "
                          "state); ingest a corpus into it again to embed them (`kdn rag "
                          "ingest`, which embeds every document of the state)")
        self._committed = _Commit(self.index.view(), by_key, self.manifest.salt, stamp,
                                  unembedded)

    def _own(self) -> None:
        """Give a new state its owner id, committed before anything is stored under it (an
        ingest that stops is resumed under the same keys); its settings are committed with the
        first keys it is about to store (``_write_ahead``: a rerun in another namespace, where
        the keys it retired would not be deleted, is refused), not here, so an ingest that
        failed before storing anything binds the state to nothing."""
        if not self.manifest.owner and not self.manifest.shared:
            self.manifest.owner = secrets.token_hex(16)
            self.manifest.save(self.state)

    def _flush(self, hold: set[str] | frozenset[str] = frozenset()) -> tuple[int, int]:
        """Commit the state (embeddings of the next generation, then the manifest naming it),
        then delete from kdn the retired keys that no document references and that are not in
        ``hold``, and commit again without them: (deleted, kept), kept being the keys a shared
        state leaves in kdn instead."""
        m = self.manifest
        refs = m.keys()
        m.retired -= refs
        stale = m.retired - hold
        kept = 0
        if m.shared:
            kept, m.retired, stale = len(stale), m.retired & hold, set()
        self.index.retain(refs)
        generation = m.generation + 1
        self.index.save(self.state, generation)
        m.generation = generation
        m.save(self.state)
        self._publish(manifest_stamp(self.state))  # readers leave the retired keys before they go
        remove_other_embeddings(self.state, generation)
        # the server's count: a key a crash kept listed may be gone already
        keys = [bytes.fromhex(k) for k in sorted(stale)]
        deleted = sum(self.engine.client.delete(keys[i : i + DELETE_BATCH],
                                                namespace=self.engine.config.namespace)
                      for i in range(0, len(keys), DELETE_BATCH))
        if stale:  # deleted: the commit on disk stops listing them too
            m.retired -= stale
            m.save(self.state)
            self._publish(manifest_stamp(self.state))
        return deleted, kept

    @staticmethod
    def _count(rep: IngestReport, flushed: tuple[int, int]) -> None:
        rep.deleted += flushed[0]
        rep.kept += flushed[1]

    # -- ingest ---------------------------------------------------------------------------------

    def ingest(self, source: Path | str | Sequence[Document], *, prune: bool | None = None,
               progress: bool = False) -> IngestReport:
        """Bring kdn and the index in line with ``source`` (see the module docstring).

        ``prune``: documents of the same source that are gone are removed (default: yes for a
        folder or file, no for a list of ``Document``s, which adds or updates only). A
        folder or file with no documents where the state holds some from it is refused
        (InvalidArgument: an unmounted drive or a mistyped path empties nothing).
        The state folder is locked from loading to the last flush (``StateLocked``: another
        ingest or rm holds it).
        """
        with self._writing():
            return self._ingest(source, prune, progress)

    def _ingest(self, source: Path | str | Sequence[Document], prune: bool | None,
                progress: bool) -> IngestReport:
        t0 = time.perf_counter()
        rep = IngestReport()
        if isinstance(source, (str, Path)):
            docs, origin = load_corpus(source), str(Path(source).resolve())
        else:
            docs, origin = list(source), "api"
        if prune is None:
            prune = origin != "api"
        if prune and not docs:
            holds = sum(d.source == origin for d in self.manifest.documents.values())
            if holds:  # an unmounted drive or a wrong path would otherwise empty the state
                raise InvalidArgument(
                    f"{source}: no documents found, and this state holds {holds} from it; "
                    "refusing to remove them all (remove them by name with `kdn rag rm`, or "
                    "ingest with `--no-prune`, prune=False from Python)")
        self._check_settings()
        self._check_embedder()
        self.engine.check_chunk_size()
        old = self.manifest.settings
        if old is not None and (not old.embedder or old.embedder in self._former_names()):
            # not recorded, or recorded by a name kdn gave it before: the checks above took it
            old = replace(old, embedder=self.settings.embedder)
        if old is not None and not old.config and old.layout == self.settings.layout:
            old = replace(old, config=self.settings.config, weights=self.settings.weights)
        same_settings = old == self.settings
        # commits before the end only where the state on disk stays of one set of settings
        commit_early = old is None or same_settings
        # a new codec mode or level, or one an interrupted ingest began storing: every chunk is
        # encoded and stored again
        reencode = self.manifest.reencoding or old is not None and (
            (old.mode, old.level) != (self.settings.mode, self.settings.level))
        self._own()  # before the settings, which bind the state once keys are to be stored
        self.manifest.settings = self.settings
        rep.documents = len(docs)
        moved_from = self._claim(docs, origin)

        # documents whose text, settings and stored chunks are all unchanged are skipped
        candidates = [d for d in docs if same_settings and not reencode
                      and d.id in self.manifest.documents
                      and self.manifest.documents[d.id].sha256 == d.sha256]
        keys = sorted({c.key for d in candidates for c in self.manifest.documents[d.id].chunks})
        held = dict(zip(keys, self.engine.present([bytes.fromhex(k) for k in keys])))
        unchanged = {d.id for d in candidates
                     if all(held[c.key] >= 0 for c in self.manifest.documents[d.id].chunks)}
        changed = [d for d in docs if d.id not in unchanged]
        rep.unchanged, rep.changed = len(unchanged), len(changed)

        chunked = [(d, chunk_document(d, self.engine.tokenizer, self.settings.target_tokens,
                                      self.settings.max_tokens)) for d in changed]
        salt = self.manifest.salt
        new_keys = [self.engine.key(c.ids, salt) for _, cs in chunked for c in cs]
        sizes = {} if reencode else dict(zip(new_keys, self.engine.present(new_keys)))
        missing = {k.hex() for k in new_keys if sizes.get(k, -1) < 0}
        todo = len(missing)
        self._write_ahead(missing, reencode)
        # a chunk found held above is not stored again: none of them is deleted before the end
        # (a chunk that moves to a document further on is retired by the one before)
        wanted = {k.hex() for k in new_keys}
        bar = progress_bar(todo, progress)
        last_flush = time.perf_counter()
        for doc, chunks in chunked:
            entries = [self._ingest_chunk(c, salt, sizes, rep, bar) for c in chunks]
            self._embed_missing(entries, rep)
            before = self.manifest.documents.get(doc.id)
            self.manifest.documents[doc.id] = DocEntry(doc.sha256, origin, entries)
            if before is not None:
                self.manifest.retired.update(c.key for c in before.chunks)
            if commit_early and time.perf_counter() - last_flush > self.engine.config.flush_s:
                self._count(rep, self._flush(hold=wanted))
                last_flush = time.perf_counter()
        bar(0, done=True)

        if prune:
            present = {d.id for d in docs}
            gone = [i for i, d in self.manifest.documents.items() if i not in present
                    and (d.source == origin or d.source in moved_from)]
            rep.removed = len(gone)
            self.remove(gone, flush=False)
        # every document of the state, other corpora's too (their embeddings may be lost)
        self._embed_missing([c for d in self.manifest.documents.values() for c in d.chunks],
                            rep)
        self.manifest.reencoding = False  # every chunk of this ingest stored in its settings
        self._count(rep, self._flush())
        counted: set[str] = set()
        for d in docs:
            for c in self.manifest.documents[d.id].chunks:
                rep.chunks += 1
                rep.tokens += c.tokens
                if c.key not in counted:
                    counted.add(c.key)
                    rep.stored_bytes += max(c.stored_bytes, held.get(c.key, 0))
        rep.total_s = time.perf_counter() - t0
        return rep

    def _write_ahead(self, keys: set[str], reencode: bool) -> None:
        """Commit what a crash while storing must leave known, before anything is stored: the
        ``keys`` about to be stored, retired until a commit references them (so a rerun
        deletes those no document uses any more), and a re-encode under way
        (``Manifest.reencoding``), since stores replace the entries the last commit lists. The
        manifest on disk (the last commit) gets them, as does this object's."""
        if self.manifest.shared:  # it deletes nothing from kdn
            keys = set()
        if not keys - self.manifest.retired and (self.manifest.reencoding or not reencode):
            return
        last = Manifest.load(self.state)
        last.retired |= keys
        last.settings = last.settings or self.manifest.settings  # the namespace they are in
        last.reencoding |= reencode
        last.save(self.state)
        self.manifest.retired |= keys
        self.manifest.reencoding |= reencode

    def _claim(self, docs: Sequence[Document], origin: str) -> set[str]:
        """Make ``origin`` the source of every listed document the manifest holds (a corpus
        folder renamed or moved keeps its documents), or InvalidArgument when another source
        still holds one of them (the class docstring's rule); the earlier sources that no
        longer exist on disk, whose unlisted documents a prune removes too."""
        if origin == "api":
            return set()
        taken = [(d.id, e) for d in docs if (e := self.manifest.documents.get(d.id)) is not None
                 and e.source not in (origin, "api")]
        clash = [(i, e.source) for i, e in taken if _holds(Path(e.source), i)]
        if clash:
            doc_id, other = clash[0]
            more = f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""
            raise InvalidArgument(
                f"{doc_id}{more}: {origin} and {other} both have a document of this id (a path "
                f"relative to its folder) and {self.state} holds {other}'s; ingest one of them "
                f"into another --state folder, or `kdn rag rm {doc_id}` first")
        moved_from: set[str] = set()
        for _, entry in taken:
            if not Path(entry.source).exists():
                moved_from.add(entry.source)
            entry.source = origin
        return moved_from

    def _check_settings(self) -> None:
        old = self.manifest.settings
        if old is None:
            return
        new = self.settings
        differ = []
        renamed = old.layout != new.layout and old.layout in self.engine.former_layouts()
        if renamed:
            differ.append(f"model name (layout {old.layout[:12]} there, {new.layout[:12]} here:"
                          " an older kdn named this model and its weights otherwise)")
        elif old.layout != new.layout and old.config and old.config == new.config:
            differ.append(f"model (layout {old.layout[:12]} there, {new.layout[:12]} here: "
                          f"weights {old.weights!r} there, {new.weights!r} here, of one config:"
                          " other weights, or these as another kdn version named them)")
        elif old.layout != new.layout:
            differ.append(f"model (layout {old.layout[:12]} there, {new.layout[:12]} here: "
                          "not the same model or weights)")
        if old.namespace != new.namespace:
            differ.append(f"namespace ({old.namespace!r} there, {new.namespace!r} here)")
        if differ:
            again = f"`kdn rag ingest CORPUS --state NEW_FOLDER`, then remove {self.state}"
            raise InvalidArgument(
                f"{self.state} holds a corpus ingested with another "
                f"{' and another '.join(differ)}; " + (
                    "kdn's fingerprint of the model changed on upgrade, so its stored chunks "
                    f"are misses: ingest the corpus again into a new state folder ({again})"
                    if renamed else "use the model and namespace it was ingested with, or "
                    f"another state folder (the same model under another kdn version: {again})"))

    def _former_names(self) -> tuple[str, ...]:
        """Names a state written by an older kdn recorded of this embedder
        (``kdn.model.embed.Embedder.former_names``: its folder)."""
        names = getattr(self._embedder, "former_names", ())
        return tuple(n for n in names if isinstance(n, str) and n)

    def _check_embedder(self) -> None:
        """InvalidArgument unless this object's embedder is the one the state's embeddings
        came from (``Settings.embedder``; in a state that did not record it, one of their
        dimension), before anything is prefilled or searched."""
        old, name = self.manifest.settings, self.settings.embedder
        if old is not None and old.embedder and old.embedder != name and \
                old.embedder not in self._former_names():
            raise InvalidArgument(f"{self.state} was embedded by {old.embedder!r}, not by this "
                                  f"knowledge base's {name!r} (their vectors do not compare); "
                                  "use that embedder, or another state folder")
        if len(self.index) and (self._embedder is not None or old is None or not old.embedder):
            dim = getattr(self.embedder, "dim", None)
            if isinstance(dim, int) and dim != self.index.dim:
                raise InvalidArgument(f"{self.state} holds {self.index.dim}-dim embeddings, "
                                      f"this knowledge base's embedder ({name!r}) makes "
                                      f"{dim}-dim ones; use the embedder it was ingested "
                                      "with, or another state folder")

    def _ingest_chunk(self, chunk: Chunk, salt: str, sizes: dict[bytes, int],
                      rep: IngestReport, bar: Callable[..., None]) -> ChunkEntry:
        key = self.engine.key(chunk.ids, salt)
        size = sizes.get(key, -1)
        if size >= 0:
            rep.reused += 1
        else:
            tp = time.perf_counter()
            kv = self.engine.prefill(chunk.ids)
            ts = time.perf_counter()
            size = self.engine.store(key, kv)
            rep.prefill_s += ts - tp
            rep.store_s += time.perf_counter() - ts
            rep.computed += 1
            rep.computed_tokens += chunk.tokens
            sizes[key] = size
            bar(1)
        return ChunkEntry(key.hex(), chunk.tokens, chunk.text, size)

    def _embed_missing(self, entries: list[ChunkEntry], rep: IngestReport) -> None:
        todo: dict[str, str] = {}
        for c in entries:
            if c.key not in self.index and c.key not in todo:
                todo[c.key] = c.text
        if not todo:
            return
        te = time.perf_counter()
        self.index.add(list(todo), self.embedder.embed(list(todo.values())))
        rep.embed_s += time.perf_counter() - te

    def remove(self, doc_ids: Sequence[str], *, flush: bool = True) -> int:
        """Forget documents; delete their chunks' kdn entries no other document uses (the
        state folder locked as by ``ingest``): how many were deleted. With ``flush`` False
        (ingest's prune) the caller's commit deletes them. One ``str`` is refused
        (InvalidArgument), not taken as the ids of its characters."""
        ids = check_texts(doc_ids, "doc_ids", "doc_id")
        with self._writing():
            return self._remove(ids, flush)

    def _remove(self, doc_ids: Sequence[str], flush: bool) -> int:
        self._check_settings()  # another model's keys are not the entries to delete
        for doc_id in doc_ids:
            d = self.manifest.documents.pop(doc_id, None)
            if d is not None:
                self.manifest.retired.update(c.key for c in d.chunks)
        if not flush:
            return 0
        deleted, self.kept = self._flush()
        return deleted

    # -- asking ---------------------------------------------------------------------------------

    def retrieve(self, question: str, k: int | None = None) -> list[Source]:
        """The top-k chunks for ``question``, best first (InvalidArgument for a question that
        is not valid Unicode: ``kdn.text.check_text``)."""
        return self._retrieve(question, k)[1]

    def _retrieve(self, question: str, k: int | None) -> tuple[_Commit, list[Source]]:
        """The last commit (read again when another one is on disk: ``_refresh``) and its
        top-k chunks for ``question``."""
        check_text(question, "the question")
        if k is not None:
            check_count("k", k, " (None: RagConfig.top_k)")
        self._check_settings()  # another model would recompute and store every chunk anew
        self._refresh()
        self._check_embedder()
        commit = self._committed  # one commit, whatever a writer does meanwhile
        if commit.unembedded:
            raise Corrupt(commit.unembedded)
        qv = self.embedder.embed([question])[0]
        out = []
        for key, score in commit.index.search(qv, k or self.engine.config.top_k):
            if key in commit.by_key:
                doc_id, c, position = commit.by_key[key]
                out.append(Source(key, c.text, doc_id, position, score))
        return commit, out

    def ask(self, question: str, k: int | None = None,
            max_new_tokens: int | None = None) -> Answer:
        """Retrieve from the last commit (another process's too), fetch the chunks' KV
        (computing missing ones), blend, generate; then store the computed chunks the state
        still lists (``_store_listed``)."""
        self.engine.config.new_tokens(max_new_tokens)  # before anything is retrieved
        t0 = time.perf_counter()
        commit, sources = self._retrieve(question, k)
        if not sources:
            raise InvalidArgument("the knowledge base is empty: ingest a corpus first")
        retrieval_s = time.perf_counter() - t0
        prepared = self.engine.prepare(question, [s.text for s in sources], max_new_tokens,
                                       salt=commit.salt)
        prepared.timings.retrieval_s = retrieval_s
        prepared.timings.ttft_s += retrieval_s
        computed, prepared.missing = prepared.missing, []
        answer = self.engine.finish(prepared, sources[:prepared.used], max_new_tokens)
        self._store_listed(computed, answer.timings)
        return answer

    def _store_listed(self, chunks: list[ChunkConnector], t: AskTimings) -> None:
        """Store the chunks an ask computed whose keys the state's last commit (on disk now)
        still lists. A chunk of a document removed or changed since the ask retrieved it is
        not stored: no manifest names it, so no rm or ingest would ever delete it. Nothing is
        stored while a thread of this process writes the state (its commit may drop them);
        the next ask computes them again. A store kdn refuses is counted, not raised
        (``kdn.rag.pipeline.store_back``): the answer is already made."""
        if not chunks or not self._write.acquire(blocking=False):
            return
        try:
            if self._writers:
                return
            self._refresh()
            listed = self._committed.by_key
            store_back([c for c in chunks if c.key.hex() in listed], t)
        finally:
            self._write.release()


def _holds(source: Path, doc_id: str) -> bool:
    """Whether a corpus on disk still has the document ``doc_id``: a folder its file, a file
    (JSONL or text) by existing."""
    return (source / doc_id).is_file() if source.is_dir() else source.is_file()
