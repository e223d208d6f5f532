"""A batch of stores is checked whole before any of it is stored, on every path a client
writes by (the shared segment, the network data path, gRPC alone): a bad argument, an entry
the server refuses, or a damaged one leaves nothing of the batch stored, and the error names
the caller's item."""

from __future__ import annotations

from typing import Any

import pytest

from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()

PATHS = [{}, {"shm_bytes": 0}, {"shm_bytes": 0, "data_path": False}]
"""Through the shared segment (same host), the network data path, gRPC alone."""


@pytest.mark.parametrize("options", PATHS)
def test_a_bad_mode_stores_nothing_of_the_batch(server: ServerThread,
                                                options: dict[str, Any]) -> None:
    """A mistyped mode or level was found only when the batch's first KVCache was encoded,
    after its staged items had been stored."""
    a, b = numbered_key(1), numbered_key(2)
    with Client(server.address, timeout_s=30, **options) as c:
        st = c.stage(LAYOUT, 8)
        st.write(random_kv(LAYOUT, 8, seed=1))
        kv = random_kv(LAYOUT, 8, seed=2)
        for mode, level, match in (("lossy", "", "unknown codec mode 'lossy'"),
                                   ("kdn", "smal", "has no level 'smal'"),
                                   ("raw", "x", "has no level 'x'")):
            with pytest.raises(InvalidArgument, match=match):
                c.store_many([(a, st), (b, kv)], mode=mode, level=level)
            with pytest.raises(InvalidArgument, match=match):
                c.store(a, st, mode=mode, level=level)
            with pytest.raises(InvalidArgument, match=match):
                c.store_async(a, st, mode=mode, level=level).result()
        with pytest.raises(InvalidArgument, match="layers_per_frame"):
            c.store_many([(a, st), (b, kv)], layers_per_frame=-1)
        c.flush()
        assert [i.present for i in c.lookup([a, b]).infos] == [False, False]
        st.close()
