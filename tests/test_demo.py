"""`fedper demo`: the whole system end to end as real processes, and nothing left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

SMALL = ["--devices", "2", "--rounds", "1", "--max-samples", "240", "--width", "0.25", "--classes-per-device", "2"]


def leftovers(marker: Path) -> list[str]:
    """Command lines of live fedper processes that mention this run's folder (the demo's children do)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(marker) in text and "fedper.cli" in text:
            found.append(text)
    return found


def default_sigint() -> None:
    """A shell without job control starts background jobs with SIGINT ignored, and children inherit
    that: then the Ctrl-C test would test nothing. Give the demo the default a terminal user has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def demo(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedper.cli", "demo", *SMALL, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)


def test_demo_runs_fedper_and_fedavg_and_cleans_up(tmp_path: Path) -> None:
    """Run twice into the same folder, as `make demo` twice does: the second run starts afresh
    (an earlier run's coordinator and agent state must not be resumed) and reports its own rounds."""
    for rounds in ("1", "2"):
        proc = demo(tmp_path / "run", "--rounds", rounds)
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, output
        results = json.loads((tmp_path / "run" / "results.json").read_text())
        assert set(results) == {"fedper", "fedavg"}
        for result in results.values():
            assert len(result["round_mean"]) == int(rounds)
            assert set(result["final"]) == {"dev-0", "dev-1"}
            assert all(0.0 <= a <= 1.0 for a in result["final"].values())
        assert (tmp_path / "run" / "demo.png").stat().st_size > 10_000
        assert "FedPer" in output and "dev-1" in output
        for name in ("dev-0", "dev-1"):  # each accuracy beside its chance line, from the device's own test labels
            y = np.load(tmp_path / "run" / "data" / f"{name}.npz")["y_test"]
            counts = np.bincount(y)
            words = (f"{np.count_nonzero(counts)} classes: guessing the most frequent gives "
                     f"{round(100 * counts.max() / len(y))} %")
            assert f"  {name}: {words}" in output, output
        assert leftovers(tmp_path / "run") == []


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = demo(out, "--rounds", "50")
    deadline = time.monotonic() + 180
    while not list(out.glob("fedper/dev-*.log")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # the agents are up and a round is under way
    assert any(" agent " in line for line in leftovers(out)), "the agents should be running before Ctrl-C"
    proc.send_signal(signal.SIGINT)
    # cleanup is bounded by design (5 s for the agents and the coordinator to stop, then SIGKILL;
    # up to 2 x 10 s for the embedded broker)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert leftovers(out) == []


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    proc = demo(tmp_path / "run", "--dataset", "cifar10")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "needs --data" in output
    with pytest.raises(FileNotFoundError):
        (tmp_path / "run" / "results.json").read_text()
