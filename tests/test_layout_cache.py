"""KVLayout and KVCache: construction, validation, fingerprints, transformers conversion."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kdn import checks, codec
from kdn.cache import KVCache
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import DType, KVLayout, LayerLayout, _channels
from kdn.model import hf
from tests.helpers import pruned_layout, random_kv, uniform_layout


def tiny_config(**kw: object) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=50000.0)
    base.update(kw)
    return LlamaConfig(**base)


def test_from_config_reads_gqa_and_rope() -> None:
    lay = KVLayout.from_config(tiny_config())
    assert lay.num_layers == 3
    assert all(x.kv_heads == 2 and x.k_channels == 16 and x.v_channels == 16 for x in lay.layers)
    assert lay.head_dim == 16 and lay.rope.rotary_dim == 16 and lay.rope.theta == 50000.0
    assert lay.bytes_per_token == 3 * 2 * (16 + 16) * 2


def test_fingerprint_depends_on_what_matters() -> None:
    a = KVLayout.from_config(tiny_config())
    assert a.fingerprint == KVLayout.from_config(tiny_config()).fingerprint
    assert a.fingerprint != KVLayout.from_config(tiny_config(num_hidden_layers=4)).fingerprint
    assert a.fingerprint != KVLayout.from_config(tiny_config(), dtype=torch.bfloat16).fingerprint
    assert a.fingerprint != KVLayout.from_config(tiny_config(), weights_id="ft-1").fingerprint
    assert a.fingerprint != KVLayout.from_config(tiny_config(rope_theta=1e4)).fingerprint


def test_fingerprint_is_stable_across_processes() -> None:
    code = ("from tests.helpers import pruned_layout; print(pruned_layout().fingerprint)")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {pruned_layout().fingerprint}


def test_pruned_layout_from_config_extension() -> None:
    cfg = tiny_config()
    cfg.kdn_pruned = {"k_kept": [[0, 1, 8, 9], list(range(16)), [2, 10]],
                      "v_kept": [list(range(8)), [1], list(range(16))]}
    lay = KVLayout.from_config(cfg)
    assert [x.k_channels for x in lay.layers] == [4, 16, 2]
    assert [x.v_channels for x in lay.layers] == [8, 1, 16]
    assert lay.layers[0].k_kept == (0, 1, 8, 9)


def test_a_pruned_config_lists_each_layer_and_keeps_whole_rotary_pairs() -> None:
    """``kdn_pruned`` must list K and V kept channels for every layer, no more, and keep each
    rotary K channel with its RoPE partner (c, c + rotary_dim/2): otherwise InvalidLayout
    naming the problem, not an IndexError, a layout of the first layers only, or one the
    blender refuses later. Channels past a partial rotary_dim need no partner."""
    pairs = [[0, 8], [1, 9], [2, 10]]
    bad = {
        "kdn_pruned lists k_kept for 1 layers, the model has 3":
            {"k_kept": pairs[:1], "v_kept": [[1]] * 3},
        "kdn_pruned lists v_kept for 5 layers, the model has 3":
            {"k_kept": pairs, "v_kept": [[1]] * 5},
        "layer 1: kdn_pruned k_kept keeps rotary channel 1 without its RoPE partner 9":
            {"k_kept": [[0, 8], [1, 2, 10], [3, 11]], "v_kept": [[1]] * 3},
        "layer 0: kdn_pruned k_kept keeps rotary channel 12 without its RoPE partner 4":
            {"k_kept": [[12], [1, 9], [3, 11]], "v_kept": [[1]] * 3},
        "malformed kdn_pruned: no v_kept": {"k_kept": pairs},
        "malformed kdn_pruned: k_kept layer 0 holds 'a'": {"k_kept": [["a", "b"]] * 3,
                                                           "v_kept": [[1]] * 3},
        "malformed kdn_pruned: k_kept layer 1 holds 9.0": {"k_kept": [[0, 8], [1, 9.0], [2, 10]],
                                                           "v_kept": [[1]] * 3},
        "malformed kdn_pruned: v_kept must list": {"k_kept": pairs, "v_kept": None},
    }
    for msg, pruned in bad.items():
        cfg = tiny_config()
        cfg.kdn_pruned = pruned
        with pytest.raises(InvalidLayout, match=msg):
            KVLayout.from_config(cfg)
    cfg = tiny_config(partial_rotary_factor=0.5)  # channels 0..7 rotate, in pairs (c, c + 4)
    cfg.kdn_pruned = {"k_kept": [[0, 4, 9], [1, 5, 8, 15], [2, 6]], "v_kept": [[1]] * 3}
    lay = KVLayout.from_config(cfg)
    assert lay.rope.rotary_dim == 8 and [x.k_channels for x in lay.layers] == [3, 4, 2]


@pytest.mark.parametrize("bad", [
    dict(kv_heads=0, k_channels=4, v_channels=4),
    dict(kv_heads=True, k_channels=4, v_channels=4),
    dict(kv_heads=1, k_channels=4, v_channels=4, k_kept=(0, 1, 2)),
    dict(kv_heads=1, k_channels=2, v_channels=4, k_kept=(1, 0)),
    dict(kv_heads=1, k_channels=2, v_channels=4, k_kept=(0.0, 1.0)),
    dict(kv_heads=1, k_channels=2, v_channels=4, k_kept="01"),
    dict(kv_heads=1, k_channels=2, v_channels=4, k_kept=(False, True)),
])
def test_layer_layout_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(InvalidLayout):
        LayerLayout(**bad)


def test_kept_channels_of_any_integer_kind_make_one_layout() -> None:
    """Indices from numpy (``np.flatnonzero(mask)``), 0-d tensors or a list are the layout
    of Python ints: one fingerprint (one key), and entries that decode (their fingerprint
    written one way, checked another, was refused as a damaged header)."""
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 0], dtype=bool)
    ints = KVLayout("m", (LayerLayout(2, 4, 4, (0, 2, 3, 6), None),), head_dim=8)
    for kept in (tuple(np.flatnonzero(mask)), [0, 2, 3, 6],
                 tuple(torch.tensor([0, 2, 3, 6]))):
        lay = KVLayout("m", (LayerLayout(2, 4, 4, kept, None),), head_dim=8)  # type: ignore[arg-type]
        assert lay == ints and lay.fingerprint == ints.fingerprint
        assert hash(lay) == hash(ints)
        kv = random_kv(lay, 3)
        assert codec.decode(codec.encode(kv, "raw")).equal(kv)


def test_a_0d_bool_tensor_is_no_count_channel_position_or_token() -> None:
    """torch.tensor(True) has __index__ (1): it was taken as 1 head, channel 1, position 1
    and token 1 where True and numpy's bools are refused."""
    yes, no = torch.tensor(True), torch.tensor(False)
    for bad in (dict(kv_heads=yes, k_channels=4, v_channels=4),
                dict(kv_heads=1, k_channels=2, v_channels=4, k_kept=(no, yes))):
        with pytest.raises(InvalidLayout, match="got"):
            LayerLayout(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidLayout, match="malformed kdn_pruned: .* holds tensor.True."):
        _channels("k_kept", [0, yes])
    lay = uniform_layout(layers=1)
    with pytest.raises(InvalidLayout, match=r"start_position must be a whole number .*tensor"):
        KVCache(lay, random_kv(lay, 2).layers, yes)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ids: token 1 is tensor.True., not a token id"):
        checks.token_ids([torch.tensor(3), yes], "ids")
    assert checks.token_ids([torch.tensor(3), np.int64(4)], "ids") == [3, 4]
    assert LayerLayout(torch.tensor(2), 4, 4).kv_heads == 2  # type: ignore[arg-type]


