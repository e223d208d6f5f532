"""What the blender refuses, on tiny random models: chunks not of the model (another
pruning, layout or dtype), a chunk source whose layers are not its tokens, and prompts past a
sliding-window model's window (the blender attends over the whole context)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.cache import KVCache
from kdn.errors import InvalidArgument, InvalidLayout, LayoutMismatch
from kdn.layout import DType
from kdn.model import hf
from kdn.model.hf import model_layout
from tests.test_blend import TOL, ids, prefill, pruned_pair, tiny


def test_a_chunk_not_of_the_model_is_refused_before_any_layer() -> None:
    """Only the model's own KV blends: a chunk of another pruning with the same counts (other
    kept channels, another model), one naming the model with other kept channels, an unpruned
    model's, or chunks of two dtypes are a LayoutMismatch naming the piece, raised before any
    layer runs. The result has the model's layout in the chunks' dtype, not a chunk's label."""
    ref, pruned, _, _ = pruned_pair()
    layout = model_layout(pruned, DType.FLOAT32)
    a, q = ids(12, seed=1), ids(5, seed=2)
    g = torch.Generator().manual_seed(3)  # k: [kv_heads, tokens, k_ch], v: [.., v_ch]
    chunk = KVCache(layout, [(torch.randn(x.kv_heads, 12, x.k_channels, generator=g),
                              torch.randn(x.kv_heads, 12, x.v_channels, generator=g))
                             for x in layout.layers])
    other = copy.deepcopy(pruned)  # the same counts per layer, other channels kept
    other.config.kdn_pruned = {
        "k_kept": [list(range(16)), [1, 2, 3, 9, 10, 11], [0, 4, 5, 6, 8, 12, 13, 14], [6, 14]],
        "v_kept": [list(range(16)), [0, 2, 5, 9, 14], list(range(12)), [0, 4]]}
    other_layout = model_layout(other, DType.FLOAT32)
    assert [(x.k_channels, x.v_channels) for x in other_layout.layers] == [
        (x.k_channels, x.v_channels) for x in layout.layers]
    kept = replace(layout, layers=(layout.layers[0], replace(
        layout.layers[1], k_kept=(1, 2, 3, 9, 10, 11)), *layout.layers[2:]))
    half = KVCache(replace(layout, dtype=DType.FLOAT16),
                   [(k.half(), v.half()) for k, v in chunk.layers])
    refused = {
        "piece 1: chunk belongs to model": (pruned, [KVCache(other_layout, chunk.layers)]),
        "piece 1: chunk layer 1 keeps other K channels": (pruned, [KVCache(kept, chunk.layers)]),
        "piece 1: chunk belongs to model ": (ref, [chunk]),
        "piece 2: chunk is float16, piece 1's float32": (pruned, [chunk, half]),
    }
    layers_started: list[str] = []

    def cancelled() -> bool:  # asked before each layer
        layers_started.append(msg)
        return False

    for msg, (model, chunks) in refused.items():
        with pytest.raises(LayoutMismatch, match=msg):
            blend(model, [Piece(q)] + [Piece(a, c) for c in chunks] + [Piece(q)],
                  BlendConfig(ratio=0.0), cancelled=cancelled)
    assert not layers_started  # each refused before layer 0
    labelled = KVCache(replace(layout, model_name="a chunk's own label"), chunk.layers)
    for kv in (labelled, half):
        got = blend(pruned, [Piece(q), Piece(a, kv), Piece(q)], BlendConfig(ratio=0.3))
        assert got.kv.layout == replace(model_layout(pruned), dtype=kv.layout.dtype)
    assert blend(pruned, [Piece(q)]).kv.layout == model_layout(pruned)


