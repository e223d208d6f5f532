"""Remote reads and writes without the shared segment (kdn.client.dataplane, the server's
Retrieve and Store streams) against a real server on loopback: inline answers and when an
entry streams instead, streams assembled in one buffer as they arrive (large frames copied
beside the next), and damage caught on the way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.dataplane import INLINE_BYTES
from kdn.client.landing import new_timings, stream_of
from kdn.errors import Corrupt, LayoutMismatch
from kdn.layout import KVLayout
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import random_kv, uniform_layout
from tests.test_dataplane import LAYOUT, _key


@contextmanager
def _small_messages(tmp_path: Path) -> Iterator[tuple[Client, KVLayout]]:
    """A remote client of a server whose messages carry 64 KiB at most, and a layout."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       max_message_bytes=64 << 10)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        yield c, uniform_layout(layers=8, heads=2, dim=64)


def test_fetch_falls_back_to_the_stream_when_the_server_sends_small_messages(
        tmp_path: Path) -> None:
    with _small_messages(tmp_path) as (c, lay):
        kv = random_kv(lay, 64)  # ~128 KiB: more than one 64 KiB message, frames of 16 KiB
        c.store(_key(14), kv, mode="raw", layers_per_frame=1)
        got = c.fetch(_key(14))
        assert got is not None and codec.decode(got.parts.to_bytes()).equal(kv)
        # the server left it out of its inline answer (past its own messages): streamed,
        # with no failed call (an older server's TooLarge turns inline reads off instead)
        assert c.dataplane._inline_ok
        small = random_kv(lay, 2)
        c.store(_key(15), small, mode="raw")
        got = c.fetch(_key(15))
        assert got is not None and codec.decode(got.parts.to_bytes()).equal(small)


def test_a_streamed_fetch_keeps_its_messages_checked_and_checks_its_size(
        tmp_path: Path) -> None:
    from kdn.client.received import received as _received
    from kdn.transport.wire import Frame, FrameMessage

    with _small_messages(tmp_path) as (c, lay):
        kv = random_kv(lay, 64, seed=3)
        c.store(_key(16), kv, mode="raw", layers_per_frame=1)
        got = c.fetch(_key(16))
        # checked where they landed, and private: views of the received messages, no copy
        assert got is not None and got.checked and got.private and not got.owned
        frames = got.parts.frames
        assert all(isinstance(f, memoryview) and f.readonly and isinstance(f.obj, bytes)
                   and len(f.obj) > len(f) for f in frames)  # views of whole messages
        assert codec.decode(got.parts.to_bytes()).equal(kv)
        back = c.retrieve(_key(16), layout=lay)  # the stream again: decoded, sums checked
        assert back is not None and back.equal(kv)
        # decoded, the tensors view the messages in place (no copy of a private frame)
        spans = [(np.frombuffer(f, np.uint8).ctypes.data, len(f)) for f in frames]
        views = stream_of(got, None, new_timings()).result()
        assert views.equal(kv)
        for i, (k, v) in enumerate(views.layers):
            lo, n = spans[i]  # one layer a frame
            assert lo < k.data_ptr() < v.data_ptr() < lo + n
        blob = codec.encode_parts(kv, "raw", layers_per_frame=1)
        msgs = [FrameMessage(Frame(i, f)) for i, f in enumerate(blob.frames)]
        head = pb.RetrieveHeader(container_header=blob.header, total_bytes=blob.nbytes,
                                 tier="ram")
        assert codec.decode(_received(head, iter(msgs)).parts.to_bytes()).equal(kv)
        flipped = bytearray(blob.frames[3])
        flipped[-5] ^= 0x04  # a damaged frame: caught as it lands
        bad = [m if i != 3 else FrameMessage(Frame(3, bytes(flipped))) for i, m in enumerate(msgs)]
        with pytest.raises(Corrupt, match="frame 3"):
            _received(head, iter(bad))
        swapped = [msgs[1], msgs[0], *msgs[2:]]  # frames out of their places
        with pytest.raises(Corrupt):
            _received(head, iter(swapped))
        with pytest.raises(Corrupt, match="frames"):  # one frame short, sizes made to agree
            short = pb.RetrieveHeader(container_header=blob.header, tier="ram",
                                      total_bytes=blob.nbytes - len(blob.frames[-1]))
            _received(short, iter(msgs[:-1]))
        for wrong in (blob.nbytes - 1, blob.nbytes + 1, 3):  # frames that do not add up
            head.total_bytes = wrong
            with pytest.raises(Corrupt):
                _received(head, iter(msgs))


