"""kdn.ratelog: a failure repeated on every call is one line, then one per interval naming how
many went unsaid; a peer that answers again is one INFO line."""

from __future__ import annotations

import logging

import pytest

from kdn import ratelog
from kdn.ratelog import Outage, Throttle

log = logging.getLogger("kdn.test_ratelog")


def test_a_kind_is_admitted_once_per_interval_and_counts_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    t = Throttle(10.0)
    assert t.admit("a") == 0 and t.admit("b") == 0  # kinds apart
    assert [t.admit("a") for _ in range(3)] == [None] * 3
    now[0] += 10.0
    assert t.admit("a") == 3 and t.admit("a") is None
    assert t.clear() == 1 and t.clear() is None
    assert t.admit("a") == 0  # a new run: said at once


def test_an_outage_is_one_warning_a_minute_then_one_info_line_when_it_ends(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    out = Outage(log, "peer answers again")
    caplog.set_level(logging.DEBUG, logger=log.name)
    out.answered()  # nothing failed: nothing to say
    for i in range(50):
        out.failed("call %d failed", i)
    out.failed("store failed", kind="store")  # another kind: said apart
    now[0] += ratelog.EVERY_S
    out.failed("call %d failed", 50)
    out.answered()
    out.answered()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert lines == [("WARNING", "call 0 failed"), ("WARNING", "store failed"),
                     ("WARNING", "call 50 failed (49 more such failures since the last warning)"),
                     ("INFO", "peer answers again")]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 49
