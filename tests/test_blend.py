"""The blender on tiny random Llama-family models (llama, qwen2 with biases, qwen3 with q/k
norms, a KVPruner-style pruned llama): re-positioning is exact, ratio 1 is a full prefill,
ratio 0 is plain concatenation, and streamed chunks blend like resident ones."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from kdn.blend import BlendConfig, Piece, blend, concat_positions
from kdn.blend.rope import inv_freq, reposition, rope_plan
from kdn.blend.select import select_tokens
from kdn.cache import KVCache
from kdn.client import Client
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import DType, KVLayout, LayerLayout, RopeSpec
from kdn.model import hf
from kdn.model.hf import model_layout

TOL = dict(atol=2e-5, rtol=1e-4)


def tiny(family: str, seed: int = 0, layers: int = 4, **config: Any) -> Any:
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2,
                  **config)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common),
        "mistral": lambda: tf.MistralConfig(**common),
    }[family]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    if family == "qwen2":  # random biases, so the test shows they are applied
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if family == "qwen3":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.3)
            torch.nn.init.normal_(layer.self_attn.k_norm.weight, 1.0, 0.3)
    return model


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def prefill(model: Any, tokens: list[int], layout: KVLayout, past: KVCache | None = None
            ) -> tuple[KVCache, torch.Tensor]:
    """Transformers' own forward: (KV of everything, last-token logits)."""
    cache = hf.to_transformers(past) if past is not None else None
    out = model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    kv = hf.from_transformers(out.past_key_values, layout)
    return KVCache(layout, [(k.clone(), v.clone()) for k, v in kv.layers]), out.logits[0, -1]


def prompt(model: Any, layout: KVLayout, sizes: tuple[int, ...] = (9, 23, 17, 30, 6)
           ) -> tuple[list[Piece], list[int], list[KVCache]]:
    """text, chunk, chunk, chunk, text; each chunk's KV prefilled alone from position 0."""
    parts = [ids(n, seed=i) for i, n in enumerate(sizes)]
    chunks = [prefill(model, p, layout)[0] for p in parts[1:-1]]
    pieces = [Piece(parts[0])] + [Piece(p, kv) for p, kv in zip(parts[1:-1], chunks)] + [
        Piece(parts[-1])]
    return pieces, [t for p in parts for t in p], chunks


def assert_exact_at_the_ends(model: Any, pieces: list[Piece], all_ids: list[int],
                             layout: KVLayout, **config: Any) -> tuple[KVCache, KVCache]:
    """With ``config``, ratio 1 reproduces a full prefill and ratio 0 plain concatenation;
    returns (full prefill's KV, plain concatenation's KV)."""
    full, logits = prefill(model, all_ids, layout)
    got = blend(model, pieces, BlendConfig(ratio=1.0, **config))
    assert_kv_close(got.kv, full)
    torch.testing.assert_close(got.logits, logits, **TOL)
    naive = blend(model, pieces, BlendConfig(ratio=0.0))
    assert blend(model, pieces, BlendConfig(ratio=0.0, **config)).kv.equal(naive.kv)
    return full, naive.kv


def assert_kv_close(a: KVCache, b: KVCache, **tol: float) -> None:
    for i, ((ka, va), (kb, vb)) in enumerate(zip(a.layers, b.layers)):
        torch.testing.assert_close(ka, kb, **(tol or TOL), msg=lambda m, i=i: f"K{i}: {m}")
        torch.testing.assert_close(va, vb, **(tol or TOL), msg=lambda m, i=i: f"V{i}: {m}")


# -- re-positioning -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_reposition_matches_keys_computed_at_that_position(family: str) -> None:
    model = tiny(family)
    layout = model_layout(model, DType.FLOAT32)
    chunk = ids(20, seed=5)
    at0, _ = prefill(model, chunk, layout)
    delta = 137
    with torch.no_grad():
        out = model(torch.tensor([chunk]), position_ids=torch.arange(delta, delta + 20)[None],
                    use_cache=True)
    there = hf.from_transformers(out.past_key_values, layout)
    freqs = model.model.rotary_emb.inv_freq
    for (k0, v0), (kd, vd) in zip(at0.layers, there.layers):
        plan = rope_plan(None, k0.shape[-1], layout.rope.rotary_dim)
        torch.testing.assert_close(reposition(k0, delta, freqs, plan), kd, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v0, vd, atol=1e-4, rtol=1e-4)
    # moving back undoes it
    plan = rope_plan(None, 16, 16)
    k = there.layers[2][0]
    torch.testing.assert_close(reposition(reposition(k, -delta, freqs, plan), delta, freqs, plan),
                               k, atol=1e-5, rtol=1e-5)