def test_a_layout_hashes_alike_in_another_process() -> None:
    """The cached hash does not travel with a layout's state (what a multiprocessing queue
    sends: a string's hash is salted per process): it is computed again where it lands."""
    import copy

    lay = pruned_layout()
    hash(lay)
    assert "_hash" not in lay.__getstate__() and "_hash" not in copy.deepcopy(lay).__dict__


def test_kept_channels_must_fit_head_dim() -> None:
    with pytest.raises(InvalidLayout, match="head_dim"):
        KVLayout("m", (LayerLayout(1, 2, 2, (0, 20), None),), head_dim=16)


def test_roundtrip_dict() -> None:
    lay = pruned_layout(DType.BFLOAT16)
    assert KVLayout.from_dict(lay.to_dict()) == lay


def test_cache_validates_shapes_and_dtype() -> None:
    lay = uniform_layout(layers=2)
    good = random_kv(lay, 5)
    with pytest.raises(InvalidLayout, match="layer 1"):
        KVCache(lay, [good.layers[0], (good.layers[1][0][:, :, :8], good.layers[1][1])])
    with pytest.raises(InvalidLayout, match="tokens"):
        KVCache(lay, [good.layers[0], (good.layers[1][0][:, :3], good.layers[1][1][:, :3])])
    with pytest.raises(InvalidLayout, match="dtype"):
        KVCache(lay, [(k.float(), v.float()) for k, v in good.layers])
    with pytest.raises(InvalidLayout, match="layers"):
        KVCache(lay, good.layers[:1])


