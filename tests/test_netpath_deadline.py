"""The network data path's calls have one deadline for all of their bytes, and a link probe
keeps to its budget, against a real server whose egress cap makes a slow link."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kdn.client import Client
from kdn.client.probe import SIZES, _entry, probe_key, probe_link
from kdn.errors import DeadlineExceeded
from kdn.server import ServerConfig, ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=2, heads=8, dim=64)  # 4 KiB a token
RATE = 20_000  # bytes/s
TOKENS = 64  # 256 KiB an entry: 13 s at RATE


def _within(seconds: float, call: Any) -> Any:
    """``call()``'s result or the error it raised, failing the test where it takes longer
    than ``seconds`` (the call is left running on a daemon thread)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["r"] = call()
        except Exception as exc:
            out["r"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still running after {seconds} s"
    return out["r"]


@pytest.fixture
def slow(server_config: ServerConfig) -> Iterator[ServerThread]:
    with ServerThread(dataclasses.replace(server_config, egress_bytes_per_s=RATE)) as st:
        yield st


@pytest.mark.parametrize("keys", [1, 2], ids=["get_many", "start_get_many"])
def test_a_trickled_answer_fails_at_the_calls_deadline(slow: ServerThread, keys: int) -> None:
    """Bytes keep coming (no single receive waits 1.5 s), yet the read ends at 1.5 s."""
    with Client(slow.address, timeout_s=1.5, shm_bytes=0) as c:
        ks = [numbered_key(i) for i in range(keys)]
        for i, k in enumerate(ks):
            c.store(k, random_kv(LAYOUT, TOKENS, seed=i), mode="raw")

        def read() -> Any:
            streams = c.retrieve_streams(ks, layout=LAYOUT)
            return [s.result() for s in streams if s is not None]

        t0 = time.monotonic()
        got = _within(8, read)
        assert isinstance(got, DeadlineExceeded), got
        assert time.monotonic() - t0 < 4


def test_a_probe_of_a_slow_link_keeps_to_its_budget(slow: ServerThread) -> None:
    """An 8 MiB probe entry would take 7 minutes at 20 KB/s: the probe ends within its 2 s
    budget and reports the link slower than the entry's size over the budget spent."""
    with Client(slow.address, timeout_s=None, shm_bytes=0) as c:
        for n in SIZES:  # stored by an earlier probe: only the reads are timed here
            c.store(probe_key(n), _entry(n), mode="raw")
        t0 = time.monotonic()
        probe = _within(10, lambda: probe_link(c, budget_s=2.0))
        assert time.monotonic() - t0 < 5
        assert probe is not None
        assert RATE / 2 < probe.bytes_per_s < 2 * SIZES[0] / 1.0  # slower than 8 MiB a second
