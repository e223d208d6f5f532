"""One retrieve over several gRPC streams of layer groups (kdn.client.parallel), against a real
server on loopback: whole entries back, frames shared by two groups, misses, the in-process tier
filled from them, an overwrite between the streams' headers, and small entries on one stream.
The entries here are small: read alone they stream (``streamed``), and ``split`` lowers the
size from which a retrieve is split."""

from __future__ import annotations

from typing import Any

import pytest

from kdn.client import Client, dataplane, parallel
from kdn.client.parallel import layer_groups
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import pruned_layout, random_kv, uniform_layout


def _key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture(autouse=True)
def streamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry read alone streams however small (not in one GetMany message)."""
    monkeypatch.setattr(dataplane, "INLINE_ENTRY_BYTES", 1)


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "GROUP_MIN_BYTES", 1)
    monkeypatch.setattr(parallel, "stream_cores", lambda: 8)  # as on a host with 16 cores


def test_layer_groups_cover_every_layer_once() -> None:
    assert layer_groups(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    assert layer_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(5, 1) == [(0, 5)]
    for n in range(1, 12):
        groups = layer_groups(7, n)
        assert [i for a, b in groups for i in range(a, b)] == list(range(7))


@pytest.mark.parametrize("streams,layers_per_frame", [(3, 1), (4, 3), (2, 0)])
def test_a_retrieve_over_several_streams_returns_the_whole_entry(
        server: ServerThread, split: None, streams: int, layers_per_frame: int) -> None:
    lay = pruned_layout()
    kv = random_kv(lay, 33, seed=streams)
    with Client(server.address, shm_bytes=0, data_path=False, streams=streams) as c:
        c.store(_key(1), kv, mode="raw", layers_per_frame=layers_per_frame)
        back = c.retrieve(_key(1), layout=lay)
        assert back is not None and back.equal(kv)
        stream = c.retrieve_stream(_key(1), layout=lay)
        assert stream is not None and stream.tier == "ram"
        assert stream.result().equal(kv)
        assert c.retrieve(_key(2), layout=lay) is None  # a miss on every stream
        lossless = random_kv(lay, 9, seed=7)
        c.store(_key(3), lossless, mode="lossless", layers_per_frame=layers_per_frame)
        assert c.retrieve(_key(3), layout=lay).equal(lossless)  # type: ignore[union-attr]
        counters = c.stats().counters
        # one frame of every layer (layers_per_frame=0) is not split: one stream reads it
        split = min(streams, lay.num_layers) if layers_per_frame else 1
        assert counters["retrieve.hit"] + counters.get("retrieve.cancelled", 0) >= 3 * split


def test_the_in_process_tier_keeps_what_several_streams_brought(server: ServerThread,
                                                                 split: None) -> None:
    lay = uniform_layout(layers=6)
    kv = random_kv(lay, 20, seed=3)
    with Client(server.address, shm_bytes=0, data_path=False, streams=3, local_bytes=1 << 20) as c:
        c.store(_key(4), kv, mode="raw", layers_per_frame=1)
        assert c.local is not None
        c.local.discard(c.namespace, _key(4))
        assert c.retrieve(_key(4), layout=lay).equal(kv)  # type: ignore[union-attr]
        got = c.local.get(c.namespace, _key(4))
        assert got is not None  # whole, frames in order
        stream = c.retrieve_stream(_key(4), layout=lay)
        assert stream is not None and stream.tier == "inproc" and stream.result().equal(kv)


def test_an_overwrite_between_the_streams_reads_one_version(server: ServerThread, split: None,
                                                             monkeypatch: Any) -> None:
    lay = uniform_layout(layers=4)
    old, new = random_kv(lay, 16, seed=1), random_kv(lay, 16, seed=2)
    with Client(server.address, shm_bytes=0, data_path=False, streams=2) as c:
        c.store(_key(5), old, mode="raw", layers_per_frame=1)
        c.store(_key(6), new, mode="raw", layers_per_frame=1)
        real = c.rpc.retrieve_calls

        def racing(n: int) -> list[Any]:
            first, *rest = real(n)

            def overwritten(req: pb.RetrieveRequest, **kw: Any) -> Any:
                other = pb.RetrieveRequest()
                other.CopyFrom(req)
                other.key = _key(6)  # what a store landing between the calls would serve
                return rest[0](other, **kw)

            return [first, overwritten]

        monkeypatch.setattr(c.rpc, "retrieve_calls", racing)
        back = c.retrieve(_key(5), layout=lay)
        assert back is not None and back.equal(old)  # read again over one stream, not mixed


def test_only_an_entry_large_enough_is_split(server: ServerThread,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The first stream's header tells the entry's size: below ``GROUP_MIN_BYTES`` a stream it
    reads on alone (one Retrieve call), from there on the later groups come on streams of
    their own (no more than ``stream_cores``) and the first stops after its group (its frames
    past it are not waited for)."""
    lay = uniform_layout(layers=8)
    kv = random_kv(lay, 40, seed=11)
    with Client(server.address, shm_bytes=0, data_path=False, streams=4) as c:
        c.store(_key(7), kv, mode="raw", layers_per_frame=1)
        nbytes = c.fetch(_key(7)).parts.nbytes  # type: ignore[union-attr]
        calls: list[tuple[int, int]] = []
        real = c.rpc.retrieve_calls

        def counted(n: int) -> list[Any]:
            def wrap(start: Any) -> Any:
                def call(req: pb.RetrieveRequest, **kw: Any) -> Any:
                    calls.append((req.first_layer, req.last_layer))
                    return start(req, **kw)
                return call
            first, *rest = real(n)
            return [first, *map(wrap, rest)]

        monkeypatch.setattr(c.rpc, "retrieve_calls", counted)
        for size, cores, want in (
                (nbytes // 2 + 1, 8, []),  # two streams' worth missing: one stream
                (nbytes // 2, 8, [(4, 8)]),  # two streams
                (nbytes // 4, 8, [(2, 4), (4, 6), (6, 8)]),  # as many as asked
                (nbytes // 4, 2, [(4, 8)]),  # no more than the cores receive side by side
                (nbytes // 4, 1, [])):
            monkeypatch.setattr(parallel, "GROUP_MIN_BYTES", size)
            monkeypatch.setattr(parallel, "stream_cores", lambda n=cores: n)
            calls.clear()
            back = c.retrieve(_key(7), layout=lay)
            assert back is not None and back.equal(kv)
            assert calls == want
        before = c.stats().counters.get("retrieve.cancelled", 0)
        stream = c.retrieve_stream(_key(7), layout=lay)
        assert stream is not None and stream.result().equal(kv)
        assert c.stats().counters.get("retrieve.cancelled", 0) <= before + 1


def test_stream_cores_is_half_the_cores_this_process_may_run_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert parallel.stream_cores() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert parallel.stream_cores() == 1
