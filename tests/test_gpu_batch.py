"""The whole-entry GPU decoder (kdn.codec.gpu_batch) against the CPU decoders, under Triton's
interpreter (exact, slow: small entries): the same bytes give bit-identical tensors in every
dtype and layout, damaged bytes raise Corrupt exactly where the CPU decoder does, and an entry
of 32 layers costs a fixed number of launches and no host synchronisation before its check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import numpy as np, torch
    from helpers import pruned_layout, random_kv, uniform_layout
    from kdn import codec
    from kdn.cache import KVCache
    from kdn.codec import gpu_batch
    from kdn.codec.api import layer_spec
    from kdn.codec.format import check_frame, parse_container
    from kdn.codec.modes import get_mode
    from kdn.errors import Corrupt
    from kdn.layout import DType

    def same(a, b):
        for (k1, v1), (k2, v2) in zip(a.layers, b.layers, strict=True):
            assert k1.dtype == k2.dtype and k1.shape == k2.shape, (k1.shape, k2.shape)
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    def records(blob):
        c = parse_container(blob, verify=False)
        return c.header, [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
''')

_IDENTICAL = _PRELUDE + textwrap.dedent('''
    cases = [(uniform_layout(3, 2, 8), 40, "kdn", "default"),
             (pruned_layout(), 37, "kdn", "high"),
             (uniform_layout(2, 2, 8, DType.BFLOAT16), 21, "kdn", "default"),
             (uniform_layout(2, 2, 8, DType.FLOAT32), 20, "kdn", "tiny"),
             (uniform_layout(2, 1, 4), 1, "kdn", "default"),  # the sink token only
             (uniform_layout(3, 2, 8), 40, "int8", ""),
             (pruned_layout(DType.BFLOAT16), 33, "int8", "")]
    checked = 0
    for lay, tokens, mode, level in cases:
        kv = random_kv(lay, tokens, seed=checked)
        blob = codec.encode(kv, mode, level, layers_per_frame=2)
        same(codec.decode(blob), codec.decode(blob, batched=True))
        checked += 1
    # constant rows: a channel that never changes, and a layer whose tokens are all the same
    # (its log-scale rows are constant too): no coded stream, filled instead
    lay = uniform_layout(2, 2, 8)
    kv = random_kv(lay, 30, seed=7)
    k0, v0 = kv.layers[0]
    k0[:, :, 3] = 0.5
    v0[1, :, :] = 0.0
    k1, v1 = kv.layers[1]
    kv.layers[1] = (k1[:, :1].repeat(1, 30, 1).contiguous(),
                    v1[:, :1].repeat(1, 30, 1).contiguous())
    for mode, level in (("kdn", "default"), ("kdn", "near-lossless"), ("int8", "")):
        blob = codec.encode(kv, mode, level)
        same(codec.decode(blob), codec.decode(blob, batched=True))
        checked += 1
    # pruned to a few values per token (1 head x 1 channel...): steps capped at the largest |x|
    from kdn.layout import KVLayout, LayerLayout
    lay = KVLayout("pruned-small", (LayerLayout(1, 1, 1), LayerLayout(2, 1, 2),
                                    LayerLayout(1, 2, 1)), head_dim=2)
    blob = codec.encode(random_kv(lay, 24, seed=5), "kdn", "tiny")
    same(codec.decode(blob), codec.decode(blob, batched=True))
    checked += 1
    # entries written before format 4 (format 3: codes inside zstd; format 2: exact counts)
    # still decode on the device, alone and beside format-4 ones in one decode
    from kdn.codec import entropy
    from kdn.codec.modes import unpack_sections
    lay = pruned_layout()
    entries = []
    for fmt in (2, 3, 4):
        with entropy.writing_format(fmt):
            blob = codec.encode(random_kv(lay, 29, seed=11 + fmt, start=29 * fmt), "kdn",
                                "default")
        body = records(blob)[1][0].body  # its symbols' blob names its format first
        sym_blob = bytes(unpack_sections(body, 4, "test")[3])
        assert entropy.FORMAT_OF_MARK[int.from_bytes(sym_blob[:4], "little")] == fmt
        same(codec.decode(blob), codec.decode(blob, batched=True))
        entries.append(blob)
        checked += 1
    bodies, specs, want = [], [], []
    for blob in entries:
        header, recs = records(blob)
        bodies += [memoryview(r.body) for r in recs]
        specs += [layer_spec(header.layout, r.layer, r.tokens) for r in recs]
        want += codec.decode(blob).layers
    got = get_mode("kdn").decode_layers(bodies, specs, "default", torch.device("cpu")).check()
    for (k1, v1), (k2, v2) in zip(want, got, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    checked += 1
    print("ok", checked)
''')

_DAMAGE = _PRELUDE + textwrap.dedent('''
    rng = np.random.default_rng(0)
    lay = uniform_layout(2, 2, 8)
    kv = random_kv(lay, 70, seed=3)
    outcomes = {"both": 0, "neither": 0}
    for mode, level in (("kdn", "default"), ("int8", "")):
        header, recs = records(codec.encode(kv, mode, level))
        m = get_mode(mode)
        for trial in range(12):
            bodies = [bytearray(r.body) for r in recs]
            b = bodies[trial % len(bodies)]
            if trial % 3 == 2:  # a run of bytes zeroed
                at = int(rng.integers(0, len(b) - 8))
                b[at : at + 8] = bytes(8)
            else:  # one flipped byte
                at = int(rng.integers(0, len(b)))
                b[at] ^= 1 << int(rng.integers(0, 8))
            if mode == "int8" and trial == 11:  # an infinite float16 scale
                b[16:18] = bytes([0x00, 0x7C])
            specs = [layer_spec(header.layout, r.layer, r.tokens) for r in recs]
            try:
                cpu = [m.decode_layer(memoryview(x), s, level, torch.device("cpu"))
                       for x, s in zip(bodies, specs)]
            except Corrupt:
                cpu = None
            try:
                dev = m.decode_layers([memoryview(x) for x in bodies], specs, level,
                                      torch.device("cpu")).check()
            except Corrupt:
                dev = None
            assert (cpu is None) == (dev is None), (mode, trial, at)
            if cpu is None:
                outcomes["both"] += 1
            else:
                outcomes["neither"] += 1
                for (k1, v1), (k2, v2) in zip(cpu, dev):
                    assert torch.equal(k1, k2) and torch.equal(v1, v2), (mode, trial)
    print("ok", outcomes["both"], outcomes["neither"])
''')

_BUDGET = _PRELUDE + textwrap.dedent('''
    from torch.utils._python_dispatch import TorchDispatchMode

    SYNCING = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "masked_select")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    from kdn.codec import gpu_source

    steps = {"kdn": ["kdn.count", "kdn.fill", "kdn.launch", "kdn.scan", "kdn.source",
                     "kdn.tables", "kdn.upload", "kdn.views"],
             "int8": ["int8.launch", "int8.sections", "int8.source", "int8.upload",
                      "int8.views"]}
    lay = uniform_layout(32, 1, 4)
    kv = random_kv(lay, 6, seed=1)
    for mode, level, most in (("kdn", "default", 8), ("int8", "", 2)):
        header, recs = records(codec.encode(kv, mode, level, layers_per_frame=0))
        specs = [layer_spec(header.layout, r.layer, r.tokens) for r in recs]
        gpu_batch.STATS.update(launches=0, copies=0, syncs=0)
        before = dict(gpu_source.SECONDS)
        with Ops() as seen:
            done = get_mode(mode).decode_layers([memoryview(r.body) for r in recs], specs,
                                                level, torch.device("cpu"))
        synced = [op for op in seen.ops if op.split(".")[0] in SYNCING]
        assert gpu_batch.STATS["syncs"] == 0 and not synced, (mode, synced)
        launches = gpu_batch.STATS["launches"]
        assert 1 <= launches <= most, (mode, launches)
        timed = sorted(k for k, v in gpu_source.SECONDS.items() if v > before.get(k, 0.0))
        assert timed == steps[mode], (mode, timed)  # each step's host time, for bench.gpu
        layers = done.check()
        assert gpu_batch.STATS["syncs"] == 1
        assert len(layers) == 32
        print(mode, launches)
    print("ok")
''')


_DIRECT = _PRELUDE + textwrap.dedent('''
    # pinned bodies that do not lie in one span are copied where they lie, a copy per run of
    # neighbouring bodies (one per entry here), and the kdn planner reads them in place where
    # one buffer holds them all: the same tensors as the CPU decoder, and damage refused
    # (one encoding a run, each in a process and time limit of its own: the test puts it in
    # place of MODES)
    gpu_batch.DIRECT.add("cpu")
    lay = uniform_layout(3, 2, 8)
    rng = np.random.default_rng(5)
    runs = 0
    for mode, level in MODES:
        entries = [codec.encode(random_kv(lay, 20 + 7 * e, seed=e, start=40 * e), mode, level)
                   for e in range(4)]
        want = [l for b in entries for l in codec.decode(b).layers]
        parsed = [records(b) for b in entries]
        specs = [layer_spec(h.layout, r.layer, r.tokens) for h, recs in parsed for r in recs]
        gap = 3 * gpu_batch.SPAN_GAP + (2 << 20)  # far apart: not one span, a run each
        one = bytearray(sum(len(b) + gap for b in entries))
        # arena views (an array each over one buffer, as the read arena gives entries): the
        # planner reads them in place too (its plan: test_gpu_tables), decoded once
        extra = ("arena views",) if (mode, level) == ("kdn", "default") else ()
        for layout in ("one buffer", "a buffer each", *extra):
            bodies, at = [], 0
            for b, (h, recs) in zip(entries, parsed):
                if layout != "a buffer each":
                    one[at : at + len(b)] = b
                    view = (memoryview(one)[at : at + len(b)] if layout == "one buffer" else
                            memoryview(np.frombuffer(one, np.uint8)[at : at + len(b)]))
                    at += len(b) + gap
                else:
                    view = memoryview(bytearray(b))
                base = int(np.frombuffer(b, np.uint8).ctypes.data)
                for r in recs:  # the same records, viewed where this copy of the entry lies
                    o = int(np.frombuffer(r.body, np.uint8).ctypes.data) - base
                    bodies.append(view[o : o + len(r.body)])
            gpu_batch.STATS.update(launches=0, copies=0, syncs=0)
            got = get_mode(mode).decode_layers(bodies, specs, level, torch.device("cpu"),
                                               pinned=True).check()
            assert gpu_batch.STATS["copies"] == len(entries), (mode, layout, gpu_batch.STATS)
            for (k1, v1), (k2, v2) in zip(want, got, strict=True):
                assert torch.equal(k1, k2) and torch.equal(v1, v2), (mode, layout)
            runs += 1
            for trial in range(0 if layout in extra else 3):  # damage in place: refused
                # or identical, like the CPU
                i = int(rng.integers(0, len(bodies)))
                j = int(rng.integers(0, len(bodies[i])))
                keep = bodies[i][j]
                bodies[i][j] = keep ^ 0x5A
                try:
                    cpu = [get_mode(mode).decode_layer(b, s, level, torch.device("cpu"))
                           for b, s in zip(bodies, specs)]
                except Corrupt:
                    cpu = None
                try:
                    dev = get_mode(mode).decode_layers(bodies, specs, level,
                                                       torch.device("cpu"), pinned=True).check()
                except Corrupt:
                    dev = None
                assert (cpu is None) == (dev is None), (mode, layout, trial)
                for (k1, v1), (k2, v2) in zip(cpu or [], dev or []):
                    assert torch.equal(k1, k2) and torch.equal(v1, v2)
                bodies[i][j] = keep
    print("ok", runs)
''')


_PLANNER_HOSTILE = _PRELUDE + textwrap.dedent('''
    # the planner parses untrusted bytes in compiled code that does not check its indexes:
    # hostile kdn bodies (flipped bytes; the entropy blobs' mark, table and code lengths set
    # to edge values; a blob's bytes changed or cut) end in Corrupt or a plan, never a crash
    import struct
    from kdn.codec.modes import pack_sections, unpack_sections
    from kdn.errors import KDNError
    gpu_batch._launch = lambda *a, **k: None  # the host's share only
    rng = np.random.default_rng(21)
    mode, seen = get_mode("kdn"), {"refused": 0, "planned": 0}
    edges = [0, 1, 3, 4, 7, 8, 255, 256, 0xFFFF, 2**31, 2**32 - 1, 0xFFFFFFFD, 0xFFFFFFFE]
    for case in range(240):
        level = ("default", "high", "tiny")[case % 3]
        lay = (uniform_layout(3, 2, 8), pruned_layout())[case % 2]
        header, recs = records(codec.encode(random_kv(lay, int(rng.integers(1, 70)), seed=case),
                                            "kdn", level, layers_per_frame=0))
        specs = [layer_spec(header.layout, r.layer, r.tokens) for r in recs]
        bodies = [bytearray(r.body) for r in recs]
        i = int(rng.integers(0, len(bodies)))
        secs = [bytearray(x) for x in unpack_sections(bytes(bodies[i]), 4, "test")]
        blob = secs[2 + case % 2]
        how = case // 2 % 4
        if how == 0 or len(blob) < 12:
            for _ in range(3):
                bodies[i][int(rng.integers(0, len(bodies[i])))] ^= int(rng.integers(1, 256))
        else:
            at = 12 + int(rng.integers(0, len(blob) - 11))
            if how == 1:
                struct.pack_into("<I", blob, 4 * int(rng.integers(0, 3)), int(rng.choice(edges)))
            elif how == 2:
                blob[min(at, len(blob) - 1)] = int(rng.integers(0, 256))
            else:
                del blob[at:]
            bodies[i] = bytearray(pack_sections([bytes(x) for x in secs]))
        try:
            mode.decode_layers([memoryview(b) for b in bodies], specs, level, torch.device("cpu"))
            seen["planned"] += 1
        except Corrupt:
            seen["refused"] += 1
    assert seen["refused"] > 60 and seen["planned"] > 30, seen
    print("ok", seen["refused"], seen["planned"])
''')


_INT8_SCALES = _PRELUDE + textwrap.dedent('''
    from kdn.codec.modes import pack_sections, unpack_sections
    mode = get_mode("int8")
    header, recs = records(codec.encode(random_kv(uniform_layout(3, 2, 8), 5, seed=3), "int8"))
    specs = [layer_spec(header.layout, r.layer, r.tokens) for r in recs]
    for value in (np.nan, np.inf, -np.inf, 65504.0):  # 65504: float16's largest, finite
        secs = [bytes(x) for x in unpack_sections(recs[1].body, 4, "test")]
        secs[2] = secs[2][:6] + np.array([value], np.float16).tobytes() + secs[2][8:]
        bodies = [memoryview(r.body) for r in recs]
        bodies[1] = memoryview(pack_sections(secs))
        cpu = torch.device("cpu")
        for decode in (lambda: mode.decode_layers(bodies, specs, "", cpu).check()[1],
                       lambda: mode.decode_layer(bodies[1], specs[1], "", cpu)):
            try:
                k, v = decode()
                print("decoded", value, bool(torch.isfinite(v.float()).all()))
            except Corrupt as exc:
                print("refused", value, "not finite" in str(exc))
''')


def _run(script: str) -> list[str]:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_whole_entry_decode_is_bit_identical_to_the_cpu_decoders() -> None:
    assert _run(_IDENTICAL)[-2:] == ["ok", "15"]


def test_damaged_bodies_are_refused_exactly_where_the_cpu_refuses_them() -> None:
    out = _run(_DAMAGE)
    assert out[-3] == "ok" and int(out[-2]) >= 8, out  # much damage is caught...
    assert int(out[-2]) + int(out[-1]) == 24, out       # ...and the rest decodes identically


@pytest.mark.parametrize(("mode", "level", "runs"),
                         [("kdn", "default", 3), ("kdn", "high", 2), ("int8", "", 2)])
def test_pinned_bodies_of_several_entries_are_copied_where_they_lie(
        mode: str, level: str, runs: int) -> None:
    script = _DIRECT.replace("for mode, level in MODES:", f"for mode, level in (({mode!r}, "
                             f"{level!r}),):", 1)
    assert script != _DIRECT
    assert _run(script)[-2:] == ["ok", str(runs)]


def test_hostile_kdn_bodies_end_in_corrupt_or_a_plan_never_a_crash() -> None:
    assert _run(_PLANNER_HOSTILE)[0] == "ok"


def test_int8_scales_that_are_not_finite_are_refused_by_both_decoders() -> None:
    """A NaN float16 scale (which no encoder writes: lossy modes refuse non-finite input)
    decoded its row as NaN in both int8 decoders, which refused only infinite ones."""
    out = _run(_INT8_SCALES)
    assert out == ["refused", "nan", "True"] * 2 + ["refused", "inf", "True"] * 2 \
        + ["refused", "-inf", "True"] * 2 + ["decoded", "65504.0", "True"] * 2, out


def test_a_32_layer_entry_takes_few_launches_and_no_sync_before_its_check() -> None:
    out = _run(_BUDGET)
    assert out[-1] == "ok", out


def _layers_with_symbols_blob(fmt: int, edit: Any) -> tuple[list[memoryview], list[Any]]:
    """The bodies and specs of a 3-layer ``kdn-default`` entry in blob format ``fmt``, layer
    1's symbols' blob replaced by ``edit(blob)``."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import random_kv, uniform_layout

    from kdn import codec
    from kdn.codec import entropy
    from kdn.codec.api import layer_spec
    from kdn.codec.format import check_frame, parse_container
    from kdn.codec.modes import pack_sections, unpack_sections

    with entropy.writing_format(fmt):
        blob = codec.encode(random_kv(uniform_layout(3, 2, 8), 30, seed=4), "kdn", "default")
    c = parse_container(blob, verify=False)
    recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
    specs = [layer_spec(c.header.layout, r.layer, r.tokens) for r in recs]
    sections = [bytes(x) for x in unpack_sections(recs[1].body, 4, "test")]
    sections[3] = edit(sections[3])
    bodies = [memoryview(r.body) for r in recs]
    bodies[1] = memoryview(pack_sections(sections))
    return bodies, specs


