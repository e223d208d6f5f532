"""A Redis Cluster master that is stopped (SIGSTOP: a hung host, a partition that drops
packets) while the Redis tier starts or closes, with real redis-server processes. The tier
starts with the other masters' slots serving, even where redis-py's client would first ask the
stopped master (it learns the commands' key positions from one random master as it starts),
and closing it while its watcher is asking the stopped master ends with no error on any
thread. A write reported failed that a stopped master runs once it goes on is withdrawn,
though another unanswered write's master is dead for good, and a batch read serves the keys of
the masters that answer beside a key whose write is not settled."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis.cluster

from kdn.errors import PartlyUnavailable
from kdn.store.redis import RedisTier
from tests.helpers import eventually, sigstop
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


def _keys_of(tier: RedisTier, masters: list[str]) -> list[bytes]:
    """One key per master in ``masters``, in that order."""
    ks = [b"default/%064x" % i for i in range(300)]
    return [next(k for k in ks if tier._master_of(k) == m) for m in masters]  # noqa: SLF001


def test_a_write_reported_failed_is_withdrawn_while_another_master_is_dead(
        tmp_path: Path) -> None:
    """Two writes got no answer: one to a master killed for good, one to a master stopped
    (SIGSTOP) that runs its commit once it goes on. The health probes withdraw the second
    (another server sharing the cluster does not read it), though the first's stays."""
    with RedisCluster3(tmp_path / "c") as cluster:
        writer = RedisTier(cluster.urls, cluster=True, timeout_s=0.5)
        other = RedisTier(cluster.urls, cluster=True, timeout_s=0.5)
        try:
            dead, hung = (cluster.nodes[0], cluster.nodes[1])
            assert hung.proc is not None
            ka, kb = _keys_of(writer, [f"127.0.0.1:{dead.port}", f"127.0.0.1:{hung.port}"])
            dead.kill()
            with pytest.raises(PartlyUnavailable):
                writer.put(ka, b"a" * 1000)
            writer.put(kb, b"warm")  # a pooled connection to it, as under load
            sigstop(hung.proc.pid)
            try:
                with pytest.raises(PartlyUnavailable):
                    writer.put(kb, b"b" * 1000)
            finally:
                hung.proc.send_signal(signal.SIGCONT)  # it runs the commit it had queued
            assert eventually(lambda: writer.healthy() and kb not in writer._unsure,  # noqa: SLF001
                              timeout=5)
            assert other.get(kb) is None
            assert ka in writer._unsure  # noqa: SLF001  (its master is gone: next probe)
        finally:
            writer.close()
            other.close()


def test_get_many_serves_the_other_masters_keys_beside_an_unsettled_write(
        tmp_path: Path) -> None:
    """A write to a master killed mid-way (no answer) leaves its key unsettled; a batch read
    that names it reads it as absent and serves the keys of the masters that answer."""
    with RedisCluster3(tmp_path / "c") as cluster:
        tier = RedisTier(cluster.urls, cluster=True, timeout_s=0.5)
        try:
            dead = cluster.nodes[0]
            ka, kb = _keys_of(tier, [f"127.0.0.1:{n.port}" for n in cluster.nodes[:2]])
            tier.put(kb, b"b" * 5000)
            dead.kill()
            with pytest.raises(PartlyUnavailable):
                tier.put(ka, b"a" * 5000)
            assert tier.get_many([ka, kb]) == [None, b"b" * 5000]
        finally:
            tier.close()
