"""The connector protocol (kdn.engine.connector) as an engine wrapping kdn would drive it:
KDNEngine for prefixes, ChunkConnector for blend chunks, and the transformers adapter's
layer-by-layer cache. Tiny random Llama on a real gRPC server."""

from __future__ import annotations

import threading

import pytest
import torch

from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.chunks import ChunkConnector
from kdn.client import Client
from kdn.delivery import LoadingController
from kdn.engine import EngineConfig, KDNEngine, KVConnector
from kdn.errors import InvalidArgument, InvalidRequest
from kdn.layout import DType
from kdn.model import hf
from tests.test_blend import ids, tiny
from tests.test_rag import CharTokenizer


def _retrieves(client: Client) -> int:
    counters = client.stats().counters
    return int(counters.get("retrieve.hit", 0) + counters.get("retrieve.frames_sent", 0))


def test_engine_follows_the_connector_lifecycle(client: Client) -> None:
    model = tiny("llama")
    # lossless decodes at 1 GB/s (given, not timed: on a model this small one block's decode
    # and a 64-token prefill both take about a millisecond, and the choice is not the point)
    engine = KDNEngine(model, CharTokenizer(), client, EngineConfig(chunk_tokens=16),
                       LoadingController(decode_b_s={"lossless@cpu": 1e9}))
    assert isinstance(engine, KVConnector)
    prompt = ids(70, seed=3)
    assert engine.matched_tokens(prompt) == 0
    first = engine.generate(prompt, max_new_tokens=4, force="recompute")
    engine.wait_for_save(30)
    assert first.store_thread is not None and not first.store_thread.is_alive()
    # 70 tokens: blocks of 16, one token always computed -> 4 reusable blocks
    assert engine.matched_tokens(prompt) == 64
    assert engine.matched_tokens(prompt[:40]) == 32  # only the blocks the prompt covers
    before = _retrieves(client)
    assert engine.matched_tokens(prompt) == 64  # a lookup: nothing fetched
    assert _retrieves(client) == before

    assert engine.start_load(prompt) == 64
    full, _ = hf.prefill(model, prompt, engine.layout)
    for i in range(engine.layout.num_layers):
        k, v = engine.wait_for_layer(i, timeout=30)
        want_k, want_v = full.layers[i]
        assert torch.equal(k, want_k[:, :64]) and torch.equal(v, want_v[:, :64])
    engine.finish()
    assert engine.start_load(prompt, force="recompute") == 0

    hit = engine.generate(prompt, max_new_tokens=4)
    assert hit.timings.reused_tokens == 64 and hit.timings.decision == "lossless"
    assert hit.token_ids == first.token_ids


def test_each_start_load_begins_a_request_of_its_own(client: Client) -> None:
    """An engine wrapping kdn drives the protocol alone (no ``generate``): what ``save_layer``
    stores after ``start_load(b)`` is b's KV under b's keys, also right after a request of
    another prompt; a wait with no load under way, or for a layer the model lacks, is
    refused by name."""
    model = tiny("llama")
    engine = KDNEngine(model, CharTokenizer(), client,
                       EngineConfig(chunk_tokens=16, calibrate=False, namespace="own"),
                       LoadingController(decode_b_s={"lossless@cpu": 1e9}))
    a, b = ids(40, seed=11), ids(40, seed=12)
    engine.generate(a, max_new_tokens=2, force="recompute")
    engine.wait_for_save(30)
    assert engine.matched_tokens(a) == 32
    assert engine.start_load(b, force="recompute") == 0
    with pytest.raises(InvalidArgument, match="no load is under way"):
        engine.wait_for_layer(0)
    full, _ = hf.prefill(model, b, engine.layout)
    for i, (k, v) in enumerate(full.layers):
        engine.save_layer(i, k, v)
    engine.wait_for_save(30)
    assert engine.matched_tokens(b) == 32
    assert engine.start_load(b) == 32
    for bad in (-1, engine.layout.num_layers, 1.0):
        with pytest.raises(InvalidArgument, match="layer must be a whole number"):
            engine.wait_for_layer(bad)  # type: ignore[arg-type]
    k, _ = engine.wait_for_layer(0, timeout=30)
    assert torch.equal(k, full.layers[0][0][:, :32])  # b's own KV, under b's keys
    engine.finish()
    # token ids matched_tokens refuses as start_load does: bools (read as 0/1 they would
    # match another prompt's blocks), a batch ([1, tokens]: it matched nothing)
    for what in ([True, False] * 20, torch.tensor([b])):
        for call in (engine.matched_tokens, engine.start_load):
            with pytest.raises(InvalidArgument, match=f"{call.__name__}: token"):
                call(what)  # type: ignore[arg-type]


