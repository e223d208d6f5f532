"""What an ingest reports (``IngestReport``, ``kdn.rag.knowledge``) and its progress bar."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class IngestReport:
    documents: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0
    chunks: int = 0
    """Chunks of the corpus after the ingest."""
    computed: int = 0
    """Chunks prefilled and stored by this ingest."""
    reused: int = 0
    """Chunks of changed documents that kdn already held."""
    tokens: int = 0
    """Tokens in the corpus's chunks."""
    computed_tokens: int = 0
    stored_bytes: int = 0
    """Bytes kdn holds for the corpus's chunks (this ingest's writes and earlier ones)."""
    deleted: int = 0
    """kdn entries deleted (chunks of changed or removed documents no document uses)."""
    kept: int = 0
    """Chunks no document uses that a shared state (module docstring) left in kdn."""
    embed_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0

    def summary(self) -> str:
        mib = self.stored_bytes / (1 << 20)
        return (f"{self.documents} documents ({self.changed} changed, {self.unchanged} unchanged,"
                f" {self.removed} removed); {self.chunks} chunks, {self.tokens} tokens; computed "
                f"{self.computed} chunks ({self.computed_tokens} tokens), reused {self.reused}; "
                f"deleted {self.deleted} entries{_kept(self.kept)}; kdn holds {mib:.1f} MiB "
                "for the corpus; "
                f"{self.total_s:.1f} s "
                f"(prefill {self.prefill_s:.1f}, store {self.store_s:.1f}, embed "
                f"{self.embed_s:.1f})")


def _kept(n: int) -> str:
    return f", kept {n} another state may use" if n else ""


def progress_bar(total: int, enabled: bool) -> Callable[..., None]:
    """A tqdm bar over the chunks to compute (on stderr), or a no-op."""
    if not enabled or total == 0:
        return lambda n=1, done=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="chunk", desc="prefill+store", dynamic_ncols=True)

    def update(n: int = 1, done: bool = False) -> None:
        if n:
            bar.update(n)
        if done:
            bar.close()

    return update
