"""The key a blended prompt is stored under: a hash of its pieces and of how it was blended.

Pieces are named by what determines their KV: a chunk by its ``chunk_key`` (which covers its
tokens, the layout and the namespace), text by its token ids. The blend settings and the
encoding are part of the key, so a different ratio or codec never reads another's result.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kdn.blend.blend import BlendConfig
from kdn.keys import KEY_BYTES, check_namespace


def combination_key(pieces: Sequence[tuple[bytes, Sequence[int]]], layout_fingerprint: str,
                    config: BlendConfig, namespace: str, encoding: str = "lossless") -> bytes:
    """Key of the blend of ``pieces`` [(chunk_key or b"" for text, token ids), ...]."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)

    def part(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    part(b"kdn/blend/v2")
    part(check_namespace(namespace).encode())
    part(layout_fingerprint.encode())
    part(struct.pack("<dI?IdI", config.ratio, config.select_layer, config.per_chunk,
                     config.head_tokens, config.query_share, config.attention_from))
    part(encoding.encode())
    for key, ids in pieces:
        part(b"chunk" if key else b"text")
        part(bytes(key) if key else struct.pack(f"<{len(ids)}i", *ids))
    if config.correct_k or config.correct_v:  # after the pieces, so keys without it stay
        part(b"correct")
        part(struct.pack("<dd", config.correct_k, config.correct_v))
    return h.digest()
