"""Layouts in the container's header: ``KVLayout`` to and from its proto message, the bounded
memo that keeps parsing a model's (always identical) layout cheap, and the per-layer size limit
that both the encoder and every header parse hold a layout and token count to."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kdn.errors import InvalidLayout
from kdn.layout import DType, KVLayout, LayerLayout, RopeSpec
from kdn.v1 import kdn_pb2 as pb

MAX_LAYER_BYTES = 4 << 30
"""Largest decoded layer (K + V) a container may declare: a bound on what a decoder allocates
for hostile input (a 128k-token layer of a 70B model is ~0.5 GiB)."""


def check_layer_bytes(layout: KVLayout, tokens: int) -> None:
    """InvalidLayout where ``tokens`` tokens of the layout's widest layer take more than
    ``MAX_LAYER_BYTES`` decoded: ``format.parse_header`` refuses such a header, so every
    decoder and server would, and ``encode`` refuses to write one."""
    widest, per_token = layout.widest_token_bytes
    if per_token * tokens > MAX_LAYER_BYTES:
        raise InvalidLayout(f"layer {widest} declares {per_token * tokens} bytes of K and V for "
                            f"{tokens} tokens, over the {MAX_LAYER_BYTES}-byte layer limit")


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    msg = pb.Layout(
        model_fingerprint=layout.model_fingerprint,
        model_name=layout.model_name,
        dtype=layout.dtype.value,
        head_dim=layout.head_dim,
        rope=pb.RopeSpec(
            theta=layout.rope.theta,
            rotary_dim=layout.rope.rotary_dim,
            scaling=layout.rope.scaling,
            keys_rotated=layout.rope.keys_rotated,
        ),
    )
    for lay in layout.layers:
        msg.layers.append(
            pb.LayerLayout(
                kv_heads=lay.kv_heads,
                k_channels=lay.k_channels,
                v_channels=lay.v_channels,
                k_kept=list(lay.k_kept or ()),
                v_kept=list(lay.v_kept or ()),
                has_k_kept=lay.k_kept is not None,
                has_v_kept=lay.v_kept is not None,
            )
        )
    return msg


def layout_from_proto(msg: pb.Layout) -> KVLayout:
    return KVLayout(
        model_fingerprint=msg.model_fingerprint,
        model_name=msg.model_name,
        dtype=DType.of(msg.dtype),
        head_dim=msg.head_dim,
        rope=RopeSpec(
            theta=msg.rope.theta or 10000.0,
            rotary_dim=msg.rope.rotary_dim,
            scaling=msg.rope.scaling,
            keys_rotated=msg.rope.keys_rotated,
        ),
        layers=tuple(
            LayerLayout(
                kv_heads=lay.kv_heads,
                k_channels=lay.k_channels,
                v_channels=lay.v_channels,
                k_kept=tuple(lay.k_kept) if lay.has_k_kept else None,
                v_kept=tuple(lay.v_kept) if lay.has_v_kept else None,
            )
            for lay in msg.layers
        ),
    )


K = TypeVar("K")
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """A memo of at most ``limit`` values, the oldest dropped first. Writes take a lock; reads
    do not (a dict read is atomic: a racing read sees the value or a miss, and computes it)."""

    def __init__(self, limit: int) -> None:
        self._values: dict[K, V] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if len(self._values) >= self._limit:
                self._values.pop(next(iter(self._values)))
            self._values[key] = value


_LAYOUTS: BoundedMemo[bytes, KVLayout] = BoundedMemo(256)


def layout_of(msg: pb.Layout) -> KVLayout:
    """``layout_from_proto``, memoised on the message's bytes: every entry of a model carries
    the same layout, and building one (and its fingerprint) costs more than the rest of a
    header parse. Layouts are immutable, so sharing them is safe."""
    key = msg.SerializeToString(deterministic=True)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = layout_from_proto(msg)
        _LAYOUTS.put(key, layout)
    return layout