def test_reposition_pruned_channels_equals_full_then_gather() -> None:
    spec = RopeSpec(theta=10000.0, rotary_dim=16)
    freqs = inv_freq(spec)
    full = torch.randn(2, 11, 16, dtype=torch.float64)
    kept = (0, 3, 5, 8, 11, 13)  # pairs (0,8), (3,11), (5,13)
    moved_full = reposition(full, 40, freqs, rope_plan(None, 16, 16))
    moved_kept = reposition(full[..., list(kept)], 40, freqs, rope_plan(kept, 6, 16))
    torch.testing.assert_close(moved_kept, moved_full[..., list(kept)])
    # a channel beyond rotary_dim passes through; a lone rotary channel is refused
    partial = rope_plan((0, 4, 12), 3, 8)
    x = torch.randn(1, 3, 3)
    assert torch.equal(reposition(x, 9, inv_freq(RopeSpec(rotary_dim=8)), partial)[..., 2],
                       x[..., 2])
    with pytest.raises(InvalidLayout):
        rope_plan((0, 3), 2, 16)


def test_concat_positions_places_chunks() -> None:
    layout = KVLayout("m", (LayerLayout(1, 4, 2),), dtype=DType.FLOAT32, head_dim=4,
                      rope=RopeSpec(theta=100.0, rotary_dim=4))
    a = KVCache(layout, [(torch.randn(1, 3, 4), torch.randn(1, 3, 2))])
    b = KVCache(layout, [(torch.randn(1, 5, 4), torch.randn(1, 5, 2))])
    out = concat_positions([a, b], start=2)
    assert out.num_tokens == 8 and out.start_position == 2
    plan = rope_plan(None, 4, 4)
    freqs = inv_freq(layout.rope)
    torch.testing.assert_close(out.layers[0][0][:, 3:], reposition(b.layers[0][0], 5, freqs,
                                                                    plan))
    # a chunk of another layout (RoPE, model) is not re-rotated with the first one's plan
    other = replace(layout, model_fingerprint="n", rope=RopeSpec(theta=5e5, rotary_dim=4))
    c = KVCache(other, b.layers)
    with pytest.raises(InvalidLayout, match="chunk 2's layout .* is not chunk 0's"):
        concat_positions([a, b, c])
    with pytest.raises(InvalidLayout, match="at least one chunk"):
        concat_positions([])


# -- selection ------------------------------------------------------------------------------


def test_select_tokens_budgets() -> None:
    scores = torch.tensor([0.0, 9, 1, 8, 2, 7, 3, 6, 4, 5])
    spans = [(0, 4), (4, 10)]
    assert select_tokens(scores, spans, 0.3).tolist() == [1, 3, 5]
    assert select_tokens(scores, spans, 0.3, head_tokens=1).tolist() == [0, 1, 4]
    assert select_tokens(scores, spans, 0.5, per_chunk=True).tolist() == [1, 3, 5, 7, 9]
    assert select_tokens(scores, spans, 0.0).tolist() == []
    assert select_tokens(scores, spans, 1.0).tolist() == list(range(10))
    # a token recomputed anyway (skip) is passed over: the budget goes to others
    assert select_tokens(scores, spans, 0.3, skip=1).tolist() == [3, 5, 7]
    assert select_tokens(scores, spans, 0.5, per_chunk=True, skip=9).tolist() == [1, 3, 5, 7, 8]
    assert select_tokens(scores, spans, 0.3, head_tokens=1, skip=4).tolist() == [0, 1, 3]
    assert select_tokens(scores, spans, 1.0, skip=9).tolist() == list(range(9))


