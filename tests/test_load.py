"""200 scripted devices through Mosquitto on loopback: every update counted, coordinator memory flat.

The coordinator (a process) runs 3 rounds of the toy model of tests/vectors for 50, 100 and 200
devices; the devices are paho clients in 4 worker processes. Each run must count exactly N
participants per round and end with the closed-form weighted mean; the coordinator's peak RSS
(VmHWM, sampled from /proc while it runs) may not grow with N: streaming aggregation is O(model).
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from helpers.processes import Processes, coordinator_args, watch_peak_rss
from helpers.scripted import expected_mean, scripted_devices
from test_coordinator_live import assert_model, metrics, write_artifacts
from vectors.make_vectors import tiny_manifest, tiny_tensors

pytestmark = pytest.mark.mosquitto
ROUNDS, WORKERS = 3, 4


def run_fleet(url: str, artifacts: Path, state: Path, count: int, processes: Processes) -> tuple[int, float]:
    """One run of `count` devices; (coordinator peak RSS in KiB, seconds)."""
    fleet = f"load{count}"
    started = time.monotonic()
    coordinator = processes.start(fleet, *coordinator_args(artifacts, url, state, fleet, ROUNDS, count, 60))
    peak_rss = watch_peak_rss(coordinator)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    workers = [spawn.Process(target=scripted_devices, args=(url, fleet, list(range(w, count, WORKERS)), 60, results))
               for w in range(WORKERS)]
    for w in workers:
        w.start()
    try:
        answered: dict[str, list[int]] = {}
        for _ in workers:
            answered.update(results.get(timeout=90))
        coordinator.wait(60)
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
    assert coordinator.returncode == 0, processes.log(fleet)
    assert len(answered) == count and all(rounds == [1, 2, 3] for rounds in answered.values())
    return peak_rss(), time.monotonic() - started


def test_200_devices_every_update_counted_and_memory_flat(mosquitto, tmp_path: Path, processes: Processes) -> None:
    manifest, initial = tiny_manifest(), tiny_tensors()
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    peaks, seconds = {}, {}
    for count in (50, 100, 200):
        state = tmp_path / f"state{count}"
        peaks[count], seconds[count] = run_fleet(mosquitto.url, artifacts, state, count, processes)
        records = metrics(state)
        assert [r["participants"] for r in records] == [count] * ROUNDS
        assert all(r["rejected"] == {} for r in records)
        assert_model(state / "final.safetensors", expected_mean(initial, count, ROUNDS))
    assert min(peaks.values()) > 10_000, peaks  # the sampling did see the process
    print(f"load: coordinator peak RSS {peaks} KiB, run seconds { {k: round(v, 1) for k, v in seconds.items()} }")
    assert peaks[200] <= 1.5 * peaks[50], peaks