def test_a_cache_holds_dense_tensors_each_layers_pair_on_one_device() -> None:
    """A sparse K or V made a valid cache, and the codec failed a raw RuntimeError
    ('unsupported memory format option Contiguous') or NotImplementedError ('aten::amax')."""
    lay = uniform_layout(layers=2)
    good = random_kv(lay, 5)
    k1, v1 = good.layers[1]
    dense = r"layer 1: K and V must be dense \(torch.strided\) tensors, got "
    for layer1, match in (((k1.to_sparse(), v1), dense + "torch.sparse_coo/torch.strided"),
                          ((k1, v1.to_sparse_csr()), dense + "torch.strided/torch.sparse_csr"),
                          ((k1, v1.to("meta")), "layer 1: K is on cpu, V on meta; a layer's K "
                                                "and V are on one device")):
        with pytest.raises(InvalidLayout, match=match):
            KVCache(lay, [good.layers[0], layer1])
    mixed = KVCache(lay, [good.layers[0], (k1.to("meta"), v1.to("meta"))])  # layers may differ
    assert mixed.layers[1][0].device.type == "meta"


def test_a_cache_of_what_is_not_tensors_or_of_a_position_that_is_not_whole_is_named() -> None:
    """numpy arrays (named as numpy, with the torch.from_numpy hint), lists, a (K, V, x)
    triple, a layout given as a str, and a start_position of 1.5, True or 2**70: each
    refused when the cache is made, naming what is wrong."""
    lay = uniform_layout(layers=2)
    good = random_kv(lay, 5)
    k0, v0 = good.layers[0]
    bad_layers = [
        ([(k0.numpy(), v0.numpy()), good.layers[1]],
         r"layer 0: K and V must be torch tensors, got ndarray and ndarray \(a numpy array: "
         r"torch.from_numpy\(it\)\)"),
        ([good.layers[0], (k0.tolist(), v0)], "layer 1: K and V must be torch tensors, got list"),
        ([(k0, v0, v0), good.layers[1]], "layer 0 must be a .K, V. pair of tensors, got tuple "
                                         "of 3"),
        ([good.layers[0], (k0,)], "layer 1 must be a .K, V. pair of tensors, got tuple of 1"),
        ([good.layers[0], 3], "layer 1 must be a .K, V. pair of tensors, got int"),
    ]
    for layers, match in bad_layers:
        with pytest.raises(InvalidLayout, match=match):
            KVCache(lay, layers)  # type: ignore[arg-type]
    with pytest.raises(InvalidLayout, match="layers must be a list of .K, V. pairs"):
        KVCache(lay, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidLayout, match="layout must be a KVLayout, got str"):
        KVCache("test-model", good.layers)  # type: ignore[arg-type]
    for position in (1.5, True, -1, 2**70, "3"):
        with pytest.raises(InvalidLayout, match=r"start_position must be a whole number in "
                           rf"\[0, 2\*\*63\), got {position!r}"):
            KVCache(lay, good.layers, position)  # type: ignore[arg-type]
    good.start_position = 2.5  # type: ignore[assignment]  # set after it was made
    with pytest.raises(InvalidLayout, match="got 2.5"):
        codec.encode(good)
    for whole in (torch.tensor(7), np.int64(7), 7):
        kv = KVCache(lay, good.layers, whole)  # type: ignore[arg-type]
        assert type(kv.start_position) is int and kv.start_position == 7
        assert codec.decode(codec.encode(kv, mode="raw")).equal(kv)


