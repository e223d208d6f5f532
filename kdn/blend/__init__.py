"""The blender: compose KV caches of chunks computed alone (CacheBlend-style selective recompute).

    from kdn.blend import BlendConfig, Piece, blend
    result = blend(model, [Piece(sys_ids), Piece(c1_ids, kv1), Piece(c2_ids, stream2),
                           Piece(question_ids)], BlendConfig(ratio=0.15))
    result.kv          # KVCache of the whole prompt (positions from 0)
    result.logits      # next-token logits

``rope`` re-positions stored keys, ``select`` picks the tokens to recompute, ``layer`` runs a
decoder layer for a subset of tokens, ``blend`` is the layer-by-layer loop.
"""

from kdn.extras import model_side

with model_side("kdn.blend"):  # kdn[model] not installed: MissingExtra
    from kdn.blend.blend import (
        BlendConfig,
        BlendResult,
        BlendTimings,
        LayerSource,
        Piece,
        Resident,
        blend,
        concat_positions,
    )

__all__ = [
    "BlendConfig",
    "BlendResult",
    "BlendTimings",
    "LayerSource",
    "Piece",
    "Resident",
    "blend",
    "concat_positions",
]