def test_layerwise_cache_fills_each_layer_right_before_it_runs() -> None:
    model = tiny("llama")
    layout = hf.model_layout(model)
    prompt = ids(30, seed=4)
    kv, _ = hf.prefill(model, prompt[:20], layout)
    asked: list[int] = []

    def fill(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        asked.append(i)
        return kv.layers[i][0].half(), kv.layers[i][1].half()  # converted back to the model's

    with hf.LayerwiseCache(model, fill) as cache:
        assert asked == [0]
        logits = hf.CacheDecoder(model, cache).forward(prompt[20:])
    assert asked == list(range(layout.num_layers))
    half = [(k.half().float(), v.half().float()) for k, v in kv.layers]
    ref = hf.CacheDecoder(model, hf.to_transformers(type(kv)(layout, half)))
    torch.testing.assert_close(logits, ref.forward(prompt[20:]))
    assert not model.model.layers[1]._forward_pre_hooks  # hooks removed on exit


def test_layerwise_cache_refuses_a_forward_on_another_thread() -> None:
    """Its layers are filled only on the thread that entered it: a forward there on another
    thread ran with layers 1.. empty; it is refused, naming why. A forward of the same model
    on another thread with a cache of its own is let be."""
    model = tiny("llama")
    layout = hf.model_layout(model)
    prompt = ids(30, seed=4)
    kv, _ = hf.prefill(model, prompt[:20], layout)
    asked: list[int] = []
    out: list[object] = []

    def fill(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        asked.append(i)
        return kv.layers[i]

    def run(cache: object) -> None:
        try:
            out.append(hf.CacheDecoder(model, cache).forward(prompt[20:]))
        except InvalidRequest as exc:
            out.append(exc)

    with hf.LayerwiseCache(model, fill) as cache:
        for other in (cache, hf.to_transformers(kv)):
            t = threading.Thread(target=run, args=(other,))
            t.start()
            t.join(60)
    assert isinstance(out[0], InvalidRequest) and "another thread" in str(out[0])
    assert isinstance(out[1], torch.Tensor) and asked == [0]


def test_chunk_connector_loads_saves_and_blends(client: Client) -> None:
    model = tiny("llama")
    layout = hf.model_layout(model, DType.FLOAT32)
    chunk, head, question = ids(24, seed=5), ids(5, seed=6), ids(7, seed=7)
    computed, _ = hf.prefill(model, chunk, layout)

    miss = ChunkConnector(client, layout, "conn")
    assert miss.matched_tokens(chunk) == 0 and miss.start_load(chunk) == 0
    with pytest.raises(InvalidArgument, match="neither loaded nor saved"):
        miss.wait_for_layer(0)
    for i, (k, v) in enumerate(computed.layers):
        miss.save_layer(i, k, v)
    assert miss.matched_tokens(chunk) == 0  # saving waits for wait_for_save
    want = blend(model, [Piece(head), Piece(chunk, miss), Piece(question)], BlendConfig())
    miss.wait_for_save()
    assert miss.stored_bytes > 0

    hit = ChunkConnector(client, layout, "conn")
    assert hit.matched_tokens(chunk) == len(chunk) and hit.start_load(chunk) == len(chunk)
    got = blend(model, [Piece(head), Piece(chunk, hit), Piece(question)], BlendConfig())
    assert got.kv.equal(want.kv) and torch.equal(got.logits, want.logits)
    other_ns = ChunkConnector(client, layout, "elsewhere")
    assert other_ns.matched_tokens(chunk) == 0


def test_chunk_connector_reports_the_stored_entrys_start_position(client: Client) -> None:
    """A chunk stored with its keys rotated at position 5 blends through a ChunkConnector as
    through its LayerStream: re-positioned from 5 (the connector said 0 whatever the entry
    held, and its keys landed rotated 5 positions too far, without a word)."""
    from kdn.cache import KVCache

    model = tiny("llama")
    layout = hf.model_layout(model)
    chunk, question = ids(8, seed=1), ids(4, seed=2)
    with torch.no_grad():  # the chunk's KV computed at positions 5..12
        out = model(torch.tensor([chunk]), position_ids=torch.arange(5, 13)[None],
                    use_cache=True)
    at5 = KVCache(layout, hf.from_transformers(out.past_key_values, layout).layers, 5)
    conn = ChunkConnector(client, layout, "conn5")
    assert conn.start_position == 0  # nothing loaded yet
    client.store(conn.key_of(chunk), at5, namespace="conn5")
    assert conn.start_load(chunk) == len(chunk) and conn.start_position == 5
    got = blend(model, [Piece(question), Piece(chunk, conn)], BlendConfig(ratio=0.0))
    conn.finish()
    full, _ = hf.prefill(model, question + chunk, layout)
    torch.testing.assert_close(got.kv.layers[0][0], full.layers[0][0], atol=1e-4, rtol=1e-4)


def test_one_greedy_loop_drives_every_decoder() -> None:
    from kdn.blend.decode import Continuation

    model = tiny("qwen3")
    layout = hf.model_layout(model)
    kv, logits = hf.prefill(model, ids(20, seed=8), layout)
    a = hf.greedy(hf.CacheDecoder(model, hf.to_transformers(kv)), logits, 6)
    b = hf.greedy(Continuation(model, kv, room=6), logits, 6)
    assert a == b and len(a) == 6
    stopped = hf.greedy(Continuation(model, kv, room=6), logits, 6, {a[2]})
    assert stopped == a[: a.index(a[2]) + 1]  # the stop token is kept, nothing after it
