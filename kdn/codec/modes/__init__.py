"""Codec modes: how one layer's K and V tensors become bytes and back.

A mode is a pure transform registered by name. The container (``kdn.codec.format``) frames its
output; the mode only sees one layer at a time:

    encode_layer(k, v, spec, level) -> body      k: [kv_heads, tokens, k_channels]
    decode_layer(body, spec, level, device) -> (k, v)

Modes must handle any per-layer shape (pruned layouts), check that a body has exactly the size
its shapes imply, and raise ``Corrupt`` rather than return wrong tensors.

Non-finite values: a lossless mode keeps every value bit for bit, NaN and inf included. A lossy
mode quantizes by scales that a NaN or an inf makes meaningless (a NaN became a symbol of
INT32_MIN; an inf zeroed its whole token), so ``encode_parts`` refuses such a layer before a
lossy mode sees it (``check_finite``: InvalidArgument naming the layer). A cache holding one
is a model's bug; store it ``lossless`` or ``raw`` to keep it as it is. So is one holding a
magnitude past the mode's ``max_abs`` (``int8`` and ``cachegen`` keep float16 scales: a bf16
or fp32 value beyond their reach came back clipped).
"""

from __future__ import annotations

import abc
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kdn.codec.quant import from_numpy
from kdn.errors import Corrupt, InvalidArgument
from kdn.layout import DType, LayerLayout


@dataclass(frozen=True)
class LayerSpec:
    """What a mode knows about the layer it codes."""

    index: int
    num_layers: int
    layout: LayerLayout
    tokens: int
    dtype: DType

    @property
    def k_shape(self) -> tuple[int, int, int]:
        return (self.layout.kv_heads, self.tokens, self.layout.k_channels)

    @property
    def v_shape(self) -> tuple[int, int, int]:
        return (self.layout.kv_heads, self.tokens, self.layout.v_channels)


