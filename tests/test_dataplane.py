"""Batches and the same-host data plane (kdn.server.batch, kdn.client.dataplane, kdn.client.shm)
against a real server on loopback: round trips through the shared segment and inline, the
fallbacks (streams, second calls, gRPC), batches in several calls, reads racing overwrites, and
GPU-bound reads. Hostile descriptors and segments, tenancy, failed batches and damaged values
are in test_dataplane_guards.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.client import Client
from kdn.client.shm import RegionAllocator, SharedSegment
from kdn.errors import TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import (
    count_staging_copies,
    pruned_layout,
    random_kv,
    read_while_churned,
    uniform_layout,
)

LAYOUT = uniform_layout()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_region_allocator_reuses_and_merges() -> None:
    regions = RegionAllocator(16, 1024)
    a, b, c = regions.alloc(100), regions.alloc(100), regions.alloc(100)
    assert (a, b, c) == (64, 192, 320)  # 64-byte aligned, after the nonce
    regions.free(b, 100)
    assert regions.alloc(200) == 448  # b's hole is too small
    regions.free(a, 100)
    regions.free(c, 100)
    assert regions.alloc(380) == 64  # a, b and c merged back into one range
    assert regions.alloc_largest(10_000) == (448 + 256, 1024 - 448 - 256)
    assert regions.alloc(1) is None


def test_a_region_allocator_whose_end_is_not_aligned_keeps_within_it() -> None:
    regions = RegionAllocator(16, 1000)  # 1000: 15 whole blocks and 40 bytes
    assert regions.free_bytes() == 1000 // 64 * 64 - 64
    off, size = regions.alloc_largest(10_000)  # type: ignore[misc]
    assert off + size <= 1000
    regions.free(off, size)  # given back whole: nothing reaches past the end
    assert regions.alloc_largest(10_000) == (off, size)
    assert RegionAllocator(16, 40).alloc(1) is None  # no whole block after the start


def test_a_segment_of_unaligned_size_serves_reads_after_a_miss(server: ServerThread) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=100_000) as c:
        keys = [_key(i) for i in range(3)]
        for i, k in enumerate(keys):
            c.store(k, random_kv(LAYOUT, 16, seed=i), mode="raw")
        assert c.dataplane.attached
        for _ in range(2):  # a miss gives the segment's tail back, then reads go through it
            assert c.retrieve_streams([_key(99)], layout=LAYOUT, tokens=16) == [None]
            for i, s in enumerate(c.retrieve_streams(keys, layout=LAYOUT, tokens=16)):
                assert s is not None
                assert torch_equal(s.wait_for_layer(3), random_kv(LAYOUT, 16, seed=i).layers[3])


def test_store_and_retrieve_through_the_segment(shm_client: Client) -> None:
    kv = random_kv(LAYOUT, 40, seed=1)
    shm_client.store(_key(1), kv, mode="raw")
    assert shm_client.dataplane.attached
    assert shm_client.retrieve(_key(1), layout=LAYOUT).equal(kv)  # type: ignore[union-attr]
    stream = shm_client.retrieve_stream(_key(1))
    assert stream is not None and stream.tier == "ram"
    assert torch_equal(stream.wait_for_layer(2), kv.layers[2])
    got = shm_client.fetch(_key(1))
    assert got is not None and codec.decode(got.parts.to_bytes()).equal(kv)
    assert shm_client.retrieve(_key(2)) is None and shm_client.fetch(_key(2)) is None
    counters = shm_client.stats().counters  # the second fetch: from the kept lease
    reused = shm_client.dataplane.same_host.arena.reused
    assert counters["getmany.hit"] + reused >= 3 and counters.get("retrieve.hit", 0) == 0
    seg = shm_client.dataplane.segment()[0]
    del stream, got
    assert seg.regions.free_bytes() == seg.size - 64  # every region given back


def torch_equal(a: tuple, b: tuple) -> bool:
    return bool((a[0] == b[0]).all() and (a[1] == b[1]).all())


@pytest.mark.parametrize(("shm", "net"), [(8 << 20, True), (0, True), (0, False)],
                         ids=["segment", "data-path", "inline"])
def test_many_entries_per_call(server: ServerThread, shm: int, net: bool) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=shm, data_path=net) as c:
        items = [(_key(i), random_kv(pruned_layout(), 16 + i, seed=i)) for i in range(24)]
        results = c.store_many(items, mode="lossless")
        assert [r.stored_bytes > 0 for r in results] == [True] * 24
        keys = [k for k, _ in items] + [_key(999)]
        got = c.retrieve_many(keys, layout=pruned_layout())
        assert got[-1] is None
        assert all(g is not None and g.equal(kv) for g, (_, kv) in zip(got, items))
        assert c.dataplane.attached == bool(shm)
        counters = c.stats().counters
        batch = "getmany" if shm or net else "retrievemany"  # gRPC: one grouped RetrieveMany
        assert counters[f"{batch}.hit"] == 24 and counters[f"{batch}.miss"] == 1


@pytest.mark.no_arena
def test_entries_larger_than_the_segment_stream_instead(server: ServerThread) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=64 << 10) as c:
        small, big = random_kv(LAYOUT, 8, seed=2), random_kv(LAYOUT, 400, seed=3)
        assert codec.encode_parts(big, "raw").nbytes > 64 << 10
        c.store_many([(_key(3), small), (_key(4), big)], mode="raw")
        assert c.dataplane.attached
        got = c.retrieve_many([_key(3), _key(4)])
        assert got[0].equal(small) and got[1].equal(big)  # type: ignore[union-attr]
        many = [(_key(100 + i), random_kv(LAYOUT, 40, seed=i)) for i in range(12)]
        c.store_many(many, mode="raw")  # more than the segment holds at once: several calls
        assert all(g.equal(kv) for g, (_, kv) in  # type: ignore[union-attr]
                   zip(c.retrieve_many([k for k, _ in many]), many))
        assert c.stats().counters["retrieve.hit"] >= 1  # the big one came by stream


def test_reads_racing_overwrites_and_evictions_return_whole_entries(server: ServerThread
                                                                     ) -> None:
    versions = [random_kv(LAYOUT, 24, seed=s) for s in range(3)]
    with Client(server.address, timeout_s=30) as writer, \
            Client(server.address, timeout_s=30, shm_bytes=1 << 20) as reader:
        writer.store(_key(9), versions[0], mode="raw")
        seen = read_while_churned(writer, reader, _key(9), versions, 1500, LAYOUT)
    assert len(set(seen)) >= 3  # the race really happened: several versions and misses seen


def test_limits_through_the_segment(tmp_path: Path) -> None:
    """Message limits are gRPC's and do not apply to the segment; max_entry_bytes does."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       max_message_bytes=64 << 10, max_entry_bytes=1 << 20)
    lay = uniform_layout(layers=2, heads=4, dim=64)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=8 << 20) as c:
        big = random_kv(lay, 200)  # 200 KiB per frame > 64 KiB per message
        c.store(_key(10), big, mode="raw")
        assert c.dataplane.attached and c.retrieve(_key(10)).equal(big)  # type: ignore[union-attr]
        huge = random_kv(uniform_layout(layers=40, heads=4, dim=64), 60)  # ~2.4 MiB entry
        with pytest.raises(TooLarge, match="max_entry_bytes"):
            c.store(_key(11), huge, mode="raw")
        assert c.fetch(_key(11)) is None


