"""Content keys: deterministic hashes naming cached KV, equal in every process and machine.

Three forms, all BLAKE2b-256 over a domain tag, the namespace, the layout fingerprint (which
covers the model fingerprint) and the token ids as little-endian int32:

* ``chunk_key``: position-free key of a knowledge chunk that may be placed anywhere in a prompt
  (the cache was prefilled with the chunk alone, from position 0).
* ``prefix_keys``: chained keys over fixed-size token chunks, for prefix reuse. Key i covers
  tokens [0, (i+1) * chunk_tokens): it hashes key i-1 and chunk i's tokens (and what else the
  engine says chunk i's KV depends on: its images, its prompt embeddings), so a hit on key i
  implies the whole prefix matches.
* ``text_chunk_key``: tokenize with the model's tokenizer, then ``chunk_key``. Keys name token
  ids, never text: texts that tokenize alike share a key, texts that do not (``"é"`` in NFC
  and in NFD, ``"<|im_end|>"`` parsed as a special token or spelled out) never do
  (``kdn.text``: kdn normalizes nothing).
* ``page_key``: one page of an engine's paged cache, named by the engine's own page hash
  (e.g. SGLang's HiCache keys) plus the layout and the page size.

Each also takes what engines key on beyond tokens and model: an ``adapter`` id (LoRA), the
``tp`` shard (rank, size) (``page_key`` also ``pp``) and a ``salt`` (vLLM's ``cache_salt``).
Any of them changes the key; left at their defaults the keys are exactly what they were
before these options existed.

Namespaces, tenants and keys follow the rules of ``kdn.names`` (re-exported here).

Inside the server's tiers an entry lives under ``store_key(tenant, namespace, key)``:
``b"<tenant>:<namespace>/<hex key>"``, or ``b"<namespace>/<hex key>"`` for the unscoped key
space (tenant ""); ``split_store_key`` reverses it.

Python's built-in ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from kdn.checks import whole
from kdn.errors import InvalidArgument
from kdn.layout import KVLayout
from kdn.names import (
    DEFAULT_NAMESPACE,
    KEY_BYTES,
    check_key,
    check_namespace,
    check_tenant,
    parse_store_key,
)
from kdn.text import tokenize

DEFAULT_PREFIX_CHUNK = 256
MAX_PREFIX_CHUNK = 1 << 16
"""The most tokens an engine's prefix chunk may hold (``EngineConfig.chunk_tokens``, vLLM's
connector's): a chunk is the unit of reuse, and one this long is larger than most prompts
(and tens of GiB of KV on a large model)."""

if TYPE_CHECKING:
    import torch

TokenIds: TypeAlias = "Sequence[int] | torch.Tensor"


_BOOLS = frozenset((bool, np.bool_))


def _token_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids of one sequence as little-endian int32 bytes (a tensor on any device, or any
    int sequence; no torch needed for the latter). A tensor or array is 1-D, or [1, n] (an
    engine's batch of one); InvalidArgument for a batch of more (hashed flattened, two
    prompts had the key of their concatenation) or a scalar."""
    ids: Any = token_ids
    if hasattr(ids, "detach"):  # a torch tensor
        if ids.dtype.is_floating_point or ids.dtype.is_complex:
            # refused here: numpy has no bfloat16, and .numpy() fails a raw TypeError on it
            raise InvalidArgument(f"token ids must be integers, got {ids.dtype}")
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, (list, tuple)):  # converted in C without inferring a dtype first
        if not _BOOLS.isdisjoint(map(type, ids)):  # refused as a bool tensor or array is
            raise InvalidArgument("token ids must be integers, got a bool")
        try:
            ids = np.frombuffer(array.array("q", ids), dtype=np.int64)
        except TypeError as exc:
            raise InvalidArgument(f"token ids must be integers: {exc}") from None
        except OverflowError:
            raise InvalidArgument("token ids must be in [0, 2**31)") from None
    t = np.asarray(ids)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]  # [1, n]: one sequence
    if t.ndim != 1:
        raise InvalidArgument(f"token ids must be one sequence (1-D, or [1, n]), got shape "
                              f"{list(t.shape)}")
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise InvalidArgument(f"token ids must be integers, got {t.dtype}")
    if t.size and (int(t.min()) < 0 or int(t.max()) >= 2**31):
        raise InvalidArgument("token ids must be in [0, 2**31)")
    return t.astype("<i4").tobytes()


def _layout_bytes(layout: KVLayout) -> tuple[bytes, bytes]:
    """The model and layout fingerprints a key hashes; InvalidArgument for no KVLayout."""
    if not isinstance(layout, KVLayout):
        raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
    return layout.model_fingerprint.encode(), layout.fingerprint.encode()


