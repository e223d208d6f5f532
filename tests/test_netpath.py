"""The network data path (kdn.server.netpath, kdn.client.netpath) against a real server on
loopback: a client without a shared segment sends its batches over TCP with the bytes on the
connection; the fallbacks to gRPC; hostile calls (unknown tickets, damaged or misplaced items,
sizes past the limits, calls cut off midway), none of which stores anything; tenancy."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from pathlib import Path

import pytest

from kdn import codec
from kdn.client import Client
from kdn.client.client import TLSOptions
from kdn.client.netpath import NetPath
from kdn.client.received import MAX_ENTRY_BYTES
from kdn.errors import Corrupt, LayoutMismatch
from kdn.layout import Expected
from kdn.server import ServerConfig, ServerThread
from kdn.transport.addresses import data_host
from kdn.transport.wire import FAST_HEAD, NET_GET_MANY, NET_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import (
    data_connect,
    data_ticket,
    eventually,
    make_certs,
    numbered_key,
    random_kv,
    read_while_churned,
    uniform_layout,
)

LAYOUT = uniform_layout()




def _counters(st: ServerThread) -> dict[str, int]:
    return dict(st.server.servicer.counters)






def _put_call(ticket: str, items: list[tuple[bytes, bytes]], *, offsets: list[int] | None = None,
              namespace: str = "default") -> tuple[bytes, bytes]:
    """(request head + body, payload) of a data path PutMany of ``items`` (key, container)."""
    req = pb.PutManyRequest(namespace=namespace, segment_id=ticket)
    at = 0
    for j, (key, value) in enumerate(items):
        item = req.items.add(key=key)
        item.region.offset = offsets[j] if offsets is not None else at
        item.region.length = len(value)
        at += len(value)
    body = req.SerializeToString()
    return FAST_HEAD.pack(len(body), NET_PUT_MANY) + body, b"".join(v for _, v in items)


def _answer(conn: socket.socket) -> tuple[int, bytes] | None:
    head = read_exact(conn, FAST_HEAD.size)
    if head is None:
        return None
    n, ok = FAST_HEAD.unpack(head)
    body = read_exact(conn, n)
    assert body is not None
    return ok, body


def _closed(conn: socket.socket) -> bool:
    conn.settimeout(5)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _entry(seed: int) -> bytes:
    return codec.encode_parts(random_kv(LAYOUT, 16, seed=seed), "raw").to_bytes()


# -- round trips ---------------------------------------------------------------------------------


def _no_grpc_data_calls(c: Client) -> None:
    """Make every gRPC call that carries entries fail the test (the data path must carry
    them all)."""
    assert c.dataplane.net() is not None

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("an entry went by gRPC")

    for name in ("GetMany", "PutMany"):
        setattr(c.rpc.stub, name, boom)
    for name in ("_store_call", "_retrieve_call", "_retrieve_many_call", "_store_many_call"):
        setattr(c, name, boom)


def test_a_remote_client_moves_its_batches_over_the_data_path(server: ServerThread,
                                                              remote: Client) -> None:
    kvs = [random_kv(LAYOUT, 16, seed=i) for i in range(6)]
    keys = [numbered_key(i) for i in range(6)]
    _no_grpc_data_calls(remote)
    before = _counters(server)
    remote.store(keys[0], kvs[0], mode="raw")
    remote.store_many(list(zip(keys[1:], kvs[1:])), mode="raw")
    got = remote.retrieve(keys[0], layout=LAYOUT)
    assert got is not None and got.equal(kvs[0])
    fetched = remote.fetch_many([*keys, numbered_key(99)], layout=LAYOUT)
    assert fetched[-1] is None
    for kv, f in zip(kvs, fetched):
        assert f is not None and f.owned and f.checked  # each frame checked as it landed
        assert codec.decode(f.parts.to_bytes()).equal(kv)
    stream = remote.retrieve_stream(keys[2], layout=LAYOUT)
    assert stream is not None and stream.result().equal(kvs[2])
    after = _counters(server)
    assert after.get("net.PutMany", 0) - before.get("net.PutMany", 0) == 2
    assert after.get("net.GetMany", 0) - before.get("net.GetMany", 0) == 3


def test_large_entries_and_frames_in_pieces_cross_whole(server: ServerThread,
                                                        remote: Client) -> None:
    layout = uniform_layout(layers=3, heads=4, dim=64)
    kv = random_kv(layout, 2048, seed=3)  # 3 MiB: frames of 1 MiB, sent from where they lie
    _no_grpc_data_calls(remote)
    remote.store(numbered_key(1), kv, mode="raw")
    got = remote.retrieve(numbered_key(1), layout=layout)
    assert got is not None and got.equal(kv)
    assert _counters(server).get("net.GetMany", 0) == 1


def test_data_path_false_and_servers_without_one_use_grpc(server_config: ServerConfig,
                                                           tmp_path: Path) -> None:
    kv = random_kv(LAYOUT, 16, seed=4)
    off = dataclasses.replace(server_config, data_port=-1, data_dir=tmp_path / "off")
    with ServerThread(server_config) as st, ServerThread(off) as st_off:
        with Client(st.address, shm_bytes=0, data_path=False) as c:
            c.store(numbered_key(1), kv, mode="raw")
            got = c.retrieve(numbered_key(1), layout=LAYOUT)
            assert got is not None and got.equal(kv)
            assert c.dataplane.net() is None
        assert not any(k.startswith("net.") for k in _counters(st))
        assert st_off.server.servicer.data_port == 0
        with Client(st_off.address, shm_bytes=0) as c:
            c.store(numbered_key(1), kv, mode="raw")
            got = c.retrieve(numbered_key(1), layout=LAYOUT)
            assert got is not None and got.equal(kv)
            assert c.dataplane.net() is None  # asked once, answered "none": gRPC
        assert not any(k.startswith("net.") for k in _counters(st_off))


def test_a_path_that_goes_away_sends_the_client_back_to_grpc(server: ServerThread,
                                                             remote: Client) -> None:
    kv, kv2 = random_kv(LAYOUT, 16, seed=5), random_kv(LAYOUT, 16, seed=6)
    remote.store(numbered_key(1), kv, mode="raw")
    assert _counters(server)["net.PutMany"] == 1
    assert server.server.net_path is not None
    server.server.net_path.close()  # its connections drop, its port no longer answers
    remote.store(numbered_key(2), kv2, mode="raw")  # by gRPC now
    for i, want in ((1, kv), (2, kv2)):
        got = remote.retrieve(numbered_key(i), layout=LAYOUT)
        assert got is not None and got.equal(want)
    assert remote.dataplane.net() is None
    assert _counters(server)["net.PutMany"] == 1


def test_layout_mismatch_is_raised_not_fallen_back_from(remote: Client) -> None:
    remote.store(numbered_key(1), random_kv(LAYOUT, 16, seed=7), mode="raw")
    with pytest.raises(LayoutMismatch):
        remote.fetch(numbered_key(1), layout=uniform_layout(layers=5))
    assert remote.dataplane.net() is not None  # the path itself is fine


def test_closing_the_client_gives_its_ticket_back(server: ServerThread) -> None:
    c = Client(server.address, shm_bytes=0)
    c.store(numbered_key(1), random_kv(LAYOUT, 16, seed=8), mode="raw")
    ticket = data_ticket(c)
    c.close()
    conn = data_connect(server)
    req = pb.GetManyRequest(keys=[numbered_key(1)], segment_id=ticket).SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(req), NET_GET_MANY) + req)
    ok, body = _answer(conn) or (1, b"")
    assert ok == 0 and body.startswith(b"NOT_FOUND\0")
    conn.close()


def test_tenants_see_only_their_own_entries(tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  a: {api_keys: [key-a]}\n  b: {api_keys: [key-b]}\n")
    auth.chmod(0o600)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", auth_file=str(auth))
    ka = random_kv(LAYOUT, 16, seed=9)
    with ServerThread(cfg) as st, \
            Client(st.address, api_key="key-a", shm_bytes=0) as a, \
            Client(st.address, api_key="key-b", shm_bytes=0) as b:
        a.store(numbered_key(1), ka, mode="raw")
        assert b.fetch(numbered_key(1)) is None  # b's key space has no such entry
        got = a.retrieve(numbered_key(1), layout=LAYOUT)
        assert got is not None and got.equal(ka)
        assert st.server.servicer.segments.ticket_owner(data_ticket(b)).tenant == "b"
        assert _counters(st)["net.GetMany"] == 2


# -- hostile calls -------------------------------------------------------------------------------


def test_an_unknown_ticket_is_refused_and_the_connection_stays_in_step(
        server: ServerThread, remote: Client) -> None:
    good = data_ticket(remote)
    conn = data_connect(server)
    head, payload = _put_call(good, [(numbered_key(3), _entry(3))])  # admitted by its ticket
    conn.sendall(head + payload)  # (not yet admitted, the connection would close: netpath)
    assert (_answer(conn) or (0, b""))[0] == 1
    head, payload = _put_call("0" * 32, [(numbered_key(1), _entry(1))])
    conn.sendall(head + payload)
    ok, body = _answer(conn) or (1, b"")
    assert ok == 0 and body.startswith(b"NOT_FOUND\0")
    head, payload = _put_call(good, [(numbered_key(2), _entry(2))])  # the same connection
    conn.sendall(head + payload)
    ok, body = _answer(conn) or (0, b"")
    assert ok == 1 and len(pb.PutManyResponse.FromString(body).results) == 1
    conn.close()
    assert remote.fetch(numbered_key(1)) is None
    assert remote.fetch(numbered_key(2)) is not None


@pytest.mark.parametrize("at", [-5, 20, 3], ids=["frame", "header", "magic"])
def test_a_damaged_item_stores_none_of_its_call(server: ServerThread, remote: Client,
                                                at: int) -> None:
    old = random_kv(LAYOUT, 16, seed=10)
    remote.store(numbered_key(1), old, mode="raw")
    damaged = bytearray(_entry(11))
    damaged[at] ^= 0xFF  # the last frame's body, the header, its magic: a check fails
    conn = data_connect(server)
    head, payload = _put_call(data_ticket(remote), [(numbered_key(2), _entry(12)),
                                                (numbered_key(1), bytes(damaged))])
    conn.sendall(head + payload)
    ok, body = _answer(conn) or (1, b"")
    assert ok == 0 and body.startswith(b"INVALID_ARGUMENT\0") and b"item 1" in body
    assert remote.fetch(numbered_key(2)) is None  # the sound item was not stored either
    got = remote.retrieve(numbered_key(1), layout=LAYOUT)
    assert got is not None and got.equal(old)  # what was stored is untouched
    conn.sendall(head + payload)  # still in step: the same call refused again
    assert (_answer(conn) or (1, b""))[0] == 0
    conn.close()


@pytest.mark.parametrize("case", ["gap", "overlap", "too_large", "garbage", "unknown_op",
                                  "inline_data"])
def test_calls_whose_bytes_can_not_be_skipped_close_the_connection(
        server: ServerThread, remote: Client, case: str) -> None:
    ticket, value = data_ticket(remote), _entry(13)
    items = [(numbered_key(1), value), (numbered_key(2), value)]
    if case == "gap":
        head, payload = _put_call(ticket, items, offsets=[0, len(value) + 64])
    elif case == "overlap":
        head, payload = _put_call(ticket, items, offsets=[0, 10])
    elif case == "too_large":
        req = pb.PutManyRequest(segment_id=ticket)
        item = req.items.add(key=numbered_key(1))
        item.region.length = server.server.config.max_entry_bytes + 1
        body = req.SerializeToString()
        head, payload = FAST_HEAD.pack(len(body), NET_PUT_MANY) + body, value
    elif case == "garbage":
        head, payload = FAST_HEAD.pack(6, NET_PUT_MANY) + b"\xff" * 6, value
    elif case == "unknown_op":
        head, payload = FAST_HEAD.pack(3, 9) + b"abc", b""
    else:
        req = pb.PutManyRequest(segment_id=ticket)
        req.items.add(key=numbered_key(1), data=value)
        body = req.SerializeToString()
        head, payload = FAST_HEAD.pack(len(body), NET_PUT_MANY) + body, b""
    conn = data_connect(server)
    conn.sendall(head + payload)
    ok, body = _answer(conn) or (1, b"")
    assert ok == 0, body
    assert _closed(conn)
    conn.close()
    assert remote.fetch(numbered_key(1)) is None and remote.fetch(numbered_key(2)) is None
    remote.store(numbered_key(3), random_kv(LAYOUT, 16, seed=14), mode="raw")  # still serves
    assert remote.fetch(numbered_key(3)) is not None


def test_a_call_cut_off_inside_its_items_stores_nothing(server: ServerThread,
                                                        remote: Client) -> None:
    conn = data_connect(server)
    head, payload = _put_call(data_ticket(remote), [(numbered_key(1), _entry(15))])
    conn.sendall(head + payload[: len(payload) // 2])
    conn.close()
    remote.store(numbered_key(2), random_kv(LAYOUT, 16, seed=16), mode="raw")
    assert remote.fetch(numbered_key(1)) is None
    assert remote.fetch(numbered_key(2)) is not None


def test_an_oversized_request_body_closes_the_connection(server: ServerThread) -> None:
    conn = data_connect(server)
    conn.sendall(struct.pack("<IB", (64 << 20) + 1, NET_GET_MANY))
    assert _answer(conn) is None  # closed without reading a body that large
    conn.close()


def test_bad_names_are_refused_before_anything_is_read(server: ServerThread,
                                                       remote: Client) -> None:
    conn = data_connect(server)
    req = pb.GetManyRequest(keys=[b"short"], segment_id=data_ticket(remote)).SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(req), NET_GET_MANY) + req)
    ok, body = _answer(conn) or (1, b"")
    assert ok == 0 and body.startswith(b"INVALID_ARGUMENT\0")
    conn.close()


def test_data_host_of_targets() -> None:
    assert data_host("10.0.0.5:50051") == "10.0.0.5"
    assert data_host("[fd00::1]:50051") == "fd00::1"
    assert data_host("dns:kdn.internal:50051") == "kdn.internal"
    assert data_host("dns:///kdn.internal:50051") == "kdn.internal"
    assert data_host("ipv4:10.0.0.5:1,10.0.0.6:1") == "10.0.0.5"
    assert data_host("unix:/tmp/kdn.sock") == ""
    assert data_host("dns://8.8.8.8/kdn.internal:50051") == ""


def _fake_server(answer: bytes) -> tuple[socket.socket, int]:
    """A listener that answers its first call with ``answer`` (an answer's bytes as they
    would follow on the connection), then closes."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            head = read_exact(conn, FAST_HEAD.size)
            assert head is not None
            read_exact(conn, FAST_HEAD.unpack(head)[0])
            conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return sock, sock.getsockname()[1]


