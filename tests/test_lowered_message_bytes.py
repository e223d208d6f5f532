"""Entries stored under a larger ``max_message_bytes`` stay readable over gRPC once it is
lowered: frames past a message are cut into pieces where the reader takes pieces (fetch),
and a read that takes whole frames only (a layer stream, RetrieveMany) is refused by name
(TooLarge naming the setting), with no server traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kdn.client import Client
from kdn.errors import TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=2, heads=2, dim=64)


def _config(tmp_path: Path, **kw: int) -> ServerConfig:
    return ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=64 << 20,
                        disk_bytes=64 << 20, shutdown_grace_s=0.5, **kw)


def test_frames_past_a_lowered_message_bound_come_in_pieces_or_a_named_refusal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stored = {}
    with ServerThread(_config(tmp_path)) as st, Client(st.address) as c:
        for i in (1, 2):  # one frame of ~256 KiB each
            c.store(numbered_key(i), random_kv(LAYOUT, 256, seed=i), mode="raw",
                    layers_per_frame=2)
            got = c.fetch(numbered_key(i))
            assert got is not None
            stored[i] = got.parts.to_bytes()
    caplog.set_level(logging.WARNING)
    with ServerThread(_config(tmp_path, max_message_bytes=128 << 10)) as st, \
            Client(st.address, shm_bytes=0, data_path=False, retry=None) as c:
        got = c.fetch(numbered_key(1))  # GetMany leaves it out; Retrieve in pieces
        assert got is not None and got.parts.to_bytes() == stored[1]
        for read in (lambda: c.fetch_many([numbered_key(1), numbered_key(2)]),  # RetrieveMany
                     lambda: c.retrieve_stream(numbered_key(1), first_layer=1).result()):
            with pytest.raises(TooLarge, match="max_message_bytes"):  # whole frames only
                read()
    with ServerThread(_config(tmp_path, max_message_bytes=16 << 10)) as st, \
            Client(st.address, shm_bytes=0, data_path=False, retry=None) as c:
        with pytest.raises(TooLarge, match=r"max_message_bytes \(16384\)"):
            c.fetch(numbered_key(1))  # no piece fits
    assert "Traceback" not in caplog.text and not any(
        r.exc_info for r in caplog.records)
