"""The one transformers adapter: everything kdn needs to know about a transformers causal LM.

Model side only (the storage side never imports it). The engine, the blender, RAG, the codec's
quality check and the pruner reach a model through these functions and nowhere else:

* what the model is: ``model_layout`` (its ``KVLayout``, pruned layouts included; its
  weights named by ``default_weights_id`` unless the caller names them: ``kdn.model.weights``),
  ``check_cache`` (a model whose cache holds other than K and V per head in every layer refused),
  ``length_regime``
  (what a prompt's KV depends on beyond its ids: its length, for a LongRoPE model),
  ``decoder_layers``, ``ModelParts`` (embedding, decoder blocks, final norm, LM head, rotary),
  ``prompt_limits`` and ``attention_window`` (a sliding window, which the blender refuses past);
* its caches: ``to_transformers`` / ``from_transformers`` convert between a ``KVCache`` and a
  transformers ``DynamicCache`` (views, no copy), and ``LayerwiseCache`` fills a cache layer by
  layer right before each decoder layer runs, so layer i computes while later layers arrive;
  ``full_cache`` is an empty one keeping every token (a sliding-window model's own keeps only
  its window). One builder (``_new_cache``/``_set_layer``) makes every cache;
* building one: ``load_config`` and ``model_from_config`` (a model rebuilt from a saved folder's
  config, as the pruner loads a pruned one) and ``attention_function`` (transformers' attention
  of an implementation, which a replaced attention layer calls);
* running it: ``prefill`` (KV of a token run computed alone, and its next-token logits),
  ``CacheDecoder`` (a transformers cache extended by the model's forward) and ``greedy``, the
  one greedy decoding loop of the package; it drives any ``Decoder`` (``CacheDecoder``, or the
  blender's preallocated ``kdn.blend.decode.Continuation``) until ``stop_tokens``.

Shapes: a kdn layer is ``k: [kv_heads, tokens, k_channels]``; transformers caches hold
``[batch, kv_heads, tokens, channels]``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kdn import checks
from kdn.cache import KVCache, LayerKV
from kdn.errors import InvalidArgument, InvalidLayout, InvalidRequest
from kdn.layout import DType, KVLayout
from kdn.model.families import kv_problem
from kdn.model.weights import default_weights_id as default_weights_id
from kdn.model.weights import former_weights_ids as former_weights_ids
from kdn.model.weights import parameters_digest as parameters_digest
from kdn.model.weights import weights_digest as weights_digest

# -- what the model is -------------------------------------------------------------------------


def _inner(model: Any) -> Any:
    """The decoder of a Llama-like causal LM (its ``embed_tokens``, one token embedding,
    ``layers``, ``norm``, ``rotary_emb``); InvalidArgument naming the model's class for any
    other (GPT-2, GPT-NeoX, Falcon: their blocks name and run these parts their own ways;
    Musicgen: an embedding per codebook). ``get_decoder`` first, ``model.model`` where that
    gives None or no such decoder (as some transformers releases' do for a causal LM; Llama 4's
    gives the model itself)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else None
    if inner is None or (not _llama_like(inner) and _llama_like(getattr(model, "model", None))):
        inner = getattr(model, "model", None)
    if not _llama_like(inner):
        raise InvalidArgument(
            f"{type(model).__name__} is not a model kdn drives: kdn needs a Llama-like "
            "transformers causal LM (Llama, Mistral, Qwen2, Gemma, ...) whose decoder has "
            f"embed_tokens (one token embedding) and layers, and its decoder "
            f"{type(inner).__name__} has not")
    return inner


def _llama_like(inner: Any) -> bool:
    """Whether ``inner`` has ``layers`` and one token embedding (its ``num_embeddings``)."""
    embed = getattr(inner, "embed_tokens", None)
    return isinstance(getattr(embed, "num_embeddings", None), int) and hasattr(inner, "layers")


def _text_config(model: Any) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder blocks of a Llama-family transformers model."""
    return _inner(model).layers  # type: ignore[no-any-return]


def model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype  # type: ignore[no-any-return]


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device  # type: ignore[no-any-return]


def default_device() -> torch.device:
    """Where a model runs unless told: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place(model: Any, device: torch.device | str | None) -> Any:
    """``model`` moved (in place) to ``device`` (None: ``default_device()``); returned."""
    return model.to(torch.device(device) if device is not None else default_device())


