"""The coordinator's deadlines do not follow a step of the system clock (found by the chaos soak's clock jump,
benchmarks/chaos_soak.py: under libfaketime a +44 s step passed round 13's deadline at once, with 0 of 8
updates in, and lapsed all 8 invitations)."""

from __future__ import annotations

import time

import pytest

from fedper.coordinator.service import steady_clock


def test_the_engine_clock_ignores_steps_of_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    wall, monotonic = [1_000.0], [50.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: monotonic[0])
    clock = steady_clock()
    assert clock() == 1_000.0  # wall time at start: metrics' timestamps stay dates
    wall[0], monotonic[0] = wall[0] + 44.0 + 1.0, monotonic[0] + 1.0  # one second passes, the clock steps +44 s
    assert clock() == 1_001.0
    wall[0], monotonic[0] = wall[0] - 100.0 + 2.0, monotonic[0] + 2.0  # two more, and a step back of 100 s
    assert clock() == 1_003.0
