"""Entries kept as the frames they arrived in (``kdn.store.framed``): a Store of a large entry is
not copied into one buffer; the RAM tier holds its frames (views of the received messages) and
a Retrieve sends those messages back as they came. Every reader that wants one buffer gets the
entry joined, once, under the same stamp; lower tiers always get one buffer. Frames longer
than their prefix declares are refused on both sides of the wire."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kdn import codec, keys
from kdn.client import Client, dataplane, received
from kdn.codec.format import parse_header
from kdn.errors import Corrupt
from kdn.server import ServerConfig, ServerThread
from kdn.store.framed import Framed, contiguous
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import FramedHit, Hit, TieredStore
from kdn.transport.wire import MIN_PIECE_BYTES, frame_message, parse_frame_message, piece_messages
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=4, dim=64)
"""1 KiB a token per layer."""


def _parts(tokens: int, seed: int) -> codec.EncodedParts:
    return codec.encode_parts(random_kv(LAYOUT, tokens, seed=seed), "raw", layers_per_frame=1)


def _framed(parts: codec.EncodedParts, messages: bool = True) -> Framed:
    msgs = [frame_message(i, f) for i, f in enumerate(parts.frames)]
    views = []
    for m in msgs:
        got = parse_frame_message(m)
        assert got is not None and got.message is m
        views.append(got.frame.data)
    return Framed(bytes(parts.header), tuple(views), tuple(msgs) if messages else None,
                  parts.nbytes)


# -- the value ---------------------------------------------------------------------------------


def test_a_framed_value_joins_to_the_entry_and_refuses_what_does_not_add_up() -> None:
    parts = _parts(40, seed=1)
    value = _framed(parts)
    assert len(value) == parts.nbytes
    assert value.joined() == parts.to_bytes() == contiguous(value)
    plain = parts.to_bytes()
    assert contiguous(plain) is plain
    with pytest.raises(ValueError, match="declared as"):
        Framed(value.header, value.frames, None, parts.nbytes + 1)
    with pytest.raises(ValueError, match="messages for"):
        Framed(value.header, value.frames, value.messages[:-1], parts.nbytes)  # type: ignore[index]
    writable = memoryview(bytearray(bytes(value.frames[0])))
    with pytest.raises(ValueError, match="read-only"):
        Framed(value.header, (writable, *value.frames[1:]), None, parts.nbytes)


# -- the RAM tier ------------------------------------------------------------------------------


def test_the_ram_tier_keeps_frames_for_those_who_ask_and_joins_them_once_for_the_rest() -> None:
    parts = _parts(40, seed=2)
    ram = RamTier(64 << 20)
    value = _framed(parts)
    ram.put(b"k", value)
    framed = ram.get_stamped(b"k", framed=True)
    assert framed is not None and framed[0] is value
    stamp = framed[1]
    assert ram.stamp_if(b"k", value) == stamp
    joined = ram.get_stamped(b"k")
    assert joined is not None and joined == (parts.to_bytes(), stamp)
    assert isinstance(joined[0], bytes)
    again = ram.get_stamped(b"k", framed=True)  # the joined bytes took its place, same stamp
    assert again is not None and again[0] is joined[0] and again[1] == stamp
    assert ram.used_bytes == parts.nbytes and ram.size_of(b"k") == parts.nbytes


def test_a_join_racing_an_overwrite_never_puts_the_old_value_back() -> None:
    """The join runs outside the tier's lock: a put landing meanwhile keeps its value."""
    old, new = _parts(40, seed=3), _parts(40, seed=4)
    ram = RamTier(64 << 20)
    slow = _framed(old)
    started, go = threading.Event(), threading.Event()

    class SlowFramed(Framed):
        __slots__ = ()

        def joined(self) -> bytes:
            started.set()
            go.wait(5)
            return Framed.joined(self)

    ram.put(b"k", SlowFramed(slow.header, slow.frames, slow.messages, slow.nbytes))
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(ram.get_stamped(b"k")))
    reader.start()
    assert started.wait(5)
    ram.put(b"k", new.to_bytes())
    go.set()
    reader.join(5)
    assert got and got[0] is not None and got[0][0] == old.to_bytes()  # type: ignore[index]
    assert ram.get(b"k") == new.to_bytes()