def _get_answer(entry: bytes, length: int | None = None) -> bytes:
    resp = pb.GetManyResponse()
    ref = resp.entries.add(present=True, tier="ram", written=True, offset=0)
    ref.length = len(entry) if length is None else length
    body = resp.SerializeToString()
    return FAST_HEAD.pack(len(body), 1) + body + entry


@pytest.mark.parametrize("damage", ["frame", "header", "short", "long", "huge"])
def test_a_damaged_answer_is_caught_as_it_lands(damage: str) -> None:
    entry = bytearray(_entry(17))
    if damage == "frame":
        entry[-3] ^= 0x01
        answer, want = _get_answer(bytes(entry)), Corrupt
    elif damage == "header":
        entry[20] ^= 0x01
        answer, want = _get_answer(bytes(entry)), Corrupt
    elif damage == "short":  # the server goes away inside the entry
        answer, want = _get_answer(bytes(entry[:-100]), len(entry)), OSError
    elif damage == "long":  # an entry longer than its frames
        answer, want = _get_answer(bytes(entry) + b"\0" * 64), Corrupt
    else:  # a length no server stores: refused before memory is set aside for it
        answer, want = _get_answer(bytes(entry), MAX_ENTRY_BYTES + 1), Corrupt
    sock, port = _fake_server(answer)
    net = NetPath("127.0.0.1", port, "0" * 32, 10)
    with pytest.raises(want):
        net.get_many("default", [numbered_key(1)], Expected())
    net.close()
    sock.close()


