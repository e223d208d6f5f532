"""What the network data path (kdn.server.netpath) grants a connection before and after it
names a live ticket, against a real server on loopback: silent or dripping connections are
closed in time, the oldest pending ones make room for new ones, a request is bounded before
its ticket is known, one ticket holds a bounded share of the connections, a GetMany's keys
and the bytes its answer reads from disk are bounded, the listener outlives a failed accept,
the server's settings reach the path, a tenant's ticket cap evicts the tickets nobody uses,
and a put past the tenant's quota is refused before its items are read."""

from __future__ import annotations

import dataclasses
import errno
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kdn import codec
from kdn.client import Client, fastwire
from kdn.client.fastwire import BATCH_ITEMS
from kdn.client.netpath import NetPath
from kdn.errors import DeadlineExceeded, NotFound, TooLarge
from kdn.server import ServerConfig, ServerThread, batch, fastpath, netpath
from kdn.transport.wire import FAST_HEAD, NET_GET_MANY, NET_MAX_KEYS, NET_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import (
    data_connect,
    data_ticket,
    eventually,
    make_certs,
    numbered_key,
    random_kv,
    uniform_layout,
)

LAYOUT = uniform_layout()




def _path(st: ServerThread) -> netpath.NetPath:
    assert st.server.net_path is not None
    return st.server.net_path






def _get(conn: socket.socket, ticket: str, keys: list[bytes]) -> tuple[int, bytes] | None:
    """A GetMany on ``conn``: (ok, answer body), its entries' bytes read and dropped; None
    when the connection closed."""
    body = pb.GetManyRequest(keys=keys, segment_id=ticket).SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(body), NET_GET_MANY) + body)
    head = read_exact(conn, FAST_HEAD.size)
    if head is None:
        return None
    n, ok = FAST_HEAD.unpack(head)
    out = read_exact(conn, n)
    assert out is not None
    if ok:
        follow = sum(r.length for r in pb.GetManyResponse.FromString(out).entries if r.present)
        assert follow == 0 or read_exact(conn, follow) is not None
    return ok, out


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _counter(st: ServerThread, name: str) -> int:
    return int(st.server.servicer.counters.get(name, 0))


def test_a_connection_that_names_no_ticket_in_time_is_closed(server: ServerThread,
                                                            remote: Client) -> None:
    _path(server).first_call_s = 0.6
    silent = data_connect(server)
    dripping = data_connect(server)
    dripping.sendall(FAST_HEAD.pack(1000, NET_GET_MANY))  # a body that never comes whole
    started = time.monotonic()
    for _ in range(4):
        time.sleep(0.25)
        try:
            dripping.sendall(b"\0")
        except OSError:
            break
    assert _closed_within(silent, 5) and _closed_within(dripping, 5)
    assert time.monotonic() - started < 5
    admitted = data_connect(server)  # a call naming its ticket at once is served
    assert (_get(admitted, data_ticket(remote), []) or (0, b""))[0] == 1
    time.sleep(0.8)  # admitted: idle_s (300 s) applies between calls, not first_call_s
    assert (_get(admitted, data_ticket(remote), []) or (0, b""))[0] == 1
    for conn in (silent, dripping, admitted):
        conn.close()


def test_the_oldest_pending_connections_make_room(server: ServerThread, remote: Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastpath, "MAX_PENDING", 4)
    ticket = data_ticket(remote)
    hogs = []
    for _ in range(6):  # accepted in turn, oldest first
        hogs.append(data_connect(server))
        time.sleep(0.05)
    assert _closed_within(hogs[0], 5) and _closed_within(hogs[1], 5)
    assert not _closed_within(hogs[-1], 0.3)
    assert _counter(server, "net.evicted_connections") == 2
    for _ in range(3):  # honest connections name their ticket at once and are served
        conn = data_connect(server)
        assert (_get(conn, ticket, [numbered_key(1)]) or (0, b""))[0] == 1
        conn.close()
    kv = random_kv(LAYOUT, 16, seed=3)
    remote.store(numbered_key(1), kv, mode="raw")
    got = remote.retrieve(numbered_key(1), layout=LAYOUT)
    assert got is not None and got.equal(kv)
    assert remote.dataplane.net() is not None  # still on the data path
    for hog in hogs:
        hog.close()