def test_same_host_addresses_and_a_server_that_is_not_there_yet(tmp_path: Path) -> None:
    from kdn.client import Retry
    from kdn.client.client import same_host
    from kdn.errors import Unavailable

    assert all(same_host(a) for a in ("127.0.0.1:5", "localhost:5", "[::1]:5", "unix:/x.sock"))
    assert not any(same_host(a) for a in ("10.0.0.7:5", "kdn.example:5", "[2001:db8::1]:5"))
    with Client("127.0.0.1:1", timeout_s=1, retry=Retry(retries=0)) as c:
        with pytest.raises(Unavailable):
            c.store(_key(12), random_kv(LAYOUT, 4))
        assert not c.dataplane.same_host._tried  # asks again once the server answers


def test_an_entry_larger_than_the_first_region_comes_in_a_second_call(server: ServerThread
                                                                      ) -> None:
    from kdn.client.dataplane import FIRST_REGION

    lay = uniform_layout(layers=2, heads=8, dim=64)
    with Client(server.address, shm_bytes=FIRST_REGION * 3) as c:
        big = random_kv(lay, FIRST_REGION // (2 * 8 * 64 * 2 * 2) + 512)  # > FIRST_REGION
        c.store(_key(20), big, mode="raw")
        before = c.stats().counters
        assert c.retrieve(_key(20)).equal(big)  # type: ignore[union-attr]
        after = c.stats().counters
        assert after["getmany.hit"] == before["getmany.hit"] + 1
        assert after.get("retrieve.hit", 0) == before.get("retrieve.hit", 0)  # no stream


def _in_segment(t: torch.Tensor, seg: SharedSegment) -> bool:
    base = seg.array.ctypes.data
    return base <= t.data_ptr() < base + seg.size


@pytest.mark.no_arena
def test_reads_through_the_segment_are_checked_by_the_server_and_viewed_in_place(
        shm_client: Client) -> None:
    kv = random_kv(LAYOUT, 160, seed=3)  # 80 KiB: larger ones than SMALL_ENTRY_BYTES come so
    shm_client.store(_key(20), kv, mode="raw")
    seg = shm_client.dataplane.segment()[0]
    got = shm_client.fetch(_key(20))
    assert got is not None and got.owned and got.checked  # the server hashed what it wrote
    frame0 = np.frombuffer(got.parts.frames[0], dtype=np.uint8)
    assert frame0.ctypes.data % 64 == 0  # first frame aligned: raw bodies can be viewed
    del got, frame0
    back = shm_client.retrieve(_key(20), layout=LAYOUT)
    assert back is not None and back.equal(kv)
    assert all(_in_segment(k, seg) and _in_segment(v, seg) for k, v in back.layers)  # no copy
    back.layers[0][0].zero_()  # the caller's own bytes: the next read is not affected
    again = shm_client.retrieve(_key(20), layout=LAYOUT)
    assert again is not None and again.equal(kv)
    assert seg.regions.free_bytes() < seg.size - 64  # the regions live while the tensors do
    del back, again
    assert seg.regions.free_bytes() == seg.size - 64
    lossless = random_kv(LAYOUT, 40, seed=4)  # a mode that decodes: fresh tensors
    shm_client.store(_key(21), lossless, mode="lossless")
    dec = shm_client.retrieve(_key(21), layout=LAYOUT)
    assert dec is not None and dec.equal(lossless)
    assert not any(_in_segment(k, seg) for k, _ in dec.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_retrieve_into_cuda_through_a_registered_segment(shm_client: Client,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 40, seed=8)
    shm_client.store(_key(23), kv, mode="raw")
    staged = count_staging_copies(monkeypatch)
    back = shm_client.retrieve(_key(23), layout=LAYOUT, device="cuda")
    assert back is not None and all(k.is_cuda for k, _ in back.layers)
    assert back.to("cpu").equal(kv)
    seg = shm_client.dataplane.segment()[0]
    assert seg.register_with_cuda()  # registered on the first CUDA read: views are pinned
    assert not staged  # copied to the device from the segment itself, no pinned staging copy


@pytest.mark.gpu
@pytest.mark.no_arena  # through the segment's regions
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_context_larger_than_the_segment_reaches_the_gpu_without_streams(
        server: ServerThread) -> None:
    """Bound for a GPU, many entries are read in groups whose regions go back once copied:
    ten entries of 800 KB through a 4 MiB segment, none streamed, every one whole."""
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 400, seed=50 + i) for i in range(10)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        for i, kv in enumerate(kvs):
            c.store(_key(50 + i), kv, mode="raw")
        before = dict(c.stats().counters).get("retrieve.hit", 0)
        streams = c.retrieve_streams([_key(50 + i) for i in range(10)], layout=lay,
                                     device="cuda")
        assert all(s is not None for s in streams)
        for s, kv in zip(streams, kvs):
            got = s.result()  # type: ignore[union-attr]
            assert got.layers[0][0].is_cuda and got.to("cpu").equal(kv)
        assert dict(c.stats().counters).get("retrieve.hit", 0) == before


def test_a_batch_larger_than_one_region_takes_few_calls(server: ServerThread,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.client import dataplane

    monkeypatch.setattr(dataplane, "FIRST_REGION", 1 << 20)
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 96, seed=i) for i in range(24)]  # ~200 KB each, ~4.7 MB in all
    with Client(server.address, timeout_s=30, shm_bytes=16 << 20) as c:
        c.store_many([(_key(40 + i), kv) for i, kv in enumerate(kvs)], mode="raw")
        calls = []
        real = c.dataplane._get
        monkeypatch.setattr(c.dataplane, "_get",
                            lambda req, rid: calls.append(len(req.keys)) or real(req, rid))
        got = c.retrieve_many([_key(40 + i) for i in range(24)], layout=lay)
        assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
        total = sum(kv.nbytes for kv in kvs)
        assert len(calls) <= total // (1 << 20) + 2, calls  # ~1 MiB per call, not one call
        assert len(calls) < len(kvs) // 3  # per entry left over


