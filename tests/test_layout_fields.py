"""KVLayout's fields: each held as the one type its fingerprint writes, what is not one
refused as InvalidLayout naming the field, in code and in a description (``from_dict``)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from kdn import codec, keys
from kdn.cache import KVCache
from kdn.errors import InvalidLayout
from kdn.layout import KVLayout, LayerLayout, RopeSpec
from tests.helpers import pruned_layout, random_kv, uniform_layout

L = (LayerLayout(2, 8, 8),)


def test_fingerprints_of_layouts_made_as_usual_are_what_they_were() -> None:
    """Fingerprints name stored entries and enter their keys: these were computed before
    the fields were normalised, and must not move."""
    assert pruned_layout().fingerprint == "566ea5d71edd3fd7b8838c1263bf448e"
    assert uniform_layout().fingerprint == "3cb23d6f672de92c48b240bcfd7ba84c"
    lay = KVLayout("m", L, head_dim=8,
                   rope=RopeSpec(theta=500000.0, rotary_dim=8, keys_rotated=False))
    assert lay.fingerprint == "75058d691e8aebe345b47a22ee8ee0d2"


@pytest.mark.parametrize("odd, usual", [
    (lambda: dict(rope=RopeSpec(theta=500000)), dict(theta=500000.0)),
    (lambda: dict(rope=RopeSpec(theta=np.float32(10000.0))), dict()),
    (lambda: dict(rope=RopeSpec(rotary_dim=np.int64(8))), dict(rotary_dim=8)),
    (lambda: dict(head_dim=np.int64(8)), dict(head_dim=8)),
    (lambda: dict(head_dim=torch.tensor(8)), dict(head_dim=8)),
    (lambda: dict(layers=(LayerLayout(np.int32(2), np.int64(8), 8),)), dict()),
])
def test_equal_layouts_of_other_number_types_are_one_layout(odd: Any, usual: dict) -> None:
    """Equal layouts share a fingerprint, keep it through to_dict/from_dict, and their
    entries decode (the header's fingerprint was of '500000', checked against '500000.0')."""
    head_dim = usual.pop("head_dim", 0)
    a = KVLayout(**{"model_fingerprint": "m", "layers": L, **odd()})
    b = KVLayout("m", L, head_dim=head_dim, rope=RopeSpec(**usual))
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    assert KVLayout.from_dict(a.to_dict()).fingerprint == a.fingerprint
    assert keys.chunk_key([1, 2], a) == keys.chunk_key([1, 2], b)
    kv = random_kv(a, 3)
    assert codec.decode(codec.encode(kv, "raw")).equal(kv)


@pytest.mark.parametrize("make, field", [
    (lambda: RopeSpec(keys_rotated=1), "keys_rotated"),
    (lambda: RopeSpec(keys_rotated="false"), "keys_rotated"),
    (lambda: RopeSpec(theta="1e4"), "theta"),
    (lambda: RopeSpec(theta=float("nan")), "theta"),
    (lambda: RopeSpec(theta=float("inf")), "theta"),
    (lambda: RopeSpec(theta=10**400), "theta"),
    (lambda: RopeSpec(theta=True), "theta"),
    (lambda: RopeSpec(rotary_dim=None), "rotary_dim"),
    (lambda: RopeSpec(rotary_dim=8.0), "rotary_dim"),
    (lambda: RopeSpec(rotary_dim=3), "rotary_dim"),
    (lambda: RopeSpec(rotary_dim=2**32), "rotary_dim"),
    (lambda: RopeSpec(scaling=None), "scaling"),
    (lambda: RopeSpec(scaling="\ud800"), "scaling"),
    (lambda: LayerLayout(2, 8.0, 8), "k_channels"),
    (lambda: LayerLayout(2**32, 8, 8), "kv_heads"),
    (lambda: LayerLayout(1, 1, 1, (2**32,)), "k_kept"),
    (lambda: KVLayout("m", ("x",)), "layer 0"),
    (lambda: KVLayout("m", 5), "layers"),
    (lambda: KVLayout("m", ()), "layer"),
    (lambda: KVLayout("m", L, head_dim="8"), "head_dim"),
    (lambda: KVLayout("m", L, head_dim=8.0), "head_dim"),
    (lambda: KVLayout("m", L, head_dim=-1), "head_dim"),
    (lambda: KVLayout("m", L, head_dim=2**32), "head_dim"),
    (lambda: KVLayout("m", L, rope=None), "rope"),
    (lambda: KVLayout(None, L), "model_fingerprint"),
    (lambda: KVLayout("m\ud800", L), "model_fingerprint"),
    (lambda: KVLayout("m", L, model_name=None), "model_name"),
])
def test_a_field_that_is_not_one_is_named(make: Any, field: str) -> None:
    with pytest.raises(InvalidLayout, match=field):
        make()


def test_a_model_folder_whose_name_is_not_utf8_names_a_layout_that_encodes() -> None:
    """model_name is informational: the surrogates os.fsdecode leaves in _name_or_path are
    shown escaped (protobuf refused them on every encode, a raw UnicodeEncodeError)."""
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=1, intermediate_size=64, vocab_size=100)
    cfg._name_or_path = os.fsdecode(b"/models/caf\xe9-7b")
    lay = KVLayout.from_config(cfg, weights_id="w1")
    assert lay.model_name == "/models/caf\\udce9-7b"
    cfg._name_or_path = "/models/cafe-7b"
    assert lay.fingerprint == KVLayout.from_config(cfg, weights_id="w1").fingerprint
    kv = KVCache(lay, [(torch.randn(1, 3, 16).half(), torch.randn(1, 3, 16).half())])
    assert codec.decode(codec.encode(kv, "raw")).equal(kv)


def _described(**change: Any) -> Any:
    d = KVLayout("m", (LayerLayout(2, 8, 8, k_kept=tuple(range(8))),), head_dim=16).to_dict()
    for path, value in change.items():
        *parents, last = path.split("__")
        at = d
        for p in parents:
            at = at[int(p)] if p.isdigit() else at[p]
        at[last] = value
    return d


@pytest.mark.parametrize("desc, field", [
    (_described(layers__0__kv_heads=2.7), "kv_heads"),
    (_described(layers__0__kv_heads=2.0), "kv_heads"),
    (_described(layers__0__k_kept=[0.5, 1, 2, 3, 4, 5, 6, 7]), "k_kept"),
    (_described(rope__keys_rotated="false"), "keys_rotated"),
    (_described(model_fingerprint=None), "model_fingerprint"),
    (_described(model_name=7), "model_name"),
    (_described(rope=None), "rope"),
    (_described(layers={"kv_heads": 2}), "layers"),
    (_described(layers=[[2, 8, 8]]), "malformed"),
    (_described(head_dim="16"), "head_dim"),
    ([_described()], "mapping"),
    (None, "mapping"),
])
def test_a_description_is_read_as_it_is_not_converted(desc: Any, field: str) -> None:
    """int(2.7) was 2 heads, bool("false") True, str(None) the model "None"; a null rope or a
    list escaped as AttributeError."""
    with pytest.raises(InvalidLayout, match=field):
        KVLayout.from_dict(desc)


def test_a_description_round_trips() -> None:
    for lay in (pruned_layout(), uniform_layout(),
                KVLayout("m", L, rope=RopeSpec(500000.0, 8, '{"factor":2.0}', False))):
        assert KVLayout.from_dict(lay.to_dict()) == lay
        assert KVLayout.from_dict(lay.to_dict()).fingerprint == lay.fingerprint
