"""Whose deadline ended a call, and what a call that ended says: a caller's short
``deadline_within`` ends a remote client's first data-path call without giving the path up
(it was given up for good, every later call going by gRPC), the client's own ``timeout_s``
is named as such when its one deadline ended a call that went by gRPC (it was blamed on 'its
caller'), and a delete to a host name that does not resolve never reached a server: it is
retried, and not said to have perhaps deleted anything."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kdn.client import Client, netpath
from kdn.client.deadline import deadline_within
from kdn.client.perthread import Crowded
from kdn.client.rpc import Retry, never_sent
from kdn.errors import DeadlineExceeded, Unavailable
from kdn.server import ServerConfig, ServerThread, service
from tests.helpers import numbered_key, random_kv, uniform_layout

LAY = uniform_layout(layers=8, heads=8, dim=64)


def test_a_callers_short_deadline_leaves_the_network_data_path(server: ServerThread) -> None:
    kv = random_kv(LAY, 1024)
    keys = [numbered_key(i) for i in range(8)]
    with Client(server.address, timeout_s=30) as w:
        for k in keys:
            w.store(k, kv)
    with Client(server.address, timeout_s=30, shm_bytes=0) as c:  # as from another host
        net = c.dataplane.net()
        assert net is not None
        with deadline_within(0.0005), pytest.raises(DeadlineExceeded):
            c.fetch_many(keys)
        assert all(g is not None for g in c.fetch_many(keys))
        assert c.dataplane.network._net is net  # noqa: SLF001  (kept, not given up)


def test_a_deadline_within_too_far_off_for_grpc_bounds_nothing(server: ServerThread) -> None:
    """deadline_within(1e10) around a client with no timeout failed every gRPC call
    DEADLINE_EXCEEDED at once (gRPC can not hold it), as vLLM's lookups did with a
    lookup_timeout_s that large; a span of NO_DEADLINE_S or more is no deadline."""
    with Client(server.address, timeout_s=None, shm_bytes=0) as c:
        with deadline_within(1e10):
            assert c.lookup([numbered_key(30)]).infos[0].present is False
            with deadline_within(0.0005), pytest.raises(DeadlineExceeded):  # inner: still
                c.fetch_many([numbered_key(30)] * 64)


def test_the_clients_own_timeout_is_named_where_it_ended_a_call(
        server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [numbered_key(20 + i) for i in range(2)]
    slow_of = service.KDNServicer.GetMany

    async def slow(self: Any, request: Any, context: Any) -> Any:
        await asyncio.sleep(2.0)
        return await slow_of(self, request, context)

    def crowded(*_: Any, **__: Any) -> Any:  # the server takes no new data-path connection
        raise Crowded("RESOURCE_EXHAUSTED: too many data path connections")

    monkeypatch.setattr(service.KDNServicer, "GetMany", slow)  # (before the server starts)
    with ServerThread(server_config) as server:
        with Client(server.address, timeout_s=30) as w:
            for k in keys:
                w.store(k, random_kv(uniform_layout(), 4))
        monkeypatch.setattr(netpath.NetPath, "get_many", crowded)
        with Client(server.address, timeout_s=0.5, shm_bytes=0) as c:
            assert c.dataplane.net() is not None
            with pytest.raises(DeadlineExceeded, match=r"timeout_s=0\.5 s") as err:
                c.fetch_many(keys)  # by gRPC, within the call's one deadline
    assert "caller" not in str(err.value)


class _Failed(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("details,sent", [
    ("failed to connect to all addresses; last error: UNKNOWN: Connection refused", False),
    ("errors resolving nosuchhost.invalid:50051: Domain name not found", False),
    ("DNS resolution failed for nosuchhost.invalid:50051", False),
    ("Socket closed", True),
    ("redis tier down: nothing deleted", True),  # answered by the server
])
def test_a_call_that_found_no_server_never_reached_one(details: str, sent: bool) -> None:
    assert never_sent(_Failed(details)) is not sent


def test_a_delete_to_a_host_that_does_not_resolve_is_not_said_to_have_deleted() -> None:
    with Client("nosuchhost.invalid:50051", timeout_s=5, shm_bytes=0, data_path=False,
                retry=Retry(retries=1, base_s=0.01)) as c:
        with pytest.raises(Unavailable) as err:
            c.delete(numbered_key(1))
    assert "may have" not in str(err.value), err.value  # (it never reached one)
