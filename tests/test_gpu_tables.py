"""The GPU planner's entropy tables decompressed by its compiled code through the system's
libzstd (``gpu_plan.inflate``, on the staging threads) or, where there is none, through
``zstandard`` (``gpu_batch._tables(..., zstd=False)``): the same staged plan byte for byte, and
damaged tables refused by both; and what the host stages grows with blobs and rANS groups,
not with table rows (the device lays those out). Kernels are not launched
(``gpu_batch._launch`` stubbed): what is compared is everything the host stages for them."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from kdn import codec
from kdn.codec import entropy, gpu_batch, gpu_source
from kdn.codec import gpu_plan as plan
from kdn.codec.api import entry_bodies, record_specs
from kdn.codec.format import check_frame, parse_container
from kdn.codec.modes import get_mode, pack_sections, unpack_sections
from kdn.errors import Corrupt
from tests.helpers import pruned_layout, random_kv, uniform_layout

pytestmark = pytest.mark.skipif(not plan.HAVE_ZSTD, reason="no libzstd on this system")


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels not launched; staging zeroed first (its alignment padding is never written)."""
    monkeypatch.setattr(gpu_batch, "_launch", lambda *a, **k: None)
    arrays = gpu_batch.Staging.arrays

    def zeroed(self: Any) -> Any:
        out = arrays(self)
        self.host.zero_()
        return out

    monkeypatch.setattr(gpu_batch.Staging, "arrays", zeroed)


def _bodies(blobs: list[bytes]) -> tuple[list[memoryview], list[Any]]:
    bodies, specs = [], []
    for blob in blobs:
        c = parse_container(blob, verify=False)
        recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
        bodies += [r.body for r in recs]
        specs += record_specs(c.header.layout, recs)
    return bodies, specs


