"""Asynchronous stores (Client.store_async, flush): sent on the thread's fast-path connection
without waiting, answered in order. Over a real server: every entry stored and answered; at
most ASYNC_DEPTH unanswered; a later call of the thread reads their answers first, so a read
after an overwrite sees the new value (also where the client keeps a lease on the old one); a
damaged entry's error comes from its result() and from flush(), the stores around it land; a
staged entry goes by where it lies; a remote client sends them on its network data path the
same way (a client with neither path stores synchronously); result()
on another thread before the answer is refused; a fast path that breaks under unanswered
stores fails them with UNAVAILABLE and the client carries on over gRPC. An operator call
(AdminClient's inspect, pin, ls, ...) and stats/health read the answers first too."""

from __future__ import annotations

import threading

import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.pending import ASYNC_DEPTH
from kdn.codec import EncodedParts
from kdn.errors import InvalidArgument, Unavailable
from kdn.options import StoreOptions
from kdn.server import ServerThread
from tests.helpers import numbered_key as _key
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout()


def test_async_stores_land_and_are_answered_in_order(server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 120, seed=i) for i in range(3 * ASYNC_DEPTH)]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        pending = []
        for i, kv in enumerate(kvs):
            pending.append(c.store_async(_key(i), kv, mode="raw"))
            assert sum(not p.done() for p in pending) <= ASYNC_DEPTH
        assert not pending[-1].done()  # sent, not waited for
        c.flush()
        assert all(p.done() for p in pending)
        assert [p.result().stored_bytes > 0 for p in pending] == [True] * len(kvs)
        assert server.server.servicer.counters["fast.PutMany"] >= len(kvs)  # type: ignore
        for i, kv in enumerate(kvs):
            got = c.retrieve(_key(i), layout=LAYOUT)
            assert got is not None and got.equal(kv)


def test_a_later_call_reads_the_answers_first_so_reads_see_the_stores(
        server: ServerThread) -> None:
    old, new = random_kv(LAYOUT, 200, seed=1), random_kv(LAYOUT, 200, seed=2)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        c.store(_key(1), old, mode="raw")
        first = c.retrieve(_key(1), layout=LAYOUT)  # the client may now keep a lease on it
        assert first is not None and first.equal(old)
        p = c.store_async(_key(1), new, mode="raw")
        got = c.retrieve(_key(1), layout=LAYOUT)
        assert p.done() and got is not None and got.equal(new)
        p2 = c.store_async(_key(2), new, mode="raw")
        assert c.contains(_key(2)) and p2.done()
        p3 = c.store_async(_key(3), old, mode="raw")
        infos = c.lookup([_key(3)]).infos
        assert p3.done() and infos[0].present


def test_operator_calls_read_the_answers_first(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 64, seed=5)
    with AdminClient(server.address, timeout_s=30, data_path=False) as a:
        calls = [("inspect", lambda k: a.inspect(k).key == k),
                 ("pin", lambda k: a.pin([k]) == 1),
                 ("unpin", lambda k: a.unpin([k]) == 1),
                 ("ls", lambda k: k in [e.key for e in a.ls(key_prefix=k)]),
                 ("evict", lambda k: a.evict([k]) >= 1),
                 ("stats", lambda k: a.stats() is not None),
                 ("health", lambda k: a.health() == "SERVING"),
                 ("gc", lambda k: a.gc() is not None)]
        for i, (name, call) in enumerate(calls):
            p = a.store_async(_key(300 + i), kv, mode="raw",
                              options=StoreOptions(pin=name == "unpin"))
            assert not p.done()
            assert call(_key(300 + i)), name
            assert p.done(), name  # read before the call was made
            assert p.result().stored_bytes > 0


