"""transformers integration: reuse cached prefixes from kdn, prefill only what is missing.

Lifecycle of ``KDNEngine.generate(prompt)``:

1. tokenize; chain keys over the prompt's full ``chunk_tokens`` blocks (``keys.prefix_keys``),
   keeping at least one token to compute so the model yields next-token logits;
2. one batched Lookup for every block and every stored encoding; the leading run of present
   blocks is the reusable prefix;
3. the loading controller picks an encoding or recompute (measured bandwidth, decode speed,
   prefill speed; overridable per request);
4. every block's Retrieve stream starts at once; the model's forward waits per layer
   (a pre-hook on each decoder layer), so layer i computes while later layers still arrive;
5. prefill the rest on top of that cache -> first token (TTFT ends here);
6. store the newly computed blocks back on a background thread (after the first token), then
   greedy-decode the remaining tokens.

Each stored block holds only its own ``chunk_tokens`` tokens (start position i * chunk_tokens)
under its chained key, so storage stays linear in prompt length.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kdn import keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.stream import LayerStream
from kdn.delivery import RECOMPUTE, LoadingController, encoding_name
from kdn.layout import DType, KVLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    chunk_tokens: int = 256
    """Tokens per prefix block (the unit of prefix reuse and of storage)."""
    namespace: str = keys.DEFAULT_NAMESPACE
    """Namespace the engine's blocks live in."""
    kv_dtype: DType = DType.FLOAT32
    """dtype KV is stored in; the model's own dtype keeps ``lossless`` exact."""
    encodings: tuple[tuple[str, str], ...] = (("lossless", ""),)
    """(mode, level) pairs each new block is stored in; the controller picks among them."""
    store_back: bool = True
    """Store newly computed blocks after the first token."""

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens}")
        if not self.encodings:
            raise ValueError("encodings must name at least one (mode, level)")


@dataclass
class Timings:
    lookup_s: float = 0.0
    transfer_s: float = 0.0
    """From the first Retrieve until the last frame arrived."""
    decode_s: float = 0.0
    """Decode time not hidden behind transfer (last layer ready minus last frame received)."""
    cache_build_s: float = 0.0
    first_token_compute_s: float = 0.0
    """Forward over the missing tokens (waits for late layers included)."""
    ttft_s: float = 0.0
    reused_tokens: int = 0
    computed_tokens: int = 0
    decision: str = RECOMPUTE


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    timings: Timings
    store_thread: threading.Thread | None = field(default=None, repr=False)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder blocks of a Llama-family transformers model."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.layers  # type: ignore[no-any-return]


def model_layout(model: Any, kv_dtype: DType) -> KVLayout:
    weights_id = Path(str(getattr(model, "name_or_path", "") or "")).name
    return KVLayout.from_config(model.config, dtype=kv_dtype, weights_id=weights_id)