def _refused_by_both(bodies: list[memoryview], specs: list[Any], cpu: str, planner: str
                     ) -> None:
    """The CPU decoder refuses layer 1 (``cpu``), and the whole-entry decoder's planner
    refuses it naming the layer (``planner``) before any launch."""
    import torch

    from kdn.codec import gpu_batch
    from kdn.codec.modes import get_mode
    from kdn.errors import Corrupt

    mode = get_mode("kdn")
    with pytest.raises(Corrupt, match=cpu):
        mode.decode_layer(bodies[1], specs[1], "default", torch.device("cpu"))
    gpu_batch.STATS.update(launches=0, copies=0, syncs=0)
    with pytest.raises(Corrupt, match=f"layer {specs[1].index}: {planner}"):
        mode.decode_layers(bodies, specs, "default", torch.device("cpu"))
    assert gpu_batch.STATS["launches"] == 0


def test_a_count_code_out_of_range_is_refused_by_both_decoders() -> None:
    """A format-3 table whose count code names no level: the CPU decoder and the planner of
    the whole-entry decoder both refuse it, the planner before anything is launched."""
    import struct

    import numpy as np
    import zstandard

    from kdn.codec.entropy import LOG_LEVELS

    def bad_code(sym: bytes) -> bytes:  # mark, table length, tables, rANS
        tlen = struct.unpack_from("<I", sym, 4)[0]
        tables = bytearray(zstandard.ZstdDecompressor().decompress(sym[8 : 8 + tlen]))
        rows = 2 * 2 * 8  # heads x (K + V channels)
        widths = np.frombuffer(bytes(tables), "<u2", count=rows, offset=2 * rows)
        at = 4 * rows + int(widths[: int(np.argmax(widths > 1))].sum())  # a coded row's bin
        tables[at] = len(LOG_LEVELS)
        packed = zstandard.ZstdCompressor().compress(bytes(tables))
        return sym[:4] + struct.pack("<I", len(packed)) + packed + sym[8 + tlen :]

    _refused_by_both(*_layers_with_symbols_blob(3, bad_code), "code out of range",
                     "entropy table code out")


