"""Encode KV caches into kdn containers and back. Pure functions; one serde path.

    blob = encode(kv, mode="lossless")                 # bytes: header + frames
    kv2  = decode(blob)                                # KVCache (checksums verified)

    parts = encode_parts(kv, mode, level)              # header bytes + list of frame bytes
    dec = StreamDecoder(parts.header)                  # streaming: one frame at a time
    for i, frame in enumerate(parts.frames):
        for layer, k, v in dec.decode_frame(i, frame): ...

Frames hold ``layers_per_frame`` consecutive layers (0: enough to fill ``FRAME_TARGET_BYTES``, so
small layers do not each pay a wire message) and decode independently. Per-layer work runs on
a small thread pool (torch ops and zstd release the GIL).

Two sides: the container format (``kdn.codec.format``: headers, frames, checksums, the server's
validation) needs no torch and is what the storage server imports; the tensor side
(``kdn.codec.api``: encode, decode, the modes) loads torch, and is imported on first use of one
of its names from this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kdn.codec.format import Container, EncodedParts, Header, parse_container, parse_header

if TYPE_CHECKING:
    from kdn.codec.api import (
        FRAME_TARGET_BYTES,
        StreamDecoder,
        decode,
        encode,
        encode_parts,
        frame_spans,
        mode_names,
    )

__all__ = [
    "FRAME_TARGET_BYTES",
    "Container",
    "EncodedParts",
    "Header",
    "StreamDecoder",
    "decode",
    "encode",
    "encode_parts",
    "frame_spans",
    "mode_names",
    "parse_container",
    "parse_header",
]

_TENSOR_SIDE = {"FRAME_TARGET_BYTES", "StreamDecoder", "decode", "encode", "encode_parts",
                "frame_spans", "mode_names", "get_mode", "_pool", "layer_spec"}


def __getattr__(name: str) -> Any:
    if name in _TENSOR_SIDE:
        from kdn.extras import model_side

        with model_side(f"kdn.codec.{name}"):
            from kdn.codec import api

        return getattr(api, name)
    import importlib.util

    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: as Python
        return importlib.import_module(f"{__name__}.{name}")  # binds it once imported
    raise AttributeError(f"module 'kdn.codec' has no attribute {name!r}")
