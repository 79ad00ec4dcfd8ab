"""The GPU benchmark's --quick form (benchmarks/emulator_gpu.py) on this CPU: every step of the paper-scale
measurement runs (both models, float32 and bf16, one run and six stacked, the sequential engine, the reduced grid)
within its budget, and its table holds every row and column with positive figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "emulator_gpu.py"
MEASURED = ("round_s", "samples_s", "gflop_sample", "tflop_s", "peak_gib", "grid_min")


@pytest.mark.long
@pytest.mark.timeout(600)  # about 2 minutes on an idle 2-core machine; the budget lets every step start under load
def test_quick_benchmark_writes_every_row_with_positive_figures(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--budget", "420", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "emulator_gpu.json").read_text())
    assert result["errors"] == [], result["errors"]  # none failed, and the budget let every step start
    paper = {(r["model"], r["engine"], r["precision"]): r for r in result["rows"] if r["step"] == "paper"}
    expected = {(m, e, p) for m in ("mobilenet_v1", "resnet34") for e in ("vmap", "stacked")
                for p in ("float32", "bf16")}
    expected |= {(m, "sequential", "float32") for m in ("mobilenet_v1", "resnet34")}
    assert set(paper) == expected
    for row in paper.values():
        assert all(isinstance(row[c], float) and row[c] > 0 for c in MEASURED), row
        assert row["peak_share"] is None  # a CPU has no peak in the table: TFLOP/s alone
        assert row["runs"] == (6 if row["engine"] == "stacked" else 1)
        assert isinstance(row["warmup_extra_s"], float)  # the first round's cost beyond a timed one
        # the grid's 6 runs x 100 rounds of a model, from the measured round
        assert abs(row["grid_min"] * 60 - row["round_s"] * 100 * 6 / row["runs"]) < 1e-6 * row["grid_min"] * 60
    # FLOPs are counted per model, whatever the engine or precision; ResNet-34 costs more than MobileNet-v1
    flops = {m: {r["gflop_sample"] for k, r in paper.items() if k[0] == m} for m in ("mobilenet_v1", "resnet34")}
    assert all(len(f) == 1 for f in flops.values()) and max(flops["resnet34"]) > max(flops["mobilenet_v1"])
    grid = {(r["engine"], r["precision"]): r["grid_min"] for r in result["rows"] if r["step"] == "fig2 grid"}
    assert grid[("stacked", "bf16")] == sum(paper[(m, "stacked", "bf16")]["grid_min"] for m in ("mobilenet_v1",
                                                                                              "resnet34"))
    reduced = [r for r in result["rows"] if r["step"].startswith("reduced")]
    assert {r["precision"] for r in reduced} == {"float32", "bf16"} and len(reduced) == 12  # fig2's 6 curves each
    assert all(0 <= r["final_mean_accuracy"] <= 1 for r in reduced)
    table = (tmp_path / "emulator_gpu.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| step"))
    assert all(f" {c} " in header for c in ("samples_s", "tflop_s", "peak_share", "peak_gib", "grid_min",
                                            "warmup_extra_s"))
