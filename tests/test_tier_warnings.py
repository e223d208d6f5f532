"""A tier that refuses every call logs a WARNING for the first of each kind a minute, not a line
per call: a Redis out of memory (``noeviction``, an operator's setting) refuses every write the
write queue sends it, and each was a WARNING of its own. The count of dropped writes stays
exact (``redis.write_dropped``)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from kdn import ratelog
from kdn.client import Client
from kdn.errors import Corrupt, TooLarge
from kdn.server import ServerConfig, ServerThread
from kdn.store import health
from kdn.store.health import Fault, TierHealth
from kdn.store.ram import RamTier
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import RedisServer


def _refused(logs: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in logs.records
            if r.name == "kdn.store.health" and r.levelno == logging.WARNING]


def test_writes_redis_refuses_out_of_memory_warn_once_and_are_all_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kdn.store.health")
    with RedisServer(tmp_path, appendonly=False) as rs:
        r = rs.client()
        cfg = ServerConfig(port=0, data_port=-1, data_dir=tmp_path / "d", redis_url=rs.url,
                           shutdown_grace_s=2)
        with ServerThread(cfg) as st, Client(st.address, timeout_s=10) as c:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 10_000)
            lay = uniform_layout(2, 2, 64)
            for i in range(12):
                c.store(hashlib.sha256(b"%d" % i).digest(), random_kv(lay, 64, seed=i),
                        mode="raw")
            store = st.server.store  # type: ignore[union-attr]
            assert store.flush(10)
            assert store.counters.get("redis.write_dropped") == 12, store.counters
    said = _refused(caplog)
    assert len(said) == 1 and "out of memory" in said[0], said


def test_each_kind_of_failure_warns_once_a_minute_and_says_how_many_went_unsaid(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    ram = RamTier(1 << 20)
    h = TierHealth([ram], count=lambda name, n: None, on_up=lambda name: None)

    def refuse(exc: Exception) -> None:
        raise exc

    caplog.set_level(logging.DEBUG, logger="kdn.store.health")
    for i in range(5):
        assert h.attempt(ram, lambda: refuse(TooLarge("full")), f"write {i}") is Fault.FAILED
    assert h.attempt(ram, lambda: refuse(Corrupt("bad")), "read") is Fault.FAILED  # another kind
    assert _refused(caplog) == ["tier ram: write 0 failed: full", "tier ram: read failed: bad"]
    now[0] += health.WARN_EVERY_S - 1
    h.attempt(ram, lambda: refuse(TooLarge("full")), "write 5")
    assert len(_refused(caplog)) == 2  # still within the minute
    now[0] += 2
    h.attempt(ram, lambda: refuse(TooLarge("full")), "write 6")
    assert _refused(caplog)[-1] == ("tier ram: write 6 failed: full (5 more such failures "
                                    "since the last warning)")
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 5  # the unsaid ones, still in the log at DEBUG
    assert h.is_up("ram")
