"""Per-block sensitivity ΔPPL_i: perplexity change on calibration text when only block i's KV
channels are pruned (at the global ratio, choosing channels with the given importance scores).

Pruning is simulated by zeroing the weights the pruned model would drop (``k_proj`` rows and
``v_proj`` rows, biases included): zero K channels add nothing to q·k, zero V channels give zero
attention output there, so the loss is the pruned model's, with the original attention scale.

Cost: one full forward records every block's input (a pre-hook per decoder layer, so the exact
masks and position embeddings transformers passes are reused); block i's ΔPPL then runs only
blocks i..N-1, the final norm and the LM head — about half a forward per block on average.

    sens = block_sensitivity(model, calib_ids, scores, ratio=0.2)   # sens.delta_ppl: [N]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kdn.errors import InvalidArgument
from kdn.model.hf import ModelParts, decoder_layers
from kdn.prune.allocate import removal_counts
from kdn.prune.apply import head_rows, kept_from_scores
from kdn.prune.importance import (
    ChannelScores,
    Geometry,
    attention_modules,
    calibration_ids,
    check_unpruned,
)


@dataclass(frozen=True)
class Sensitivity:
    """Calibration perplexity of the unpruned model and ΔPPL of each block pruned alone."""

    ratio: float
    base_ppl: float
    delta_ppl: tuple[float, ...]


class TailRunner:
    """Runs a model from any decoder block onwards on fixed calibration ids."""

    def __init__(self, model: Any, calib_ids: torch.Tensor) -> None:
        self.model = model
        self.layers = list(decoder_layers(model))
        self.ids = calibration_ids(model, calib_ids)
        self.inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def grab(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.inputs.append((tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                                dict(kwargs)))

        hooks = [layer.register_forward_pre_hook(grab, with_kwargs=True)
                 for layer in self.layers]
        try:
            with torch.inference_mode():
                model(input_ids=self.ids, use_cache=False)
        finally:
            for h in hooks:
                h.remove()

    @torch.inference_mode()
    def ppl_from(self, start: int) -> float:
        """Perplexity of the calibration ids, running blocks ``start``.. on recorded inputs."""
        args, kwargs = self.inputs[start]
        h = args[0] if args else kwargs["hidden_states"]
        for i in range(start, len(self.layers)):
            a, kw = self.inputs[i]
            if args:
                out = self.layers[i](h, *a[1:], **kw)
            else:
                out = self.layers[i](**{**kw, "hidden_states": h})
            h = out[0] if isinstance(out, tuple) else out
        logits = ModelParts.of(self.model).logits(h).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               self.ids[:, 1:].reshape(-1))
        nll = float(loss)
        return math.exp(nll) if nll < 709.0 else math.inf  # past float's range: inf


@contextmanager
def masked_block(model: Any, block: int, k_kept: tuple[int, ...], v_kept: tuple[int, ...]
                 ) -> Iterator[None]:
    """Temporarily zero block ``block``'s K and V channels outside ``k_kept``/``v_kept``."""
    geo = Geometry.of(model)
    attn = attention_modules(model)[block]
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for lin, kept in ((attn.k_proj, k_kept), (attn.v_proj, v_kept)):
            drop = torch.ones(geo.kv_heads * geo.head_dim, dtype=torch.bool)
            drop[head_rows(geo.kv_heads, geo.head_dim, kept)] = False
            for p in (lin.weight, lin.bias):
                if p is not None:
                    saved.append((p, p.detach().clone()))
                    p[drop] = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


def block_sensitivity(model: Any, calib_ids: torch.Tensor, scores: ChannelScores, ratio: float,
                      runner: TailRunner | None = None) -> Sensitivity:
    """ΔPPL_i (perplexity points) of pruning block i alone at ``ratio``."""
    check_unpruned(model)
    geo = Geometry.of(model)
    runner = runner or TailRunner(model, calib_ids)
    base = runner.ppl_from(0)
    if not math.isfinite(base):
        raise InvalidArgument(f"calibration perplexity of the unpruned model is {base}: the "
                              "model's outputs on the calibration text are not finite")
    half = geo.head_dim // 2
    k_pairs = removal_counts([ratio], half, max_per_block=half - 1)[0]
    v_chans = removal_counts([ratio], geo.head_dim)[0]
    pairs = scores.pair_scores()
    deltas = []
    for i in range(geo.layers):
        kk, vk = kept_from_scores(pairs[i], scores.v[i], k_pairs, v_chans)
        with masked_block(model, i, kk, vk):
            delta = runner.ppl_from(i) - base
        if math.isnan(delta):
            raise InvalidArgument(f"block {i} pruned alone gives a calibration perplexity "
                                  "that is not a number")
        deltas.append(delta)
    return Sensitivity(ratio, base, tuple(deltas))
