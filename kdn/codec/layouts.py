"""Layouts in the container's header: ``KVLayout`` to and from its proto message, and the
bounded memo that keeps parsing a model's (always identical) layout cheap."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kdn.layout import DType, KVLayout, LayerLayout, RopeSpec
from kdn.v1 import kdn_pb2 as pb


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
