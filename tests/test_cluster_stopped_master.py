"""A Redis Cluster master that is stopped (SIGSTOP: a hung host, a partition that drops
packets) while the Redis tier starts or closes, with real redis-server processes. The tier
starts with the other masters' slots serving, even where redis-py's client would first ask the
stopped master (it learns the commands' key positions from one random master as it starts),
and closing it while its watcher is asking the stopped master ends with no error on any
thread."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis.cluster

from kdn.store.redis import RedisTier
from tests.helpers import sigstop
from tests.redis_servers import RedisCluster3

pytestmark = pytest.mark.redis


def _stopped_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """redis-py's random choices pick the master on ``port`` wherever it is offered."""
    pick = redis.cluster.random.choice

    def choice(seq: Any) -> Any:
        return next((n for n in seq if getattr(n, "port", None) == port), None) or pick(seq)

    monkeypatch.setattr(redis.cluster.random, "choice", choice)


def test_the_tier_starts_while_a_master_is_stopped(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisCluster3(tmp_path / "c") as cluster:
        lost = cluster.nodes[0]
        _stopped_first(monkeypatch, lost.port)
        assert lost.proc is not None
        sigstop(lost.proc.pid)
        try:
            tier = RedisTier(cluster.urls, cluster=True, timeout_s=0.5)
            try:
                assert tier.healthy()  # the probe asks every master: one does not answer
                assert tier.masters_down() == [f"127.0.0.1:{lost.port}"]
                key = next(k for k in (b"k%d" % i for i in range(200))
                           if tier._master_of(k) != f"127.0.0.1:{lost.port}")  # noqa: SLF001
                tier.put(key, b"v" * 100)
                assert tier.get(key) == b"v" * 100
            finally:
                tier.close()
        finally:
            lost.proc.send_signal(signal.SIGCONT)


def test_closing_while_a_stopped_master_is_asked_raises_on_no_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    with RedisCluster3(tmp_path / "c") as cluster:
        lost = cluster.nodes[0]
        assert lost.proc is not None
        sigstop(lost.proc.pid)
        try:
            for wait_s in (0.6, 0.9, 1.2):  # the watcher PINGs it every 0.25 s, each 0.5 s
                tier = RedisTier(cluster.urls, cluster=True, timeout_s=0.5)
                assert tier.healthy()
                assert tier.masters_down() == [f"127.0.0.1:{lost.port}"]
                time.sleep(wait_s)
                tier.close()
                asking = [t for t in threading.enumerate() if t.name == "kdn-redis-ask"]
                assert not asking, asking  # close waited for it
        finally:
            lost.proc.send_signal(signal.SIGCONT)
    assert errors == []
