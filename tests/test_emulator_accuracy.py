"""benchmarks/emulator_accuracy.py's verdict: a comparison agrees when the difference of the means over seeds is
within the spread across seeds, the widest max - min over seeds among a curve's conditions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import emulator_accuracy


def test_the_verdict_sets_each_difference_against_the_spread_across_seeds() -> None:
    results = {"fedper, k = 4": {"separate": {0: 0.40, 1: 0.50},  # spread 0.10, the widest
                                 "stacked": {0: 0.47, 1: 0.49},  # mean 0.48: +0.03 on separate's 0.45
                                 "stacked-bf16": {0: 0.20, 1: 0.22}},  # mean 0.21: -0.27 on stacked's 0.48
               "fedavg, k = 4": {"separate": {0: 0.25, 1: 0.25}, "stacked": {0: 0.25, 1: 0.26},
                                 "stacked-bf16": {0: 0.25, 1: 0.25}}}  # spread 0.01: every difference within
    rows, text = emulator_accuracy.report(results, [0, 1])
    fedper, fedavg = rows
    assert fedper["spread"] == pytest.approx(0.10)
    assert fedper["stacked - separate"] == pytest.approx(0.03) and fedper["stacked - separate agrees"]
    assert fedper["bf16 - float32"] == pytest.approx(-0.27) and not fedper["bf16 - float32 agrees"]
    assert fedper["separate by seed"] == [0.40, 0.50]
    assert fedavg["spread"] == pytest.approx(0.01)
    assert fedavg["stacked - separate agrees"] and fedavg["bf16 - float32 agrees"]
    assert "| fedper, k = 4 | 0.450 (0.400 / 0.500) |" in text and text.rstrip().endswith("| yes / yes |")
