"""The store service end to end over real gRPC on 127.0.0.1: round trips, concurrency, and
every bad input the contract names, each leaving what was stored before intact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import AsyncClient, Client
from kdn.codec import api
from kdn.codec.format import build_header, build_record, frame_with_sum, parse_header
from kdn.errors import InvalidArgument, LayoutMismatch, TooLarge
from kdn.layout import DType, LayerLayout
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import pruned_layout, random_kv, uniform_layout

LAYOUTS = {
    "uniform-fp16": uniform_layout(),
    "uniform-bf16": uniform_layout(dtype=DType.BFLOAT16),
    "uniform-fp32": uniform_layout(layers=2, dtype=DType.FLOAT32),
    "pruned": pruned_layout(),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["raw", "lossless"])
def test_roundtrip_bit_exact(client: Client, name: str, mode: str) -> None:
    lay = LAYOUTS[name]
    kv = random_kv(lay, tokens=37, seed=3, start=11)
    key = keys.chunk_key(list(range(37)), lay)
    resp = client.store(key, kv, mode=mode, layers_per_frame=2)
    assert resp.stored_bytes > 0 and resp.tier == "ram"
    back = client.retrieve(key, layout=lay)
    assert back is not None and back.equal(kv)
    assert client.lookup([key]).infos[0].present


def test_miss_is_none_and_delete(client: Client) -> None:
    lay = uniform_layout()
    key = keys.chunk_key([1, 2, 3], lay)
    assert client.retrieve(key) is None
    client.store(key, random_kv(lay, 3))
    assert client.delete(key) == 1
    assert client.retrieve(key) is None
    assert client.delete(key) == 0


def test_lookup_prefix_chain(client: Client) -> None:
    lay = uniform_layout()
    chain = keys.prefix_keys(list(range(64)), lay, chunk_tokens=16)
    kv = random_kv(lay, 64)
    for i in (0, 1, 3):  # chunk 2 missing
        client.store(chain[i], kv.slice(0, 16 * (i + 1)))
    res = client.lookup(chain, prefix_chain=True)
    assert [i.present for i in res.infos] == [True, True, False, True]
    assert res.prefix_hits == 2


def test_sixteen_concurrent_clients(server: ServerThread) -> None:
    lay = pruned_layout()

    def work(i: int) -> bool:
        with Client(server.address) as c:
            ok = True
            for j in range(4):
                kv = random_kv(lay, tokens=16 + i, seed=i * 10 + j)
                key = keys.chunk_key([i, j], lay)
                c.store(key, kv, mode="lossless" if j % 2 else "raw")
                back = c.retrieve(key, layout=lay)
                ok = ok and back is not None and back.equal(kv)
            return ok

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(work, range(16)))


def test_shared_client_across_threads_and_asyncio(client: Client) -> None:
    import asyncio

    lay = uniform_layout()
    kvs = {keys.chunk_key([i], lay): random_kv(lay, 8, seed=i) for i in range(20)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: client.store(kv[0], kv[1]), kvs.items()))

    async def main() -> list[KVCache | None]:
        ac = AsyncClient(client)
        return await asyncio.gather(*(ac.retrieve(k) for k in kvs))

    got = asyncio.run(main())
    assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs.values()))


def test_request_ids_per_call_and_per_thread(client: Client) -> None:
    key = keys.chunk_key([7], uniform_layout())
    assert client.last_request_id == ""
    client.lookup([key], request_id="main-1")
    assert client.last_request_id == "main-1"

    def other(i: int) -> tuple[str, str]:
        before = client.last_request_id
        client.contains(key, request_id=f"worker-{i}")
        return before, client.last_request_id

    with ThreadPoolExecutor(4) as pool:
        seen = list(pool.map(other, range(8)))
    assert all(before in ("", *(f"worker-{i}" for i in range(8))) for before, _ in seen)
    assert [after for _, after in seen] == [f"worker-{i}" for i in range(8)]
    assert client.last_request_id == "main-1"  # no other thread's id leaks in
    client.delete(key)
    assert client.last_request_id not in ("", "main-1")  # a fresh id per call


@pytest.mark.parametrize("rid", ["order/42", "job 7", "r" * 129, "a\nb", "héllo"])
def test_a_request_id_the_server_would_not_keep_is_refused(client: Client, rid: str) -> None:
    """The server logs another id for one it does not keep (the caller's last_request_id
    was not the logged one); a newline or a non-ASCII letter was INTERNAL 'Invalid metadata'."""
    with pytest.raises(InvalidArgument, match="^request_id .* is malformed"):
        client.lookup([keys.chunk_key([7], uniform_layout())], request_id=rid)


def test_store_options(client: Client) -> None:
    lay = uniform_layout()
    key = keys.chunk_key([8], lay)
    kv = random_kv(lay, 4)
    client.store(key, kv, options=StoreOptions(ttl_s=60, pin=True))
    assert client.retrieve(key).equal(kv)  # type: ignore[union-attr]
    assert StoreOptions(durability=2).durability is Durability.DISK  # type: ignore[arg-type]
    for bad in ({"ttl_s": -1}, {"ttl_s": 1.5}, {"pin": 1}, {"durability": 9}):
        with pytest.raises(InvalidArgument):
            StoreOptions(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- bad input


@pytest.fixture
def stored(client: Client) -> tuple[bytes, KVCache]:
    """An entry already stored: every bad request below must leave it intact."""
    lay = uniform_layout()
    kv = random_kv(lay, 10, seed=99)
    key = keys.chunk_key([9, 9, 9], lay)
    client.store(key, kv)
    return key, kv


def _intact(client: Client, stored: tuple[bytes, KVCache]) -> None:
    back = client.retrieve(stored[0])
    assert back is not None and back.equal(stored[1])


def _stub(server: ServerThread, max_send: int = 64 << 20) -> pb_grpc.KDNStub:
    ch = grpc.insecure_channel(server.address,
                               options=[("grpc.max_send_message_length", max_send)])
    return pb_grpc.KDNStub(ch)


def _send(stub: pb_grpc.KDNStub, header: pb.StoreHeader, frames: list[bytes]) -> None:
    def reqs() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=header)
        for i, f in enumerate(frames):
            yield pb.StoreRequest(frame=pb.Frame(index=i, data=f))

    stub.Store(reqs(), timeout=10)


def _expect(code: grpc.StatusCode, match: str, fn: object, *args: object) -> None:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)  # type: ignore[operator]
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


def _store_refused(server: ServerThread, hdr: pb.StoreHeader, frames: list[bytes],
                   match: str) -> None:
    """A Store of ``frames`` under ``hdr`` fails with INVALID_ARGUMENT naming ``match``."""
    _expect(grpc.StatusCode.INVALID_ARGUMENT, match, _send, _stub(server), hdr, frames)


def _other_parts(stored: tuple[bytes, KVCache], seed: int) -> codec.EncodedParts:
    """Another 10-token cache of the stored entry's layout, raw-encoded."""
    return codec.encode_parts(random_kv(stored[1].layout, 10, seed=seed), "raw")


