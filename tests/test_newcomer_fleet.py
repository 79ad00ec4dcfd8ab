"""A newcomer's fleet path (issue 27), through the real commands: fedper-coordinator and fedper-agent as processes
on the embedded broker as the quickstart runs them, their refusals of a bad export, a taken port, a state of
another fleet, a missing folder or a file for --data (one line each), a broker they cannot reach (said again every
few seconds), their --help at 80 columns; and the engine's side of a rerun with more --rounds and of updates sent
again."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from helpers.processes import Processes, agent_args, finish, write_device_data
from helpers.toy_export import write_toy_export
from test_coordinator_engine import MANIFEST, errors, make, register, send, shifted
from vectors.make_vectors import tiny_tensors

from fedper.ports import free_port

COORDINATOR = [sys.executable, "-m", "fedper.coordinator.cli"]
AGENT = [sys.executable, "-m", "fedper.edge.cli"]


def run(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def one_line(done: subprocess.CompletedProcess[str], code: int, *said: str) -> None:
    """Exit `code`, and stderr exactly one line holding each of `said` (no traceback, no library's warning)."""
    lines = done.stderr.splitlines()
    assert done.returncode == code and len(lines) == 1 and all(s in lines[0] for s in said), done.stderr


def coordinator(artifacts: Path, state: Path, *args: str, fleet: str = "lab") -> list[str]:
    return [*COORDINATOR, "--artifacts", str(artifacts), "--fleet", fleet, "--rounds", "1", "--state-dir", str(state),
            *args]


# ------------------------------------------------------------ a clean run looks clean


def test_the_quickstart_fleet_on_the_embedded_broker_runs_clean(tiny_artifacts: Path, tmp_path: Path,
                                                                processes: Processes) -> None:
    """The quickstart's fleet by hand, agents with their default MQTT 5: they speak 3.1.1 to the embedded broker
    by themselves, nothing is resent or refused, no agent loses its broker before it finishes (the coordinator
    waits for them to go), and no library's warning about CUDA appears."""
    port = free_port()
    args = coordinator(tiny_artifacts, tmp_path / "coord", "--embedded-broker", "--port", str(port),
                       "--min-clients", "2", "--round-timeout", "120")
    args[args.index("--rounds") + 1] = "2"
    coord = processes.start("coordinator", *args[1:])  # Processes runs `python *args`
    deadline = time.monotonic() + 60
    while "connected to the broker" not in processes.log("coordinator"):
        assert coord.poll() is None and time.monotonic() < deadline, processes.log("coordinator")
        time.sleep(0.2)
    agents = {}
    for name, classes in (("a", (0, 1)), ("b", (2, 3))):
        data = write_device_data(tmp_path / f"{name}.npz", classes, 40)
        agents[name] = processes.start(name, *agent_args(tiny_artifacts, data, f"mqtt://127.0.0.1:{port}", "lab",
                                                         name, tmp_path / f"state-{name}"))
    for name, proc in agents.items():
        assert finish(proc, 300, name, processes.log(name)) == 0, processes.log(name)
    assert finish(coord, 60, "coordinator", processes.log("coordinator")) == 0
    for name in agents:
        log = processes.log(name)
        assert log.count(f"the broker at 127.0.0.1:{port} does not speak MQTT 5") == 1, log
        assert "finished after 2 rounds" in log, log
        for noise in ("lost the broker", "already trained", "coordinator:", "No CUDA runtime", "Traceback",
                      "cannot connect"):
            assert noise not in log, (noise, log)
    log = processes.log("coordinator")
    assert "round 2 closed: 2 participant(s)" in log and "the devices' accuracy of round 2's model" in log, log
    assert "waiting up to 120 s for the 2 device(s) online" in log and "done: 2 round(s)" in log, log
    assert not re.search(r"rejected \w+ from", log) and " 0 rejected" in log, log  # the bar's count too
    for noise in ("Traceback", "No CUDA runtime", "cannot connect"):
        assert noise not in log, (noise, log)


# ------------------------------------------------------------ refusals: one line, exit 2


@pytest.mark.parametrize("damage", ["tampered", "incomplete"])
def test_the_coordinator_refuses_an_export_that_does_not_match_its_manifest(tiny_artifacts: Path, tmp_path: Path,
                                                                            damage: str) -> None:
    export = Path(shutil.copytree(tiny_artifacts, tmp_path / "export"))
    if damage == "tampered":
        base = export / "base.safetensors"
        data = bytearray(base.read_bytes())
        data[-1] ^= 0x01  # one bit of the last weight
        base.write_bytes(bytes(data))
        said = "base.safetensors: sha256 does not match the manifest"
    else:
        (export / "inference.onnx").unlink()
        said = "inference.onnx: listed in the manifest but missing"
    done = run(coordinator(export, tmp_path / "state", "--broker", f"mqtt://127.0.0.1:{free_port()}"))
    one_line(done, 2, f"fedper-coordinator: {export} does not match its manifest: ", said)
    assert not (tmp_path / "state").exists()  # refused before anything is written


def test_a_taken_port_for_the_embedded_broker_is_one_line(tmp_path: Path) -> None:
    export = write_toy_export(tmp_path / "export", MANIFEST, tiny_tensors())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run(coordinator(export, tmp_path / "state", "--embedded-broker", "--port", str(port)))
    one_line(done, 2, f"the embedded broker cannot listen on 127.0.0.1:{port}: the port is in use",
             "choose another --port")


def test_a_state_of_another_fleet_is_refused(tmp_path: Path) -> None:
    make(tmp_path / "state").start(0.0)  # fleet "lab" (test_coordinator_engine's topics), checkpointed
    export = write_toy_export(tmp_path / "export", MANIFEST, tiny_tensors())
    done = run(coordinator(export, tmp_path / "state", "--broker", "mqtt://127.0.0.1:1", fleet="other"))
    one_line(done, 2, "holds the state of fleet 'lab', not 'other': resume it with --fleet lab, or use a fresh "
                      "--state-dir")


def test_verify_of_a_missing_folder_and_data_that_is_a_file_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    one_line(run([sys.executable, "-m", "fedper.cli", "export", "verify", str(missing)]), 1,
             f"no manifest.json in {missing}: {missing} does not exist")
    notes = tmp_path / "notes.txt"
    notes.write_text("not images")
    common = ["--artifacts", str(tmp_path), "--broker", "mqtt://127.0.0.1:1", "--fleet", "lab", "--client-id", "d",
              "--state-dir", str(tmp_path / "state")]
    one_line(run([*AGENT, "--data", str(notes), *common]), 2, f"--data {notes} is a file, and not an .npz")
    one_line(run([*AGENT, "--data", str(missing), *common]), 2, f"--data {missing} does not exist")


def test_a_coordinator_that_cannot_reach_its_broker_says_so_every_few_seconds(tmp_path: Path,
                                                                             processes: Processes) -> None:
    export = write_toy_export(tmp_path / "export", MANIFEST, tiny_tensors())
    port = free_port()
    proc = processes.start("coordinator", *coordinator(export, tmp_path / "state", "--broker",
                                                        f"mqtt://127.0.0.1:{port}")[1:])
    said = f"cannot connect to the broker at 127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while processes.log("coordinator").count(said) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, processes.log("coordinator")
        time.sleep(0.2)
    lines = [line for line in processes.log("coordinator").splitlines() if said in line]
    assert all("connection refused: nothing listens on port" in line for line in lines), lines
    first, second = (time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) for line in lines[:2])
    assert 4 <= second - first <= 15  # every few seconds, not at every attempt (the coordinator retries within 10 s)


