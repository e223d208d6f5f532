from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, Arena


def _order_seed(config: pytest.Config) -> int | None:
    """pytest-randomly's seed when it shuffled this run (None: the plugin is off, ``-p
    no:randomly``, or keeps the files' order, ``--randomly-dont-reorganize``)."""
    if not config.pluginmanager.hasplugin("randomly"):
        return None
    if not config.getoption("randomly_reorganize", True):
        return None
    seed = config.getoption("randomly_seed", None)
    return seed if isinstance(seed, int) else None


def _say_order(config: pytest.Config, write: Callable[[str], object]) -> None:
    seed = _order_seed(config)
    if seed is not None:
        write(f"test order: shuffled by pytest-randomly; rerun it with -p randomly "
              f"--randomly-seed={seed}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Say the seed of a shuffled order first: pytest-randomly's own line is a report header,
    which ``-q`` (scripts/test.sh) does not print."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        _say_order(session.config, reporter.write_line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """And again beside the failures, where a failure that depends on the order is read."""
    _say_order(terminalreporter.config, terminalreporter.write_line)


@pytest.fixture
def server_config(tmp_path: Path, request: pytest.FixtureRequest) -> ServerConfig:
    """Marked ``no_arena``: the server keeps no read arenas, so same-host reads are copied into
    the client's segment (the path of entries outside the RAM tier and of a full arena;
    kdn.server.arena)."""
    config = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=256 << 20,
                          disk_bytes=512 << 20, shutdown_grace_s=2.0)
    if request.node.get_closest_marker("no_arena"):
        return dataclasses.replace(config, shm_arena_bytes=0)
    return config


@pytest.fixture
def server(server_config: ServerConfig) -> Iterator[ServerThread]:
    with ServerThread(server_config) as st:
        yield st


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    c = Client(server.address, timeout_s=30)
    yield c
    c.close()


@pytest.fixture
def shm_client(server: ServerThread) -> Iterator[Client]:
    """A client of ``server`` with an 8 MiB shared segment (the same-host data plane)."""
    c = Client(server.address, timeout_s=30, shm_bytes=8 << 20)
    yield c
    c.close()


@pytest.fixture
def remote(server: ServerThread) -> Iterator[Client]:
    """A client as one on another host meets the server: no shared segment (its batches go
    over the network data path)."""
    c = Client(server.address, timeout_s=30, shm_bytes=0)
    yield c
    c.close()


@pytest.fixture
def arena() -> Iterator[Arena]:
    """A read arena of 16 pages, alone (no server)."""
    a = Arena("t", 16 * PAGE)
    yield a
    a.close()