def test_a_damaged_entry_fails_alone_and_flush_raises_it(server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 80, seed=10 + i) for i in range(3)]
    good = [codec.encode_parts(kv, "raw") for kv in kvs]
    frame = bytearray(good[1].frames[-1])
    frame[-3] ^= 0x10
    bad = EncodedParts(good[1].header, [*good[1].frames[:-1], bytes(frame)])
    with Client(server.address, timeout_s=30, data_path=False) as c:
        ps = [c.store_async(_key(20), good[0]), c.store_async(_key(21), bad),
              c.store_async(_key(22), good[2])]
        with pytest.raises(InvalidArgument, match="corrupt"):
            c.flush()
        c.flush()  # reported once
        with pytest.raises(InvalidArgument, match="corrupt"):
            ps[1].result()
        assert ps[0].result().stored_bytes and ps[2].result().stored_bytes
        assert c.retrieve(_key(20), layout=LAYOUT).equal(kvs[0])  # type: ignore[union-attr]
        assert c.retrieve(_key(22), layout=LAYOUT).equal(kvs[2])  # type: ignore[union-attr]
        assert not c.contains(_key(21))


@pytest.mark.parametrize("options", [{"data_path": False}, {"shm_bytes": 0},
                                     {"shm_bytes": 0, "data_path": False}],
                         ids=["same-host", "network", "grpc-only"])
def test_a_refused_store_is_reported_by_flush_on_every_path(
        server: ServerThread, options: dict[str, object]) -> None:
    """Over gRPC alone (and the network data path's first call, stored as ``store``) the
    refusal was raised by store_async itself; through the segment only by flush(). A bad
    argument is raised by the call on every path."""
    good = codec.encode_parts(random_kv(LAYOUT, 16, seed=40), "raw")
    frame = bytearray(good.frames[-1])
    frame[-3] ^= 0x10
    bad = EncodedParts(good.header, [*good.frames[:-1], bytes(frame)])
    with Client(server.address, timeout_s=30, **options) as c:  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="key"):
            c.store_async("k", good)  # type: ignore[arg-type]
        p = c.store_async(_key(60), bad)
        with pytest.raises(InvalidArgument, match="corrupt"):
            c.flush()
        c.flush()  # reported once
        with pytest.raises(InvalidArgument, match="corrupt"):
            p.result()
        assert not c.contains(_key(60))


def test_staged_and_remote_async_stores(server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 64, seed=30 + i) for i in range(2)]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        st = c.stage(LAYOUT, 64)
        for (k, v), (a, b) in zip(st.layers, kvs[0].layers):
            k.copy_(a)
            v.copy_(b)
        p = c.store_async(_key(30), st)
        assert p.result().stored_bytes == st.nbytes  # answered: free to write it again
        for (k, v), (a, b) in zip(st.layers, kvs[1].layers):
            k.copy_(a)
            v.copy_(b)
        c.store_async(_key(31), st)
        c.flush()
        for i, kv in enumerate(kvs):
            assert c.retrieve(_key(30 + i), layout=LAYOUT).equal(kv)  # type: ignore[union-attr]
        st.close()
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as grpc_only:
        p = grpc_only.store_async(_key(32), kvs[0], mode="raw")
        assert p.done() and p.result().stored_bytes > 0  # stored as store() does
        grpc_only.flush()
        assert grpc_only.retrieve(_key(32), layout=LAYOUT).equal(kvs[0])  # type: ignore


