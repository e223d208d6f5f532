"""Where the blender puts its tensors: on the model's device, in the model's dtype, never on a
default device (practice 14 of STYLE.md).

On a CPU the check runs with the default device set to ``meta``: a tensor made without a
device taken from the blend's inputs (a position list, a mask, a RoPE angle, an index) lands on
``meta`` instead of the CPU, and a ``TorchFunctionMode`` records every torch call whose result
lies off the model's device, and every floating tensor a factory makes in torch's default dtype
(none given). On a CUDA host (``-m gpu``) the same tests run on ``cuda`` with the CPU as the
wrong place, and chunks stream from a kdn server straight onto the GPU. Covered: ``blend`` under
every selection rule in fp32/fp16/bf16, chunks resident and streamed (``LayerStream``), the
Blend RPC's model side, decoding after a blend, and RAG (``KnowledgeBase.ask``, ingest).

A second mode, ``HostReads``, records the calls that read a tensor back to the host (a sync on
a GPU: ``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing, ...): a blend makes a few
per pass, never one per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from kdn.blend import BlendConfig, Piece, blend
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import DType
from kdn.model import hf
from kdn.model.hf import model_layout
from tests.test_blend import ids, tiny

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

CONFIGS = {
    "question": BlendConfig(ratio=0.2),
    "deviation": BlendConfig(ratio=0.2, query_share=0.0),
    "mixed-corrected": BlendConfig(ratio=0.3, query_share=0.5, correct_k=0.5, correct_v=1.0),
    "chunk-head": BlendConfig(ratio=0.0, head_tokens=4),
    "per-chunk-heads": BlendConfig(ratio=0.1, head_tokens=2, per_chunk=True),
    "naive": BlendConfig(ratio=0.0),
    "full": BlendConfig(ratio=1.0),
}


FACTORIES = frozenset({"arange", "as_tensor", "empty", "eye", "full", "linspace", "ones",
                       "rand", "randn", "scalar_tensor", "tensor", "zeros"})


class OffDevice(TorchFunctionMode):
    """Records every torch call that returns a tensor off ``device``, and every factory call
    that makes a floating tensor in the default dtype (no ``dtype=``)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                self.strays.append(f"{name} -> {t.device}")
        if name in FACTORIES and "dtype" not in (kwargs or {}) and \
                isinstance(out, torch.Tensor) and out.is_floating_point():
            self.strays.append(f"{name} -> default dtype {out.dtype}")
        return out


HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                        "nonzero", "argwhere", "masked_select", "unique", "cpu", "numpy"})