def test_a_prompt_ending_in_a_chunk_spends_no_budget_on_its_last_token() -> None:
    """The prompt's last token is recomputed anyway (its hidden state gives the logits): the
    selection could also pick it, and one fewer other token was recomputed than
    recomputed_tokens said."""
    model = tiny("llama")
    layout = model_layout(model)
    q, a, b = ids(5, 1), ids(9, 2), ids(11, 3)
    ka, kb = prefill(model, a, layout)[0], prefill(model, b, layout)[0]
    n = len(q) + len(a) + len(b)
    for cfg in (BlendConfig(ratio=0.3), BlendConfig(ratio=0.5),
                BlendConfig(ratio=0.3, query_share=0.0),
                BlendConfig(ratio=0.2, query_share=0.5), BlendConfig(ratio=0.3, per_chunk=True)):
        r = blend(model, [Piece(q), Piece(a, ka), Piece(b, kb)], cfg)
        assert n - 1 not in r.recomputed.tolist(), cfg
        assert len(r.recomputed) == r.timings.recomputed_tokens == round(cfg.ratio * (n - len(q)))


def test_config_checks() -> None:
    with pytest.raises(InvalidArgument):
        BlendConfig(ratio=1.5)
    with pytest.raises(InvalidArgument):
        BlendConfig(select_layer=0)
    with pytest.raises(InvalidArgument, match="query_share"):
        BlendConfig(query_share=-0.1)
    with pytest.raises(InvalidArgument, match="correct_k"):
        BlendConfig(correct_k=1.5)
    with pytest.raises(InvalidArgument, match="correct_v"):
        BlendConfig(correct_v=-0.5)
    # neither a str, None or a bool for a share, nor a fraction of a layer or of a token
    for field, bad in (("ratio", "0.5"), ("ratio", None), ("ratio", True),
                       ("select_layer", 1.5), ("head_tokens", 2.5), ("attention_from", "3"),
                       ("per_chunk", 1)):
        with pytest.raises(InvalidArgument, match=f"{field} must be .*got {bad!r}"):
            BlendConfig(**{field: bad})


def test_the_combination_key_covers_the_stale_correction() -> None:
    """A blend with its stale tokens corrected is other KV: another key. The default's key is
    the one it always was (a stored blend stays a hit)."""
    from kdn.blend.key import combination_key
    pieces = [(b"\x01" * 32, [1, 2]), (b"", [3, 4, 5])]
    default = combination_key(pieces, "lay", BlendConfig(), "default")
    assert default.hex() == "02346d0a53fa02a2db4b23ca1b40426a21566601335010fe2c24a406d8b21b73"
    assert combination_key(pieces, "lay", BlendConfig(correct_k=0.0, correct_v=-0.0),
                           "default") == default
    corrected = {combination_key(pieces, "lay", BlendConfig(correct_k=k, correct_v=v), "default")
                 for k, v in ((0.5, 0.0), (0.0, 0.5), (0.5, 0.5), (1.0, 0.5))}
    assert len(corrected) == 4 and default not in corrected


