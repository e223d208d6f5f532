"""Compose the KV caches of chunks computed alone into the KV cache of a whole prompt.

A prompt is a list of ``Piece``s in order: cached chunks (token ids plus their KV, computed
alone from position 0, as a resident ``KVCache`` or a ``LayerStream`` still arriving) and
uncached text (system prompt, question: ids only). ``blend`` returns the KV of the whole
prompt, as close to a full prefill as the recompute budget allows, and the next-token logits.

Lifecycle of ``blend(model, pieces, config)``:

0. layouts: every chunk must hold KV of this model (``blend_layout``: its model fingerprint,
   head dimension, RoPE and each layer's heads and kept K/V channels are the model's; only
   the dtype may differ, one for all chunks), checked before anything is computed. The result
   has the model's layout, in the chunks' dtype (the model's when there is no chunk). Each
   layer a chunk hands over must then be [kv_heads, its tokens, channels] (InvalidLayout).
1. positions: piece j starts where piece j-1 ended; a chunk's stored keys are re-rotated by
   that offset (``rope.reposition``), exactly as if computed there.
2. selection, one of two rules (``query_share`` mixes them):
   - question (``query_share=1``, the default): a first pass computes only the uncached text
     over the re-positioned chunks (naive concatenation, about 5% of a prefill) and sums,
     over layers from ``attention_from``, the attention the question (the text after the
     last chunk) gives each cached token; the top ``ratio`` are selected before layer 0.
     Layer 0's K/V depend on nothing but the token and its position, so no layer needs
     every token;
   - deviation (``query_share=0``, CacheBlend): layers ``< select_layer`` compute every
     token; at ``select_layer`` cached tokens are scored by how far their fresh K/V deviate
     from the stored (re-positioned) ones and the top ``ratio`` selected.
   Each chunk's first ``head_tokens`` can be forced in either way; when they fill the budget
   (EPIC's rule: ``ratio=0, head_tokens=h``) the selection is known before layer 0 and
   neither a first pass nor full layers run.
3. the selected tokens and the uncached text (and always the prompt's last token, which the
   selection passes over: the budget goes to others) are computed
   through the remaining layers; their fresh K/V replace the stored ones and they attend over
   the whole context (stored K/V for everything else) with a causal mask. Text before the
   first chunk is final after the first pass and is not computed again.
   Optionally (``correct_k``/``correct_v``, off by default) each chunk's tokens that keep
   their stored K/V are shifted, per layer, by a fraction of the mean change recomputation
   made to the chunk's recomputed tokens (``correct_stale``).
4. the last token's hidden state gives the logits of the first generated token.

The question rule is the default because it recomputes the tokens the answer reads, where
deviation picks the tokens whose K/V moved (bench/README.md, blend, has the comparison).

Models: the blender runs each decoder layer itself (``kdn.blend.layer``), so it takes only the
families it computes exactly (``kdn.model.families.BLENDED``: Llama, Mistral, Qwen2/3, Gemma,
...); any other is InvalidArgument naming it before anything runs.

Attention is full (causal) in every layer: a sliding-window model blends prompts no longer
than its window (``kdn.model.hf.attention_window``; InvalidArgument past it).

Devices: everything runs on the model's device, in the model's dtype. Token ids, positions,
masks, RoPE angles and selections are made there from per-piece facts the host holds (no
per-token Python, no tensor on a default device); stored chunks are copied in from wherever
they lie (resident on the device, or streamed: a ``LayerStream`` opened with ``device=``) and
re-positioned by one rotation per layer covering every chunk (each token by its chunk's
shift). The selected rows attend through a causal plan built once per pass (``layer.causal``).
No layer reads a tensor back to the host (a sync on a GPU): where the rows, the question's
rows and the stale tokens lie is found once per pass, a few reads per blend at any depth.
Scores are float32 whatever torch's default dtype. ``tests/test_blend_devices.py`` checks it,
on a CPU with ``meta`` as the wrong default device and the host reads counted.

Pipelining: stored K/V of layer i are requested (``wait_for_layer(i)``) right before layer i
needs them, so later layers keep arriving and decoding while earlier layers compute.

``ratio=1`` reproduces a full prefill (within float tolerance); ``ratio=0`` (with no head
tokens) skips selection and equals concatenating the re-positioned chunks and prefilling only
the uncached text on top. The question rule's first pass needs every layer of every chunk
before the second starts: it overlaps delivery itself (layer i decodes while the pass runs
layer i-1), and the second pass then runs from memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from kdn.blend import layer as blk
from kdn.blend.rope import RopePlan, apply_rope, cos_sin, reposition, rope_plan
from kdn.blend.select import budget, deviation, select_tokens
from kdn.blend.stale import ChunkStale, correct_stale, stale_plan
from kdn.cache import KVCache, LayerKV
from kdn.checks import check_vocabulary, share, whole
from kdn.errors import Cancelled, InvalidArgument, InvalidLayout, LayoutMismatch
from kdn.layout import KVLayout, LayerLayout
from kdn.model.families import check_blended
from kdn.model.hf import (
    ModelParts,
    attention_window,
    check_window,
    model_layout,
    prompt_limits,
    token_ids,
)


class LayerSource(Protocol):
    """Per-layer K/V of one chunk (``kdn.client.stream.LayerStream`` is one)."""

    @property
    def layout(self) -> KVLayout: ...

    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV: ...


class Resident:
    """A ``KVCache`` already in memory, as a ``LayerSource``."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv

    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    @property
    def layout(self) -> KVLayout:
        return self.kv.layout

    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV:
        return self.kv.layers[i]