def test_frames_with_wrong_shapes(server: ServerThread, client: Client,
                                  stored: tuple[bytes, KVCache]) -> None:
    parts = _other_parts(stored, seed=1)
    header = parse_header(parts.header)
    wrong = LayerLayout(2, 8, 16)  # the layout says 16 key channels
    rec = build_record(wrong, 10, b"\0" * (2 * 10 * (8 + 16) * 2))
    frames = list(parts.frames)
    frames[1], full = frame_with_sum(header.frame_seed, 1, 1, [rec])
    entry = pb.EntryHeader()
    entry.CopyFrom(header.entry)
    entry.frames[1].checksum = full  # sealed as its own: only the shapes are wrong
    hdr = pb.StoreHeader(key=stored[0], container_header=build_header(entry))
    _store_refused(server, hdr, frames, "layer 1")
    _intact(client, stored)


def test_truncated_stream_stores_nothing(server: ServerThread, client: Client,
                                         stored: tuple[bytes, KVCache]) -> None:
    parts = _other_parts(stored, seed=2)
    hdr = pb.StoreHeader(key=stored[0], container_header=parts.header)
    _store_refused(server, hdr, parts.frames[:2], "ended after 2 of 4 frames")
    # a frame cut short
    frames = list(parts.frames)
    frames[3] = frames[3][:-5]
    _store_refused(server, hdr, frames, "frame 3")
    _intact(client, stored)


def test_corrupted_frame_is_rejected(server: ServerThread, client: Client,
                                     stored: tuple[bytes, KVCache]) -> None:
    parts = _other_parts(stored, seed=2)
    frames = list(parts.frames)
    flipped = bytearray(frames[2])
    flipped[40] ^= 0x10
    frames[2] = bytes(flipped)
    hdr = pb.StoreHeader(key=stored[0], container_header=parts.header)
    _store_refused(server, hdr, frames, "checksum")
    swapped = [parts.frames[1], parts.frames[0], *parts.frames[2:]]
    _store_refused(server, hdr, swapped, "frame 0")
    _intact(client, stored)


