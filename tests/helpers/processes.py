"""The coordinator and the agent as subprocesses: their arguments, their input data, their saved
state, waiting for or killing them, and their peak memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("0", "1", "2", "3")


class Processes:
    """Subprocesses with their output in log files; every one is killed (SIGKILL) at teardown."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """`python *args`; a restart under the same name appends to the same log."""
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def coordinator_args(artifacts: Path, url: str, state_dir: Path, fleet: str, rounds: int, min_clients: int,
                     round_timeout: float, *extra: str) -> list[str]:
    return ["-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", fleet, "--broker", url,
            "--rounds", str(rounds), "--min-clients", str(min_clients), "--round-timeout", str(round_timeout),
            "--state-dir", str(state_dir), *extra]


def agent_args(artifacts: Path, data: Path, url: str, fleet: str, client_id: str, state_dir: Path,
               *extra: str) -> list[str]:
    return ["-m", "fedper.edge.cli", "--artifacts", str(artifacts), "--data", str(data), "--broker", url,
            "--fleet", fleet, "--client-id", client_id, "--state-dir", str(state_dir), "--batch-size", "16",
            "--lr", "0.02", "--seed", "3", *extra]


def write_device_data(path: Path, classes: tuple[int, ...], count: int) -> Path:
    """Real digits of the given classes (non-IID), `count` images, as the agent's .npz."""
    from fedper.data import load_digits

    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[:count]
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(CLASSES))
    return path


def saved_state(state_dir: Path) -> dict[str, Any] | None:
    """The coordinator's state.json, or None while there is none (it is replaced atomically)."""
    from fedper.coordinator.store import Store

    path = state_dir / "state.json"
    for _ in range(10):  # a commit may delete the registry file an older state.json names: read again
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        try:
            return {**state, "registered": Store(state_dir).load_registry(state)}
        except FileNotFoundError:
            continue
    raise AssertionError(f"{state_dir}: state.json and its registry file kept changing")


def finish(proc: subprocess.Popen[bytes], timeout: float, what: str, log: str = "") -> int:
    """The exit code of `proc`, waiting at most `timeout` seconds (then kill it and fail)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not finish in {timeout} s:\n{log[-3000:]}") from None


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def watch_peak_rss(proc: subprocess.Popen[bytes], interval: float = 0.05) -> Callable[[], int]:
    """Sample the process's VmHWM (peak resident set, KiB; reset by exec, unlike ru_maxrss) until it
    exits; the returned function gives the highest value seen."""
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                break
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()

    def result() -> int:
        thread.join(5)
        return peak[0]

    return result


def run_fleet(coordinator: subprocess.Popen[Any], agents: list[Any], timeout: float, logs: object) -> Any:
    """Run real agents (fedper.edge.engine.Agent) in threads until the coordinator process has finished
    its rounds; `logs` goes into the failure message. Returns the coordinator's stderr."""
    from fedper.edge.service import run_agent

    stop = threading.Event()
    threads = [threading.Thread(target=run_agent, args=(agent, stop), daemon=True) for agent in agents]
    for thread in threads:
        thread.start()
    try:
        _, err = coordinator.communicate(timeout=timeout)
        assert coordinator.returncode == 0, err
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), logs
    finally:
        stop.set()
        coordinator.kill()
    return err

