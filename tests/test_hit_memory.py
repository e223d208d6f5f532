"""What a hit leaves behind in the client's memory: nothing for the garbage collector (the
entry's buffers go back to their pools the moment its tensors do, so the next hit reuses
memory already faulted in), and verbatim bodies that no tensor can view where they lie (fp32
after a record prefix) copied into one recycled buffer, not into fresh memory layer by layer."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from kdn import codec
from kdn.client import Client
from kdn.codec.api import StreamDecoder
from kdn.layout import DType
from kdn.transport.buffers import RECEIVED
from tests.helpers import numbered_key, random_kv, uniform_layout


@pytest.fixture
def no_collector() -> Iterator[list[object]]:
    """The cyclic garbage collector off (what it finds is kept, not freed) for the test; what
    it found when the test collected, listed."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def _kdn_garbage(found: list[object]) -> list[str]:
    return sorted({type(o).__qualname__ for o in found
                   if type(o).__module__.startswith("kdn.")})


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.FLOAT32])
def test_a_network_hit_makes_no_reference_cycles(remote: Client, no_collector: list[object],
                                                 dtype: DType) -> None:
    layout = uniform_layout(layers=6, heads=2, dim=64, dtype=dtype)
    kvs = [random_kv(layout, tokens=256, seed=i) for i in range(3)]
    ks = [numbered_key(i) for i in range(3)]
    remote.store_many(list(zip(ks, kvs)), mode="raw")
    remote.flush()
    for _ in range(2):
        streams = remote.retrieve_streams(ks)
        for kv, s in zip(kvs, streams):
            assert s is not None
            got = s.result(timeout=30)
            for (k, v), (k0, v0) in zip(got.layers, kv.layers):
                assert torch.equal(k, k0) and torch.equal(v, v0)
        del streams, got, k, v
    gc.collect()
    assert _kdn_garbage(no_collector) == [], (
        "a hit's objects were freed only by the garbage collector (its buffers with them)")


def test_misaligned_borrowed_bodies_land_in_one_recycled_buffer() -> None:
    """fp32 bodies after a 14-byte record prefix lie 2 bytes off alignment in a frame of
    several layers: no tensor views them there, so they are copied, all into one pooled
    buffer per entry."""
    layout = uniform_layout(layers=6, heads=2, dim=64, dtype=DType.FLOAT32)
    kv = random_kv(layout, tokens=512)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=3)
    frames = [memoryview(bytearray(f)) for f in parts.frames]  # writable, handed over
    before = RECEIVED.created + RECEIVED.reused
    dec = StreamDecoder(parts.header, "cpu", borrow=True)
    layers = [(k, v) for i, f in enumerate(frames) for _, k, v in dec.decode_frame(i, f)]
    assert RECEIVED.created + RECEIVED.reused == before + 1, (
        "the layers no tensor could view were not copied into one pooled buffer")
    for (k, v), (k0, v0) in zip(layers, kv.layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # the aligned ones still view the frames in place
    base = [memoryview(f).obj for f in frames]
    viewing = [any(_inside(k, b) for b in base) for k, _ in layers]
    assert any(viewing) and not all(viewing), viewing


def _inside(t: torch.Tensor, buf: object) -> bool:
    import numpy as np

    arr = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
    lo = arr.ctypes.data
    return lo <= t.data_ptr() < lo + arr.nbytes
