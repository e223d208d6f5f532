"""Fast-path calls that fail mid-way, against a real server: a segment detached while a
PutMany or GetMany copies out of or into it is NOT_FOUND (its mapping was taken from under the
copy: the connection's thread died with a raw AttributeError and the client saw the
connection drop), and a call that fails not on purpose is answered INTERNAL
(``kdn.server.fastpath``)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn import codec
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread, batch, putmany
from kdn.transport.wire import FAST_GET_MANY, FAST_HEAD, FAST_PUT_MANY, read_exact
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, ram_bytes=64 << 20,
                       shm_arena_bytes=0)
    with ServerThread(cfg) as st:
        yield st


@pytest.fixture
def client(served: ServerThread) -> Iterator[Client]:
    with Client(served.address, timeout_s=30, shm_bytes=16 << 20) as c:
        yield c


def _call(st: ServerThread, op: int, req: Any) -> tuple[int, bytes]:
    """One call on a new fast-path connection: (ok, answer body)."""
    assert st.server is not None and st.server.fast_path is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect("\0" + st.server.fast_path.name)
        body = req.SerializeToString()
        s.sendall(FAST_HEAD.pack(len(body), op) + body)
        head = read_exact(s, FAST_HEAD.size)
        assert head is not None, "closed with no answer"
        n, ok = FAST_HEAD.unpack(head)
        return ok, read_exact(s, n) or b""


def _detaching(st: ServerThread, sid: str, copy: Callable[..., Any]) -> Callable[..., Any]:
    """``copy`` that detaches segment ``sid`` (as its client's Detach) before its first copy."""
    assert st.server is not None
    segments = st.server.servicer.segments

    def first_detaches(*args: Any, **kwargs: Any) -> Any:
        if segments._by_id.get(sid) is not None:
            segments.detach("", sid)
        return copy(*args, **kwargs)

    return first_detaches


def test_a_segment_detached_during_a_put_or_get_is_not_found(
        served: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(served.address, timeout_s=30, shm_bytes=16 << 20) as c:
        c.store(numbered_key(100), random_kv(LAYOUT, 16, seed=1), mode="raw")
        seg, sid = c.dataplane.segment()
        value = codec.encode_parts(random_kv(LAYOUT, 16, seed=2), "raw").to_bytes()
        seg.write(1 << 20, value)
        put = pb.PutManyRequest(segment_id=sid)
        for j in range(4):
            item = put.items.add(key=numbered_key(j))
            item.region.offset, item.region.length = 1 << 20, len(value)
        monkeypatch.setattr(putmany, "copy_checked",
                            _detaching(served, sid, putmany.copy_checked))
        ok, out = _call(served, FAST_PUT_MANY, put)
        assert ok == 0 and out.startswith(b"NOT_FOUND\0")
        assert b"segment detached during the call" in out
        assert not c.contains(numbered_key(0))  # refused whole

    with Client(served.address, timeout_s=30, shm_bytes=16 << 20) as c:
        c.store_many([(numbered_key(j), random_kv(LAYOUT, 16, seed=j)) for j in range(2)],
                     mode="raw")
        _, sid = c.dataplane.segment()
        monkeypatch.setattr(batch, "copy_checked", _detaching(served, sid, batch.copy_checked))
        get = pb.GetManyRequest(keys=[numbered_key(0), numbered_key(1)], segment_id=sid,
                                region=pb.Region(offset=1 << 20, length=1 << 20))
        ok, out = _call(served, FAST_GET_MANY, get)
        assert ok == 0 and out.startswith(b"NOT_FOUND\0")
        assert b"segment detached during the call" in out


def test_a_call_that_fails_not_on_purpose_is_answered_internal(
        served: ServerThread, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    assert served.server is not None
    reads = served.server.servicer.reads

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    _, sid = client.dataplane.segment()
    monkeypatch.setattr(reads, "get_many", broken)
    get = pb.GetManyRequest(keys=[numbered_key(0)], segment_id=sid,
                            region=pb.Region(offset=1 << 20, length=1 << 20))
    ok, out = _call(served, FAST_GET_MANY, get)
    assert ok == 0 and out == b"INTERNAL\0internal error: RuntimeError: a bug"
    monkeypatch.undo()
    assert client.retrieve(numbered_key(0), layout=LAYOUT) is None  # the path serves on
