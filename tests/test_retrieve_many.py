"""Remote batch reads: one RetrieveMany stream, grouped: the headers of a run of keys in one
message with the small entries whole inside them (many a message), then the large ones' frames,
a message each, instead of GetMany's large unary messages, which Python gRPC moves at about
half a stream's speed. The ungrouped form (each key's header, then its frames) is what a
server without grouping answers, and the client reads both. Real server on loopback; the
stream's answers are checked as a fetch's are, and a stream that does not hold what was asked
is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kdn import codec, keys
from kdn.client import Client, dataplane, received, writes
from kdn.errors import Corrupt, LayoutMismatch
from kdn.server import ServerConfig, ServerThread
from kdn.server.retrieve_many import HEADER_BYTES
from kdn.transport.wire import (
    frame_message,
    parse_frame_message,
    retrieve_headers_message,
    retrieve_response,
)
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=4, dim=64)
"""1 KiB a token per layer: 4 KiB a token."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0)) as st:
        yield st


def _stored(c: Client, sizes: list[int], layers_per_frame: int = 0
            ) -> list[tuple[bytes, codec.EncodedParts]]:
    """Entries of ``sizes`` tokens, stored; frames as ``Client.store`` fills them (~1 MiB),
    or of ``layers_per_frame`` layers."""
    out = []
    for i, tokens in enumerate(sizes):
        parts = codec.encode_parts(random_kv(LAYOUT, tokens, seed=100 + i), "raw",
                                   layers_per_frame=layers_per_frame)
        key = keys.chunk_key([7000 + i], LAYOUT)
        c.store(key, parts)
        out.append((key, parts))
    return out


def test_a_batch_reads_small_entries_inline_and_large_ones_in_one_stream(
        server: ServerThread) -> None:
    """Entries of 32 KiB to 2 MiB and misses mixed: every entry reads back as stored, misses are
    None, and all came by one grouped RetrieveMany (no GetMany, no Retrieve)."""
    sizes = [8, 256, 16, 512, 200, 64, 160]  # 32 KiB ... 2 MiB
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        stored = _stored(c, sizes)
        large = sum(p.nbytes >= dataplane.STREAM_ENTRY_BYTES for _, p in stored)
        assert 1 < large < len(stored)
        miss = keys.chunk_key([6999], LAYOUT)
        ask = [stored[0][0], miss, *[k for k, _ in stored[1:]]]
        before = c.stats().counters
        got = c.fetch_many(ask, layout=LAYOUT)
        after = c.stats().counters
        assert got[1] is None
        for (_, parts), g in zip(stored, [got[0], *got[2:]]):
            assert g is not None and g.parts.to_bytes() == parts.to_bytes()
        assert after.get("retrievemany.hit", 0) - before.get("retrievemany.hit", 0) == 7
        assert after.get("retrievemany.miss", 0) - before.get("retrievemany.miss", 0) == 1
        for alone in ("retrieve.hit", "getmany.hit", "getmany.miss"):
            assert after.get(alone, 0) == before.get(alone, 0)
        back = c.retrieve_many(ask, layout=LAYOUT)
        assert back[1] is None and back[0] is not None
        assert back[0].equal(random_kv(LAYOUT, sizes[0], seed=100))
        assert back[4] is not None and back[4].equal(random_kv(LAYOUT, sizes[3], seed=103))