def test_connections_past_the_cap_are_closed(server: ServerThread, remote: Client) -> None:
    assert server.server.net_path is not None
    server.server.net_path.max_connections = 2  # each connection holds a thread
    held = [data_connect(server), data_connect(server)]
    for conn in held:  # served: a GetMany of nothing answers
        req = pb.GetManyRequest(segment_id=data_ticket(remote)).SerializeToString()
        conn.sendall(FAST_HEAD.pack(len(req), NET_GET_MANY) + req)
        assert (_answer(conn) or (0, b""))[0] == 1
    extra = data_connect(server)
    assert _closed(extra)  # refused: closed at once
    extra.close()
    for conn in held:
        conn.close()
    assert eventually(lambda: len(server.server.net_path._conns) == 0)
    remote.store(numbered_key(1), random_kv(LAYOUT, 16, seed=18), mode="raw")
    assert remote.fetch(numbered_key(1)) is not None
    assert _counters(server)["net.refused_connections"] == 1


def test_a_tls_server_offers_the_data_path_over_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", tls_cert=str(certs["server.crt"]),
                       tls_key=str(certs["server.key"]))
    kv = random_kv(LAYOUT, 64, seed=19)
    tls = TLSOptions(ca=certs["ca.crt"].read_bytes())
    with ServerThread(cfg) as st, Client(st.address, tls=tls, shm_bytes=0) as c:
        _no_grpc_data_calls(c)
        c.store(numbered_key(1), kv, mode="raw")
        got = c.retrieve(numbered_key(1), layout=LAYOUT)
        assert got is not None and got.equal(kv)
        assert _counters(st)["net.PutMany"] == 1 and _counters(st)["net.GetMany"] == 1
        plain = data_connect(st)  # a client speaking no TLS: refused by the handshake
        req = pb.GetManyRequest(keys=[numbered_key(1)], segment_id=data_ticket(c))
        body = req.SerializeToString()
        plain.sendall(FAST_HEAD.pack(len(body), NET_GET_MANY) + body)
        assert _answer_or_closed(plain)
        plain.close()
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other")  # the path's certificate not trusted: gRPC
    with ServerThread(dataclasses.replace(cfg, data_dir=tmp_path / "d2")) as st:
        with Client(st.address, tls=tls, shm_bytes=0) as c:
            c.store(numbered_key(2), kv, mode="raw")
            net = c.dataplane.net()
            assert net is not None
            untrusted = TLSOptions(ca=other["ca.crt"].read_bytes()).data_path_tls()
            net._tls = untrusted[0]
            c.dataplane.network._tls = untrusted  # the path asked for again fails the same way
            net._drop()
            c.store(numbered_key(3), kv, mode="raw")  # the handshake fails: gRPC from here
            assert c.dataplane.net() is None
            got = c.retrieve(numbered_key(3), layout=LAYOUT)
            assert got is not None and got.equal(kv)