def test_pieces_and_config_that_are_not_the_models_are_named_before_any_layer() -> None:
    """Ids outside the vocabulary, float ids (1.7, a float tensor or array: never truncated
    to other tokens), a text, a blend longer than the model's context, a dict config or a
    list for a piece: each InvalidArgument naming it. Lists, tuples, integer tensors and
    integer numpy arrays of ids blend alike."""
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    a, q = ids(12, seed=1), ids(5, seed=2)
    chunk, _ = prefill(model, a, layout)
    context = model.config.max_position_embeddings
    for pieces, match in (
            ([Piece(a, chunk), Piece(q[:-1] + [96])],
             r"piece 1: token id 96 is outside the model's vocabulary of 96 \(0..95\), at "
             "token 4"),
            ([Piece(a, chunk), Piece([-1] + q)], "piece 1: token id -1 .*, at token 0"),
            ([Piece(a, chunk), Piece(ids(context - 11, seed=3))],
             f"Blend of {context + 1} tokens exceeds the model's context of {context}"),
            ([Piece(a, chunk), q], "piece 1 must be a kdn.blend.Piece, got list")):
        with pytest.raises(InvalidArgument, match=match):
            blend(model, pieces)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="config must be a kdn.blend.BlendConfig"):
        blend(model, [Piece(a, chunk), Piece(q)], {"ratio": 0.5})  # type: ignore[arg-type]
    for bad, match in (([1.7, 2.0], "token 0 is 1.7, not a token id"),
                       ([3, True], "token 1 is True"),
                       ("hello", "a list of whole numbers, got str"),
                       (torch.tensor([1.0, 2.0]), r"1-D integer tensor, got torch.float32"),
                       (np.array([1.0, 2.0]), r"1-D integer array, got float64"),
                       (torch.tensor([q]), r"1-D integer tensor, got torch.int64 of shape "
                                           r"\[1, 5\]")):
        with pytest.raises(InvalidArgument, match=match):
            Piece(bad)  # type: ignore[arg-type]
    for kv in ("chunk", {"layers": []}, torch.zeros(4)):  # a tensor has a .layout of its own
        with pytest.raises(InvalidArgument, match=f"a piece's kv is a KVCache, a LayerSource .*"
                                                  f"got {type(kv).__name__}"):
            Piece(a, kv)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="pieces must be a list of kdn.blend.Piece, got "
                                              "generator"):
        blend(model, (p for p in [Piece(a, chunk), Piece(q)]))  # type: ignore[arg-type]
    fits = ids(context - 12, seed=3)
    want = blend(model, [Piece(a, chunk), Piece(fits)])
    for same in (torch.tensor(fits), tuple(fits), np.array(fits, np.int32)):
        got = blend(model, [Piece(torch.tensor(a), chunk), Piece(same)])  # type: ignore[arg-type]
        assert got.kv.num_tokens == context and torch.equal(got.logits, want.logits)


def test_correct_stale_shifts_by_the_mean_change_before_rope() -> None:
    """A pre-RoPE key change shared by a chunk's recomputed tokens moves its stale keys by that
    change rotated to each stale position; values move by their mean change; the chunk's
    first token does not count in the mean, and nothing outside the chunks moves. A chunk
    with fewer than two recomputed tokens after its first is left as it is."""
    from kdn.blend.rope import apply_rope, cos_sin
    from kdn.blend.stale import correct_stale, stale_plan

    heads, n, ch = 2, 14, 8
    freqs = inv_freq(RopeSpec(theta=10000.0, rotary_dim=ch))
    cos, sin = (t.float() for t in cos_sin(torch.arange(n), freqs))
    plan = rope_plan(None, ch, ch)
    g = torch.Generator().manual_seed(0)
    k_all, v_all = torch.randn(heads, n, ch, generator=g), torch.randn(heads, n, ch, generator=g)
    # positions 0, 1, 10, 11 are text; chunks at [2, 10) and [12, 14)
    rows = torch.tensor([2, 4, 5, 7, 11, 13])  # 2 is the chunk's first token: not in the mean
    d = torch.randn(heads, 1, ch, generator=g)  # pre-RoPE change shared by 4, 5, 7
    k = k_all[:, rows] + apply_rope(d.expand(-1, 6, -1), cos[rows], sin[rows], plan)
    k[:, 0] += 100.0  # the first token's change must be ignored
    dv = torch.randn(heads, 3, ch, generator=g)  # value changes of 4, 5, 7
    v = v_all[:, rows].clone()
    v[:, 1:4] += dv
    v[:, 0] -= 100.0
    v[:, 5] += 1.0  # the second chunk has one recomputed token after its first: not corrected
    before_k, before_v = k_all.clone(), v_all.clone()
    chunks = stale_plan(rows, [(2, 10), (12, 14)], n)
    assert len(chunks) == 1 and chunks[0].stale.tolist() == [3, 6, 8, 9]
    correct_stale(chunks, k_all, v_all, k, v, cos, sin, plan, correct_k=0.5, correct_v=1.0)
    stale = torch.tensor([3, 6, 8, 9])
    want_k = before_k[:, stale] + 0.5 * apply_rope(d.expand(-1, 4, -1), cos[stale], sin[stale],
                                                   plan)
    torch.testing.assert_close(k_all[:, stale], want_k, **TOL)
    torch.testing.assert_close(v_all[:, stale], before_v[:, stale] + dv.mean(1, keepdim=True),
                               **TOL)
    untouched = torch.tensor([0, 1, 2, 4, 5, 7, 10, 11, 12, 13])
    assert torch.equal(k_all[:, untouched], before_k[:, untouched])
    assert torch.equal(v_all[:, untouched], before_v[:, untouched])


