"""What KDNEngine.generate takes: one prompt (a text, ids, or a tensor of them, a batch of one
included), ids in the model's vocabulary, at least one new token, a prompt and new tokens that
fit the model's context, and ``force`` naming one of the engine's own choices; anything else
is an InvalidRequest that names it (kdn's InvalidArgument, and a ValueError as transformers'
generate raises), before anything is computed or stored."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import InvalidArgument
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _model, _Tok

IDS = [int(x) for x in torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KDNEngine]:
    data: Path = tmp_path_factory.mktemp("data")
    cfg = ServerConfig(port=0, data_dir=data, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c, KDNEngine(
            _model(torch.float32, "cpu"), _Tok(), c,
            EngineConfig(chunk_tokens=16, encodings=(("raw", ""),), calibrate=False)) as eng:
        yield eng


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_fewer_than_one_new_token_is_refused(engine: KDNEngine, n: object) -> None:
    with pytest.raises(InvalidArgument, match=f"max_new_tokens .*got {n!r}") as raised:
        engine.generate(IDS, max_new_tokens=n)  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError)  # as transformers' generate refuses it


def test_a_prompt_past_the_models_context_is_refused_before_anything_is_stored(
        engine: KDNEngine) -> None:
    """A prompt longer than max_position_embeddings (positions the model was never trained
    on), or new tokens past it, is refused naming both lengths; no block of it is stored."""
    context = engine.model.config.max_position_embeddings
    chunk = engine.config.chunk_tokens
    ids = [int(x) for x in torch.randint(
        1, 256, (context + 1,), generator=torch.Generator().manual_seed(7))]
    with pytest.raises(InvalidArgument, match=f"prompt of {context + 1} tokens is longer than "
                       f"the model's context of {context} tokens") as raised:
        engine.generate(ids, max_new_tokens=1)
    assert isinstance(raised.value, ValueError)
    fits = ids[: context - 4]
    with pytest.raises(InvalidArgument, match=f"prompt of {context - 4} tokens and "
                       f"max_new_tokens=6 need {context + 1} positions.*context of {context} "
                       "tokens.*at most 5 new tokens"):
        engine.generate(fits, max_new_tokens=6)
    assert engine.matched_tokens(ids) == 0  # no block of either prompt was stored
    # the last new token is never fed back: it takes no position
    assert len(engine.generate(fits, max_new_tokens=5).token_ids) == 5
    engine.wait_for_save(30)
    assert engine.matched_tokens(fits) == (len(fits) - 1) // chunk * chunk


def test_a_prompt_of_the_whole_context_gets_its_one_token(engine: KDNEngine) -> None:
    """As from transformers' generate: the first new token needs only the prompt's positions."""
    context = engine.model.config.max_position_embeddings
    ids = [int(x) for x in torch.randint(
        1, 256, (context,), generator=torch.Generator().manual_seed(8))]
    with torch.no_grad():
        want = int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
    assert engine.generate(ids, max_new_tokens=1).token_ids == [want]
    engine.wait_for_save(30)
    with pytest.raises(InvalidArgument, match="at most 1 new tokens"):
        engine.generate(ids, max_new_tokens=2)


def test_decoding_stops_at_every_end_token_of_the_model(engine: KDNEngine) -> None:
    """transformers' generate stops at each id of generation_config.eos_token_id (a chat
    model's end-of-turn tokens), not only at the tokenizer's EOS; so does the engine."""
    gen = engine.model.generation_config
    before, gen.eos_token_id = gen.eos_token_id, None
    try:
        free = engine.generate(IDS, max_new_tokens=8, force="recompute").token_ids
        assert len(free) == 8
        never = next(t for t in range(256) if t not in free)
        gen.eos_token_id = [never, free[2]]
        assert engine.generate(IDS, max_new_tokens=8).token_ids == free[: free.index(free[2]) + 1]
        gen.eos_token_id = free[1]
        assert engine.generate(IDS, max_new_tokens=8).token_ids == free[: free.index(free[1]) + 1]
    finally:
        gen.eos_token_id = before


def test_a_batch_of_one_is_one_prompt_and_a_batch_of_more_is_refused(engine: KDNEngine) -> None:
    want = engine.generate(IDS, max_new_tokens=4).token_ids
    assert len(want) == 4
    for same in (torch.tensor([IDS]), torch.tensor(IDS), [IDS], tuple(IDS),
                 [torch.tensor(IDS)], list(torch.tensor(IDS))):  # (the last: 0-d tensors)
        assert engine.generate(same, max_new_tokens=4).token_ids == want  # type: ignore[arg-type]
    for batch in (torch.tensor([IDS, IDS]), [IDS, IDS]):
        with pytest.raises(InvalidArgument, match="one prompt, got a batch of 2"):
            engine.generate(batch, max_new_tokens=4)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="integer dtype"):
        engine.generate(torch.tensor(IDS, dtype=torch.float32), max_new_tokens=4)
    with pytest.raises(InvalidArgument, match=r"\[1, 1, 40\]"):
        engine.generate(torch.tensor([[IDS]]), max_new_tokens=4)
    for text in (b"Paris is", bytearray(b"Paris"), [b"Paris is"]):  # bytes' items pass for ids
        with pytest.raises(InvalidArgument, match="holding bytes: decode them to text"):
            engine.generate(text, max_new_tokens=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt,named", [
    (IDS[:-1] + [300], r"token id 300 \(token 39 of the prompt\).*\(0..255\)"),
    ([-1] + IDS, r"token id -1 \(token 0 "),
    (IDS[:5] + [2.0], "token 5 of the prompt is 2.0"),
    ([], "empty prompt"),
])
def test_an_id_that_is_not_the_models_is_refused_naming_it(
        engine: KDNEngine, prompt: list[int], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        engine.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("ids,named", [
    (list(torch.tensor([IDS])), r"token 0 is tensor\(\["),  # a batch as a list of tensors
    (IDS[:3] + [torch.tensor(2.0)], r"token 3 is tensor\(2\.\)"),
    (IDS[:3] + [torch.tensor([4, 5])], r"token 3 is tensor\(\[4, 5\]\)"),
])
def test_the_connector_refuses_what_is_no_token_id_naming_it(
        engine: KDNEngine, ids: list[object], named: str) -> None:
    for call in (engine.matched_tokens, engine.start_load):
        with pytest.raises(InvalidArgument, match=named):
            call(ids)  # type: ignore[arg-type]
    assert engine.matched_tokens(list(torch.tensor(IDS))) >= 0  # 0-d integer tensors are ids


def test_save_layer_refuses_a_layer_the_model_does_not_have(engine: KDNEngine) -> None:
    k = torch.zeros(2, len(IDS), 16)
    for i in (3, 7, -1, True, 1.0):
        with pytest.raises(InvalidArgument, match=rf"save_layer: layer .*\[0, 3\), got {i!r}"):
            engine.save_layer(i, k, k)  # type: ignore[arg-type]


def test_save_layer_refuses_kv_not_of_the_layers_shape_and_stores_what_is(
        engine: KDNEngine) -> None:
    """K/V with the batch dimension kept, or other heads or channels, are refused naming the
    shape expected (they passed, and the store-back thread died on them: nothing stored)."""
    ids = [int(x) for x in torch.randint(1, 256, (50,), generator=torch.Generator().manual_seed(9))]
    lay = engine.layout.layers[0]
    heads, ch, n = lay.kv_heads, lay.k_channels, len(ids)
    engine.start_load(ids)
    for shape in ((1, heads, n, ch), (heads + 1, n, ch), (heads, n, ch // 2), (n, ch)):
        with pytest.raises(InvalidArgument, match=rf"save_layer: layer 0's K has shape "
                           rf"{re.escape(str(shape))}, expected .*\[{heads}, tokens, {ch}\]"):
            engine.save_layer(0, torch.zeros(shape), torch.zeros(heads, n, ch))
    with pytest.raises(InvalidArgument, match="layer 0's V must be a torch tensor"):
        engine.save_layer(0, torch.zeros(heads, n, ch), [[0.0]])  # type: ignore[arg-type]
    for i in range(engine.layout.num_layers):
        engine.save_layer(i, torch.randn(heads, n, ch), torch.randn(heads, n, ch))
    engine.wait_for_save()
    engine.finish()
    assert engine.matched_tokens(ids) == 48  # every whole block of 16


@pytest.mark.parametrize("force", ["bogus", "int8", "lossless", "Raw", ""])
def test_force_names_one_of_the_engines_choices(engine: KDNEngine, force: str) -> None:
    with pytest.raises(InvalidArgument, match=r"\['raw', 'recompute'\]"):
        engine.generate(IDS, max_new_tokens=2, force=force)
    with pytest.raises(InvalidArgument, match=repr(force)):
        engine.start_load(IDS, force=force)
    for ok in ("raw", "recompute", None):
        assert len(engine.generate(IDS, max_new_tokens=2, force=ok).token_ids) == 2