def test_evicted_framed_values_are_demoted_as_one_buffer(tmp_path: Path) -> None:
    """A RAM tier alone keeps a ``Framed`` value; over a lower tier the store joins it once and
    every tier (and write queue) holds that one buffer; an eviction hook handed a ``Framed``
    value writes the lower tier one buffer too."""
    parts = _parts(40, seed=5)
    alone = TieredStore([RamTier(64 << 20)])
    try:
        assert alone.memory_only  # the server commits its Stores on the event loop's thread
        alone.put(b"a", _framed(parts), verified=True)
        hit = alone.get_in_memory(b"a", framed=True)
        assert isinstance(hit, FramedHit) and hit.value.joined() == parts.to_bytes()
        plain = alone.get_in_memory(b"a")
        assert isinstance(plain, Hit) and plain.value == parts.to_bytes()
    finally:
        alone.close()
    ram = RamTier(64 << 20)
    disk = LmdbTier(tmp_path / "l", capacity_bytes=64 << 20)
    both = TieredStore([ram, disk])
    try:
        assert not both.memory_only
        both.put(b"b", _framed(parts), verified=True)
        assert isinstance(ram.get_stamped(b"b", framed=True)[0], bytes)  # type: ignore[index]
        assert disk.get(b"b") == parts.to_bytes()
        assert ram.on_evict is not None
        # as the tier calls it when it evicts
        ram.on_evict(b"c", _framed(parts), None, ram.generation(b"c"))
        both.flush(5)
        assert disk.get(b"c") == parts.to_bytes()
    finally:
        both.close()


# -- the server --------------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0)) as st:
        yield st


def _store_stream(parts: codec.EncodedParts, key: bytes, msgs: list[bytes]) -> list[object]:
    return [pb.StoreRequest(header=pb.StoreHeader(
        key=key, container_header=parts.header, total_bytes=parts.nbytes,
        layout_fingerprint=parse_header(parts.header).layout.fingerprint)),
        *(pb.StoreRequest.FromString(m) for m in msgs)]


def _raw_retrieve(ch: grpc.Channel, key: bytes) -> list[bytes]:
    call = ch.unary_stream("/kdn.v1.KDN/Retrieve",
                           request_serializer=pb.RetrieveRequest.SerializeToString)
    return list(call(pb.RetrieveRequest(key=key), timeout=30))


def test_a_retrieve_sends_back_the_very_messages_a_store_brought(server: ServerThread) -> None:
    """Stored from 64 KiB up as its frames, an entry's first Retrieve sends the messages the
    Store brought (nothing built: the wire memo never misses), byte for byte; GetMany (inline
    and through a shared segment: one buffer) then reads it joined, and the Retrieve after
    that still reads the same bytes."""
    parts = _parts(600, seed=6)  # ~600 KiB frames, 2.4 MB
    key = keys.chunk_key([6], LAYOUT)
    msgs = list(parts.messages() or [frame_message(i, f) for i, f in enumerate(parts.frames)])
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        stub = pb_grpc.KDNStub(ch)
        stub.Store(iter(_store_stream(parts, key, msgs)), timeout=30)
        before = c.stats().counters["wire_memo.misses"]
        answer = _raw_retrieve(ch, key)
        assert answer[1:] == msgs
        assert c.stats().counters["wire_memo.misses"] == before
        got = c.fetch(key)
        assert got is not None and got.parts.to_bytes() == parts.to_bytes()
        with Client(server.address) as near:  # a shared segment: the arena's copy, joined
            for reader in (c, near):
                many = reader.fetch_many([key])
                assert many[0] is not None and many[0].parts.to_bytes() == parts.to_bytes()
        assert [m for m in _raw_retrieve(ch, key)[1:]] == msgs
        back = c.retrieve(key, layout=LAYOUT)
        assert back is not None and back.equal(random_kv(LAYOUT, 600, seed=6))


@pytest.mark.parametrize("kept_free_mib, kept", [(8, True), (4, False)])
def test_a_store_is_kept_as_its_frames_up_to_half_the_heap_the_allocator_keeps(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch, kept_free_mib: int,
        kept: bool) -> None:
    """``framed_limit``: a 2.4 MB Store is kept as its frames where the allocator keeps 8 MiB
    of free heap (its first Retrieve sends the Store's own messages: the wire memo does not
    miss), and copied into one buffer where it keeps 4 MiB (the Retrieve builds a message a
    frame); read back the same either way."""
    from kdn.server import receive

    monkeypatch.setattr(receive, "kept_free_bytes", lambda: kept_free_mib << 20)
    parts = _parts(600, seed=9)
    assert 2 << 20 < parts.nbytes < 4 << 20
    key = keys.chunk_key([9], LAYOUT)
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        c.store(key, parts)
        before = c.stats().counters["wire_memo.misses"]
        answer = _raw_retrieve(ch, key)
        misses = c.stats().counters["wire_memo.misses"] - before
        assert answer[1:] == [frame_message(i, f) for i, f in enumerate(parts.frames)]
        got = c.retrieve(key, layout=LAYOUT)
        assert got is not None and got.equal(random_kv(LAYOUT, 600, seed=9))
    assert misses == (0 if kept else len(parts.frames))