# -- exactness on tiny models -----------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_ratio_one_is_full_prefill(family: str) -> None:
    model = tiny(family)
    layout = model_layout(model, DType.FLOAT32)
    pieces, all_ids, _ = prompt(model, layout)
    full, logits = prefill(model, all_ids, layout)
    calls: list[int] = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: calls.append(int(args[0].shape[-2])))
        for layer in model.model.layers]
    try:
        got = blend(model, pieces, BlendConfig(ratio=1.0))  # the question rule, by default
    finally:
        for h in hooks:
            h.remove()
    assert got.timings.recomputed_tokens == got.timings.cached_tokens == 70
    # every token in one pass through the layers: nothing left for a question pass to rank
    assert calls == [len(all_ids)] * len(model.model.layers)
    assert_kv_close(got.kv, full)
    torch.testing.assert_close(got.logits, logits, **TOL)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ratio_zero_is_concatenation(family: str) -> None:
    model = tiny(family)
    layout = model_layout(model, DType.FLOAT32)
    pieces, all_ids, chunks = prompt(model, layout)
    head, tail = pieces[0].ids, pieces[-1].ids
    sys_kv, _ = prefill(model, head, layout)
    placed = concat_positions(chunks, freqs=model.model.rotary_emb.inv_freq, start=len(head))
    concat = KVCache.concat([sys_kv, placed])
    ref, logits = prefill(model, tail, layout, past=concat)
    got = blend(model, pieces, BlendConfig(ratio=0.0))
    assert got.timings.recomputed_tokens == 0
    assert_kv_close(got.kv, ref)
    torch.testing.assert_close(got.logits, logits, **TOL)
    # recomputing more gets closer to the full prefill
    full, _ = prefill(model, all_ids, layout)

    def err(ratio: float) -> float:
        kv = blend(model, pieces, BlendConfig(ratio=ratio)).kv
        return sum(float((a[1] - b[1]).norm()) for a, b in zip(kv.layers, full.layers))

    assert err(0.6) < err(0.0)


def test_blend_is_deterministic_and_counts_budget() -> None:
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    pieces, _, _ = prompt(model, layout)
    a = blend(model, pieces, BlendConfig(ratio=0.2, head_tokens=2))
    b = blend(model, pieces, BlendConfig(ratio=0.2, head_tokens=2))
    assert torch.equal(a.recomputed, b.recomputed) and a.kv.equal(b.kv)
    assert a.timings.recomputed_tokens == 14  # round(0.2 * 70)
    for start in (9, 32, 49):  # each chunk's first two tokens
        assert {start, start + 1} <= set(a.recomputed.tolist())


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_correction_keeps_the_ends_exact_and_moves_stale_kv(share: float) -> None:
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    pieces, all_ids, _ = prompt(model, layout)
    on = dict(correct_k=1.0, correct_v=1.0, query_share=share)
    # ratio 1: nothing stale, nothing moves; ratio 0: nothing fresh, no change to take
    assert_exact_at_the_ends(model, pieces, all_ids, layout, **on)
    plain = blend(model, pieces, BlendConfig(ratio=0.3, query_share=share))
    fixed = blend(model, pieces, BlendConfig(ratio=0.3, **on))
    assert torch.equal(plain.recomputed, fixed.recomputed)
    stale = torch.ones(85, dtype=torch.bool)
    stale[plain.recomputed] = False
    stale[:9] = stale[79:] = False  # text
    last = len(layout.layers) - 1
    assert not torch.equal(plain.kv.layers[last][1][:, stale], fixed.kv.layers[last][1][:, stale])


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_question_selection_exact_at_the_ends_and_picks_attended_tokens(share: float) -> None:
    model = tiny("qwen3")
    layout = model_layout(model, DType.FLOAT32)
    pieces, all_ids, _ = prompt(model, layout)
    full, naive = assert_exact_at_the_ends(model, pieces, all_ids, layout, query_share=share)
    from kdn.blend.blend import question_attention

    r = blend(model, pieces, BlendConfig(ratio=0.1, query_share=share))
    assert r.timings.recomputed_tokens == 7  # round(0.1 * 70)
    # layer 0's K/V do not depend on context: stored (re-positioned) ones equal the full
    # prefill's, so recomputing from layer 0 only for the picked rows loses nothing there
    for a, b in zip(r.kv.layers[0], full.layers[0]):
        torch.testing.assert_close(a, b, **TOL)

    def err(kv: KVCache) -> float:
        return sum(float((a[1] - b[1]).norm()) for a, b in zip(kv.layers, full.layers))

    assert err(r.kv) < err(naive)
    weights = question_attention(model.model.layers[0], torch.randn(4, 3, 16),
                                 full.layers[0][0], torch.tensor([60, 61, 84]))
    assert weights.sum().item() == pytest.approx(1.0)
    assert weights[85:].abs().sum().item() == 0.0  # causal: nothing after the last query


