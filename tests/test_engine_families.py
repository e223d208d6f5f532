"""KDNEngine and model families whose cache is not K and V of every token in every layer:
hybrid (convolution, linear attention), MLA and KV-shared models are refused at construction
with InvalidArgument naming the model and why (each request raised a raw error before), by
their config or, where it names nothing, by a probe forward; per-layer head sizes (Gemma 4)
and a decoder with an embedding per codebook (Musicgen) are refused alike; Llama 4, whose
``get_decoder()`` gives the model itself, is driven through ``model.model`` and served exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import InvalidArgument, InvalidLayout
from kdn.layout import KVLayout
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _Tok
from tests.test_engine_models import _first_logits

IDS = [int(x) for x in torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))]
RAW = EngineConfig(chunk_tokens=16, encodings=(("raw", ""),), calibrate=False)
SMALL = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
         "max_position_embeddings": 512, "pad_token_id": 0}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=64 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        yield c


def _built(config_class: Any, model_class: Any, **settings: Any) -> Any:
    torch.manual_seed(0)
    cfg = config_class(**SMALL, **settings)
    cfg._attn_implementation = "sdpa"
    return model_class(cfg).eval()


def _lfm2() -> Any:
    return _built(transformers.Lfm2Config, transformers.Lfm2ForCausalLM, intermediate_size=128,
                  num_hidden_layers=4, num_key_value_heads=2,
                  layer_types=["conv", "full_attention"] * 2)


def _deepseek_v3() -> Any:
    return _built(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                  intermediate_size=128, num_hidden_layers=2, num_key_value_heads=4,
                  kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=1, topk_group=1)


def _gemma3n() -> Any:
    return _built(transformers.Gemma3nTextConfig, transformers.Gemma3nForCausalLM,
                  intermediate_size=[128] * 4, num_hidden_layers=4, num_key_value_heads=2,
                  head_dim=16, bos_token_id=1, eos_token_id=2, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=256, num_kv_shared_layers=2, sliding_window=24,
                  laurel_rank=8, layer_types=["sliding_attention", "full_attention"] * 2,
                  activation_sparsity_pattern=[0.0] * 4)


@pytest.mark.parametrize(("make", "why"), [
    (_lfm2, "layers of type conv"),
    (_deepseek_v3, "multi-head latent attention"),
    (_gemma3n, "reuse earlier layers' K and V")], ids=["lfm2", "deepseek-v3", "gemma3n"])
def test_a_model_whose_cache_is_not_kv_per_layer_is_refused_at_construction(
        client: Client, make: Any, why: str) -> None:
    model = make()
    with pytest.raises(InvalidArgument, match=f"KDNEngine can not run {type(model).__name__}: "
                                              f".*{why}"):
        KDNEngine(model, _Tok(), client, RAW)


def _llama(**settings: Any) -> Any:
    return _built(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2, **settings)


def test_a_cache_unlike_the_config_is_refused_by_the_probe_forward(client: Client) -> None:
    """A config that names no reason but does not describe the cache (here: a model built with
    2 KV heads and 2 layers, its config then saying 4 heads, or 3 layers) is refused by the
    forward of two tokens the engine runs at construction."""
    model = _llama()
    model.config.num_key_value_heads = 4
    with pytest.raises(InvalidArgument, match=r"layer 0 of its cache holds K of \(1, 2, 2, 16\)"):
        KDNEngine(model, _Tok(), client, RAW)
    model = _llama()
    model.config.num_hidden_layers = 3
    with pytest.raises(InvalidArgument, match="its cache has 2 layers, its config 3"):
        KDNEngine(model, _Tok(), client, RAW)
    KDNEngine(_llama(), _Tok(), client, RAW)  # the model as built


def test_per_layer_head_sizes_are_an_invalid_layout(client: Client) -> None:
    """Gemma 4's config sets head_dim per layer: reading it raised transformers' own error."""
    model = _built(transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
                   intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                   head_dim=16, bos_token_id=1, eos_token_id=2, sliding_window=24,
                   vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)
    with pytest.raises(InvalidLayout, match="sets head_dim per layer"):
        KVLayout.from_config(model.config)
    with pytest.raises(InvalidLayout, match="sets head_dim per layer"):
        KDNEngine(model, _Tok(), client, RAW)


def test_a_decoder_of_no_single_token_embedding_is_refused(client: Client) -> None:
    """Musicgen's embed_tokens is a list of codebook embeddings (an AttributeError before)."""
    cfg = transformers.MusicgenDecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, ffn_dim=64, num_codebooks=2,
                                             max_position_embeddings=128)
    model = transformers.MusicgenForCausalLM(cfg).eval()
    with pytest.raises(InvalidArgument, match="MusicgenForCausalLM is not a model kdn drives"):
        KDNEngine(model, _Tok(), client, RAW)


def test_llama4_is_driven_through_model_model_and_served_exactly(client: Client) -> None:
    """Llama4ForCausalLM.get_decoder() gives the model itself (no embed_tokens): it was refused
    although its ``model.model`` is a Llama-like decoder; a miss and a hit now give what a
    forward with no cache gives."""
    model = _built(transformers.Llama4TextConfig, transformers.Llama4ForCausalLM,
                   intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
                   num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2,
                   attention_chunk_size=24, interleave_moe_layer_step=2, num_local_experts=4,
                   num_experts_per_tok=1)
    engine = KDNEngine(model, _Tok(), client, RAW)
    with torch.no_grad():
        full = model(torch.tensor([IDS])).logits[0, -1]
    miss = engine.generate(IDS, max_new_tokens=1)
    engine.wait_for_save(30)
    reused, logits = _first_logits(engine, IDS)  # a hit through the connector protocol
    assert reused == 32
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
    assert miss.token_ids == [int(full.argmax())]
