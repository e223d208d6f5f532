"""What a Client refuses, against a real server: each bad argument is a kdn error naming it
(InvalidArgument), raised where every call passes, not an AttributeError, a ValueError or a
TypeError from protobuf, gRPC or torch; and what it takes (None and inf: no deadline)."""

from __future__ import annotations

import math

import pytest

from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()


def test_a_timeout_is_a_number_of_seconds_or_none(server: ServerThread) -> None:
    """0, -1 and NaN were taken and every call then failed DEADLINE_EXCEEDED at once, as did
    inf and 1e12 (no deadline gRPC can hold); "5" failed inside gRPC (TypeError)."""
    for bad in (0, -1, math.nan, "5", True):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            Client(server.address, timeout_s=bad)  # type: ignore[arg-type]
    kv = random_kv(LAYOUT, 8, seed=1)
    for none in (None, math.inf, 1e12):
        with Client(server.address, timeout_s=none) as c:
            assert c.timeout_s is None
            c.store(numbered_key(1), kv)
            assert c.retrieve(numbered_key(1)).equal(kv)  # type: ignore[union-attr]
            assert c.lookup([numbered_key(1)]).infos[0].present
            c.stats()
    with Client(server.address, timeout_s=5) as c:
        assert c.timeout_s == 5.0
