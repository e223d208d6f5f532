"""Continue from a blended (or any) prompt KV with the model's own modules.

``Continuation`` copies a prompt's ``KVCache`` once into preallocated per-layer buffers and
then runs new tokens through the decoder layers (``kdn.blend.layer``), writing their K/V in
place. Unlike growing a transformers ``DynamicCache`` (which copies the whole cache on every
token), a step costs only the new token's work, and it runs pruned layouts too. Its attention
is full: a sliding-window model continues only within its window (InvalidArgument past it),
and it takes only the families the blender computes exactly (``kdn.model.families``).

    cont = Continuation(model, result.kv, room=16)
    logits = cont.forward(answer_ids)          # [tokens, vocab], teacher-forced
    tokens = kdn.model.hf.greedy(Continuation(model, result.kv, room=16), result.logits, 16, {eos})

``Continuation`` is a ``kdn.model.hf.Decoder``: the package's one greedy loop
(``kdn.model.hf.greedy``) drives it.
"""

from __future__ import annotations

from typing import Any

import torch

from kdn.blend import layer as blk
from kdn.blend.rope import rope_plan
from kdn.cache import KVCache
from kdn.model.families import check_blended
from kdn.model.hf import ModelParts, attention_window, check_window


class Continuation:
    """A prompt's KV in buffers with ``room`` free token slots, extended by ``forward``."""

    def __init__(self, model: Any, kv: KVCache, room: int) -> None:
        check_blended(model, "a Continuation")
        self.m = ModelParts.of(model)
        layout = kv.layout
        self.length = kv.num_tokens
        if kv.start_position != 0:
            raise ValueError("a continuation needs the KV of a whole prompt (start position 0)")
        self.window = attention_window(model)
        check_window(self.window, self.length, "a continuation's prompt")
        cap = self.length + room
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for k, v in kv.layers:
            kb = torch.empty(k.shape[0], cap, k.shape[2], dtype=self.m.dtype, device=k.device)
            vb = torch.empty(v.shape[0], cap, v.shape[2], dtype=self.m.dtype, device=v.device)
            kb[:, : self.length], vb[:, : self.length] = k, v  # [kv_heads, cap, ch]
            self.k.append(kb)
            self.v.append(vb)
        rotary_dim = int(self.m.rotary.inv_freq.numel() * 2)
        device = self.k[0].device if self.k else None
        self.plans = [rope_plan(lay.k_kept, lay.k_channels, rotary_dim, device=device)
                      for lay in layout.layers]
        self.shapes = [blk.LayerShape(self.m.heads, lay.kv_heads, lay.k_channels, lay.v_channels)
                       for lay in layout.layers]

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` after everything so far; [len(ids), vocab] logits."""
        t = len(ids)
        start, stop = self.length, self.length + t
        if stop > self.k[0].shape[1]:
            raise ValueError(f"no room for {t} more tokens")
        check_window(self.window, stop, "a continuation")
        h = self.m.embed(torch.tensor(ids, device=self.k[0].device))  # [t, hidden]
        positions = torch.arange(start, stop, device=h.device)
        cos, sin = self.m.rotary(h[None], positions[None])
        plan = blk.causal(positions, first=start)  # from host facts: no read back per layer
        for i, layer in enumerate(self.m.layers):
            q, k, v = blk.project_qkv(layer, h, self.shapes[i], cos[0], sin[0], self.plans[i])
            self.k[i][:, start:stop], self.v[i][:, start:stop] = k, v
            out = blk.attend(layer, q, self.k[i][:, :stop], self.v[i][:, :stop], plan)
            h = blk.finish(layer, h, out)
        self.length = stop
        return self.m.logits(h)