@pytest.mark.parametrize("damage", ["codes cut short", "codes one byte long",
                                    "tables with the codes inside"])
def test_format_4_codes_that_do_not_fit_the_tables_are_refused_by_both_decoders(
        damage: str) -> None:
    """Format 4 keeps the count codes outside zstd, sized by the tables' widths: codes of the
    wrong length, or lo/width tables that are not exactly 4 bytes a row, are refused by the
    CPU decoder and by the planner, naming the layer, before anything is launched."""
    import struct

    import numpy as np
    import zstandard

    def edit(sym: bytes) -> bytes:  # mark, table length, codes length, tables, codes, rANS
        tlen, clen = struct.unpack_from("<II", sym, 4)
        tables, codes, rest = sym[12 : 12 + tlen], sym[12 + tlen : 12 + tlen + clen], \
            sym[12 + tlen + clen :]
        if damage == "codes cut short":
            codes = codes[:-1]
        elif damage == "codes one byte long":
            codes += bytes(1)
        else:  # format 3's tables behind format 4's mark
            bins = np.frombuffer(codes, np.uint8)
            full = np.stack([bins & 15, bins >> 4], axis=1).ravel()
            raw = zstandard.ZstdDecompressor().decompress(tables) + full.tobytes()
            tables = zstandard.ZstdCompressor().compress(raw)
        return sym[:4] + struct.pack("<II", len(tables), len(codes)) + tables + codes + rest

    cpu = {"codes cut short": "codes are", "codes one byte long": "codes are",
           "tables with the codes inside": "zstd frame declares"}[damage]
    planner = {"codes cut short": "entropy table codes do not fit",
               "codes one byte long": "entropy table codes do not fit",
               "tables with the codes inside": "zstd frame declares"}[damage]
    _refused_by_both(*_layers_with_symbols_blob(4, edit), cpu, planner)


