"""Where the blender puts its tensors: on the model's device, in the model's dtype, never on a
default device (practice 14 of STYLE.md).

On a CPU the check runs with the default device set to ``meta``: a tensor made without a
device taken from the blend's inputs (a position list, a mask, a RoPE angle, an index) lands on
``meta`` instead of the CPU, and a ``TorchFunctionMode`` records every torch call whose result
lies off the model's device. On a CUDA host (``-m gpu``) the same tests run on ``cuda`` with the
CPU as the wrong place, and chunks stream from a kdn server straight onto the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
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


class OffDevice(TorchFunctionMode):
    """Records every torch call that returns a tensor off ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                self.strays.append(f"{getattr(func, '__name__', func)} -> {t.device}")
        return out


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
    """The check can fail: a factory call without a device is recorded (lands on meta)."""
    with only_on(torch.device("cpu")) as mode:
        x = torch.ones(3)
        torch.arange(4, device="cpu")  # explicit: fine
    assert x.device.type == "meta"
    assert mode.strays == ["ones -> meta"]


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
