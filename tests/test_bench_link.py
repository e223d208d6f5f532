"""``bench.link`` runs end to end on a CPU (real kdn server processes with egress caps, a
remote client on the network data path, the engine) and writes the report format: a row per
link rate and choice, the fresh controller's decision, and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_link_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "link.json"
    run = subprocess.run([sys.executable, "-m", "bench.link", "--quick", "--tokens", "256",
                          "--links", "1,0", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] and report["torch"]
    rows = report["rows"]
    assert {(r["link_gbps"], r["encoding"]) for r in rows} == {
        (g, e) for g in (1.0, 0.0)
        for e in ("recompute", "raw", "int8", "kdn-default", "controller")}
    for r in rows:
        assert r["ttft_s"] > 0 and r["prefill_s"] > 0 and r["tokens"] == 256
        assert abs(r["ratio_vs_prefill"] - r["ttft_s"] / r["prefill_s"]) < 1e-9
    sizes = {r["encoding"]: r["stored_bytes"] for r in rows if r["link_gbps"] == 1.0}
    assert sizes["kdn-default"] < sizes["int8"] < sizes["raw"]  # every link, the same bytes
    assert all(r["stored_bytes"] == sizes[r["encoding"]] for r in rows
               if r["encoding"] in sizes and r["encoding"] != "controller")
    for r in (r for r in rows if r["encoding"] == "controller"):
        assert r["decision"] in {"recompute", "raw", "int8", "kdn-default"}
        # --quick: two rounds, the controller asked once a round, its TTFT the best of them
        assert len(r["decisions"]) == len(r["measured_s"]) == len(r["predicted_s"]) == 2
        assert r["decision"] == r["decisions"][0] and r["ttft_s"] == min(r["measured_s"])
        assert r["vs_best_fixed"] == r["ttft_s"] / min(
            o["ttft_s"] for o in rows
            if o["link_gbps"] == r["link_gbps"] and o["encoding"] != "controller")
    # the fresh engine measured its link: 1 Gbit/s = 0.125 GB/s, and far more unthrottled
    probed = {r["link_gbps"]: r["probed_gb_s"] for r in rows if r["encoding"] == "controller"}
    assert 0.09 < probed[1.0] < 0.16 and probed[0.0] > 0.5, probed
    # 1 Gbit/s: raw (the most bytes) takes longer than over the unthrottled loopback
    raw = {r["link_gbps"]: r["ttft_s"] for r in rows if r["encoding"] == "raw"}
    assert raw[1.0] > raw[0.0]
    assert out.with_suffix(".png").exists()
