"""The in-process tier (kdn.client.local) ends holding what the server holds when a client's
threads store, delete and read one key side by side: a write drops the key's copy before it is
sent, and a copy is kept only by the write that began last, alone, once it succeeded, or by a
read that no write of the key began after; otherwise reads go to the server."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.client.local import LocalTier
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()
NS = "default"
ROUNDS = 30


def test_the_order_of_writes_and_reads_decides_what_is_kept() -> None:
    a, b = (codec.encode_parts(random_kv(LAYOUT, 8, seed=i), "raw") for i in (1, 2))
    tier = LocalTier(1 << 20)
    key = numbered_key(1)
    assert tier.put(NS, key, a)
    first = tier.write(NS, key)
    assert tier.contains(NS, key) is None  # dropped before the write is sent
    second = tier.write(NS, key)  # side by side: the server may take either last
    assert not second.keep(b) and not first.keep(a)
    first.end()
    second.end()
    second.end()  # again: nothing
    assert tier.contains(NS, key) is None
    with tier.write(NS, key) as alone:
        assert alone.keep(b) and tier.get(NS, key).parts.header == b.header  # type: ignore[union-attr]
    read = tier.read_ticket(NS, key)
    with tier.write(NS, key):
        during = tier.read_ticket(NS, key)
        assert during == 0 and not tier.put(NS, key, a, during)  # a write in flight
    assert not tier.put(NS, key, a, read)  # read before that write began: not kept
    assert tier.contains(NS, key) is None
    assert tier.put(NS, key, b, tier.read_ticket(NS, key))
    stale = tier.write(NS, key)
    with tier.write(NS, key) as later:  # began while ``stale`` was in flight
        stale.end()
    assert not stale.keep(a) and not later.keep(b)
    assert tier.put(NS, numbered_key(2), a, read)  # another key's writes do not matter


def _race(c: Client, rounds: int, sides: list[Callable[[bytes], Any]]) -> list[bytes]:
    """Each round, ``sides`` run on threads of their own side by side on a fresh key; the
    keys."""
    keys = [numbered_key(5000 + r) for r in range(rounds)]
    start = threading.Barrier(len(sides))
    errors: list[BaseException] = []

    def run(side: Callable[[bytes], Any]) -> None:
        try:
            for k in keys:
                start.wait(timeout=60)
                side(k)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=run, args=(s,)) for s in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return keys


def _diverged(c: Client, fresh: Client, keys: list[bytes]) -> int:
    """Keys whose value this client reads is not the server's."""
    out = 0
    for k in keys:
        mine, theirs = c.retrieve(k), fresh.retrieve(k)
        if (mine is None) != (theirs is None) or (
                mine is not None and theirs is not None and not mine.equal(theirs)):
            out += 1
    return out


def _stores(c: Client, kv: KVCache, how: str) -> Callable[[bytes], Any]:
    def side(k: bytes) -> None:
        for _ in range(4):
            if how == "store":
                c.store(k, kv)
            elif how == "store_async":
                c.store_async(k, kv)
            else:
                c.store_many([(k, kv)])
        c.flush()
    return side


PATHS = pytest.mark.parametrize("path", [{}, {"shm_bytes": 0},
                                         {"shm_bytes": 0, "data_path": False}],
                                ids=["same-host", "network", "grpc"])


@PATHS
def test_stores_side_by_side_leave_the_servers_value(server: ServerThread,
                                                     path: dict[str, Any]) -> None:
    a, b = random_kv(LAYOUT, 16, seed=1), random_kv(LAYOUT, 16, seed=2)
    with Client(server.address, timeout_s=30, local_bytes=1 << 22, **path) as c, \
            Client(server.address, timeout_s=30, shm_bytes=0) as fresh:
        for how in ("store", "store_async", "store_many"):
            keys = _race(c, ROUNDS, [_stores(c, a, how), _stores(c, b, how)])
            assert _diverged(c, fresh, keys) == 0, how
        keys = _race(c, ROUNDS, [_stores(c, a, "store"), _stores(c, b, "store_async")])
        assert _diverged(c, fresh, keys) == 0
        assert c.local.stats.entries > 0  # not every round lost its copy


@PATHS
def test_deletes_and_reads_beside_stores_leave_the_servers_value(
        server: ServerThread, path: dict[str, Any]) -> None:
    a, b = random_kv(LAYOUT, 16, seed=1), random_kv(LAYOUT, 16, seed=2)
    with Client(server.address, timeout_s=30, local_bytes=1 << 22, **path) as c, \
            Client(server.address, timeout_s=30, shm_bytes=0) as fresh:

        def delete(k: bytes) -> None:
            for _ in range(4):
                c.delete(k)

        def read(k: bytes) -> None:
            for _ in range(4):
                c.retrieve(k)

        keys = _race(c, ROUNDS, [_stores(c, a, "store"), delete])
        assert _diverged(c, fresh, keys) == 0
        for k in keys:
            c.store(k, b)  # each key starts out held in both places
        keys = _race(c, ROUNDS, [_stores(c, a, "store"), read])
        assert _diverged(c, fresh, keys) == 0
        keys = _race(c, ROUNDS, [_stores(c, a, "store"), _stores(c, b, "store"), read, read])
        assert _diverged(c, fresh, keys) == 0