@dataclass
class Piece:
    """A run of prompt tokens: a cached chunk (``kv`` set) or uncached text (``kv`` None)."""

    ids: list[int]
    kv: KVCache | LayerSource | None = None
    start_position: int = 0
    """Position the stored keys were rotated at (0 for a chunk prefilled alone)."""

    def __post_init__(self) -> None:
        self.ids = token_ids(self.ids, "a piece")
        if not self.ids:
            raise InvalidArgument("a piece needs at least one token")
        if self.kv is None:
            return
        if isinstance(self.kv, KVCache):
            self.start_position = self.kv.start_position
            self.kv = Resident(self.kv)
        elif not callable(getattr(self.kv, "wait_for_layer", None)):
            raise InvalidArgument(f"a piece's kv is a KVCache, a LayerSource (a LayerStream, a "
                                  f"ChunkConnector) or None, got {type(self.kv).__name__}")
        header = getattr(getattr(self.kv, "decoder", None), "header", None)
        if header is not None:  # a LayerStream: tokens and position come with its header
            self.start_position = int(header.entry.start_position)
        elif isinstance(position := getattr(self.kv, "start_position", None), int):
            self.start_position = position  # a connector (kdn.blend.chunks) says it
        tokens = getattr(self.kv, "num_tokens", None)
        if tokens is not None and tokens != len(self.ids):
            raise InvalidLayout(f"chunk has {len(self.ids)} ids but its KV holds {tokens} tokens")

    @property
    def source(self) -> LayerSource | None:
        return Resident(self.kv) if isinstance(self.kv, KVCache) else self.kv


@dataclass(frozen=True)
class BlendConfig:
    """How much to recompute, and how to choose it."""

    ratio: float = 0.15
    """Fraction of cached tokens recomputed through the layers from ``select_layer`` on."""
    select_layer: int = 1
    """Layer whose K/V deviation selects the tokens; all tokens are computed before it. Read
    (and checked against the model's layers) only where deviation selects: ``query_share`` < 1
    and the chunk heads do not fill the budget."""
    head_tokens: int = 0
    """Always recompute each chunk's first this many tokens (they count against the budget)."""
    per_chunk: bool = False
    """Split the budget between chunks by size instead of taking the global top deviations."""
    query_share: float = 1.0
    """Fraction of the budget given to the cached tokens the question (the uncached text after
    the last chunk) attends to most, summed over layers in a first pass that recomputes
    nothing (naive concatenation); the rest goes by deviation. 1 selects by the question
    alone, before layer 0, and skips the full layers below ``select_layer``."""
    attention_from: int = 3
    """First layer whose question attention counts (the first layers attend by position more
    than by content: counting from layer 3 picked better tokens than from layer 0 on SQuAD)."""
    correct_k: float = 0.0
    """Stale-token correction of keys: in each layer after selection, every chunk's tokens
    that keep their stored K are shifted by this fraction of the mean change (taken before
    RoPE) that recomputation made to the keys of the chunk's recomputed tokens. A shift
    shared by a chunk moves the attention the chunk as a whole receives, the part of the
    context a chunk computed alone gets most wrong; the ranking inside the chunk is kept.
    Off by default: it lowers first-token KL but not answer NLL (bench/README.md, blend)."""
    correct_v: float = 0.0
    """The same for values (no RoPE): stale values move by this fraction of the chunk's mean
    value change."""

    def __post_init__(self) -> None:
        for name in ("ratio", "query_share", "correct_k", "correct_v"):
            share(name, getattr(self, name))
        for name, low in (("select_layer", 1), ("attention_from", 0), ("head_tokens", 0)):
            whole(name, getattr(self, name), low)
        if not isinstance(self.per_chunk, bool):
            raise InvalidArgument(f"per_chunk must be a bool, got {self.per_chunk!r}")

    @property
    def selects(self) -> bool:
        return self.ratio > 0 or self.head_tokens > 0


