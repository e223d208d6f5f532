from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from kdn.server.arena import PAGE, Arena


@pytest.fixture
def server_config(tmp_path: Path) -> ServerConfig:
    return ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=256 << 20,
                        disk_bytes=512 << 20, shutdown_grace_s=2.0)


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
def arena() -> Iterator[Arena]:
    """A read arena of 16 pages, alone (no server)."""
    a = Arena("t", 16 * PAGE)
    yield a
    a.close()
