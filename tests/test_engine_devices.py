"""KDNEngine's device handling with a tiny random Llama (fast, no packaged model): KV stored in
the model's own dtype (fp16 / bf16 / fp32), retrieved layers placed on the model's device,
store-back of only the blocks kdn lacks, and greedy output of a hit identical to a full prefill.
The same tests run on CUDA where a device exists (``-m gpu``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.layout import DType
from kdn.server import ServerConfig, ServerThread


class _Tok:
    """The least a tokenizer must do for the engine when prompts are token ids."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _model(dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        yield c


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode,level", [("lossless", ""), ("raw", "")])
def test_a_hit_on_the_models_device_and_dtype_matches_full_prefill(
        client: Client, device: str, dtype: torch.dtype, mode: str, level: str) -> None:
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 matmuls on CPU are slow and not what a CPU user runs")
    model = _model(dtype, device)
    engine = KDNEngine(model, _Tok(), client,
                       EngineConfig(chunk_tokens=32, encodings=((mode, level),)))
    assert engine.layout.dtype == DType.of(dtype)  # the model's own dtype, not fp32
    gen = torch.Generator().manual_seed(1)
    ids = [int(x) for x in torch.randint(1, 256, (100,), generator=gen)]
    full = engine.generate(ids, max_new_tokens=8)
    assert full.store_thread is not None
    full.store_thread.join(60)
    # forced: on a CPU this tiny model's 96-token prefill takes a few ms, and the controller
    # (rightly) recomputes whenever a busy host makes the hit look slower than that
    name = f"{mode}-{level}" if level else mode
    hit = engine.generate(ids, max_new_tokens=8, force=name)
    assert hit.timings.decision == name
    assert hit.timings.reused_tokens == 96 and hit.token_ids == full.token_ids
    stream = client.retrieve_stream(_first_key(engine, ids), layout=engine.layout,
                                    device=device)
    assert stream is not None
    k, _ = stream.wait_for_layer(0)
    assert k.device.type == device and k.dtype == dtype


def _first_key(engine: KDNEngine, ids: list[int]) -> bytes:
    from kdn import keys
    from kdn.delivery import encoding_name

    mode, level = engine.config.encodings[0]
    return keys.variant_key(engine._chain(ids)[0], encoding_name(mode, level))


def test_store_back_after_a_partial_hit_stores_only_the_new_blocks(client: Client) -> None:
    model = _model(torch.float32, "cpu")
    engine = KDNEngine(model, _Tok(), client, EngineConfig(chunk_tokens=16))
    ids = list(range(1, 60))
    first = engine.generate(ids[:40], max_new_tokens=1)  # blocks 0, 1 stored
    assert first.store_thread is not None
    first.store_thread.join(60)
    # the hits are forced: on this tiny model the controller may rightly find a prefill
    # cheaper than a hit it timed on a busy machine, and recompute (a flaky test before)
    longer = engine.generate(ids, max_new_tokens=4, force="lossless")  # 0, 1 reused; 2 stored
    assert longer.timings.reused_tokens == 32
    assert longer.store_thread is not None
    longer.store_thread.join(60)
    again = engine.generate(ids, max_new_tokens=4, force="lossless")
    assert again.timings.reused_tokens == 48 and again.token_ids == longer.token_ids
    full = engine.generate(ids, max_new_tokens=4, force="recompute")
    assert full.token_ids == again.token_ids


def test_a_hit_slower_than_prefill_teaches_the_controller_to_recompute(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller learns a hit's cost end to end (to the first token), not from what the
    streams report: on a GPU the copies they queue finish later (or, as faked here, the
    retrieve itself is slow). After hits slower than the model's prefill, it recomputes (two:
    one straggler alone moves an estimate at most twofold, ``kdn.delivery.controller``)."""
    import time

    model = _model(torch.float32, "cpu")
    engine = KDNEngine(model, _Tok(), client,
                       EngineConfig(chunk_tokens=32, encodings=(("raw", ""),)))
    ids = [int(x) for x in torch.randint(1, 256, (100,), generator=torch.Generator()
                                         .manual_seed(2))]
    first = engine.generate(ids, max_new_tokens=1)  # a prefill: its speed is learnt
    assert first.store_thread is not None
    first.store_thread.join(60)
    slow_streams = client.retrieve_streams

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.5)  # far slower than this tiny model's prefill of 96 tokens
        return slow_streams(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "retrieve_streams", slow)
    for _ in range(2):
        hit = engine.generate(ids, max_new_tokens=1, force="raw")
        assert hit.timings.reused_tokens == 96 and hit.timings.ttft_s >= 0.5
    again = engine.generate(ids, max_new_tokens=1)
    assert again.timings.decision == "recompute", engine.controller.decode_b_s
