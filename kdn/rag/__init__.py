"""RAG on kdn: ingest a corpus as chunk KV caches, answer questions by blending them.

    from kdn.rag import KnowledgeBase, RagEngine
    engine = RagEngine(model, tokenizer, client)               # drop-in: chunks + question
    engine.answer("Who ...?", ["chunk 1", "chunk 2"]).text
    kb = KnowledgeBase(engine, ".kdn-rag")                     # corpus + retrieval index
    kb.ingest("docs/"); kb.ask("Who ...?")

``corpus`` loads and chunks documents, ``index`` persists the manifest and embeddings,
``pipeline`` holds the engine and the knowledge base, ``cli`` the ``kdn rag`` commands.
"""

from kdn.rag.corpus import Chunk, Document, chunk_document, load_corpus
from kdn.rag.pipeline import (
    Answer,
    AskTimings,
    IngestReport,
    KnowledgeBase,
    RagConfig,
    RagEngine,
    Source,
)

__all__ = [
    "Answer",
    "AskTimings",
    "Chunk",
    "Document",
    "IngestReport",
    "KnowledgeBase",
    "RagConfig",
    "RagEngine",
    "Source",
    "chunk_document",
    "load_corpus",
]
