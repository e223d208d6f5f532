"""``bench.gpu --quick`` runs end to end on a CPU (the smoke test of the GPU benchmark's code:
a real kdn server process, the engine, every encoding) and writes the report format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_quick_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] and report["torch"] and report["limits"]
    rows = [r for r in report["rows"] if r["path"] != "decode"]
    assert {r["encoding"] for r in rows} == {"raw", "lossless", "int8", "kdn-default",
                                             "default"}
    for r in rows:  # a forced row decides what it was told; EngineConfig()'s, on a CPU,
        if r["encoding"] == "default":  # store lossless and the controller picks
            assert r["stored_encodings"] == ["lossless"], r
            assert set(r["decisions"]) <= {"lossless", "recompute"}, r
        else:
            assert set(r["decisions"]) == {r["encoding"]}, r
    assert {r["path"] for r in rows} == {"shm", "inproc"}
    decode = [r for r in report["rows"] if r["path"] == "decode"]
    assert [r["encoding"] for r in decode] == ["kdn-default"]
    assert decode[0]["decode_gb_s"] > 0 and 0 < decode[0]["stored_bytes"] < decode[0]["kv_bytes"]
    assert report["skipped"] == []
    for r in rows:
        assert set(r) >= {"model", "tokens", "path", "encoding", "ttft_s", "prefill_s",
                          "ratio_vs_prefill", "load_gb_s"}
        assert r["ttft_s"] > 0 and r["prefill_s"] > 0
        assert 0 < r["ttft_best_s"] <= r["ttft_s"]  # the median a user sees, the best beside
        assert abs(r["ratio_vs_prefill"] - r["ttft_s"] / r["prefill_s"]) < 1e-9
    assert (tmp_path / "gpu.png").exists()


def test_bench_gpu_skips_what_its_budget_leaves_no_time_for(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--quick", "--budget-s", "0.001",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["rows"] == [] and len(report["skipped"]) == 11, report["skipped"]


def test_bench_heap_quick_compares_the_heap_as_is_with_it_frozen(tmp_path: Path) -> None:
    out = tmp_path / "heap.json"
    run = subprocess.run([sys.executable, "-m", "bench.heap", "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    as_is, frozen, format3 = json.loads(out.read_text())["rows"]
    assert [(r["heap"], r["table_format"]) for r in (as_is, frozen, format3)] == \
        [("as-is", 4), ("frozen", 4), ("frozen", 3)]
    assert as_is["frozen_objects"] == 0 and as_is["tracked_objects"] > 100_000  # an engine's
    assert frozen["frozen_objects"] > 100_000 and frozen["tracked_objects"] < 10_000
    for r in (as_is, frozen, format3):
        assert r["hits"] == 12 and r["blocks"] == 8 and r["kernels"] == "not run"
        assert 0 < r["hit_p50_ms"] <= r["hit_p90_ms"] <= r["hit_max_ms"]


def test_bench_plan_host_quick_times_every_host_step(tmp_path: Path) -> None:
    """``bench.plan_host --quick``: the host's steps of a whole-entry GPU decode of a context,
    each timed, kernels counted and not launched, next to a memcpy of the same bytes."""
    out = tmp_path / "plan_host.json"
    run = subprocess.run([sys.executable, "-m", "bench.plan_host", "--quick", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["encoding"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"kdn-default", "int8"}
    for enc, steps, launches in (("kdn-default", {"kdn.tables", "kdn.count", "kdn.fill"}, 5),
                                 ("int8", {"int8.sections"}, 1)):
        r = rows[enc]
        assert r["entries"] == 8 and r["layers"] == 8 * 30, r
        assert steps <= set(r["phases_s"]) and r["launches"] == launches, r
        assert abs(r["host_s"] - r["bodies_s"] - r["plan_s"]) < 1e-9
        assert sum(r["phases_s"].values()) <= r["plan_s"] + 1e-6
        assert r["memcpy_s"] > 0 and r["ratio_to_memcpy"] == r["host_s"] / r["memcpy_s"]
