"""Egress caps (kdn.server.egress) against a real server on loopback: a read of a known size
under a per-connection cap takes at least size/cap, over gRPC and over the network data path,
as an export does; two clients of one process have a cap each; a default server is not
slowed; a tenant's cap is shared by its clients; a read cut off by its deadline holds back
none of the tenant's later reads; bad values are refused at start-up.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.errors import ConfigError, DeadlineExceeded
from kdn.keys import store_key
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import tenants_from_text
from kdn.server.config import load_config
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=2, heads=8, dim=64)  # 4 KiB a token, 2 frames
CAP = 4_000_000  # bytes/s
TOKENS = 512  # ~2 MiB an entry: ~0.5 s at CAP


def _read(server: ServerThread, how: str, n: int = 1, api_key: str | None = None
          ) -> tuple[float, int]:
    """Seconds a fresh client takes to read entries 0..n-1 (stored beforehand), and their
    bytes; ``how``: retrieve or fetch_many."""
    with Client(server.address, timeout_s=30, shm_bytes=0, api_key=api_key) as c:
        c.lookup([numbered_key(0)])  # connected (and attached to the data path) first
        keys = [numbered_key(i) for i in range(n)]
        t0 = time.perf_counter()
        if how == "retrieve":
            got = [c.retrieve(k, layout=LAYOUT) for k in keys]
        elif how.startswith("retrieve_many"):  # the raw RPC: the client reads by GetMany
            with grpc.insecure_channel(server.address) as ch:
                stub = pb_grpc.KDNStub(ch)
                req = pb.RetrieveManyRequest(keys=keys, grouped=how.endswith("grouped"))
                md = [("x-kdn-api-key", api_key)] if api_key else None
                got = [sum(len(m.SerializeToString()) for m in stub.RetrieveMany(req,
                                                                                 metadata=md))]
        elif how == "retrieve_stream":
            got = [s.result() if (s := c.retrieve_stream(k, layout=LAYOUT)) else None
                   for k in keys]
        else:
            got = list(c.fetch_many(keys, layout=LAYOUT))
        elapsed = time.perf_counter() - t0
    assert all(g is not None for g in got)
    return elapsed, sum(_entry_bytes(server, k, api_key) for k in keys)


def _entry_bytes(server: ServerThread, key: bytes, api_key: str | None) -> int:
    tenant = "" if api_key is None else "team-a"
    (found,) = server.server.store.lookup([store_key(tenant, "default", key)])
    return found.size


def _store(server: ServerThread, n: int, api_key: str | None = None) -> None:
    with Client(server.address, timeout_s=30, api_key=api_key) as c:
        for i in range(n):
            c.store(numbered_key(i), random_kv(LAYOUT, TOKENS, seed=i), mode="raw")


@pytest.fixture
def capped(server_config: ServerConfig, request: pytest.FixtureRequest
           ) -> Iterator[ServerThread]:
    cfg = dataclasses.replace(server_config, egress_bytes_per_s=CAP, **request.param)
    with ServerThread(cfg) as st:
        yield st


@pytest.mark.parametrize(("capped", "how", "rpc"), [
    ({"data_port": -1}, "retrieve", "getmany.hit"),  # a GetMany, inline
    ({"data_port": -1}, "retrieve_stream", "retrieve.hit"),
    ({"data_port": -1}, "retrieve_many", "retrievemany.hit"),
    ({"data_port": -1}, "retrieve_many_grouped", "retrievemany.hit"),
    ({}, "retrieve", "net.GetMany"),
    ({}, "fetch_many", "net.GetMany"),
], ids=["grpc-GetMany", "grpc-Retrieve", "grpc-RetrieveMany", "grpc-RetrieveMany-grouped",
        "net-retrieve", "net-fetch_many"], indirect=["capped"])
def test_a_read_under_a_connection_cap_takes_size_over_cap(capped: ServerThread, how: str,
                                                           rpc: str) -> None:
    _store(capped, 1)
    before = capped.server.servicer.counters.get(rpc, 0)
    elapsed, size = _read(capped, how)
    assert capped.server.servicer.counters.get(rpc, 0) == before + 1  # the path meant
    assert size > 2_000_000
    assert elapsed >= 0.8 * size / CAP, (elapsed, size)
    assert elapsed < 3 * size / CAP + 1.0  # paced, not stalled
    delayed = capped.server.servicer.usage.egress_delayed_bytes
    assert delayed.get("", 0) > 0


@pytest.mark.parametrize("capped", [{}], indirect=True)
def test_an_export_under_a_connection_cap_takes_size_over_cap(capped: ServerThread,
                                                              tmp_path: Path) -> None:
    _store(capped, 1)
    size = _entry_bytes(capped, numbered_key(0), None)
    with AdminClient(capped.address, timeout_s=30, shm_bytes=0) as c:
        c.lookup([numbered_key(0)])
        t0 = time.perf_counter()
        assert c.export_to(tmp_path / "out.kdnx") == 1
        elapsed = time.perf_counter() - t0
    assert elapsed >= 0.8 * size / CAP, (elapsed, size)
    assert capped.server.servicer.usage.egress_delayed_bytes.get("", 0) > 0


def test_a_default_server_is_not_slowed(server: ServerThread) -> None:
    assert not server.server.servicer.egress.on
    _store(server, 1)
    for how in ("retrieve", "fetch_many", "retrieve_stream", "retrieve_many"):
        elapsed, size = _read(server, how)
        assert elapsed < 0.5 * size / CAP, (how, elapsed)
    assert server.server.servicer.usage.egress_delayed_bytes == {}


def test_a_tenant_cap_is_shared_by_its_clients(server_config: ServerConfig,
                                               tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text(f"tenants:\n  team-a: {{api_keys: [key-a], egress_bytes_per_s: {CAP}}}\n")
    auth.chmod(0o600)
    cfg = dataclasses.replace(server_config, auth_file=str(auth))
    with ServerThread(cfg) as st:
        _store(st, 2, api_key="key-a")
        results: list[tuple[float, int]] = []
        errors: list[BaseException] = []

        def one() -> None:
            try:
                results.append(_read(st, "retrieve", 2, api_key="key-a"))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        assert not errors, errors
        total = sum(size for _, size in results)
        assert total > 8_000_000
        assert elapsed >= 0.8 * total / CAP, (elapsed, total)  # one cap for both, not two
        usage = st.server.servicer.usage
        assert usage.egress_delayed_bytes["team-a"] > 0
        assert usage.egress_wait_s["team-a"] > 0


@pytest.mark.parametrize("capped", [{"data_port": -1}], indirect=True)
def test_two_clients_of_one_process_each_have_a_connection_cap(capped: ServerThread) -> None:
    _store(capped, 1)
    with Client(capped.address, timeout_s=30, shm_bytes=0) as a, \
            Client(capped.address, timeout_s=30, shm_bytes=0) as b:
        for c in (a, b):
            assert c.fetch(numbered_key(0), layout=LAYOUT) is not None
        # one bucket per connection the server saw: the two did not share one (and its cap)
        assert len(capped.server.servicer.egress._connections) == 2


def test_a_read_cut_off_by_its_deadline_gives_its_unsent_bytes_back(
        server_config: ServerConfig, tmp_path: Path) -> None:
    auth = tmp_path / "tenants.yaml"
    auth.write_text("tenants:\n  team-a: {api_keys: [key-a], egress_bytes_per_s: 1MB}\n")
    auth.chmod(0o600)
    cfg = dataclasses.replace(server_config, auth_file=str(auth), data_port=-1)
    with ServerThread(cfg) as st:
        with Client(st.address, timeout_s=30, api_key="key-a") as c:
            for i in (*range(20), 99):  # 20 of ~400 KB: inline GetManys of ~2 MB, ~2 s each
                c.store(numbered_key(i), random_kv(LAYOUT, 2 if i == 99 else 96, seed=i),
                        mode="raw")
        with Client(st.address, timeout_s=0.3, shm_bytes=0, api_key="key-a") as c:
            c.lookup([numbered_key(0)])
            with pytest.raises(DeadlineExceeded):
                c.fetch_many([numbered_key(i) for i in range(20)], layout=LAYOUT)
        time.sleep(0.2)  # the server has seen the call end
        with Client(st.address, timeout_s=1.0, shm_bytes=0, api_key="key-a") as c:
            t0 = time.perf_counter()
            assert c.fetch(numbered_key(99), layout=LAYOUT) is not None
            assert time.perf_counter() - t0 < 0.5  # not behind the cut-off read's bytes
        usage = st.server.servicer.usage
        # only bytes sent count: the small read's own (past the 1 ms burst), not the cut one's
        assert usage.egress_delayed_bytes.get("team-a", 0) < 20_000
        assert usage.egress_cancelled_bytes["team-a"] > 1_500_000


def test_units_and_bad_values_are_refused_at_start_up() -> None:
    assert load_config(env={"KDN_EGRESS_BYTES_PER_S": "125MB"}).egress_bytes_per_s \
        == 125_000_000
    assert load_config(env={}).egress_bytes_per_s == 0
    with pytest.raises(ConfigError, match=r"egress_bytes_per_s: must be >= 0"):
        load_config(env={}, flags={"egress_bytes_per_s": -1})
    with pytest.raises(ConfigError, match=r"egress_bytes_per_s: invalid value 'fast' "
                                          r"\(from \$KDN_EGRESS_BYTES_PER_S\)"):
        load_config(env={"KDN_EGRESS_BYTES_PER_S": "fast"})
    digest = "sha256:" + "0" * 64
    ok = tenants_from_text(f"{{t: {{api_keys: ['{digest}'], egress_bytes_per_s: 1GB}}}}")
    assert ok.policies["t"].egress_bytes_per_s == 10**9
    for bad, why in (("-5", "must be a finite whole number >= 0"), ("lots", "expected a size")):
        with pytest.raises(ConfigError, match=rf"tenant 't': egress_bytes_per_s: {why}"):
            tenants_from_text(f"{{t: {{api_keys: ['{digest}'], egress_bytes_per_s: {bad}}}}}")


def test_a_read_after_an_idle_spell_comes_at_most_a_millisecond_early() -> None:
    """An emulated 1 Gbit/s link: 3 MB after an idle spell take 24 ms less 1 ms of burst
    (the bucket held 50 ms of the rate, capped at 4 MiB: they left at once, a 3 MB hit came at
    3 Gbit/s and the benchmark's slow links were faster than their labels)."""
    from kdn.server.egress import Bucket

    gbit = Bucket(125_000_000)
    time.sleep(0.01)  # idle: the bucket is full
    assert gbit.reserve(3_000_000) >= 0.024 - 0.001 - 1e-4
