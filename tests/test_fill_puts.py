"""Puts of a cache that fills: memory faulted in ahead of demand (kdn.transport.prefault) and
``store(KVCache)`` written straight into the shared segment (``Writer._written_staged``).

The heap alone: its first take starts the grower and misses; what it hands out afterwards
lies in its regions, never overlaps another held range, comes back once released, and it
never maps past its limit. Over a real server: large stores of new keys land in the heap and
read back whole; a byte damaged in the heap's copy is caught by the entry's checksums. A
``raw`` ``store(KVCache)`` on the server's host is stored byte for byte as ``encode_parts``
writes it, without the client encoding or copying into the segment twice, its region given
back; ``store_many`` likewise; other modes, frame sizes and remote clients encode as before.
Bad input (a wrong dtype, a bad key in a batch) raises before anything is stored."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.shm import SharedSegment
from kdn.client.staged import Staged
from kdn.errors import Corrupt, InvalidArgument, InvalidLayout, KDNError
from kdn.keys import store_key
from kdn.names import DEFAULT_NAMESPACE
from kdn.server import ServerThread
from kdn.server.config import ServerConfig
from kdn.transport.prefault import PrefaultedHeap
from tests.helpers import numbered_key as _key
from tests.helpers import random_kv, uniform_layout

MIB = 1 << 20
LAYOUT = uniform_layout(layers=4, heads=8, dim=64)  # 4 KiB a token


def _grown(heap: PrefaultedHeap, free: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while heap.free_bytes < free:
        assert time.monotonic() < deadline, f"the heap holds {heap.free_bytes} free bytes"
        heap.grown.wait(0.05)


def test_the_heap_hands_out_faulted_ranges_and_takes_them_back() -> None:
    heap = PrefaultedHeap(ahead_bytes=8 * MIB, limit_bytes=16 * MIB)
    try:
        with pytest.raises(ValueError, match="size"):
            heap.take(0)
        first = heap.take(MIB)  # the first take starts the grower, which may map at once
        assert first is None or heap.mapped_bytes >= MIB  # served only from mapped memory
        del first
        gc.collect()
        _grown(heap, 8 * MIB)
        a, b = heap.take(3 * MIB), heap.take(3 * MIB)
        assert a is not None and b is not None and a.flags.writeable
        lo_a, lo_b = a.ctypes.data, b.ctypes.data
        assert lo_a + a.nbytes <= lo_b or lo_b + b.nbytes <= lo_a  # no two share a byte
        a[:] = 1
        b[:] = 2
        assert int(a.sum()) == a.nbytes and int(b.min()) == 2
        view = memoryview(a)[10:20]  # a reader derived from it keeps the range
        del a
        gc.collect()
        _grown(heap, 8 * MIB)  # the grower back ahead (and idle): nothing lands during the take
        c = heap.take(heap.free_bytes_unlocked() + MIB)  # more than is free: a miss
        assert c is None
        assert bytes(view) == b"\x01" * 10
        before = heap.free_bytes
        del view
        gc.collect()
        assert heap.free_bytes >= before + 3 * MIB  # the range came back, still mapped
        assert heap.take(64 * MIB) is None  # past the limit: never mapped
        time.sleep(0.2)
        assert heap.mapped_bytes <= 16 * MIB
        del b
    finally:
        heap.close()
    with pytest.raises(ValueError, match="ahead_bytes"):
        PrefaultedHeap(-1, 0)


def test_large_stores_of_new_keys_land_in_memory_faulted_ahead(tmp_path: object) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=256 << 20,  # type: ignore[operator]
                       disk_bytes=0, shm_arena_bytes=0, shutdown_grace_s=2.0)
    kvs = [random_kv(LAYOUT, 512, seed=i) for i in range(6)]  # 2 MiB each
    with ServerThread(cfg) as srv, Client(srv.address, timeout_s=30) as c:
        assert srv.server is not None
        heap = srv.server.servicer.heap
        c.store(_key(0), kvs[0], mode="raw")  # starts the grower (its own buffer is fresh)
        _grown(heap, 16 * MIB)
        taken = heap.taken
        for i in range(1, 6):
            c.store(_key(i), kvs[i], mode="raw")
        assert heap.taken >= taken + 5
        for i, kv in enumerate(kvs):
            back = c.retrieve(_key(i), layout=LAYOUT)
            assert back is not None and back.equal(kv)
        # a byte of a stored copy damaged where it lies in the heap: its checksum says so
        ram = srv.server.store.tiers[0]
        value = ram.get(store_key("", DEFAULT_NAMESPACE, _key(5)))
        assert value is not None
        where = np.frombuffer(value, dtype=np.uint8).ctypes.data + len(value) // 2
        assert heap.holds(where)
        ctypes.memset(where, int(np.frombuffer(value, np.uint8)[len(value) // 2]) ^ 0xFF, 1)
        with Client(srv.address, timeout_s=30, shm_bytes=0, data_path=False) as remote:
            with pytest.raises(Corrupt):
                remote.retrieve(_key(5), layout=LAYOUT)


def _encoded_twice(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every encode_parts call and every client write into a segment."""
    calls: list[str] = []
    real_encode, real_write = codec.encode_parts, SharedSegment.write

    def encode(*a: object, **k: object) -> object:
        calls.append("encode")
        return real_encode(*a, **k)  # type: ignore[arg-type]

    def write(self: SharedSegment, offset: int, data: bytes | memoryview) -> None:
        calls.append("write")
        real_write(self, offset, data)

    monkeypatch.setattr(codec, "encode_parts", encode)
    monkeypatch.setattr(SharedSegment, "write", write)
    return calls