def _h(*parts: bytes) -> bytes:
    """BLAKE2b of the parts, each preceded by its length (8 bytes, little-endian)."""
    framed: list[bytes] = []
    for p in parts:
        framed += (len(p).to_bytes(8, "little"), p)
    return hashlib.blake2b(b"".join(framed), digest_size=KEY_BYTES).digest()


Shard = tuple[int, int]
"""(rank, size) of one tensor- or pipeline-parallel shard; (0, 1) is the whole model."""


def _u32(name: str, value: object) -> int:
    """``value`` when it is a whole number in [1, 2**32) (it is hashed as 4 bytes);
    InvalidArgument naming ``name`` otherwise (``kdn.checks.whole``: 2.5, "2", True are not)."""
    got = whole(name, value, 1)
    if got >= 1 << 32:
        raise InvalidArgument(f"{name} must be below 2**32, got {got}")
    return got


def _shard_bytes(name: str, shard: Shard | None) -> bytes:
    if shard is None:
        return b""
    try:
        rank, size = shard
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be (rank, size), got {shard!r}") from None
    rank, size = whole(f"{name}'s rank", rank), _u32(f"{name}'s size", size)
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"{name} must be (rank, size) with 0 <= rank < size, got {shard!r}")
    return b"" if size == 1 else rank.to_bytes(4, "little") + size.to_bytes(4, "little")


def _scope(adapter: str = "", tp: Shard | None = None, salt: str | bytes = b"",
           pp: Shard | None = None) -> tuple[bytes, ...]:
    """What an engine keys on beyond tokens and layout, as extra hash parts: none at all for
    the defaults (so keys made without them are what they always were), else one part.

    ``adapter``: the LoRA (or other) adapter the KV was computed with. ``tp``/``pp``: the
    tensor-/pipeline-parallel shard holding it ((0, 1) is the whole model: the same bytes as no
    shard). ``salt``: an opaque per-request or per-user value (vLLM's ``cache_salt``) that keeps
    caches apart even inside one namespace.

    Both are opaque: a str is hashed as UTF-8 with ``surrogatepass``, so any str has a key (a
    request's ``cache_salt`` decoded from JSON may hold a lone surrogate) and different strs
    never share one."""
    if not isinstance(adapter, str):
        raise InvalidArgument(f"adapter must be a str, got {type(adapter).__name__}")
    if not isinstance(salt, (str, bytes)):
        raise InvalidArgument(f"salt must be str or bytes, got {type(salt).__name__}")
    salt_b = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt)
    tp_b, pp_b = _shard_bytes("tp", tp), _shard_bytes("pp", pp)
    if not (adapter or tp_b or pp_b or salt_b):
        return ()
    return (_h(b"kdn/scope/v1", adapter.encode("utf-8", "surrogatepass"), tp_b, pp_b, salt_b),)


def scope_tag(adapter: str = "", salt: str | bytes = b"") -> str:
    """A short name of an adapter and salt (16 hex digits of their hash; "" for neither), for
    an engine to mark the entries it stores with its scope without writing the salt itself."""
    parts = _scope(adapter, salt=salt)
    return parts[0].hex()[:16] if parts else ""


def chunk_key(token_ids: TokenIds, layout: KVLayout, namespace: str = DEFAULT_NAMESPACE, *,
              adapter: str = "", tp: Shard | None = None, salt: str | bytes = b"") -> bytes:
    """Position-free key of a chunk's KV (prefilled alone, from position 0). ``adapter``,
    ``tp`` and ``salt`` scope it to an engine's adapter, shard and salt (see ``_scope``).
    InvalidArgument for no tokens: a chunk key names the KV of at least one."""
    check_namespace(namespace)
    raw = _token_bytes(token_ids)
    if not raw:
        raise InvalidArgument("chunk_key of no tokens: a chunk key names the KV of at least "
                              "one token")
    return _h(
        b"kdn/chunk/v1",
        namespace.encode(),
        *_layout_bytes(layout),
        raw,
        *_scope(adapter, tp, salt),
    )