def test_layers_viewing_one_span_are_copied_as_one() -> None:
    """``one_span``: the layers of an entry viewed in place lie in one span of its bytes; a
    copy of the span rebuilt with each layer's offset and strides gives every layer back (what
    a GPU-bound hit does with one host-to-device copy). Tensors of other storages, dtypes or
    spans with wide gaps are refused."""
    from kdn.client.stream import one_span
    from kdn.codec import encode_parts, inplace
    from kdn.codec.format import parse_header

    lay = uniform_layout(layers=5, heads=2, dim=32)
    kv = random_kv(lay, 17, seed=3)
    parts = encode_parts(kv, "raw")
    got = inplace.copied(parse_header(parts.header), parts.to_bytes())
    assert got is not None
    flat = [t for pair in got for t in pair]
    found = one_span(flat)
    assert found is not None
    span, offsets = found
    copy = span.clone()  # stands for the device copy
    back = [copy.as_strided(t.shape, t.stride(), at) for t, at in zip(flat, offsets)]
    assert all(torch.equal(a, b) for a, b in zip(back, (t for p in kv.layers for t in p)))
    assert span.numel() * span.element_size() < 1.25 * kv.nbytes
    assert one_span([flat[0], flat[1].clone()]) is None  # another storage
    assert one_span([flat[0], flat[1].float()]) is None  # another dtype
    base = torch.zeros(10_000, dtype=torch.float16)
    assert one_span([base[:10], base[-10:]]) is None  # mostly gap
    assert one_span([]) is None
    assert one_span([base[:0], base[5:5]]) is None  # nothing to copy


