"""What the two halves of kdn's vLLM connector share (``kdn.integrations.vllm``): its settings
(``KDNConnectorConfig``, vLLM's ``kv_connector_extra_config``), the shape of vLLM's paged cache
as kdn sees it (``PagedShape``, from vLLM's ``KVCacheConfig``), and the metadata the scheduler
half sends the worker half each step (``KDNConnectorMetadata``: ``LoadSpec`` and ``SaveSpec``
per request).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kdn import keys
from kdn.checks import MAX_WAIT_S
from kdn.client import Client
from kdn.codec.catalog import check_codec, default_level
from kdn.delivery import IN_PROCESS, NETWORK, SAME_HOST, default_encodings, encoding_name
from kdn.errors import ConfigError, InvalidLayout, KDNError
from kdn.integrations.settings import check_field_types, check_number, check_tls_files, tls_options
from kdn.layout import DType, KVLayout, LayerLayout, model_fingerprint
from kdn.options import StoreOptions
from kdn.transport.addresses import same_host

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

@dataclass(frozen=True)
class KDNConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config``; unknown names are errors."""

    address: str = "127.0.0.1:50051"
    """The kdn server (host:port, or unix:PATH)."""
    namespace: str = "vllm"
    """kdn namespace of the chunks."""
    encodings: tuple[str, ...] = ()
    """Encodings each new chunk is stored in, ``mode`` or ``mode-level`` (``lossless``,
    ``raw``, ``int8``, ``kdn-default``...); the loading controller picks among those stored.
    Empty (default): what pays off where vLLM runs and how kdn is reached
    (``kdn.delivery.default_encodings``): on a GPU ``raw`` from a server on this host or the
    in-process tier, ``kdn-default`` and ``raw`` across a network; ``lossless`` on a CPU."""
    chunk_tokens: int = 256
    """Tokens per kdn entry (the unit of reuse), at most ``keys.MAX_PREFIX_CHUNK``; rounded
    down to whole vLLM blocks (fewer than one block is refused at start)."""
    salt: str = ""
    """Opaque salt in every key, beside each request's own ``cache_salt``."""
    weights_id: str = ""
    """Checkpoint identity (e.g. a revision hash) when the model name alone is ambiguous."""
    ttl_s: int = 0
    """Seconds a stored chunk lives (0: the server's default)."""
    timeout_s: float = 30.0
    """Deadline of each kdn call, and of a layer's wait during a load (at most a day,
    ``kdn.checks.MAX_WAIT_S``)."""
    lookup_threads: int = 2
    """Threads the scheduler's lookups run on."""
    lookup_timeout_s: float = 2.0
    """Deadline of a request's lookup (at most ``timeout_s``, which cuts it, and a day); one
    that passes it makes lookups answer misses at once for ``10 * lookup_timeout_s`` (a
    silent server held every waiting request for its own deadline, one after another)."""
    save_backlog_bytes: int = 1 << 30
    """Gathered KV (bytes, each worker) the saves waiting on a slow server may hold; a step's
    saves past it (or past ``SAVE_BACKLOG_STEPS`` steps waiting) are dropped, counted in
    ``save_errors`` (a later miss). One step's saves always go when none wait."""
    allow_recompute: bool = False
    """Let the loading controller decline a hit when it predicts prefilling is faster (its
    prefill speed is then ``prefill_tok_s``); False: every hit is loaded."""
    prefill_tok_s: float = 20000.0
    """Prefill speed (tokens/s) the controller weighs a hit against (``allow_recompute``)."""
    api_key: str = ""
    """API key of the kdn tenant; "" reads ``$KDN_API_KEY`` (none when unset)."""
    tls_ca: str = ""
    """PEM file of the CA to trust. Any of ``tls_ca``, ``tls_cert``, ``tls_key`` turns TLS on
    (without ``tls_ca``: the system's roots); ``tls_cert``/``tls_key``: mutual TLS."""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    """Send the API key even in plaintext to a non-loopback server (refused otherwise)."""
    shm_bytes: int | None = None
    """Client's shared segment (same host); None: the client's default, 0: gRPC only."""
    local_bytes: int = 0
    """In-process tier of encoded chunks in each worker (0: none)."""
    tp: tuple[int, int] | None = field(default=None, repr=False)
    """(rank, size) of this worker's tensor-parallel shard; None: vLLM's own (set only by
    tests that run a worker outside vLLM's process groups)."""

    def __post_init__(self) -> None:
        check_number("chunk_tokens", self.chunk_tokens, whole=True, positive=True)
        if self.chunk_tokens > keys.MAX_PREFIX_CHUNK:
            raise ConfigError(f"chunk_tokens must be <= {keys.MAX_PREFIX_CHUNK}, got "
                              f"{self.chunk_tokens}")
        check_number("ttl_s", self.ttl_s, whole=True, positive=False)
        check_number("timeout_s", self.timeout_s, whole=False, positive=True, high=MAX_WAIT_S)
        check_number("lookup_threads", self.lookup_threads, whole=True, positive=True)
        check_number("lookup_timeout_s", self.lookup_timeout_s, whole=False, positive=True,
                     high=MAX_WAIT_S)
        check_number("save_backlog_bytes", self.save_backlog_bytes, whole=True, positive=True)
        check_number("prefill_tok_s", self.prefill_tok_s, whole=False, positive=True)
        check_number("local_bytes", self.local_bytes, whole=True, positive=False)
        if self.shm_bytes is not None:
            check_number("shm_bytes", self.shm_bytes, whole=True, positive=False)
        check_field_types(self)  # address, namespace, ..., tls_key; allow_recompute, insecure
        check_tls_files("", self.tls_ca, self.tls_cert, self.tls_key)
        if not isinstance(self.encodings, tuple) or not all(
                isinstance(e, str) for e in self.encodings):
            raise ConfigError(f"encodings must be a list of encoding names (e.g. ['raw', "
                              f"'kdn-default']), got {self.encodings!r}")
        for enc in self.encodings:
            try:
                check_codec(*split_encoding(enc))
            except KDNError as exc:
                raise ConfigError(f"encodings: {enc!r}: {exc}") from None
        object.__setattr__(self, "encodings",  # "kdn" is "kdn-default", as keys name it
                           tuple(encoding_name(*split_encoding(e)) for e in self.encodings))
        if self.tp is not None and not (
                isinstance(self.tp, tuple) and len(self.tp) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in self.tp)
                and 0 <= self.tp[0] < self.tp[1]):
            raise ConfigError(f"tp must be (rank, size) with 0 <= rank < size, got {self.tp!r}")
        for name, check in (("namespace", lambda: keys.check_namespace(self.namespace)),
                            ("ttl_s", lambda: StoreOptions(ttl_s=self.ttl_s))):
            try:
                check()
            except KDNError as exc:
                raise ConfigError(f"{name}: {exc}") from None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KDNConnectorConfig:
        if extra is not None and not isinstance(extra, dict):  # dict() of pairs is no config
            raise ConfigError(f"kv_connector_extra_config: kdn's settings are a JSON object "
                              f"({{\"address\": ...}}), got {type(extra).__name__}")
        given = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown kdn connector settings {unknown}; known: "
                              f"{sorted(known)}")
        if isinstance(given.get("encodings"), str):
            given["encodings"] = (given["encodings"],)
        for name in ("encodings", "tp"):
            if isinstance(given.get(name), list):
                given[name] = tuple(given[name])
        return cls(**given)

    def client(self) -> Client:
        tls = tls_options(self.tls_ca, self.tls_cert, self.tls_key)
        return Client(self.address, timeout_s=self.timeout_s, namespace=self.namespace,
                      api_key=self.api_key or os.environ.get("KDN_API_KEY") or None, tls=tls,
                      shm_bytes=self.shm_bytes, local_bytes=self.local_bytes,
                      insecure=self.insecure or None)


