"""KDNEngine with tiny random models whose own transformers cache does not keep every token:
sliding-window Mistral and Gemma 3 (sliding and full layers) store every token's KV and a hit
gives a full prefill's output; a layer of fewer tokens than the prompt is never stored."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kdn import keys
from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import InvalidArgument
from kdn.layout import DType
from kdn.model import hf
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _Tok

IDS = [int(x) for x in torch.randint(1, 256, (100,), generator=torch.Generator().manual_seed(5))]
OTHER = [int(x) for x in torch.randint(1, 256, (10,), generator=torch.Generator().manual_seed(9))]
RAW = EngineConfig(chunk_tokens=32, encodings=(("raw", ""),), calibrate=False)


def _mistral() -> Any:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=48)
    cfg._attn_implementation = "sdpa"
    return transformers.MistralForCausalLM(cfg).eval()


def _gemma3() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    cfg._attn_implementation = "sdpa"
    return transformers.Gemma3ForCausalLM(cfg).eval()


@torch.no_grad()
def _prefilled(model: Any, ids: list[int], n: int) -> list[int]:
    """Greedy tokens, each from a forward over the whole sequence so far (no cache at all),
    up to an end token of the model's (as transformers' generate)."""
    seq, out, stop = list(ids), [], hf.stop_tokens(model, _Tok())
    while len(out) < n and not (out and out[-1] in stop):
        out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        seq.append(out[-1])
    return out


def _longrope() -> Any:
    """A Phi-3-128k-like model: LongRoPE's short factors up to 32 positions, long past them."""
    torch.manual_seed(0)
    factors = {"short_factor": [1.0] * 8, "long_factor": [8.0] * 8}
    cfg = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **factors,
                         "original_max_position_embeddings": 32})
    cfg._attn_implementation = "sdpa"
    return transformers.Phi3ForCausalLM(cfg).eval()


@torch.no_grad()
def _first_logits(engine: KDNEngine, ids: list[int]) -> tuple[int, torch.Tensor]:
    """(tokens reused, next-token logits) of ``ids`` through the connector protocol."""
    reused = engine.start_load(ids, force="raw")
    if not reused:
        return 0, hf.CacheDecoder(engine.model, hf.full_cache(engine.model)).forward(ids)[-1]
    with hf.LayerwiseCache(engine.model, engine.wait_for_layer) as cache:
        logits = hf.CacheDecoder(engine.model, cache).forward(ids[reused:])[-1]
    engine.finish()
    return reused, logits


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        yield c


def _stored_tokens(engine: KDNEngine, ids: list[int]) -> list[int | None]:
    """Per block of ``ids``: tokens of its stored raw entry (None: not stored)."""
    got = []
    for key in engine._chain(ids):  # noqa: SLF001
        kv = engine.client.retrieve(keys.variant_key(key, "raw"), layout=engine.layout)
        got.append(None if kv is None else kv.num_tokens)
    return got


@pytest.mark.parametrize("make", [_mistral, _gemma3])
def test_a_sliding_window_models_hit_matches_a_full_prefill(client: Client, make: Any) -> None:
    model = make()
    engine = KDNEngine(model, _Tok(), client, RAW)
    first = engine.generate(IDS, max_new_tokens=8)
    assert first.token_ids == _prefilled(model, IDS, 8)  # the full cache changes nothing
    assert first.store_thread is not None
    first.store_thread.join(60)
    assert _stored_tokens(engine, IDS) == [32, 32, 32]  # every block whole, the window's too
    shared = IDS[:32] + OTHER  # block 0 only: its KV from before the window
    hit = engine.generate(shared, max_new_tokens=8, force="raw")
    assert hit.timings.reused_tokens == 32 and not hit.timings.load_error
    assert hit.token_ids == _prefilled(model, shared, 8)
    whole = engine.generate(IDS, max_new_tokens=8, force="raw")
    assert whole.timings.reused_tokens == 96 and whole.token_ids == first.token_ids