def test_a_remote_client_sends_them_on_its_data_path(server: ServerThread) -> None:
    """Without a segment, asynchronous stores go on the thread's network data path
    connection, answered in order: bounded, read before the next call (which then reads on
    the same connection), a damaged entry failing alone, a connection that breaks failing the
    unanswered ones UNAVAILABLE."""
    kvs = [random_kv(LAYOUT, 100, seed=70 + i) for i in range(2 * ASYNC_DEPTH)]
    bad_parts = codec.encode_parts(kvs[0], "raw")
    frame = bytearray(bad_parts.frames[0])
    frame[-2] ^= 0x01
    bad = EncodedParts(bad_parts.header, [bytes(frame), *bad_parts.frames[1:]])
    with Client(server.address, timeout_s=30, shm_bytes=0) as c:
        c.store(_key(69), kvs[0], mode="raw")  # the data path is up
        assert c.dataplane.net() is not None
        before = server.server.servicer.counters.get("net.PutMany", 0)  # type: ignore
        ps = [c.store_async(_key(70 + i), kv, mode="raw") for i, kv in enumerate(kvs)]
        assert not ps[-1].done() and sum(not p.done() for p in ps) <= ASYNC_DEPTH
        got = c.retrieve(_key(70 + len(kvs) - 1), layout=LAYOUT)  # its answer read first
        assert all(p.done() for p in ps) and got is not None and got.equal(kvs[-1])
        assert server.server.servicer.counters["net.PutMany"] - before == len(kvs)  # type: ignore
        p_bad, p_good = c.store_async(_key(90), bad), c.store_async(_key(91), kvs[1], mode="raw")
        with pytest.raises(InvalidArgument, match="corrupt"):
            c.flush()
        assert p_good.result().stored_bytes > 0 and not c.contains(_key(90))
        with pytest.raises(InvalidArgument):
            p_bad.result()
        ps = [c.store_async(_key(92 + i), kv, mode="raw") for i, kv in enumerate(kvs[:3])]
        c.dataplane.network._net.threads.mine().conn.close()  # type: ignore[union-attr]
        with pytest.raises(Unavailable, match="may or may not be stored"):
            c.flush()
        assert all(p.done() for p in ps)
        p = c.store_async(_key(95), kvs[2], mode="raw")  # stored, one way or another
        assert p.result().stored_bytes > 0
        assert c.retrieve(_key(95), layout=LAYOUT).equal(kvs[2])  # type: ignore[union-attr]


def test_result_on_another_thread_waits_for_the_senders_flush(server: ServerThread) -> None:
    kv = random_kv(LAYOUT, 64, seed=40)
    with Client(server.address, timeout_s=30, data_path=False) as c:
        p = c.store_async(_key(40), kv, mode="raw")
        seen: list[BaseException | None] = []

        def other() -> None:
            try:
                p.result()
                seen.append(None)
            except BaseException as exc:  # noqa: BLE001 - what the other thread got
                seen.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert isinstance(seen[0], InvalidArgument)
        c.flush()
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen[1] is None and p.result().stored_bytes > 0


def test_a_broken_fast_path_fails_the_unanswered_stores_and_grpc_takes_over(
        server: ServerThread) -> None:
    kvs = [random_kv(LAYOUT, 64, seed=50 + i) for i in range(3)]
    with Client(server.address, timeout_s=30, data_path=False) as c:
        c.store(_key(49), kvs[0], mode="raw")
        ps = [c.store_async(_key(50 + i), kv, mode="raw") for i, kv in enumerate(kvs)]
        c.dataplane.same_host.threads.mine().conn.close()  # goes before any answer is read
        with pytest.raises(Unavailable, match="may or may not be stored"):
            c.flush()
        assert all(p.done() for p in ps)
        p = c.store_async(_key(60), kvs[1], mode="raw")  # no fast path: stored at once
        assert p.done() and p.result().stored_bytes > 0
        assert c.retrieve(_key(60), layout=LAYOUT).equal(kvs[1])  # type: ignore[union-attr]