@pytest.mark.parametrize("damage", ["short body", "sections past the body", "K sections resized",
                                    "V sections resized"])
def test_int8_section_tables_that_do_not_fit_are_refused_naming_the_layer(damage: str) -> None:
    """The int8 planner reads every body's section table at once: a damaged table in layer 3
    of 5 is refused before anything is copied or launched, naming layer 3, as the CPU
    decoder refuses it."""
    import struct
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import pruned_layout, random_kv

    from kdn import codec
    from kdn.codec import gpu_batch
    from kdn.codec.api import layer_spec
    from kdn.codec.format import check_frame, parse_container
    from kdn.codec.modes import get_mode
    from kdn.errors import Corrupt

    blob = codec.encode(random_kv(pruned_layout(), 9, seed=2), "int8")
    c = parse_container(blob, verify=False)
    recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
    specs = [layer_spec(c.header.layout, r.layer, r.tokens) for r in recs]
    bodies = [bytearray(r.body) for r in recs]
    lens = list(struct.unpack_from("<4I", bodies[3]))
    if damage == "short body":
        bodies[3] = bodies[3][:12]
    elif damage == "sections past the body":
        struct.pack_into("<I", bodies[3], 12, lens[3] + 1)
    else:  # two sections resized the same, so that they still add up to the body
        i = 1 if damage.startswith("K") else 3
        struct.pack_into("<I", bodies[3], 4 * i, lens[i] - 2)
        struct.pack_into("<I", bodies[3], 4 * (i - 1), lens[i - 1] + 2)
    mode = get_mode("int8")
    with pytest.raises(Corrupt):
        mode.decode_layer(memoryview(bodies[3]), specs[3], "", torch.device("cpu"))
    gpu_batch.STATS.update(launches=0, copies=0, syncs=0)
    with pytest.raises(Corrupt, match="layer 3: ") as err:
        mode.decode_layers([memoryview(b) for b in bodies], specs, "", torch.device("cpu"))
    shape = {"K sections resized": specs[3].k_shape,
             "V sections resized": specs[3].v_shape}.get(damage)
    assert shape is None or f"wrong sizes for {shape}" in str(err.value), str(err.value)
    assert gpu_batch.STATS["launches"] == 0