@pytest.mark.parametrize("streamed", [False, True], ids=["one-message", "stream"])
def test_a_remote_retrieve_reads_the_entry_whole_and_catches_damage(
        server: ServerThread, streamed: bool) -> None:
    """Without the segment, ``retrieve`` reads as ``fetch`` does (one GetMany message, or a
    stream whose messages are kept past the inline budget), then decodes: the tensors are
    the stored ones, a held result survives the next reads, a mode that decodes decodes, a
    miss is None, another layout is refused, and a value damaged in server memory never
    comes back as tensors."""
    tokens = INLINE_BYTES // LAYOUT.bytes_per_token + 500 if streamed else 40
    kv = random_kv(LAYOUT, tokens, seed=30)
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as c:
        assert not c.dataplane.attached and c.streams == 1
        c.retrieve_stream = None  # type: ignore[method-assign,assignment]  # not the way here
        c.store(_key(30), kv, mode="raw", layers_per_frame=1)
        back = c.retrieve(_key(30), layout=LAYOUT)
        assert back is not None and back.equal(kv)
        if streamed:  # the messages: each layer in its own, and the first result holds
            ptrs = {t.untyped_storage().data_ptr() for kv_ in back.layers for t in kv_}
            assert len(ptrs) == 2 * LAYOUT.num_layers  # K and V: views of their frame's message
            other = random_kv(LAYOUT, tokens, seed=31)
            c.store(_key(31), other, mode="raw")
            del back
            again = c.retrieve(_key(31), layout=LAYOUT)
            assert again is not None and again.equal(other)
            held = c.retrieve(_key(30), layout=LAYOUT)
            assert held is not None and c.retrieve(_key(31)).equal(other)  # type: ignore[union-attr]
            assert held.equal(kv)
        lossless = random_kv(LAYOUT, tokens, seed=32)
        c.store(_key(32), lossless, mode="lossless")
        assert c.retrieve(_key(32), layout=LAYOUT).equal(lossless)  # type: ignore[union-attr]
        assert c.retrieve(_key(33), layout=LAYOUT) is None
        with pytest.raises(LayoutMismatch):
            c.retrieve(_key(30), layout=uniform_layout(layers=3))
        assert server.server is not None
        ram = next(t for t in server.server.store.tiers if t.name == "ram")
        skey = next(k for k in ram._data if k.endswith(_key(30).hex().encode()))  # noqa: SLF001
        memo = server.server.servicer.wire_memo
        assert (skey in memo._memos) == streamed  # noqa: SLF001  # streamed: memoised
        if streamed:  # a flipped bit in a message kept for the next stream
            msgs = memo._memos[skey].messages  # noqa: SLF001
            bad_msg = bytearray(msgs[-1][-1])  # type: ignore[index]
            bad_msg[-100] ^= 0x10
            msgs[-1][-1] = bytes(bad_msg)  # type: ignore[index]
            with pytest.raises(Corrupt):
                c.retrieve(_key(30), layout=LAYOUT)
            memo.drop(skey)
        bad = bytearray(ram._data[skey])  # noqa: SLF001
        bad[-100] ^= 0x10  # a flipped bit in a value the server checked already
        ram._data[skey] = bytes(bad)  # noqa: SLF001
        for tier in server.server.store.tiers:
            if tier.name != "ram":
                tier.delete(skey)
        with pytest.raises(Corrupt):
            c.retrieve(_key(30), layout=LAYOUT)