def model_layout(model: Any, kv_dtype: DType | None = None, weights_id: str | None = None,
                 *, exact: bool = False) -> KVLayout:
    """The layout of the KV ``model`` computes, stored as ``kv_dtype`` (default: the model's);
    ``weights_id`` names its weights in the fingerprint (None: ``default_weights_id``).
    ``exact``: the layout of blocks held as exactly what this model computes (the engine's):
    where ``kv_dtype`` is not the dtype the model computes in, that dtype enters the
    fingerprint (``KVLayout.from_config``'s ``computed_in``), so KV a bf16 model computed is
    never an exact hit of the fp32 model of the same weights, nor the reverse. Without it (the
    blender, which takes chunks of any dtype) a layout names the model alone."""
    if weights_id is None:
        weights_id = default_weights_id(model)
    dtype = kv_dtype if kv_dtype is not None else DType.of(model_dtype(model))
    computed = str(model_dtype(model)).removeprefix("torch.") if exact else None
    return KVLayout.from_config(model.config, dtype=dtype, weights_id=weights_id,
                                computed_in=computed)


@torch.inference_mode()
def check_cache(model: Any, layout: KVLayout, what: str) -> None:
    """InvalidArgument naming ``what`` (the engine) and ``model``'s class unless its cache
    holds what ``layout`` describes: K and V of every token per KV head in every layer. Its
    config may name why not (``kdn.model.families.kv_problem``: multi-head latent attention,
    KV-shared layers, linear-attention or state-space layers); else a forward of two tokens on
    a ``full_cache`` tells (any error it raises; a layer missing, empty or of another shape),
    as every forward the engine runs would. That forward costs about one decode step (the
    weights read once): ~0.1 s of one CPU core for SmolLM2-135M in fp32."""
    why = kv_problem(model.config)
    if why is None:
        try:
            decoder = CacheDecoder(model, full_cache(model))
            decoder.forward([0] * _PROBE_TOKENS)
            why = _cache_mismatch(cache_layers(decoder.cache), layout)
        except Exception as exc:  # the model's own error, as its first request would raise
            why = (f"a forward on a cache of every layer's K and V failed "
                   f"({type(exc).__name__}: {str(exc)[:200]})")
    if why is not None:
        raise InvalidArgument(f"{what} can not run {type(model).__name__}: {why}; kdn stores "
                              "and reuses K and V of every token in every layer only")


_PROBE_TOKENS = 2


def _cache_mismatch(layers: list[LayerKV], layout: KVLayout) -> str | None:
    """How ``layers`` (a cache after ``_PROBE_TOKENS`` tokens) differ from ``layout``'s."""
    if len(layers) != layout.num_layers:
        return f"its cache has {len(layers)} layers, its config {layout.num_layers}"
    for i, ((k, v), lay) in enumerate(zip(layers, layout.layers)):
        # k: [1, kv_heads, tokens, k_channels]
        for name, t, ch in (("K", k, lay.k_channels), ("V", v, lay.v_channels)):
            want = (1, lay.kv_heads, _PROBE_TOKENS, ch)
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            if got != want:
                return (f"layer {i} of its cache holds {name} of {got}, not of "
                        f"[batch, kv_heads, tokens, channels] = {list(want)} as its config says")
    return None


def length_regime(model: Any, tokens: int) -> bytes:
    """What the KV of a prompt of ``tokens`` tokens depends on beyond its tokens' ids, to enter
    its blocks' keys (``keys.prefix_keys``' ``extras``); b"" for most models. A LongRoPE model
    (rope_type ``longrope``: Phi-3/3.5-*-128k, Phi-4-mini) rotates every position of a forward
    with its short factors while the sequence is at most ``original_max_position_embeddings``
    long and with its long factors past it (transformers' ``dynamic_rope_update``): a block
    of a prompt past that length is other KV than the same block of a shorter prompt. (Dynamic
    NTK scaling changes the rotation only past ``max_position_embeddings``, which no prompt
    with its new tokens reaches: ``kdn.engine.config.check_fits``.)"""
    cfg = _text_config(model)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_type = params if params and all(isinstance(p, dict) for p in params.values()) \
        else {"": params}  # rope parameters per layer type (full, sliding attention), or one
    long = []
    for name, p in sorted(per_type.items()):
        if not isinstance(p, dict) or (p.get("rope_type") or p.get("type")) != "longrope":
            continue
        limit = p.get("original_max_position_embeddings") or getattr(
            cfg, "original_max_position_embeddings", None) or 0
        if tokens > int(limit):
            long.append(f"{name}>{int(limit)}")
    return ("kdn/longrope-long:" + ",".join(long)).encode() if long else b""