@dataclass
class BlendTimings:
    wait_s: float = 0.0
    """Time spent getting chunk layers: waiting for ones not yet decoded, and re-positioning."""
    total_s: float = 0.0
    recomputed_tokens: int = 0
    """Cached tokens the selection recomputed (not counting the uncached text, nor the prompt's
    last token, recomputed anyway)."""
    cached_tokens: int = 0


@dataclass
class BlendResult:
    kv: KVCache
    """The whole prompt's KV, positions 0..tokens-1."""
    logits: torch.Tensor
    """[vocab] next-token logits after the prompt's last token."""
    recomputed: torch.Tensor
    """Positions of the cached tokens the selection recomputed (sorted; the prompt's last
    token, recomputed anyway, is not among them)."""
    timings: BlendTimings = field(default_factory=BlendTimings)


def check_chunk_layout(chunk: KVLayout, model: KVLayout, what: str = "chunk") -> None:
    """LayoutMismatch, starting ``what: ``, unless KV of layout ``chunk`` is KV ``model``
    computes: the same model fingerprint, head dimension and RoPE, and per layer the same KV
    heads, K/V channels and kept channels (a pruning with the same counts keeps other
    channels: its keys would be re-rotated and read as the wrong ones). The dtype may differ.
    """
    if chunk.model_fingerprint != model.model_fingerprint:
        raise LayoutMismatch(f"{what}: chunk belongs to model {chunk.model_fingerprint}, the "
                             f"blending model is {model.model_fingerprint}")
    if chunk.num_layers != model.num_layers:
        raise LayoutMismatch(f"{what}: chunk has {chunk.num_layers} layers, the model "
                             f"{model.num_layers}")
    for i, (got, want) in enumerate(zip(chunk.layers, model.layers)):
        shapes = [(lay.kv_heads, lay.k_channels, lay.v_channels) for lay in (got, want)]
        if shapes[0] != shapes[1]:
            (heads, k, v), (want_heads, want_k, want_v) = shapes
            raise LayoutMismatch(f"{what}: chunk layer {i} holds {heads} KV heads of "
                                 f"{k}/{v} K/V channels, the model's {want_heads} of "
                                 f"{want_k}/{want_v}")
        for name, a, b in (("K", got.k_kept, want.k_kept), ("V", got.v_kept, want.v_kept)):
            if a != b:
                raise LayoutMismatch(f"{what}: chunk layer {i} keeps other {name} channels "
                                     f"than the model's")
    if chunk.head_dim != model.head_dim:
        raise LayoutMismatch(f"{what}: chunk's head_dim is {chunk.head_dim}, the model's "
                             f"{model.head_dim}")
    if chunk.rope != model.rope:
        raise LayoutMismatch(f"{what}: chunk's keys carry RoPE {chunk.rope}, the model's "
                             f"{model.rope}")
    if replace(chunk, dtype=model.dtype).fingerprint != model.fingerprint:
        raise LayoutMismatch(f"{what}: chunk's layout {chunk.fingerprint} is not the model's "
                             f"{model.fingerprint}")


