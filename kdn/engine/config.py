"""What a ``KDNEngine`` is told and what it tells back: ``EngineConfig`` (checked when made,
each field documented), a request's prompt as token ids (``prompt_ids``, checked), the
checks of what a request asks (``check_fits``, ``check_force``, ``check_layer``) and of the
blocks a load brings (``check_streams``), the ``Timings`` of one request and its
``Generation``, and the default block size (``default_chunk_tokens``)."""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.checks import MAX_WAIT_S
from kdn.client import LayerStream
from kdn.codec.catalog import check_codec
from kdn.delivery import RECOMPUTE
from kdn.errors import ConfigError, InvalidArgument, InvalidRequest, LayoutMismatch
from kdn.keys import MAX_PREFIX_CHUNK
from kdn.layout import DType, KVLayout
from kdn.names import check_namespace
from kdn.text import tokenize

CHUNK_TOKENS = 256
"""Tokens per block by default: fine-grained prefix reuse, and a few MiB to tens of MiB per
entry for models from 135M to 8B parameters (SmolLM2-135M fp32: 11 MiB; Llama-3-8B fp16:
32 MiB)."""
MAX_CHUNK_BYTES = 64 << 20
"""A model whose blocks of ``CHUNK_TOKENS`` would be bigger gets fewer tokens per block (a
power of two), so that each entry streams in frames of a few layers and stays far below the
server's ``max_entry_bytes`` guard: Llama-3-70B fp16 (320 KiB/token) gets 128."""

MAX_CHUNK_TOKENS = MAX_PREFIX_CHUNK
"""The most tokens ``EngineConfig.chunk_tokens`` may name: a block is the unit of reuse, and
one this long is larger than most prompts (and tens of GiB of KV on a large model)."""
MAX_CALIBRATION_TOKENS = 1 << 17
"""The most tokens ``EngineConfig.calibration_tokens`` may name: a 128k-token prefill."""
MAX_LOOKUP_TIMEOUT_S = MAX_WAIT_S
"""The longest ``EngineConfig.lookup_timeout_s`` (a day, as every kdn wait): a longer one is
no deadline a call can carry (gRPC's and the clock's arithmetic overflow)."""


def default_chunk_tokens(layout: KVLayout) -> int:
    """``CHUNK_TOKENS``, halved until a block's KV is at most ``MAX_CHUNK_BYTES`` (>= 16)."""
    tokens = CHUNK_TOKENS
    while tokens > 16 and tokens * layout.bytes_per_token > MAX_CHUNK_BYTES:
        tokens //= 2
    return tokens


