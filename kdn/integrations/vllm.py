"""kdn as a vLLM KV connector: ``KDNConnector``, loaded by vLLM from its module path.

Turn it on with

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KDNConnector",
        "kv_connector_module_path": "kdn.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "127.0.0.1:50051"}}'

(``kv_connector_extra_config`` is ``KDNConnectorConfig``; ``kv_role``: ``kv_both`` loads and
saves, ``kv_consumer`` only loads, ``kv_producer`` only saves.)

vLLM builds one connector per role (``KVConnectorFactory.create_connector``): one in the
scheduler process, one in each worker. This class only dispatches to the half of its role,
``kdn.integrations.vllm_scheduler.SchedulerSide`` or ``kdn.integrations.vllm_worker.WorkerSide``;
the two halves talk through ``KDNConnectorMetadata``, built by the scheduler once per step and
bound to every worker before the forward pass.

Lifecycle, as vLLM drives it each step:

Scheduler (``vllm.v1.core.sched.scheduler.Scheduler``):

1. ``get_num_new_matched_tokens(request, local_hit)`` for each waiting request: the first call
   starts the request's lookup on a background thread and returns ``(None, False)`` ("ask
   again later"); once the lookup is done, the tokens kdn adds beyond vLLM's own prefix hit.
   It never waits on the server.
2. ``update_state_after_alloc(request, blocks, n)``: blocks are allocated; when ``n > 0`` the
   load of those ``n`` tokens into the request's blocks is planned.
3. ``build_connector_meta(scheduler_output)``: the step's loads, and the saves of prompt chunks
   whose every token is computed by the end of this step and that kdn lacks.
4. ``update_connector_output``, ``request_finished`` (the request's state is dropped; blocks are
   never held: saves copy the blocks out during the step), ``take_events``.

Worker (the model runner, around one forward pass):

1. ``handle_preemptions(meta)``, ``bind_connector_metadata(meta)``;
2. ``start_load_kv``: every planned chunk's Retrieve stream starts (same-host segment, in-process
   tier or network, whichever the client has);
3. ``wait_for_layer_load(layer)`` (inside each attention layer): that layer's K/V of every
   loading chunk is scattered into vLLM's paged cache by block id, on the cache's device;
4. ``save_kv_layer(layer, kv_cache, ...)``: the blocks of the chunks to save are gathered (on a
   GPU: copied to pinned host memory on a side stream);
5. ``wait_for_save``: the gathered chunks go to a background thread that encodes and stores
   them (off the critical path); ``get_block_ids_with_load_errors``: the blocks of chunks that
   did not load (evicted since the lookup, damaged, unreachable), reported for vLLM to
   recompute instead of failing the request.

Storage: one kdn entry per ``chunk_tokens`` tokens of a prompt (a whole number of vLLM
blocks), keyed by ``kdn.keys.prefix_keys`` chained over the prompt, so a hit on chunk i
implies the prefix matches; the layout (model, layer count, KV heads, head size, dtype), the
chunk size, the request's LoRA adapter, the TP shard and the cache salt are all in the key.
Each chunk is stored in every configured encoding; the loading controller
(``kdn.delivery.LoadingController``) picks which one to load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kdn import keys
from kdn.client import Client
from kdn.client.client import TLSOptions
from kdn.codec.catalog import check_codec
from kdn.delivery import encoding_name
from kdn.errors import InvalidLayout
from kdn.layout import DType, KVLayout, LayerLayout, model_fingerprint
from kdn.options import StoreOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KDNConnector", "KDNConnectorConfig", "KDNConnectorMetadata", "LoadSpec",
           "SaveSpec", "paged_layout"]


@dataclass(frozen=True)
class KDNConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config``; unknown names are errors."""

    address: str = "127.0.0.1:50051"
    """The kdn server (host:port, or unix:PATH)."""
    namespace: str = "vllm"
    """kdn namespace of the chunks."""
    encodings: tuple[str, ...] = ("lossless",)
    """Encodings each new chunk is stored in, ``mode`` or ``mode-level`` (``lossless``,
    ``raw``, ``int8``, ``kdn-default``...); the loading controller picks among those stored."""
    chunk_tokens: int = 256
    """Tokens per kdn entry (the unit of reuse); rounded down to whole vLLM blocks."""
    salt: str = ""
    """Opaque salt in every key, beside each request's own ``cache_salt``."""
    weights_id: str = ""
    """Checkpoint identity (e.g. a revision hash) when the model name alone is ambiguous."""
    ttl_s: int = 0
    """Seconds a stored chunk lives (0: the server's default)."""
    timeout_s: float = 30.0
    """Deadline of each kdn call, and of a layer's wait during a load."""
    lookup_threads: int = 2
    """Threads the scheduler's lookups run on."""
    allow_recompute: bool = False
    """Let the loading controller decline a hit when it predicts prefilling is faster (its
    prefill speed is then ``prefill_tok_s``); False: every hit is loaded."""
    prefill_tok_s: float = 20000.0
    """Prefill speed (tokens/s) the controller weighs a hit against (``allow_recompute``)."""
    api_key: str = ""
    """API key of the kdn tenant; "" reads ``$KDN_API_KEY`` (none when unset)."""
    tls_ca: str = ""
    """PEM file of the CA to trust; set to use TLS. ``tls_cert``/``tls_key``: mutual TLS."""
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
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.lookup_threads < 1:
            raise ValueError(f"lookup_threads must be >= 1, got {self.lookup_threads}")
        if self.prefill_tok_s <= 0:
            raise ValueError(f"prefill_tok_s must be > 0, got {self.prefill_tok_s}")
        if not self.encodings:
            raise ValueError("encodings must name at least one encoding")
        for enc in self.encodings:
            check_codec(*split_encoding(enc))
        keys.check_namespace(self.namespace)
        StoreOptions(ttl_s=self.ttl_s)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KDNConnectorConfig:
        given = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown kdn connector settings {unknown}; known: {sorted(known)}")
        if isinstance(given.get("encodings"), str):
            given["encodings"] = (given["encodings"],)
        for name in ("encodings", "tp"):
            if isinstance(given.get(name), list):
                given[name] = tuple(given[name])
        return cls(**given)

    def client(self) -> Client:
        tls = None
        if self.tls_ca:
            tls = TLSOptions(ca=Path(self.tls_ca).read_bytes(),
                             cert=Path(self.tls_cert).read_bytes() if self.tls_cert else None,
                             key=Path(self.tls_key).read_bytes() if self.tls_key else None)
        return Client(self.address, timeout_s=self.timeout_s, namespace=self.namespace,
                      api_key=self.api_key or os.environ.get("KDN_API_KEY") or None, tls=tls,
                      shm_bytes=self.shm_bytes, local_bytes=self.local_bytes,
                      insecure=self.insecure or None)


