"""The Blend RPC against a real in-process server hosting a tiny random Llama: it composes,
stores and serves combinations, and what it stores or reads is held to the rules of every
other write and read (quotas, limits, the tenant's key space)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.host import ModelBlender
from kdn.blend.key import combination_key
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.blend import RemotePiece, blend_request
from kdn.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidArgument,
    KDNError,
    LayoutMismatch,
    NotFound,
    TooLarge,
)
from kdn.keys import chunk_key, split_store_key
from kdn.layout import DType, KVLayout
from kdn.model import hf
from kdn.model.hf import model_layout
from kdn.prune import prune_model
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import digest
from kdn.v1 import kdn_pb2 as pb
from tests import test_prune
from tests.test_blend import ids, prefill, prompt, tiny

TENANT = '{a: {api_keys: ["sha256:%s"], quota_bytes: %s}}'


@contextmanager
def blending(tmp_path: Path, quota: str = "1GiB", model: Any = None, **settings: Any
             ) -> Iterator[tuple[ServerThread, Client, Any]]:
    """A server (``settings`` on top) whose one tenant ``a`` has ``quota``, blending with
    ``model`` (default: a tiny random Llama); its client as ``a``, and the model."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=256 << 20,
                       disk_bytes=512 << 20, shutdown_grace_s=2.0,
                       auth_tenants=TENANT % (digest("key-a"), quota), **settings)
    model = model if model is not None else tiny("llama")
    with ServerThread(cfg) as st, Client(st.address, timeout_s=30, api_key="key-a") as c:
        assert st.server is not None
        st.server.servicer.blender = ModelBlender(model, None)
        yield st, c, model


def request(pieces: list[RemotePiece], **options: Any) -> pb.BlendRequest:
    """The Blend request of ``pieces`` (``options``: those of ``blend_request`` to change)."""
    kw: dict[str, Any] = dict(namespace="default", ratio=None, select_layer=0, head_tokens=0,
                              per_chunk=False, store=False, mode="", level="", layout=None)
    return blend_request(pieces, **(kw | options))


def test_a_remote_pieces_ids_are_token_ids_not_what_int_makes_of_them() -> None:
    """The wire's ids are uint32: the request was built with ``int(t)`` (1.7 sent as 1, True
    as 1, the text "12" as tokens 1 and 2), which the server can not tell from real ids."""
    for bad, match in (([1.7, 2.2], "piece 0's ids: token 0 is 1.7, not a token id"),
                       ([3, True], "token 1 is True"), ("12", "got str"), (b"ab", "got bytes"),
                       (torch.tensor([1.0]), "token 0 is 1.0"), (7, "got int")):
        with pytest.raises(InvalidArgument, match=match):
            request([RemotePiece(ids=bad)])  # type: ignore[arg-type]
    for same in ([5, 6], (5, 6), torch.tensor([5, 6]), np.array([5, 6], np.int32)):
        assert list(request([RemotePiece(ids=same)]).pieces[0].token_ids) == [5, 6]


def test_a_remote_pieces_ids_outside_uint32_are_refused_naming_the_piece() -> None:
    """An id below 0 or from 2**32 passed the check and reached protobuf, a raw ValueError
    ('Value out of range') naming neither the piece nor the token."""
    for bad, match in (([-1], r"piece 1's ids: token 0 is -1, not in \[0, 2\*\*32\)"),
                       ([3, 2**32], r"piece 1's ids: token 1 is 4294967296, not in"),
                       (torch.tensor([4, -5]), "token 1 is -5")):
        with pytest.raises(InvalidArgument, match=match):
            request([RemotePiece(ids=[3]), RemotePiece(ids=bad)])  # type: ignore[arg-type]
    assert list(request([RemotePiece(ids=[0, 2**32 - 1])]).pieces[0].token_ids) == [0, 2**32 - 1]


