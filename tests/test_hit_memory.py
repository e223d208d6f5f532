"""What a hit leaves behind in the client's memory: nothing for the garbage collector (the
entry's buffers go back to their pools the moment its tensors do, so the next hit reuses
memory already faulted in), also when it fails (its error, kept by the stream that failed or
raised up the frames that read it, holds none of them); and verbatim bodies that no tensor can
view where they lie (fp32 after a record prefix) copied into one recycled buffer, not into
fresh memory layer by layer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kdn import codec
from kdn.client import Client
from kdn.codec.api import StreamDecoder
from kdn.errors import Cancelled, Corrupt, InvalidArgument, LayoutMismatch, again, kept
from kdn.layout import DType
from kdn.server import ServerThread
from kdn.server.streamed import Desynced
from kdn.transport.buffers import RECEIVED
from tests.collected import collected, cycles, kdn_garbage
from tests.helpers import numbered_key, random_kv, uniform_layout

_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.FLOAT32])
@pytest.mark.parametrize("mode", ["raw", "int8"])
def test_a_network_hit_makes_no_reference_cycles(remote: Client, dtype: DType, mode: str,
                                                 device: str) -> None:
    """On a GPU the entries land in page-locked memory, which torch's host allocator hands
    out again only once nothing refers to it: a cycle would cost a new page-locked
    allocation per hit."""
    layout = uniform_layout(layers=6, heads=2, dim=64, dtype=dtype)
    kvs = [random_kv(layout, tokens=256, seed=i) for i in range(3)]
    ks = [numbered_key(i) for i in range(3)]
    remote.store_many(list(zip(ks, kvs)), mode=mode)
    remote.flush()
    want = [codec.decode(codec.encode(kv, mode)) for kv in kvs]

    def hit() -> None:
        for kv, s in zip(want, remote.retrieve_streams(ks, device=device)):
            assert s is not None
            got = s.result(timeout=30)
            for (k, v), (k0, v0) in zip(got.layers, kv.layers):
                assert torch.equal(k.cpu(), k0) and torch.equal(v.cpu(), v0)

    found = collected(hit)
    assert kdn_garbage(found) == [], (
        "a hit's objects were freed only by the garbage collector (its buffers with them):\n"
        + cycles(found))


LAYOUT = uniform_layout(layers=6, heads=2, dim=64)
OTHER = uniform_layout(layers=6, heads=2, dim=32)  # what a caller expecting another model asks
PATHS = {"network": {"shm_bytes": 0}, "grpc": {"shm_bytes": 0, "data_path": False}}
"""Clients as one on another host meets the server: by its network data path, and by gRPC
alone (``data_path=False``)."""


def _ram(server: ServerThread) -> Any:
    assert server.server is not None
    return next(t for t in server.server.store.tiers if t.name == "ram")


def _damage(ram: Any, key: bytes = b"") -> None:
    """A bit flipped in the value of ``key`` (every key, where none is named) in the server's
    RAM tier, after its first read was checked (the server does not hash it again: the
    reader finds it)."""
    for skey in list(ram._data):  # noqa: SLF001
        if skey.endswith(key.hex().encode()):
            bad = bytearray(ram._data[skey])  # noqa: SLF001
            bad[-100] ^= 0x10
            ram._data[skey] = bytes(bad)  # noqa: SLF001


def _failing(c: Client, ks: list[bytes], failure: str) -> Callable[[], None]:
    """A read of ``ks`` that fails as ``failure`` says: ``damaged`` (Corrupt as the entries
    land), ``mismatch`` (the server refuses: another layout), ``cancelled`` (each stream
    let go before it is read)."""
    if failure == "cancelled":
        def run() -> None:
            for s in [c.retrieve_stream(ks[0]), *c.retrieve_streams(ks)]:
                assert s is not None
                s.cancel()
                try:
                    s.result(timeout=30)
                except Cancelled:
                    pass
        return run
    error = Corrupt if failure == "damaged" else LayoutMismatch
    want = LAYOUT if failure == "damaged" else OTHER

    def read() -> None:
        with pytest.raises(error):
            c.retrieve(ks[0], layout=want)
        with pytest.raises(error):
            c.retrieve_many(ks, layout=want)
        with pytest.raises(error):  # as it is asked for (refused) or as it lands (damaged)
            for s in c.retrieve_streams(ks, layout=want):
                assert s is not None
                s.result(timeout=30)
    return read


@pytest.mark.parametrize(("path", "failure"), [
    ("network", "damaged"), ("network", "mismatch"), ("network", "cancelled"),
    ("grpc", "mismatch"), ("grpc", "cancelled")])
def test_a_failed_hit_makes_no_reference_cycles(server: ServerThread, path: str,
                                                failure: str) -> None:
    """The error of a failed hit holds no frame that holds it (the stream keeping it, the
    frames that read the entry, the gRPC call it came by), on the client and on the server."""
    kvs = [random_kv(LAYOUT, tokens=64 + 32 * i, seed=i) for i in range(3)]
    ks = [numbered_key(40 + i) for i in range(3)]
    with Client(server.address, timeout_s=30, **PATHS[path]) as c:
        c.store_many(list(zip(ks, kvs)), mode="raw", layers_per_frame=1)
        assert all(g is not None for g in c.retrieve_many(ks, layout=LAYOUT))  # checked once
        if failure == "damaged":
            _damage(_ram(server))
        run = _failing(c, ks, failure)
        run()  # what the server keeps for its life is made here
        found = collected(run)
    assert kdn_garbage(found) == [], (
        f"a {failure} hit's objects were freed only by the garbage collector:\n"
        + cycles(found))


def test_a_kept_error_lets_go_of_its_frames_and_says_where_a_bug_was_raised() -> None:
    def bug() -> None:
        raise ValueError("a bug")

    try:
        bug()
    except ValueError as exc:
        kept(exc)
        assert exc.__traceback__ is None
        assert "in bug" in exc.__notes__[0]  # what a printed traceback of it shows
        copied = again(exc)
        assert type(copied) is ValueError and copied is not exc and str(copied) == "a bug"
    odd = Desynced(InvalidArgument("its arguments are not its constructor's"))
    assert again(odd) is odd  # not copied: raised as it is


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


def test_a_load_failing_in_the_engine_makes_no_reference_cycles(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keeps a load's error that came up through the model's forward (a layer
    found damaged as it is waited for: ``generate`` then computes the prompt whole) without
    the frames it came through: its own, holding the engine, and the forward's, holding its
    tensors."""
    from kdn.client.stream import LayerStream
    from kdn.engine import EngineConfig, KDNEngine
    from tests.test_engine_devices import _model, _Tok

    ids = [int(x) for x in torch.randint(1, 256, (100,),
                                         generator=torch.Generator().manual_seed(5))]
    eng = KDNEngine(_model(torch.float32, "cpu"), _Tok(), client,
                    EngineConfig(chunk_tokens=32, encodings=(("raw", ""),)))
    first = eng.generate(ids, max_new_tokens=2)  # blocks 0..2 stored
    assert first.store_thread is not None
    first.store_thread.join(60)
    wait = LayerStream.wait_for_layer

    def damaged(self: LayerStream, i: int, *args: Any, **kwargs: Any) -> Any:
        if i == 1:  # found as layer 1 is decoded, after layer 0 was used
            raise Corrupt("frame 1 checksum mismatch")
        return wait(self, i, *args, **kwargs)

    monkeypatch.setattr(LayerStream, "wait_for_layer", damaged)
    # its warning unrecorded: pytest keeps each record, the error among its arguments
    monkeypatch.setattr(logging.getLogger("kdn.engine.engine"), "disabled", True)

    def failing() -> None:
        got = eng.generate(ids, max_new_tokens=2, force="raw")
        assert got.timings.load_error == "Corrupt: frame 1 checksum mismatch"
        assert got.store_thread is not None
        got.store_thread.join(60)

    failing()
    found = collected(failing)
    assert kdn_garbage(found) == [], (
        "a failed load's objects were freed only by the garbage collector:\n" + cycles(found))


