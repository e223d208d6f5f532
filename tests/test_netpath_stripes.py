"""GetMany striped over several connections of the network data path (kdn.client.netpath):
bit-identical entries from a real server, the number of connections chosen by size, and a
stripe whose connection drops inside an entry or whose answer is wrong (against a scripted
server), which fails the whole call with nothing returned and leaves the path usable; the
stripes of one call are one answer in the server's bound of disk reads being sent."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kdn import codec
from kdn.client import Client, netpath
from kdn.client.netpath import STRIPE_MIN_BYTES, NetPath
from kdn.client.received import Fetched
from kdn.errors import Corrupt, InvalidArgument, NotFound, Unavailable
from kdn.layout import Expected
from kdn.server import ServerConfig, ServerThread
from kdn.server.reader import Sending
from kdn.store.hits import Hit
from kdn.transport.wire import FAST_HEAD, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()


def _parts(seed: int, tokens: int = 16) -> codec.EncodedParts:
    return codec.encode_parts(random_kv(LAYOUT, tokens, seed=seed, start=0), "raw")


@pytest.fixture
def striped(server: ServerThread) -> Iterator[Client]:
    c = Client(server.address, timeout_s=30, shm_bytes=0, data_connections=3)
    yield c
    c.close()


def test_a_striped_batch_read_is_bit_identical(server: ServerThread, striped: Client) -> None:
    keys = [numbered_key(i) for i in range(7)]
    stored = [_parts(i, tokens=16 + 8 * i) for i in range(7)]  # entries of several sizes
    for k, p in zip(keys, stored):
        striped.store(k, p)
    before = dict(server.server.servicer.counters).get("net.GetMany", 0)
    got = striped.fetch_many([*keys[:3], numbered_key(99), *keys[3:]])
    assert got[3] is None  # a miss in the middle of a stripe stays in its place
    for p, f in zip(stored, got[:3] + got[4:]):
        assert f is not None and f.checked and f.owned
        assert f.parts.to_bytes() == p.to_bytes()
    calls = dict(server.server.servicer.counters).get("net.GetMany", 0) - before
    assert calls == 3  # one GetMany per connection, side by side
    streams = striped.retrieve_streams(keys, layout=LAYOUT, device="cpu")
    for p, s in zip(stored, streams):
        assert s is not None and s.result().equal(codec.decode(p.to_bytes()))


def test_the_default_connections_follow_the_entries_size(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(netpath, "stream_cores", lambda: 16)  # a host with 32 cores
    net = NetPath("127.0.0.1", 1, "0" * 32, 5)
    assert net.stripes(8) == 1  # nothing read yet: no size known
    net.entry_bytes = STRIPE_MIN_BYTES // 4
    assert net.stripes(8) == 2  # 8 entries of a quarter: two connections' worth
    net.entry_bytes = STRIPE_MIN_BYTES * 2
    assert net.stripes(3) == 3  # never more than the keys
    assert net.stripes(100) == 8  # nor more than MAX_STRIPES
    assert NetPath("127.0.0.1", 1, "0" * 32, 5, connections=2).stripes(100) == 2
    monkeypatch.setattr(netpath, "stream_cores", lambda: 1)  # two cores: one connection
    assert net.stripes(30) == 1
    assert net.stripes(100) == 4  # but a call asks for at most STRIPE_MAX_BYTES (3.2 GiB here)
    with pytest.raises(InvalidArgument, match="data_connections"):
        Client("127.0.0.1:1", data_connections=-1)


# -- a scripted server: one answer per connection, chosen by the keys it is asked for ----------


Script = Callable[[list[bytes]], bytes]
"""What a connection answers to a GetMany of these keys (the answer's bytes, on the wire)."""


def _answer(entries: list[bytes | None], *, count: int | None = None) -> bytes:
    resp = pb.GetManyResponse()
    at = 0
    for e in entries:
        ref = resp.entries.add()
        if e is not None:
            ref.present, ref.tier, ref.written = True, "ram", True
            ref.length, ref.offset = len(e), at
            at += len(e)
    while count is not None and len(resp.entries) > count:
        del resp.entries[-1]
    body = resp.SerializeToString()
    return FAST_HEAD.pack(len(body), 1) + body + b"".join(e for e in entries if e is not None)


class Scripted:
    """A listener that answers every GetMany by ``script`` (then closes the connection when
    the script says so: an answer ending in ``CUT``)."""

    CUT = b"<cut>"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.calls = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client closes a failed stripe's end
            while (head := read_exact(conn, FAST_HEAD.size)) is not None:
                body = read_exact(conn, FAST_HEAD.unpack(head)[0])
                assert body is not None
                self.calls += 1
                out = self.script(list(pb.GetManyRequest.FromString(body).keys))
                if out.endswith(self.CUT):
                    conn.sendall(out[: -len(self.CUT)])
                    return
                conn.sendall(out)

    def close(self) -> None:
        self.sock.close()


ENTRIES = {numbered_key(i): _parts(i, tokens=64).to_bytes() for i in range(4)}
KEYS = list(ENTRIES)


def _honest(keys: list[bytes]) -> bytes:
    return _answer([ENTRIES.get(k) for k in keys])


def _bad(how: str) -> Script:
    """A script answering the stripe that holds the last key wrongly (``how``)."""

    def script(keys: list[bytes]) -> bytes:
        if KEYS[-1] not in keys:
            return _honest(keys)
        entries = [ENTRIES.get(k) for k in keys]
        if how == "drop":  # the connection ends inside the last entry
            return _answer(entries)[: -len(ENTRIES[KEYS[-1]]) // 2] + Scripted.CUT
        if how == "count":  # fewer entries than keys
            return _answer(entries, count=len(keys) - 1)
        if how == "damaged":  # a bit flipped in the last frame
            answer = bytearray(_answer(entries))
            answer[-5] ^= 0x10
            return bytes(answer)
        if how == "error":
            message = b"NOT_FOUND\0no such ticket"
            return FAST_HEAD.pack(len(message), 0) + message + Scripted.CUT
        raise AssertionError(how)

    return script


@pytest.mark.parametrize("how,error", [("drop", OSError), ("count", Corrupt),
                                       ("damaged", Corrupt), ("error", NotFound)])
def test_a_failed_stripe_fails_the_call_and_the_path_goes_on(how: str,
                                                              error: type[Exception]) -> None:
    script = {"now": _bad(how)}
    server = Scripted(lambda keys: script["now"](keys))
    net = NetPath("127.0.0.1", server.port, "0" * 32, 10, connections=2)
    try:
        with pytest.raises(error):
            net.get_many("default", KEYS, Expected())
        assert server.calls == 2  # both stripes were asked for
        script["now"] = _honest  # the server mends: the next call is whole and right
        got = net.get_many("default", KEYS, Expected())
        assert [bytes(g[0]) if g else None for g in got] == [ENTRIES[k] for k in KEYS]
    finally:
        net.close()
        server.close()


@pytest.mark.parametrize("how,error", [("drop", Unavailable), ("damaged", Corrupt)])
def test_entries_landing_after_the_answer_fail_one_by_one(how: str,
                                                          error: type[Exception]) -> None:
    """``start_get_many`` returns once the answers are in; a stripe that fails inside an
    entry fails that entry's future (and its later ones), never hands out its bytes, and the
    other stripe's entries land whole."""
    server = Scripted(_bad(how))
    net = NetPath("127.0.0.1", server.port, "0" * 32, 10, connections=2)
    try:
        got = net.start_get_many("default", [*KEYS[:2], numbered_key(99), *KEYS[2:]],
                                 Expected())
        assert got[2] is None  # the miss is known at once
        firsts = [g for g in got[:2] if g is not None]
        assert [bytes(f.result(10)) for _, f in firsts] == [ENTRIES[k] for k in KEYS[:2]]
        assert got[3] is not None and got[4] is not None
        if how == "drop":  # the entry before the cut landed whole; the cut one fails
            assert bytes(got[3][1].result(10)) == ENTRIES[KEYS[2]]
        with pytest.raises(error):
            got[4][1].result(10)
    finally:
        net.close()
        server.close()


def test_retrieve_streams_land_as_the_entries_arrive(server: ServerThread,
                                                     striped: Client) -> None:
    keys = [numbered_key(i) for i in range(5)]
    kvs = [random_kv(LAYOUT, 32, seed=i) for i in range(5)]
    for k, kv in zip(keys, kvs):
        striped.store(k, kv, mode="raw")
    streams = striped.retrieve_streams([*keys, numbered_key(99)], layout=LAYOUT)
    assert streams[-1] is None
    for kv, s in zip(kvs, streams):
        assert s is not None and s.blocks == 1
        assert s.result(10).equal(kv)
        k0, _ = s.wait_for_layer(0, 10)
        assert k0.equal(kv.layers[0][0])


@pytest.mark.model
def test_an_engine_on_a_remote_client_reuses_blocks_landed_from_the_data_path(
        server: ServerThread) -> None:
    """The real model through KDNEngine, the client on "another host": its hit's blocks come
    by one striped GetMany, handed to the engine before they land, and generate the same
    tokens as the full prefill."""
    from kdn.engine import EngineConfig, KDNEngine
    from kdn.model.data import english_token_ids
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    with Client(server.address, timeout_s=60, shm_bytes=0, data_connections=2) as c:
        engine = KDNEngine(model, tok, c, EngineConfig(chunk_tokens=64, encodings=(("raw", ""),)))
        ids = [int(t) for t in english_token_ids(300, tok)]
        full = engine.generate(ids, max_new_tokens=8)
        assert full.store_thread is not None
        full.store_thread.join(60)
        before = dict(server.server.servicer.counters).get("net.GetMany", 0)
        hit = engine.generate(ids, max_new_tokens=8, force="raw")
        assert hit.timings.reused_tokens == 256 and hit.token_ids == full.token_ids
        assert dict(server.server.servicer.counters).get("net.GetMany", 0) - before == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_bound_for_a_gpu_land_page_locked(server: ServerThread, striped: Client) -> None:
    keys = [numbered_key(i) for i in range(4)]
    kvs = [random_kv(LAYOUT, 64, seed=i) for i in range(4)]
    for k, kv in zip(keys, kvs):
        striped.store(k, kv, mode="raw")
    for g in striped.dataplane.get_many("default", keys, Expected(), None, pinned=True):
        assert isinstance(g, Fetched) and g.pinned and g.container is not None
        assert torch.frombuffer(g.container, dtype=torch.uint8).is_pinned()
    streams = striped.retrieve_streams(keys, layout=LAYOUT, device="cuda")
    for kv, s in zip(kvs, streams):
        assert s is not None
        for i, (k, v) in enumerate(kv.layers):
            kd, vd = s.wait_for_layer(i, 30)
            assert kd.device.type == "cuda"
            assert torch.equal(kd.cpu(), k) and torch.equal(vd.cpu(), v)


def test_a_striped_read_sees_the_stores_sent_before_it(striped: Client) -> None:
    keys = [numbered_key(i) for i in range(6)]
    kvs = [random_kv(LAYOUT, 16, seed=i) for i in range(6)]
    for k, kv in zip(keys, kvs):
        striped.store_async(k, kv, mode="raw")  # unanswered yet on this thread's connection
    streams = striped.retrieve_streams(keys, layout=LAYOUT)
    for kv, s in zip(kvs, streams):
        assert s is not None and s.result(10).equal(kv)


def test_a_context_read_again_lands_in_the_buffers_of_the_last_read(striped: Client) -> None:
    big = uniform_layout(layers=3, heads=4, dim=64)
    keys = [numbered_key(i) for i in range(3)]
    kvs = [random_kv(big, 2048, seed=i) for i in range(3)]  # 3 MiB each: pooled sizes
    for k, kv in zip(keys, kvs):
        striped.store(k, kv, mode="raw")
    first = striped.fetch_many(keys, layout=big)
    assert all(f is not None for f in first)
    net = striped.dataplane.net()
    assert net is not None
    reused = net.landing.reused
    del first  # nothing views the landed entries any more: their buffers go back
    again = striped.retrieve_many(keys, layout=big)
    assert net.landing.reused - reused == 3
    assert all(g is not None and g.equal(kv) for g, kv in zip(again, kvs))


def test_the_stripes_of_one_call_do_not_refuse_each_other(tmp_path: Path) -> None:
    """Disk entries under a read bound one stripe's answer fills: every call is served on the
    data path (its stripes were refused RESOURCE_EXHAUSTED, and the batch redone by gRPC)."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=1 << 16, disk_bytes=64 << 20)
    keys = [numbered_key(i) for i in range(12)]
    stored = [_parts(i, tokens=256) for i in range(12)]  # 128 KiB each: past RAM, on disk
    with ServerThread(cfg) as st, Client(st.address, timeout_s=30, shm_bytes=0,
                                         data_connections=4) as c:
        for k, p in zip(keys, stored):
            c.store(k, p)
        counters = st.server.servicer.counters
        st.server.servicer.sending.limit = 4 * stored[0].nbytes  # a stripe's 3, not two's
        for _ in range(5):
            got = c.fetch_many(keys)
            assert [f is not None and f.parts.to_bytes() for f in got] == \
                [p.to_bytes() for p in stored]
        assert dict(counters).get("net.RESOURCE_EXHAUSTED", 0) == 0
        assert dict(counters).get("net.GetMany", 0) == 20  # none redone by gRPC


def test_a_call_holding_nothing_waits_for_room() -> None:
    sending = Sending(SimpleNamespace(tiers=[]), 10)  # type: ignore[arg-type]
    other, a, b = sending.open(), sending.open(), sending.open()
    assert sending.took(other, Hit(b"x" * 8, "disk"))
    sending.join(a, "call")
    sending.join(b, "call")
    assert not sending.took(a, Hit(b"x" * 4, "disk"), 0.05)  # waited, no room came
    threading.Timer(0.05, sending.close, [other]).start()
    started = time.monotonic()
    assert sending.took(a, Hit(b"x" * 4, "disk"), 5)  # room came once the other let go
    assert time.monotonic() - started < 2
    assert sending.took(b, Hit(b"x" * 9, "disk"))  # its call's own: one answer, let in
    c = sending.open()
    assert not sending.took(c, Hit(b"x", "disk"))  # another's is refused at once
    sending.close(a)
    sending.close(b)
    assert sending.took(c, Hit(b"x", "disk")) and sending.nbytes == 1
    sending.close(c)
    assert sending.nbytes == 0 and not sending._calls and not sending._call_of
