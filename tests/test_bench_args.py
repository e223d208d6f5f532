"""The benchmarks' arguments are checked before anything is measured: a bad one is a usage
error naming it (exit 2, nothing written), and what they merge keeps what each run was. No
model runs here; the merges read and write JSON only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench.blend
import bench.delivery
import bench.disk_writes
import bench.fleet
import bench.gpu
import bench.link
import bench.security
import bench.tiers
import bench.vllm_connector

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _usage_error(capsys: pytest.CaptureFixture[str], main: Any, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("main, argv, named", [
    (bench.gpu.main, ["--tokens", "abc"], "'abc' is not a whole number"),
    (bench.disk_writes.main, ["--entries", "0"], "--entries must be >= 1"),
    (bench.disk_writes.main, ["--clients", "1,x"], "'x' is not a whole number"),
    (bench.gpu.main, ["--tokens", "0"], "'0' must be above 0"),
    (bench.gpu.main, ["--merge", "/nonexistent/run.json:label"], "/nonexistent/run.json"),
    (bench.link.main, ["--links", "abc"], "'abc' is not a number"),
    (bench.vllm_connector.main, ["--tokens", "300"], "whole number of 256-token chunks"),
    (bench.link.main, ["--links", "-1"], "'-1' must be at least 0"),
    (bench.link.main, ["--links", "nan"], "'nan' must be at least 0"),
    (bench.link.main, ["--tokens", "x"], "'x' is not a whole number"),
    (bench.fleet.main, ["--skip-real", "--trace", "/nonexistent/t.jsonl"],
     "/nonexistent/t.jsonl"),
    (bench.security.main, ["--quick", "--modes", "tsl"], "unknown tsl"),
    (bench.security.main, ["--modes", ","], "none given"),
])
def test_a_bad_argument_is_a_usage_error_naming_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, main: Any, argv: list[str],
        named: str) -> None:
    out = tmp_path / "x.json"
    assert named in _usage_error(capsys, main, [*argv, "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("argv, named", [
    (["--quick", "--encodings", "rawx"], "--encodings: this run's plan has no rawx"),
    (["--quick", "--paths", "shm,nope"], "--paths: this run's plan has no nope"),
    (["--quick", "--tokens", "512"], "--tokens: this run's plan has no 512"),
    (["--quick", "--paths", "decode", "--encodings", "raw"], "no case of this run's plan"),
])
def test_bench_gpu_refuses_a_selection_that_measures_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
        named: str) -> None:
    out = tmp_path / "gpu.json"
    out.write_text("{}")  # an earlier report is kept
    assert named in _usage_error(capsys, bench.gpu.main, [*argv, "--out", str(out)])
    assert out.read_text() == "{}"


def test_bench_gpu_merges_a_merged_report_whose_runs_hold_no_when(tmp_path: Path) -> None:
    src = RESULTS / "gpu_h100.json"
    doc = json.loads(src.read_text())
    assert any("when" not in run for run in doc["runs"].values())  # the committed file's form
    out = tmp_path / "m.json"
    bench.gpu.main(["--merge", str(src), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert set(merged["runs"]) == set(doc["runs"])
    assert {r["run"] for r in merged["rows"]} <= set(doc["runs"])
    assert all(run["when"] == when and run["dtype"] == doc["dtype"]
               for when, run in merged["runs"].items())


def _run(when: str, dtype: str, encoding: str) -> dict[str, Any]:
    base = json.loads((RESULTS / "gpu_cpu.json").read_text())
    return {**base, "when": when, "dtype": dtype,
            "rows": [{**base["rows"][0], "encoding": encoding}]}


def test_bench_gpu_merge_refuses_runs_of_different_dtypes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run("2026-11-01T00:00:00Z", "float32", "raw")))
    b.write_text(json.dumps(_run("2026-11-02T00:00:00Z", "bfloat16", "int8")))
    out = tmp_path / "m.json"
    with pytest.raises(SystemExit, match="different dtypes.*bfloat16.*float32"):
        bench.gpu.merge([str(a), str(b)], out)
    assert not out.exists()
    b.write_text(json.dumps(_run("2026-11-02T00:00:00Z", "float32", "int8")))
    merged = bench.gpu.merge([str(a), f"{b}:second"], out)
    assert {w: (r["dtype"], r["label"]) for w, r in merged["runs"].items()} == {
        "2026-11-01T00:00:00Z": ("float32", ""), "2026-11-02T00:00:00Z": ("float32", "second")}
    # a merged report merged again still knows each run's dtype
    again = bench.gpu.merge([str(out)], tmp_path / "again.json")
    assert all(r["dtype"] == "float32" and r["torch"] for r in again["runs"].values())
    c = tmp_path / "c.json"
    c.write_text(json.dumps(_run("2026-11-03T00:00:00Z", "float16", "raw")))
    with pytest.raises(SystemExit, match="different dtypes"):
        bench.gpu.merge([str(out), str(c)], tmp_path / "x.json")


def test_bench_delivery_only_refuses_a_missing_out_before_measuring(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(name: str) -> Any:
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(bench.delivery, "load_model", no_model)
    missing = tmp_path / "missing.json"
    err = _usage_error(capsys, bench.delivery.main,
                       ["--only", "agreement", "--out", str(missing)])
    assert str(missing) in err


def test_bench_delivery_only_merges_its_section_and_says_when(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.delivery, "load_model", lambda name: (None, None))
    monkeypatch.setattr(bench.delivery, "best_kdn_level", lambda: ("kdn", "default"))
    monkeypatch.setattr(bench.delivery, "agreement_rows",
                        lambda *a, **k: [{"section": "agreement", "new": True}])
    out = tmp_path / "delivery.json"
    out.write_text(json.dumps({"when": "then", "rows": [
        {"section": "agreement", "new": False}, {"section": "ttft"}]}))
    bench.delivery.main(["--only", "agreement", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == [{"section": "ttft"}, {"section": "agreement", "new": True}]
    assert doc["when"] == "then" and doc["agreement_when"] != "then"


def test_bench_tiers_wait_only_says_how_its_wait_rows_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.tiers, "wait_rows", lambda root, n: [{"ops": n}])
    monkeypatch.setattr(bench.tiers, "print_wait", lambda rows: None)
    out = tmp_path / "tiers.json"
    out.write_text(json.dumps({"meta": {"quick": False, "wait_ops": {"4096": 600}},
                               "rows": [], "wait": []}))
    bench.tiers.main(["--wait-only", "--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["wait"] == [{"ops": 60}]
    assert doc["meta"]["quick"] is False  # the full run's own
    assert doc["meta"]["wait_quick"] is True
    assert doc["meta"]["wait_ops"] == {"4096": 60, str(1 << 20): 20}


def test_committed_results_hold_the_fields_the_readmes_quote() -> None:
    load = json.loads((RESULTS / "load.json").read_text())
    first = load["gateway"][0]
    assert (first["path"], first["clients"]) == ("grpc", 1)
    assert load["gateway_beyond_raw_grpc_p50_ms_1client"] == first["beyond_raw_grpc_p50_ms"]
    assert load["gateway_overhead_p50_ms_1client"] == first["overhead_p50_ms"]
    link = json.loads((RESULTS / "gpu_link_cpu.json").read_text())
    for r in link["rows"]:
        if r["decision"] != "recompute":
            assert "load_gb_s" in r, r


def test_a_count_of_no_cases_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.blend --cases 0 ran its setup, then died in a raw UnboundLocalError."""
    monkeypatch.setattr("sys.argv", ["bench.blend", "--cases", "0"])
    err = _usage_error(capsys, lambda argv: bench.blend.main(), [])
    assert "--cases: must be at least 1, got 0" in err