def test_the_gpu_bound_batch_read_returns_every_entry_in_order(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """``retrieve_streams`` bound for a GPU (faked: its grouped path run into CPU tensors):
    in-process hits and server reads mixed, groups sized by the entries' size, a miss, every
    entry back whole and in order."""
    from kdn.client import reads as client_mod
    from kdn.codec import gpu_source

    monkeypatch.setattr(client_mod, "on_cuda", lambda device: True)
    lay = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(lay, 100 + 7 * i, seed=60 + i) for i in range(9)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20, local_bytes=1 << 20) as c:
        for i, kv in enumerate(kvs):
            c.store(_key(60 + i), kv, mode="raw")  # the tier keeps the last few (1 MiB)
        assert c.local is not None and 0 < c.local.stats.entries < len(kvs)
        hits = c.local.stats.hits
        keys = [_key(60 + i) for i in range(9)] + [_key(99)]
        before = dict(gpu_source.SECONDS)
        streams = c.retrieve_streams(keys, layout=lay, device="cpu")
        steps = {k: v - before.get(k, 0.0) for k, v in gpu_source.SECONDS.items()}
        assert streams[-1] is None and len(streams) == 10
        for s, kv in zip(streams, kvs):
            assert s is not None and s.result().equal(kv)
        assert c.local.stats.hits > hits  # some came from the tier, the rest from the server
        # the host's time of each step is kept for bench.gpu's rows (host_phases_s)
        assert all(steps.get(f"read.{k}", 0.0) > 0 for k in ("entries", "streams", "settle"))


