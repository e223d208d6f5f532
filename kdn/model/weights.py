"""Which weights a transformers model holds, as a name for its KV's fingerprint.

Model side only. ``default_weights_id`` names them by where transformers loaded them from (a
folder's name and a digest of its weight files: ``weights_digest``; a hub id and its revision)
or, for a model built from a config, by a digest of its parameters (``parameters_digest``);
``former_weights_ids`` lists what older kdn named them. ``kdn.model.hf`` exports these, and
every caller reaches them through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from pathlib import Path
from typing import Any

import torch


def default_weights_id(model: Any) -> str:
    """Which weights ``model`` holds, as far as where transformers loaded them from tells: a
    local folder's name and a digest of its weights' bytes (``weights_digest``: the same
    weights at another path or on another machine share their KV; checkpoints of one config
    in folders of the same name, ``run1/final`` and ``run2/final``, do not); a hub id with the
    revision it resolved to (``config._commit_hash``) where known; for a model built from a
    config (its weights given by ``load_state_dict``, as training code does), a digest of its
    parameters (``parameters_digest``: two such models of one config do not share their KV).
    Transformers records no ``subfolder=`` nor ``gguf_file=`` of a load: where the
    folder (or the hub snapshot in the local cache) holds no weight file of its own, or
    several GGUF files, the id is a digest of the loaded parameters instead
    (``parameters_digest``), so checkpoints in subfolders of one root, or GGUF variants of one
    folder, do not share their KV. Weights changed in memory after loading (an adapter merged;
    for a digest of the parameters, a change through ``.data``, which their version counters
    do not count) are not seen: name them yourself (``EngineConfig.weights_id``)."""
    name = str(getattr(model, "name_or_path", "") or "")
    if not name:
        return f"params#{parameters_digest(model)}"
    folder = Path(name).expanduser()
    if folder.exists():  # what transformers loads first, before asking the hub
        if not folder.is_dir():
            return str(folder.resolve())
        digest = weights_digest(folder)
        return f"{folder.resolve().name}#{digest}" if digest \
            else f"params#{parameters_digest(model)}"
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    if not revision:
        return name
    snapshot = _hub_snapshot(name, str(revision))
    if snapshot is not None and weights_digest(snapshot) is None:
        return f"{name}@{revision}#params-{parameters_digest(model)}"
    return f"{name}@{revision}"


def former_weights_ids(model: Any) -> tuple[str, ...]:
    """What older kdn named ``model``'s weights by default (``default_weights_id`` before it
    named them as it does now): "" (a model built from a config), the name it was loaded by and
    that name's last part (a folder's name, a hub id's), a folder resolved, a hub id with its
    revision. An entry or a RAG state whose layout names one of these was written by an older
    kdn for a model of this config loaded by this name: the fingerprint changed, not the model
    (unless other weights went by the same name, as any two built from one config did)."""
    name = str(getattr(model, "name_or_path", "") or "")
    ids = ["", name, Path(name).name]
    folder = Path(name).expanduser()
    if name and folder.exists():
        ids.append(str(folder.resolve()))
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    if name and revision:
        ids.append(f"{name}@{revision}")
    return tuple(dict.fromkeys(ids))


def _hub_snapshot(name: str, revision: str) -> Path | None:
    """The folder of hub model ``name`` at ``revision`` in the default local hub cache; None
    where it is not there (another ``cache_dir``, or no such model)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    folder = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / \
        "snapshots" / revision
    return folder if folder.is_dir() else None


def parameters_digest(model: Any) -> str:
    """A digest of the parameters ``model`` holds (BLAKE2b): each one's name, dtype and shape
    and its first 4 KiB of bytes (one copy from the device), the same on every machine and
    device. A parameter not materialised (the meta device) counts by its name and shape.
    Memoised per model until a parameter is replaced or changed in place (its version
    counter), so a model named by it (every blend of one built from a config) reads nothing
    back from its device again."""
    params = sorted(model.named_parameters(), key=lambda item: item[0])
    stamp = tuple((pname, p.data_ptr(), p._version, p.dtype, p.shape) for pname, p in params)
    memo = _PARAMETER_DIGESTS.get(model)
    if memo is not None and memo[0] == stamp:
        return memo[1]
    h = hashlib.blake2b(digest_size=16)
    samples: list[torch.Tensor] = []
    for pname, p in params:
        h.update(f"{pname}\0{p.dtype}\0{list(p.shape)}\0".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)[: max(1, _SAMPLE_BYTES // p.element_size())]
            samples.append(flat.contiguous().view(torch.uint8))
    if samples:
        h.update(torch.cat([t.to(samples[0].device) for t in samples]).cpu().numpy().tobytes())
    digest = h.hexdigest()
    with contextlib.suppress(TypeError):  # (a model that takes no weak reference: not kept)
        _PARAMETER_DIGESTS[model] = (stamp, digest)
    return digest


_PARAMETER_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = \
    weakref.WeakKeyDictionary()
_SAMPLE_BYTES = 4096
_DIGESTS: dict[tuple[str, ...], str | None] = {}


def weights_digest(folder: Path) -> str | None:
    """A digest of the weights a folder holds, the same on every machine (BLAKE2b): each
    ``*.safetensors`` file's tensor table (names, dtypes, shapes) and the first 4 KiB of every
    tensor's bytes (a fine-tune or a merged adapter changes every tensor it touches
    throughout), each other weight file's size and 4 KiB at 64 evenly spaced places. None
    where the folder holds no weight file, or a GGUF file beside other weight files (a load
    picks one of them by ``gguf_file=``, which the model does not record). A few MB read,
    memoised by the files' sizes and times."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
                   for p in folder.glob(pattern) if p.is_file())
    if not files or (len(files) > 1 and any(p.suffix == ".gguf" for p in files)):
        return None
    stats = tuple(f"{p.name}:{st.st_size}:{st.st_mtime_ns}"
                  for p, st in ((p, p.stat()) for p in files))
    memo = (str(folder.resolve()), *stats)
    if memo in _DIGESTS:
        return _DIGESTS[memo]
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            table = _safetensors_table(f, size) if p.suffix == ".safetensors" else None
            if table is not None:
                start, tensors = table
                for tname in sorted(tensors):
                    info = tensors[tname]
                    lo, hi = info["data_offsets"]
                    h.update(f"{tname}\0{info['dtype']}\0{info['shape']}\0".encode())
                    f.seek(start + lo)
                    h.update(f.read(min(_SAMPLE_BYTES, hi - lo)))
            else:
                for i in range(64):
                    f.seek(size * i // 64)
                    h.update(f.read(_SAMPLE_BYTES))
    _DIGESTS[memo] = digest = h.hexdigest()
    return digest


def _safetensors_table(f: Any, size: int) -> tuple[int, dict[str, Any]] | None:
    """(where the tensors' bytes start, the tensor table) of a safetensors file; None where it
    does not parse as one (it is then sampled as any file)."""
    head = f.read(8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if not 2 <= n <= min(size - 8, 100 << 20):
        return None
    try:
        table = json.loads(f.read(n))
        tensors = {k: v for k, v in table.items() if k != "__metadata__"}
        for v in tensors.values():
            lo, hi = v["data_offsets"]
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
                return None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return 8 + n, tensors
