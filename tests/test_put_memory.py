"""What a refused store leaves behind: nothing for the garbage collector, on the client or on
the server (in-process here, so its objects show too). The error of an entry refused as
damaged holds no frame that holds it: not the server's copy of the entry's bytes (PutMany
through the shared segment, the network data path's received items, a Store stream's
frames), nor the client's batch of what it sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec import EncodedParts
from kdn.errors import InvalidArgument
from kdn.server import ServerThread
from tests.collected import collected, cycles, kdn_garbage
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=6, heads=2, dim=64)
PATHS = {"same-host": {"shm_bytes": 8 << 20}, "network": {"shm_bytes": 0},
         "grpc": {"shm_bytes": 0, "data_path": False}}
"""The client's ways to store: the shared segment (PutMany), the network data path (its
streamed PutMany) and gRPC alone (Store, StoreMany)."""


def _damaged(kv: KVCache) -> EncodedParts:
    """``kv`` encoded, a bit of its last frame flipped (the server refuses it)."""
    good = codec.encode_parts(kv, "raw")
    frame = bytearray(good.frames[-1])
    frame[-3] ^= 0x10
    return EncodedParts(good.header, [*good.frames[:-1], bytes(frame)])


def _refused(c: Client, how: str) -> Callable[[], None]:
    """Stores of damaged entries (``how``: one by one, many at once, asynchronously), each
    refused with InvalidArgument."""
    keys = iter(range(1000, 10**6))
    kvs = [random_kv(LAYOUT, tokens=64 * (1 + 8 * i), seed=i) for i in range(2)]  # 98 KB, 884 KB

    def store() -> None:
        for kv in kvs:
            with pytest.raises(InvalidArgument, match="corrupt"):
                c.store(numbered_key(next(keys)), _damaged(kv))

    def store_many() -> None:
        with pytest.raises(InvalidArgument, match="corrupt"):
            c.store_many([(numbered_key(next(keys)), _damaged(kv)) for kv in kvs])

    def store_async() -> None:
        pending = []
        for kv in kvs:
            try:  # refused at once where it was not sent ahead (large, or no fast path)
                pending.append(c.store_async(numbered_key(next(keys)), _damaged(kv)))
            except InvalidArgument:
                continue
        try:  # the first refusal of those answered since the last flush
            c.flush()
        except InvalidArgument:
            pass
        for p in pending:  # each its own
            with pytest.raises(InvalidArgument, match="corrupt"):
                p.result()

    run: dict[str, Any] = {"store": store, "store_many": store_many, "store_async": store_async}
    return run[how]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["store", "store_many", "store_async"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_refused_store_makes_no_reference_cycles(server: ServerThread, path: str,
                                                   how: str) -> None:
    with Client(server.address, timeout_s=30, **PATHS[path]) as c:
        run = _refused(c, how)
        run()  # what the server keeps for its life is made here
        found = collected(run)
    assert kdn_garbage(found) == [], (
        "a refused store's objects were freed only by the garbage collector:\n"
        + cycles(found))