def split_encoding(name: str) -> tuple[str, str]:
    """``"kdn-default"`` -> ``("kdn", "default")``; ``"lossless"`` -> ``("lossless", "")``; a
    mode alone means its default level (``"kdn"`` -> ``("kdn", "default")``)."""
    mode, _, level = name.partition("-")
    return mode, level or default_level(mode)


@dataclass(frozen=True)
class PagedShape:
    """vLLM's paged KV cache as kdn stores it (the same in the scheduler and every worker)."""

    layout: KVLayout
    """kdn layout of one worker's KV (its TP shard's heads), every layer."""
    block_size: int
    """Tokens per vLLM block (``B``)."""
    chunk_tokens: int
    """Tokens per kdn entry (``C``, a multiple of ``B``)."""
    layer_names: tuple[str, ...]
    """vLLM's attention layer names, in layer order."""
    encodings: tuple[str, ...]
    """Encoding names each chunk is stored in (``kdn.delivery.encoding_name``)."""
    tp_size: int = 1
    """Tensor-parallel shards: each one's chunks have their own keys."""

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size


def default_connector_encodings(config: KDNConnectorConfig, device: str) -> tuple[str, ...]:
    """The encodings a connector whose config names none stores on ``device`` (vLLM's device
    type): the path follows from the config alone, so the scheduler and every worker agree."""
    if config.local_bytes:
        path = IN_PROCESS
    elif same_host(config.address) and config.shm_bytes != 0:
        path = SAME_HOST
    else:
        path = NETWORK
    return tuple(encoding_name(m, lv) for m, lv in default_encodings(device, path))