def test_retrieve_many_answers_each_key_in_order_and_refuses_another_layout(
        server: ServerThread) -> None:
    with Client(server.address, shm_bytes=0, data_path=False) as c, \
            grpc.insecure_channel(server.address) as ch:
        stored = _stored(c, [300, 20])
        call = ch.unary_stream("/kdn.v1.KDN/RetrieveMany",
                               request_serializer=pb.RetrieveManyRequest.SerializeToString,
                               response_deserializer=retrieve_response)
        miss = keys.chunk_key([1], LAYOUT)
        req = pb.RetrieveManyRequest(keys=[stored[1][0], miss, stored[0][0]])
        got = received.received_many(3, call(req, timeout=30))
        assert got[1] is None
        assert got[0] is not None and got[0].parts.to_bytes() == stored[1][1].to_bytes()
        assert got[2] is not None and got[2].parts.to_bytes() == stored[0][1].to_bytes()
        other = uniform_layout(layers=4, heads=2, dim=64)
        req.expect_layout_fingerprint = other.fingerprint
        with pytest.raises(grpc.RpcError) as info:
            list(call(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(LayoutMismatch):
            c.fetch_many([stored[0][0], stored[1][0], miss], layout=other)
        other_namespace = pb.RetrieveManyRequest(namespace="elsewhere",
                                                   keys=[stored[0][0]])
        assert received.received_many(1, call(other_namespace, timeout=30)) == [None]


def _messages(parts: codec.EncodedParts) -> list[object]:
    head = pb.RetrieveResponse(header=pb.RetrieveHeader(
        container_header=bytes(parts.header), total_bytes=parts.nbytes, tier="ram",
        frame_count=len(parts.frames)))
    return [head, *(parse_frame_message(frame_message(i, f)) for i, f in enumerate(parts.frames))]


@pytest.mark.parametrize("fault", ["frame-for-header", "short", "extra", "header-in-frames",
                                   "damaged"])
def test_a_stream_that_does_not_hold_what_was_asked_is_refused(fault: str) -> None:
    a = codec.encode_parts(random_kv(LAYOUT, 40, seed=1), "raw", layers_per_frame=1)
    b = codec.encode_parts(random_kv(LAYOUT, 40, seed=2), "raw", layers_per_frame=1)
    missing = pb.RetrieveResponse(header=pb.RetrieveHeader(missing=True))
    good = [*_messages(a), missing, *_messages(b)]
    assert [g.parts.to_bytes() if g else None
            for g in received.received_many(3, iter(good))] == [a.to_bytes(), None, b.to_bytes()]
    if fault == "frame-for-header":
        bad, count, words = good[1:], 3, "header of entry 0"
    elif fault == "short":
        bad, count, words = good, 4, "nothing arrived"
    elif fault == "extra":
        bad, count, words = good, 2, "more than the 2 entries"
    elif fault == "header-in-frames":  # entry a's last frame left out: b's header comes early
        bad, count, words = [*good[:4], *good[5:]], 3, "arrived where frame"
    else:
        frame = bytearray(a.frames[2])
        frame[-3] ^= 0x10
        bad = list(good)
        bad[3] = parse_frame_message(frame_message(2, bytes(frame)))
        count, words = 3, "frame 2"
    with pytest.raises(Corrupt, match=words):
        received.received_many(count, iter(bad))


def _grouped_call(ch: grpc.Channel) -> Any:
    return ch.unary_stream("/kdn.v1.KDN/RetrieveMany",
                           request_serializer=pb.RetrieveManyRequest.SerializeToString,
                           response_deserializer=retrieve_response)


def _shape(msgs: list[Any]) -> list[str]:
    """Each message of a RetrieveMany answer: ``run[...]`` (each header: ``i`` inline,
    ``s`` streamed, ``m`` missing) or ``f`` (a frame)."""
    def kind(v: Any) -> str:
        return "m" if v.head.missing else "i" if len(v.entry) else "s"

    return [f"run[{''.join(kind(v) for v in m.headers)}]" if m.WhichOneof("part") == "headers"
            else "f" for m in msgs]


def test_a_grouped_answer_runs_headers_then_the_frames_of_what_was_not_inline(
        server: ServerThread) -> None:
    """Entries up to ``inline_max_entry_bytes`` come whole inside their headers, a run holds
    no more inline bytes than ``inline_budget_bytes`` (the entry that would pass it starts the
    next run), a miss is a header of its own, and a streamed entry's frames follow the run
    that holds its header, in order. Every entry reads back as stored."""
    with Client(server.address, shm_bytes=0, data_path=False) as c, grpc.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stored = _stored(c, [8, 300, 16, 24, 8, 16], layers_per_frame=2)  # 300: 2 frames
        sizes = [p.nbytes for _, p in stored]
        miss = keys.chunk_key([1], LAYOUT)
        ks = [k for k, _ in stored]
        order = [0, 1, -1, 2, 4, 3, 5]  # -1: the miss
        ask = [ks[i] if i >= 0 else miss for i in order]
        headers = 2 * HEADER_BYTES + len(stored[1][1].header)  # the miss, the streamed one
        budget = sizes[0] + sizes[2] + sizes[4] + headers  # 32 + 64 + 32 KiB: the first run
        # is full
        req = pb.RetrieveManyRequest(keys=ask, grouped=True, inline_max_entry_bytes=100 << 10,
                                     inline_budget_bytes=budget)
        msgs = list(_grouped_call(ch)(req, timeout=30))  # 96 KiB, then 64 would pass 128
        assert _shape(msgs) == ["run[ismii]", "f", "f", "run[i]", "run[i]"]
        got = received.received_many(len(ask), iter(msgs))
        for i, g in zip(order, got):
            assert g is None if i < 0 else g is not None and \
                g.parts.to_bytes() == stored[i][1].to_bytes()
        # an entry larger than the run's budget streams, however small
        req = pb.RetrieveManyRequest(keys=[ks[2]], grouped=True,
                                     inline_max_entry_bytes=100 << 10,
                                     inline_budget_bytes=sizes[2] - 1)
        assert _shape(list(_grouped_call(ch)(req, timeout=30))) == ["run[s]", "f", "f"]
        # no inline limit: entries of small frames (under 256 KiB on average) still come whole
        # while they fit the budget; the 1.2 MB entry of 600 KiB frames streams
        req = pb.RetrieveManyRequest(keys=ks[:3], grouped=True, inline_budget_bytes=1 << 20)
        assert _shape(list(_grouped_call(ch)(req, timeout=30))) == ["run[isi]", "f", "f"]
        other = uniform_layout(layers=4, heads=2, dim=64)
        req = pb.RetrieveManyRequest(keys=ks, grouped=True,
                                     expect_layout_fingerprint=other.fingerprint)
        with pytest.raises(grpc.RpcError) as info:
            list(_grouped_call(ch)(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _grouped(parts: codec.EncodedParts, inline: bool) -> tuple[pb.RetrieveHeader,
                                                             list[bytes | memoryview]]:
    if inline:
        return pb.RetrieveHeader(total_bytes=parts.nbytes, tier="ram",
                                 frame_count=len(parts.frames)), [parts.to_bytes()]
    return pb.RetrieveHeader(container_header=bytes(parts.header), total_bytes=parts.nbytes,
                             tier="ram", frame_count=len(parts.frames)), []


@pytest.mark.parametrize("fault", ["too-many", "empty-run", "short-entry", "frame-count",
                                   "not-an-entry", "missing-with-bytes", "frame-left-out",
                                   "extra-run"])
def test_a_grouped_stream_that_does_not_hold_what_was_asked_is_refused(fault: str) -> None:
    a = codec.encode_parts(random_kv(LAYOUT, 40, seed=1), "raw", layers_per_frame=1)
    b = codec.encode_parts(random_kv(LAYOUT, 40, seed=2), "raw", layers_per_frame=1)
    missing = (pb.RetrieveHeader(missing=True), [])
    frames = [parse_frame_message(frame_message(i, f)) for i, f in enumerate(b.frames)]

    def run(*heads: tuple[pb.RetrieveHeader, list[bytes | memoryview]]) -> object:
        return retrieve_response(retrieve_headers_message(list(heads)))

    good = [run(_grouped(a, True), missing, _grouped(b, False)), *frames]
    assert [g.parts.to_bytes() if g else None for g in received.received_many(3, iter(good))
            ] == [a.to_bytes(), None, b.to_bytes()]
    count = 3
    if fault == "too-many":
        bad, count, words = good, 2, "run of 3 headers after 0 of the 2"
    elif fault == "empty-run":
        bad, words = [run(), *good], "run of 0 headers"
    elif fault == "short-entry":
        head, body = _grouped(a, True)
        head.total_bytes += 1
        bad, words = [run((head, body), missing, _grouped(b, False)), *frames], "under a header"
    elif fault == "frame-count":
        head, body = _grouped(a, True)
        head.frame_count -= 1
        bad, words = [run((head, body), missing, _grouped(b, False)), *frames], "frames under"
    elif fault == "not-an-entry":
        head, _ = _grouped(a, True)
        bad, words = [run((head, [bytes(a.nbytes)]), missing, _grouped(b, False)), *frames], \
            "not a kdn container"
    elif fault == "missing-with-bytes":
        bad, words = [run(_grouped(a, True), (pb.RetrieveHeader(missing=True), [b"x"]),
                          _grouped(b, False)), *frames], "missing entry with bytes"
    elif fault == "frame-left-out":  # b's last frame left out: the stream ends early
        bad, words = good[:-1], "stream ended"
    else:
        bad, words = [*good, run(missing)], "more than the 3 entries"
    with pytest.raises(Corrupt, match=words):
        received.received_many(count, iter(bad))


def test_a_damaged_inline_entry_is_caught_when_decoded(server: ServerThread) -> None:
    """An entry that came whole inside its header is checked as GetMany's inline entries are:
    when it is decoded (``retrieve_many``), never handed out as tensors."""
    a = codec.encode_parts(random_kv(LAYOUT, 40, seed=1), "raw", layers_per_frame=1)
    body = bytearray(a.to_bytes())
    body[-5] ^= 0x04
    head, _ = _grouped(a, True)
    got = received.received_many(1, iter([retrieve_response(retrieve_headers_message(
        [(head, [bytes(body)])]))]))[0]
    assert got is not None
    with pytest.raises(Corrupt):
        codec.decode(got.parts.to_bytes())


def test_a_server_that_does_not_group_is_read_as_before(server: ServerThread) -> None:
    """A server without grouping ignores the request's grouped fields and answers each key's
    header then its frames: the client reads that form too."""
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        stored = _stored(c, [8, 300, 16])
        plain = c.rpc.channel.unary_stream(  # noqa: SLF001 - the grouped fields dropped
            "/kdn.v1.KDN/RetrieveMany",
            request_serializer=lambda r: pb.RetrieveManyRequest(
                namespace=r.namespace, keys=r.keys).SerializeToString(),
            response_deserializer=retrieve_response)
        seen: list[str] = []

        def call(req: pb.RetrieveManyRequest, **kw: Any) -> Iterator[Any]:
            assert req.grouped
            for msg in plain(req, **kw):
                seen.append(msg.WhichOneof("part"))
                yield msg

        c.rpc.retrieve_many_call = call  # type: ignore[assignment]
        got = c.fetch_many([k for k, _ in stored] + [keys.chunk_key([1], LAYOUT)])
        assert got[-1] is None and "headers" not in seen and seen.count("header") == 4
        for g, (_, parts) in zip(got, stored):
            assert g is not None and g.parts.to_bytes() == parts.to_bytes()


def test_a_server_without_retrieve_many_is_read_key_by_key(server: ServerThread) -> None:
    """An older server answers UNIMPLEMENTED: the client reads each large entry on its own
    from then on, and the batch still reads back whole."""
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        stored = _stored(c, [300, 400])
        c.rpc.retrieve_many_call = c.rpc.channel.unary_stream(  # noqa: SLF001 - as an old server
            "/kdn.v1.KDN/NoSuchMethod",
            request_serializer=pb.RetrieveManyRequest.SerializeToString)
        got = c.fetch_many([k for k, _ in stored])
        assert [g.parts.to_bytes() for g in got if g] == [p.to_bytes() for _, p in stored]
        assert not c._reads._retrieve_many_ok  # noqa: SLF001
        assert c.stats().counters.get("retrievemany.hit", 0) == 0


def test_get_many_leaves_out_entries_past_the_inline_limit_with_their_length(
        server: ServerThread) -> None:
    """Past ``inline_max_entry_bytes`` an entry is left out (its length given), unless its
    frames are small (200 KiB each here: streamed, each would be a message of its own)."""
    with Client(server.address, shm_bytes=0, data_path=False) as c, \
            grpc.insecure_channel(server.address) as ch:
        stored = _stored(c, [8, 300, 200], layers_per_frame=1)  # frames of 8/300/200 KiB
        resp = pb_grpc.KDNStub(ch).GetMany(pb.GetManyRequest(
            keys=[k for k, _ in stored], region=pb.Region(length=16 << 20),
            inline_max_entry_bytes=stored[0][1].nbytes), timeout=30)
        small, large, small_frames = resp.entries
        assert small.written and small.data == stored[0][1].to_bytes()
        assert large.present and not large.written and not large.data
        assert large.length == stored[1][1].nbytes
        assert small_frames.written and small_frames.data == stored[2][1].to_bytes()


# -- StoreMany: the write side ------------------------------------------------------------------


def _store_many_stream(items: list[tuple[bytes, codec.EncodedParts]]) -> list[object]:
    out: list[object] = []
    for key, parts in items:
        out.append(pb.StoreRequest(header=pb.StoreHeader(
            key=key, container_header=parts.header, total_bytes=parts.nbytes)))
        out += [pb.StoreRequest.FromString(frame_message(i, f))
                for i, f in enumerate(parts.frames)]
    return out


def test_a_remote_batch_store_streams_its_large_entries_and_reads_back(
        server: ServerThread) -> None:
    """``store_many`` without a segment: entries from ``STREAM_ENTRY_BYTES`` go in one
    StoreMany stream, the small ones inline (PutMany); every entry reads back as stored."""
    sizes = [8, 256, 16, 512, 200]
    items = [(keys.chunk_key([8000 + i], LAYOUT), codec.encode_parts(
        random_kv(LAYOUT, t, seed=200 + i), "raw", layers_per_frame=0))
        for i, t in enumerate(sizes)]
    large = sum(p.nbytes >= dataplane.STREAM_ENTRY_BYTES for _, p in items)
    assert 1 < large < len(items)
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        before = c.stats().counters.get("store.ok", 0)
        done = c.store_many(items)
        assert [r.stored_bytes for r in done] == [p.nbytes for _, p in items]
        assert c.stats().counters.get("store.ok", 0) - before == len(items)
        got = c.fetch_many([k for k, _ in items])
        assert [g.parts.to_bytes() if g else None for g in got] == \
            [p.to_bytes() for _, p in items]


@pytest.mark.parametrize("fault", ["damaged", "frame-first", "short", "too-large"])
def test_a_bad_entry_in_a_store_many_stream_stores_none_of_them(
        server: ServerThread, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged frame in the second entry, a frame where a header is due, an entry cut short
    before the next header, or a batch past ``MAX_BATCH_BYTES``: INVALID_ARGUMENT (or
    RESOURCE_EXHAUSTED), and none of the entries is stored, the first one included."""
    from kdn.server import receive

    items = [(keys.chunk_key([8100 + i], LAYOUT), codec.encode_parts(
        random_kv(LAYOUT, 200, seed=300 + i), "raw", layers_per_frame=0)) for i in range(3)]
    msgs = _store_many_stream(items)
    per = 1 + len(items[0][1].frames)
    code = grpc.StatusCode.INVALID_ARGUMENT
    if fault == "damaged":
        frame = bytearray(bytes(items[1][1].frames[0]))
        frame[-5] ^= 0x01
        msgs[per + 1] = pb.StoreRequest.FromString(frame_message(0, bytes(frame)))
    elif fault == "frame-first":
        msgs = msgs[1:]
    elif fault == "short":  # the second entry's last frame left out: the third header is next
        del msgs[2 * per - 1]
    else:
        monkeypatch.setattr(receive, "MAX_BATCH_BYTES", items[0][1].nbytes * 2)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    words = "entry 1:" if fault in ("damaged", "short") else ""
    _refused_then_stored(server, msgs, _store_many_stream(items), items, code, words,
                         monkeypatch)


def _refused_then_stored(server: ServerThread, msgs: list[object], intact: list[object],
                         items: list[tuple[bytes, codec.EncodedParts]], code: grpc.StatusCode,
                         words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """StoreMany of ``msgs`` refused with ``code`` (its details holding ``words``) and none
    of ``items`` stored; then, the monkeypatches undone, ``intact`` stores every one of them
    and they read back as sent."""
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KDNStub(ch).StoreMany(iter(msgs), timeout=30)
        assert info.value.code() == code, info.value.details()
        assert words in (info.value.details() or ""), info.value.details()
        assert not any(i.present for i in c.lookup([k for k, _ in items]).infos)
        monkeypatch.undo()
        done = pb_grpc.KDNStub(ch).StoreMany(iter(intact), timeout=30)
        assert done.reads_grouped
        assert [r.stored_bytes for r in done.results] == [p.nbytes for _, p in items]
        got = c.fetch_many([k for k, _ in items])
        assert [g.parts.to_bytes() if g else None for g in got] == \
            [p.to_bytes() for _, p in items]


def test_a_server_without_store_many_is_written_as_before(server: ServerThread) -> None:
    items = [(keys.chunk_key([8200 + i], LAYOUT), codec.encode_parts(
        random_kv(LAYOUT, 300, seed=400 + i), "raw", layers_per_frame=0)) for i in range(2)]
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.rpc.store_many_call = c.rpc.channel.stream_unary(  # noqa: SLF001 - as an old server
            "/kdn.v1.KDN/NoSuchMethod", request_serializer=lambda m: m if isinstance(
                m, bytes) else m.SerializeToString())
        done = c.store_many(items)
        assert [r.stored_bytes for r in done] == [p.nbytes for _, p in items]
        assert not c._writes._store_many_ok  # noqa: SLF001
        got = c.fetch_many([k for k, _ in items])
        assert [g.parts.to_bytes() if g else None for g in got] == \
            [p.to_bytes() for _, p in items]


# -- StoreMany, grouped: every header first -----------------------------------------------------


def _grouped_store_stream(items: list[tuple[bytes, codec.EncodedParts]]) -> list[object]:
    heads = [pb.StoreHeader(key=key, container_header=parts.header, total_bytes=parts.nbytes)
             for key, parts in items]
    return [pb.StoreRequest(headers=pb.StoreHeaders(headers=heads)),
            *(pb.StoreRequest.FromString(frame_message(i, f))
              for _, parts in items for i, f in enumerate(parts.frames))]


def _batch(first: int, count: int, tokens: int = 200) -> list[tuple[bytes, codec.EncodedParts]]:
    return [(keys.chunk_key([first + i], LAYOUT), codec.encode_parts(
        random_kv(LAYOUT, tokens, seed=first + i), "raw", layers_per_frame=1))
        for i in range(count)]


def test_a_client_groups_its_store_many_once_the_server_says_it_reads_that(
        server: ServerThread) -> None:
    """The first StoreMany goes a header per entry; its answer says the server reads the
    grouped form (every header in one message, then the frames), and the next goes grouped:
    every entry reads back as stored, both times."""
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        for n, items in enumerate((_batch(8300, 3), _batch(8310, 4))):
            before = c.stats().counters.get("storemany.grouped", 0)
            done = c.store_many(items)
            assert [r.stored_bytes for r in done] == [p.nbytes for _, p in items]
            assert c.stats().counters.get("storemany.grouped", 0) - before == n
            got = c.fetch_many([k for k, _ in items])
            assert [g.parts.to_bytes() if g else None for g in got] == \
                [p.to_bytes() for _, p in items]


def test_a_server_that_does_not_say_it_reads_grouped_is_never_sent_one(
        server: ServerThread) -> None:
    """An older server's answer has no ``reads_grouped`` (it would refuse a grouped stream):
    the client keeps sending a header per entry."""
    def old(buf: bytes) -> pb.StoreManyResponse:
        resp = pb.StoreManyResponse.FromString(buf)
        resp.ClearField("reads_grouped")
        return resp

    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.rpc.store_many_call = c.rpc.channel.stream_unary(  # noqa: SLF001 - as an old server
            "/kdn.v1.KDN/StoreMany", request_serializer=lambda m: m if isinstance(
                m, bytes) else m.SerializeToString(), response_deserializer=old)
        before = c.stats().counters.get("storemany.grouped", 0)
        for items in (_batch(8320, 2), _batch(8330, 2)):
            assert [r.stored_bytes for r in c.store_many(items)] == \
                [p.nbytes for _, p in items]
        assert c.stats().counters.get("storemany.grouped", 0) == before


@pytest.mark.parametrize("fault", ["damaged", "short", "declared-short", "extra",
                                   "header-after", "no-headers", "too-many", "too-large"])
def test_a_bad_grouped_store_many_stores_none_of_its_entries(
        server: ServerThread, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged frame in the second entry, the second entry's last frame left out (the third
    entry's first frame then arrives where it was due), an entry declaring fewer bytes than
    its frames hold, a message after the last entry, a header after the grouped ones, no
    header at all or more than ``MAX_GROUPED_ENTRIES``, or a batch past ``MAX_BATCH_BYTES``:
    refused, none of the entries stored;
    the intact stream then stores them all."""
    from kdn.server import receive

    items = _batch(8400, 3)
    msgs = _grouped_store_stream(items)
    per = len(items[0][1].frames)
    code, words = grpc.StatusCode.INVALID_ARGUMENT, ""
    if fault == "damaged":
        frame = bytearray(bytes(items[1][1].frames[1]))
        frame[-5] ^= 0x01
        msgs[1 + per + 1] = pb.StoreRequest.FromString(frame_message(1, bytes(frame)))
        words = "entry 1:"
    elif fault == "short":
        del msgs[2 * per]
        words = "entry 1:"
    elif fault == "declared-short":
        heads = msgs[0].headers.headers  # type: ignore[attr-defined]
        heads[0].total_bytes -= 1
        words = "entry 0:"
    elif fault == "extra":
        msgs.append(msgs[1])
        words = "more after the 3 grouped entries"
    elif fault == "header-after":
        msgs.insert(1 + per, pb.StoreRequest(header=pb.StoreHeader(
            key=items[1][0], container_header=items[1][1].header,
            total_bytes=items[1][1].nbytes)))
        words = "a header after the grouped headers"
    elif fault == "no-headers":
        msgs = [pb.StoreRequest(headers=pb.StoreHeaders())]
        words = "of 0 headers"
    elif fault == "too-many":
        monkeypatch.setattr(receive, "MAX_GROUPED_ENTRIES", 2)
        words = "of 3 headers; from 1 to 2"
    else:
        monkeypatch.setattr(receive, "MAX_BATCH_BYTES", items[0][1].nbytes * 2)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    _refused_then_stored(server, msgs, _grouped_store_stream(items), items, code, words,
                         monkeypatch)


def test_a_batch_too_large_to_group_goes_a_header_per_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More entries than ``GROUP_ENTRIES``, or headers past ``GROUP_HEADER_BYTES``: no grouped
    form (the client sends a header per entry); within both, every header first, then each
    entry's frames in order."""
    items = [(k, p, pb.StoreOptions()) for k, p in _batch(8500, 3)]
    msgs = writes.grouped_store_messages("default", items)
    assert msgs is not None and len(msgs[0].headers.headers) == 3
    assert [bytes(m) for m in msgs[1:]] == [frame_message(i, f) for _, p, _ in items
                                            for i, f in enumerate(p.frames)]
    monkeypatch.setattr(writes, "GROUP_ENTRIES", 2)
    assert writes.grouped_store_messages("default", items) is None
    monkeypatch.undo()
    monkeypatch.setattr(writes, "GROUP_HEADER_BYTES", msgs[0].ByteSize() - 1)
    assert writes.grouped_store_messages("default", items) is None


def test_a_grouped_store_many_refused_as_a_bad_request_goes_again_a_header_per_entry(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that said it reads grouped StoreMany, then refuses one (as an older server put
    in its place would: INVALID_ARGUMENT, nothing stored): the client sends the batch again
    a header per entry, and it is stored."""
    from kdn.server import receive

    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.store_many(_batch(8600, 2))  # learns that the server reads the grouped form
        monkeypatch.setattr(receive, "MAX_GROUPED_ENTRIES", 0)  # now refuses every one
        items = _batch(8610, 3)
        before = c.stats().counters
        done = c.store_many(items)
        after = c.stats().counters
        assert [r.stored_bytes for r in done] == [p.nbytes for _, p in items]
        assert after.get("StoreMany.INVALID_ARGUMENT", 0) == \
            before.get("StoreMany.INVALID_ARGUMENT", 0) + 1
        assert after.get("storemany.grouped", 0) == before.get("storemany.grouped", 0)
        got = c.fetch_many([k for k, _ in items])
        assert [g.parts.to_bytes() if g else None for g in got] == \
            [p.to_bytes() for _, p in items]


def test_a_key_missing_past_a_full_answer_counts_as_a_miss(server: ServerThread) -> None:
    """A GetMany whose answer filled up asks the store only the later keys' sizes: one not
    there is a miss all the same (the client does not ask for it again), counted as any."""
    with Client(server.address) as c:
        full, absent = bytes(32), b"\x01" * 32
        c.store(full, random_kv(LAYOUT, 16), mode="raw")
        before = c.stats().counters.get("getmany.miss", 0)
        with grpc.insecure_channel(server.address) as ch:
            answer = pb_grpc.KDNStub(ch).GetMany(pb.GetManyRequest(
                keys=[full, absent], region=pb.Region(length=1000)))  # no room for one
        assert [e.present for e in answer.entries] == [True, False]
        assert c.stats().counters.get("getmany.miss", 0) - before == 1
