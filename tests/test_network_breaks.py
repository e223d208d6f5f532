"""A remote client's connections failing in the ways of a real network (``tests.relay``
between the client and a real server's ports). The network data path: each call still ends by
its one deadline, whatever it makes after the path failed, a path that never answered is given
up for gRPC, and a call waiting on it ends when the client is closed. The gRPC channel: a
connection that died silently is left for a new one, and a delete whose answer was lost is not
made again (it would count nothing).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from kdn.client import Client
from kdn.errors import Closed, DeadlineExceeded, Unavailable
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout
from tests.relay import FREEZE, MUTE, LateReset, Relay

LAYOUT = uniform_layout(layers=2, heads=1, dim=8)
KEY = numbered_key(1)


def _port(st: ServerThread) -> int:
    return int(st.address.rsplit(":", 1)[1])


@pytest.fixture
def relayed(server: ServerThread) -> Iterator[Relay]:
    """The server's data path reached through a relay (the port ``Attach`` hands out)."""
    servicer = server.server.servicer
    with Relay(servicer.data_port) as relay:
        servicer.data_port = relay.port
        yield relay


def test_a_path_that_breaks_late_costs_a_call_its_deadline_once(server: ServerThread,
                                                                 relayed: Relay) -> None:
    """Every answer comes 0.7 s late as a reset, on a path that had worked: the call made
    again on a new connection, the path asked for again, the call made there and then by
    gRPC each took a fresh 1.5 s (2.1 s and more in all); they share the call's one now."""
    kv = random_kv(LAYOUT, 8, seed=1)
    with Client(server.address, timeout_s=1.5, shm_bytes=0) as c:
        c.store(KEY, kv, mode="raw")
        assert c.dataplane.net() is not None
        assert c.fetch(KEY) is not None  # the path worked
        relayed.fault = LateReset(0.7)
        t0 = time.monotonic()
        try:
            got = c.retrieve(KEY, layout=LAYOUT)
            assert got is not None and got.equal(kv)
        except DeadlineExceeded:
            pass
        assert time.monotonic() - t0 < 1.5 + 0.3


def test_a_path_that_never_answered_is_given_up_for_grpc(server: ServerThread,
                                                         relayed: Relay) -> None:
    """The data port takes connections and says nothing: the first call fails at its
    deadline, the client's later calls go by gRPC (each failed DEADLINE_EXCEEDED)."""
    kv = random_kv(LAYOUT, 8, seed=2)
    with Client(server.address, timeout_s=30, data_path=False) as writer:
        writer.store(KEY, kv, mode="raw")
    relayed.fault = MUTE
    with Client(server.address, timeout_s=1.0, shm_bytes=0) as c:
        with pytest.raises(DeadlineExceeded, match="data path"):
            c.retrieve(KEY, layout=LAYOUT)
        assert c.dataplane.net() is None
        for _ in range(2):
            got = c.retrieve(KEY, layout=LAYOUT)
            assert got is not None and got.equal(kv)


def test_a_grpc_connection_that_died_silently_is_left_for_a_new_one(server: ServerThread
                                                                      ) -> None:
    """The connection swallows every byte and never closes (a peer gone without a reset):
    the client's pings go unanswered, the connection is closed, and a call a few seconds
    later goes on a new one (every call failed DEADLINE_EXCEEDED for good)."""
    kv = random_kv(LAYOUT, 8, seed=3)
    with Relay(_port(server)) as relay, \
            Client(f"127.0.0.1:{relay.port}", timeout_s=2.0, data_path=False,
                   shm_bytes=0) as c:
        c.store(KEY, kv, mode="raw")
        relay.bury()
        t0 = time.monotonic()
        got = None
        while got is None and time.monotonic() - t0 < 8:
            with contextlib.suppress(DeadlineExceeded, Unavailable):
                got = c.retrieve(KEY, layout=LAYOUT)
        assert got is not None and got.equal(kv)
        assert relay.accepted == 2


def test_a_delete_whose_answer_was_lost_says_so(server: ServerThread) -> None:
    """The connection resets as the server answers a delete: Unavailable saying the keys
    may have been deleted (it was made again, found nothing, and said 0 deleted where the
    first had deleted the key)."""
    with Relay(_port(server)) as relay, \
            Client(f"127.0.0.1:{relay.port}", timeout_s=3.0, data_path=False,
                   shm_bytes=0) as c:
        c.store(KEY, random_kv(LAYOUT, 8, seed=4), mode="raw")
        time.sleep(0.2)  # the connection's own frames after the store (window, pings) came
        relay.fault = LateReset(0, answers=True)
        with pytest.raises(Unavailable, match="may have been deleted"):
            c.delete(KEY)  # (reset as the server answers the delete, or acks its bytes)


def test_close_ends_a_read_waiting_on_the_data_path(server: ServerThread,
                                                    relayed: Relay) -> None:
    """The data path stops answering while ``retrieve_streams`` waits on its connections:
    the client's ``close`` ends the call with Closed at once (it waited out its timeout_s)."""
    keys = [numbered_key(i) for i in range(2)]
    got: list[object] = []
    with Client(server.address, timeout_s=20, shm_bytes=0) as c:
        c.store_many([(k, random_kv(LAYOUT, 8, seed=i)) for i, k in enumerate(keys)],
                     mode="raw")
        for stream in c.retrieve_streams(keys, layout=LAYOUT):
            assert stream is not None and stream.result() is not None  # its connections open
        relayed.fault = FREEZE

        def read() -> None:
            try:
                got.append(c.retrieve_streams(keys, layout=LAYOUT))
            except Exception as exc:
                got.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.3)
    t0 = time.monotonic()
    reader.join(5)
    relayed.fault = None
    assert time.monotonic() - t0 < 3
    assert len(got) == 1 and isinstance(got[0], Closed), got