def prefix_keys(
    token_ids: TokenIds,
    layout: KVLayout,
    namespace: str = DEFAULT_NAMESPACE,
    chunk_tokens: int = DEFAULT_PREFIX_CHUNK,
    *,
    adapter: str = "",
    tp: Shard | None = None,
    salt: str | bytes = b"",
    extras: Sequence[bytes] = (),
) -> list[bytes]:
    """Chained keys of each full ``chunk_tokens`` block of the prefix; a partial tail has none.
    ``adapter``/``tp``/``salt`` enter the chain's root, so they change every link.
    ``extras[i]`` (opaque bytes) enters chunk i's link and so every later one: what the KV of
    chunk i depends on beyond its token ids (an engine's images placed in it, its prompt
    embeddings). A chunk past the end of ``extras``, or whose extra is empty, has the link it
    would have without."""
    check_namespace(namespace)
    chunk_tokens = _u32("chunk_tokens", chunk_tokens)
    if not isinstance(extras, Sequence) or isinstance(extras, (bytes, str)) \
            or not all(isinstance(e, bytes) for e in extras):
        raise InvalidArgument("extras must be a sequence of bytes, one per chunk")
    raw = _token_bytes(token_ids)
    step = chunk_tokens * 4
    prev = _h(
        b"kdn/prefix/v1",
        namespace.encode(),
        *_layout_bytes(layout),
        chunk_tokens.to_bytes(4, "little"),
        *_scope(adapter, tp, salt),
    )
    out: list[bytes] = []
    for i in range(len(raw) // step):
        part = raw[i * step : (i + 1) * step]
        if i < len(extras) and extras[i]:
            prev = _h(b"kdn/prefix-link-extra/v1", prev, part, extras[i])
        else:
            prev = _h(b"kdn/prefix-link/v1", prev, part)
        out.append(prev)
    return out


def text_chunk_key(
    text: str, tokenizer: Any, layout: KVLayout, namespace: str = DEFAULT_NAMESPACE, *,
    adapter: str = "", tp: Shard | None = None, salt: str | bytes = b""
) -> bytes:
    """Key of a text chunk: tokenized without special tokens added (those written in the text
    are parsed, as the tokenizer does by default: ``kdn.text.tokenize``), then ``chunk_key``.
    InvalidArgument for a text that is not valid Unicode or gives no tokens."""
    ids = tokenize(tokenizer, text, "the chunk text")
    if not ids:
        raise InvalidArgument(f"the chunk text {text[:40]!r} gives no tokens: a chunk key names "
                              "the KV of at least one token")
    return chunk_key(ids, layout, namespace, adapter=adapter, tp=tp, salt=salt)


def page_key(page_hash: str | bytes, layout: KVLayout, namespace: str = DEFAULT_NAMESPACE, *,
             page_tokens: int, adapter: str = "", tp: Shard | None = None,
             pp: Shard | None = None, salt: str | bytes = b"") -> bytes:
    """Key of one page of an engine's paged KV cache, named by the engine's own page hash
    (SGLang's HiCache keys: a hash of the page's tokens chained over the pages before it).
    The hash says nothing of the model, so the layout (model, shape, dtype), ``page_tokens``
    and the engine's adapter, TP/PP shard and salt are hashed with it. ``page_hash`` must be
    str (encodable as UTF-8) or bytes: anything else is refused rather than converted (``bytes``
    of an int is that many zero bytes)."""
    check_namespace(namespace)
    page_tokens = _u32("page_tokens", page_tokens)
    if isinstance(page_hash, str):
        try:
            raw = page_hash.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"page_hash is not encodable text: {exc}") from None
    elif isinstance(page_hash, bytes):
        raw = page_hash
    else:
        raise InvalidArgument(f"page_hash must be str or bytes, got {type(page_hash).__name__}")
    if not raw:
        raise InvalidArgument("page_hash must not be empty")
    return _h(
        b"kdn/page/v1",
        namespace.encode(),
        *_layout_bytes(layout),
        page_tokens.to_bytes(4, "little"),
        raw,
        *_scope(adapter, tp, salt, pp),
    )


def variant_key(key: bytes, encoding: str) -> bytes:
    """Key of one stored encoding of an entry. ``lossless`` is the entry's own key, so a plain
    ``Client.store(key, kv)`` is found; other encodings (``kdn.delivery.encoding_name``, e.g.
    ``kdn-default``, ``int8``) get derived keys."""
    key = check_key(key)
    if not isinstance(encoding, str) or not encoding:
        raise InvalidArgument(f"encoding must be an encoding's name (kdn.delivery.encoding_name),"
                              f" got {encoding!r}")
    if encoding == "lossless":
        return key
    try:
        name = encoding.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"encoding must be an encoding's name, got {encoding!r}, which "
                              f"is not valid Unicode") from None
    return _h(b"kdn/variant/v1", key, name)


def store_key(tenant: str, namespace: str, key: bytes) -> bytes:
    """The key an entry has inside the tiers: ``b"<tenant>:<namespace>/<hex key>"``, or
    ``b"<namespace>/<hex key>"`` when ``tenant`` is "" (the unscoped key space)."""
    ns = check_namespace(namespace)
    if tenant:  # neither name can hold ':' or '/', which separate the parts (kdn.names)
        ns = f"{check_tenant(tenant)}:{ns}"
    return ns.encode() + b"/" + check_key(key).hex().encode()


def split_store_key(skey: bytes) -> tuple[str, str, bytes]:
    """(tenant, namespace, key) of a tier key made by ``store_key``; tenant "" when unscoped.
    ValueError for one no ``store_key`` made (``parse_store_key``)."""
    got = parse_store_key(skey)
    if got is None:
        raise ValueError(f"not a kdn tier key: {skey[:80]!r}")
    return got
