"""Real agents (onnxruntime-training, real digits) and a coordinator run with --clients-per-round,
through a real Mosquitto: each round exactly the invited device trains; the others stay quiet and
never send an update (the coordinator counts no not_invited); a device whose --only-when does not
hold says it is offline, so it is never invited and never trains; every device gets the final model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import run_fleet

from fedper.data import load_digits
from fedper.edge.agent import Agent, AgentConfig

pytestmark = pytest.mark.mosquitto
ROUNDS = 3


def digits(tmp_path: Path, j: int) -> Path:
    ds = load_digits(32).train
    idx = np.flatnonzero(ds.y < 4)[20 * j : 20 * (j + 1)]
    path = tmp_path / f"device{j}.npz"
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
    return path


def test_only_invited_eligible_devices_train_and_the_rest_stay_quiet(tmp_path: Path, tiny_artifacts: Path,
                                                                     mosquitto) -> None:
    state = tmp_path / "coordinator"
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(tiny_artifacts), "--fleet", "sel",
         "--rounds", str(ROUNDS), "--min-clients", "1", "--clients-per-round", "1", "--round-timeout", "30",
         "--state-dir", str(state), "--broker", mosquitto.url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    logs: dict[str, list[str]] = {}
    agents = []
    for j in range(3):
        name = f"dev{j}"
        logs[name] = []
        only_when = ("command:false",) if j == 2 else ()  # dev2 is never willing to train
        agents.append(Agent(AgentConfig(artifacts=tiny_artifacts, data=digits(tmp_path, j), broker=mosquitto.url,
                                        fleet="sel", client_id=name, state_dir=tmp_path / name, batch_size=8,
                                        lr=0.05, only_when=only_when, reconnect_spread_s=1.0),
                            log=logs[name].append))
    run_fleet(coordinator, agents, 120, logs)

    rounds = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [1] * ROUNDS and all(r["invited"] == 1 for r in rounds)
    counters = json.loads((state / "state.json").read_text())["counters"]
    assert counters.get("not_invited", 0) == 0 and counters["accepted"] == ROUNDS
    trained = {name: sum("served accuracy" in line for line in lines) for name, lines in logs.items()}
    assert sum(trained.values()) == ROUNDS and trained["dev2"] == 0, logs
    assert any("not invited" in line for lines in logs.values() for line in lines)
    assert any("not eligible (command:false" in line for line in logs["dev2"])
    assert all(agent.final_accuracy is not None for agent in agents)  # everyone gets the final model