def check_layer_kv(k: Any, v: Any, lay: LayerLayout, tokens: int, what: str, i: int) -> None:
    """InvalidLayout, naming ``what`` and layer ``i``, unless ``k``/``v`` are tensors of
    [kv_heads, tokens, k/v channels] as ``lay`` declares (shapes are host facts: no sync)."""
    for name, t, ch in (("K", k, lay.k_channels), ("V", v, lay.v_channels)):
        want = (lay.kv_heads, tokens, ch)
        if not isinstance(t, torch.Tensor):
            raise InvalidLayout(f"{what}: layer {i}'s {name} must be a torch tensor, got "
                                f"{type(t).__name__}")
        if tuple(t.shape) != want:
            raise InvalidLayout(f"{what}: layer {i}'s {name} has shape {tuple(t.shape)}, "
                                f"expected {want} ([kv_heads, tokens, channels])")


def blend_layout(model: Any, pieces: list[Piece]) -> KVLayout:
    """The layout of ``blend(model, pieces)``'s result: the model's, in the chunks' dtype (the
    model's when no piece is a chunk). LayoutMismatch, naming the piece, unless every chunk is
    of the model (``check_chunk_layout``) and all are of one dtype."""
    own = model_layout(model)
    dtype, first = None, 0
    for j, p in enumerate(pieces):
        src = p.source
        if src is None:
            continue
        check_chunk_layout(src.layout, own, f"piece {j}")
        if dtype is None:
            dtype, first = src.layout.dtype, j
        elif src.layout.dtype is not dtype:
            raise LayoutMismatch(f"piece {j}: chunk is {src.layout.dtype.value}, piece "
                                 f"{first}'s {dtype.value}: chunks to blend share one dtype")
    return own if dtype is None or dtype is own.dtype else replace(own, dtype=dtype)


