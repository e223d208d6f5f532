"""KVPruner on a tiny random Llama (GQA: 4 query heads, 2 KV heads, head_dim 16): allocation
rules, exact integer budgets, rotary-pair exactness against a zeroed unpruned model, save/load,
the pruned layout, and the pruned KV through the codec, a real gRPC server and the blender."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec import decode, encode
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import DType, KVLayout
from kdn.model import hf
from kdn.model.hf import model_layout
from kdn.prune import (
    Allocation,
    Geometry,
    Importance,
    PruneConfig,
    PrunedAttention,
    PrunePlan,
    block_ratios,
    block_sensitivity,
    channel_scores,
    kvprune,
    load_pruned,
    make_plan,
    prune_model,
    removal_counts,
    save_pruned,
    zero_pruned_channels,
)

HD, LAYERS = 16, 4
TOL = dict(atol=2e-5, rtol=1e-4)


def tiny(seed: int = 0, family: str = "llama") -> Any:
    import transformers as tf

    cfg_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family]
    cfg = cfg_cls(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=HD,
                  max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    if family == "qwen2":  # random biases, so slicing them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def random_plan(seed: int = 0) -> PrunePlan:
    """Different K and V channel counts in every layer."""
    g = torch.Generator().manual_seed(seed)
    pairs, vs = [0, 3, 5, 7], [0, 9, 2, 14]
    kk, vk = [], []
    for i in range(LAYERS):
        low = sorted(torch.randperm(HD // 2, generator=g)[pairs[i]:].tolist())
        kk.append(tuple(low + [c + HD // 2 for c in low]))
        vk.append(tuple(sorted(torch.randperm(HD, generator=g)[vs[i]:].tolist())))
    return PrunePlan(HD, tuple(kk), tuple(vk))


# -- allocation --------------------------------------------------------------------------------


def test_ppl_rule_mean_cap_and_order() -> None:
    deltas = [0.01, 0.5, 2.0, 0.0, 5.0, 0.1]
    r = block_ratios("ppl-based", 0.4, 6, deltas, cap=0.7)
    assert sum(r) / 6 == pytest.approx(0.4)
    assert max(r) <= 0.7 + 1e-12
    order = sorted(range(6), key=lambda i: deltas[i])
    assert all(r[a] >= r[b] - 1e-12 for a, b in zip(order, order[1:]))  # less sensitive: more
    # uncapped blocks keep the rule's proportions 1 / (e^d + eps)
    free = [i for i in range(6) if r[i] < 0.7 - 1e-9]
    w = [1 / (torch.tensor(deltas[i]).exp().item() + 1e-6) for i in free]
    assert [r[i] / r[free[0]] for i in free] == pytest.approx([x / w[0] for x in w])


def test_rank_rule_prunes_least_sensitive_blocks_only() -> None:
    deltas = [0.3, 0.01, 2.0, 0.02, 5.0, 0.1, 1.0, 0.5, 0.05, 3.0]
    r = block_ratios("rank-based", 0.2, 10, deltas, cap=1.0)
    assert sorted(i for i, x in enumerate(r) if x > 0) == [1, 3]  # ceil(0.2 * 10) blocks
    r = block_ratios("rank-based", 0.2, 10, deltas, cap=0.6)
    assert sum(r) == pytest.approx(2.0) and [i for i, x in enumerate(r) if x > 0] == [1, 3, 5, 8]
    assert block_ratios("uniform", 0.2, 4) == [0.2] * 4
    with pytest.raises(InvalidArgument):
        block_ratios("ppl-based", 0.2, 4)


def test_removal_counts_are_exact() -> None:
    assert removal_counts([0.2] * 30, 32) == removal_counts([0.2] * 30, 32)
    assert sum(removal_counts([0.2] * 30, 32)) == 192
    counts = removal_counts([0.05, 0.9, 0.3, 0.35], 8, total=13, max_per_block=6)
    assert sum(counts) == 13 and max(counts) <= 6
    with pytest.raises(InvalidArgument):
        removal_counts([0.9, 0.9], 4, total=8)


# -- the pruned model --------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pruned_equals_zeroed_unpruned(family: str) -> None:
    """Rotary pairs keep their frequencies and the original scale: exact logits, exact KV."""
    model = tiny(1, family)
    plan = random_plan(1)
    ref = copy.deepcopy(model)
    zero_pruned_channels(ref, plan)
    pruned = prune_model(copy.deepcopy(model), plan)
    x = ids(40, 1)
    with torch.no_grad():
        a = ref(x[None], use_cache=True)
        b = pruned(x[None], use_cache=True)
    torch.testing.assert_close(b.logits, a.logits, **TOL)
    layout = model_layout(pruned, DType.FLOAT32)
    kv_ref = hf.from_transformers(a.past_key_values, model_layout(ref, DType.FLOAT32))
    kv = hf.from_transformers(b.past_key_values, layout)
    for (kr, vr), (k, v), kk, vk in zip(kv_ref.layers, kv.layers, plan.k_kept, plan.v_kept):
        torch.testing.assert_close(k, kr[..., list(kk)], **TOL)
        torch.testing.assert_close(v, vr[..., list(vk)], **TOL)
    # decoding on top of the pruned cache (positions > 0) stays exact too
    with torch.no_grad():
        ga = ref.generate(x[None], max_new_tokens=8, do_sample=False)
        gb = pruned.generate(x[None], max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


def test_sdpa_matches_eager() -> None:
    pruned = prune_model(tiny(2), random_plan(2))
    x = ids(30, 2)
    with torch.no_grad():
        eager = pruned(x[None]).logits
        pruned.config._attn_implementation = "sdpa"
        sdpa = pruned(x[None]).logits
    torch.testing.assert_close(sdpa, eager, **TOL)


def test_plan_rejects_broken_rotary_pairs_and_double_pruning() -> None:
    every = tuple(range(HD))
    with pytest.raises(InvalidLayout):
        PrunePlan(HD, ((0, 1, 8),) + (every,) * 3, (every,) * 4)
    with pytest.raises(InvalidLayout):
        PrunePlan(HD, ((0, 1, 8, 10),) + (every,) * 3, (every,) * 4)
    model = prune_model(tiny(), random_plan())
    with pytest.raises(InvalidArgument):
        prune_model(model, random_plan())


@pytest.mark.parametrize("importance", list(Importance))
def test_importance_scores_shapes_and_gqa_sum(importance: Importance) -> None:
    model = tiny(3)
    s = channel_scores(model, importance, ids(32, 3))
    assert s.k.shape == (LAYERS, HD) and s.v.shape == (LAYERS, HD)
    assert s.pair_scores().shape == (LAYERS, HD // 2)
    assert bool((s.k > 0).all()) and bool((s.v > 0).all())
    assert all(p.grad is None for p in model.parameters())
    if importance is Importance.L1:  # K channel c: mean of normalised q and k row sums
        attn = model.model.layers[0].self_attn
        q = attn.q_proj.weight.abs().sum(1).view(4, HD).sum(0).double()
        k = attn.k_proj.weight.abs().sum(1).view(2, HD).sum(0).double()
        torch.testing.assert_close(s.k[0], (q / q.mean() + k / k.mean()) / 2)


def test_one_shot_pipeline_bytes_fall_exactly_and_layout_records_kept() -> None:
    model = tiny(4)
    calib = ids(48, 4)
    full = model_layout(model, DType.FLOAT16)
    scores = channel_scores(model, "l2")
    sens = block_sensitivity(model, calib, scores, 0.25)
    assert len(sens.delta_ppl) == LAYERS and sens.base_ppl > 1
    geo = Geometry.of(model)
    for allocation in Allocation:
        cfg = PruneConfig(0.25, allocation, "l2")
        plan, ratios = make_plan(geo, scores, cfg, sens)
        assert sum(ratios) / LAYERS == pytest.approx(0.25)
        assert plan.kept_fraction() == pytest.approx(0.75)
    result = kvprune(model, calib, PruneConfig(0.25, "ppl-based", "taylor"))
    layout = model_layout(result.model, DType.FLOAT16)
    assert layout.bytes_per_token == full.bytes_per_token * 3 // 4
    assert [lay.k_kept for lay in layout.layers] == list(result.plan.k_kept)
    assert [lay.v_kept for lay in layout.layers] == list(result.plan.v_kept)
    assert isinstance(result.model.model.layers[0].self_attn, PrunedAttention)
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * HD  # original untouched
    assert layout.fingerprint != full.fingerprint


def test_k_share_moves_the_removal_between_keys_and_values() -> None:
    model = tiny(5)
    calib = ids(48, 5)
    scores = channel_scores(model, "l2")
    sens = block_sensitivity(model, calib, scores, 0.25)
    geo = Geometry.of(model)
    total = 2 * HD * LAYERS

    def removed(plan: PrunePlan) -> tuple[int, int]:
        return (sum(HD - len(k) for k in plan.k_kept), sum(HD - len(v) for v in plan.v_kept))

    even, _ = make_plan(geo, scores, PruneConfig(0.25, "ppl-based", "l2"), sens)
    keys, _ = make_plan(geo, scores, PruneConfig(0.25, "ppl-based", "l2", k_share=0.75), sens)
    assert removed(even) == (total // 8, total // 8)  # the default: K and V alike
    assert removed(keys) == (3 * total // 16, total // 16)  # same bytes, three quarters from K
    assert keys.kept_fraction() == pytest.approx(0.75)
    only_v, _ = make_plan(geo, scores, PruneConfig(0.25, "uniform", "l2", k_share=0.0), sens)
    assert removed(only_v) == (0, total // 4)
    result = kvprune(model, calib, PruneConfig(0.25, "ppl-based", "l2", k_share=0.75))
    layout = model_layout(result.model, DType.FLOAT16)
    assert layout.bytes_per_token == model_layout(model, DType.FLOAT16).bytes_per_token * 3 // 4
    for bad in (-0.1, 1.5):
        with pytest.raises(InvalidArgument, match="k_share"):
            PruneConfig(0.25, k_share=bad)
    with pytest.raises(InvalidArgument, match="keep some"):
        PruneConfig(0.6, k_share=0.9)  # K's ratio 1.08


def test_a_k_share_that_scales_a_block_past_whole_is_capped_not_refused() -> None:
    """K's part of the ratio over the ratio (here 0.6 / 0.4) scaled a sensitive-free block's
    ratio past 1, which removal_counts refuses: a valid PruneConfig raised InvalidArgument.
    The block is capped instead, and K and V still remove their whole parts."""
    from kdn.prune.importance import ChannelScores
    from kdn.prune.sensitivity import Sensitivity

    geo = Geometry(layers=4, heads=2, kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    scores = ChannelScores(Importance.L2, torch.rand(4, 16, generator=g, dtype=torch.float64),
                           torch.rand(4, 16, generator=g, dtype=torch.float64))
    sens = Sensitivity(ratio=0.4, base_ppl=10.0, delta_ppl=(0.1, 0.2, 0.3, 5.0))
    plan, _ = make_plan(geo, scores, PruneConfig(0.4, "rank-based", k_share=0.75), sens)
    k_removed = sum(16 - len(k) for k in plan.k_kept)  # in pairs of channels
    v_removed = sum(16 - len(v) for v in plan.v_kept)
    assert (k_removed, v_removed) == (2 * round(0.6 * 4 * 8), round(0.2 * 4 * 16))


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = prune_model(tiny(5), random_plan(5))
    folder = save_pruned(model, tmp_path / "pruned")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["kdn_pruned"]["k_kept"] == [list(k) for k in random_plan(5).k_kept]
    loaded = load_pruned(folder)
    x = ids(24, 5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x[None]).logits, model(x[None]).logits, atol=0, rtol=0)
    a = KVLayout.from_config(model.config)
    b = KVLayout.from_config(loaded.config)
    assert a.layers == b.layers and a.fingerprint == b.fingerprint
    with pytest.raises(InvalidLayout):
        load_pruned(_save_plain(tiny(), tmp_path / "plain"))


def _save_plain(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


# -- end to end: codec, server, blend ----------------------------------------------------------


def _pruned_kv(dtype: DType = DType.FLOAT16, tokens: int = 48) -> tuple[Any, KVCache]:
    model = prune_model(tiny(6), random_plan(6))
    layout = model_layout(model, DType.FLOAT32)
    with torch.no_grad():
        out = model(ids(tokens, 6)[None], use_cache=True)
    kv = hf.from_transformers(out.past_key_values, layout)
    target = model_layout(model, dtype)
    return model, KVCache(target, [(k.to(dtype.torch).clone(), v.to(dtype.torch).clone())
                                   for k, v in kv.layers])


@pytest.mark.parametrize("mode,level", [("raw", ""), ("lossless", ""), ("int8", ""),
                                        ("cachegen", ""), ("kdn", "default"), ("kdn", "tiny")])
def test_codec_round_trip_of_pruned_kv(mode: str, level: str) -> None:
    _, kv = _pruned_kv()
    out = decode(encode(kv, mode, level))
    assert out.layout == kv.layout
    if mode in ("raw", "lossless"):
        assert out.equal(kv)
        return
    for (k, v), (k2, v2) in zip(kv.layers, out.layers):
        assert k2.shape == k.shape and v2.shape == v.shape
        rel = ((k2.float() - k.float()).norm() / k.float().norm()).item()
        assert rel < 0.5


def test_store_retrieve_pruned_kv_through_server(client: Client) -> None:
    _, kv = _pruned_kv()
    for i, (mode, level) in enumerate((("lossless", ""), ("kdn", "default"))):
        key = bytes([i + 1]) * 32
        client.store(key, kv, mode=mode, level=level)
        got = client.retrieve(key, layout=kv.layout)
        assert got is not None and got.layout == kv.layout
        if mode == "lossless":
            assert got.equal(kv)
        else:
            assert got.equal(decode(encode(kv, mode, level)))
        assert [k.shape[-1] for k, _ in got.layers] == [len(c) for c in random_plan(6).k_kept]


def test_blend_on_pruned_model_equals_prefill() -> None:
    from kdn.blend import BlendConfig, Piece, blend

    model = kvprune(tiny(7), ids(32, 7), PruneConfig(0.3, "rank-based", "l1")).model
    layout = model_layout(model, DType.FLOAT32)
    parts = [ids(n, 20 + i).tolist() for i, n in enumerate((5, 19, 13, 7))]

    def prefill(tokens: list[int]) -> tuple[KVCache, torch.Tensor]:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), use_cache=True)
        kv = hf.from_transformers(out.past_key_values, layout)
        return KVCache(layout, [(k.clone(), v.clone()) for k, v in kv.layers]), out.logits[0, -1]

    chunks = [prefill(p)[0] for p in parts[1:3]]
    pieces = [Piece(parts[0]), Piece(parts[1], chunks[0]), Piece(parts[2], chunks[1]),
              Piece(parts[3])]
    full, logits = prefill([t for p in parts for t in p])
    got = blend(model, pieces, BlendConfig(ratio=1.0))
    for (k, v), (k2, v2) in zip(got.kv.layers, full.layers):
        torch.testing.assert_close(k, k2, **TOL)
        torch.testing.assert_close(v, v2, **TOL)
    torch.testing.assert_close(got.logits, logits, **TOL)
    partial = blend(model, pieces, BlendConfig(ratio=0.2))
    assert partial.kv.layout == layout