def test_a_source_whose_layers_are_not_its_tokens_is_refused() -> None:
    """A LayerSource handing back K/V of another shape than the chunk's (1 token or 1 head
    for 10 tokens: copy_ would broadcast it over them; 5 tokens: a bare RuntimeError), or a
    piece whose ids changed after it was built, is InvalidLayout naming the piece and layer."""
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    a, q = ids(10, seed=1), ids(5, seed=2)
    kv, _ = prefill(model, a, layout)

    class Cut:
        def __init__(self, take: Any) -> None:
            self.layout, self.take = layout, take

        def wait_for_layer(self, i: int, timeout: float | None = None) -> Any:
            return tuple(self.take(t) for t in kv.layers[i])

    for take, match in ((lambda t: t[:, :1], r"piece 1: layer 0's K has shape \(2, 1, 16\), "
                                             r"expected \(2, 10, 16\)"),
                        (lambda t: t[:1], r"piece 1: layer 0's K has shape \(1, 10, 16\)"),
                        (lambda t: t[:, :5], r"piece 1: layer 0's K has shape \(2, 5, 16\)")):
        with pytest.raises(InvalidLayout, match=match):
            blend(model, [Piece(q), Piece(a, Cut(take)), Piece(q)], BlendConfig(ratio=0.15))
    grown = Piece(a, kv)
    grown.ids = a + q
    with pytest.raises(InvalidLayout, match=r"piece 0: layer 0's K has shape \(2, 10, 16\), "
                                            r"expected \(2, 15, 16\)"):
        blend(model, [grown, Piece(q)], BlendConfig(ratio=0.15))


def test_a_sliding_window_is_blended_within_it_and_refused_past_it() -> None:
    """The blender attends over the whole context: a sliding-window model (Mistral's window of
    8) blends and continues a prompt of up to 8 tokens as its own forward does, and refuses a
    longer one (InvalidArgument naming the window); a window no layer uses (Qwen2 below
    max_window_layers) is no window."""
    from kdn.blend.decode import Continuation

    model = tiny("mistral", sliding_window=8)
    layout = model_layout(model, DType.FLOAT32)
    a, q = ids(5, seed=1), ids(3, seed=2)
    chunk, _ = prefill(model, a, layout)
    _, logits = prefill(model, a + q, layout)
    got = blend(model, [Piece(a, chunk), Piece(q)], BlendConfig(ratio=1.0))
    torch.testing.assert_close(got.logits, logits, **TOL)
    with pytest.raises(InvalidArgument, match="Blend of 9 tokens exceeds the model's sliding "
                                              "attention window of 8"):
        blend(model, [Piece(a, chunk), Piece(q + [5])], BlendConfig(ratio=1.0))
    cont = Continuation(model, got.kv, room=4)
    with pytest.raises(InvalidArgument, match="continuation of 9 tokens exceeds .* window of 8"):
        cont.forward([5])
    with pytest.raises(InvalidArgument, match="prompt of 10 tokens exceeds .* window of 8"):
        Continuation(model, KVCache.concat([chunk, chunk]), room=1)
    unused = tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=4)
    assert unused.config.sliding_window == 8
    assert hf.attention_window(unused) is None
    blend(unused, [Piece(ids(20, seed=3))], BlendConfig(ratio=0.0))


def test_select_layer_is_checked_only_by_the_rule_that_reads_it() -> None:
    """The question rule (the default) selects before layer 0 and never reads select_layer,
    yet a 1-layer model was refused "select_layer 1 >= 1 layers" with the default config; the
    deviation rule, which selects at that layer, is still refused past the last layer."""
    model = tiny("llama", layers=1)
    a, q = ids(8, 1), ids(4, 2)
    ka = prefill(model, a, model_layout(model))[0]
    r = blend(model, [Piece(a, ka), Piece(q)], BlendConfig(ratio=0.25))
    assert len(r.recomputed) == 2
    blend(model, [Piece(a, ka), Piece(q)], BlendConfig(ratio=0.0, head_tokens=2))  # EPIC's
    with pytest.raises(InvalidArgument, match="select_layer 1 >= 1 layers"):
        blend(model, [Piece(a, ka), Piece(q)], BlendConfig(ratio=0.25, query_share=0.0))