def test_a_connection_whose_call_is_being_read_is_not_evicted(
        server: ServerThread, remote: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that spoke is pending until its ticket is checked; silent ones arriving
    meanwhile evict each other, not it (it was the oldest, and lost its call)."""
    monkeypatch.setattr(fastpath, "MAX_PENDING", 4)
    body = pb.GetManyRequest(keys=[numbered_key(1)], segment_id=data_ticket(remote)
                             ).SerializeToString()
    speaking = data_connect(server)
    speaking.sendall(FAST_HEAD.pack(len(body), NET_GET_MANY) + body[:3])  # the rest later
    time.sleep(0.2)  # heard: its call is being read
    silent = []
    for _ in range(6):
        silent.append(data_connect(server))
        time.sleep(0.05)
    assert eventually(lambda: _counter(server, "net.evicted_connections") == 3)
    assert not _closed_within(speaking, 0.1)
    speaking.sendall(body[3:])
    head = read_exact(speaking, FAST_HEAD.size)
    assert head is not None and FAST_HEAD.unpack(head)[1] == 1  # answered
    for conn in (speaking, *silent):
        conn.close()


def test_a_new_connection_closed_before_its_answer_is_tried_again(
        server: ServerThread, remote: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every pending connection is being read, the oldest makes room: the client whose
    new connection that was tries once more on a fresh one, and keeps the path (it went by
    gRPC for good, warning that "the fast path" closed the connection)."""
    monkeypatch.setattr(fastpath, "MAX_PENDING", 4)
    remote.store(numbered_key(2), random_kv(LAYOUT, 16, seed=4), mode="raw")
    owner_of, checking = netpath.NetPath.owner_of, threading.Event()

    def slow_owner_of(self: netpath.NetPath, name: str) -> Any:
        if not checking.is_set():  # the first call's ticket checked slowly (a busy server)
            checking.set()
            time.sleep(1.5)
        return owner_of(self, name)

    monkeypatch.setattr(netpath.NetPath, "owner_of", slow_owner_of)
    speaking: list[socket.socket] = []

    def crowd() -> None:  # connections that each send a byte of a call, and no more
        checking.wait(10)
        for _ in range(5):
            speaking.append(data_connect(server))
            speaking[-1].sendall(b"\0")
            time.sleep(0.1)

    crowding = threading.Thread(target=crowd)
    crowding.start()
    with Client(server.address, shm_bytes=0, timeout_s=30) as fresh:  # its path never worked
        got = fresh.fetch_many([numbered_key(2)], layout=LAYOUT)[0]
        crowding.join()
        assert got is not None
        assert fresh.dataplane.net() is not None  # still on the data path
    for conn in speaking:
        conn.close()


def test_a_request_is_bounded_until_its_ticket_is_known(server: ServerThread,
                                                       remote: Client) -> None:
    ticket = data_ticket(remote)
    conn = data_connect(server)
    conn.sendall(FAST_HEAD.pack(fastpath.FIRST_BODY + 1, NET_GET_MANY))
    assert _closed_within(conn, 5)  # refused before any of its body is read
    conn.close()
    conn = data_connect(server)
    assert (_get(conn, ticket, []) or (0, b""))[0] == 1  # admitted by its ticket
    keys = [numbered_key(i) for i in range(NET_MAX_KEYS + 1)]  # ~1.3 MiB of request
    ok, out = _get(conn, ticket, keys) or (1, b"")
    assert ok == 0 and out.startswith(b"INVALID_ARGUMENT\0")  # as any request (MAX_CALL_KEYS)
    assert f"{NET_MAX_KEYS + 1} names in one call; at most {NET_MAX_KEYS}".encode() in out
    assert (_get(conn, ticket, []) or (0, b""))[0] == 1  # in step: served on
    conn.close()


def test_a_put_naming_no_ticket_is_answered_and_closed_before_its_items(
        server: ServerThread, remote: Client) -> None:
    """A PutMany naming no live ticket on a connection none admitted declares 2 GiB of
    items: answered NOT_FOUND at once and closed, its items not waited for; one from an
    admitted connection has its items read and dropped, the connection in step."""
    _path(server).first_call_s = 1.0
    put = pb.PutManyRequest(segment_id="0" * 32)
    item = put.items.add(key=numbered_key(1))
    item.region.offset, item.region.length = 0, (1 << 31) - 1
    conn = data_connect(server)
    body = put.SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(body), NET_PUT_MANY) + body)
    head = read_exact(conn, FAST_HEAD.size)
    assert head is not None
    n, ok = FAST_HEAD.unpack(head)
    assert ok == 0 and (read_exact(conn, n) or b"").startswith(b"NOT_FOUND\0")
    assert _closed_within(conn, 5)
    conn.close()
    conn = data_connect(server)
    assert (_get(conn, data_ticket(remote), []) or (0, b""))[0] == 1  # admitted
    item.region.length = 1000
    body = put.SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(body), NET_PUT_MANY) + body + bytes(1000))
    head = read_exact(conn, FAST_HEAD.size)
    assert head is not None and FAST_HEAD.unpack(head)[1] == 0
    assert read_exact(conn, FAST_HEAD.unpack(head)[0]) is not None
    assert (_get(conn, data_ticket(remote), []) or (0, b""))[0] == 1  # in step
    conn.close()