def test_a_new_clients_first_hit_lands_where_an_earlier_clients_entries_lay(
        server: ServerThread) -> None:
    """Landing buffers are the process's: a client made after another let go of its hits
    (an engine restarted in the process, a new server's client) does not fault in fresh
    memory for its first one."""
    big = uniform_layout(layers=3, heads=4, dim=64)
    ks = [numbered_key(100 + i) for i in range(3)]
    kvs = [random_kv(big, 2048, seed=i) for i in range(3)]  # 3 MiB each: pooled sizes
    with Client(server.address, timeout_s=30, shm_bytes=0) as first:
        first.store_many(list(zip(ks, kvs)), mode="raw")
        first.flush()
        got = first.fetch_many(ks, layout=big)
        assert all(g is not None for g in got)
        del got  # their buffers go back
    with Client(server.address, timeout_s=30, shm_bytes=0) as second:
        net = second.dataplane.net()
        assert net is not None
        reused = net.landing.reused
        again = second.retrieve_many(ks, layout=big)
        assert net.landing.reused - reused == 3
        assert all(g is not None and g.equal(kv) for g, kv in zip(again, kvs))


def test_a_stream_cancelled_before_its_entry_landed_says_so_as_any_cancelled_stream() -> None:
    """A network-path stream let go before its entry came raises ``Cancelled`` from its
    waits, as a cancelled gRPC stream does (not ``concurrent.futures.CancelledError``)."""
    from concurrent.futures import Future

    from kdn.client.landing import PendingStream, new_timings

    entry: Future = Future()
    pending = PendingStream(entry, "ram", "cpu", new_timings())
    pending.cancel()
    assert entry.cancelled()
    with pytest.raises(Cancelled, match="retrieve cancelled"):
        pending.result(timeout=5)
    with pytest.raises(Cancelled, match="retrieve cancelled"):
        pending.wait_for_layer(0, timeout=5)