def split_encoding(name: str) -> tuple[str, str]:
    """``"kdn-default"`` -> ``("kdn", "default")``; ``"lossless"`` -> ``("lossless", "")``."""
    mode, _, level = name.partition("-")
    return mode, level


def paged_layout(kv_cache_config: KVCacheConfig, model: str, weights_id: str = ""
                 ) -> tuple[KVLayout, int, list[str]]:
    """(kdn layout of this worker's KV, vLLM's block size, layer names in order) from vLLM's
    ``KVCacheConfig``: one group of full-attention layers (K and V per token) is supported."""
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
    names = list(groups[0].layer_names)
    fp = model_fingerprint({"engine": "vllm", "model": model}, weights_id=weights_id)
    layers = tuple(LayerLayout(heads, k_dim, v_dim) for _ in names)
    layout = KVLayout(fp, layers, dtype=DType.of(spec.dtype),  # type: ignore[attr-defined]
                      head_dim=k_dim, model_name=model)
    return layout, int(spec.block_size), names


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


@dataclass
class KDNConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


class KDNConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's v1 KV connector over a kdn server (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig, *, client: Client | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = KDNConnectorConfig.from_extra(
            self._kv_transfer_config.kv_connector_extra_config)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise NotImplementedError("kdn's vLLM connector does not support pipeline "
                                      "parallelism yet")
        model = vllm_config.model_config.model if vllm_config.model_config else "unknown"
        self.layout, self.block_size, self.layer_names = paged_layout(
            kv_cache_config, model, self.config.weights_id)
        blocks_per_chunk = max(1, self.config.chunk_tokens // self.block_size)
        self.chunk_tokens = blocks_per_chunk * self.block_size
        self.encodings = tuple(encoding_name(*split_encoding(e)) for e in self.config.encodings)
        self.tp_size = int(par.tensor_parallel_size)
        tc = self._kv_transfer_config
        from kdn.integrations.vllm_scheduler import SchedulerSide
        from kdn.integrations.vllm_worker import WorkerSide

        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self, client or self.config.client(),
                                           load=tc.is_kv_consumer, save=tc.is_kv_producer,
                                           own_client=client is None)
        else:
            self.worker = WorkerSide(self, client or self.config.client(), self._tp_rank(),
                                     own_client=client is None)

    def _tp_rank(self) -> int:
        if self.config.tp is not None:
            rank, size = self.config.tp
            if size != self.tp_size or not 0 <= rank < size:
                raise ValueError(f"tp {self.config.tp} does not fit tensor_parallel_size "
                                 f"{self.tp_size}")
            return rank
        if self.tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def _sched(self) -> Any:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's connector")
        return self.scheduler

    def _work(self) -> Any:
        if self.worker is None:
            raise RuntimeError("a worker-side call on the scheduler's connector")
        return self.worker

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KDNConnectorMetadata):
            self._work().preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KDNConnectorMetadata)
        self._work().start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KDNConnectorMetadata)
            self._work().save_layer(layer_name, kv_layer, meta.saves)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        saves = meta.saves if isinstance(meta, KDNConnectorMetadata) else None
        self._work().end_step(saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_failed()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads finish within their step; saves hold no blocks

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta: KDNConnectorMetadata = self._sched().build(scheduler_output)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
