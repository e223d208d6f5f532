"""The kdn HiCache backend's host indices and its quiet paths, against a real kdn server: a page
whose host indices do not name one whole page of the host pool is refused alone (never a short
or wrong page stored under its key), a server that is down is a warning without a traceback
(one per kind of call, not one per batch), and reading a ``raw`` page prints no torch warning.

Skipped when sglang is not installed (``scripts/bootstrap.sh test`` installs it).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from bench.sglang import HostPool, kdn_backend  # noqa: E402
from kdn.errors import InvalidArgument  # noqa: E402
from kdn.server import ServerThread  # noqa: E402

SMALL = {"layers": 3, "heads": 2, "head_dim": 16, "page_size": 4}
KEYS = [f"{j:02d}" + "cd" * 31 for j in range(4)]  # SGLang's page keys are hex digests


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_host_indices_outside_one_whole_page_are_refused_alone(
        server: ServerThread, layout: str, caplog: pytest.LogCaptureFixture) -> None:
    """Indices past the pool's end (a 2-token view), off a page boundary (page_first_direct
    stored page 0 for them) or not consecutive: that page is False, nothing stored under its
    key, the batch's good page stored; a read into such indices writes nothing."""
    src = HostPool(layout, 16, seed=7, **SMALL)  # type: ignore[arg-type]  # 64 slots
    dst = HostPool(layout, 16, **SMALL)  # type: ignore[arg-type]
    a, b = kdn_backend(src, server.address), kdn_backend(dst, server.address)
    try:
        bad = [torch.arange(62, 66), torch.arange(2, 6), torch.tensor([8, 9, 11, 10]),
               torch.arange(-4, 0)]
        for idx in bad:
            with caplog.at_level(logging.ERROR, logger="kdn.integrations.sglang"):
                got = a.batch_set_v1([KEYS[0], KEYS[1]], torch.cat([src.indices([3]), idx]))
            assert got == [True, False], idx
            assert "consecutive slots from a page boundary" in caplog.text
            assert b.batch_exists([KEYS[1]]) == 0
        before = dst.kv_buffer.clone()
        assert b.batch_get_v1([KEYS[0]], torch.arange(62, 66)) == [False]
        assert torch.equal(dst.kv_buffer.view(torch.int16), before.view(torch.int16))
        assert b.batch_get_v1([KEYS[0]], dst.indices([5])) == [True]
        assert torch.equal(dst.kv_of(5), src.kv_of(3))
        pages = a._need_pages()
        with pytest.raises(InvalidArgument, match="does not hold 4 tokens"):
            pages.encode(pages.pool_page(0)[:, :, :, :2])
    finally:
        a.close()
        b.close()


def test_a_write_with_the_server_down_is_one_warning_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = HostPool("page_first", 8, seed=8, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, "127.0.0.1:1", timeout_s=2.0, shm_bytes=0)  # nothing listens there
    try:
        with caplog.at_level(logging.INFO, logger="kdn.integrations.sglang"):
            assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
        logged = [r for r in caplog.records if r.name == "kdn.integrations.sglang"]
        assert logged and all(r.levelno == logging.WARNING and not r.exc_info for r in logged)
    finally:
        b.close()


def test_a_server_down_is_one_warning_per_kind_of_call_not_one_per_batch(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every batch SGLang asked about logged a WARNING while the server was down (prefetch and
    backup run all the time: lines without end); now one per kind of call, the rest at DEBUG."""
    pool = HostPool("layer_first", 4, seed=6, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, "127.0.0.1:1", timeout_s=2.0)  # nothing listens there
    try:
        with caplog.at_level(logging.DEBUG, logger="kdn.integrations"):
            for _ in range(10):
                assert b.batch_exists(KEYS[:2]) == 0
                assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                  and r.name.startswith("kdn.")]
        assert len(warned) == 2 and "lookup of 2 pages failed" in warned[0], warned
        assert "storing 2 pages failed" in warned[1]
        assert b.stats().errors == 20  # every one counted still
    finally:
        b.close()


def test_a_raw_page_read_prints_no_torch_warning(server: ServerThread,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``raw`` pages read from the in-process tier are read-only bytes viewed by torch only as
    copy sources: torch's "not writable" warning is not the engine's to see. (Torch gives it
    once a process, and this process's server may have had it first: so each view of a
    read-only array is checked to be made where the warning is ignored.)"""
    views: list[bool] = []  # per view of a read-only array: whether its warning was shown
    made = torch.from_numpy

    def from_numpy(a: np.ndarray) -> torch.Tensor:
        if not a.flags.writeable:
            with warnings.catch_warnings(record=True) as got:
                warnings.warn("not writable", UserWarning, stacklevel=1)
            views.append(bool(got))
        return made(a)

    pool = HostPool("layer_first", 8, seed=9, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address, namespace="quiet", local_bytes=1 << 20)
    try:
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            monkeypatch.setattr(torch, "from_numpy", from_numpy)
            assert b.batch_get_v1(KEYS[:2], pool.indices([4, 5])) == [True, True]
            monkeypatch.undo()
        assert views and not any(views)
        assert torch.equal(pool.kv_of(4), pool.kv_of(0))
    finally:
        b.close()


def test_clear_drops_the_pages_of_the_in_process_tier(server: ServerThread) -> None:
    """``clear`` with ``local_bytes`` on: a page the server no longer holds (deleted by
    another client, or evicted) but the in-process tier still does is gone too (``ls`` on the
    server did not find it, and exists and batch_get_v1 went on reading it after clear)."""
    from kdn.client.admin import AdminClient

    pool = HostPool("page_first", 16, seed=3, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address, namespace="cleared", local_bytes=1 << 20)
    try:
        assert b.batch_set_v1(KEYS, pool.indices([0, 1, 2, 3])) == [True] * 4
        with AdminClient(server.address) as other:
            assert other.delete([b.kdn_key(KEYS[1])], namespace="cleared") == 1
        assert b.exists(KEYS[1])  # the in-process tier's copy
        assert b.clear() is True
        assert [b.exists(k) for k in KEYS] == [False] * 4
        assert b.batch_get_v1(KEYS[1:2], pool.indices([5])) == [False]
        assert b.client.local is not None and b.client.local.stats.entries == 0
    finally:
        b.close()