def test_the_framed_limit_and_the_servers_trim_threshold_bounds() -> None:
    """A server keeps half its RAM tier of free heap, from the client's 128 MiB to 512 MiB,
    and keeps Stores up to half of what the allocator keeps as their frames, up to
    ``MAX_FRAMED_BYTES``."""
    from kdn.store.framed import MAX_FRAMED_BYTES, framed_limit
    from kdn.transport.buffers import SERVER_TRIM_THRESHOLD, TRIM_THRESHOLD, server_trim_bytes

    assert server_trim_bytes(64 << 20) == TRIM_THRESHOLD
    assert server_trim_bytes(600 << 20) == 300 << 20
    assert server_trim_bytes(8 << 30) == SERVER_TRIM_THRESHOLD
    assert framed_limit(TRIM_THRESHOLD) == 64 << 20  # a client's, or an untuned process's
    assert framed_limit(300 << 20) == 150 << 20
    assert framed_limit(SERVER_TRIM_THRESHOLD) == MAX_FRAMED_BYTES
    assert framed_limit(4 << 30) == MAX_FRAMED_BYTES


def test_a_getmany_that_only_learns_the_size_leaves_the_frames_as_they_came(
        server: ServerThread) -> None:
    """A remote read of an entry too large for one inline message asks GetMany first, which
    answers with its length only: the value stays as its frames (not joined for nothing), so
    the Retrieve that follows sends the messages the Store brought, nothing built."""
    parts = _parts(1100, seed=8)  # 4.5 MB: past INLINE_ENTRY_BYTES, frames of ~1.1 MiB
    assert parts.nbytes > dataplane.INLINE_ENTRY_BYTES
    key = keys.chunk_key([8], LAYOUT)
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.store(key, parts)
        before = c.stats().counters
        got = c.fetch(key)  # GetMany (its length), then Retrieve
        after = c.stats().counters
        assert got is not None and got.parts.to_bytes() == parts.to_bytes()
        assert after["retrieve.hit"] == before.get("retrieve.hit", 0) + 1
        assert after["wire_memo.misses"] == before["wire_memo.misses"]  # the kept messages
        assert after.get("getmany.hit", 0) == before.get("getmany.hit", 0)  # sent nothing


def test_a_store_in_pieces_is_kept_as_frames_and_read_back_whole(server: ServerThread) -> None:
    """Pieces are joined frame by frame (no message to send back): a Retrieve builds whole
    frame messages, and every read path returns the entry as it was sent."""
    parts = _parts(600, seed=7)
    key = keys.chunk_key([7], LAYOUT)
    msgs = [m for i, f in enumerate(parts.frames) for m in piece_messages(i, f, MIN_PIECE_BYTES)]
    assert len(msgs) > len(parts.frames)
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        pb_grpc.KDNStub(ch).Store(iter(_store_stream(parts, key, msgs)), timeout=30)
        answer = _raw_retrieve(ch, key)
        assert answer[1:] == [frame_message(i, f) for i, f in enumerate(parts.frames)]
        got = c.fetch(key)
        assert got is not None and got.parts.to_bytes() == parts.to_bytes()


def test_frames_longer_than_their_prefix_declares_are_refused_on_both_sides(
        server: ServerThread) -> None:
    """A piece continuing a frame past the length its prefix declares: the server refuses the
    Store (INVALID_ARGUMENT, the stored entry stays), and a client receiving it raises
    Corrupt instead of returning an entry."""
    parts = _parts(600, seed=8)
    key = keys.chunk_key([8], LAYOUT)
    first = bytes(parts.frames[0])
    extra = frame_message(0, b"\0" * MIN_PIECE_BYTES, len(first))
    msgs = [frame_message(i, f) for i, f in enumerate(parts.frames)]
    long_stream = [msgs[0], extra, *msgs[1:]]
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        stub = pb_grpc.KDNStub(ch)
        stub.Store(iter(_store_stream(parts, key, msgs)), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter(_store_stream(parts, key, long_stream)), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "its prefix declares" in (info.value.details() or "")
        got = c.fetch(key)
        assert got is not None and got.parts.to_bytes() == parts.to_bytes()
    head = pb.RetrieveHeader(container_header=bytes(parts.header), total_bytes=parts.nbytes
                             + MIN_PIECE_BYTES, tier="ram")
    stream = [parse_frame_message(m) for m in long_stream]
    with pytest.raises(Corrupt, match="its prefix declares"):
        received.received(head, iter(stream))