def test_cancelled_stream_stores_nothing(server: ServerThread, client: Client,
                                         stored: tuple[bytes, KVCache]) -> None:
    key = stored[0]
    parts = _other_parts(stored, seed=3)
    gate = threading.Event()

    def reqs() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(key=key, container_header=parts.header))
        yield pb.StoreRequest(frame=pb.Frame(index=0, data=parts.frames[0]))
        gate.wait(10)
        for i, f in enumerate(parts.frames[1:], 1):
            yield pb.StoreRequest(frame=pb.Frame(index=i, data=f))

    fut = _stub(server).Store.future(reqs(), timeout=10)
    time.sleep(0.3)
    assert fut.cancel()
    gate.set()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result()
    time.sleep(0.3)
    _intact(client, stored)


def test_layout_for_another_model(tmp_path: Path, client: Client,
                                  stored: tuple[bytes, KVCache]) -> None:
    key, kv = stored
    other = uniform_layout(model="another-model")
    with pytest.raises(LayoutMismatch, match="^FAILED_PRECONDITION: .*caller expects") as info:
        client.retrieve(key, layout=other)
    assert info.value.status == "FAILED_PRECONDITION"
    # a server restricted to one model refuses caches of another
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d2", disk_bytes=0,
                       allowed_models=(kv.layout.model_fingerprint,))
    with ServerThread(cfg) as st, Client(st.address) as c:
        c.store(key, kv)
        with pytest.raises(LayoutMismatch, match="not served here"):
            c.store(keys.chunk_key([1], other), random_kv(other, 4))
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_an_entry_of_no_tokens_is_refused(server: ServerThread, client: Client,
                                          stored: tuple[bytes, KVCache]) -> None:
    """A key for nothing (no prefill to skip) is refused by the encoder and by the server
    (from a client that skips the encoder), under a stored entry's key: that entry stays."""
    empty = random_kv(stored[1].layout, 0)
    with pytest.raises(InvalidArgument, match="holds no tokens"):
        client.store(stored[0], empty)
    parts = api._encode_unchecked(empty, "raw", "", 1, False)  # noqa: SLF001
    hdr = pb.StoreHeader(key=stored[0], container_header=parts.header)
    _store_refused(server, hdr, list(parts.frames), "holds no tokens")
    _intact(client, stored)


def test_header_layout_fingerprint_must_match(server: ServerThread, client: Client,
                                              stored: tuple[bytes, KVCache]) -> None:
    parts = _other_parts(stored, seed=2)
    hdr = pb.StoreHeader(key=stored[0], container_header=parts.header,
                         layout_fingerprint="0" * 32)
    _store_refused(server, hdr, parts.frames, "does not match")
    _intact(client, stored)


def test_oversize_message_and_entry(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       max_message_bytes=64 << 10, max_entry_bytes=1 << 20)
    lay = uniform_layout(layers=2, heads=4, dim=64)
    with ServerThread(cfg) as st, \
            Client(st.address, shm_bytes=0, data_path=False) as c:  # messages only
        small = random_kv(lay, 4)
        key = keys.chunk_key([1], lay)
        c.store(key, small, mode="raw")
        big = random_kv(lay, 200)  # 200 KiB per frame > 64 KiB per message
        with pytest.raises(TooLarge):
            c.store(key, big, mode="raw")
        huge = random_kv(uniform_layout(layers=40, heads=4, dim=64), 60)  # ~2.4 MiB entry
        with pytest.raises(TooLarge, match="max_entry_bytes"):
            c.store(keys.chunk_key([2], lay), huge, mode="raw")
        assert c.retrieve(key).equal(small)  # type: ignore[union-attr]


def test_unknown_codec(server: ServerThread, client: Client,
                       stored: tuple[bytes, KVCache]) -> None:
    parts = _other_parts(stored, seed=2)
    entry = parse_header(parts.header).entry
    entry.codec.mode = "zip-of-dreams"
    bad_header = build_header(entry)
    hdr = pb.StoreHeader(key=stored[0], container_header=bad_header)
    _store_refused(server, hdr, parts.frames, "unknown codec mode")
    _intact(client, stored)


