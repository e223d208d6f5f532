"""A replay of vLLM's scheduler/worker call sequence around kdn's connector, on paged tensors.

``Replay`` plays the parts of vLLM's ``Scheduler`` (a block pool, prefix-hit queries, block
allocation, ``SchedulerOutput`` with new, cached, resumed and preempted requests, recompute of
blocks that failed to load) and of the model runner (``handle_preemptions``, binding the
metadata, ``start_load_kv``, per layer ``wait_for_layer_load`` -> attention writes the step's
KV -> ``save_kv_layer``, then ``wait_for_save``, ``get_block_ids_with_load_errors``,
``get_finished``), with vLLM's own data classes, in the order vLLM 0.33.0 makes these calls.

The "model" is a table: the K/V of token ``t`` at position ``p`` in layer ``l`` is
``table[l, :, (7 t + p) % V]``, random bits in the cache's dtype, so every block has one right
content. Free blocks are scribbled with garbage, so a block that was meant to be loaded and
was not never passes for a right one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

VOCAB = 97


@dataclass
class Req:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens whose KV is in the blocks (loaded or computed)."""
    loaded: int = 0
    """Tokens the connector was asked to load (the last admission)."""
    load_pending: bool = False
    """Admitted with tokens to load, and not stepped since."""
    is_new: bool = True
    resumed: bool = False

    @property
    def prompt(self) -> list[int]:
        return list(self.request.all_token_ids[: self.request.num_prompt_tokens])


