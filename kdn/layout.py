"""KVLayout: the one description of a KV cache's shape, used everywhere in kdn.

A layout says, for one model, what each layer's cached keys and values look like:

    K[layer]: [kv_heads, tokens, k_channels]      V[layer]: [kv_heads, tokens, v_channels]

Layers may differ from each other, and K may differ from V: layouts of structurally pruned models
(KVPruner) are first-class. ``k_kept``/``v_kept`` record which channels of the model's original
head dimension a layer kept (``None`` means all of them, in order).

Positional facts (``RopeSpec``) say how keys were rotated, so the blender can re-position them.
The start position of a particular cache's first token is a property of that cache
(``KVCache.start_position``), not of the layout: the same layout serves chunks at any position.

A layout is frozen and hashable; ``fingerprint`` is a stable content hash (same value in every
process and on every machine) that keys and stored entries carry. Each field is held as one type
(theta a float, counts and channels ints, keys_rotated a bool), whatever kind of number built it,
so layouts that compare equal have one fingerprint; what is none of these is InvalidLayout.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import numbers
import operator
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kdn.checks import is_bool, to_float, whole
from kdn.checks import shown as _shown
from kdn.errors import InvalidArgument, InvalidLayout, LayoutMismatch

if TYPE_CHECKING:
    import torch

    TorchDType = torch.dtype


MAX_POSITION = 2**63 - 1
"""The largest position a token may have (a cache's ``start_position`` and its last token's):
positions are int64 in torch (RoPE tables, position ids)."""


_TORCH_DTYPES: dict[str, TorchDType] = {}


class DType(enum.Enum):
    """Element types a cache may hold."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"

    @property
    def torch(self) -> TorchDType:
        t = _TORCH_DTYPES.get(self.value)  # asked per tensor on every decode: looked up once
        if t is None:
            import torch  # the storage side uses layouts without torch: loaded on first need

            t = _TORCH_DTYPES[self.value] = getattr(torch, self.value)
        return t

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @classmethod
    def of(cls, dtype: TorchDType | str | DType) -> DType:
        if isinstance(dtype, DType):
            return dtype
        torch = sys.modules.get("torch")  # a torch dtype can only exist once torch is loaded
        if torch is not None and isinstance(dtype, torch.dtype):
            for k in cls:
                if getattr(torch, k.value) == dtype:
                    return k
            raise InvalidLayout(f"unsupported dtype {dtype}; kdn stores float16, bfloat16, float32")
        try:
            return cls(str(dtype).removeprefix("torch."))
        except ValueError:
            raise InvalidLayout(
                f"unsupported dtype {dtype!r}; kdn stores float16, bfloat16, float32"
            ) from None


@dataclass(frozen=True)
class RopeSpec:
    """What is needed to re-rotate stored keys to another position."""

    theta: float = 10000.0
    """Base of the rotary frequencies."""
    rotary_dim: int = 0
    """Channels of the original head that rotate (the first ``rotary_dim``; 0 = no RoPE)."""
    scaling: str = ""
    """Canonical JSON of the model's rope scaling parameters beyond theta ("" = none)."""
    keys_rotated: bool = True
    """Whether stored keys already carry RoPE at their positions (transformers caches do)."""

    def __post_init__(self) -> None:
        # each field as the one Python type the fingerprint writes it as: theta=500000 and
        # 500000.0 compare equal, and must be one layout (one key, entries that decode)
        theta = self.theta
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
            raise InvalidLayout(f"rope theta must be a number > 0, got {_shown(theta)}")
        theta = to_float(theta)
        if not 0 < theta < math.inf:
            raise InvalidLayout(f"rope theta must be a finite number > 0, got {_shown(theta)}")
        object.__setattr__(self, "theta", theta)
        rotary_dim = _count("rope rotary_dim", self.rotary_dim, 0)
        if rotary_dim % 2:
            raise InvalidLayout(f"rope rotary_dim must be even and >= 0, got {rotary_dim}")
        object.__setattr__(self, "rotary_dim", rotary_dim)
        _text("rope scaling", self.scaling)
        if not isinstance(self.keys_rotated, bool):
            raise InvalidLayout(f"rope keys_rotated must be True or False, got "
                                f"{_shown(self.keys_rotated)}")