class HostReads(TorchFunctionMode):
    """Records every torch call that reads a tensor back to the host (on a GPU, a wait for
    everything queued before it): by name, and indexing by a boolean mask (its result's size
    is the mask's count)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool
                for t in tree_flatten(args[1:2])[0]):
            self.calls.append(f"{name}[mask]")
        return func(*args, **(kwargs or {}))


@contextmanager
def only_on(device: torch.device) -> Iterator[OffDevice]:
    """Inside: a tensor made without an explicit device goes to the wrong place (meta when the
    model is on the CPU, the CPU otherwise), and every result off ``device`` is recorded."""
    wrong = "meta" if device.type == "cpu" else "cpu"
    with torch.device(wrong), OffDevice(device) as mode:
        yield mode


def _prompt(model: Any, device: torch.device, chunk_dtype: torch.dtype
            ) -> tuple[list[Piece], list[KVCache]]:
    """text, three chunks (prefilled alone, KV in ``chunk_dtype`` on ``device``), text."""
    own = model_layout(model, DType.of(next(model.parameters()).dtype))
    layout = model_layout(model, DType.of(chunk_dtype))
    parts = [ids(n, seed=i) for i, n in enumerate((9, 23, 17, 30, 6))]
    chunks = []
    for p in parts[1:-1]:
        with torch.no_grad():
            out = model(torch.tensor([p], device=device), use_cache=True)
        kv = hf.from_transformers(out.past_key_values, own)
        chunks.append(KVCache(layout, [(k.to(device, chunk_dtype), v.to(device, chunk_dtype))
                                       for k, v in kv.layers]))
    pieces = [Piece(parts[0])] + [Piece(p, kv) for p, kv in zip(parts[1:-1], chunks)] + [
        Piece(parts[-1])]
    return pieces, chunks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tensor_of_a_blend_is_made_on_the_models_device(device: str, name: str) -> None:
    dev = torch.device(device)
    model = tiny("qwen3").to(dev)
    pieces, _ = _prompt(model, dev, torch.float32)
    with only_on(dev) as mode:
        result = blend(model, pieces, CONFIGS[name])
    assert mode.strays == [], sorted(set(mode.strays))
    assert result.logits.device.type == dev.type and result.recomputed.device.type == dev.type
    assert all(k.device.type == dev.type and v.device.type == dev.type
               for k, v in result.kv.layers)


def test_the_device_check_catches_a_tensor_made_on_the_default_device() -> None:
    """The check can fail: a factory call without a device is recorded (lands on meta), and
    one of a floating tensor without a dtype."""
    with only_on(torch.device("cpu")) as mode:
        x = torch.ones(3)
        torch.arange(4, device="cpu")  # explicit (and integer): fine
        torch.zeros(2, dtype=torch.float16, device="cpu")  # explicit: fine
        torch.zeros(2, device="cpu")
    assert x.device.type == "meta"
    assert mode.strays == ["ones -> meta", f"ones -> default dtype {torch.get_default_dtype()}",
                           f"zeros -> default dtype {torch.get_default_dtype()}"]


def test_the_host_read_check_catches_each_kind() -> None:
    x = torch.arange(6, device="cpu")
    with HostReads() as reads:
        x.sum().item()
        x.tolist()
        bool(x.any())
        int(x[0])
        x[x > 2]
        x.nonzero()
        x.cpu()
        x[torch.tensor([1, 2], device="cpu")]  # by index: no read back
        x[1:3]
    assert reads.calls == ["item", "tolist", "__bool__", "__int__", "__getitem__[mask]",
                           "nonzero", "cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,chunk_dtype,tol", [
    (torch.float32, torch.float16, 2e-2),  # chunks stored in another dtype than the model's
    (torch.bfloat16, torch.bfloat16, 1e-1),
    (torch.float16, torch.float32, 5e-2),
])
def test_blend_in_the_models_dtype_matches_its_prefill(device: str, dtype: torch.dtype,
                                                       chunk_dtype: torch.dtype,
                                                       tol: float) -> None:
    """Ratio 1 in the model's dtype is the model's own prefill (within that dtype's rounding);
    chunks in another dtype are converted on the way in; the result keeps the chunks' dtype."""
    dev = torch.device(device)
    model = tiny("llama").to(dev, dtype)
    pieces, _ = _prompt(model, dev, chunk_dtype)
    all_ids = [t for p in pieces for t in p.ids]
    with torch.no_grad():
        want = model(torch.tensor([all_ids], device=dev)).logits[0, -1].float()
    with only_on(dev) as mode:
        got = blend(model, pieces, BlendConfig(ratio=1.0))
        naive = blend(model, pieces, BlendConfig(ratio=0.2))
    assert mode.strays == []
    assert got.logits.dtype == dtype and got.kv.layers[0][0].dtype == chunk_dtype
    torch.testing.assert_close(got.logits.float(), want, atol=tol * float(want.abs().max()),
                               rtol=0)
    assert torch.isfinite(naive.logits).all()


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_streamed_onto_the_device_blend_like_resident(client: Client,
                                                             device: str) -> None:
    dev = torch.device(device)
    model = tiny("qwen2").to(dev)
    pieces, chunks = _prompt(model, dev, torch.float32)
    want = blend(model, pieces, BlendConfig(ratio=0.3))
    streamed = []
    for j, p in enumerate(pieces):
        if p.kv is None:
            streamed.append(p)
            continue
        key = bytes([40 + j]) * 32
        client.store(key, chunks[j - 1], mode="lossless")
        stream = client.retrieve_stream(key, layout=chunks[0].layout, device=dev)
        assert stream is not None
        streamed.append(Piece(p.ids, stream))
    # on CUDA a stream may stage layers in pinned host memory as it lands them (delivery's
    # work, not the blend's): there the placement check covers the resident tests only
    with only_on(dev) if device == "cpu" else nullcontext() as mode:
        got = blend(model, streamed, BlendConfig(ratio=0.3))
    assert mode is None or mode.strays == []
    assert got.kv.equal(want.kv) and torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("device", DEVICES)
def test_the_blend_rpc_served_by_a_model_on_the_device(server_config: Any, device: str) -> None:
    """A server hosting a model on ``device`` decodes stored chunks onto it and answers the
    blend a local call computes."""
    from kdn.blend.host import ModelBlender
    from kdn.client.blend import RemotePiece
    from kdn.keys import chunk_key
    from kdn.server import ServerThread

    dev = torch.device(device)
    model = tiny("llama").to(dev)
    pieces, chunks = _prompt(model, dev, torch.float32)
    want = blend(model, pieces, BlendConfig(ratio=0.3))
    layout = chunks[0].layout
    with ServerThread(server_config) as st, Client(st.address, timeout_s=30) as c:
        assert st.server is not None
        st.server.servicer.blender = ModelBlender(model, None)
        remote = []
        for p in pieces:
            if p.kv is None:
                remote.append(RemotePiece(ids=p.ids))
                continue
            key = chunk_key(p.ids, layout)
            c.store(key, chunks[len(remote) - 1])
            remote.append(RemotePiece(ids=p.ids, key=key))
        got = c.blend(remote, ratio=0.3)
    assert got.equal(KVCache(layout, [(k.cpu(), v.cpu()) for k, v in want.kv.layers]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_selection_rule_in_half_precision_stays_on_the_device(
        device: str, dtype: torch.dtype, name: str) -> None:
    dev = torch.device(device)
    model = tiny("llama").to(dev, dtype)
    pieces, _ = _prompt(model, dev, dtype)
    with only_on(dev) as mode:
        got = blend(model, pieces, CONFIGS[name])
    assert mode.strays == [], sorted(set(mode.strays))
    assert got.logits.dtype == dtype and torch.isfinite(got.logits).all()
    assert all(k.dtype == dtype and v.dtype == dtype for k, v in got.kv.layers)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("name", ["question", "mixed-corrected", "chunk-head"])
def test_a_blend_does_not_depend_on_torchs_default_dtype(name: str) -> None:
    """Scores are float32 whatever ``torch.set_default_dtype`` says (a script that sets fp16
    before loading a model gets the blend it would get otherwise)."""
    model = tiny("llama")
    pieces, _ = _prompt(model, torch.device("cpu"), torch.float32)
    want = blend(model, pieces, CONFIGS[name])
    with default_dtype(torch.float16):
        got = blend(model, pieces, CONFIGS[name])
    assert torch.equal(got.recomputed, want.recomputed)
    assert torch.equal(got.logits, want.logits) and got.kv.equal(want.kv)


def _reads(model: Any, config: BlendConfig) -> list[str]:
    pieces, _ = _prompt(model, torch.device("cpu"), torch.float32)
    with HostReads() as reads:
        blend(model, pieces, config)
    return reads.calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_host_reads_of_a_blend_do_not_grow_with_its_layers(name: str) -> None:
    """A blend reads back to the host a few times per pass (where its rows are, how many),
    never per layer: a 12-layer model's blend reads what a 4-layer one's does, and never
    copies a tensor to the host."""
    shallow = _reads(tiny("llama", layers=4), CONFIGS[name])
    deep = _reads(tiny("llama", layers=12), CONFIGS[name])
    assert deep == shallow, (shallow, deep)
    assert len(deep) <= 8 and not {"cpu", "numpy", "item"} & set(deep), deep


def test_chunks_placed_by_concat_positions_stay_on_their_device() -> None:
    """``concat_positions`` re-rotates each chunk's keys where they lie, reading nothing back
    per layer."""
    from kdn.blend import concat_positions

    model = tiny("llama")
    _, chunks = _prompt(model, torch.device("cpu"), torch.float32)
    with only_on(torch.device("cpu")) as mode, HostReads() as reads:
        placed = concat_positions(chunks)
    assert mode.strays == [] and reads.calls == []
    assert placed.num_tokens == sum(c.num_tokens for c in chunks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name,level", [("lossless", ""), ("kdn", "default")])
def test_the_blend_rpc_model_side_decodes_and_blends_on_the_device(
        device: str, mode_name: str, level: str) -> None:
    """``ModelBlender`` (the Blend RPC's model side) decodes stored chunks onto the model's
    device and blends there: what a local blend of the decoded chunks gives."""
    from kdn import codec
    from kdn.blend.host import ModelBlender
    from kdn.client.blend import RemotePiece, blend_request
    from kdn.keys import chunk_key

    dev = torch.device(device)
    model = tiny("llama").to(dev)
    pieces, chunks = _prompt(model, dev, torch.float32)
    stored, remote, local = {}, [], []
    for p in pieces:
        if p.kv is None:
            remote.append(RemotePiece(ids=p.ids))
            local.append(p)
            continue
        key = chunk_key(p.ids, chunks[0].layout)
        stored[key] = codec.encode_parts(chunks[len(stored)], mode_name, level).to_bytes()
        remote.append(RemotePiece(ids=p.ids, key=key))
        local.append(Piece(p.ids, codec.decode(stored[key], device=dev)))
    request = blend_request(remote, namespace="default", ratio=0.3, select_layer=1,
                            head_tokens=0, per_chunk=False, store=False, mode="lossless",
                            level="", layout=None)
    job = ModelBlender(model, None).plan(request, stored.get)
    # on CUDA the codec stages frames in pinned host memory (delivery's work, not the blend's)
    with only_on(dev) if device == "cpu" else nullcontext() as mode:
        got = blend(job.model, job.pieces, job.config)
    assert mode is None or mode.strays == [], sorted(set(mode.strays))
    want = blend(model, local, job.config)
    assert got.kv.equal(want.kv) and torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_after_a_blend_stays_on_the_device(device: str) -> None:
    """The prefill of a missing chunk and both decoders after a blend (kdn's ``Continuation``
    and the model's own forward over a transformers cache) make their tensors on the model's
    device."""
    from kdn.blend.decode import Continuation

    dev = torch.device(device)
    model = tiny("llama").to(dev)
    pieces, _ = _prompt(model, dev, torch.float32)
    result = blend(model, pieces, BlendConfig(ratio=0.2))
    with only_on(dev) as mode:
        kv, _ = hf.prefill(model, pieces[1].ids, model_layout(model))
        ours = hf.greedy(Continuation(model, result.kv, 4), result.logits, 4)
        theirs = hf.greedy(hf.CacheDecoder(model, hf.to_transformers(result.kv)),
                           result.logits, 4)
    assert mode.strays == [], sorted(set(mode.strays))
    assert kv.layers[0][0].device.type == dev.type and len(ours) == len(theirs) == 4


def test_continuation_reads_nothing_back_per_token() -> None:
    """``Continuation.forward`` plans its rows' attention from positions the host knows: a
    decoding step reads nothing back, at any depth (greedy's one argmax per token aside)."""
    from kdn.blend.decode import Continuation

    for layers in (4, 12):
        model = tiny("llama", layers=layers)
        pieces, _ = _prompt(model, torch.device("cpu"), torch.float32)
        result = blend(model, pieces, BlendConfig(ratio=0.2))
        cont = Continuation(model, result.kv, 4)
        with HostReads() as reads:
            cont.forward([5])
            logits = cont.forward([6, 7])
        assert reads.calls == [], (layers, reads.calls)
        assert logits.shape[0] == 2 and torch.isfinite(logits).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rag_ask_keeps_every_tensor_on_the_models_device(client: Client, tmp_path: Path,
                                                         device: str) -> None:
    """``kdn rag``'s path: ingest (prefill, store, embed, index) and ask (retrieve, fetch
    each chunk onto the model's device or compute a missing one, blend, decode)."""
    from tests.test_rag import CONFIG, corpus, make_kb, tiny_llama

    dev = torch.device(device)
    model = tiny_llama().to(dev)
    kb = make_kb(model, client, tmp_path / "state")
    question = "Which river flows north in Africa, the Nile?"
    # on CUDA delivery stages layers in pinned host memory and the embedder runs on the CPU
    with only_on(dev) if device == "cpu" else nullcontext() as mode:
        kb.ingest(corpus(tmp_path))
        first = kb.ask(question)
        client.delete(bytes.fromhex(first.sources[0].key), namespace=CONFIG.namespace)
        again = kb.ask(question)  # one chunk computed on the request path
    assert mode is None or mode.strays == [], sorted(set(mode.strays))
    assert first.timings.missing_chunks == 0 and again.timings.missing_chunks == 1
    assert again.token_ids == first.token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rag_index_takes_a_query_embedded_on_the_gpu() -> None:
    """An embedder on the GPU gives its question vector there; the index lives on the host."""
    from kdn.rag.index import VectorIndex

    index = VectorIndex()
    vectors = torch.nn.functional.normalize(torch.randn(5, 8, device="cuda"), dim=1)
    index.add([f"k{i}" for i in range(5)], vectors)
    assert index.search(vectors[3], 1)[0][0] == "k3"
