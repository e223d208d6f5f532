"""The token-level metrics an operator charts (tokens stored and served by tier, tenant and
model; entries hit and missed; bytes by encoding; tier read latency), counted exactly on a
real server through each read path (the Retrieve stream and GetMany), and the request id on
the server's own log lines."""

from __future__ import annotations

import logging
import re
import urllib.request
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

LAY = uniform_layout(layers=2, heads=2, dim=8, model="model-a")


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels}")


def test_tokens_and_entries_are_counted_on_every_read_path(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", metrics_port=0)
    a, b = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    with ServerThread(cfg) as st:
        with Client(st.address, shm_bytes=0) as c:
            c.store(a, random_kv(LAY, 8), mode="raw")
            c.store(b, random_kv(LAY, 4), mode="lossless")
            assert c.retrieve_stream(a).result() is not None  # the Retrieve stream
            assert c.retrieve(b) is not None  # GetMany
            assert c.retrieve(keys.chunk_key([3], LAY)) is None  # a miss
        assert st.server is not None
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    assert _sample(text, "kdn_tokens_stored_total", tenant="", model="model-a") == 12
    assert _sample(text, "kdn_tokens_served_total", tier="ram", model="model-a") == 12
    assert _sample(text, "kdn_entries_requested_total", result="hit") == 2
    assert _sample(text, "kdn_entries_requested_total", result="miss") == 1
    assert _sample(text, "kdn_bytes_stored_total", encoding="raw") > 0
    assert _sample(text, "kdn_bytes_served_total", encoding="lossless") > 0
    assert _sample(text, "kdn_tier_read_seconds_count", tier="ram") == 2


def test_log_lines_carry_the_request_id(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    from kdn.server.logs import JsonLines, _RequestId

    with caplog.at_level(logging.INFO, logger="kdn.access"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as st:
            with Client(st.address) as c:
                c.lookup([keys.chunk_key([1], LAY)], request_id="req-1234")
    records = [r for r in caplog.records if r.name == "kdn.access"]
    assert records
    record = records[-1]
    _RequestId().filter(record)  # the handler's filter: the id of the call being served
    import json

    line = json.loads(JsonLines().format(record))
    assert line["rpc"] == "Lookup" and line["request_id"] == "req-1234"
    assert line["logger"] == "kdn.access" and "msg" not in line  # fields merged, not quoted