@dataclass(frozen=True)
class LayerLayout:
    """One layer's K and V shapes."""

    kv_heads: int
    k_channels: int
    v_channels: int
    k_kept: tuple[int, ...] | None = None
    """Original channel indices kept for K (per head, ascending); None = all, in order."""
    v_kept: tuple[int, ...] | None = None
    """Original channel indices kept for V; None = all, in order."""

    def __post_init__(self) -> None:
        for name in ("kv_heads", "k_channels", "v_channels"):
            object.__setattr__(self, name, _count(name, getattr(self, name), 1))
        for name, n in (("k_kept", self.k_channels), ("v_kept", self.v_channels)):
            kept = _indices(name, getattr(self, name))
            object.__setattr__(self, name, kept)  # numpy / torch integers as ints: one
            if kept is None:  # fingerprint, one key, whatever built the layout
                continue
            if len(kept) != n:
                raise InvalidLayout(f"{name} lists {len(kept)} channels but the layer has {n}")
            if any(b <= a for a, b in zip(kept, kept[1:])) or (kept and kept[0] < 0):
                raise InvalidLayout(f"{name} must be strictly ascending non-negative indices")
            if kept and kept[-1] >= _U32:
                raise InvalidLayout(f"{name} must list channels below 2**32, got {kept[-1]}")

    def k_numel(self, tokens: int) -> int:
        return self.kv_heads * tokens * self.k_channels

    def v_numel(self, tokens: int) -> int:
        return self.kv_heads * tokens * self.v_channels


def _indices(name: str, kept: object) -> tuple[int, ...] | None:
    """``kept`` as a tuple of Python ints (a sequence of integers of any kind: numpy's,
    0-d tensors), or None; InvalidLayout naming ``name`` for anything else."""
    if kept is None:
        return None
    try:
        if isinstance(kept, (str, bytes)):
            raise TypeError("text")
        out = tuple(operator.index(c) for c in kept)  # type: ignore[attr-defined]
        if any(is_bool(c) for c in kept):  # type: ignore[attr-defined]
            raise TypeError("bool")
    except TypeError:
        raise InvalidLayout(f"{name} must be a sequence of channel indices (integers), got "
                            f"{type(kept).__name__}") from None
    return out


_U32 = 1 << 32
"""Counts and channel indices are uint32 in the container's header."""


def _count(name: str, value: object, low: int) -> int:
    """``value`` as an int when it is a whole number (of any integer kind: numpy's, a 0-d
    tensor) in [low, 2**32); else InvalidLayout naming ``name`` (8.0, "8", True are none)."""
    what = "a positive int" if low == 1 else f"an int >= {low}"
    try:
        if is_bool(value):
            raise TypeError("bool")
        got = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidLayout(f"{name} must be {what}, got {_shown(value)}") from None
    if not low <= got < _U32:
        raise InvalidLayout(f"{name} must be {what} below 2**32, got {_shown(got)}")
    return got