@dataclass(frozen=True)
class EngineConfig:
    chunk_tokens: int = 0
    """Tokens per prefix block (the unit of prefix reuse and of storage), at most
    ``MAX_CHUNK_TOKENS``; 0 (default) = the model's own: ``default_chunk_tokens`` of its KV
    layout."""
    namespace: str | None = None
    """Namespace the engine's blocks live in; None or "" (default): the client's
    (``Client(namespace=...)``, itself ``default`` unless named)."""
    weights_id: str | None = None
    """Which weights the model holds, part of its layout's fingerprint and so of every key
    (as ``KDNConnectorConfig.weights_id``): checkpoints that share a config (fine-tunes) must
    differ in it. None (default): ``kdn.model.hf.default_weights_id``, the name of the folder
    the model was loaded from and a digest of its weights' bytes (the same weights at any path
    share their KV), or its hub id and revision (with a digest of the loaded parameters where
    the load took a ``subfolder=`` or one of several GGUF files, and alone for a model built
    from a config and given its weights by ``load_state_dict``); name the weights yourself
    where they changed after loading (an adapter merged in memory). An empty or blank name
    is refused: it names no weights."""
    kv_dtype: DType | None = None
    """dtype KV is stored in; None (default) = the model's own dtype, which keeps
    ``lossless`` exact (fp16 and bf16 models store fp16 and bf16 KV)."""
    encodings: tuple[tuple[str, str], ...] | None = None
    """(mode, level) pairs each new block is stored in; the controller picks among them.
    None (default): what pays off on the model's device and the path hits take
    (``kdn.delivery.default_encodings``): ``lossless`` on a CPU; on a GPU ``raw`` from the
    engine's host or its in-process tier, ``kdn-default`` and ``raw`` across a network."""
    store_back: bool = True
    """Store newly computed blocks after the first token."""
    lookup_timeout_s: float = 2.0
    """Deadline of the Lookup that starts each request (and of the first call a calibration
    or a new engine makes), at most the client's ``timeout_s``: a server that does not answer
    within it, or can not be reached, is taken as down for that request, whose prompt is then
    computed whole (``Timings.load_error`` says why) instead of waiting out a call deadline.
    At most ``MAX_LOOKUP_TIMEOUT_S``."""
    join_in_process: bool = True
    """A hit whose blocks are all in the client's in-process tier loads as one joined stream
    (``Client.retrieve_joined``); False: one stream per block, joined per layer."""
    calibrate: bool = True
    """Time prefills of ``calibration_tokens`` tokens (the best of three) before the first
    decision, so the controller starts from this model's prefill speed on this machine
    (``KDNEngine.calibrate``); False: it starts from its prior
    (``LoadingController.prefill_tok_s``)."""
    calibration_tokens: int = 256
    """Length of the calibration prefill: a typical request's (the controller keeps the speed
    per length class: ``kdn.delivery.controller``), capped by the model's context; at most
    ``MAX_CALIBRATION_TOKENS``."""
    probe_link: bool = True
    """With ``calibrate``, and when hits come across a network: measure that link's bandwidth
    before the first decision (``kdn.client.probe``: two probe entries read back), so a fresh
    engine does not weigh a 1 or a 100 Gbit/s link by one prior."""
    freeze_heap: bool | None = None
    """Before the first request: collect, then ``gc.freeze()`` what the process holds (the
    model, the libraries), so the collector's oldest generation no longer scans it; None
    (default): on where the model runs on a GPU. A GPU hit of many blocks makes thousands of
    short-lived objects (each layer's views of each block), and every few hits that set off a
    full collection of the whole heap: about 200 ms per pause with torch, transformers and kdn
    loaded, longer than the whole hit (``bench.heap``). The price: garbage in reference cycles
    among what was frozen is never collected (engines that live as long as their process lose
    nothing)."""

    def __post_init__(self) -> None:
        _whole("chunk_tokens", self.chunk_tokens, 0, MAX_CHUNK_TOKENS)
        _whole("calibration_tokens", self.calibration_tokens, 1, MAX_CALIBRATION_TOKENS)
        if (isinstance(self.lookup_timeout_s, bool)
                or not isinstance(self.lookup_timeout_s, (int, float))
                or not 0 < self.lookup_timeout_s <= MAX_LOOKUP_TIMEOUT_S):
            raise ConfigError(f"lookup_timeout_s: must be a number of seconds > 0 and at most "
                              f"{MAX_LOOKUP_TIMEOUT_S:g} (a day), got {self.lookup_timeout_s!r}")
        if self.namespace:  # None or "": the client's
            try:
                check_namespace(self.namespace)
            except InvalidArgument as exc:
                raise ConfigError(f"namespace: {exc}") from None
        if self.weights_id is not None and not isinstance(self.weights_id, str):
            raise ConfigError(f"weights_id: must be a string or None, got {self.weights_id!r}")
        if self.weights_id is not None and not self.weights_id.strip():
            raise ConfigError(f"weights_id: {self.weights_id!r} names no weights (checkpoints "
                              "of one config would share keys); name them, or leave it None "
                              "for kdn.model.hf.default_weights_id")
        if self.kv_dtype is not None:
            try:
                object.__setattr__(self, "kv_dtype", DType.of(self.kv_dtype))
            except InvalidArgument as exc:
                raise ConfigError(f"kv_dtype: {exc}") from None
        if self.encodings is not None:
            object.__setattr__(self, "encodings", _encodings(self.encodings))
        for name in ("store_back", "join_in_process", "calibrate", "probe_link"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.freeze_heap is not None and not isinstance(self.freeze_heap, bool):
            raise ConfigError(f"freeze_heap: must be True, False or None, got "
                              f"{self.freeze_heap!r}")


def _whole(name: str, value: object, low: int, high: int) -> None:
    """ConfigError unless ``value`` is a whole number (not a bool) in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}: must be a whole number in {low}..{high}, got {value!r}")


def _encodings(given: object) -> tuple[tuple[str, str], ...]:
    """``given`` as a tuple of (mode, level) pairs, each a codec kdn has
    (``kdn.codec.catalog.check_codec``) and named once; ConfigError naming the first that is
    not."""
    if isinstance(given, (str, bytes)) or not isinstance(given, (tuple, list)):
        raise ConfigError(f"encodings: a sequence of (mode, level) pairs, e.g. "
                          f"(('raw', ''),), or None; got {given!r}")
    if not given:
        raise ConfigError("encodings: must name at least one (mode, level), or be None (the "
                          "device's defaults)")
    pairs = []
    for pair in given:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(part, str) for part in pair)):
            raise ConfigError(f"encodings: each is a (mode, level) pair of strings, e.g. "
                              f"('raw', '') or ('kdn', 'default'); got {pair!r}")
        try:
            check_codec(pair[0], pair[1])
        except InvalidArgument as exc:
            raise ConfigError(f"encodings: {tuple(pair)!r}: {exc}") from None
        if (pair[0], pair[1]) in pairs:  # each block would be stored twice under one key
            raise ConfigError(f"encodings: {tuple(pair)!r} is named twice")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


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
    predicted_ttft_s: float = 0.0
    """The TTFT the loading controller predicted when it decided: lookup, its estimate of the
    chosen way to the prefix's KV, and the prefill of the rest of the prompt."""
    reused_tokens: int = 0
    computed_tokens: int = 0
    decision: str = RECOMPUTE
    local_blocks: int = 0
    """Blocks read from the client's in-process tier (no transfer)."""
    load_error: str = ""
    """Why loading the prefix failed (the server not reached or too slow to answer the
    lookup; a block not what the engine stores, damaged, cut off, gone since the lookup; the
    load not in by its deadline: ``kdn.engine.engine.LOAD_DEADLINE_X``); the prompt was then
    computed whole, and its blocks stored again where the server could be reached."""


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    timings: Timings
    store_thread: threading.Thread | None = field(default=None, repr=False)


_BYTES = (bytes, bytearray, memoryview)
"""Not a prompt: their items are whole numbers, yet they are encoded text, not token ids."""


def prompt_ids(prompt: str | Sequence[int] | torch.Tensor, tokenizer: Any,
               vocabulary: int) -> list[int]:
    """The token ids of one prompt: a text (tokenized by ``tokenizer``, no special tokens
    added), a sequence of ids, or a tensor of them, 1-D or a batch of one (``[1, tokens]``, what
    a tokenizer's ``return_tensors="pt"`` gives; ``[[ids]]`` likewise). InvalidRequest (an
    InvalidArgument and a ValueError) for an empty prompt, a batch of several, ids that are not
    whole numbers, bytes (encoded text, whose items would pass for ids), or an id outside
    ``0..vocabulary-1`` (the model's embedding rows), naming it and where it is, and for a
    text that is not valid Unicode (a lone surrogate: ``kdn.text.check_text``). Special tokens
    written in a text are parsed as the tokenizer's (``kdn.text.tokenize``)."""
    if isinstance(prompt, _BYTES) or (isinstance(prompt, Sequence) and not isinstance(
            prompt, str) and len(prompt) and isinstance(prompt[0], _BYTES)):  # ([b"..."])
        raise InvalidRequest(f"a prompt is a text (str), token ids or a tensor of them, got "
                             f"{type(prompt).__name__} holding bytes: decode them to text")
    if isinstance(prompt, str):
        try:
            prompt = tokenize(tokenizer, prompt, "the prompt")
        except InvalidArgument as exc:
            raise InvalidRequest(str(exc)) from None
    rows: list[Any]
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise InvalidRequest(f"a prompt tensor holds token ids: an integer dtype, got "
                                 f"{prompt.dtype}")
        if prompt.dim() not in (1, 2):
            raise InvalidRequest(f"a prompt tensor is [tokens] or [1, tokens], got "
                                 f"{list(prompt.shape)}")
        rows = [prompt.tolist()] if prompt.dim() == 1 else prompt.tolist()
    elif isinstance(prompt, Sequence) and prompt and all(
            (isinstance(p, Sequence) and not isinstance(p, str))
            or (isinstance(p, torch.Tensor) and p.dim() >= 1) for p in prompt):
        rows = [list(p) for p in prompt]  # type: ignore[arg-type]  # a batch: [[ids], ...]
    elif isinstance(prompt, Sequence):
        rows = [list(prompt)]
    else:
        raise InvalidRequest(f"a prompt is a text, token ids or a tensor of them, got "
                             f"{type(prompt).__name__}")
    if len(rows) != 1:
        raise InvalidRequest(f"KDNEngine.generate takes one prompt, got a batch of {len(rows)}: "
                             "call it once per prompt")
    ids = []
    for i, t in enumerate(rows[0]):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise InvalidRequest(f"token {i} of the prompt is {t!r}, not a token id") from None
        if not 0 <= ids[-1] < vocabulary:
            raise InvalidRequest(f"token id {ids[-1]} (token {i} of the prompt) is outside the "
                                 f"model's vocabulary of {vocabulary} (0..{vocabulary - 1})")
    if not ids:
        raise InvalidRequest("empty prompt")
    return ids


def check_fits(tokens: int, max_new_tokens: int, context: int | None) -> None:
    """InvalidRequest unless a prompt of ``tokens`` tokens and ``max_new_tokens`` generated
    after it fit a model's ``context`` (its max_position_embeddings; None: no limit): past it
    the model meets positions it was never trained on, and its KV is stored for reuse. The
    last new token is never fed back, so it takes no position: a prompt of the whole context
    still gets one token, as from transformers' ``generate``."""
    if context is None or tokens + max_new_tokens - 1 <= context:
        return
    if tokens > context:
        raise InvalidRequest(f"the prompt of {tokens} tokens is longer than the model's context "
                             f"of {context} tokens (max_position_embeddings): shorten it")
    raise InvalidRequest(f"the prompt of {tokens} tokens and max_new_tokens={max_new_tokens} "
                         f"need {tokens + max_new_tokens - 1} positions (the last new token "
                         f"takes none), more than the model's context of {context} tokens "
                         f"(max_position_embeddings): ask for at most {context - tokens + 1} "
                         f"new tokens or shorten the prompt")


def check_force(force: str | None, choices: list[str]) -> None:
    """InvalidRequest unless ``force`` is None or one of an engine's ``choices`` (its
    encodings' names and ``recompute``): one it does not store would always be a miss, a
    silent recompute."""
    if force is not None and force not in choices:
        raise InvalidRequest(f"force={force!r} is none of this engine's choices {choices} "
                             "(None: the loading controller's)")


def check_layer(i: object, layers: int, what: str) -> None:
    """InvalidRequest, starting ``what: ``, unless ``i`` is a layer of a model of ``layers``
    layers: a whole number in ``0..layers-1``."""
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers:
        raise InvalidRequest(f"{what}: layer must be a whole number in [0, {layers}), got "
                             f"{i!r}")


def check_saved_layer(i: object, k: object, v: object, layout: KVLayout, what: str) -> None:
    """``check_layer``, then InvalidRequest, starting ``what: ``, unless ``k`` and ``v`` are
    tensors of [kv_heads, tokens, k/v channels] as layer ``i`` of ``layout`` declares (any
    number of tokens: a layer short of the prompt is the caller's to judge)."""
    check_layer(i, layout.num_layers, what)
    assert isinstance(i, int)
    lay = layout.layers[i]
    for name, t, ch in (("K", k, lay.k_channels), ("V", v, lay.v_channels)):
        if not isinstance(t, torch.Tensor):
            raise InvalidRequest(f"{what}: layer {i}'s {name} must be a torch tensor, got "
                                 f"{type(t).__name__}")
        if t.dim() != 3 or t.shape[0] != lay.kv_heads or t.shape[2] != ch:
            raise InvalidRequest(f"{what}: layer {i}'s {name} has shape {tuple(t.shape)}, "
                                 f"expected [kv_heads, tokens, channels] = [{lay.kv_heads}, "
                                 f"tokens, {ch}]")


def check_streams(streams: Sequence[LayerStream], layout: KVLayout, chunk_tokens: int) -> None:
    """LayoutMismatch unless ``streams`` hold the blocks asked for, in order: of ``layout``,
    ``chunk_tokens`` tokens a block, each starting where its block does. The client checks the
    layout and tokens of what a server answers; where the positions differ, the server
    answered another block than the key's (a fault, or a server not to be trusted), and its KV
    must not reach the model."""
    c, at = chunk_tokens, 0
    for s in streams:
        tokens, start = s.num_tokens, s.start_position
        if s.layout.fingerprint != layout.fingerprint or tokens != s.blocks * c:
            raise LayoutMismatch(f"a loaded block holds {tokens} tokens of layout "
                                 f"{s.layout.fingerprint}; the engine's blocks hold "
                                 f"{c} of {layout.fingerprint}")
        if start != at:
            raise LayoutMismatch(f"the block loaded for tokens {at}..{at + tokens} holds "
                                 f"the KV of tokens {start}..{start + tokens}")
        at += tokens