def _answer_or_closed(conn: socket.socket) -> bool:
    """True when ``conn`` was closed, reset or answered with a TLS alert (not served)."""
    conn.settimeout(5)
    try:
        data = conn.recv(5)
    except OSError:
        return True
    return not data or data[:1] == b"\x15"


def test_reads_racing_overwrites_on_the_data_path_return_one_version_whole(
        server: ServerThread) -> None:
    """Thousands of remote reads while another remote client overwrites and deletes the key:
    each read is one stored version, whole, or a miss (the server sends the value it read,
    which an overwrite replaces but never changes; each frame is checked as it lands)."""
    versions = [random_kv(LAYOUT, 16, seed=40 + i) for i in range(4)]
    with Client(server.address, shm_bytes=0) as writer, \
            Client(server.address, shm_bytes=0) as reader:
        seen = read_while_churned(writer, reader, numbered_key(1), versions, 2000, LAYOUT,
                                  touch=True)
        assert reader.dataplane.net() is not None and writer.dataplane.net() is not None
    assert len(set(seen) - {-1}) >= 3  # the versions really changed under the reads
    assert _counters(server)["net.GetMany"] >= 2000


def test_threads_of_one_client_each_use_a_connection_of_their_own(
        server: ServerThread, remote: Client) -> None:
    kvs = {i: random_kv(LAYOUT, 16, seed=60 + i) for i in range(32)}
    errors: list[BaseException] = []
    held: list[int] = []
    net = remote.dataplane.net()
    assert net is not None
    done = threading.Barrier(4)

    def work(part: int) -> None:
        try:
            mine = [i for i in kvs if i % 4 == part]
            remote.store_many([(numbered_key(i), kvs[i]) for i in mine], mode="raw")
            for _ in range(5):
                got = remote.retrieve_many([numbered_key(i) for i in mine], layout=LAYOUT)
                assert all(g is not None and g.equal(kvs[i]) for g, i in zip(got, mine))
            done.wait(timeout=30)  # all four live
            held.append(net.threads.count())
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert max(held) == 4  # one connection per thread
    assert eventually(lambda: net.threads.count() == 0)  # each closed as its thread ended