def test_question_attention_goes_in_blocks_of_bounded_size() -> None:
    """A long question's attention is summed a block of rows at a time (no [heads, rows, ctx]
    matrix of the whole prompt), to the result of one block."""
    from torch.overrides import TorchFunctionMode

    from kdn.blend.blend import question_attention

    class Largest(TorchFunctionMode):
        most = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                Largest.most = max(Largest.most, out.numel())
            return out

    layer = tiny("llama").model.layers[0]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 50, 16, generator=gen), torch.randn(2, 300, 16, generator=gen)
    pos = torch.randperm(300, generator=gen)[:50].sort().values
    whole = question_attention(layer, q, k, pos)
    with Largest():
        blocks = question_attention(layer, q, k, pos, block=4 * 300 * 7)
    assert Largest.most <= 4 * 300 * 16  # the repeated keys; logits of 7 rows at a time
    torch.testing.assert_close(blocks, whole)
    assert blocks.sum().item() == pytest.approx(1.0)


# -- pruned layout ------------------------------------------------------------------------------


def pruned_pair(seed: int = 1) -> tuple[Any, Any, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(reference full model with pruned channels zeroed, pruned model, k_kept, v_kept)."""
    ref = tiny("llama", seed)
    hd, heads, kvh = 16, 4, 2
    k_kept = [tuple(range(16)), (0, 2, 3, 8, 10, 11), (1, 4, 5, 6, 9, 12, 13, 14), (7, 15)]
    v_kept = [tuple(range(16)), (1, 2, 5, 9, 14), tuple(range(4, 16)), (0, 3)]
    pruned = copy.deepcopy(ref)
    for i, (rl, pl) in enumerate(zip(ref.model.layers, pruned.model.layers)):
        kk, vk = list(k_kept[i]), list(v_kept[i])
        q_rows = [h * hd + c for h in range(heads) for c in kk]
        k_rows = [h * hd + c for h in range(kvh) for c in kk]
        v_rows = [h * hd + c for h in range(kvh) for c in vk]
        o_cols = [h * hd + c for h in range(heads) for c in vk]
        with torch.no_grad():
            for name, keep in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows)):
                w = getattr(rl.self_attn, name).weight
                drop = torch.ones(w.shape[0], dtype=torch.bool)
                drop[keep] = False
                w[drop] = 0.0
                lin = torch.nn.Linear(w.shape[1], len(keep), bias=False)
                lin.weight.copy_(w[keep])
                setattr(pl.self_attn, name, lin)
            o = torch.nn.Linear(len(o_cols), 64, bias=False)
            o.weight.copy_(rl.self_attn.o_proj.weight[:, o_cols])
            pl.self_attn.o_proj = o
    pruned.config.kdn_pruned = {"k_kept": [list(k) for k in k_kept],
                                "v_kept": [list(v) for v in v_kept]}
    return ref, pruned, k_kept, v_kept


def test_pruned_model_blends_exactly() -> None:
    ref, pruned, k_kept, v_kept = pruned_pair()
    layout = model_layout(pruned, DType.FLOAT32)
    assert [lay.k_channels for lay in layout.layers] == [16, 6, 8, 2]
    full_layout = model_layout(ref, DType.FLOAT32)

    def gather(kv: KVCache) -> KVCache:  # full-width KV of the zeroed model -> pruned layout
        return KVCache(layout, [(k[..., list(kk)].contiguous(), v[..., list(vk)].contiguous())
                                for (k, v), kk, vk in zip(kv.layers, k_kept, v_kept)])

    parts = [ids(n, seed=10 + i) for i, n in enumerate((5, 21, 14, 8))]
    chunks = [gather(prefill(ref, p, full_layout)[0]) for p in parts[1:3]]
    pieces = [Piece(parts[0]), Piece(parts[1], chunks[0]), Piece(parts[2], chunks[1]),
              Piece(parts[3])]
    full, logits = prefill(ref, [t for p in parts for t in p], full_layout)
    got = blend(pruned, pieces, BlendConfig(ratio=1.0))
    assert_kv_close(got.kv, gather(full))
    torch.testing.assert_close(got.logits, logits, **TOL)
    zero = blend(pruned, pieces, BlendConfig(ratio=0.0))
    placed = concat_positions(chunks, freqs=ref.model.rotary_emb.inv_freq, start=5)
    for i, (k, _) in enumerate(zero.kv.layers):
        torch.testing.assert_close(k[:, 5:40], placed.layers[i][0], **TOL)


# -- streamed chunks ----------------------------------------------------------------------------


def test_streamed_chunks_blend_like_resident(client: Client) -> None:
    model = tiny("qwen2")
    layout = model_layout(model, DType.FLOAT32)
    pieces, _, chunks = prompt(model, layout)
    want = blend(model, pieces, BlendConfig(ratio=0.3))
    streamed = []
    for j, p in enumerate(pieces):
        if p.kv is None:
            streamed.append(p)
            continue
        key = bytes([j]) * 32
        client.store(key, chunks[j - 1], mode="lossless")
        stream = client.retrieve_stream(key, layout=layout)
        assert stream is not None
        streamed.append(Piece(p.ids, stream))
    got = blend(model, streamed, BlendConfig(ratio=0.3))
    assert got.kv.equal(want.kv)
    assert torch.equal(got.logits, want.logits)


# -- continuation -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_continuation_matches_transformers(family: str) -> None:
    from kdn.blend.decode import Continuation

    model = tiny(family)
    layout = model_layout(model, DType.FLOAT32)
    prompt_ids, more = ids(40, seed=1), ids(5, seed=2)
    kv, logits = prefill(model, prompt_ids, layout)
    with torch.no_grad():
        ref = model(torch.tensor([more]), past_key_values=hf.to_transformers(kv)).logits[0]
    got = Continuation(model, kv, room=8).forward(more)
    torch.testing.assert_close(got, ref, **TOL)
    want, cache = [int(logits.argmax())], hf.to_transformers(kv)
    with torch.no_grad():
        for _ in range(5):
            o = model(torch.tensor([[want[-1]]]), past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            want.append(int(o.logits[0, -1].argmax()))
    assert hf.greedy(Continuation(model, kv, room=6), logits, 6) == want


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_chunk_heads_alone_need_no_scoring_pass(share: float) -> None:
    """EPIC's rule (ratio 0, head tokens): each chunk's first tokens are recomputed, selected
    before layer 0 with one pass through the layers (no question pass, no full layers)."""
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    pieces, all_ids, _ = prompt(model, layout)
    calls = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: calls.append(int(args[0].shape[-2])))
        for layer in model.model.layers]
    try:
        heads = blend(model, pieces, BlendConfig(ratio=0.0, head_tokens=3, query_share=share))
        heads_rows = list(calls)
        calls.clear()
        blend(model, pieces, BlendConfig(ratio=0.2, head_tokens=3, query_share=share))
    finally:
        for h in hooks:
            h.remove()
    starts = (9, 32, 49)  # the chunks' first positions
    assert heads.recomputed.tolist() == [s + j for s in starts for j in range(3)]
    # one pass, every layer computing only the text (9 + 6 tokens) and the 9 head tokens
    assert heads_rows == [24] * len(model.model.layers)
    assert sum(calls) > sum(heads_rows)  # a rule that scores computes more rows
    full, _ = prefill(model, all_ids, layout)
    naive = blend(model, pieces, BlendConfig(ratio=0.0)).kv

    def err(kv: KVCache) -> float:
        return sum(float((a[1] - b[1]).norm()) for a, b in zip(kv.layers, full.layers))

    assert err(heads.kv) < err(naive)
    assert heads.timings.recomputed_tokens == 9