def prompt_limits(model: Any) -> tuple[int, int | None]:
    """(vocabulary, context) of ``model``: a token id lies in 0..vocabulary-1 (the rows of its
    input embeddings), and a prompt holds at most ``context`` tokens (the config's
    max_position_embeddings; None where it names none). InvalidArgument for a model kdn
    does not drive (not Llama-like: ``_inner``)."""
    context = getattr(_text_config(model), "max_position_embeddings", None)
    vocabulary = int(_inner(model).embed_tokens.num_embeddings)
    return vocabulary, context if isinstance(context, int) and context > 0 else None


def attention_window(model: Any) -> int | None:
    """The sliding window of ``model``'s attention (Mistral's ``sliding_window``, the
    sliding layers a ``layer_types`` names: Qwen2's, Gemma 3's): a token attends to the last
    this many tokens only. None where every layer attends to the whole prompt. A prompt of at
    most this many tokens attends alike either way."""
    cfg = _text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and not any("sliding" in str(t) for t in types):
        return None  # a window named, used by no layer (Qwen2 below max_window_layers)
    return window


def check_window(window: int | None, tokens: int, what: str) -> None:
    """InvalidArgument unless ``tokens`` fit a model's sliding ``window`` (``attention_window``;
    None: no window): the blender's layers attend over the whole context, so past the window
    they would not compute what the model does. ``what`` names the prompt."""
    if window is not None and tokens > window:
        raise InvalidArgument(f"{what} of {tokens} tokens exceeds the model's sliding attention "
                              f"window of {window} tokens: kdn blends and continues with full "
                              f"attention only")


def token_ids(values: object, what: str) -> list[int]:
    """``values`` (a sequence of whole numbers, or a 1-D integer tensor or numpy array of
    them) as a list of ints; InvalidArgument naming ``what`` otherwise: a text, a batch, a
    float or a bool is no token id (``kdn.checks.token_ids``, with the array's or tensor's
    dtype and shape named here)."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise InvalidArgument(f"{what}: token ids are a 1-D integer array, got "
                                  f"{values.dtype} of shape {list(values.shape)}")
        return [int(t) for t in values.tolist()]
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.is_complex() \
                or values.dtype == torch.bool:
            raise InvalidArgument(f"{what}: token ids are a 1-D integer tensor, got "
                                  f"{values.dtype} of shape {list(values.shape)}")
        return [int(t) for t in values.tolist()]
    return checks.token_ids(values, what)


@dataclass(frozen=True)
class ModelParts:
    """The modules of a transformers causal LM that kdn drives one by one."""

    embed: Any
    layers: Any
    norm: Any
    lm_head: Any
    rotary: Any
    heads: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: Any) -> ModelParts:
        inner = _inner(model)
        return cls(inner.embed_tokens, inner.layers, inner.norm, model.get_output_embeddings(),
                   inner.rotary_emb, int(_text_config(model).num_attention_heads),
                   model_dtype(model))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits of hidden states ``h`` [rows, hidden] -> [rows, vocab]."""
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]


# -- building one ------------------------------------------------------------------------------


