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
5. ``reset_cache`` (``reset_prefix_cache(reset_connector=True)``, after a weight update): keys
   take a new random epoch, so nothing stored before is loaded again.

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
   did not load (evicted since the lookup, damaged, of another shape, unreachable), reported
   for vLLM to recompute instead of failing the request; once recomputed, those chunks are
   saved again even where kdn holds them (``SaveSpec.mend``), so a damaged one is mended.

Storage: one kdn entry per ``chunk_tokens`` tokens of a prompt (a whole number of vLLM
blocks), keyed by ``kdn.keys.prefix_keys`` chained over the prompt, so a hit on chunk i
implies the prefix matches; the layout (model, layer count, KV heads, head size, dtype), the
chunk size, the request's LoRA adapter (name and path), the TP shard, the cache salt and each
chunk's images and prompt embeddings are all in the key (``kdn.integrations.vllm_keys``).
Each chunk is stored in every configured encoding; the loading controller
(``kdn.delivery.LoadingController``) picks which one to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kdn.client import Client
from kdn.integrations.vllm_meta import (
    KDNConnectorConfig,
    KDNConnectorMetadata,
    LoadSpec,
    PagedShape,
    SaveSpec,
    paged_shape,
)
from kdn.integrations.vllm_scheduler import SchedulerSide
from kdn.integrations.vllm_worker import WorkerSide

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
           "PagedShape", "SaveSpec"]


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
        dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
        pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
        if dcp > 1 or pcp > 1:  # a scheduler block then spans block_size * cp tokens
            raise NotImplementedError(
                "kdn's vLLM connector does not support context parallelism yet "
                f"(decode_context_parallel_size {dcp}, prefill_context_parallel_size {pcp})")
        model = vllm_config.model_config.model if vllm_config.model_config else "unknown"
        self.tp_size = int(par.tensor_parallel_size)
        dev = getattr(vllm_config.device_config, "device_type", "") or "cuda"
        self.shape: PagedShape = paged_shape(kv_cache_config, self.config, model, self.tp_size,
                                             device=dev)
        self.layout = self.shape.layout
        self.encodings = self.shape.encodings
        tc = self._kv_transfer_config
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.shape, self.config, client or self.config.client(),
                                           load=tc.is_kv_consumer, save=tc.is_kv_producer,
                                           own_client=client is None)
        else:
            rank = self._tp_rank()  # checked before a client is made
            self.worker = WorkerSide(self.shape, self.config, client or self.config.client(),
                                     rank, own_client=client is None)

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

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run between layers: whole-model CUDA graphs skip them

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's connector")
        return self.scheduler

    def _work(self) -> WorkerSide:
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
        if meta.forget:
            self._work().forget(meta.forget)
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
        return self._sched().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update): later
        keys take a new random epoch (``SchedulerSide.reset``), so no chunk stored before is
        loaded again (the workers hold nothing keyed otherwise)."""
        if self.scheduler is not None:
            self.scheduler.reset()
        return True

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