def test_blend_options_are_refused_by_name() -> None:
    """Each Blend option of the wrong kind or out of the wire's range is InvalidArgument
    naming it (they escaped as protobuf's ValueError, TypeError or AttributeError)."""
    for options, match in (({"select_layer": -1}, "select_layer must be a whole number >= 0"),
                           ({"select_layer": True}, "select_layer must be a whole number"),
                           ({"head_tokens": 2**32}, "head_tokens must be at most 4294967295"),
                           ({"head_tokens": 1.5}, "head_tokens must be a whole number"),
                           ({"per_chunk": "yes"}, "per_chunk must be a bool, got 'yes'"),
                           ({"store": 1}, "store must be a bool, got 1"),
                           ({"ratio": "0.2"}, r"ratio must be a number in \[0, 1\], got '0.2'"),
                           ({"ratio": 1.5}, r"ratio must be a number in \[0, 1\]"),
                           ({"query_share": "x"}, "query_share must be a number in"),
                           ({"layout": "a-fingerprint"}, "layout must be a kdn.layout.KVLayout"),
                           ({"mode": 5}, "mode must be a str, got 5"),
                           ({"mode": "zip"}, "unknown codec mode 'zip'"),
                           ({"mode": "kdn", "level": "x"}, "codec mode 'kdn' has no level 'x'")):
        with pytest.raises(InvalidArgument, match=match):
            request([RemotePiece(ids=[3, 4])], **options)
    for key, match in (("ab" * 32, "piece 1's key must be 32 bytes .*got str"),
                       (b"abc", "piece 1's key must be 32 bytes .*got 3")):
        with pytest.raises(InvalidArgument, match=match):
            request([RemotePiece(ids=[3]), RemotePiece(ids=[3], key=key)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="piece 0 must be a kdn.client.blend.RemotePiece"):
        request([[3, 4]])  # type: ignore[list-item]
    req = request([RemotePiece(ids=[3], key=bytes(32)), RemotePiece(ids=[4])], ratio=0.5,
                  select_layer=2, head_tokens=1, per_chunk=True, mode="kdn", level="small")
    assert req.pieces[0].chunk_key == bytes(32) and req.pieces[1].chunk_key == b""
    assert (req.select_layer, req.head_tokens, req.per_chunk) == (2, 1, True)


def held(st: ServerThread, tenant: str) -> dict[bytes, int]:
    """The keys ``tenant`` holds in the store, with their sizes."""
    assert st.server is not None
    store = st.server.servicer.store
    keys = store.keys(f"{tenant}:".encode())
    return {split_store_key(k)[-1]: p.size for k, p in zip(keys, store.lookup(keys))}


def test_blend_rpc_composes_stores_and_hits(server_config: Any) -> None:
    model = tiny("llama")
    layout = model_layout(model, DType.FLOAT32)
    pieces, _, chunks = prompt(model, layout)
    want = blend(model, pieces, BlendConfig(ratio=0.3))
    want_share = BlendConfig().query_share
    with ServerThread(server_config) as st, Client(st.address, timeout_s=30) as c:
        remote = [RemotePiece(ids=p.ids) for p in pieces]
        with pytest.raises(LayoutMismatch):  # no model hosted yet
            c.blend(remote)
        assert st.server is not None
        st.server.servicer.blender = ModelBlender(model, None)
        for j, kv in enumerate(chunks, start=1):
            key = chunk_key(pieces[j].ids, layout)
            remote[j] = RemotePiece(ids=pieces[j].ids, key=key)
            if j == 1:
                with pytest.raises(NotFound):
                    c.blend(remote)
            c.store(key, kv)
        got = c.blend_stream(remote, ratio=0.3, store=True)
        assert got.tier == "blend"
        assert got.result().equal(want.kv)
        again = c.blend_stream(remote, ratio=0.3, store=True)
        assert again.tier == "ram" and again.result().equal(want.kv)
        other = c.blend(remote, ratio=1.0)
        assert not other.equal(want.kv)
        # the selection rule travels and is part of the stored combination's key
        shared = blend(model, pieces, BlendConfig(ratio=0.3, query_share=1.0 - want_share))
        got = c.blend_stream(remote, ratio=0.3, store=True, query_share=1.0 - want_share)
        assert got.tier == "blend" and got.result().equal(shared.kv)
        assert not torch.equal(shared.recomputed, want.recomputed)
        bad = list(remote)
        bad[1] = RemotePiece(ids=pieces[2].ids[:23], key=remote[1].key)
        with pytest.raises(InvalidArgument):
            c.blend(bad)
        counters = c.stats().counters
        assert counters["blend.hit"] == 1 and counters["blend.computed"] == 3


def test_a_ratio_is_read_as_the_caller_wrote_it(tmp_path: Path) -> None:
    """ratio and query_share travel as 32-bit floats (0.1 arrives as 0.10000000149): the
    server reads the shortest decimal of each, so the Blend equals the in-process one (over
    25 cached tokens the widened 0.1 recomputed 3 tokens, 0.1 recomputes 2) and the
    combination key is the one the caller computes."""
    with blending(tmp_path) as (st, c, model):
        layout = model_layout(model, DType.FLOAT32)
        a, b, q = ids(10, 1), ids(15, 2), ids(5, 3)
        kv = {tuple(x): prefill(model, x, layout)[0] for x in (a, b)}
        remote = [RemotePiece(ids=x, key=chunk_key(x, layout)) for x in (a, b)]
        for x, r in zip((a, b), remote):
            c.store(r.key, kv[tuple(x)])
        remote.append(RemotePiece(ids=q))
        cfg = BlendConfig(ratio=0.1, query_share=0.7)
        want = blend(model, [Piece(a, kv[tuple(a)]), Piece(b, kv[tuple(b)]), Piece(q)], cfg)
        assert len(want.recomputed) == 2
        assert c.blend(remote, ratio=0.1, query_share=0.7).equal(want.kv)
        assert st.server is not None
        entries = {r.key: codec.encode(kv[tuple(x)]) for x, r in zip((a, b), remote)}
        job = st.server.servicer.blender.plan(
            request(remote, ratio=0.1, query_share=0.7, store=True), entries.get)
        assert job.config == cfg
        named = [(r.key, list(r.ids)) for r in remote[:2]] + [(b"", q)]
        assert job.combination_key == combination_key(named, want.kv.layout.fingerprint, cfg,
                                                      "default")


def test_a_model_folder_that_does_not_load_is_named(tmp_path: Path) -> None:
    """A folder that is no model is refused at start (``model_problem``: no config.json naming
    a model_type); one that passes but does not load (no weights) fails each Blend as
    FAILED_PRECONDITION naming the model, not UNKNOWN with transformers' ValueError."""
    from kdn.cli.args import model_problem

    folder = tmp_path / "model"
    folder.mkdir()
    assert "is not a transformers model folder" in str(model_problem(str(folder)))
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert "naming a model_type" in str(model_problem(str(folder)))
    (folder / "config.json").write_text("{")
    assert "its config.json can not be read" in str(model_problem(str(folder)))
    (folder / "config.json").write_text('{"model_type": "llama"}')  # and no weights
    assert model_problem(str(folder)) is None
    with blending(tmp_path) as (st, c, _):
        assert st.server is not None
        st.server.servicer.blender = ModelBlender(name=str(folder))
        for _ in range(2):  # not memoised as loaded: each Blend says why
            with pytest.raises(LayoutMismatch, match=f"the server's model '{folder}' can not "
                                                      "be loaded: OSError"):
                c.blend([RemotePiece(ids=[3, 4])])


def test_a_stored_blend_is_charged_to_the_tenant_and_refused_past_its_quota(
        tmp_path: Path) -> None:
    """A stored combination is charged like a Store (a delete refunds exactly it); one past
    the quota is refused with nothing stored."""
    with blending(tmp_path, quota="100KiB") as (st, c, model):
        assert st.server is not None
        auth = st.server.servicer.auth
        layout = model_layout(model, DType.FLOAT32)
        a = ids(20, 1)
        ka = chunk_key(a, layout)
        c.store(ka, prefill(model, a, layout)[0])
        c.blend([RemotePiece(ids=a, key=ka), RemotePiece(ids=ids(8, 2))], store=True)
        entries = held(st, "a")
        assert len(entries) == 2 and auth.usage("a") == sum(entries.values())
        with pytest.raises(TooLarge, match="quota"):  # ~170 KB of KV past the 100 KiB quota
            c.blend([RemotePiece(ids=a, key=ka), RemotePiece(ids=ids(150, 3))], store=True)
        assert held(st, "a") == entries and auth.usage("a") == sum(entries.values())
        (combination,) = set(entries) - {ka}
        assert c.delete([combination]) == 1
        assert auth.usage("a") == entries[ka]


def test_a_blend_is_bounded_by_its_pieces_and_the_models_context(tmp_path: Path) -> None:
    """Past ``max_blend_pieces`` pieces, or the model's context of tokens, a Blend is refused
    naming the limit (before any chunk is read or text tokenized); a chunk named by several
    pieces is read once."""
    with pytest.raises(ConfigError, match="max_blend_pieces: must be > 0, got 0"):
        ServerConfig(max_blend_pieces=0)
    with blending(tmp_path, max_blend_pieces=4) as (st, c, model):
        layout = model_layout(model, DType.FLOAT32)
        a = ids(20, 1)
        ka = chunk_key(a, layout)
        c.store(ka, prefill(model, a, layout)[0])
        chunk = RemotePiece(ids=a, key=ka)
        with pytest.raises(TooLarge, match="5 pieces exceeds max_blend_pieces 4"):
            c.blend([chunk] * 4 + [RemotePiece(ids=[5])])
        with pytest.raises(InvalidArgument, match=r"257 tokens exceeds the model's context of "
                                                  r"256 \(max_position_embeddings\)"):
            c.blend([chunk, RemotePiece(ids=ids(237, 2))])
        assert c.blend([chunk] * 3 + [RemotePiece(ids=[5])]).num_tokens == 61
    reads: list[bytes] = []
    entry = codec.encode(prefill(model, a, layout)[0])

    def read_chunk(key: bytes) -> bytes:
        reads.append(key)
        return entry

    def tokenizer(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        reads.append(b"text")
        return {"input_ids": [ord(ch) % 96 for ch in text]}

    blender = ModelBlender(model, tokenizer)
    too_many = [chunk] * 4 + [RemotePiece(text="hello")]
    for pieces in (too_many, [chunk, RemotePiece(ids=ids(237, 2)), RemotePiece(text="x")],
                   [chunk, RemotePiece(text="x" * 237)]):
        with pytest.raises((TooLarge, InvalidArgument)):
            blender.plan(request(pieces), read_chunk, 4)
    assert reads == [b"text"]  # only the text that had to be counted; no chunk was read
    reads.clear()  # a text too long for the context's tokens is not handed to the tokenizer
    with pytest.raises(InvalidArgument, match="piece 1: a text of 15105 characters can not fit "
                                              "the 236 tokens left of the model's context"):
        blender.plan(request([chunk, RemotePiece(text="x" * (236 * 64 + 1))]), read_chunk, 4)
    assert reads == []
    reads.clear()
    job = blender.plan(request([chunk] * 3 + [RemotePiece(text="hi")]), read_chunk, 4)
    assert reads == [b"text", ka] and len(job.pieces) == 4
    assert len({id(p.kv) for p in job.pieces[:3]}) == 1  # one decoded copy of the chunk


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_piece(tmp_path: Path) -> None:
    """An id past the model's vocabulary (96) is InvalidArgument naming the piece and the id,
    stored or not (2**31 would not even fit the combination key); so is a piece giving both
    ids and text (one of them would be ignored)."""
    with blending(tmp_path) as (_, c, model):
        layout = model_layout(model, DType.FLOAT32)
        a = ids(20, 1)
        ka = chunk_key(a, layout)
        c.store(ka, prefill(model, a, layout)[0])
        chunk = RemotePiece(ids=a, key=ka)
        for bad, store in ((96, False), (2**31, True), (2**32 - 1, False)):
            with pytest.raises(InvalidArgument, match=f"piece 1: token id {bad} is outside the "
                                                      "model's vocabulary of 96"):
                c.blend([chunk, RemotePiece(ids=[5, bad])], store=store)
        with pytest.raises(InvalidArgument, match="piece 0 has both token_ids and text"):
            c.blend([RemotePiece(ids=[5], text="hello")])
        assert c.blend([chunk, RemotePiece(ids=[0, 95])]).num_tokens == 22


def test_an_entry_of_another_dtype_than_its_key_is_named_so() -> None:
    """A float16 entry stored under the float32 key of the same ids is a LayoutMismatch naming
    both dtypes (it blamed the ids, which are the key's); ids that are not the key's are still
    InvalidArgument naming them."""
    model = tiny("llama")
    l32, l16 = model_layout(model, DType.FLOAT32), model_layout(model, DType.FLOAT16)
    a = ids(10, 1)
    kv = prefill(model, a, l32)[0]
    entry = codec.encode(KVCache(l16, [(k.half(), v.half()) for k, v in kv.layers]))
    key = chunk_key(a, l32)
    blender = ModelBlender(model, None)
    with pytest.raises(LayoutMismatch, match="piece 0: the entry stored under chunk_key holds "
                                             "float16 KV .* its key names the float32 layout"):
        blender.plan(request([RemotePiece(ids=a, key=key), RemotePiece(ids=[3])]),
                     {key: entry}.get)
    with pytest.raises(InvalidArgument, match="piece 0: token_ids do not match chunk_key"):
        blender.plan(request([RemotePiece(ids=a[:-1] + [3], key=key)]), {key: entry}.get)
    key16 = chunk_key(a, l16)
    job = blender.plan(request([RemotePiece(ids=a, key=key16)]), {key16: entry}.get)
    assert job.tokens == 10


def test_a_chunk_naming_the_model_with_other_shapes_is_a_layout_mismatch(tmp_path: Path) -> None:
    """A container that names the server's model but holds other K/V shapes (heads, channels,
    layers) is refused as LayoutMismatch naming the piece, by both selection rules."""
    with blending(tmp_path) as (_, c, model):
        layout = model_layout(model, DType.FLOAT32)
        a = ids(20, 1)
        forged = {
            "chunk layer 0 holds 1 KV heads of 16/16 K/V channels, the model's 2 of 16/16":
                dict(kv_heads=1),
            "chunk layer 0 holds 2 KV heads of 16/8 K/V channels, the model's 2 of 16/16":
                dict(v_channels=8),
        }
        lays = {msg: replace(layout, layers=tuple(replace(lay, **kw) for lay in layout.layers))
                for msg, kw in forged.items()}
        lays["chunk has 3 layers, the model 4"] = replace(layout, layers=layout.layers[:3])
        for msg, lay in lays.items():
            kv = KVCache(lay, [(torch.randn(x.kv_heads, 20, x.k_channels),
                                torch.randn(x.kv_heads, 20, x.v_channels)) for x in lay.layers])
            key = chunk_key(a, lay)
            c.store(key, kv)
            for share in (None, 0.0):
                with pytest.raises(LayoutMismatch, match=f"piece 0: {msg}"):
                    c.blend([RemotePiece(ids=a, key=key), RemotePiece(ids=[5])],
                            query_share=share)


def test_a_chunk_naming_the_model_with_other_kept_channels_is_a_layout_mismatch(
        tmp_path: Path) -> None:
    """A pruned model's chunk forged to keep other channels (the same counts), or to another
    head_dim or RoPE, is refused as LayoutMismatch naming the piece, by the plan (no
    combination is named, looked up or stored under the forged layout); the model's own chunk
    blends, its result labelled with the model's layout."""
    pruned = prune_model(test_prune.tiny(6), test_prune.random_plan(6))
    with blending(tmp_path, model=pruned) as (st, c, model):
        assert st.server is not None
        blender = st.server.servicer.blender
        layout = model_layout(model, DType.FLOAT32)
        a, q = ids(20, 1), ids(6, 2)
        kv = prefill_pruned(model, a, layout)
        ka = chunk_key(a, layout)
        c.store(ka, kv)
        got = c.blend([RemotePiece(ids=a, key=ka), RemotePiece(ids=q)], ratio=0.3)
        assert got.layout.fingerprint == layout.fingerprint
        lay = layout.layers[1]
        low = sorted((x + 1) % 8 for x in lay.k_kept or () if x < 8)  # other rotary pairs
        forged = {
            "chunk layer 1 keeps other K channels than the model's": replace(layout, layers=(
                layout.layers[0], replace(lay, k_kept=tuple(low + [x + 8 for x in low])),
                *layout.layers[2:])),
            "chunk's head_dim is 32, the model's 16": replace(layout, head_dim=32),
            "chunk's keys carry RoPE": replace(layout, rope=replace(layout.rope, theta=5e5)),
        }
        for msg, lay_f in forged.items():
            assert lay_f.fingerprint != layout.fingerprint
            key = chunk_key(a, lay_f)
            c.store(key, KVCache(lay_f, kv.layers))
            entry = codec.encode(KVCache(lay_f, kv.layers))
            pieces = [RemotePiece(ids=a, key=key), RemotePiece(ids=q)]
            with pytest.raises(LayoutMismatch, match=f"piece 0: {msg}"):
                blender.plan(request(pieces, store=True), {key: entry}.get)
            for share in (None, 0.0):
                with pytest.raises(LayoutMismatch, match=f"piece 0: {msg}"):
                    c.blend([RemotePiece(ids=a, key=key), RemotePiece(ids=q)], ratio=0.0,
                            query_share=share)


def prefill_pruned(model: Any, tokens: list[int], layout: KVLayout) -> KVCache:
    """A pruned model's KV of ``tokens`` (its own forward, through kdn's adapter)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    kv = hf.from_transformers(out.past_key_values, layout)
    return KVCache(layout, [(k.clone(), v.clone()) for k, v in kv.layers])


def test_a_stored_combination_of_another_shape_is_computed_again(tmp_path: Path) -> None:
    """An entry under a combination's key that is not that prompt's KV (3 tokens; another
    model's 2 layers) is not served: the blend is computed, overwrites it, and is then a hit.
    A right one is a hit in a lossy encoding too."""
    with blending(tmp_path) as (st, c, model):
        layout = model_layout(model, DType.FLOAT32)
        a, q = ids(20, 1), ids(8, 2)
        ka = chunk_key(a, layout)
        c.store(ka, prefill(model, a, layout)[0])
        pieces = [RemotePiece(ids=a, key=ka), RemotePiece(ids=q)]
        want = c.blend(pieces)
        comb = combination_key([(ka, a), (b"", q)], layout.fingerprint, BlendConfig(),
                               "default", "lossless")
        other = tiny("llama", seed=3)
        other.model.layers = other.model.layers[:2]
        other.config.num_hidden_layers = 2
        for junk in (prefill(model, [5, 6, 7], layout)[0],
                     prefill(other, [1, 2], model_layout(other, DType.FLOAT32))[0]):
            c.store(comb, junk)
            got = c.blend_stream(pieces, store=True)
            assert got.tier == "blend" and got.result().equal(want)
            again = c.blend_stream(pieces, store=True)
            assert again.tier == "ram" and again.result().equal(want)
        assert st.server is not None  # a tenant's Stats has no server-wide counters
        assert st.server.servicer.counters["blend.stale"] == 2
        assert c.blend_stream(pieces, store=True, mode="int8").tier == "blend"
        assert c.blend_stream(pieces, store=True, mode="int8").tier == "ram"


def test_a_blend_is_paced_by_the_egress_cap(tmp_path: Path) -> None:
    """A Blend's answer leaves at the egress cap as a Retrieve's does, computed or a hit."""
    cap = 200_000
    with blending(tmp_path, egress_bytes_per_s=cap) as (st, c, model):
        assert st.server is not None
        layout = model_layout(model, DType.FLOAT32)
        a = ids(20, 1)
        ka = chunk_key(a, layout)
        c.store(ka, prefill(model, a, layout)[0])
        pieces = [RemotePiece(ids=a, key=ka), RemotePiece(ids=ids(100, 2))]
        for tier in ("blend", "ram"):
            t0 = time.perf_counter()
            got = c.blend_stream(pieces, store=True)
            got.result()
            elapsed = time.perf_counter() - t0
            assert got.tier == tier
            size = sum(held(st, "a").values()) - held(st, "a")[ka]
            assert size > 100_000 and elapsed >= 0.8 * size / cap, (tier, elapsed, size)
        assert st.server.servicer.usage.egress_delayed_bytes["a"] > size


def test_blends_whose_callers_are_gone_stop(tmp_path: Path) -> None:
    """Blends wait for the model in turn on the event loop, and one whose caller's deadline
    passed stops within a layer: of 4 calls given up at 0.5 s (a blend of text alone here
    takes 4 layer passes of 0.2 s: nothing cached, so no question pass), one starts and stops,
    the others never start."""
    with blending(tmp_path) as (st, c, model):
        passes: list[int] = []

        def slow(*_: Any) -> None:
            passes.append(1)
            time.sleep(0.2)

        for layer in model.model.layers:
            layer.self_attn.q_proj.register_forward_hook(slow)
        pieces = [RemotePiece(ids=ids(100, 1))]
        c.blend(pieces)
        assert len(passes) == 4  # one pass: nothing cached for a question pass to rank
        passes.clear()
        failed: list[Exception] = []

        def call() -> None:
            with Client(st.address, timeout_s=0.5, api_key="key-a") as caller:
                caller.lookup([b"k" * 32])  # connected: the deadline runs out in the blend
                try:
                    caller.blend(pieces)
                except KDNError as exc:
                    failed.append(exc)

        callers = [threading.Thread(target=call) for _ in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        time.sleep(1.0)  # what a blend left running would compute meanwhile
        assert len(failed) == 4 and all(isinstance(e, DeadlineExceeded) for e in failed)
        assert 0 < len(passes) < 4, passes  # stopped, within a pass of the deadline


def test_blends_waiting_for_the_model_hold_no_chunks_past_a_few(tmp_path: Path) -> None:
    """A plan holds the bytes of the chunk entries it names until its blend ends: every call
    planned at once and then waited for the model, so memory grew with the callers waiting
    (each up to the model's context of KV). At most PLANNED calls are planned or blending."""
    from kdn.server.blend_rpc import PLANNED

    with blending(tmp_path) as (st, c, model):
        chunk, layout = ids(40, 1), model_layout(model, DType.FLOAT32)
        c.store(chunk_key(chunk, layout), prefill(model, chunk, layout)[0])
        pieces = [RemotePiece(ids=chunk, key=chunk_key(chunk, layout)), RemotePiece(ids=ids(6, 2))]
        blender = st.server.servicer.blender  # type: ignore[union-attr]
        held, most, lock = [0], [0], threading.Lock()
        plan = blender.plan

        def counted_plan(*args: Any, **kwargs: Any) -> Any:
            job = plan(*args, **kwargs)
            run = job.run

            def counted_run(*a: Any, **kw: Any) -> Any:
                time.sleep(0.1)  # the model busy: the other calls wait
                try:
                    return run(*a, **kw)
                finally:
                    with lock:
                        held[0] -= 1
            with lock:
                held[0] += 1
                most[0] = max(most[0], held[0])
            job.run = counted_run
            return job

        blender.plan = counted_plan
        answers: list[Any] = []

        def call() -> None:
            with Client(st.address, timeout_s=60, api_key="key-a") as caller:
                answers.append(caller.blend(pieces))

        callers = [threading.Thread(target=call) for _ in range(PLANNED + 4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert len(answers) == PLANNED + 4  # every call answered
        assert most[0] <= PLANNED, most


def test_a_stored_text_only_blend_of_a_bf16_model_is_served_again(tmp_path: Path) -> None:
    """A blend of text alone computes KV in the model's own dtype: its plan names that layout,
    so the stored combination is what the next call finds (the plan named float32 before, and
    a bf16 model's stored blends were recomputed and overwritten on every call)."""
    import torch

    with blending(tmp_path) as (st, c, model):
        model.to(torch.bfloat16)
        remote = [RemotePiece(ids=list(range(3, 40)))]
        first = c.blend_stream(remote, store=True)
        assert first.tier == "blend" and first.result().layout.dtype == DType.BFLOAT16
        again = c.blend_stream(remote, store=True)
        assert again.tier == "ram"
        assert st.server is not None
        assert st.server.servicer.counters.get("blend.stale", 0) == 0
