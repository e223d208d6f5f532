"""A Redis tier put back after a run of the disk tier without it is named at start (it missed
that run's overwrites and deletes); a Redis tier added for the first time, or kept, is not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kdn.server import ServerConfig, ServerThread
from tests.redis_servers import RedisServer

ALARM = "missed that run's overwrites and deletes"


def _started(caplog: pytest.LogCaptureFixture, **kw: object) -> bool:
    """Whether a server of ``kw`` named its Redis tier at start."""
    caplog.clear()
    with ServerThread(ServerConfig(port=0, ram_bytes=16 << 20, disk_bytes=16 << 20,
                                   shutdown_grace_s=0.2, **kw)):  # type: ignore[arg-type]
        pass
    return ALARM in caplog.text


def test_a_redis_tier_back_after_a_run_without_it_is_named_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="kdn.server.tier_history")
    data = tmp_path / "d"
    with RedisServer(tmp_path / "r") as rs:
        on = {"data_dir": data, "redis_url": rs.url}
        off = {"data_dir": data, "redis_url": "", "tier_order": ("ram", "disk")}
        assert not _started(caplog, **off)  # a disk without a Redis tier yet
        assert not _started(caplog, **on)  # a Redis tier added: it missed nothing of its own
        assert not _started(caplog, **on)  # kept
        assert not _started(caplog, **off)
        assert _started(caplog, **on)  # back: it missed the last run's writes
        assert not _started(caplog, **on)  # named once
        other = {"data_dir": tmp_path / "e", "redis_url": rs.url}  # a fleet's other server
        assert not _started(caplog, **other)
        assert not _started(caplog, **on)