def test_one_ticket_holds_a_bounded_share_of_the_connections(
        server: ServerThread, remote: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netpath.NetPath, "max_per_owner", 2)
    ticket = data_ticket(remote)
    held = [data_connect(server) for _ in range(2)]
    for conn in held:
        assert (_get(conn, ticket, []) or (0, b""))[0] == 1
    extra = data_connect(server)
    ok, out = _get(extra, ticket, []) or (1, b"")
    assert ok == 0 and b"at most 2" in out
    held[0].close()  # a slot of the ticket's frees up as one of its connections ends
    assert eventually(lambda: _path(server)._per_owner.get(ticket) == 1)
    assert (_get(extra, ticket, []) or (0, b""))[0] == 1
    with Client(server.address, shm_bytes=0) as other:  # another ticket is not held back
        conn = data_connect(server)
        assert (_get(conn, data_ticket(other), []) or (0, b""))[0] == 1
        conn.close()
    for conn in (held[1], extra):
        conn.close()


def test_an_answer_reads_a_bounded_amount_from_disk(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=1 << 16, disk_bytes=64 << 20)
    kvs = [random_kv(LAYOUT, 256, seed=i) for i in range(3)]  # 128 KiB each: past RAM
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0) as c:
        for i, kv in enumerate(kvs):
            c.store(numbered_key(i), kv, mode="raw")
        ticket, keys = data_ticket(c), [numbered_key(i) for i in range(3)]
        conn = data_connect(st)
        ok, out = _get(conn, ticket, keys[:1]) or (0, b"")
        ref = pb.GetManyResponse.FromString(out).entries[0]
        assert ok == 1 and ref.tier == "disk"
        size = ref.length
        monkeypatch.setattr(batch, "NET_HELD_BYTES", size * 3 // 2)
        ok, out = _get(conn, ticket, keys) or (1, b"")
        assert ok == 0 and out.startswith(b"RESOURCE_EXHAUSTED\0") and b"fewer keys" in out
        ok, out = _get(conn, ticket, [keys[0]] * 50) or (0, b"")  # one key 50 times: read once
        assert ok == 1
        refs = pb.GetManyResponse.FromString(out).entries
        assert len(refs) == 50 and all(r.present and r.length == size for r in refs)
        assert [r.offset for r in refs] == [i * size for i in range(50)]
        conn.close()
        monkeypatch.setattr(batch, "NET_HELD_BYTES", 2 << 30)
        got = c.fetch_many(keys, layout=LAYOUT)  # the client's own reads are not held back
        for kv, f in zip(kvs, got):
            assert f is not None and codec.decode(f.parts.to_bytes()).equal(kv)


def test_stripes_respect_the_servers_limits_per_call() -> None:
    net = NetPath("127.0.0.1", 1, "0" * 32, 10, connections=1)
    assert net.stripes(10) == 1
    assert net.stripes(NET_MAX_KEYS + 1) == 2  # keys per call
    net.entry_bytes = 256 << 20
    assert net.stripes(10) == 3  # 2.5 GiB of entries: at most 1 GiB a call
    assert net.stripes(100_000) == 32  # never more connections than one client may hold
    net.close()


class _FailingListener:
    """A listening socket whose ``accept`` fails as one out of descriptors does, ``fails``
    times, then hands out one end of a socket pair, then blocks until closed."""

    def __init__(self, fails: int) -> None:
        self.fails, self.closed = fails, threading.Event()
        self.mine, self.theirs = socket.socketpair()

    def accept(self) -> tuple[socket.socket, Any]:
        if self.fails:
            self.fails -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        if self.mine is not None:
            conn, self.mine = self.mine, None
            return conn, None
        self.closed.wait()
        raise OSError(errno.EBADF, "closed")

    def shutdown(self, how: int) -> None:
        self.closed.set()

    def close(self) -> None:
        self.closed.set()


def test_the_listener_outlives_a_failed_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    listener = _FailingListener(fails=3)
    served: list[socket.socket] = []
    counts: dict[str, int] = {}

    class Path_(fastpath.FastPath):
        def listen(self) -> socket.socket:
            self.name = "test"
            return listener  # type: ignore[return-value]

        def _serve(self, conn: socket.socket) -> None:
            served.append(conn)

    class Servicer:
        def count(self, name: str) -> None:
            counts[name] = counts.get(name, 0) + 1

    monkeypatch.setattr(fastpath, "ACCEPT_PAUSE_S", 0.01)
    path = Path_(Servicer())  # type: ignore[arg-type]
    listener.theirs.send(b"x")  # (a connection gets its thread once it speaks)
    assert eventually(lambda: len(served) == 1)  # accepted after three failures
    assert counts == {"fast.accept_errors": 3}
    path.close()
    for conn in (*served, listener.theirs):
        conn.close()


def test_a_failed_thread_start_loses_that_connection_only(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection whose thread can not be started (a pids limit, memory) is closed and
    counted; the door goes on handing later ones on (it died with the error: later
    connections were never served nor closed)."""
    start, fails = threading.Thread.start, [1]

    def failing_start(self: threading.Thread) -> None:
        if self.name == "kdn-net" and fails[0]:
            fails[0] -= 1
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    address = ("127.0.0.1", _path(server).port)
    with socket.create_connection(address) as lost:
        lost.sendall(b"\0")  # speaks: its thread is started, and fails
        assert _closed_within(lost, 5)
    with socket.create_connection(address) as later:
        later.sendall(FAST_HEAD.pack(1, 99) + b"\0")
        later.settimeout(5)
        assert b"unknown data path op 99" in later.recv(4096)
    assert _counter(server, "net.thread_errors") == 1


def test_config_timeouts_reach_the_data_path(server_config: ServerConfig) -> None:
    cfg = dataclasses.replace(server_config, idle_timeout_s=42.0, handshake_timeout_s=3.0)
    with ServerThread(cfg) as st:
        assert (_path(st).idle_s, _path(st).first_call_s) == (42.0, 3.0)


def test_a_put_of_many_small_entries_stays_within_the_first_call_limit(
        server: ServerThread, remote: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    # the constants as shipped: the largest PutMany a client sends fits a first call
    req = pb.PutManyRequest(namespace="n" * 64, segment_id="0" * 32)
    for i in range(BATCH_ITEMS):
        item = req.items.add(key=numbered_key(i), options=pb.StoreOptions(
            ttl_seconds=1 << 40, pin=True, durability=pb.DURABILITY_SHARED))
        item.region.offset, item.region.length = 1 << 40, 1 << 33
    assert req.ByteSize() <= fastpath.FIRST_BODY
    # and scaled down, on a real server: a fresh connection's first PutMany of many items
    monkeypatch.setattr(fastpath, "FIRST_BODY", 16 << 10)
    monkeypatch.setattr(fastwire, "BATCH_ITEMS", 200)
    kv = random_kv(LAYOUT, 1, seed=5)
    items = [(numbered_key(i), kv) for i in range(410)]
    before = _counter(server, "net.PutMany")
    remote.store_many(items, mode="raw")
    assert remote.dataplane.net() is not None  # not sent back to gRPC
    assert _counter(server, "net.PutMany") - before == 3
    got = remote.fetch_many([numbered_key(0), numbered_key(409)], layout=LAYOUT)
    assert all(f is not None and codec.decode(f.parts.to_bytes()).equal(kv) for f in got)


def test_a_pending_connection_is_evicted_mid_handshake(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TLS a silent connection waits inside its handshake; eviction still ends it (a
    shutdown of its socket through a duplicate descriptor)."""
    monkeypatch.setattr(fastpath, "MAX_PENDING", 2)
    certs = make_certs(tmp_path)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", tls_cert=str(certs["server.crt"]),
                       tls_key=str(certs["server.key"]))
    with ServerThread(cfg) as st:
        hogs = []
        for _ in range(3):
            hogs.append(data_connect(st))
            time.sleep(0.1)
        assert _closed_within(hogs[0], 5)
        assert not _closed_within(hogs[2], 0.3)
        assert _counter(st, "net.evicted_connections") == 1
        for hog in hogs:
            hog.close()
        assert eventually(lambda: not _path(st)._peers)  # every thread ended and forgot it


def test_a_tenant_member_minting_tickets_takes_back_its_own(
        server: ServerThread, remote: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a tenant's ticket cap, tickets no connection named go first, then the least
    recently named; never one whose connections are live. A member of the tenant asking for
    tickets over and over leaves its tenant's working clients on the data path."""
    from kdn.server import segments

    monkeypatch.setattr(segments, "MAX_TICKETS_PER_TENANT", 8)
    remote.store(numbered_key(1), random_kv(LAYOUT, 16, seed=1), mode="raw")
    working = data_ticket(remote)
    assert remote.fetch_many([numbered_key(1), numbered_key(2)])[0] is not None  # live
    with grpc.insecure_channel(server.address) as ch:
        attach = ch.unary_unary("/kdn.v1.KDN/Attach",
                                request_serializer=pb.AttachRequest.SerializeToString,
                                response_deserializer=pb.AttachResponse.FromString)
        idle = attach(pb.AttachRequest(remote=True), timeout=10).segment_id
        conn = data_connect(server)  # named once, then let go
        assert (_get(conn, idle, []) or (0, b""))[0] == 1
        conn.close()
        assert eventually(lambda: idle not in _path(server)._per_owner)
        minted = [attach(pb.AttachRequest(remote=True), timeout=10).segment_id
                  for _ in range(40)]
    owners = server.server.servicer.segments
    for ticket in (working, idle, minted[-1]):
        owners.ticket_owner(ticket)  # still live: NotFound otherwise
    for ticket in minted[:30]:  # the minter's own went
        with pytest.raises(NotFound):
            owners.ticket_owner(ticket)
    before = _counter(server, "net.GetMany")
    assert remote.fetch_many([numbered_key(1), numbered_key(2)])[0] is not None
    assert _counter(server, "net.GetMany") == before + 1  # on the data path still
    monkeypatch.setattr(segments, "MAX_TICKETS_PER_TENANT", 1)  # every one is in use
    owners.busy = lambda ticket: True
    with pytest.raises(TooLarge, match="in use"):
        owners.ticket(owners.ticket_owner(working))


def test_a_put_past_the_quota_is_refused_before_its_items_are_read(
        server_config: ServerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed PutMany that would take its tenant past its quota, even once the entries
    it replaces are given back, is refused before its items are read into memory (they are
    read and dropped); an overwrite of the same size near the quota is not."""
    from kdn.server import streamed

    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  t: {api_keys: [key-t], quota_bytes: 300KiB}\n")
    auth.chmod(0o600)
    received: list[int] = []
    real = streamed._received
    monkeypatch.setattr(streamed, "_received",
                        lambda conn, put, pool: received.append(len(put.items))
                        or real(conn, put, pool))
    kvs = [random_kv(LAYOUT, 128, seed=i) for i in range(6)]  # ~66 KB each as raw
    with ServerThread(dataclasses.replace(server_config, auth_file=str(auth))) as st, \
            Client(st.address, timeout_s=30, shm_bytes=0, api_key="key-t") as c:
        c.store_many([(numbered_key(i), kv) for i, kv in enumerate(kvs[:3])], mode="raw")
        assert received == [3] and _counter(st, "net.PutMany") == 1
        c.store_many([(numbered_key(i), kv) for i, kv in enumerate(kvs[3:])], mode="raw")
        assert received == [3, 3]  # 200 KB in, 100 KB left: replaces 200 KB, grows by 0
        with pytest.raises(TooLarge, match="this batch of 6 entries adds"):
            c.store_many([(numbered_key(10 + i), kv) for i, kv in enumerate(kvs)], mode="raw")
        assert received == [3, 3]  # refused before a byte of its items was kept
        assert not c.contains(numbered_key(10))
        got = c.retrieve(numbered_key(0), layout=LAYOUT)  # the connection in step
        assert got is not None and got.equal(kvs[3])


def test_a_hung_server_costs_a_call_one_deadline(server_config: ServerConfig,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose data path stops answering mid-run: the call fails DeadlineExceeded after
    one ``timeout_s``, neither made again on a fresh connection, nor on the path asked for
    again, nor over gRPC (a fleet moves it to the next node)."""
    hung, release = threading.Event(), threading.Event()
    call = netpath.NetPath.call

    def stalled(self: netpath.NetPath, conn: socket.socket, op: int, body: bytes) -> Any:
        if hung.is_set():
            release.wait(10)
        return call(self, conn, op, body)

    monkeypatch.setattr(netpath.NetPath, "call", stalled)
    with ServerThread(dataclasses.replace(server_config, disk_bytes=0)) as st, \
            Client(st.address, timeout_s=1.0, shm_bytes=0, retry=None) as c:
        c.store(numbered_key(1), random_kv(LAYOUT, 16), mode="raw")
        assert c.fetch_many([numbered_key(1)])[0] is not None  # over the data path
        hung.set()
        began = time.monotonic()
        try:
            with pytest.raises(DeadlineExceeded):
                c.fetch_many([numbered_key(1)])
            assert time.monotonic() - began < 1.8
        finally:
            release.set()


def test_one_tenant_holds_a_bounded_share_of_the_connections(
        server_config: ServerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant asking for ticket after ticket, each within its own bound, took every slot
    of the data path: another tenant's clients were refused and went back to gRPC for good.
    Where callers are authenticated a tenant holds at most TENANT_SHARE percent."""
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  a: {api_keys: [key-a]}\n  b: {api_keys: [key-b]}\n")
    auth.chmod(0o600)
    monkeypatch.setattr(netpath.NetPath, "max_connections", 4)
    monkeypatch.setattr(netpath.NetPath, "max_per_owner", 2)
    with ServerThread(dataclasses.replace(server_config, auth_file=str(auth))) as st, \
            Client(st.address, shm_bytes=0, api_key="key-a") as a1, \
            Client(st.address, shm_bytes=0, api_key="key-a") as a2, \
            Client(st.address, shm_bytes=0, api_key="key-b") as b:
        held = []
        for ticket, n in ((data_ticket(a1), 2), (data_ticket(a2), 2)):
            for _ in range(n):
                conn = data_connect(st)
                held.append((conn, _get(conn, ticket, [])))
        assert [got[0] for _, got in held] == [1, 1, 1, 0]  # 3 of 4 slots: tenant a's share
        assert b"tenant 'a' holds 3" in held[3][1][1]
        conn = data_connect(st)
        assert (_get(conn, data_ticket(b), []) or (0, b""))[0] == 1  # tenant b finds room
        for c, _ in (*held, (conn, None)):
            c.close()


def test_a_rate_limited_first_call_is_raised_not_sent_again_by_grpc(
        server_config: ServerConfig, tmp_path: Path) -> None:
    """A thread's first data path call refused for its tenant's rate limit was taken for a
    connection the server had no room for (Crowded): sent again by gRPC (the tenant's bucket
    asked twice) and the thread kept off the data path for CROWDED_S."""
    from kdn.errors import RateLimited

    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  t: {api_keys: [key-t], rate_rps: 0.5, burst: 8}\n")
    auth.chmod(0o600)
    config = dataclasses.replace(server_config, auth_file=str(auth), disk_bytes=0)
    with ServerThread(config) as st, \
            Client(st.address, timeout_s=30, shm_bytes=0, api_key="key-t", retry=None) as c:
        c.store(numbered_key(1), random_kv(LAYOUT, 16), mode="raw")
        assert c.fetch_many([numbered_key(1)])[0] is not None  # the ticket, this thread's
        with pytest.raises(RateLimited):
            for _ in range(20):
                c.lookup([numbered_key(1)])
        seen: list[Any] = []

        def first_call() -> None:  # a new thread: a new connection
            try:
                c.fetch_many([numbered_key(1)])
            except Exception as exc:  # noqa: BLE001 - checked below
                seen.append(exc)
            path = c.dataplane.net()
            seen.append(path is not None and path.threads.mine().crowded)

        t = threading.Thread(target=first_call)
        t.start()
        t.join()
        assert isinstance(seen[0], RateLimited) and seen[1] is False
