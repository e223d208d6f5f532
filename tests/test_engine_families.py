"""KDNEngine and model families: per-layer head sizes (Gemma 4) are InvalidLayout, and a
decoder with an embedding per codebook (Musicgen) is refused with InvalidArgument; Llama 4,
whose ``get_decoder()`` gives the model itself, is driven through ``model.model`` and served
exactly.
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
