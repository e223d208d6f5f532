"""Frames in pieces (``Frame.offset``): a large frame crosses the wire in messages of the size
gRPC moves fastest. The server's Retrieve cuts frames only for a client that asks
(``RetrieveRequest.piece_bytes``, ``piece_min_entry_bytes``); the client asks where it copies
what it receives (``ask_pieces``) and puts the pieces back in place, checked as whole frames;
Store takes pieces from any client. Pieces out of order, with gaps, of another frame, or
too small before a frame's last are refused, and nothing is stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kdn import codec, keys
from kdn.client import Client, dataplane, received
from kdn.codec.format import parse_header
from kdn.errors import Corrupt
from kdn.server import ServerConfig, ServerThread
from kdn.transport.wire import (
    MIN_PIECE_BYTES,
    Frame,
    FrameMessage,
    frame_message,
    parse_frame_message,
    piece_messages,
    piece_spans,
)
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=4, dim=64)
"""1 KiB a token per layer: a frame of one layer at 300 tokens is ~300 KiB."""


def _parts(tokens: int = 300, seed: int = 1) -> codec.EncodedParts:
    return codec.encode_parts(random_kv(LAYOUT, tokens, seed=seed), "raw", layers_per_frame=1)


def _pieces(parts: codec.EncodedParts, piece: int = MIN_PIECE_BYTES) -> list[FrameMessage]:
    out = []
    for i, f in enumerate(parts.frames):
        for m in piece_messages(i, f, piece):
            msg = parse_frame_message(m)
            assert msg is not None
            out.append(msg)
    return out


def _head(parts: codec.EncodedParts) -> pb.RetrieveHeader:
    return pb.RetrieveHeader(container_header=bytes(parts.header), total_bytes=parts.nbytes,
                             tier="ram")


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "copied"])
def test_received_puts_pieces_back_in_place_and_checks_whole_frames(
        keep: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not keep:
        monkeypatch.setattr(received, "KEEP_MESSAGES_BYTES", 0)
    parts = _parts()
    msgs = _pieces(parts)
    assert len(msgs) > 2 * len(parts.frames)  # several pieces a frame
    got = received.received(_head(parts), iter(msgs))
    assert got.checked and got.owned != keep
    assert got.parts.to_bytes() == parts.to_bytes()
    assert codec.decode(got.parts.to_bytes()).equal(codec.decode(parts.to_bytes()))
    first = [m for m in msgs if m.frame.index == 2]
    for at in (0, len(first) // 2, len(first) - 1):  # a byte flipped in any piece of frame 2
        bad = list(msgs)
        j = msgs.index(first[at])
        data = bytearray(bad[j].frame.data)
        data[len(data) // 2] ^= 0x08
        bad[j] = FrameMessage(Frame(2, bytes(data), bad[j].frame.offset))
        with pytest.raises(Corrupt, match="frame 2"):
            received.received(_head(parts), iter(bad))


def _shuffled(msgs: list[FrameMessage]) -> Iterator[list[FrameMessage]]:
    """Streams of pieces that do not add up to their frames."""
    j = next(i for i, m in enumerate(msgs) if m.frame.offset)  # the second piece of frame 0
    yield msgs[:j] + msgs[j + 1:]  # a gap
    yield [msgs[j], *msgs[:j], *msgs[j + 1:]]  # a piece first
    swapped = list(msgs)
    swapped[j], swapped[j + 1] = swapped[j + 1], swapped[j]
    yield swapped  # out of order
    other = list(msgs)
    m = other[j].frame
    other[j] = FrameMessage(Frame(m.index + 1, m.data, m.offset))
    yield other  # a piece naming another frame


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "copied"])
def test_received_refuses_pieces_that_do_not_add_up(keep: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if not keep:
        monkeypatch.setattr(received, "KEEP_MESSAGES_BYTES", 0)
    parts = _parts()
    for msgs in _shuffled(_pieces(parts)):
        with pytest.raises(Corrupt, match="does not continue"):
            received.received(_head(parts), iter(msgs))
    frame = bytes(parts.frames[0])  # a frame in many tiny pieces: refused at the second
    tiny = [FrameMessage(Frame(0, frame[a:a + 100], a)) for a in range(0, len(frame), 100)]
    with pytest.raises(Corrupt, match="at least"):
        received.received(_head(parts), iter(tiny + _pieces(parts)[len(
            piece_spans(len(frame), MIN_PIECE_BYTES)):]))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0)
    with ServerThread(cfg) as st:
        yield st


def _retrieve(stub: pb_grpc.KDNStub, key: bytes, piece: int, min_entry: int = 0
              ) -> list[pb.RetrieveResponse]:
    return list(stub.Retrieve(pb.RetrieveRequest(key=key, piece_bytes=piece,
                                                 piece_min_entry_bytes=min_entry), timeout=30))


def test_the_server_sends_pieces_only_when_asked_and_only_for_entries_large_enough(
        server: ServerThread) -> None:
    parts = _parts(seed=2)
    key = keys.chunk_key([1], LAYOUT)
    with Client(server.address, shm_bytes=0, data_path=False) as c, \
            grpc.insecure_channel(server.address) as ch:
        c.store(key, parts)
        stub = pb_grpc.KDNStub(ch)
        for _ in range(2):  # built, then from the memo: the same messages
            whole = _retrieve(stub, key, 0)
            assert [m.frame.index for m in whole[1:]] == list(range(len(parts.frames)))
            assert all(m.frame.offset == 0 for m in whole[1:])
            cut = _retrieve(stub, key, MIN_PIECE_BYTES)
            spans = [piece_spans(len(f), MIN_PIECE_BYTES) for f in parts.frames]
            assert [(m.frame.index, m.frame.offset) for m in cut[1:]] == [
                (i, a) for i, s in enumerate(spans) for a, _ in s]
            assert cut[0].header.total_bytes == parts.nbytes
            assert bytes(parts.header) + b"".join(m.frame.data for m in cut[1:]) \
                == parts.to_bytes()
        small = _retrieve(stub, key, 1, min_entry=parts.nbytes + 1)  # an entry too small
        assert len(small) == len(whole) and all(m.frame.offset == 0 for m in small[1:])
        tiny = _retrieve(stub, key, 1)  # pieces below the floor are raised to it
        assert len(tiny) == len(cut)


def test_a_fetch_past_the_kept_size_asks_for_pieces_and_gets_the_entry(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(received, "KEEP_MESSAGES_BYTES", 100 << 10)
    monkeypatch.setattr(received, "PIECE_BYTES", MIN_PIECE_BYTES)
    monkeypatch.setattr(dataplane, "INLINE_ENTRY_BYTES", 1)  # streamed, not one message
    asked: list[pb.RetrieveRequest] = []
    kv = random_kv(LAYOUT, 300, seed=3)
    small = random_kv(LAYOUT, 20, seed=4)
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        start = c.rpc.retrieve_call  # noqa: SLF001

        def counted(req: pb.RetrieveRequest, **kw: object) -> object:
            asked.append(req)
            return start(req, **kw)

        c.rpc.retrieve_call = counted  # type: ignore[method-assign]  # noqa: SLF001
        c.store(keys.chunk_key([2], LAYOUT), kv, mode="raw", layers_per_frame=1)
        c.store(keys.chunk_key([3], LAYOUT), small, mode="raw", layers_per_frame=1)
        for key, want in ((keys.chunk_key([2], LAYOUT), kv), (keys.chunk_key([3], LAYOUT),
                                                              small)):
            got = c.fetch(key)
            assert got is not None and got.checked
            assert codec.decode(got.parts.to_bytes()).equal(want)
            back = c.retrieve(key, layout=LAYOUT)
            assert back is not None and back.equal(want)
        assert asked and all(r.piece_bytes == MIN_PIECE_BYTES and
                             r.piece_min_entry_bytes == (100 << 10) + 1 for r in asked)
        assert server.server is not None
        memo = server.server.servicer.wire_memo
        forms = {m.piece_bytes: [len(x) for x in m.messages if x]
                 for m in memo._memos.values()}  # noqa: SLF001
        assert max(max(n) for n in forms.values()) > 1  # the large entry's frames: in pieces


def _store_stream(parts: codec.EncodedParts, key: bytes, frames: list[bytes]) -> list[object]:
    return [pb.StoreRequest(header=pb.StoreHeader(
        key=key, container_header=parts.header, total_bytes=parts.nbytes,
        layout_fingerprint=parse_header(parts.header).layout.fingerprint)),
        *(pb.StoreRequest.FromString(m) for m in frames)]


@pytest.mark.parametrize(("tokens", "copied"), [(200, False), (1200, False), (600, True)],
                         ids=["joined", "framed", "copied"])
def test_store_takes_frames_in_pieces_and_refuses_pieces_that_do_not_add_up(
        server: ServerThread, tokens: int, copied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces stored: the entry reads back as sent (an entry under
    ``kdn.transport.buffers.MIN_BYTES`` is joined into one buffer, a larger one kept as its frames,
    each joined from its pieces: ``kdn.store.framed``, and past ``framed_limit``
    (``MAX_FRAMED_BYTES`` lowered) copied into one buffer piece by piece); a gap, a
    piece out of order or of another frame, a tiny piece before a frame's last, or a damaged
    piece is INVALID_ARGUMENT and leaves the stored entry as it was."""
    from kdn.store import framed

    if copied:
        monkeypatch.setattr(framed, "MAX_FRAMED_BYTES", 1 << 20)
    parts = _parts(tokens, seed=5)
    key = keys.chunk_key([tokens], LAYOUT)
    msgs = [m for i, f in enumerate(parts.frames) for m in piece_messages(i, f, MIN_PIECE_BYTES)]
    assert len(msgs) > len(parts.frames)
    with grpc.insecure_channel(server.address) as ch, \
            Client(server.address, shm_bytes=0, data_path=False) as c:
        stub = pb_grpc.KDNStub(ch)
        assert stub.Store(iter(_store_stream(parts, key, msgs)), timeout=30).stored_bytes \
            == parts.nbytes
        got = c.fetch(key)
        assert got is not None and got.parts.to_bytes() == parts.to_bytes()
        parsed = [parse_frame_message(m) for m in msgs]
        bad_streams = [("arrived", [frame_message(x.frame.index, x.frame.data, x.frame.offset)
                                    for x in stream])
                       for stream in _shuffled([p for p in parsed if p is not None])]
        frame = bytes(parts.frames[0])
        tiny = [frame_message(0, frame[a:a + 100], a) for a in range(0, len(frame), 100)]
        bad_streams.append(("at least", tiny + [
            m for m in msgs if parse_frame_message(m).frame.index > 0]))  # type: ignore[union-attr]
        damaged = list(msgs)
        flip = bytearray(damaged[1])
        flip[-10] ^= 0x02
        damaged[1] = bytes(flip)
        bad_streams.append(("corrupt", damaged))
        for words, stream in bad_streams:
            with pytest.raises(grpc.RpcError) as info:
                stub.Store(iter(_store_stream(parts, key, stream)), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (info.value.details() or ""), info.value.details()
            again = c.fetch(key)
            assert again is not None and again.parts.to_bytes() == parts.to_bytes()


def test_a_layer_stream_handed_pieces_fails_and_never_returns_tensors(
        server: ServerThread) -> None:
    """A stream decoding frame by frame never asks for pieces; a server that sent them anyway
    (here: asked behind the client's back) gets an error, not tensors of part frames."""
    from kdn.errors import KDNError

    kv = random_kv(LAYOUT, 300, seed=7)
    key = keys.chunk_key([7], LAYOUT)
    with Client(server.address, shm_bytes=0, data_path=False) as c:
        c.store(key, kv, mode="raw", layers_per_frame=1)
        req = pb.RetrieveRequest(key=key, piece_bytes=MIN_PIECE_BYTES)
        stream = c.layer_stream(c.rpc.retrieve_call, req)  # noqa: SLF001
        with pytest.raises(KDNError):
            stream.result()
        whole = c.layer_stream(c.rpc.retrieve_call, pb.RetrieveRequest(key=key))  # noqa: SLF001
        assert whole.result().equal(kv)