def _text(name: str, value: object) -> str:
    """``value`` when it is a str that UTF-8 can hold (the header is protobuf); else
    InvalidLayout naming ``name``."""
    if not isinstance(value, str):
        raise InvalidLayout(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidLayout(f"{name} is not valid Unicode: {exc.reason} at {exc.start}"
                            ) from None
    return value


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's KV cache, layer by layer."""

    model_fingerprint: str
    """Stable id of the model (config and weights identity) the cache belongs to."""
    layers: tuple[LayerLayout, ...]
    dtype: DType = DType.FLOAT16
    head_dim: int = 0
    """Original (unpruned) head dimension; kept-channel indices refer to it."""
    rope: RopeSpec = field(default_factory=RopeSpec)
    model_name: str = ""
    """Human-readable model name; informational, not part of the fingerprint."""

    def __post_init__(self) -> None:
        if not _text("model_fingerprint", self.model_fingerprint):
            raise InvalidLayout("model_fingerprint must not be empty")
        if not isinstance(self.model_name, str):
            raise InvalidLayout(f"model_name must be a str, got {type(self.model_name).__name__}")
        # informational: a model folder whose name is not UTF-8 (os.fsdecode's surrogates in
        # _name_or_path, an engine's model path) is shown with those bytes escaped, not
        # refused, nor carried into a header protobuf can not write
        object.__setattr__(self, "model_name",
                           self.model_name.encode("utf-8", "backslashreplace").decode())
        if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__iter__"):
            raise InvalidLayout(f"layers must be a sequence of LayerLayout, got "
                                f"{type(self.layers).__name__}")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise InvalidLayout("a layout needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerLayout):
                raise InvalidLayout(f"layer {i} must be a LayerLayout, got "
                                    f"{type(layer).__name__}")
        if not isinstance(self.rope, RopeSpec):
            raise InvalidLayout(f"rope must be a RopeSpec, got {type(self.rope).__name__}")
        object.__setattr__(self, "dtype", DType.of(self.dtype))
        object.__setattr__(self, "head_dim", _count("head_dim", self.head_dim, 0))
        for i, layer in enumerate(self.layers):
            for kept in (layer.k_kept, layer.v_kept):
                if kept and self.head_dim and kept[-1] >= self.head_dim:
                    raise InvalidLayout(
                        f"layer {i}: kept channel {kept[-1]} >= head_dim {self.head_dim}"
                    )

    def __getstate__(self) -> dict[str, Any]:
        """The fields, not the cached hash: a string's hash is salted per process."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __hash__(self) -> int:
        """The fields' hash, computed once per layout object (layouts key many memos: the
        dataclass's own hash walks every layer on each lookup)."""
        got: int | None = self.__dict__.get("_hash")
        if got is None:
            got = hash((self.model_fingerprint, self.layers, self.dtype, self.head_dim,
                        self.rope, self.model_name))
            object.__setattr__(self, "_hash", got)
        return got

    @functools.cached_property
    def widest_token_bytes(self) -> tuple[int, int]:
        """(index, bytes) of the layer whose K and V take the most bytes per token."""
        sizes = [lay.kv_heads * (lay.k_channels + lay.v_channels) * self.dtype.itemsize
                 for lay in self.layers]
        widest = max(range(len(sizes)), key=sizes.__getitem__)
        return widest, sizes[widest]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def is_uniform(self) -> bool:
        """Every layer has the same shape (computed once per layout object)."""
        return all(layer == self.layers[0] for layer in self.layers)

    @functools.cached_property
    def bytes_per_token(self) -> int:
        """Uncompressed bytes one token's K and V occupy across all layers (computed once per
        layout object)."""
        per = sum(lay.kv_heads * (lay.k_channels + lay.v_channels) for lay in self.layers)
        return per * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON-safe) used by the fingerprint and by serializers."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "model_name": self.model_name,
            "dtype": self.dtype.value,
            "head_dim": self.head_dim,
            "rope": {
                "theta": self.rope.theta,
                "rotary_dim": self.rope.rotary_dim,
                "scaling": self.rope.scaling,
                "keys_rotated": self.rope.keys_rotated,
            },
            "layers": [
                {
                    "kv_heads": lay.kv_heads,
                    "k_channels": lay.k_channels,
                    "v_channels": lay.v_channels,
                    "k_kept": list(lay.k_kept) if lay.k_kept is not None else None,
                    "v_kept": list(lay.v_kept) if lay.v_kept is not None else None,
                }
                for lay in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """The layout ``to_dict`` described; InvalidLayout for a description that is not one.
        Values are taken as they are, not converted: the fields' own checks refuse what is
        not whole (kv_heads 2.7), not a bool ("false") or not a text (null), as they do for
        a layout made in code."""
        if not isinstance(d, dict):
            raise InvalidLayout(f"malformed layout description: a mapping is needed, got "
                                f"{type(d).__name__}")
        try:
            rope = d.get("rope", {})
            if not isinstance(rope, dict):
                raise InvalidLayout(f"rope must be a mapping, got {type(rope).__name__}")
            layers = d["layers"]
            if not isinstance(layers, (list, tuple)):
                raise InvalidLayout(f"layers must be a list, got {type(layers).__name__}")
            return cls(
                model_fingerprint=d["model_fingerprint"],
                model_name=d.get("model_name", ""),
                dtype=DType.of(d.get("dtype", "float16")),
                head_dim=d.get("head_dim", 0),
                rope=RopeSpec(
                    theta=rope.get("theta", 10000.0),
                    rotary_dim=rope.get("rotary_dim", 0),
                    scaling=rope.get("scaling", ""),
                    keys_rotated=rope.get("keys_rotated", True),
                ),
                layers=tuple(
                    LayerLayout(
                        kv_heads=lay["kv_heads"],
                        k_channels=lay["k_channels"],
                        v_channels=lay["v_channels"],
                        k_kept=lay.get("k_kept"),
                        v_kept=lay.get("v_kept"),
                    )
                    for lay in layers
                ),
            )
        except InvalidLayout as exc:
            raise InvalidLayout(f"malformed layout description: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidLayout(f"malformed layout description: {type(exc).__name__}: {exc}"
                                ) from exc

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable hex digest of everything that determines how the cache's bytes are read
        (computed once per layout object)."""
        d = self.to_dict()
        d.pop("model_name")
        return _digest(d)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        dtype: torch.dtype | str | DType = DType.FLOAT16,
        weights_id: str = "",
        computed_in: torch.dtype | str | DType | None = None,
    ) -> KVLayout:
        """Layout of an ordinary (or kdn-pruned) transformers decoder config.

        ``weights_id`` distinguishes checkpoints that share a config (e.g. fine-tunes). It is not
        derived from ``_name_or_path``: a local path differs between machines, and the same
        model must give the same fingerprint everywhere. ``computed_in``: the dtype the model
        computes its KV in, where it matters (``kdn.model.hf.model_layout``'s ``exact``); it
        enters the model fingerprint only where it is not ``dtype`` (the KV was converted), so
        the usual layout, stored as computed, keeps its fingerprint.
        """
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        per_layer = sorted(set(getattr(cfg, "per_layer_attributes", None) or ()) & _READ)
        if per_layer:  # (reading one raises transformers' AmbiguousGlobalPerLayerAttributeError)
            raise InvalidLayout(
                f"{getattr(cfg, 'model_type', type(cfg).__name__)} sets {', '.join(per_layer)} "
                f"per layer (per_layer_config): a kdn layout describes models whose layers "
                f"share one head size and rotary embedding")
        n_layers = int(cfg.num_hidden_layers)
        n_heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        rope_params = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = float(rope_params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        rope_type = rope_params.get("rope_type", "default")
        partial = float(
            rope_params.pop("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        )
        scaling = "" if rope_type == "default" and len(rope_params) <= 1 else _canon(rope_params)
        rotary_dim = int(head_dim * partial) // 2 * 2
        pruned = getattr(cfg, "kdn_pruned", None)  # written by kdn.prune: per-layer kept channels
        layers = [LayerLayout(kv_heads, len(k_kept), len(v_kept), k_kept, v_kept)
                  for k_kept, v_kept in pruned_kept(pruned, n_layers)] if pruned is not None \
            else [LayerLayout(kv_heads, head_dim, head_dim)] * n_layers
        name = str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", ""))
        computed = "" if computed_in is None else computed_in.value if isinstance(
            computed_in, DType) else str(computed_in).removeprefix("torch.")
        layout = cls(
            model_fingerprint=model_fingerprint(
                config, weights_id=weights_id,
                computed_in="" if computed == DType.of(dtype).value else computed),
            model_name=name,
            layers=tuple(layers),
            dtype=DType.of(dtype),
            head_dim=head_dim,
            rope=RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling=scaling),
        )
        for i, lay in enumerate(layout.layers if pruned is not None else ()):
            _check_rotary_pairs(i, lay.k_kept or (), rotary_dim)
        return layout


_READ = frozenset({"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "hidden_size", "rope_parameters", "rope_theta", "partial_rotary_factor"})
"""The config attributes ``KVLayout.from_config`` reads (none may differ between layers)."""


def pruned_kept(pruned: Any, n_layers: int | None = None
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(k_kept, v_kept) of each layer from a config's ``kdn_pruned``; InvalidLayout naming the
    field unless it is a mapping listing both, each layer a list of whole numbers (not 1.5,
    1.0 or true), for the same number of layers (exactly ``n_layers`` when given)."""
    if not isinstance(pruned, dict):
        raise InvalidLayout(f"malformed kdn_pruned: a mapping, got {type(pruned).__name__}")
    kept: dict[str, list[tuple[int, ...]]] = {}
    for name in ("k_kept", "v_kept"):
        if name not in pruned:
            raise InvalidLayout(f"malformed kdn_pruned: no {name}")
        layers = pruned[name]
        if not isinstance(layers, (list, tuple)):
            raise InvalidLayout(f"malformed kdn_pruned: {name} must list each layer's "
                                f"channels, got {_shown(layers)}")
        kept[name] = [_channels(f"{name} layer {i}", layer) for i, layer in enumerate(layers)]
    want = len(kept["k_kept"]) if n_layers is None else n_layers
    for name, per_layer in kept.items():
        if len(per_layer) != want:
            raise InvalidLayout(f"kdn_pruned lists {name} for {len(per_layer)} layers, the "
                                f"model has {want}")
    return list(zip(kept["k_kept"], kept["v_kept"]))


def _channels(name: str, layer: object) -> tuple[int, ...]:
    """One layer's kept channels from ``kdn_pruned``: a list of whole numbers (any integer
    kind), else InvalidLayout naming ``name`` and the value that is none."""
    if not isinstance(layer, (list, tuple)):
        raise InvalidLayout(f"malformed kdn_pruned: {name} must list channel indices, got "
                            f"{_shown(layer)}")
    out = []
    for c in layer:
        try:
            if is_bool(c):
                raise TypeError("bool")
            out.append(operator.index(c))
        except TypeError:
            raise InvalidLayout(f"malformed kdn_pruned: {name} holds {_shown(c)}, not a "
                                "channel index (a whole number)") from None
    return tuple(out)


def _check_rotary_pairs(i: int, k_kept: tuple[int, ...], rotary_dim: int) -> None:
    """InvalidLayout unless layer ``i`` keeps each rotary K channel with its RoPE partner
    (c and c + rotary_dim/2, for c < rotary_dim): a key missing half of a pair can not be
    re-positioned (``kdn.blend.rope.rope_plan``)."""
    half, kept = rotary_dim // 2, set(k_kept)
    for c in k_kept:
        mate = c + half if c < half else c - half
        if c < rotary_dim and mate not in kept:
            raise InvalidLayout(f"layer {i}: kdn_pruned k_kept keeps rotary channel {c} "
                                f"without its RoPE partner {mate}; K must keep whole pairs")


_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "architectures",
    "_commit_hash",
}


class Expected(NamedTuple):
    """What a reader expects of a stored entry: its layout (by fingerprint) and the tokens it
    holds ("" / 0: any). The server checks it before answering (``expect_layout_fingerprint``
    and ``expect_tokens`` of a read: FAILED_PRECONDITION), the client on entries it holds
    itself. An engine that reads a block of ``chunk_tokens`` tokens asks for exactly that: an
    entry written under the block's key with another shape is refused before any of it is
    decoded (its declared size never reaches an allocator)."""

    fingerprint: str = ""
    tokens: int = 0

    @classmethod
    def of(cls, layout: KVLayout | None, tokens: int = 0) -> Expected:
        """What a read's ``layout`` and ``tokens`` arguments ask for; InvalidArgument naming
        the one that is not a KVLayout or None, or a whole number of tokens in [0, 2**32)
        (0: any)."""
        if layout is not None and not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout or None, got "
                                  f"{type(layout).__name__}")
        tokens = whole("tokens", tokens, 0, " (0: any)")  # numpy's ints too
        if tokens >= 1 << 32:  # a uint32 on the wire
            raise InvalidArgument(f"tokens must be below 2**32, got {tokens}")
        return cls(layout.fingerprint if layout is not None else "", tokens)

    def check(self, layout: KVLayout, tokens: int, what: str = "entry") -> None:
        """LayoutMismatch unless an entry of ``layout`` holding ``tokens`` tokens is what is
        expected."""
        if self.fingerprint and layout.fingerprint != self.fingerprint:
            raise LayoutMismatch(f"{what} has layout {layout.fingerprint}, caller expects "
                                 f"{self.fingerprint}")
        if self.tokens and tokens != self.tokens:
            raise LayoutMismatch(f"{what} holds {tokens} tokens, caller expects {self.tokens}")


def model_fingerprint(config: Any, *, weights_id: str = "", computed_in: str = "") -> str:
    """Stable digest of a model config's architecture fields plus a weights identity, and the
    dtype the KV was computed in where it is not the one it is stored in ("": the same)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
    named: dict[str, Any] = {"config": d, "weights": weights_id}
    if computed_in:
        named["computed_in"] = computed_in
    return _digest(named)


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _digest(obj: Any) -> str:
    return hashlib.blake2b(_canon(obj).encode(), digest_size=16).hexdigest()
