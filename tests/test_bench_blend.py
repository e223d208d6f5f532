"""bench.blend's summary arithmetic: the NLL gap and its interval over the case sample."""

from __future__ import annotations

import json
import math

import pytest

from bench.blend import gap_interval, resummarize, summarize


def test_gap_interval_is_the_paired_normal_interval_in_percent_of_the_reference():
    # differences 0 and 2: mean 1, sample sd sqrt(2), half-width 1.96 * sqrt(2) / sqrt(2)
    lo, hi = gap_interval([1.0, 3.0], [1.0, 1.0])
    assert lo == pytest.approx(100 * (1 - 1.96))
    assert hi == pytest.approx(100 * (1 + 1.96))
    # a constant shift has no spread: the interval closes on the gap (1 over a mean of 3)
    lo, hi = gap_interval([2.0, 4.0, 6.0], [1.0, 3.0, 5.0])
    assert lo == pytest.approx(100 / 3) and hi == pytest.approx(100 / 3)


def test_gap_interval_pairs_cases_rather_than_pooling_them():
    # large case-to-case spread of the NLL, but every case moves by exactly +0.1
    ref = [0.5, 9.0, 2.0, 6.0]
    lo, hi = gap_interval([r + 0.1 for r in ref], ref)
    assert hi - lo == pytest.approx(0.0, abs=1e-9)


def test_gap_interval_rejects_unpaired_input():
    with pytest.raises(ValueError, match="same non-zero number"):
        gap_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same non-zero number"):
        gap_interval([], [])


def _case(i: int, nll: float, ttft: float = 1.0) -> dict[str, float]:
    return {"case": i, "f1": 0.5, "ttft": ttft, "cpu": 2 * ttft, "nll": nll, "kl": 0.01,
            "agree": 0.8}


def test_summarize_rows_carry_the_gap_and_its_interval():
    per = {"full-prefill": [_case(0, 2.0, 10.0), _case(1, 4.0, 10.0), _case(2, 3.0, 10.0)],
           "blend@0.15": [_case(0, 2.2, 3.0), _case(1, 4.0, 3.0), _case(2, 3.2, 3.0)]}
    rows = {r["method"]: r for r in summarize(per)}
    b = rows["blend"]
    assert b["ratio"] == 0.15 and b["selection"] == "question"
    assert b["nll_gap"] == pytest.approx(0.4 / 3)
    assert b["nll_gap_pct"] == pytest.approx(100 * (0.4 / 3) / 3.0)
    assert b["nll_gap_pct_lo"] < b["nll_gap_pct"] < b["nll_gap_pct_hi"]
    assert b["ttft_vs_full"] == pytest.approx(0.3)
    assert rows["full-prefill"]["nll_gap_pct_hi"] == 0.0


def test_resummarize_rewrites_rows_from_per_case_and_keeps_the_measurement(tmp_path):
    per = {"full-prefill": [_case(0, 2.0), _case(1, 4.0)],
           "naive-concat": [_case(0, 2.5), _case(1, 4.5)]}
    path = tmp_path / "b.json"
    doc = {"benchmark": "blend", "when": "2026-01-01T00:00:00Z", "complete": False,
           "config": {"query_share": 1.0}, "per_case": per, "rows": []}
    path.write_text(json.dumps(doc))
    resummarize(path)
    out = json.loads(path.read_text())
    assert out["when"] == doc["when"] and out["config"] == doc["config"]
    naive = next(r for r in out["rows"] if r["method"] == "naive-concat")
    assert math.isclose(naive["nll_gap_pct"], 100 * 0.5 / 3.0)
    assert not path.with_suffix(".png").exists()  # incomplete: no picture


def test_resummarize_refuses_a_file_without_per_case_data(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"benchmark": "blend", "rows": []}))
    with pytest.raises(SystemExit, match="no per_case"):
        resummarize(path)
    assert json.loads(path.read_text()) == {"benchmark": "blend", "rows": []}


def test_bench_blend_gpu_quick_writes_its_report(tmp_path):
    """``bench.blend --gpu --quick`` runs on a CPU end to end (a real kdn server process, chunks
    resident and streamed, every selection rule) and writes the issue's row fields."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "blend_gpu.json"
    run = subprocess.run([sys.executable, "-m", "bench.blend", "--gpu", "--quick", "--out",
                          str(out)], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and report["device"]
    rows = report["rows"]
    for r in rows:
        assert set(r) >= {"method", "selection", "ratio", "context_tokens", "chunks", "source",
                          "ttft_s", "ttft_vs_full", "device"}
        assert r["ttft_s"] > 0 and r["context_tokens"] == 16 + 4 * 128 + 32
    full = next(r for r in rows if r["method"] == "full-prefill")
    blends = [r for r in rows if r["method"] != "full-prefill"]
    assert {(r["method"], r["selection"], r["source"]) for r in blends} == {
        (m, s, src) for m, s in [("naive", ""), ("blend", "question"), ("blend", "deviation"),
                                 ("blend", "chunk-head")] for src in ("resident", "streamed")}
    for r in blends:
        assert r["ttft_vs_full"] == pytest.approx(r["ttft_s"] / full["ttft_s"])
        want = 0 if r["method"] == "naive" else round(0.15 * 512)
        assert abs(r["recomputed_tokens"] - want) <= 4  # chunk heads round per chunk
    assert out.with_suffix(".png").exists()
