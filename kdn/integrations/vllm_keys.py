"""The kdn keys of a vLLM request's chunks (``kdn.integrations.vllm_scheduler``): what vLLM's
own prefix cache keys a block on (``vllm.v1.core.kv_cache_utils``), per kdn chunk.

``request_chains(request, token_ids, shape, config)`` chains ``keys.prefix_keys`` over the
token ids, one chain per TP rank, with:

* the LoRA adapter as its name and its path (``adapter``, length-framed): a name pointed at
  other weights names other KV;
* per chunk, an extra (``extras``): each image (or other multimodal item) placed in the chunk,
  by its hash (``identifier``) and its offset from the chunk's start; the hash of the chunk's
  prompt embeddings and of which of its positions they fill (vLLM writes 0 at embedded
  positions of the token ids); the request's ``cache_salt``, in chunk 0's (so in every link);
* the connector's ``salt`` in the chain's root, and after vLLM's ``reset_cache`` (new weights)
  the random ``epoch`` the scheduler drew then.

A request with none of these has the keys plain ``prefix_keys`` gives.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from kdn import keys
from kdn.errors import InvalidArgument
from kdn.integrations.vllm_meta import KDNConnectorConfig, PagedShape

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _framed(*parts: bytes) -> bytes:
    """The parts, each after its length (8 bytes, little-endian): never two ways to read."""
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def _text(value: object) -> bytes:
    return str(value).encode("utf-8", "surrogatepass")


def adapter_name(request: Request) -> str:
    """The request's LoRA adapter as kdn keys name it: its name and its path, framed by the
    name's length; "" without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return ""
    name = str(getattr(lora, "lora_name", "") or "")
    path = str(getattr(lora, "lora_path", "") or "")
    return f"{len(name)}:{name}:{path}"


def _mm_extra(features: list[Any], start: int, end: int) -> bytes:
    """The multimodal items overlapping tokens [start, end): hash, offset from start, length."""
    out = []
    for f in features:
        pos = f.mm_position
        offset, length = int(pos.offset), int(pos.length)
        if offset < end and offset + length > start:
            ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
            if not ident:
                raise InvalidArgument(f"a {f.modality} item at token {offset} has no hash: its "
                                      "chunks can not be keyed")
            out.append(_framed(b"mm", _text(ident),
                               (offset - start).to_bytes(8, "little", signed=True),
                               length.to_bytes(8, "little")))
    return b"".join(out)


def _embeds_extra(embeds: torch.Tensor, mask: list[bool] | None, start: int, end: int) -> bytes:
    """A hash of the prompt embeddings of positions [start, end) (none past the prompt) and of
    which of those positions they fill (all where ``mask`` is None)."""
    part = embeds[start:end]  # [tokens, hidden]
    if not part.shape[0]:
        return b""
    h = hashlib.blake2b(digest_size=32)
    h.update(_framed(_text(part.dtype), _text(tuple(part.shape))))
    h.update(part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    if mask is not None:
        h.update(bytes(bool(m) for m in mask[start:end]))
    return _framed(b"prompt_embeds", h.digest())


def chunk_extras(request: Request, num_tokens: int, chunk_tokens: int) -> list[bytes]:
    """Per full chunk of the first ``num_tokens`` tokens, what its KV depends on beyond its
    token ids (module docstring); [] when nothing does."""
    features = list(getattr(request, "mm_features", None) or ())
    embeds = getattr(request, "prompt_embeds", None)
    mask = getattr(request, "prompt_is_token_ids", None)
    cache_salt = getattr(request, "cache_salt", None)
    if not (features or embeds is not None or cache_salt):
        return []
    out = []
    for i in range(num_tokens // chunk_tokens):
        start, end = i * chunk_tokens, (i + 1) * chunk_tokens
        extra = _mm_extra(features, start, end)
        if embeds is not None:
            extra += _embeds_extra(embeds, mask, start, end)
        if i == 0 and cache_salt:
            extra += _framed(b"cache_salt", _text(cache_salt))
        out.append(extra)
    return out


def request_chains(request: Request, token_ids: list[int], shape: PagedShape,
                   config: KDNConnectorConfig, epoch: bytes = b"") -> list[list[bytes]]:
    """Per TP rank: the keys of each full chunk of ``token_ids`` (module docstring);
    ``epoch`` (b"": none) is mixed into the salt."""
    c = shape.chunk_tokens
    extras = chunk_extras(request, len(token_ids), c)
    adapter = adapter_name(request)
    salt: str | bytes = config.salt
    if epoch:
        salt = _framed(b"epoch", _text(config.salt), epoch)
    return [keys.prefix_keys(token_ids, shape.layout, config.namespace, c, adapter=adapter,
                             tp=(r, shape.tp_size), salt=salt, extras=extras)
            for r in range(shape.tp_size)]