class KDNEngine:
    def __init__(self, model: Any, tokenizer: Any, client: Client,
                 config: EngineConfig | None = None,
                 controller: LoadingController | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.client = client
        self.config = config or EngineConfig()
        self.controller = controller or LoadingController()
        self.layout = model_layout(model, self.config.kv_dtype)
        self.model_dtype = next(model.parameters()).dtype
        self.layers = decoder_layers(model)

    # -- reuse ----------------------------------------------------------------------------------

    def _plan(self, ids: list[int], force: str | None, t: Timings
              ) -> tuple[list[bytes], str, int]:
        """(chain keys, chosen encoding or recompute, number of reusable blocks)."""
        c = self.config.chunk_tokens
        usable = (len(ids) - 1) // c
        chain = keys.prefix_keys(ids[: usable * c], self.layout, self.config.namespace, c)
        if not chain or force == RECOMPUTE:
            return chain, RECOMPUTE, 0
        t0 = time.perf_counter()
        names = [encoding_name(m, lv) for m, lv in self.config.encodings]
        probe = [keys.variant_key(k, n) for n in names for k in chain]
        infos = self.client.lookup(probe, namespace=self.config.namespace).infos
        t.lookup_s = time.perf_counter() - t0
        stored: dict[str, int] = {}
        best_hits = 0
        hits_by_name: dict[str, int] = {}
        for j, name in enumerate(names):
            row = infos[j * len(chain) : (j + 1) * len(chain)]
            hits = next((i for i, info in enumerate(row) if not info.present), len(row))
            hits_by_name[name] = hits
            best_hits = max(best_hits, hits)
        for j, name in enumerate(names):
            if hits_by_name[name] == best_hits and best_hits:
                row = infos[j * len(chain) : j * len(chain) + best_hits]
                stored[name] = sum(info.size_bytes for info in row)
        tokens = best_hits * c
        decision = self.controller.choose(tokens, tokens * self.layout.bytes_per_token, stored,
                                          override=force)
        return chain, decision.choice, best_hits if decision.choice != RECOMPUTE else 0

    def _fetch(self, chain: list[bytes], encoding: str, hits: int) -> list[LayerStream]:
        streams: list[LayerStream] = []
        for k in chain[:hits]:
            s = self.client.retrieve_stream(keys.variant_key(k, encoding),
                                            namespace=self.config.namespace, layout=self.layout)
            if s is None:  # evicted between lookup and retrieve
                for other in streams:
                    other.cancel()
                return []
            streams.append(s)
        return streams

    def _layer_kv(self, streams: list[LayerStream], i: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [s.wait_for_layer(i) for s in streams]
        k = torch.cat([p[0] for p in parts], dim=1) if len(parts) > 1 else parts[0][0]
        v = torch.cat([p[1] for p in parts], dim=1) if len(parts) > 1 else parts[0][1]
        # k: [kv_heads, tokens, k_channels] -> [1, kv_heads, tokens, k_channels]
        return k.to(self.model_dtype).unsqueeze(0), v.to(self.model_dtype).unsqueeze(0)

    def _pipelined_cache(self, streams: list[LayerStream]) -> tuple[Any, list[Any]]:
        """A DynamicCache whose layer i is filled just before decoder layer i runs."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = [DynamicLayer() for _ in range(len(self.layers))]
        cache = DynamicCache()
        cache.layers = list(layers)
        filled = [False] * len(self.layers)

        def fill(i: int) -> None:
            if not filled[i]:
                k, v = self._layer_kv(streams, i)
                layers[i].lazy_initialization(k, v)
                layers[i].keys, layers[i].values = k, v
                filled[i] = True

        fill(0)  # the mask and positions are sized from layer 0's length
        hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: fill(i))
                 for i, layer in enumerate(self.layers)]
        return cache, hooks

    # -- generate -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: str | list[int], max_new_tokens: int = 32, *,
                 force: str | None = None) -> Generation:
        """Greedy generation reusing cached prefix blocks. ``force``: an encoding name or
        ``recompute`` to override the controller for this request."""
        ids = (self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
               if isinstance(prompt, str) else list(prompt))
        if not ids:
            raise ValueError("empty prompt")
        t = Timings()
        start = time.perf_counter()
        chain, choice, hits = self._plan(ids, force, t)
        streams = self._fetch(chain, choice, hits) if hits else []
        if not streams:
            hits = 0
        t.decision = choice if hits else RECOMPUTE
        c = self.config.chunk_tokens
        reused = hits * c
        cache: Any = None
        hooks: list[Any] = []
        if hits:
            tb = time.perf_counter()
            cache, hooks = self._pipelined_cache(streams)
            t.cache_build_s = time.perf_counter() - tb
        tc = time.perf_counter()
        try:
            out = self.model(torch.tensor([ids[reused:]]), past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        first = int(out.logits[0, -1].argmax())
        t.first_token_compute_s = time.perf_counter() - tc
        t.ttft_s = time.perf_counter() - start
        t.reused_tokens, t.computed_tokens = reused, len(ids) - reused
        self._observe(streams, choice, reused, t)
        cache = out.past_key_values
        snapshot = [(layer.keys, layer.values) for layer in cache.layers]
        store_thread = None
        if self.config.store_back and len(ids) // c > hits:
            store_thread = threading.Thread(
                target=self._store_blocks, args=(ids, snapshot, hits), daemon=True)
            store_thread.start()
        new = [first]
        eos = self.tokenizer.eos_token_id
        while len(new) < max_new_tokens and new[-1] != eos:
            out = self.model(torch.tensor([[new[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            new.append(int(out.logits[0, -1].argmax()))
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text, new, t, store_thread)

    def _observe(self, streams: list[LayerStream], choice: str, reused: int, t: Timings) -> None:
        if streams:
            start = min(s.timings.started for s in streams)
            last = max(s.timings.last_frame_received for s in streams)
            ready = max(max(s.timings.layer_ready.values()) for s in streams)
            nbytes = sum(s.timings.bytes_received for s in streams)
            t.transfer_s = max(0.0, last - start)
            t.decode_s = max(0.0, ready - last)
            self.controller.observe_transfer(nbytes, t.transfer_s)
            kv_bytes = reused * self.layout.bytes_per_token
            self.controller.observe_decode(choice, kv_bytes, max(t.decode_s, 1e-4))
        else:
            self.controller.observe_prefill(t.computed_tokens, t.first_token_compute_s)

    def _store_blocks(self, ids: list[int], snapshot: list[tuple[torch.Tensor, torch.Tensor]],
                      first_block: int) -> None:
        c = self.config.chunk_tokens
        ns = self.config.namespace
        chain = keys.prefix_keys(ids, self.layout, ns, c)
        todo = [(b, mode, level, keys.variant_key(chain[b], encoding_name(mode, level)))
                for b in range(first_block, len(chain)) for mode, level in self.config.encodings]
        try:
            present = self.client.lookup([t[3] for t in todo], namespace=ns).infos
        except Exception as exc:  # storing back is best effort; generation goes on
            log.warning("store-back lookup failed: %s", exc)
            return
        dt = self.layout.dtype.torch
        for (b, mode, level, key), info in zip(todo, present):
            if info.present:
                continue
            layers = [(k[0, :, b * c : (b + 1) * c].to(dt), v[0, :, b * c : (b + 1) * c].to(dt))
                      for k, v in snapshot]
            kv = KVCache(self.layout, layers, start_position=b * c)
            try:
                self.client.store(key, kv, mode=mode, level=level, namespace=ns)
            except Exception as exc:  # storing back is best effort; generation goes on
                log.warning("store-back of block %d (%s) failed: %s", b, mode, exc)
