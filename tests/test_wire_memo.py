"""The remote path's copies: Retrieve's memoised frame messages (kdn.server.wire_memo), Store
messages written by the encoder (``encode_parts(wire=True)``), and entries a client knows to be
too large for one message (streamed without asking first)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.dataplane import INLINE_BYTES
from kdn.errors import Corrupt
from kdn.server import ServerConfig, ServerThread
from kdn.server.app import build_store
from kdn.server.config import ConfigError
from kdn.server.service import KDNServicer
from kdn.server.wire_memo import WireMemo
from kdn.transport.wire import frame_message, parse_frame_message, piece_messages
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout()
BIG = INLINE_BYTES // LAYOUT.bytes_per_token + 500  # tokens past one inline message: streamed


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _frames(n: int, size: int, fill: int = 1) -> list[tuple[int, bytes]]:
    return [(i, bytes([fill + i]) * size) for i in range(n)]


def test_memo_sends_the_messages_it_built_until_the_value_changes() -> None:
    memo = WireMemo(1 << 20)
    frames = _frames(4, 1000)
    first = list(memo.messages(b"k", 7, 4000, 4, frames))
    assert first == [[frame_message(i, f)] for i, f in frames]
    assert (memo.hits, memo.misses) == (0, 4)
    again = list(memo.messages(b"k", 7, 4000, 4, frames))
    assert all(a is b for a, b in zip(again, first)) and memo.hits == 4  # the same objects
    other = _frames(4, 1000, fill=50)  # another value of the key: another stamp
    assert list(memo.messages(b"k", 8, 4000, 4, other)) == [[frame_message(i, f)]
                                                            for i, f in other]
    assert memo.used_bytes == sum(len(frame_message(i, f)) for i, f in other)
    memo.drop(b"k")
    assert memo.used_bytes == 0
    assert list(memo.messages(b"k", 8, 4000, 4, other))[0] is not first[0]


def test_memo_keeps_one_form_of_the_messages_whole_or_in_pieces() -> None:
    memo = WireMemo(16 << 20)
    frames = [(0, bytes([1]) * 300_000), (1, bytes([2]) * 1000)]
    pieces = list(memo.messages(b"k", 7, 301_000, 2, frames, piece_bytes=1 << 16))
    assert pieces == [piece_messages(i, f, 1 << 16) for i, f in frames]
    assert len(pieces[0]) == 5 and len(pieces[1]) == 1
    assert list(memo.messages(b"k", 7, 301_000, 2, frames, piece_bytes=1 << 16))[0] \
        is pieces[0]  # memoised in that form
    whole = list(memo.messages(b"k", 7, 301_000, 2, frames))  # another form: built anew
    assert whole == [[frame_message(i, f)] for i, f in frames] and memo.misses == 4
    assert memo.used_bytes == sum(len(m[0]) for m in whole)


def test_memo_keeps_what_was_read_within_its_bytes_least_recent_out() -> None:
    memo = WireMemo(2500)
    list(memo.messages(b"a", 1, 1000, 1, _frames(1, 1000)))
    list(memo.messages(b"b", 2, 1000, 1, _frames(1, 1000)))
    list(memo.messages(b"a", 1, 1000, 1, _frames(1, 1000)))  # a read last: b goes first
    list(memo.messages(b"c", 3, 1000, 1, _frames(1, 1000)))
    assert set(memo._memos) == {b"a", b"c"}  # noqa: SLF001
    assert memo.used_bytes <= 2500
    list(memo.messages(b"d", 4, 3000, 1, _frames(1, 3000)))  # larger than the whole budget
    assert b"d" not in memo._memos and set(memo._memos) == {b"a", b"c"}  # noqa: SLF001
    list(memo.messages(b"e", 0, 10, 1, _frames(1, 10)))  # no stamp (not the RAM tier's value)
    assert b"e" not in memo._memos  # noqa: SLF001
    part = WireMemo(1 << 20)  # a read of some layers keeps those frames only
    list(part.messages(b"p", 1, 4000, 4, _frames(4, 1000)[1:3]))
    assert [m is not None for m in part._memos[b"p"].messages] == [  # noqa: SLF001
        False, True, True, False]
    assert WireMemo(0)._memo_for(b"k", 1, 1, 1, 0) is None  # noqa: SLF001  # off


def test_the_memo_is_at_most_a_quarter_of_the_ram_tier(tmp_path: Path) -> None:
    for memo, want in ((256 << 20, 2 << 20), (1 << 20, 1 << 20), (0, 0)):
        cfg = ServerConfig(port=0, data_dir=tmp_path, ram_bytes=8 << 20, disk_bytes=0,
                           wire_memo_bytes=memo)
        store = build_store(cfg)
        try:
            assert KDNServicer(cfg, store).wire_memo.capacity_bytes == want
        finally:
            store.close()
    with pytest.raises(ConfigError, match="wire_memo_bytes"):
        ServerConfig(wire_memo_bytes=-1)


@pytest.fixture
def remote(server: ServerThread) -> Iterator[Client]:
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as c:
        yield c


def test_streamed_reads_are_memoised_and_never_serve_an_older_value(
        server: ServerThread, remote: Client) -> None:
    assert server.server is not None
    memo = server.server.servicer.wire_memo
    a, b = random_kv(LAYOUT, BIG, seed=1), random_kv(LAYOUT, BIG, seed=2)
    remote.store(_key(1), a, mode="raw", layers_per_frame=1)
    assert remote.retrieve(_key(1), layout=LAYOUT).equal(a)  # type: ignore[union-attr]
    hits = memo.hits
    assert remote.retrieve(_key(1), layout=LAYOUT).equal(a)  # type: ignore[union-attr]
    assert memo.hits == hits + LAYOUT.num_layers  # every frame from the memo
    remote.store(_key(1), b, mode="raw", layers_per_frame=1)  # overwritten: a new stamp
    assert remote.retrieve(_key(1), layout=LAYOUT).equal(b)  # type: ignore[union-attr]
    remote.delete(_key(1))
    assert not any(k.endswith(_key(1).hex().encode()) for k in memo._memos)  # noqa: SLF001
    assert remote.retrieve(_key(1), layout=LAYOUT) is None
    stats = dict(remote.stats().counters)
    assert stats["wire_memo.hits"] >= LAYOUT.num_layers and "wire_memo.bytes" in stats


def test_a_stream_racing_overwrites_returns_one_stored_value_whole(
        server: ServerThread, remote: Client) -> None:
    """Two values written in turn while another client streams the key: every read is one of
    the two, whole (the memo is named by the value's stamp, never mixed)."""
    values = [random_kv(LAYOUT, BIG, seed=s) for s in (3, 4)]
    parts = [codec.encode_parts(v, "raw", wire=True) for v in values]
    remote.store(_key(2), parts[0])
    stop = threading.Event()

    def writer() -> None:
        with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as w:
            i = 0
            while not stop.is_set():
                i += 1
                w.store(_key(2), parts[i % 2])

    t = threading.Thread(target=writer)
    t.start()
    try:
        seen = set()
        for _ in range(60):
            got = remote.retrieve(_key(2), layout=LAYOUT)
            assert got is not None
            match = [j for j, v in enumerate(values) if got.equal(v)]
            assert len(match) == 1, "a read mixed two stored values"
            seen.add(match[0])
    finally:
        stop.set()
        t.join()
    assert seen  # at least one value read whole (both, when the writer kept pace)


def test_encoder_writes_each_frame_inside_its_store_message() -> None:
    kv = random_kv(LAYOUT, 64, seed=5)
    plain = codec.encode_parts(kv, "lossless", layers_per_frame=1)
    wired = codec.encode_parts(kv, "lossless", layers_per_frame=1, wire=True)
    assert wired.to_bytes() == plain.to_bytes() and plain.messages() is None
    msgs = wired.messages()
    assert msgs is not None and len(msgs) == len(wired.frames)
    for i, (msg, frame) in enumerate(zip(msgs, wired.frames)):
        assert msg == frame_message(i, frame)
        parsed = parse_frame_message(msg)
        assert parsed is not None and parsed.frame.index == i
        assert bytes(parsed.frame.data) == bytes(frame)
    swapped = codec.EncodedParts(wired.header, [bytes(f) for f in wired.frames], wire=wired.wire)
    assert swapped.messages() is None  # frames that are not the messages' own: built again


def test_client_store_sends_the_encoders_messages(server: ServerThread, remote: Client,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.client import writes as storing  # builds a Store stream's messages (store_messages)

    built: list[int] = []
    real = storing.frame_message

    def counting(index: int, data: bytes | memoryview) -> bytes:
        built.append(index)
        return real(index, data)

    monkeypatch.setattr(storing, "frame_message", counting)
    kv = random_kv(LAYOUT, 300, seed=6)
    remote.store(_key(3), kv, mode="int8", layers_per_frame=1)
    assert built == []  # encoded by the client: sent as the encoder wrote them
    back = remote.retrieve(_key(3), layout=LAYOUT)
    assert back is not None and back.num_tokens == 300
    remote.store(_key(4), codec.encode_parts(kv, "raw", layers_per_frame=1))
    assert built == list(range(LAYOUT.num_layers))  # pre-encoded plainly: built here
    assert remote.retrieve(_key(4), layout=LAYOUT).equal(kv)  # type: ignore[union-attr]


def test_a_key_known_too_big_is_streamed_without_asking_first(
        server: ServerThread, remote: Client) -> None:
    calls: list[int] = []
    get = remote.dataplane._get  # noqa: SLF001

    def counted(req, request_id):  # type: ignore[no-untyped-def]
        calls.append(len(req.keys))
        return get(req, request_id)

    remote.dataplane._get = counted  # type: ignore[method-assign]  # noqa: SLF001
    big, small = random_kv(LAYOUT, BIG, seed=7), random_kv(LAYOUT, 40, seed=8)
    remote.store(_key(5), big, mode="raw")
    assert remote.fetch(_key(5)) is not None and calls == [1]  # asked once: too big
    assert remote.retrieve(_key(5), layout=LAYOUT).equal(big)  # type: ignore[union-attr]
    assert calls == [1]  # then streamed straight away
    remote.store(_key(5), small, mode="raw")  # stored again smaller: still read right
    assert remote.retrieve(_key(5), layout=LAYOUT).equal(small)  # type: ignore[union-attr]
    remote.delete(_key(5))
    assert remote.fetch(_key(5)) is None
    remote.store(_key(6), small, mode="raw")
    assert remote.fetch(_key(6)) is not None and calls == [1, 1]  # other keys ask as before
    assert server.server is not None  # the streamed path still checks what arrives
    remote.store(_key(5), big, mode="raw", layers_per_frame=1)
    assert remote.retrieve(_key(5), layout=LAYOUT).equal(big)  # type: ignore[union-attr]
    memo = next(m for k, m in server.server.servicer.wire_memo._memos.items()  # noqa: SLF001
                if k.endswith(_key(5).hex().encode()))
    bad = bytearray(memo.messages[0][-1])  # type: ignore[index]
    bad[-1] ^= 1
    memo.messages[0][-1] = bytes(bad)  # type: ignore[index]
    with pytest.raises(Corrupt):
        remote.retrieve(_key(5), layout=LAYOUT)