@pytest.mark.gpu
def test_on_cuda_the_whole_entry_decode_matches_the_cpu_and_never_syncs_early() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import pruned_layout, random_kv, uniform_layout

    from kdn import codec
    from kdn.codec.api import layer_spec
    from kdn.codec.format import check_frame, parse_container
    from kdn.codec.modes import get_mode
    from kdn.layout import DType

    for lay, tokens in ((uniform_layout(32, 8, 128), 1500), (pruned_layout(), 333),
                        (uniform_layout(4, 2, 64, DType.BFLOAT16), 700)):
        kv = random_kv(lay, tokens)
        for mode, level in (("kdn", "default"), ("kdn", "high"), ("int8", "")):
            blob = codec.encode(kv, mode, level)
            cpu, dev = codec.decode(blob), codec.decode(blob, device="cuda")
            for (k1, v1), (k2, v2) in zip(cpu.layers, dev.layers, strict=True):
                assert k2.is_cuda and torch.equal(k1, k2.cpu()) and torch.equal(v1, v2.cpu())
            c = parse_container(blob, verify=False)
            recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
            specs = [layer_spec(c.header.layout, r.layer, r.tokens) for r in recs]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
            try:
                done = get_mode(mode).decode_layers([memoryview(r.body) for r in recs], specs,
                                                    level, torch.device("cuda"))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert len(done.check()) == lay.num_layers