def test_puts_queued_on_a_connection_are_copied_together_and_answered_one_by_one(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """PutMany calls sent back to back on one fast-path connection before any answer (what
    store_async does) are copied out together, two at a time, and each is answered as it would
    be alone, in order: a damaged call in the middle is refused whole (its sound item is not
    stored either), the calls around it land, a later overwrite of a key wins, and a GetMany
    queued behind them is served after them."""
    import kdn.server.fastpath as fastpath
    from kdn.client.fastwire import fast_answer, fast_error
    from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, FAST_PUT_MANY
    from kdn.v1 import kdn_pb2 as pb

    groups: list[int] = []
    real = fastpath.FastPath._put_group

    def seen(self: fastpath.FastPath, conn: object, group: list[tuple[bytes, float]]) -> bool:
        groups.append(len(group))
        return real(self, conn, group)  # type: ignore[arg-type]

    monkeypatch.setattr(fastpath.FastPath, "_put_group", seen)
    kvs = [random_kv(LAYOUT, 64, seed=70 + i) for i in range(4)]
    raw = [codec.encode_parts(kv, "raw").to_bytes() for kv in kvs]
    bad = bytearray(raw[2])
    bad[-10] ^= 0x01
    with Client(server.address, timeout_s=30, data_path=False) as c:
        c.store(_key(70), kvs[0], mode="raw")  # the segment attached, the old value of 70
        seg, seg_id = c.dataplane.segment()
        conn = c.dataplane.same_host._fast_conn()

        def call(op: int, req: pb.PutManyRequest | pb.GetManyRequest) -> bytes:
            body = req.SerializeToString()
            return FAST_HEAD.pack(len(body), op) + body

        def put(*items: tuple[bytes, bytes]) -> bytes:
            req = pb.PutManyRequest(namespace="default", segment_id=seg_id)
            for key, data in items:
                at = seg.regions.alloc(len(data))
                assert at is not None
                seg.write(at, data)
                item = req.items.add(key=key)
                item.region.offset, item.region.length = at, len(data)
            return call(FAST_PUT_MANY, req)

        at = seg.regions.alloc(1 << 16)
        assert at is not None
        answer_to = pb.Region(offset=at, length=1 << 16)
        sent = [put((_key(71), raw[1])),
                put((_key(73), raw[3]), (_key(72), bytes(bad))),  # refused whole
                put((_key(70), raw[3])),  # an overwrite
                put((_key(74), raw[1])),
                call(FAST_GET_MANY, pb.GetManyRequest(namespace="default", segment_id=seg_id,
                                                      keys=[_key(99)], region=answer_to))]
        conn.sendall(b"".join(sent))  # all queued before the server reads the first
        answers = [fast_answer(conn) for _ in sent]
        assert [ok for ok, _ in answers] == [1, 0, 1, 1, 1]
        assert isinstance(fast_error(answers[1][1]), InvalidArgument)
        assert "item 1: corrupt" in str(fast_error(answers[1][1]))
        assert [r.stored_bytes for r in pb.PutManyResponse.FromString(answers[0][1]).results] \
            == [len(raw[1])]
        assert not pb.GetManyResponse.FromString(answers[4][1]).entries[0].present
        assert groups and max(groups) >= 2, groups  # copied together
        assert [i.present for i in c.lookup([_key(72), _key(73)]).infos] == [False, False]
        for key, want in ((70, kvs[3]), (71, kvs[1]), (74, kvs[1])):
            got = c.retrieve(_key(key), layout=LAYOUT)
            assert got is not None and got.equal(want), key


def test_a_store_seen_done_on_another_thread_has_its_error() -> None:
    """resolve() marked the store done before it recorded the error: a thread that saw
    done() could read result() as an AssertionError (under -O: None, a failed store answered)."""
    import sys
    import time

    from kdn.client.pending import PendingStore

    seen: list[str] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end and not seen:
            stores = [PendingStore(None, b"k" * 32) for _ in range(2000)]
            for p in stores:
                p._thread = -1  # read as from another thread: result() does not settle

            def read(stores: list[PendingStore] = stores) -> None:
                for p in stores:
                    while not p.done():
                        pass
                    try:
                        seen.append(f"answered {p.result()!r}")
                    except InvalidArgument:
                        pass
                    except BaseException as exc:  # noqa: BLE001 - what the test is about
                        seen.append(repr(exc))

            t = threading.Thread(target=read)
            t.start()
            for p in stores:
                p.resolve(None, InvalidArgument("damaged"))
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not seen, seen[:3]