def test_a_raw_kvcache_is_written_straight_into_the_segment(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    kvs = [random_kv(LAYOUT, 100 + i, seed=20 + i, start=7 * i) for i in range(4)]
    want = [codec.encode_parts(kv, "raw", layers_per_frame=0).to_bytes() for kv in kvs]
    calls = _encoded_twice(monkeypatch)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        c.store(_key(1), kvs[0], mode="raw")  # a client's first call: it attaches then
        seg = c.dataplane.segment()[0]
        assert seg is not None
        free = seg.regions.free_bytes()
        c.store_many([(_key(2 + i), kv) for i, kv in enumerate(kvs[1:])], mode="raw")
        assert calls == []  # neither encoded into the client's memory nor copied again
        gc.collect()
        assert seg.regions.free_bytes() == free  # every region given back
        # a tensor that is not contiguous (a slice of a wider one) is copied as it lies
        wide = random_kv(uniform_layout(layers=4, heads=8, dim=128), 50, seed=9)
        sliced = KVCache(LAYOUT, [(k[..., :64], v[..., 64:]) for k, v in wide.layers])
        assert not sliced.layers[0][0].is_contiguous()
        c.store(_key(20), sliced, mode="raw")
        back = c.retrieve(_key(20), layout=LAYOUT)
        assert back is not None and back.equal(sliced) and calls == []
        for i, w in enumerate(want):
            got = c.fetch(_key(1 + i))
            assert got is not None and got.parts.to_bytes() == w
        # other modes and frame sizes encode as before
        c.store(_key(9), kvs[0], mode="lossless")
        c.store(_key(10), kvs[0], mode="raw", layers_per_frame=1)
        assert calls.count("encode") == 2
        back = c.retrieve(_key(10), layout=LAYOUT)
        assert back is not None and back.equal(kvs[0])


def test_a_remote_client_encodes_as_before(server: ServerThread,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 64, seed=3)
    calls = _encoded_twice(monkeypatch)
    with Client(server.address, timeout_s=30, shm_bytes=0) as c:
        c.store(_key(1), kv, mode="raw")
        assert calls == ["encode"]
        back = c.retrieve(_key(1), layout=LAYOUT)
        assert back is not None and back.equal(kv)


def test_bad_kv_and_bad_keys_store_nothing(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 32, seed=4)
    wrong = KVCache.__new__(KVCache)  # a cache whose tensors went wrong after it was made
    wrong.layout, wrong.start_position = LAYOUT, 0
    wrong.layers = [(k.float(), v.float()) for k, v in kv.layers]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        seg = c.dataplane.segment()[0]
        assert seg is not None
        free = seg.regions.free_bytes()
        with pytest.raises(InvalidLayout, match="dtype"):
            c.store(_key(1), wrong, mode="raw")
        with pytest.raises(InvalidLayout, match="dtype"):
            c.store_many([(_key(2), kv), (_key(3), wrong)], mode="raw")
        with pytest.raises((InvalidArgument, KDNError)):
            c.store_many([(_key(4), kv), (b"", kv)], mode="raw")
        # a copy that fails half way (the last layer can not be read): nothing is stored
        half = KVCache.__new__(KVCache)
        half.layout, half.start_position = LAYOUT, 0
        half.layers = [*kv.layers[:-1], tuple(t.to("meta") for t in kv.layers[-1])]
        half.validate()
        with pytest.raises((NotImplementedError, RuntimeError)):
            c.store(_key(6), half, mode="raw")
        assert not any(c.contains(_key(i)) for i in (1, 2, 3, 4, 6))
        gc.collect()
        assert seg.regions.free_bytes() == free
        # a segment without room for the entry: encoded and sent as any, stored whole
        hog = seg.regions.alloc_largest(1 << 40)
        assert hog is not None
        c.store(_key(5), kv, mode="raw")
        seg.regions.free(*hog)
        back = c.retrieve(_key(5), layout=LAYOUT)
        assert back is not None and back.equal(kv)


def test_a_staged_entry_without_room_and_without_own_memory_is_closed() -> None:
    seg = SharedSegment(1 << 16)
    try:
        st = Staged(LAYOUT, 1000, 0, seg, own_memory=False)  # 4 MB: no room in 64 KiB
        assert st.closed and st.layers == []
        ok = Staged(LAYOUT, 2, 0, seg, own_memory=False)
        assert not ok.closed and ok.region(seg) is not None
        torch.zeros(1)  # (torch loaded: the views above are tensors)
        ok.close()
    finally:
        seg.close()


def test_store_many_of_kvcaches_is_pipelined_and_byte_exact(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.client import pipelined

    monkeypatch.setattr(pipelined, "PIPE_BYTES", 256 << 10)  # a call every entry or so
    kvs = [random_kv(LAYOUT, 60 + i, seed=40 + i, start=3 * i) for i in range(10)]
    want = [codec.encode_parts(kv, "raw", layers_per_frame=0).to_bytes() for kv in kvs]
    calls = _encoded_twice(monkeypatch)
    sent: list[int] = []
    real = pipelined._send_staged  # noqa: SLF001

    def spy(*args: object) -> None:
        sent.append(len(args[5]))  # type: ignore[arg-type]
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipelined, "_send_staged", spy)
    # a segment that holds about four of them at once: the rest wait for room
    with Client(server.address, timeout_s=30, data_path=False, shm_bytes=1 << 20) as c:
        c.store(_key(99), kvs[0], mode="raw")  # attached
        seg = c.dataplane.segment()[0]
        free = seg.regions.free_bytes()
        done = c.store_many([(_key(1 + i), kv) for i, kv in enumerate(kvs)], mode="raw")
        assert len(done) == len(kvs) and calls == []
        assert len(sent) > 2 and sum(sent) == len(kvs)  # several calls, every entry once
        gc.collect()
        assert seg.regions.free_bytes() == free
        for i, w in enumerate(want):
            got = c.fetch(_key(1 + i))
            assert got is not None and got.parts.to_bytes() == w
        # one entry larger than the segment: stored another way, in its place in the answers
        big = random_kv(LAYOUT, 400, seed=60)
        done = c.store_many([(_key(20), kvs[0]), (_key(21), big), (_key(22), kvs[1])],
                            mode="raw")
        assert len(done) == 3
        back = c.retrieve_many([_key(20), _key(21), _key(22)], layout=LAYOUT)
        assert [b is not None and b.equal(k) for b, k in zip(back, [kvs[0], big, kvs[1]])] \
            == [True, True, True]


def test_a_bad_cache_anywhere_in_a_pipelined_batch_stores_nothing(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.client import pipelined

    monkeypatch.setattr(pipelined, "PIPE_BYTES", 64 << 10)
    kvs = [random_kv(LAYOUT, 40, seed=70 + i) for i in range(6)]
    wrong = KVCache.__new__(KVCache)
    wrong.layout, wrong.start_position = LAYOUT, 0
    wrong.layers = [(k[:, :-1], v) for k, v in kvs[0].layers]  # K one token short
    with Client(server.address, timeout_s=30, data_path=False) as c:
        with pytest.raises(InvalidLayout, match="layer 0"):
            c.store_many([*((_key(30 + i), kv) for i, kv in enumerate(kvs)),
                          (_key(40), wrong)], mode="raw")
        assert not any(c.contains(_key(30 + i)) for i in range(6))
        assert not c.contains(_key(40))


def test_staged_write_refuses_what_does_not_fit() -> None:
    kv = random_kv(LAYOUT, 6, seed=80)
    with Staged(LAYOUT, 6, 0, None, tensors=False) as st:
        with pytest.raises(InvalidArgument, match="layout"):
            st.write(random_kv(uniform_layout(layers=4, heads=8, dim=32), 6))
        with pytest.raises(InvalidArgument, match="6 tokens|x 6"):
            st.write(random_kv(LAYOUT, 7))
        short = KVCache.__new__(KVCache)  # a tensor's bytes not the layer's (made after)
        short.layout, short.start_position = LAYOUT, 0
        short.layers = [*kv.layers[:-1], (kv.layers[-1][0][:, :-1], kv.layers[-1][1])]
        with pytest.raises(InvalidArgument, match="layer 3: a tensor of"):
            st.write(short)
        away = KVCache.__new__(KVCache)
        away.layout, away.start_position = LAYOUT, 0
        away.layers = [*kv.layers[:-1], tuple(t.to("meta") for t in kv.layers[-1])]
        with pytest.raises(InvalidArgument, match="layer 3: write of a tensor on meta"):
            st.write(away)
        st.write(kv)  # and after those, a sound one: the entry is what encode_parts writes
        assert st.sealed().to_bytes() == codec.encode_parts(kv, "raw",
                                                            layers_per_frame=0).to_bytes()
    with pytest.raises(InvalidArgument, match="closed"):
        st.write(kv)
