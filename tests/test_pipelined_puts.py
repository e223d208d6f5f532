"""Pipelined same-host stores (kdn.client.pipelined.put_pipelined): a large
``store_many`` goes as several PutMany calls on the fast path, the next one written while the
server copies the last. Over a real server: every entry reads back as stored, each call's
region is freed, an error in one call is raised after every call was answered (the path stays
usable, nothing half-written), a path that goes away mid-way stores the rest by gRPC, and a
segment without room stores what it can and the rest another way. (Entries in frames of one
layer: a ``raw`` KVCache in default frames is written straight into the segment instead,
``tests/test_fill_puts.py``.)"""

from __future__ import annotations

import dataclasses

import pytest

import kdn.client.pipelined as dp
from kdn.client import Client, samehost
from kdn.errors import TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def small_calls(monkeypatch: pytest.MonkeyPatch) -> int:
    """Pipelined calls of 32 KiB (a few entries each)."""
    monkeypatch.setattr(dp, "PIPE_BYTES", 32 << 10)
    return 32 << 10


@pytest.fixture
def values() -> list:
    return [random_kv(LAYOUT, 40, seed=i) for i in range(24)]


def _calls(c: Client) -> int:
    return int(dict(c.stats().counters).get("fast.PutMany", 0))


def _read_back(c: Client, values: list, offset: int = 0) -> None:
    got = c.retrieve_many([_key(offset + i) for i in range(len(values))], layout=LAYOUT)
    assert all(g is not None and g.equal(v) for g, v in zip(got, values))


def test_a_large_batch_goes_in_several_calls_and_reads_back(
        server: ServerThread, small_calls: int, values: list) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        before = _calls(c)
        out = c.store_many([(_key(i), kv) for i, kv in enumerate(values)],
                           mode="raw", layers_per_frame=1)
        assert len(out) == len(values) and all(r.stored_bytes > 0 for r in out)
        size = out[0].stored_bytes
        assert _calls(c) - before >= len(values) * size // small_calls  # pipelined calls
        _read_back(c, values)
        seg = c.dataplane.segment()[0]
        assert seg.regions.free_bytes() >= seg.size - (8 << 20)  # every call's region freed