def paged_shape(kv_cache_config: KVCacheConfig, config: KDNConnectorConfig, model: str,
                tp_size: int = 1, device: str = "cuda") -> PagedShape:
    """The ``PagedShape`` of vLLM's ``KVCacheConfig``: one group of full-attention layers (K
    and V per token) is supported; ``config.chunk_tokens`` is rounded down to whole blocks
    (a ``ConfigError`` when it is less than one); the encodings are the config's, or
    ``default_connector_encodings`` on ``device``."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"kdn's vLLM connector needs one KV cache group (full attention in every layer); "
            f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in ("FullAttentionSpec", "AttentionSpec") or getattr(
            spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        raise NotImplementedError(f"kdn's vLLM connector stores full-attention KV, not {kind}")
    heads, k_dim = int(spec.num_kv_heads), int(spec.head_size)  # type: ignore[attr-defined]
    v_dim = int(getattr(spec, "head_size_v", None) or k_dim)
    if v_dim != k_dim:
        raise InvalidLayout(f"K head size {k_dim} != V head size {v_dim}")
    names = tuple(groups[0].layer_names)
    fp = model_fingerprint({"engine": "vllm", "model": model}, weights_id=config.weights_id)
    layers = tuple(LayerLayout(heads, k_dim, v_dim) for _ in names)
    layout = KVLayout(fp, layers, dtype=DType.of(spec.dtype),  # type: ignore[attr-defined]
                      head_dim=k_dim, model_name=model)
    block = int(spec.block_size)
    if config.chunk_tokens < block:
        raise ConfigError(f"chunk_tokens {config.chunk_tokens} is less than one vLLM block of "
                          f"{block} tokens; set chunk_tokens to a multiple of {block}")
    chunk = config.chunk_tokens // block * block
    encodings = (tuple(encoding_name(*split_encoding(e)) for e in config.encodings)
                 or default_connector_encodings(config, device))
    return PagedShape(layout, block, chunk, names, encodings, tp_size)


@dataclass
class LoadSpec:
    """Chunks of one request to load into its blocks this step."""

    req_id: str
    keys_by_rank: list[list[bytes]]
    """Per TP rank: the chunks' keys (of the chosen encoding), chunk ``first_chunk`` on."""
    first_chunk: int
    start_token: int
    """First token to place (vLLM's own prefix hit ends here; a block boundary)."""
    end_token: int
    """End of the tokens to place (a chunk boundary)."""
    block_ids: list[int]
    """The request's block table (group 0): token t lives in block ``block_ids[t // B]``."""


@dataclass
class SaveSpec:
    """Chunks of one request whose tokens are all computed by the end of this step."""

    req_id: str
    keys_by_rank: list[list[bytes]]
    """Per TP rank: the chunks' base keys (lossless); other encodings use ``variant_key``."""
    first_chunk: int
    block_ids: list[int]
    """Blocks of the chunks, in token order (``len(keys) * chunk_tokens / B`` of them)."""
    mend: bool = False
    """Stored even where kdn holds them: a load of these chunks failed (damaged, or written
    with another shape), and they were recomputed."""
    attended: list[int] = field(default_factory=list)
    """Every block the chunks' tokens attended over: the request's block table up to their
    end (also blocks vLLM's prefix cache shares with a request loading them this step). A
    load that failed into any of them this step, on this rank, makes the chunks wrong."""
    exact: bool = True
    """Computed over exact KV. False: the request loaded its first chunks in a lossy encoding
    (``kdn-*``, ``int8``, ``cachegen``), or some of ``attended`` hold KV so loaded (by another
    request, shared through vLLM's prefix cache), so these hold an approximation and are
    stored in the lossy encodings only (what ``raw`` and ``lossless`` hold stays exact)."""


@dataclass
class KDNConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    forget: list[list[bytes]] = field(default_factory=list)
    """Per TP rank: base keys of chunks that may hold KV computed over a load that failed on
    some rank (each rank knows only its own failures, and the attention's all-reduce spreads
    them) and that were not stored again before their request ended: every encoding of them
    is deleted, after the saves handed off before it."""