def test_slice_and_concat() -> None:
    kv = random_kv(pruned_layout(), 20, start=7)
    a, b = kv[:12], kv.slice(12)
    assert a.num_tokens == 12 and b.num_tokens == 8 and b.start_position == 19
    assert a.layers[0][0].data_ptr() == kv.layers[0][0].data_ptr()  # a view, not a copy
    assert KVCache.concat([a, b]).equal(kv)
    with pytest.raises(InvalidLayout):
        kv.slice(5, 30)
    with pytest.raises(InvalidLayout, match="different layouts"):
        KVCache.concat([a, random_kv(uniform_layout(), 3)])


def test_concat_takes_any_iterable_on_one_device_and_equal_any_object() -> None:
    """concat of a generator was a TypeError ('not subscriptable'), of parts on two devices
    torch.cat's RuntimeError, and kv.equal(None) an AttributeError ('layout')."""
    kv = random_kv(uniform_layout(layers=2), 6)
    assert KVCache.concat(p for p in (kv[:2], kv[2:])).equal(kv)
    on_meta = kv[3:].to("meta")
    with pytest.raises(InvalidArgument, match="concat of caches on different devices: part 1's "
                                              "layer 0 is on meta, part 0's on cpu"):
        KVCache.concat([kv[:3], on_meta])
    for bad in (kv, 3, None):
        with pytest.raises(InvalidArgument, match="concat joins a list of KVCaches, got"):
            KVCache.concat(bad)  # type: ignore[arg-type]
    for other in (None, kv.layers, "kv"):
        assert not kv.equal(other)


@pytest.mark.parametrize("dtype", list(DType))
def test_equal_compares_bits_not_values(dtype: DType) -> None:
    """torch.equal is value equality: a cache of -0.0 was 'bit-exactly' equal to one of 0.0
    (a codec that lost the sign of zero passed), and a cache holding a NaN was not equal to
    itself nor to its bit-exact lossless round trip."""
    lay = uniform_layout(layers=2, dim=8, dtype=dtype)
    kv = random_kv(lay, 4)
    zeros, negative = kv.layers[0][0].clone(), kv.layers[0][0].clone()
    zeros[0, 0, 0], negative[0, 0, 0] = 0.0, -0.0
    a = KVCache(lay, [(zeros, kv.layers[0][1]), kv.layers[1]])
    assert not a.equal(KVCache(lay, [(negative, kv.layers[0][1]), kv.layers[1]]))
    zeros[1, 2, 3] = float("nan")
    assert a.equal(a)
    for mode in ("raw", "lossless"):
        assert codec.decode(codec.encode(a, mode)).equal(a)
    other = zeros.clone()
    other.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[1, 2, 3] += 1  # another NaN
    assert torch.isnan(other[1, 2, 3])
    assert not a.equal(KVCache(lay, [(other, kv.layers[0][1]), kv.layers[1]]))


def test_caches_compare_by_identity() -> None:
    """The dataclass's == compared layer lists of tensors: a raw RuntimeError ('Boolean value
    of Tensor ... is ambiguous') for any two caches, also for ``kv in caches``."""
    a, b = random_kv(uniform_layout(), 4, seed=1), random_kv(uniform_layout(), 4, seed=2)
    assert a == a and a != b and a in [b, a] and b not in [a]
    assert len({a, b, a}) == 2


def test_transformers_roundtrip_shares_storage_and_continues_generation() -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg).eval()
    layout = KVLayout.from_config(cfg, dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        kv = hf.from_transformers(out.past_key_values, layout)
        assert kv.num_tokens == 12
        assert kv.layers[0][0].data_ptr() == out.past_key_values.layers[0].keys.data_ptr()
        full = model(torch.cat([ids, torch.tensor([[5, 6]])], 1)).logits[0, -2:]
        cont = model(torch.tensor([[5, 6]]), past_key_values=hf.to_transformers(kv)).logits[0]
    torch.testing.assert_close(cont, full, rtol=1e-4, atol=1e-4)
    back = hf.to_transformers(kv)
    assert back.layers[1].keys.data_ptr() == kv.layers[1][0].data_ptr()


def test_a_layout_hashes_once_and_as_its_fields() -> None:
    a = KVLayout("m", (LayerLayout(2, 8, 8),) * 3)
    b = KVLayout("m", (LayerLayout(2, 8, 8),) * 3)
    assert a == b and hash(a) == hash(b) and a is not b
    assert "_hash" in a.__dict__  # computed once, kept on the object
    other = dataclasses.replace(a, head_dim=8)
    assert other != a and "_hash" not in other.__dict__  # a new object hashes anew
    assert len({a, b, other}) == 2