def test_a_layer_not_of_the_prompts_length_is_not_stored(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that keeps a window (the model's own, as the engine ran before) is refused in
    ``save_layer``: nothing of the request is stored, and the output is the prefill's."""
    from transformers import DynamicCache

    model = _mistral()
    monkeypatch.setattr("kdn.engine.engine.full_cache",
                        lambda m: DynamicCache(config=m.config))  # keeps 47 tokens
    engine = KDNEngine(model, _Tok(), client, RAW)
    got = engine.generate(IDS, max_new_tokens=4)
    assert got.token_ids == _prefilled(model, IDS, 4)
    assert got.store_thread is None
    assert _stored_tokens(engine, IDS) == [None, None, None]


def test_prefill_keeps_every_tokens_kv_of_a_sliding_window_model() -> None:
    model = _mistral()
    layout = hf.model_layout(model, DType.FLOAT32)
    kv, logits = hf.prefill(model, IDS, layout)
    assert kv.num_tokens == len(IDS)
    assert int(logits.argmax()) == _prefilled(model, IDS, 1)[0]


def _llama(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def _not_shared(ea: KDNEngine, eb: KDNEngine, b: Any) -> None:
    """What ``ea`` stores, ``eb`` (of model ``b``) does not load: it computes its own tokens."""
    stored = ea.generate(IDS, max_new_tokens=6)
    assert stored.store_thread is not None
    stored.store_thread.join(60)
    got = eb.generate(IDS, max_new_tokens=6, force="raw")
    assert got.timings.reused_tokens == 0
    assert got.token_ids == _prefilled(b, IDS, 6)


def test_checkpoints_in_folders_of_one_name_do_not_share_kv(
        client: Client, tmp_path: Path) -> None:
    """Two fine-tunes of one config saved as run1/final and run2/final: each engine's keys name
    its own folder, so the second never loads the first one's KV."""
    for run, seed in (("run1", 0), ("run2", 1)):
        _llama(seed).save_pretrained(tmp_path / run / "final")
    a, b = (transformers.LlamaForCausalLM.from_pretrained(tmp_path / run / "final").eval()
            for run in ("run1", "run2"))
    ea, eb = KDNEngine(a, _Tok(), client, RAW), KDNEngine(b, _Tok(), client, RAW)
    assert ea.layout.model_fingerprint != eb.layout.model_fingerprint
    _not_shared(ea, eb, b)
    # the same weights by another path, or copied elsewhere (another machine), are the same
    # weights; a named id is taken as given
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "run2" / ".." / "run1"
                                                          / "final")
    assert hf.model_layout(again).fingerprint == ea.layout.fingerprint
    shutil.copytree(tmp_path / "run1" / "final", tmp_path / "elsewhere" / "final")
    moved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "elsewhere" / "final")
    assert hf.model_layout(moved).fingerprint == ea.layout.fingerprint
    named = EngineConfig(chunk_tokens=32, encodings=(("raw", ""),), weights_id="ft-1")
    ids = {KDNEngine(m, _Tok(), client, named).layout.fingerprint for m in (a, b)}
    assert len(ids) == 1 and ea.layout.fingerprint not in ids  # named alike: one


def test_a_longrope_models_blocks_are_keyed_by_the_prompts_length_regime(
        client: Client) -> None:
    """A LongRoPE model rotates a prompt past original_max_position_embeddings with its long
    factors: a block stored from a short prompt is other KV than that block of a long one,
    and is not its hit; a long prompt's block is, exactly."""
    model = _longrope()
    assert hf.length_regime(model, 32) == b"" and hf.length_regime(model, 33) != b""
    assert hf.length_regime(_llama(0), 500) == b""
    engine = KDNEngine(model, _Tok(), client, dataclasses.replace(RAW, chunk_tokens=16))
    engine.generate(IDS[:20], max_new_tokens=1)  # block 0, short factors
    engine.wait_for_save(30)
    assert engine.matched_tokens(IDS[:32]) == 16 and engine.matched_tokens(IDS) == 0
    with torch.no_grad():
        own = model(torch.tensor([IDS])).logits[0, -1]
    reused, logits = _first_logits(engine, IDS)  # computed whole
    assert reused == 0 and float((logits - own).abs().max()) < 1e-4
    engine.generate(IDS, max_new_tokens=1)  # stores its blocks, long factors
    engine.wait_for_save(30)
    reused, logits = _first_logits(engine, IDS)
    assert reused == 96 and float((logits - own).abs().max()) < 1e-4


def test_kv_computed_in_another_dtype_is_no_exact_hit(client: Client) -> None:
    """A bf16 model whose engine stores fp32 KV does not write the fp32 model's keys (its
    KV is not what the fp32 model computes), nor the reverse; a layout stored as computed
    keeps the fingerprint it had, which the blender's checks use."""
    fp32, bf16 = _llama(0), _llama(0).to(torch.bfloat16)
    writer = KDNEngine(bf16, _Tok(), client, dataclasses.replace(RAW, kv_dtype=DType.FLOAT32))
    reader = KDNEngine(fp32, _Tok(), client, RAW)
    assert writer.layout.fingerprint != reader.layout.fingerprint
    assert reader.layout == hf.model_layout(fp32)  # the usual case: unchanged
    assert KDNEngine(bf16, _Tok(), client, RAW).layout == hf.model_layout(bf16)
    down = KDNEngine(fp32, _Tok(), client, dataclasses.replace(RAW, kv_dtype=DType.BFLOAT16))
    assert down.layout.fingerprint != hf.model_layout(bf16).fingerprint
    assert down.layout == dataclasses.replace(hf.model_layout(fp32), dtype=DType.BFLOAT16,
                                              model_fingerprint=down.layout.model_fingerprint)
    _not_shared(writer, reader, fp32)


def test_the_default_weights_id() -> None:
    model = _llama(0)
    # built from a config: its parameters tell
    assert hf.default_weights_id(model) == f"params#{hf.parameters_digest(model)}"
    model.name_or_path = "org/some-model"
    assert hf.default_weights_id(model) == "org/some-model"
    model.config._commit_hash = "0123abcd"
    assert hf.default_weights_id(model) == "org/some-model@0123abcd"
    with pytest.raises(ValueError, match="weights_id"):
        EngineConfig(weights_id=3)  # type: ignore[arg-type]


def test_models_built_from_one_config_do_not_share_kv(client: Client) -> None:
    """Two models built from one config and given their weights by load_state_dict (as
    training code does) name no folder: each is named by its parameters, and the same weights
    loaded again are the same model."""
    a, b = (_llama(0).eval() for _ in range(2))
    b.load_state_dict(_llama(1).state_dict())
    ea, eb = KDNEngine(a, _Tok(), client, RAW), KDNEngine(b, _Tok(), client, RAW)
    assert ea.layout.model_fingerprint != eb.layout.model_fingerprint
    again = _llama(2)
    again.load_state_dict(a.state_dict())
    assert hf.model_layout(again).fingerprint == ea.layout.fingerprint
    with torch.no_grad():  # weights changed in place after it was named (a training step)
        next(again.parameters()).add_(1.0)
    assert hf.model_layout(again).fingerprint != ea.layout.fingerprint
    _not_shared(ea, eb, b)


def test_checkpoints_in_subfolders_of_one_root_do_not_share_kv(
        client: Client, tmp_path: Path) -> None:
    """from_pretrained(root, subfolder=...) leaves name_or_path at the root, which holds no
    weights: each checkpoint is named by its loaded parameters, never by the root's path."""
    root = tmp_path / "root"
    for sub, seed in (("ckpt-a", 0), ("ckpt-b", 1)):
        _llama(seed).save_pretrained(root / sub)
    a, b, a2 = (transformers.LlamaForCausalLM.from_pretrained(root, subfolder=sub).eval()
                for sub in ("ckpt-a", "ckpt-b", "ckpt-a"))
    ea, eb = KDNEngine(a, _Tok(), client, RAW), KDNEngine(b, _Tok(), client, RAW)
    assert ea.layout.model_fingerprint != eb.layout.model_fingerprint
    assert hf.model_layout(a2).fingerprint == ea.layout.fingerprint  # the same weights again
    _not_shared(ea, eb, b)


def test_a_folder_of_several_gguf_files_names_no_weights(tmp_path: Path) -> None:
    """Which GGUF file of a folder a load took (gguf_file=) is not recorded: such a folder's
    files name no one checkpoint; one GGUF file alone does."""
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF" + bytes(100))
    assert hf.weights_digest(tmp_path) is not None
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"GGUF" + bytes(200))
    assert hf.weights_digest(tmp_path) is None
    model = _llama(0)
    model.name_or_path = str(tmp_path)
    assert hf.default_weights_id(model) == f"params#{hf.parameters_digest(model)}"
    assert hf.parameters_digest(model) != hf.parameters_digest(_llama(1))