class Replay:
    def __init__(self, scheduler: Any, worker: Any | list[Any], *, layers: list[str],
                 blocks: int,
                 block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: str = "cpu", kv_first: bool = True, shuffle: bool = True,
                 cross_layer: bool = False, seed: int = 0) -> None:
        # one worker per TP rank, each with its own cache and its own heads' K/V ("table")
        self.sched = scheduler
        self.workers = worker if isinstance(worker, list) else [worker]
        self.layers, self.block_size = layers, block_size
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        g = torch.Generator().manual_seed(seed)
        # table: [L, 2, V, H, D] random bits of the dtype (as values: no NaN patterns)
        self.tables = [torch.randn(len(layers), 2, VOCAB, heads, head_dim, generator=g
                                   ).to(dtype).to(device) for _ in self.workers]
        shape = ((2, blocks, block_size, heads, head_dim) if kv_first
                 else (blocks, 2, block_size, heads, head_dim))
        self.kvs: list[dict[str, torch.Tensor]] = []
        for _ in self.workers:
            if cross_layer:  # one buffer [blocks, L, 2, B, H, D]; per-layer caches are views
                buf = torch.full((blocks, len(layers), 2, block_size, heads, head_dim), 7.0,
                                 dtype=dtype, device=device)
                self.kvs.append({n: buf[:, i] for i, n in enumerate(layers)})
            else:
                self.kvs.append({n: torch.full(shape, 7.0, dtype=dtype, device=device)
                                 for n in layers})
        self.kv_first = kv_first and not cross_layer
        self.rank = 0
        """The rank the "model" methods below act for."""
        # free blocks in a shuffled order, as a pool after some churn (loads then scatter by
        # block id), or in order (a request's blocks are consecutive: slices of the cache)
        order = torch.randperm(blocks, generator=g) if shuffle else torch.arange(blocks)
        self.free = [int(b) for b in order]
        self.reqs: dict[str, Req] = {}
        self.failed: set[int] = set()
        """Every block id reported failed so far."""
        self.steps = 0
        for w, kv in zip(self.workers, self.kvs):
            w.register_kv_caches(kv)

    @property
    def worker(self) -> Any:
        return self.workers[self.rank]

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.kvs[self.rank]

    @property
    def table(self) -> torch.Tensor:
        return self.tables[self.rank]

    # -- the "model" ------------------------------------------------------------------------------

    def expected(self, tokens: list[int], layer: int, lo: int, hi: int) -> torch.Tensor:
        """K and V of tokens [lo, hi): ``[2, hi - lo, H, D]``."""
        idx = torch.tensor([(7 * tokens[p] + p) % VOCAB for p in range(lo, hi)],
                           device=self.device)
        return self.table[layer][:, idx]

    def _kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.kv[name]
        return (t[0], t[1]) if self.kv_first else (t[:, 0], t[:, 1])

    def _write(self, r: Req, layer: int, lo: int, hi: int) -> None:
        """Attention of tokens [lo, hi) of ``r``: their K/V into its blocks."""
        k, v = self._kv(self.layers[layer])
        exp = self.expected(r.prompt, layer, lo, hi)
        for p in range(lo, hi):
            b, s = r.block_ids[p // self.block_size], p % self.block_size
            k[b, s], v[b, s] = exp[0, p - lo], exp[1, p - lo]

    def blocks_of(self, req_id: str) -> torch.Tensor:
        """What ``req_id``'s blocks hold for its computed prompt tokens: [L, 2, T, H, D]."""
        r = self.reqs[req_id]
        n = min(r.computed, len(r.prompt))
        out = []
        for name in self.layers:
            k, v = self._kv(name)
            rows = [torch.stack([k[r.block_ids[p // self.block_size], p % self.block_size],
                                 v[r.block_ids[p // self.block_size], p % self.block_size]])
                    for p in range(n)]
            out.append(torch.stack(rows, dim=1))
        return torch.stack(out)

    def want(self, req_id: str) -> torch.Tensor:
        r = self.reqs[req_id]
        n = min(r.computed, len(r.prompt))
        return torch.stack([self.expected(r.prompt, i, 0, n) for i in range(len(self.layers))])

    # -- the scheduler --------------------------------------------------------------------------

    def new_request(self, req_id: str, prompt: list[int], cache_salt: str | None = None
                    ) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=4), None,
                       cache_salt=cache_salt)

    def ask(self, request: Request, local_hit: int = 0) -> int | None:
        """vLLM's external-hit query for a waiting request."""
        n, load_async = self.sched.get_num_new_matched_tokens(request, local_hit)
        assert load_async is False
        return n

    def admit(self, request: Request, local_blocks: list[int] | None = None,
              resumed: bool = False) -> int | None:
        """Admit a waiting request (None: the connector asks to be asked later). Its local
        prefix hit is ``local_blocks`` (block ids already holding its first tokens)."""
        local = list(local_blocks or [])
        ext = self.ask(request, len(local) * self.block_size)
        if ext is None:
            return None
        need = -(-request.num_prompt_tokens // self.block_size) - len(local)
        ids = local + [self.free.pop(0) for _ in range(need)]
        blocks = KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))
        self.sched.update_state_after_alloc(request, blocks, ext)
        old = self.reqs.get(request.request_id)
        r = Req(request, ids, len(local) * self.block_size + ext, ext, ext > 0,
                is_new=not resumed, resumed=resumed)
        if old is not None:
            r.is_new = False
        self.reqs[request.request_id] = r
        return ext

    def preempt(self, req_id: str) -> None:
        """Free the request's blocks (scribbled: another request may overwrite them)."""
        r = self.reqs[req_id]
        for rank in range(len(self.workers)):
            self.rank = rank
            for name in self.layers:
                k, v = self._kv(name)
                k[r.block_ids] = -3.0
                v[r.block_ids] = -3.0
        self.rank = 0
        self.free.extend(r.block_ids)
        r.block_ids, r.computed = [], 0
        request = r.request
        request.num_computed_tokens = 0
        self._preempted = {req_id}

    _preempted: set[str] = set()

    def step(self, budget: dict[str, int] | None = None) -> set[int]:
        """One engine step over every admitted request still short of its prompt; ``budget``
        caps the tokens scheduled per request (chunked prefill; 0: not this step). Returns the
        failed blocks."""
        budget = budget or {}
        news, cached = [], CachedRequestData.make_empty()
        sched: dict[str, int] = {}
        for rid, r in self.reqs.items():
            left = len(r.prompt) - r.computed
            if left <= 0 or not r.block_ids:
                continue
            n = min(left, budget.get(rid, left))
            if n <= 0:  # a budget of 0: not scheduled this step
                continue
            sched[rid] = n
            if r.is_new:
                news.append(NewRequestData(
                    req_id=rid, prompt_token_ids=r.prompt, mm_features=[],
                    sampling_params=r.request.sampling_params, pooling_params=None,
                    block_ids=(list(r.block_ids),), num_computed_tokens=r.computed,
                    lora_request=None))
            else:
                cached.req_ids.append(rid)
                cached.new_token_ids.append([])
                cached.new_block_ids.append((list(r.block_ids),) if r.resumed else None)
                cached.num_computed_tokens.append(r.computed)
                cached.num_output_tokens.append(0)
                if r.resumed:
                    cached.resumed_req_ids.add(rid)
        so = SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                             num_scheduled_tokens=sched,
                             total_num_scheduled_tokens=sum(sched.values()),
                             scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                             finished_req_ids=set(), free_encoder_mm_hashes=[],
                             preempted_req_ids=set(self._preempted),
                             has_sync_kv_loads=any(self.reqs[rid].load_pending
                                                   for rid in sched))
        self._preempted = set()
        meta = self.sched.build_connector_meta(so)
        so.kv_connector_metadata = meta
        # the model runner of every TP rank (vLLM runs them side by side; in turn here)
        failed: set[int] = set()
        for rank in range(len(self.workers)):
            self.rank = rank
            w = self.worker
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:  # vLLM starts loads before the forward only when some
                w.start_load_kv(None)  # request of the step loads synchronously
            for i, name in enumerate(self.layers):
                w.wait_for_layer_load(name)
                for rid, n in sched.items():
                    r = self.reqs[rid]
                    self._write(r, i, r.computed, r.computed + n)
                w.save_kv_layer(name, self.kv[name], None)
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)
            w.wait_for_save()
            w.get_finished(set())
            failed |= w.get_block_ids_with_load_errors()  # vLLM: the union over workers
            w.clear_connector_metadata()
        self.rank = 0
        self.sched.update_connector_output(KVConnectorOutput(invalid_block_ids=set(failed)))
        self.failed |= failed
        for rid, n in sched.items():
            r = self.reqs[rid]
            r.computed += n
            r.is_new, r.resumed, r.load_pending = False, False, False
            bad = [j for j, b in enumerate(r.block_ids) if b in failed]
            if bad:  # vLLM's recompute policy: computed back to the first failed block
                r.computed = min(r.computed, bad[0] * self.block_size)
        self.steps += 1
        return failed
