"""KVCache: a layout plus the per-layer key and value tensors of one sequence.

    K[layer]: [kv_heads, tokens, k_channels]      V[layer]: [kv_heads, tokens, v_channels]

``start_position`` is the absolute position of the first token (0 for a chunk prefilled alone);
stored keys carry RoPE at ``start_position + t`` when ``layout.rope.keys_rotated``.

Conversions to and from transformers caches live in the adapter (``kdn.model.hf.to_transformers``,
``kdn.model.hf.from_transformers``): this module knows nothing of any model library.
"""

from __future__ import annotations

import builtins
import contextlib
import numbers
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kdn.checks import is_bool
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import MAX_POSITION, KVLayout

LayerKV = tuple[torch.Tensor, torch.Tensor]
_DENSE = torch.strided


@dataclass(eq=False)
class KVCache:
    """Keys and values of one sequence, layer by layer, in the shapes ``layout`` declares.

    ``==`` is identity (a cache is its tensors: the dataclass's field comparison asked torch
    for the truth of a tensor, a RuntimeError); ``equal`` compares contents bit for bit."""

    layout: KVLayout
    layers: list[LayerKV]
    start_position: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise InvalidLayout(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if isinstance(self.layers, torch.Tensor) or not isinstance(self.layers, Iterable):
            raise InvalidLayout(f"layers must be a list of (K, V) pairs of tensors, one per "
                                f"layer, got {type(self.layers).__name__}")
        self.layers = list(self.layers)
        if not isinstance(self.start_position, (int, float)) and not is_bool(self.start_position):
            with contextlib.suppress(TypeError):  # numpy's, torch's integers
                self.start_position = operator.index(self.start_position)
        self.validate()

    @classmethod
    def of_views(cls, layout: KVLayout, layers: list[LayerKV], start_position: int) -> KVCache:
        """A cache of tensors whose shapes and dtype were made from ``layout`` by the caller
        (views a codec plan made, ``kdn.codec.inplace``): not validated again (``validate``
        walks every layer: ~20 µs for 32 layers, on every read)."""
        kv = cls.__new__(cls)
        kv.layout, kv.layers, kv.start_position = layout, layers, start_position
        return kv

    def validate(self) -> None:
        """Raise InvalidLayout unless ``start_position`` is a whole number in [0, 2**63) (its
        last token's position too) and every layer is a (K, V) pair of dense tensors on one
        device that matches the layout (layers may lie on different devices)."""
        if len(self.layers) != self.layout.num_layers:
            raise InvalidLayout(
                f"cache has {len(self.layers)} layers, layout declares {self.layout.num_layers}"
            )
        sp = self.start_position
        if isinstance(sp, bool) or not isinstance(sp, int) or not 0 <= sp <= MAX_POSITION:
            raise InvalidLayout(f"start_position must be a whole number in [0, 2**63), got "
                                f"{sp!r}")
        tokens = None
        dtype = self.layout.dtype.torch
        for i, (pair, lay) in enumerate(zip(self.layers, self.layout.layers)):
            # what is not a pair of tensors is named where a check fails (``_not_tensors``):
            # this runs per cache made, and a numpy array has a shape too
            try:
                k, v = pair
                ks, vs = k.shape, v.shape  # torch.Size: a tuple (one call each)
            except (TypeError, ValueError, AttributeError):
                raise InvalidLayout(_not_tensors(i, pair) or f"layer {i}: no shape") from None
            t = ks[1] if len(ks) == 3 else -1
            if ks != (lay.kv_heads, t, lay.k_channels):
                raise InvalidLayout(_not_tensors(i, pair) or f"layer {i}: K has shape "
                                    f"{tuple(ks)}, expected {(lay.kv_heads, t, lay.k_channels)}")
            if vs != (lay.kv_heads, t, lay.v_channels):
                raise InvalidLayout(_not_tensors(i, pair) or f"layer {i}: V has shape "
                                    f"{tuple(vs)}, expected {(lay.kv_heads, t, lay.v_channels)}")
            if tokens is None:
                tokens = t
            elif t != tokens:
                raise InvalidLayout(f"layer {i} holds {t} tokens, layer 0 holds {tokens}")
            if k.dtype != dtype or v.dtype != dtype:
                raise InvalidLayout(_not_tensors(i, pair) or f"layer {i}: dtype "
                                    f"{k.dtype}/{v.dtype}, layout declares "
                                    f"{self.layout.dtype.value}")
            if k.layout is not _DENSE or v.layout is not _DENSE:  # the codec's views need it
                raise InvalidLayout(f"layer {i}: K and V must be dense (torch.strided) tensors, "
                                    f"got {k.layout}/{v.layout} (to_dense() makes one)")
            if k.device != v.device:
                raise InvalidLayout(f"layer {i}: K is on {k.device}, V on {v.device}; a "
                                    f"layer's K and V are on one device")
        if tokens is not None and sp + tokens - 1 > MAX_POSITION:
            raise InvalidLayout(f"start_position {sp} with {tokens} tokens puts the last past "
                                f"the largest position, 2**63 - 1")

    @property
    def num_tokens(self) -> int:
        return int(self.layers[0][0].shape[1])

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def __len__(self) -> int:
        return self.num_tokens

    # -- slicing and concatenation -------------------------------------------------------------

    def slice(self, start: int, stop: int | None = None) -> KVCache:
        """Tokens [start, stop) as views (no copy); positions follow the slice."""
        n = self.num_tokens
        stop = n if stop is None else stop
        for name, at in (("start", start), ("stop", stop)):
            if isinstance(at, bool) or not isinstance(at, numbers.Integral):
                raise InvalidArgument(f"slice {name} must be a whole number, got {at!r}")
        if not 0 <= start <= stop <= n:
            raise InvalidLayout(f"token range [{start}, {stop}) outside a cache of {n} tokens")
        return KVCache(
            self.layout,
            [(k[:, start:stop], v[:, start:stop]) for k, v in self.layers],
            self.start_position + start,
        )

    def __getitem__(self, item: builtins.slice) -> KVCache:
        if not isinstance(item, builtins.slice) or item.step not in (None, 1):
            raise TypeError("KVCache supports contiguous token slices only, e.g. kv[10:20]")
        start, stop, _ = item.indices(self.num_tokens)
        return self.slice(start, max(start, stop))

    @staticmethod
    def concat(parts: Iterable[KVCache]) -> KVCache:
        """Join caches along tokens; all must share one layout, and each layer one device.
        Positions follow the first part."""
        if isinstance(parts, (KVCache, torch.Tensor)) or not isinstance(parts, Iterable):
            raise InvalidArgument(f"concat joins a list of KVCaches, got {type(parts).__name__}")
        parts = list(parts)  # a generator too
        if not parts:
            raise InvalidLayout("concat needs at least one cache")
        for i, p in enumerate(parts):
            if not isinstance(p, KVCache):
                raise InvalidArgument(f"concat joins KVCaches; part {i} is "
                                      f"{type(p).__name__}")
        layout = parts[0].layout
        for p in parts[1:]:
            if p.layout.fingerprint != layout.fingerprint:
                raise InvalidLayout("concat of caches with different layouts")
        for j, p in enumerate(parts[1:], 1):
            for i, ((k, _), (k0, _)) in enumerate(zip(p.layers, parts[0].layers)):
                if k.device != k0.device:  # torch.cat's raw RuntimeError otherwise
                    raise InvalidArgument(f"concat of caches on different devices: part {j}'s "
                                          f"layer {i} is on {k.device}, part 0's on {k0.device}")
        if len(parts) == 1:
            return parts[0]
        layers = [
            (
                torch.cat([p.layers[i][0] for p in parts], dim=1),
                torch.cat([p.layers[i][1] for p in parts], dim=1),
            )
            for i in range(layout.num_layers)
        ]
        return KVCache(layout, layers, parts[0].start_position)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KVCache:
        return KVCache(
            self.layout,
            [(k.to(device, non_blocking=non_blocking), v.to(device, non_blocking=non_blocking))
             for k, v in self.layers],
            self.start_position,
        )

    def equal(self, other: object) -> bool:
        """Bit-exact equality of layout, positions and every tensor: the bits are compared,
        not the values (-0.0 is not 0.0, a NaN equals the same NaN). What is not a KVCache
        is not equal."""
        return (
            isinstance(other, KVCache)
            and self.layout.fingerprint == other.layout.fingerprint
            and self.start_position == other.start_position
            and all(
                _same_bits(a, c) and _same_bits(b, d)
                for (a, b), (c, d) in zip(self.layers, other.layers)
            )
        )


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have one dtype, one shape and the same bits (``torch.equal`` compares
    values: 0.0 == -0.0, NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        bits = _BITS[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return torch.equal(a, b)


def _not_tensors(i: int, pair: object) -> str:
    """Why layer ``i``'s ``pair`` is not a (K, V) pair of torch tensors; "" when it is."""
    if not isinstance(pair, (tuple, list, torch.Tensor)) or len(pair) != 2:
        size = f" of {len(pair)}" if isinstance(pair, (tuple, list, torch.Tensor)) else ""
        return f"layer {i} must be a (K, V) pair of tensors, got {type(pair).__name__}{size}"
    k, v = pair
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        return ""
    hint = (" (a numpy array: torch.from_numpy(it))"
            if "numpy" in (type(k).__module__, type(v).__module__) else "")
    return (f"layer {i}: K and V must be torch tensors, got {type(k).__name__} and "
            f"{type(v).__name__}{hint}")


def to_pinned_host(tensors: Sequence[torch.Tensor], side: torch.cuda.Stream
                   ) -> list[torch.Tensor]:
    """Copies of CUDA ``tensors`` in new page-locked host tensors, queued on the side stream
    ``side`` after what the current stream has queued (the compute that wrote them), so the
    compute stream does not wait for them. Non-blocking: they are done once an event
    recorded on ``side`` after this call has completed; each source stays alive until then."""
    side.wait_stream(torch.cuda.current_stream(tensors[0].device))
    out = []
    with torch.cuda.stream(side):
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(side)  # not reused by the allocator before the copy ran
            out.append(host)
    return out
