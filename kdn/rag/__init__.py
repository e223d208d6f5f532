"""RAG on kdn: ingest a corpus as chunk KV caches, answer questions by blending them.

    from kdn.rag import KnowledgeBase, RagEngine
    engine = RagEngine(model, tokenizer, client)               # drop-in: chunks + question
    engine.answer("Who ...?", ["chunk 1", "chunk 2"]).text
    kb = KnowledgeBase(engine, ".kdn-rag")                     # corpus + retrieval index
    kb.ingest("docs/"); kb.ask("Who ...?")

``corpus`` loads and chunks documents, ``index`` persists the manifest and embeddings,
``pipeline`` holds the engine, ``knowledge`` the knowledge base (``report`` what its ingest
reports; ``kdn.cli.rag``: the ``kdn rag`` commands). The names below load on first use, so
``kdn rag --help`` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdn.lazy import lazy_exports

if TYPE_CHECKING:
    from kdn.rag.corpus import Chunk, Document, chunk_document, load_corpus
    from kdn.rag.knowledge import KnowledgeBase
    from kdn.rag.pipeline import Answer, AskTimings, RagConfig, RagEngine, Source
    from kdn.rag.report import IngestReport

_HOME = {name: "kdn.rag.pipeline" for name in (
    "Answer", "AskTimings", "RagConfig", "RagEngine", "Source")}
_HOME.update({"KnowledgeBase": "kdn.rag.knowledge", "IngestReport": "kdn.rag.report"})
_HOME.update({name: "kdn.rag.corpus" for name in (
    "Chunk", "Document", "chunk_document", "load_corpus")})

__all__ = ["Answer", "AskTimings", "Chunk", "Document", "IngestReport", "KnowledgeBase",
           "RagConfig", "RagEngine", "Source", "chunk_document", "load_corpus"]

__getattr__, __dir__ = lazy_exports(__name__, _HOME, __all__)