@pytest.mark.parametrize("bad_key", [b"", b"short", b"x" * 33])
def test_empty_or_malformed_key(server: ServerThread, client: Client,
                                stored: tuple[bytes, KVCache], bad_key: bytes) -> None:
    parts = codec.encode_parts(stored[1], "raw")
    hdr = pb.StoreHeader(key=bad_key, container_header=parts.header)
    _store_refused(server, hdr, parts.frames, "key must be 32 bytes")
    with pytest.raises(InvalidArgument):
        client.retrieve(bad_key)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "namespace", _stub(server).Lookup,
            pb.LookupRequest(namespace="bad ns", keys=[stored[0]]))
    _intact(client, stored)


def test_malformed_header_and_stream_order(server: ServerThread, client: Client,
                                           stored: tuple[bytes, KVCache]) -> None:
    key, kv = stored
    stub = _stub(server)
    hdr = pb.StoreHeader(key=key, container_header=b"NOPE garbage bytes")
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "bad magic", _send, stub, hdr, [])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "empty Store stream", stub.Store, iter([]))
    frame_first = iter([pb.StoreRequest(frame=pb.Frame(index=0, data=b"x"))])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "must start with a header", stub.Store, frame_first)
    _intact(client, stored)


def test_health_and_stats(client: Client, stored: tuple[bytes, KVCache]) -> None:
    assert client.health() == "SERVING"
    assert client.health("kdn.v1.KDN") == "SERVING"
    st = client.stats()
    ram = next(t for t in st.tiers if t.name == "ram")
    assert ram.entries == 1 and ram.bytes > 0
    assert st.counters["store.ok"] == 1


def test_disk_tier_survives_restart(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d")
    lay = pruned_layout()
    kv = random_kv(lay, 12)
    key = keys.chunk_key([4, 2], lay)
    with ServerThread(cfg) as st, Client(st.address) as c:
        c.store(key, kv)
    with ServerThread(cfg) as st, Client(st.address) as c:
        hit = c.fetch(key)
        assert hit is not None and hit.tier == "disk"
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]
        assert c.fetch(key).tier == "ram"  # type: ignore[union-attr]  # promoted


def test_client_retries_unavailable_then_succeeds(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig(port=port, data_dir=tmp_path / "d", disk_bytes=0)
    starter = threading.Timer(0.5, lambda: holder.append(ServerThread(cfg).start()))
    holder: list[ServerThread] = []
    from kdn.client import Retry

    lay = uniform_layout()
    with Client(f"127.0.0.1:{port}", retry=Retry(retries=8, base_s=0.2, cap_s=0.5)) as c:
        starter.start()
        try:
            assert c.lookup([keys.chunk_key([1], lay)]).infos[0].present is False
        finally:
            starter.join()
            for st in holder:
                st.stop()


def test_client_gives_up_after_bounded_retries(tmp_path: Path) -> None:
    import socket

    from kdn.client import Retry
    from kdn.errors import Unavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.time()
    with Client(f"127.0.0.1:{port}", retry=Retry(retries=2, base_s=0.05)) as c:
        with pytest.raises(Unavailable):
            c.lookup([b"k" * 32])
    assert time.time() - t < 10


def test_graceful_shutdown_lets_in_flight_store_finish(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A Store stream still sending when shutdown begins completes, and the entry is durable.

    Shutdown starts once the server has the stream's header (its handler is running): a stream
    not yet begun when shutdown starts is refused, by design, so waiting on the client's side
    alone would race the server's accept under load (CI once saw CANCELLED that way)."""
    from kdn.server.receive import Receiver

    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", shutdown_grace_s=20.0)
    lay = pruned_layout()
    kv = random_kv(lay, 12, seed=8)
    key = keys.chunk_key([8, 8], lay)
    parts = codec.encode_parts(kv, "lossless")
    begun = threading.Event()
    entry = Receiver._entry

    async def noting(self: Receiver, *args: object, **kw: object) -> object:
        begun.set()
        return await entry(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Receiver, "_entry", noting)
    st = ServerThread(cfg).start()

    def slow() -> Iterator[pb.StoreRequest]:
        yield pb.StoreRequest(header=pb.StoreHeader(key=key, container_header=parts.header))
        for i, f in enumerate(parts.frames):
            time.sleep(0.3)
            yield pb.StoreRequest(frame=pb.Frame(index=i, data=f))

    stopper = threading.Thread(target=lambda: (begun.wait(10), st.stop()))
    stopper.start()
    resp = _stub(st).Store(slow(), timeout=30)
    stopper.join(60)
    assert begun.is_set(), "the server never began the Store stream"
    assert resp.stored_bytes == parts.nbytes
    with ServerThread(cfg) as again, Client(again.address) as c:
        back = c.retrieve(key)
        assert back is not None and back.equal(kv)