@torch.no_grad()
def blend(model: Any, pieces: list[Piece], config: BlendConfig | None = None,
          cancelled: Callable[[], bool] | None = None) -> BlendResult:
    """KV cache and next-token logits of the prompt ``pieces`` (see the module docstring).

    ``cancelled()``, asked before each layer, stops the blend (Cancelled) once true: a server
    stops a blend whose caller has gone within one layer."""
    cfg = config or BlendConfig()
    if not isinstance(cfg, BlendConfig):
        raise InvalidArgument(f"config must be a kdn.blend.BlendConfig, got {type(cfg).__name__}")
    t0 = time.perf_counter()
    check_blended(model, "blend")
    m = ModelParts.of(model)

    def layers() -> Iterator[tuple[int, Any]]:
        for i, layer in enumerate(m.layers):
            if cancelled is not None and cancelled():
                raise Cancelled("blend stopped: its caller is gone")
            yield i, layer

    if not isinstance(pieces, Sequence):  # a generator would pass for pieces, then run dry
        raise InvalidArgument(f"pieces must be a list of kdn.blend.Piece, got "
                              f"{type(pieces).__name__}")
    if not pieces:
        raise InvalidArgument("nothing to blend")
    vocabulary, context = prompt_limits(model)
    for j, p in enumerate(pieces):
        if not isinstance(p, Piece):
            raise InvalidArgument(f"piece {j} must be a kdn.blend.Piece, got {type(p).__name__}")
        check_vocabulary(p.ids, vocabulary, f"piece {j}")
    if context is not None and (total := sum(len(p.ids) for p in pieces)) > context:
        raise InvalidArgument(f"Blend of {total} tokens exceeds the model's context of "
                              f"{context} (max_position_embeddings)")
    check_window(attention_window(model), sum(len(p.ids) for p in pieces), "Blend")
    layout = blend_layout(model, pieces)
    n_layers = layout.num_layers
    if len(m.layers) != n_layers:
        raise LayoutMismatch(f"model has {len(m.layers)} layers, its config {n_layers}")

    # -- positions (host: per piece, never per token; device: the model's) ----------------------
    dev = m.embed.weight.device
    n = sum(len(p.ids) for p in pieces)
    ranges: list[tuple[int, int, LayerSource, int]] = []  # chunk: [start, stop), source, shift
    spans: list[tuple[int, int]] = []  # each chunk's [start, stop) among cached tokens
    owners: list[int] = []  # each chunk's piece index, for errors
    pos, seen = 0, 0
    for j, p in enumerate(pieces):
        if p.source is not None:
            ranges.append((pos, pos + len(p.ids), p.source, pos - p.start_position))
            owners.append(j)
            spans.append((seen, seen + len(p.ids)))
            seen += len(p.ids)
        pos += len(p.ids)
    ids = torch.tensor([t for p in pieces for t in p.ids], dtype=torch.long, device=dev)  # [n]
    cached_pos = torch.cat([torch.arange(a, b, device=dev) for a, b, _, _ in ranges]) \
        if ranges else torch.empty(0, dtype=torch.long, device=dev)  # [cached]
    chunk_ranges = [(a, b) for a, b, _, _ in ranges]
    always = torch.ones(n, dtype=torch.bool, device=dev)  # uncached text, and the last token
    for a, b, _, _ in ranges:  # (its hidden state gives the logits)
        always[a:b] = False
    always[-1] = True
    question = torch.zeros(n, dtype=torch.bool, device=dev)  # uncached tokens after the last
    question[ranges[-1][1] if ranges else 0 :] = True  # chunk, and the last token
    question[-1] = True

    h = m.embed(ids)  # [n, hidden]
    positions = torch.arange(n, device=dev)
    cos, sin = m.rotary(h[None], positions[None])  # [1, n, rotary_dim]
    cos, sin = cos[0], sin[0]
    rotary_dim = int(cos.shape[-1])
    plans = [rope_plan(lay.k_kept, lay.k_channels, rotary_dim, device=dev)
             for lay in layout.layers]
    shapes = [blk.LayerShape(m.heads, lay.kv_heads, lay.k_channels, lay.v_channels)
              for lay in layout.layers]
    # every chunk's stored keys move by its shift: one rotation per layer for all of them
    shift = torch.zeros(n, dtype=torch.long, device=dev)  # [n] positions each key moves by
    for a, b, _, d in ranges:
        shift[a:b] = d
    moved = any(d != 0 for _, _, _, d in ranges)
    freqs = m.rotary.inv_freq.detach().to(dev, torch.float64)
    move_cos, move_sin = (t.to(m.dtype) for t in cos_sin(shift, freqs))  # [n, rotary_dim]

    timings = BlendTimings(cached_tokens=int(cached_pos.numel()))

    def stored(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K/V for all n tokens: stored chunks re-positioned, zeros for text."""
        tw = time.perf_counter()
        lay = layout.layers[i]
        # k: [kv_heads, n, k_ch], v: [kv_heads, n, v_ch], in the model's dtype on its device
        k_all = torch.zeros(lay.kv_heads, n, lay.k_channels, dtype=m.dtype, device=dev)
        v_all = torch.zeros(lay.kv_heads, n, lay.v_channels, dtype=m.dtype, device=dev)
        for j, (a, b, src, _) in zip(owners, ranges):
            k, v = src.wait_for_layer(i)
            check_layer_kv(k, v, lay, b - a, f"piece {j}", i)  # copy_ would broadcast
            k_all[:, a:b].copy_(k)  # from wherever the chunk lies, in whatever dtype
            v_all[:, a:b].copy_(v)
        if moved:
            k_all = apply_rope(k_all, move_cos, move_sin, plans[i])
        timings.wait_s += time.perf_counter() - tw
        return k_all, v_all

    def text_pass(rows: torch.Tensor, placed: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
        """Naive concatenation: only ``rows`` computed, over the re-positioned stored K/V of
        every layer (appended to ``placed``). Returns the question's summed attention over
        all layers [n]."""
        attention = torch.zeros(n, dtype=torch.float32, device=dev)
        first = min(cfg.attention_from, n_layers - 1)  # the last layer's queries are not
        counted = (first, max(n_layers - 1, first + 1))  # worth their cost, unless alone
        x = h[rows]
        asking = question[rows].nonzero().flatten()  # which rows ask: found once, not per layer
        q_rows = rows[asking]
        mask = blk.causal(rows)  # planned once, every layer attends through it
        for i, layer in layers():
            k_all, v_all = stored(i)
            q, k, v = blk.project_qkv(layer, x, shapes[i], cos[rows], sin[rows], plans[i])
            k_all[:, rows], v_all[:, rows] = k, v
            if counted[0] <= i < counted[1]:
                attention += question_attention(layer, q[:, asking], k_all, q_rows)
            x = blk.finish(layer, x, blk.attend(layer, q, k_all, v_all, mask))
            placed.append((k_all, v_all))
        return attention

    fixed = always.nonzero().flatten()
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []
    recomputed = torch.empty(0, dtype=torch.long, device=dev)
    rows: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    heads = sum(min(cfg.head_tokens, b - a) for a, b in spans)
    heads_only = cfg.head_tokens > 0 and (
        all(budget(cfg.ratio, b - a) <= min(cfg.head_tokens, b - a) for a, b in spans)
        if cfg.per_chunk else budget(cfg.ratio, int(cached_pos.numel())) <= heads)
    # a budget of every cached token (ratio 1) leaves nothing for scores to rank
    heads_only = heads_only or (
        all(budget(cfg.ratio, b - a) >= b - a for a, b in spans) if cfg.per_chunk
        else budget(cfg.ratio, int(cached_pos.numel())) >= int(cached_pos.numel()))
    if cfg.selects and cfg.query_share < 1 and not heads_only and cfg.select_layer >= n_layers:
        # (only the deviation rule reads select_layer: the question's selects before layer 0)
        raise InvalidArgument(f"select_layer {cfg.select_layer} >= {n_layers} layers")
    # a chunk that ends the prompt: its last token is recomputed anyway (``always``), so the
    # selection passes it over and the budget goes to other tokens
    skip = int(cached_pos.numel()) - 1 if ranges and ranges[-1][1] == n else None
    if cfg.selects and cfg.query_share > 0 and not heads_only:  # the question's attention
        scores = text_pass(fixed, placed)[cached_pos]  # needs a first pass
        if skip is not None:
            scores[skip] = float("-inf")  # (nor does mix lift it)
        # text before the first chunk sees no chunk: the pass computed its K/V exactly
        always[: ranges[0][0] if ranges else 0] = False
    if not cfg.selects:
        rows = fixed
    elif cfg.query_share >= 1 or heads_only:  # selection known before layer 0
        if scores is None:  # chunk heads fill the budget: no scores needed (EPIC)
            scores = torch.zeros(int(cached_pos.numel()), dtype=torch.float32, device=dev)
        chosen = select_tokens(scores, spans, cfg.ratio, per_chunk=cfg.per_chunk,
                               head_tokens=cfg.head_tokens, skip=skip)
        recomputed = cached_pos[chosen]
        rows = _union(always, recomputed)
    mask: blk.Causal | None = None  # None: every row, plain causal attention
    stale: list[ChunkStale] | None = None  # chunks to correct (some tokens keep stored K/V)
    correcting = bool(cfg.correct_k or cfg.correct_v)
    if rows is not None:
        h = h[rows]
        mask = blk.causal(rows) if rows.numel() < n else None
        stale = stale_plan(rows, chunk_ranges, n) if correcting and mask is not None else None
    out_layers: list[LayerKV] = []

    for i, layer in layers():
        if rows is None and i < cfg.select_layer:  # plain prefill of every token
            q, k, v = blk.project_qkv(layer, h, shapes[i], cos, sin, plans[i])
            h = blk.finish(layer, h, blk.attend(layer, q, k, v, None))
            out_layers.append((k, v))
            continue
        k_all, v_all = placed[i] if placed else stored(i)
        if rows is None:  # the selection layer: h still covers every token
            q, k, v = blk.project_qkv(layer, h, shapes[i], cos, sin, plans[i])
            moved_by = deviation(k[:, cached_pos], k_all[:, cached_pos],
                                 v[:, cached_pos], v_all[:, cached_pos])
            if scores is not None:
                moved_by = mix(moved_by, scores, cfg.query_share, cfg.ratio)
            chosen = select_tokens(moved_by, spans, cfg.ratio, per_chunk=cfg.per_chunk,
                                   head_tokens=cfg.head_tokens, skip=skip)
            recomputed = cached_pos[chosen]
            rows = _union(always, recomputed)
            mask = blk.causal(rows) if rows.numel() < n else None
            stale = stale_plan(rows, chunk_ranges, n) if correcting and mask is not None else None
            q, k, v, h = q[:, rows], k[:, rows], v[:, rows], h[rows]
        else:
            q, k, v = blk.project_qkv(layer, h, shapes[i], cos[rows], sin[rows], plans[i])
        if stale is not None:
            correct_stale(stale, k_all, v_all, k, v, cos, sin, plans[i],
                          correct_k=cfg.correct_k, correct_v=cfg.correct_v)
        k_all[:, rows], v_all[:, rows] = k, v
        h = blk.finish(layer, h, blk.attend(layer, q, k_all, v_all, mask))
        out_layers.append((k_all, v_all))

    logits = m.logits(h[-1:])[0]  # [vocab]
    dt = layout.dtype.torch
    kv = KVCache(layout, [(k.to(dt), v.to(dt)) for k, v in out_layers], 0)
    timings.recomputed_tokens = int(recomputed.numel())
    timings.total_s = time.perf_counter() - t0
    return BlendResult(kv, logits, recomputed, timings)


def _union(always: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Sorted positions of the tokens in the ``always`` mask or listed in ``extra``."""
    keep = always.clone()
    keep[extra] = True
    return keep.nonzero().flatten()


ATTENTION_BLOCK = 1 << 24
"""Most float32 logits (64 MiB) ``question_attention`` holds at once: a long question's
[heads, rows, ctx] matrix would grow with the square of the prompt, so rows go in blocks."""


def question_attention(layer: Any, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                       block: int = ATTENTION_BLOCK) -> torch.Tensor:
    """[ctx] mean attention probability the question rows give each key (causal).

    q: [heads, rows, k_ch] at positions ``q_pos``; k: [kv_heads, ctx, k_ch]. The rows are
    taken a block at a time, each block's logits at most ``block`` elements, so the memory it
    takes grows with the context, not with the square of the prompt.
    """
    heads, rows = q.shape[0], q.shape[1]
    kk = k.repeat_interleave(heads // k.shape[0], dim=0).transpose(1, 2)  # [h, k_ch, ctx]
    ctx = torch.arange(k.shape[1], device=q.device)
    step = max(1, block // max(1, heads * k.shape[1]))
    total = torch.zeros(k.shape[1], dtype=torch.float32, device=q.device)
    for a in range(0, rows, step):
        logits = (q[:, a : a + step] @ kk).float() * float(layer.self_attn.scaling)
        logits.masked_fill_(~(q_pos[a : a + step, None] >= ctx[None, :])[None], float("-inf"))
        total += logits.softmax(-1).sum(dim=(0, 1))  # [h, step, ctx] -> [ctx]
    return total / (heads * rows)


def mix(deviation_scores: torch.Tensor, query_scores: torch.Tensor, share: float,
        ratio: float) -> torch.Tensor:
    """Scores whose top ``ratio`` holds the top ``share`` of it by question attention and the
    rest by deviation: query-picked tokens are lifted above every deviation score."""
    n = int(deviation_scores.numel())
    take = round(share * ratio * n)
    out = deviation_scores.float().clone()
    if take > 0:
        top = torch.topk(query_scores, min(take, n)).indices
        out[top] = out.max() + 1.0 + query_scores[top].float()  # on the device: no read back
    return out


def concat_positions(chunks: list[KVCache], plans: list[RopePlan] | None = None,
                     freqs: torch.Tensor | None = None, start: int = 0) -> KVCache:
    """Chunks placed one after another from ``start``, keys re-rotated (no recompute).
    All must share one layout (each is re-rotated with its RoPE and kept channels): else
    InvalidLayout naming the chunk, as ``KVCache.concat``."""
    if not chunks:
        raise InvalidLayout("concat_positions needs at least one chunk")
    layout = chunks[0].layout
    for j, c in enumerate(chunks[1:], 1):
        if c.layout.fingerprint != layout.fingerprint:
            raise InvalidLayout(f"concat_positions: chunk {j}'s layout {c.layout.fingerprint} "
                                f"is not chunk 0's {layout.fingerprint}: chunks to join share "
                                f"one layout")
    dev = chunks[0].layers[0][0].device if chunks[0].layers else None  # the keys'
    if freqs is None:
        from kdn.blend.rope import inv_freq

        freqs = inv_freq(layout.rope)
    freqs = freqs.to(dev) if dev is not None else freqs  # moved once, not per layer
    if plans is None:
        plans = [rope_plan(lay.k_kept, lay.k_channels, layout.rope.rotary_dim, device=dev)
                 for lay in layout.layers]
    placed, pos = [], start
    for c in chunks:
        delta = pos - c.start_position
        layers = [(reposition(k, delta, freqs, plans[i]), v) for i, (k, v) in enumerate(c.layers)]
        placed.append(KVCache(layout, layers, pos))
        pos += c.num_tokens
    return KVCache.concat(placed)