def test_a_remote_batch_sends_small_entries_inline_and_streams_large_ones(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the segment, ``store_many`` packs entries under ``STREAM_ENTRY_BYTES`` into
    inline PutMany messages (many per message) and sends the larger ones (one past
    ``PUT_INLINE_BYTES`` too) in one StoreMany stream; ``fetch_many`` reads them all by one
    grouped RetrieveMany: the small ones whole inside their headers (one message for the
    run), the large ones a message a frame after it. Every entry comes back whole."""
    from kdn.client import dataplane as client_puts

    lay = uniform_layout(layers=4, heads=2, dim=64)  # 2 KiB a token
    small = [random_kv(lay, 100, seed=70 + i) for i in range(4)]  # ~200 KB each
    large = [random_kv(lay, 900, seed=75 + i) for i in range(2)]  # ~1.9 MB each
    big = random_kv(lay, client_puts.PUT_INLINE_BYTES // lay.bytes_per_token + 200, seed=79)
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as c:
        assert not c.dataplane.attached
        puts: list[int] = []
        real_put = c.dataplane._put
        monkeypatch.setattr(c.dataplane, "_put",
                            lambda req, rid: puts.append(len(req.items)) or real_put(req, rid))
        alone: list[bytes] = []
        real_store = c.store
        monkeypatch.setattr(c, "store", lambda key, *a, **kw: alone.append(key)
                            or real_store(key, *a, **kw))
        streams: list[int] = []
        real_many = c.rpc.store_many_call
        monkeypatch.setattr(c.rpc, "store_many_call", lambda reqs, **kw: streams.append(1)
                            or real_many(reqs, **kw))
        items = [(_key(70 + i), kv) for i, kv in enumerate(small)] + \
            [(_key(75 + i), kv) for i, kv in enumerate(large)] + [(_key(79), big)]
        c.store_many(items, mode="raw")
        assert alone == [] and streams == [1]  # the three large ones: one StoreMany
        assert sum(puts) == len(small) and len(puts) == 1  # the small ones: one PutMany
        gets: list[int] = []
        real_get = c.dataplane._get
        monkeypatch.setattr(c.dataplane, "_get",
                            lambda req, rid: gets.append(len(req.keys)) or real_get(req, rid))
        parts: list[str] = []  # what the RetrieveMany stream brought, message by message
        real_many_call = c.rpc.retrieve_many_call

        def seen(req: pb.RetrieveManyRequest, **kw: object) -> Iterator[object]:
            for msg in real_many_call(req, **kw):
                part = msg.WhichOneof("part")
                parts.extend([f"inline {v.head.total_bytes}" if len(v.entry) else "header"
                              for v in msg.headers] if part == "headers" else [part])
                yield msg

        monkeypatch.setattr(c.rpc, "retrieve_many_call", seen)
        before = c.stats().counters.get("retrievemany.hit", 0)
        got = c.retrieve_many([k for k, _ in items], layout=lay)
        assert all(g is not None and g.equal(kv) for g, (_, kv) in zip(got, items))
        assert gets == []  # no GetMany: one grouped RetrieveMany
        assert c.stats().counters.get("retrievemany.hit", 0) - before == len(items)
        monkeypatch.undo()
        stored = [c.fetch(k) for k, _ in items]  # one at a time: what each entry holds
        sizes = [s.parts.nbytes for s in stored[:len(small)] if s is not None]
        frames = sum(len(s.parts.frames) for s in stored[len(small):] if s is not None)
        assert parts == [*(f"inline {n}" for n in sizes), "header", "header", "header",
                         *["frame"] * frames]  # the small ones inside their headers


def test_an_entry_read_alone_streams_past_the_inline_entry_budget(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the segment, an entry read alone comes in one GetMany message up to
    ``INLINE_ENTRY_BYTES`` and as a Retrieve stream past it, though one message would hold it
    (learnt once: later reads stream without asking first); in a batch with others both come
    by one RetrieveMany. Every read is the stored entry."""
    from kdn.client import dataplane

    lay = uniform_layout(layers=4, heads=2, dim=64)
    per_token = lay.bytes_per_token
    small = random_kv(lay, dataplane.INLINE_ENTRY_BYTES // per_token // 2, seed=90)
    large = random_kv(lay, dataplane.INLINE_ENTRY_BYTES // per_token + 300, seed=91)
    assert dataplane.INLINE_ENTRY_BYTES < large.nbytes < dataplane.INLINE_BYTES // 2
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False) as c:
        assert not c.dataplane.attached and c.streams == 1
        c.store(_key(90), small, mode="raw")
        c.store(_key(91), large, mode="raw")
        gets: list[int] = []
        real_get = c.dataplane._get
        monkeypatch.setattr(c.dataplane, "_get",
                            lambda req, rid: gets.append(req.region.length) or real_get(req, rid))
        streamed: list[bytes] = []
        real_call = c.rpc.retrieve_call
        monkeypatch.setattr(c.rpc, "retrieve_call",
                            lambda req, **kw: streamed.append(req.key) or real_call(req, **kw))
        got = c.retrieve(_key(90), layout=lay)
        assert got is not None and got.equal(small)
        assert streamed == [] and gets == [dataplane.INLINE_ENTRY_BYTES]  # one message
        gets.clear()
        got = c.retrieve(_key(91), layout=lay)
        assert got is not None and got.equal(large)
        assert streamed == [_key(91)] and gets == [dataplane.INLINE_ENTRY_BYTES]
        gets.clear()
        fetched = c.fetch(_key(91), layout=lay)  # known to stream: no GetMany first
        assert fetched is not None and streamed == [_key(91)] * 2 and gets == []
        assert codec.decode(fetched.parts.to_bytes()).equal(large)
        streamed.clear()
        c.dataplane._too_big.clear()  # noqa: SLF001  # a batch asks for both at once
        both = c.retrieve_many([_key(90), _key(91)], layout=lay)
        assert both[0] is not None and both[0].equal(small)
        assert both[1] is not None and both[1].equal(large)
        assert streamed == [] and gets == []  # one grouped RetrieveMany for both


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "copied"])
@pytest.mark.parametrize("damaged", [None, 0, 2, 5], ids=["intact", "first", "middle", "last"])
def test_a_received_stream_checks_each_frame_as_it_lands_and_catches_damage(
        damaged: int | None, keep: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``received``: each frame, large or small, is hashed the moment its last byte lands
    (copied, each message is copied and hashed as it lands); the entry comes back checked,
    its frames the messages themselves (kept) or one recycled buffer (copied: an entry past
    ``KEEP_MESSAGES_BYTES``), and a frame damaged anywhere raises Corrupt (never an
    entry)."""
    from kdn.client import received as dataplane
    from kdn.transport.wire import Frame, FrameMessage

    if not keep:
        monkeypatch.setattr(dataplane, "KEEP_MESSAGES_BYTES", 0)

    lay = uniform_layout(layers=6, heads=4, dim=64)
    tokens = (1 << 20) // (lay.bytes_per_token // 6) + 64
    kv = random_kv(lay, tokens, seed=95)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=1)
    frames = [bytes(f) for f in parts.frames]
    assert min(map(len, frames)) >= 1 << 20
    small = codec.encode_parts(random_kv(lay, 8, seed=96), "raw", layers_per_frame=1)
    for p, bad in ((parts, damaged), (small, None)):
        sent = [bytearray(f) for f in p.frames]
        if bad is not None:
            sent[bad][len(sent[bad]) // 2] ^= 0x40
        head = pb.RetrieveHeader(container_header=bytes(p.header), total_bytes=p.nbytes,
                                 tier="ram")
        msgs = [FrameMessage(Frame(i, bytes(f))) for i, f in enumerate(sent)]
        if bad is not None:
            with pytest.raises(Corrupt, match=f"frame {bad}"):
                dataplane.received(head, iter(msgs))
            continue
        got = dataplane.received(head, iter(msgs))
        assert got.checked and got.private == keep and got.owned != keep
        if keep:  # not copied
            assert got.container is None
            assert all(f is m.frame.data for f, m in zip(got.parts.frames, msgs))
        else:  # one buffer, the caller's
            assert got.container is not None and not got.container.readonly
            assert bytes(got.container) == got.parts.to_bytes()
        assert got.parts.to_bytes() == bytes(p.header) + b"".join(map(bytes, p.frames))


def test_writes_through_tensors_that_view_received_messages_change_nothing_stored(
        server: ServerThread) -> None:
    """Tensors of a streamed retrieve view the messages they came in (``Fetched.private``):
    written to, they change neither the server's value, nor the in-process tier's copy, nor
    what the next retrieve brings."""
    tokens = INLINE_BYTES // LAYOUT.bytes_per_token + 100  # past the inline budget: a stream
    kv = random_kv(LAYOUT, tokens, seed=41)
    with Client(server.address, shm_bytes=0, data_path=False) as remote, \
            Client(server.address, shm_bytes=0, data_path=False, local_bytes=256 << 20) as tiered:
        remote.store(_key(41), kv, mode="raw", layers_per_frame=1)
        for c in (remote, tiered):
            for read in (lambda c=c: c.retrieve(_key(41), layout=LAYOUT),
                         lambda c=c: c.retrieve_stream(_key(41), layout=LAYOUT).result()):
                back = read()
                assert back is not None and back.equal(kv)
                for k, v in back.layers:
                    k.fill_(7.0)
                    v.zero_()
                assert not back.equal(kv)
                again = c.retrieve(_key(41), layout=LAYOUT)
                assert again is not None and again.equal(kv)
        assert tiered.local is not None and tiered.local.get(tiered.namespace, _key(41))
        # a stream whose entry the in-process tier copies once its last frame came decodes
        # into memory of its own: a caller writing to early layers meanwhile changes no copy
        tiered.local.discard(tiered.namespace, _key(41))
        for c, private in ((remote, True), (tiered, False)):
            stream = c.retrieve_stream(_key(41), layout=LAYOUT)
            assert stream is not None and stream.decoder.private is private
            assert stream.result().equal(kv)