class Mode(abc.ABC):
    """Base of every codec mode. Subclasses set ``name`` and ``levels`` and register."""

    name: ClassVar[str]
    levels: ClassVar[tuple[str, ...]] = ("",)
    lossless: ClassVar[bool] = False
    max_abs: ClassVar[float] = math.inf
    """The largest magnitude the mode codes within its error (its scales' format bounds
    them); ``encode_parts`` refuses a layer holding a larger one (``check_finite``)."""
    borrows: ClassVar[bool] = False
    """Whether ``borrow_layer`` views bodies in place (the mode stores tensors verbatim)."""

    def check_level(self, level: str) -> str:
        if level not in self.levels:
            raise InvalidArgument(
                f"codec mode {self.name!r} has no level {level!r}; levels: {list(self.levels)}"
            )
        return level

    def params(self, level: str) -> dict[str, str]:
        """Parameters recorded in the header (informational; decode relies on the level)."""
        return {}

    @abc.abstractmethod
    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, spec: LayerSpec, level: str) -> bytes:
        ...

    @abc.abstractmethod
    def decode_layer(
        self, body: memoryview, spec: LayerSpec, level: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def decode_layers(self, bodies: list[memoryview], specs: list[LayerSpec], level: str,
                      device: torch.device, *, pinned: bool = False,
                      addresses: list[int] | None = None) -> Any:
        """Many layers at once on a GPU in a few kernel launches, with no host
        synchronisation: a ``kdn.codec.gpu_batch.Decoded`` whose ``check()`` gives the layers
        (raising Corrupt for damaged bytes). None where the mode has no such decoder: then
        ``decode_layer`` one layer at a time. ``pinned``: the bodies lie in page-locked or
        CUDA-registered memory (copied from in place, not staged first). ``addresses``:
        where each body lies (``codec.api.entry_bodies``), else found from the views."""
        return None

    def decode_work_bytes(self, elements: int, itemsize: int) -> int:
        """Bytes a CPU ``decode_layer`` of a layer of ``elements`` K and V elements of
        ``itemsize`` bytes holds at its peak besides its output and its body: what
        ``StreamDecoder`` checks room for, times the layers decoded at once."""
        return 0

    def borrow_layer(self, body: memoryview, spec: LayerSpec, *, private: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CPU tensors that view ``body``'s bytes in place (no copy), for modes that store
        the tensors verbatim; None where the mode must decode (or ``body`` is misaligned).
        Only for bodies the caller owns alone and keeps unchanged while the tensors live;
        ``private``: read-only bodies may be viewed too (``tensor_borrowed``)."""
        return None


def check_finite(k: torch.Tensor, v: torch.Tensor, layer: int, mode: str,
                 max_abs: float = math.inf) -> None:
    """InvalidArgument when layer ``layer``'s K or V holds a NaN or an inf, which lossy mode
    ``mode`` can not code (module docstring), or a value of magnitude past ``max_abs`` (the
    mode's ``max_abs``: it would come back clipped, not within the mode's error)."""
    for name, x in (("K", k), ("V", v)):
        top = float(x.abs().amax()) if x.numel() else 0.0  # (NaN where one is: amax keeps it)
        if not math.isfinite(top):
            raise InvalidArgument(f"layer {layer}: {name} holds NaN or inf, which lossy mode "
                                  f"{mode!r} can not code (lossless and raw keep them)")
        if top > max_abs:
            raise InvalidArgument(f"layer {layer}: {name} holds a value of magnitude {top:.4g}, "
                                  f"past the {max_abs:.4g} lossy mode {mode!r} codes (its "
                                  "scales are float16; lossless and raw keep it)")


_MODES: dict[str, Mode] = {}
_LOADED = False


def register(mode: Mode) -> Mode:
    _MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> Mode:
    _load_builtin()
    try:
        return _MODES[name]
    except (KeyError, TypeError):  # TypeError: a list, a dict (unhashable)
        raise InvalidArgument(
            f"unknown codec mode {name!r}; known modes: {sorted(_MODES)}"
        ) from None


def mode_names() -> list[str]:
    _load_builtin()
    return sorted(_MODES)


def _load_builtin() -> None:
    # a flag, not ``if not _MODES``: importing one mode module directly registers it first
    global _LOADED
    if not _LOADED:
        import importlib
        import pkgutil

        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _LOADED = True


# ------------------------------------------------------------------ helpers shared by modes

_INT_VIEW = {2: np.int16, 4: np.int32}


def tensor_view(t: torch.Tensor) -> memoryview:
    """Zero-copy view of ``t``'s element bytes when it is a contiguous CPU tensor (one copy
    otherwise). The view keeps the tensor's storage alive; join or copy it before mutating."""
    t = t.detach().contiguous().cpu()
    if not t.numel():  # memoryview can not cast a view with a zero in its shape
        return memoryview(b"")
    return memoryview(t.view(_int_dtype(t.dtype)).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian element bytes of ``t`` (any float dtype, bf16 included)."""
    t = t.detach().contiguous().cpu()
    return t.view(_int_dtype(t.dtype)).numpy().tobytes()


def tensor_from_bytes(
    buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device,
    *, owned: bool = False,
) -> torch.Tensor:
    """Owned tensor of ``shape`` from exactly the right number of raw bytes. ``owned``: ``buf``
    views a new array nothing else holds, so a CPU tensor views it instead of copying it."""
    itemsize = dtype.itemsize
    n = int(np.prod(shape))
    if len(buf) != n * itemsize:
        raise Corrupt(f"expected {n * itemsize} bytes for {shape} {dtype}, got {len(buf)}")
    if device.type != "cpu":  # staged once in pinned memory, copied without a sync
        return from_numpy(np.frombuffer(buf, dtype=_INT_VIEW[itemsize]), device
                          ).view(dtype).reshape(shape)
    arr = np.frombuffer(buf, dtype=_INT_VIEW[itemsize])
    return torch.from_numpy(arr if owned else arr.copy()).view(dtype).reshape(shape)


_warned = False
"""Whether torch gave (to nothing) its one warning about a read-only buffer in this process."""


def tensor_borrowed(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], *,
                    private: bool = False) -> torch.Tensor | None:
    """A CPU tensor of ``shape`` viewing ``buf`` (exactly the right size) in place; None when
    ``buf`` is read-only (unless ``private``) or not aligned to the element size.

    ``private``: ``buf`` is read-only only because of what holds it, and nothing else holds
    or reads that: the bytes objects gRPC made for one received message, which the receiver
    alone references (``kdn.client.received.received``). The tensor keeps them alive, and a
    write through it changes no value anyone else can see."""
    if buf.readonly and not private or not len(buf) or \
            len(buf) != math.prod(shape) * dtype.itemsize:
        return None
    global _warned
    if buf.readonly and not _warned:
        with warnings.catch_warnings():  # torch warns once per process that it can not
            warnings.simplefilter("ignore", UserWarning)  # protect them, then never again
            t = torch.frombuffer(buf, dtype=dtype)
        _warned = True
    else:
        t = torch.frombuffer(buf, dtype=dtype)
    return None if t.data_ptr() % dtype.itemsize else t.view(shape)


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[
        dtype
    ]


_SECTION_LEN = np.dtype("<u4")


def pack_sections(sections: list[bytes]) -> bytes:
    """A body of several byte sections: u32 lengths (one per section), then the sections."""
    lens = np.array([len(s) for s in sections], dtype=_SECTION_LEN).tobytes()
    return lens + b"".join(sections)


def unpack_sections(body: bytes | memoryview, count: int, where: str) -> list[memoryview]:
    """Split a ``pack_sections`` body of exactly ``count`` sections; raise Corrupt otherwise."""
    mv = memoryview(body)
    head = 4 * count
    if len(mv) < head:
        raise Corrupt(f"{where}: body of {len(mv)} bytes is shorter than its section table")
    lens = np.frombuffer(mv[:head], dtype=_SECTION_LEN).astype(np.int64)
    if head + int(lens.sum()) != len(mv):
        raise Corrupt(f"{where}: sections of {int(lens.sum())} bytes in a body of {len(mv)}")
    out: list[memoryview] = []
    off = head
    for n in lens.tolist():
        out.append(mv[off : off + n])
        off += n
    return out