@pytest.mark.parametrize(("arena", "mode"), [(0, "raw"), (64 << 20, "raw"),
                                             (64 << 20, "kdn")])
def test_a_gpu_bound_read_waits_only_for_copies_that_hold_the_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arena: int, mode: str) -> None:
    """``retrieve_streams`` bound for a GPU (faked) reads in groups of about a quarter of the
    segment, the first sized by the entries' raw size (it was one entry, whatever the size);
    entries the server copies into the segment (no read arena) are waited for, oldest first,
    to keep half of it free for the next group; entries the read arena lends hold no room of
    the segment, and nothing is waited for before the call returns (a wait for the group
    before each was a host synchronisation per group on a GPU)."""
    from kdn.client import reads as client_mod
    from kdn.client.stream import LayerStream

    monkeypatch.setattr(client_mod, "on_cuda", lambda device: True)
    asked: list[int] = []
    settled: list[int] = []
    entries = client_mod.Reader._entries  # noqa: SLF001
    monkeypatch.setattr(client_mod.Reader, "_entries",
                        lambda self, ns, ks, *a, **kw: asked.append(len(ks))
                        or entries(self, ns, ks, *a, **kw))
    settle = LayerStream.settle_copies
    monkeypatch.setattr(LayerStream, "settle_copies",
                        lambda self: settled.append(len(asked)) or settle(self))
    lay = uniform_layout(layers=4, heads=2, dim=64)  # fp16: 2 KiB a token
    kvs = [random_kv(lay, 128, seed=80 + i) for i in range(12)]  # 256 KiB each raw
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, shm_arena_bytes=arena)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=30, shm_bytes=4 << 20) as c:
        for i, kv in enumerate(kvs):
            c.store(_key(80 + i), kv, mode=mode, level="default" if mode == "kdn" else "")
        streams = c.retrieve_streams([_key(80 + i) for i in range(12)], layout=lay,
                                     tokens=128, device="cpu")
        waited = list(settled)
        for s, kv in zip(streams, kvs):
            assert s is not None
            got = s.result()
            assert got.equal(kv) if mode == "raw" else got.num_tokens == 128
    assert asked[0] == 3  # 1 MiB of raw entries of 256 KiB and their headers
    assert sum(asked) == 12
    if arena == 0:  # every group's 0.75 MiB in the segment: before the third group is
        # asked for, the first one's three streams are waited for; before the fourth, the
        # second's
        assert asked == [3, 3, 3, 3] and waited == [2] * 3 + [3] * 3, (asked, waited)
    else:
        assert waited == [], (asked, waited)
        if mode == "kdn":  # groups sized by the largest entry read, after the first
            assert len(asked) == 2, asked