def load_config(folder: str | Path) -> Any:
    """The transformers config saved in ``folder`` (its ``config.json``; no hub access)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def model_from_config(config: Any, dtype: torch.dtype) -> Any:
    """A causal LM of architecture ``config``, weights freshly initialised, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def attention_function(impl: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention transformers runs for ``config._attn_implementation == impl`` (eager when
    it knows no such name): ``(module, q, k, v, mask, scaling=, dropout=, ...) -> (out, w)``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(  # type: ignore[no-any-return]
            impl, eager_attention_forward)
    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        return eager_attention_forward  # type: ignore[no-any-return]
    return ALL_ATTENTION_FUNCTIONS[impl]  # type: ignore[no-any-return]


# -- caches ------------------------------------------------------------------------------------


def _new_cache(num_layers: int) -> tuple[Any, list[Any]]:
    """An empty DynamicCache of ``num_layers`` layers and those layers (the only builder)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(num_layers)]
    return cache, list(cache.layers)


def full_cache(model: Any) -> Any:
    """An empty cache that keeps every token's KV in every layer of ``model``. The one
    transformers makes from a sliding-window model's config (Mistral's ``sliding_window``,
    Gemma 3's sliding ``layer_types``) keeps only each sliding layer's last window: a cache to
    store a prompt's KV from must be this one. The model's mask, built from its config, still
    keeps each layer's attention within its window, so the output is the same."""
    return _new_cache(len(decoder_layers(model)))[0]


def _set_layer(layer: Any, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fill one cache layer with k, v: [1, kv_heads, tokens, channels] (kept as views)."""
    layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v


def to_transformers(kv: KVCache) -> Any:
    """A transformers DynamicCache holding batch-of-one views of ``kv``'s tensors (no copy)."""
    cache, layers = _new_cache(len(kv.layers))
    for layer, (k, v) in zip(layers, kv.layers):
        _set_layer(layer, k.unsqueeze(0), v.unsqueeze(0))  # [1, kv_heads, tokens, channels]
    return cache


def cache_layers(cache: Any) -> list[LayerKV]:
    """Per-layer (K, V) of a transformers cache (DynamicCache, older caches, legacy tuples)."""
    if hasattr(cache, "layers") and cache.layers and hasattr(cache.layers[0], "keys"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # older transformers
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise InvalidLayout(f"unsupported transformers cache type {type(cache).__name__}")


def from_transformers(cache: Any, layout: KVLayout, *, batch_index: int = 0,
                      start_position: int = 0) -> KVCache:
    """View one sequence of a transformers cache as a KVCache (no copy: the tensors share the
    cache's storage, so copy them before the engine mutates the cache if they must outlive it).
    """
    layers: list[LayerKV] = []
    for k, v in cache_layers(cache):
        # k: [batch, kv_heads, tokens, k_channels]
        if k.dim() != 4:
            raise InvalidLayout(f"transformers cache tensors must be 4-D, got {tuple(k.shape)}")
        layers.append((k[batch_index], v[batch_index]))
    return KVCache(layout, layers, start_position)


class LayerwiseCache:
    """A DynamicCache whose layer i is filled from ``fill(i)`` just before decoder layer i runs.

        with LayerwiseCache(model, connector.wait_for_layer) as cache:
            logits = CacheDecoder(model, cache).forward(rest_of_prompt)

    ``fill(i)`` returns layer i's (K, V) as ``[kv_heads, tokens, channels]`` in any dtype and on
    any device; they are converted to the model's. Layer 0 is filled on entry (transformers
    sizes the mask and positions from it); the others by forward pre-hooks, removed on exit.
    The hooks sit on the model's own layers, so they act only in the thread that entered: a
    forward of the same model in another thread (another engine's) neither waits for this
    cache's layers nor sees its failures; one in another thread that runs on this very cache
    is refused (InvalidRequest): its layers would not be filled.
    """

    def __init__(self, model: Any, fill: Callable[[int], LayerKV]) -> None:
        self.fill = fill
        self.blocks = decoder_layers(model)
        self.dtype, self.device = model_dtype(model), model_device(model)
        self.cache, self._layers = _new_cache(len(self.blocks))
        self._filled = [False] * len(self.blocks)
        self._hooks: list[Any] = []
        self._owner = 0  # the thread that entered: its forward is the one this cache serves

    def _fill(self, i: int) -> None:
        if not self._filled[i]:
            k, v = self.fill(i)
            # k: [kv_heads, tokens, k_channels] -> [1, kv_heads, tokens, k_channels]
            _set_layer(self._layers[i], k.to(self.device, self.dtype).unsqueeze(0),
                       v.to(self.device, self.dtype).unsqueeze(0))
            self._filled[i] = True

    def _hook(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if threading.get_ident() == self._owner:
            self._fill(i)
        elif any(a is self.cache for a in (*args, *kwargs.values())):
            raise InvalidRequest("LayerwiseCache: a forward on another thread than the one "
                                 "that entered it runs on its cache, whose layers are filled "
                                 "only on that thread; run the forward inside the with there")

    def __enter__(self) -> Any:
        self._owner = threading.get_ident()
        self._fill(0)
        self._hooks = [block.register_forward_pre_hook(
            lambda m, a, kw, i=i: self._hook(i, a, kw), with_kwargs=True)
            for i, block in enumerate(self.blocks)]
        return self.cache

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# -- running the model -------------------------------------------------------------------------


def _ids(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.reshape(1, -1).to(device)  # [1, tokens]
    return torch.tensor([[int(i) for i in ids]], dtype=torch.long, device=device)


@torch.inference_mode()
def prefill(model: Any, ids: Sequence[int] | torch.Tensor, layout: KVLayout
            ) -> tuple[KVCache, torch.Tensor]:
    """KV of ``ids`` computed alone from position 0, in ``layout.dtype``, and the next-token
    logits after the last id ([vocab]). InvalidArgument for no ids: a forward of nothing has
    neither KV nor logits."""
    if (ids.numel() if isinstance(ids, torch.Tensor) else len(ids)) == 0:
        raise InvalidArgument("prefill needs at least one token id, got none (an empty text?)")
    out = model(_ids(ids, model_device(model)), past_key_values=full_cache(model),
                use_cache=True, logits_to_keep=1)
    dt = layout.dtype.torch
    layers = [(k[0].to(dt).contiguous(), v[0].to(dt).contiguous())
              for k, v in cache_layers(out.past_key_values)]
    return KVCache(layout, layers), out.logits[0, -1]


class Decoder(Protocol):
    """Something that runs tokens after everything it has seen (a cache it extends)."""

    def forward(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] logits of ``ids`` run after everything so far."""
        ...


class CacheDecoder:
    """A transformers cache (``None``: empty) extended by the model's own forward."""

    def __init__(self, model: Any, cache: Any = None) -> None:
        self.model = model
        self.cache = cache
        self.device = model_device(model)

    @torch.no_grad()
    def forward(self, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """Extend the cache by ``ids``; the logits of the last position ([1, vocab]), or of
        every position ([tokens, vocab]) with ``all_logits``. Only the last is computed by
        default: the head over every prompt position costs a prefill up to ~7% more time
        (Llama-3-8B) and a [tokens, vocab] tensor (2 GiB in fp16 at 8k tokens) for nothing
        the next token needs."""
        extra = {} if all_logits else {"logits_to_keep": 1}
        out = self.model(_ids(ids, self.device), past_key_values=self.cache, use_cache=True,
                         **extra)
        self.cache = out.past_key_values
        return out.logits[0]  # type: ignore[no-any-return]


def stop_tokens(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids greedy decoding stops after, as transformers' ``generate``: every id of the
    model's ``generation_config.eos_token_id`` (an id or a list: a chat model's end-of-turn
    tokens, Llama-3.1-Instruct's three) and the tokenizer's ``eos_token_id``."""
    found: set[int] = set()
    for eos in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(eos, torch.Tensor):
            eos = eos.reshape(-1).tolist()
        for t in eos if isinstance(eos, (list, tuple)) else [eos]:
            if t is not None and not isinstance(t, bool):
                found.add(int(t))
    return frozenset(found)


@torch.no_grad()
def greedy(decoder: Decoder, first_logits: torch.Tensor, max_new: int,
           stop: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Greedy tokens after a prompt: the first from ``first_logits`` ([vocab]), then one
    ``decoder`` step per token until ``max_new`` tokens or a token in ``stop`` (kept)."""
    out = [int(first_logits.argmax())]
    while len(out) < max_new and out[-1] not in stop:
        out.append(int(decoder.forward([out[-1]])[-1].argmax()))
    return out