def test_an_error_in_one_call_is_raised_once_all_were_answered(
        server_config: ServerConfig, small_calls: int, values: list, tmp_path) -> None:
    """A tenant whose quota holds only part of the batch: the call past it is refused, the
    calls before it stored theirs, and the connection serves the next call in order."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  t: {api_keys: [key-t], quota_bytes: 120000}\n")
    auth.chmod(0o600)
    with ServerThread(dataclasses.replace(server_config, auth_file=str(auth))) as st, \
            Client(st.address, timeout_s=30, shm_bytes=4 << 20, api_key="key-t") as c:
        with pytest.raises(TooLarge, match="quota"):
            c.store_many([(_key(i), kv) for i, kv in enumerate(values)],
                         mode="raw", layers_per_frame=1)
        stored = [c.contains(_key(i)) for i in range(len(values))]
        assert stored[0] and not all(stored)  # the first calls stored theirs
        kv = random_kv(LAYOUT, 4, seed=99)
        c.delete([_key(i) for i in range(len(values))])
        c.store_many([(_key(100), kv), (_key(101), kv)], mode="raw",
                     layers_per_frame=1)  # the path still in step
        got = c.retrieve(_key(101), layout=LAYOUT)
        assert got is not None and got.equal(kv)


def test_a_path_that_goes_away_midway_stores_the_rest_by_grpc(
        server: ServerThread, small_calls: int, values: list,
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = dp.fast_answer
    answers = [0]

    def flaky(conn, *bound):  # type: ignore[no-untyped-def]
        answers[0] += 1
        if answers[0] == 3:
            raise OSError("connection reset")
        return real(conn, *bound)

    monkeypatch.setattr(dp, "fast_answer", flaky)  # the pipelined calls' answers
    monkeypatch.setattr(samehost, "fast_answer", flaky)  # and the path's other calls'
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        c.store(_key(999), values[0], mode="raw")  # attach first (one answer)
        out = c.store_many([(_key(i), kv) for i, kv in enumerate(values)],
                           mode="raw", layers_per_frame=1)
        assert all(r.stored_bytes > 0 for r in out)
        gone = c.dataplane.same_host._fast_path == ""  # later calls by gRPC
        assert answers[0] >= 3 and gone
        _read_back(c, values)


def test_a_segment_without_room_stores_what_it_can_and_the_rest_another_way(
        server: ServerThread, small_calls: int, values: list) -> None:
    with Client(server.address, timeout_s=30, shm_bytes=1 << 20) as c:
        c.store(_key(999), values[0], mode="raw")
        seg = c.dataplane.segment()[0]
        hold = seg.regions.alloc(seg.size - (48 << 10))  # a read holds most of it
        assert hold is not None
        out = c.store_many([(_key(i), kv) for i, kv in enumerate(values)],
                           mode="raw", layers_per_frame=1)
        assert all(r.stored_bytes > 0 for r in out)
        seg.regions.free(hold, seg.size - (48 << 10))
        _read_back(c, values)


def test_entries_larger_than_a_call_are_stored_too(
        server: ServerThread, small_calls: int) -> None:
    mixed = [random_kv(LAYOUT, 40 if i % 3 else 600, seed=i) for i in range(9)]
    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        out = c.store_many([(_key(i), kv) for i, kv in enumerate(mixed)],
                           mode="raw", layers_per_frame=1)
        assert out[0].stored_bytes > small_calls and all(r.stored_bytes for r in out)
        _read_back(c, mixed)


@pytest.mark.parametrize("change", [-1, 1])
def test_an_answer_with_the_wrong_number_of_results_is_an_error(
        server: ServerThread, small_calls: int, values: list,
        monkeypatch: pytest.MonkeyPatch, change: int) -> None:
    """A PutMany answer with one result fewer or more than its call had entries names the
    mismatch (raised once every call was answered), not taken for entries to store again."""
    from kdn.errors import KDNError
    from kdn.v1 import kdn_pb2 as pb

    real = dp.fast_answer
    answers = [0]

    def miscounted(conn, *bound):  # type: ignore[no-untyped-def]
        ok, body = real(conn, *bound)
        answers[0] += 1
        if ok and answers[0] == 2:
            resp = pb.PutManyResponse.FromString(body)
            if change < 0:
                del resp.results[-1]
            else:
                resp.results.add().CopyFrom(resp.results[0])
            body = resp.SerializeToString()
        return ok, body

    with Client(server.address, timeout_s=30, shm_bytes=4 << 20) as c:
        c.store(_key(999), values[0], mode="raw")  # attach first
        monkeypatch.setattr(dp, "fast_answer", miscounted)
        with pytest.raises(KDNError, match=r"PutMany answered \d+ results for \d+ entries"):
            c.store_many([(_key(i), kv) for i, kv in enumerate(values)],
                         mode="raw", layers_per_frame=1)
        assert answers[0] > 2  # the later calls were answered too


@pytest.mark.parametrize(("mode", "admitted"), [("lossless", False), ("lossless", True),
                                               ("raw", True)])
def test_a_batch_of_many_small_entries_goes_in_calls_a_server_takes(
        server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch, mode: str,
        admitted: bool) -> None:
    """Calls were cut by bytes alone: ``PIPE_BYTES`` of entries of a few hundred bytes is
    more keys than a server takes in one call (``MAX_CALL_KEYS``: the batch was refused
    INVALID_ARGUMENT), and a first call of that many a body larger than a connection not yet
    admitted may send (the server closed it). Encoded entries (``put_pipelined``) on a fresh
    connection and on one a store was admitted on, KVCaches written into the segment
    (``put_staged_pipelined``, once the client knows the fast path)."""
    from kdn import codec
    from kdn.layout import KVLayout, LayerLayout
    from kdn.names import MAX_CALL_KEYS
    from kdn.options import Durability, StoreOptions

    monkeypatch.setattr(dp, "PIPE_BYTES", 6 << 20)  # fewer entries, still more than a call's
    tiny = KVLayout("tiny", (LayerLayout(1, 4, 4),), head_dim=4)
    kv = random_kv(tiny, 1, seed=1)
    entry = kv if mode == "raw" else codec.encode_parts(kv, mode)
    n = (6 << 20) // codec.encode_parts(kv, mode).nbytes + 1000
    assert n > MAX_CALL_KEYS + 1000
    keys = [_key(i) for i in range(n)]
    options = StoreOptions(ttl_s=10**9, durability=Durability.MEMORY)
    config = dataclasses.replace(server_config, disk_bytes=0)  # RAM alone: fast
    with ServerThread(config) as st, Client(st.address, timeout_s=30) as c:
        if admitted:
            c.store(_key(n), kv, mode=mode)
        before = _calls(c)
        out = c.store_many([(k, entry) for k in keys], mode=mode, options=options)
        assert len(out) == n and all(r.stored_bytes > 0 for r in out)
        assert _calls(c) - before >= 2  # pipelined, not stored another way
        assert all(i.present for i in c.lookup(keys[-10:]).infos)