def test_a_hub_checkpoint_in_a_subfolder_names_its_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub snapshot (in the local hub cache) with no weights at its root was loaded with
    subfolder=: its id adds the parameters' digest; one with its weights at the root keeps
    name@revision."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshots = tmp_path / "models--org--m" / "snapshots"
    _llama(0).save_pretrained(snapshots / "abc" / "sub")
    model = _llama(0)
    model.name_or_path, model.config._commit_hash = "org/m", "abc"
    assert hf.default_weights_id(model) == f"org/m@abc#params-{hf.parameters_digest(model)}"
    _llama(0).save_pretrained(snapshots / "def")
    model.config._commit_hash = "def"
    assert hf.default_weights_id(model) == "org/m@def"


@pytest.mark.parametrize("make", [
    lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4))], ids=["gpt2", "gpt-neox"])
def test_a_model_not_llama_like_is_refused_by_name(client: Client, make: Any) -> None:
    """GPT-2 and GPT-NeoX decoders have no embed_tokens nor layers: the engine refuses them,
    naming the class and what it needs (an AttributeError came from deep inside before)."""
    model = make().eval()
    name = type(model).__name__
    with pytest.raises(InvalidArgument, match=f"{name} is not a model kdn drives.*embed_tokens"):
        KDNEngine(model, _Tok(), client, RAW)
    with pytest.raises(InvalidArgument, match=name):
        hf.decoder_layers(model)


def test_a_causal_lm_whose_get_decoder_gives_none_is_driven_through_model_model() -> None:
    """transformers 4.56's LlamaForCausalLM.get_decoder() returned None: kdn refused every Llama
    ('its decoder NoneType has not'); its decoder is then ``model.model``."""

    class _NoDecoder(transformers.LlamaForCausalLM):  # type: ignore[misc]
        def get_decoder(self) -> None:
            return None

    model = _NoDecoder(_llama(0).config).eval()
    layout = hf.model_layout(model)
    assert hf.decoder_layers(model) is model.model.layers
    kv, _ = hf.prefill(model, torch.tensor(IDS[:8]), layout)
    assert kv.num_tokens == 8