# ------------------------------------------------------------ --help at 80 columns


@pytest.mark.parametrize("command", [["fedper.edge.cli"], ["fedper.coordinator.cli"], ["fedper.cli", "agent"],
                                     ["fedper.cli", "coordinator"]])
def test_help_at_80_columns_has_whole_option_names_and_no_subcommands(command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("Usage: ") and text.splitlines()[0].endswith("[OPTIONS]"), text[:200]
    assert "COMMAND" not in text and max(len(line) for line in text.splitlines()) <= 80
    shown = typer.main.get_command(importlib.import_module(command[0]).app)  # the click command that printed it
    if len(command) > 1:
        shown = shown.commands[command[1]]
    names = {name for param in shown.params for name in (*param.opts, *param.secondary_opts)}
    assert len(names) > 15
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), name
    assert not re.search(r"[\w-]-\n", text)  # no word broken at a hyphen, in names or in help


# ------------------------------------------------------------ the engine: more --rounds, updates sent again


def test_a_finished_run_rerun_with_more_rounds_runs_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedper.coordinator")
    c = make(tmp_path, rounds=1, min_clients=1)
    c.start(0.0)
    register(c, "a", 10)
    send(c, "a", shifted(1.0), 10)
    c.tick(1.0)
    assert c.finished and c.round.number == 1
    again = make(tmp_path, rounds=3, min_clients=1)
    assert not again.finished and again.round.number == 2
    assert "finished after round 1: --rounds 3 runs rounds 2 to 3" in caplog.text
    for number in (2, 3):
        again.start(float(number))
        send(again, "a", shifted(float(number)), 10, now=float(number))
        again.tick(float(number) + 0.5)
    assert again.finished and again.round.number == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3]
    caplog.clear()
    assert make(tmp_path, rounds=3).finished and "the run finished after round 3: --rounds 4 or more" in caplog.text


def test_an_update_sent_again_is_refused_quietly_and_a_late_one_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A device sends its saved update again at every RoundInfo it sees again: refused and counted, no warning."""
    caplog.set_level(logging.DEBUG, logger="fedper.coordinator")
    c = make(tmp_path, rounds=3, min_clients=2)
    c.start(0.0)
    register(c, "a", 10)
    register(c, "b", 10)
    send(c, "a", shifted(1.0), 10)
    warnings = lambda: [r for r in caplog.records if r.levelno >= logging.WARNING]  # noqa: E731
    assert errors(send(c, "a", shifted(1.0), 10, blob_id="again")) == ["duplicate_update"] and not warnings()
    send(c, "b", shifted(2.0), 10)
    c.tick(2.0)
    assert c.round.number == 2
    assert errors(send(c, "a", shifted(1.0), 10, round_=1, blob_id="late")) == ["late_update"] and not warnings()
    register(c, "z", 10)  # whose round-1 update never came: late, and worth a warning
    assert errors(send(c, "z", shifted(1.0), 10, round_=1, blob_id="z1")) == ["late_update"]
    assert [r.getMessage() for r in warnings()] == ["rejected late_update from z: update for round 1, but round 2 "
                                                    "is open"]
    assert c.counters["duplicate_update"] == 1 and c.counters["late_update"] == 2
    assert any("rejected duplicate_update from a" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)