def _staged(bodies: list[memoryview], specs: list[Any], level: str, zstd: bool,
            monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Every byte the host stages for the kernels (the tables, and the per-blob, per-group and
    sink span arrays it uploads), with the tables decompressed one way."""
    monkeypatch.setattr(plan, "HAVE_ZSTD", zstd)
    done = get_mode("kdn").decode_layers(bodies, specs, level, torch.device("cpu"))
    staged = bytes(done.keep[2].numpy())  # the staging buffer (Staging.host)
    dev = done.keep[3]  # the device arrays by name: those the kernels write are left out
    staged += b"".join(bytes(dev[name].numpy()) for name in sorted(dev)
                       if name not in _WRITTEN and not name.endswith(("coded", "c_blob",
                                                                      "c_row")))
    done.check()
    return staged


_WRITTEN = {"lo", "width", "tstart", "depth", "csrc", "flag"}


def test_libzstd_and_zstandard_stage_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = []
    for i, (lay, level) in enumerate([(uniform_layout(3, 2, 8), "default"),
                                      (pruned_layout(), "high"),
                                      (uniform_layout(2, 4, 16), "near-lossless")]):
        for fmt in (2, 3, 4):  # every table layout the planner reads
            with entropy.writing_format(fmt):
                blob = codec.encode(random_kv(lay, 37 + 11 * i, seed=fmt + 3 * i), "kdn", level)
            entries.append((level, blob))
    for level, blob in entries:
        bodies, specs = _bodies([blob])
        a = _staged(bodies, specs, level, True, monkeypatch)
        b = _staged(bodies, specs, level, False, monkeypatch)
        assert a == b and any(a), level
    # several entries of one level in one decode, as a hit on a context's blocks
    same = [blob for level, blob in entries if level == "default"]
    bodies, specs = _bodies(same)
    assert _staged(bodies, specs, "default", True, monkeypatch) == \
        _staged(bodies, specs, "default", False, monkeypatch)


def test_damaged_tables_end_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes of a blob's zstd frame of tables changed or cut: both ways refuse it, or both
    stage the same plan (a change zstd can not see decodes to other tables)."""
    import numpy as np

    rng = np.random.default_rng(3)
    blob = codec.encode(random_kv(uniform_layout(3, 2, 8), 40, seed=5), "kdn", "default")
    clean, specs = _bodies([blob])
    outcomes = {"refused": 0, "planned": 0}
    for case in range(40):
        bodies = list(clean)
        i = int(rng.integers(0, len(bodies)))
        secs = [bytearray(x) for x in unpack_sections(bytes(bodies[i]), 4, "test")]
        sym = secs[2 + case % 2]  # mark | tables length | codes length | zstd(tables) | ...
        tlen = struct.unpack_from("<I", sym, 4)[0]
        frame = bytearray(sym[12 : 12 + tlen])
        if case % 3 == 2:  # cut short, the blob's lengths kept consistent
            frame = frame[: int(rng.integers(6, len(frame)))]
        else:
            for _ in range(1 + case % 3):
                at = int(rng.integers(0, len(frame)))
                frame[at] ^= int(rng.integers(1, 256))
        sym[12 : 12 + tlen] = frame
        struct.pack_into("<I", sym, 4, len(frame))
        bodies[i] = memoryview(pack_sections([bytes(x) for x in secs]))
        got = []
        for zstd in (True, False):
            try:
                got.append(_staged(bodies, specs, "default", zstd, monkeypatch))
            except Corrupt as exc:
                got.append(type(exc).__name__)
        assert got[0] == got[1], (case, got[0] if isinstance(got[0], str) else "planned",
                                  got[1] if isinstance(got[1], str) else "planned")
        outcomes["refused" if got[0] == "Corrupt" else "planned"] += 1
    assert outcomes["refused"] >= 20, outcomes


def test_the_host_stages_per_blob_and_group_not_per_table_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry of wide layers (8 heads x 128 channels: 2,048 table rows a symbols' blob):
    beyond the decompressed tables, the host stages under 2 bytes a row (per-blob descriptors,
    rANS groups of 32 streams, sink spans); laying out each row on the host cost 28."""
    seen = {"staged": 0, "uploaded": 0}
    send, upload = gpu_batch.Staging.send, gpu_batch.upload_many

    def sent(self: Any) -> Any:
        seen["staged"] += self.total
        return send(self)

    def uploaded(host: dict[str, Any], device: Any) -> Any:
        seen["uploaded"] += sum(a.nbytes for a in host.values())
        return upload(host, device)

    monkeypatch.setattr(gpu_batch.Staging, "send", sent)
    monkeypatch.setattr(gpu_batch, "upload_many", uploaded)
    for level in ("default", "high"):
        blob = codec.encode(random_kv(uniform_layout(4, 8, 128), 40, seed=9), "kdn", level)
        bodies, specs = _bodies([blob])
        seen.update(staged=0, uploaded=0)
        done = get_mode("kdn").decode_layers(bodies, specs, level, torch.device("cpu"))
        done.check()
        rows = 4 * (2 + 2 * 8 * 128)  # a log-scale row per K and V, a row per head channel
        assert seen["staged"] >= 4 * rows  # the tables: lo and width, u16 each, a row
        extra = seen["staged"] - 4 * rows + seen["uploaded"]
        assert extra < 2 * rows + 4096, (level, extra, rows)


def test_entries_viewed_apart_in_one_buffer_are_planned_where_they_lie(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read arena gives each entry as an array of its own over its one mapping: the
    planner reads a context's bodies there (a 780 MB copy at 32k tokens of 8B shape when it
    took them for bodies of several buffers), and its plan is the one of bodies given as
    views of one buffer."""
    import numpy as np

    monkeypatch.setattr(gpu_source, "DIRECT", {"cuda", "cpu"})  # pinned bodies as on a GPU
    blobs = [codec.encode(random_kv(uniform_layout(3, 2, 8), 30 + e, seed=e), "kdn", "default")
             for e in range(3)]
    gap = 3 * gpu_source.SPAN_GAP + (2 << 20)  # far apart: not one span, copied a run each
    one = bytearray(sum(len(b) + gap for b in blobs))
    arena = np.frombuffer(one, np.uint8)
    plans = {}
    for how in ("arena views", "views of one buffer"):
        bodies, addresses, specs, at = [], [], [], 0
        for b in blobs:
            one[at : at + len(b)] = b
            view = (memoryview(arena[at : at + len(b)]) if how == "arena views"
                    else memoryview(one)[at : at + len(b)])
            c = parse_container(view, verify=False)
            got = entry_bodies(c.header, c.frames, hashed=True)
            bodies += got.bodies
            addresses += got.addresses
            specs += got.specs
            at += len(b) + gap
        source = gpu_source.Source(bodies, torch.device("cpu"), True, addresses=addresses)
        assert source.array.ctypes.data == arena.ctypes.data, how  # no copy: read in place
        assert len(source.host) == len(blobs)  # a device copy per entry
        plans[how] = _staged(bodies, specs, "default", True, monkeypatch)
    assert plans["arena views"] == plans["views of one buffer"]
