"""What a connection to the same-host fast path may hold before and after it names a segment
(``kdn.server.fastpath``, module docstring), against a real server: any local process may
connect (the socket's name is in /proc/net/unix), and 1,100 keyless idle connections held
1,015 server threads and every descriptor until gRPC stopped answering, while 8 that each
declared a 64 MiB body and sent all of it but a byte held 870 MB for good."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import codec
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread, fastpath
from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, FAST_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import eventually, random_kv
from tests.test_dataplane import LAYOUT, _key


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, ram_bytes=64 << 20,
                       handshake_timeout_s=1.0)
    with ServerThread(cfg) as st:
        yield st


def _path(st: ServerThread) -> fastpath.FastPath:
    assert st.server is not None and st.server.fast_path is not None
    return st.server.fast_path


def _connect(st: ServerThread) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + _path(st).name)
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (read within its timeout; a reset where it left bytes
    of ours unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _get(s: socket.socket, segment_id: str) -> tuple[int, bytes]:
    body = pb.GetManyRequest(keys=[_key(1)], segment_id=segment_id,  # a miss: nothing written
                             region=pb.Region(offset=4096, length=4096)).SerializeToString()
    s.sendall(FAST_HEAD.pack(len(body), FAST_GET_MANY) + body)
    head = read_exact(s, FAST_HEAD.size)
    assert head is not None, "closed with no answer"
    n, ok = FAST_HEAD.unpack(head)
    return ok, read_exact(s, n) or b""


def test_silent_strangers_are_closed_in_time_and_the_oldest_make_room(
        served: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastpath, "MAX_PENDING", 4)
    t0 = time.monotonic()
    hogs = [_connect(served) for _ in range(6)]
    assert all(_closed(h) for h in hogs[:2])  # the oldest two were cut for the newer
    assert time.monotonic() - t0 < 1.0, "cut for room, not at their deadline"
    assert all(_closed(h) for h in hogs[2:])  # the rest at handshake_timeout_s (1 s)
    assert eventually(lambda: not _path(served)._peers)
    with Client(served.address, shm_bytes=4 << 20) as c:  # a client is served throughout
        kv = random_kv(LAYOUT, 8, seed=3)
        c.store(_key(3), kv)
        assert c.retrieve(_key(3)).equal(kv)  # type: ignore[union-attr]
        assert c.stats().counters["fast.evicted_connections"] >= 2
    for h in hogs:
        h.close()


def test_a_stranger_may_not_declare_a_large_body_nor_hold_one_half_sent(
        served: ServerThread) -> None:
    big = _connect(served)  # 64 MiB declared before any segment is named: refused unread
    big.sendall(FAST_HEAD.pack(fastpath.FIRST_BODY + 1, FAST_GET_MANY) + b"x" * 1000)
    assert _closed(big)
    half = _connect(served)  # within the limit, all but a byte sent: closed at the deadline
    half.sendall(FAST_HEAD.pack(fastpath.FIRST_BODY, FAST_GET_MANY) + b"x" * 4096)
    t0 = time.monotonic()
    assert _closed(half) and time.monotonic() - t0 < 3.0
    big.close()
    half.close()


def test_a_named_segment_admits_its_connections_within_their_bound(
        served: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(served.address, shm_bytes=4 << 20) as c:
        seg_id = c.dataplane.segment()[1]
        own = _path(served)._per_owner.get(seg_id, 0)  # the client's own (its arena's)
        monkeypatch.setattr(fastpath.FastPath, "max_per_owner", own + 2)
        held = [_connect(served) for _ in range(2)]
        for h in held:
            assert _get(h, seg_id)[0] == 1  # admitted: served, and kept past the deadline
        extra = _connect(served)
        ok, out = _get(extra, seg_id)
        assert ok == 0 and f"at most {own + 2}".encode() in out
        assert out.startswith(b"RESOURCE_EXHAUSTED")
        time.sleep(1.5)  # past handshake_timeout_s: the admitted stay, the pending one goes
        assert all(_get(h, seg_id)[0] == 1 for h in held)
        assert _closed(extra)
        held[0].close()  # its slot frees up
        assert eventually(lambda: _path(served)._per_owner.get(seg_id) == own + 1)
        again = _connect(served)
        assert _get(again, seg_id)[0] == 1
        for s in (again, extra, *held):
            s.close()


def test_putmanys_sent_together_are_not_stored_past_the_bound(
        served: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """PutManys queued on a connection not yet admitted are not copied together: each is
    refused as alone (the later half of a group ran where nothing was admitted, and was
    stored past ``max_per_owner``)."""
    with Client(served.address, shm_bytes=4 << 20) as c:
        seg, seg_id = c.dataplane.segment()
        monkeypatch.setattr(fastpath.FastPath, "max_per_owner",
                            _path(served)._per_owner.get(seg_id, 0))  # at its bound
        value = codec.encode_parts(random_kv(LAYOUT, 16, seed=1), "raw").to_bytes()
        seg.write(1 << 20, value)
        calls = b""
        for i in (1, 2, 3, 4):
            put = pb.PutManyRequest(segment_id=seg_id)
            item = put.items.add(key=_key(i))
            item.region.offset, item.region.length = 1 << 20, len(value)
            body = put.SerializeToString()
            calls += FAST_HEAD.pack(len(body), FAST_PUT_MANY) + body
        s = _connect(served)
        s.sendall(calls)  # queued together: grouped, were it admitted
        for _ in range(4):
            head = read_exact(s, FAST_HEAD.size)
            assert head is not None
            n, ok = FAST_HEAD.unpack(head)
            assert ok == 0 and (read_exact(s, n) or b"").startswith(b"RESOURCE_EXHAUSTED")
        assert not any(c.contains(_key(i)) for i in (1, 2, 3, 4))
        s.close()
