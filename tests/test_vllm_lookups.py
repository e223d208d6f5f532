"""The kdn vLLM connector's lookups against a server that stops answering (a stall, not a
refused connection): each has ``lookup_timeout_s``, and once one passes it, lookups answer
misses at once for a back-off, so waiting requests are not held one deadline each (vLLM's
classes and the replay of ``tests.test_vllm``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config infers a platform
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kdn.integrations.vllm_scheduler import BACKOFF_TIMES  # noqa: E402
from kdn.server import ServerThread  # noqa: E402
from kdn.server.app import build_store  # noqa: E402
from kdn.server.config import ServerConfig  # noqa: E402
from tests.helpers import eventually  # noqa: E402
from tests.test_vllm import both, prompt  # noqa: E402
from tests.vllm_replay import Replay  # noqa: E402


def test_a_silent_server_holds_waiting_requests_one_lookup_deadline_at_most(
        tmp_path: Path) -> None:
    """Eight requests, one lookup thread, a server that holds every Lookup: the first lookup
    fails after lookup_timeout_s, the others answer 0 at once (each waited its own deadline
    behind the others': 8 x 0.3 s); after the back-off the server is asked again."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20, disk_bytes=0,
                       shutdown_grace_s=1.0)
    store = build_store(cfg)
    gate = threading.Event()
    asked: list[float] = []
    real = store.lookup

    def held(skeys: Any) -> Any:
        asked.append(time.monotonic())
        gate.wait(30)
        return real(skeys)

    store.lookup = held  # type: ignore[method-assign]
    with ServerThread(cfg, store) as st:
        s, w = both(st.address, encodings=["raw"], lookup_threads=1, lookup_timeout_s=0.3,
                    timeout_s=10.0)
        try:
            reqs = [Replay.new_request(None, f"r{i}", prompt(30 + i, 17))  # type: ignore[arg-type]
                    for i in range(8)]
            t0 = time.monotonic()
            waiting = list(reqs)
            while waiting and time.monotonic() - t0 < 10:
                waiting = [r for r in waiting if s.get_num_new_matched_tokens(r, 0)[0] is None]
                time.sleep(0.01)
            took = time.monotonic() - t0
            assert not waiting and took < 1.2, took
            assert len(asked) == 1
            gate.set()
            assert eventually(lambda: time.monotonic() - t0 > (BACKOFF_TIMES + 2) * 0.3, 10)
            assert len(asked) == 1
            late = Replay.new_request(None, "late", prompt(40, 17))  # type: ignore[arg-type]
            assert eventually(lambda: s.get_num_new_matched_tokens(late, 0)[0] == 0, 10)
            assert len(asked) == 2  # the server is asked again
        finally:
            gate.set()
            s.shutdown()
            w.shutdown()


def test_a_stopped_server_is_one_warning_then_one_info_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server that refuses connections (stopped: UNAVAILABLE, at once) is said once: each of
    20 requests logged a WARNING; once it answers again (started again on its port), one INFO
    line."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20, disk_bytes=0,
                       shutdown_grace_s=1.0)
    with ServerThread(cfg) as st:
        s, w = both(st.address, encodings=["raw"], lookup_threads=1, lookup_timeout_s=0.3,
                    timeout_s=5.0)
        port = int(st.address.rsplit(":", 1)[1])
    try:
        with caplog.at_level(logging.INFO, logger="kdn.integrations"):
            t0 = time.monotonic()
            for i in range(20):
                r = Replay.new_request(None, f"r{i}", prompt(30 + i, 17))  # type: ignore[arg-type]
                assert eventually(lambda r=r: s.get_num_new_matched_tokens(r, 0)[0] == 0, 10)
            assert time.monotonic() - t0 < 5  # refused at once
            warned = [x for x in _kdn(caplog) if x.levelno >= logging.WARNING]
            assert len(warned) == 1 and "UNAVAILABLE" in warned[0].getMessage()
            with ServerThread(dataclasses.replace(cfg, port=port)):
                late = iter(range(1000))

                def back() -> bool:  # a new request each time: each is looked up once
                    r = Replay.new_request(None, f"late{next(late)}",  # type: ignore[arg-type]
                                           prompt(60, 17))
                    eventually(lambda: s.get_num_new_matched_tokens(r, 0)[0] is not None, 5)
                    return any("answers lookups again" in x.getMessage() for x in _kdn(caplog))
                assert eventually(back, 20)
        assert [x.levelno for x in _kdn(caplog) if x.levelno > logging.INFO] == [logging.WARNING]
    finally:
        s.shutdown()
        w.shutdown()


def _kdn(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [x for x in caplog.records if x.name.startswith("kdn.")]
