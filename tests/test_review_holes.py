"""Issue 39, item 5: the holes a hostile-device and hostile-coordinator review found, each shut by a test built
from hand-made frames (tests/helpers/frames.py) or third-party clients, expected values derived here.

- `--mode async` applies `--max-weight-ratio` as synchronous rounds do, and records `weight_cap`.
- Device-chosen text (a registration's software, a digest quoted in an error text) reaches the
  coordinator's log escaped: published with `mosquitto_pub`, read from the live coordinator's output.
- State is its owner's alone: after a real run (a coordinator process under DP, two ORT agents) every state
  file is mode 600 and every state directory 700; directories left open by an earlier release are tightened
  at start, in one log line; the systemd units set UMask=0077.
- Under `--secure-aggregation` with the defaults, a fleet of 4 with one poisoning device trains on: a round
  too small to sum the suspects in halves leaves one suspect out at a time (the engines of
  tests/test_secagg_live_engine.py, the liar's masked input framed by hand).
- A lying coordinator cannot run a secure-aggregation session twice: real agents through Mosquitto, a coordinator
  scripted by hand, advertise (and so sign) once per (round, session), across 77 -> 78 -> 77 and a restart.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.frames import to_json
from helpers.processes import Processes, coordinator_args, run_fleet, saved_state
from test_agent_fleet import agent_config, device_data
from test_async_engine import copy, make, plus, records, register, send
from test_coordinator_live import FLEET, TOPICS, wait_for, write_artifacts
from test_secagg_live import Impostor, make_agents, run_agents
from test_secagg_live_engine import Fleet, flat_manifest
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.edge.agent import Agent
from fedper.edge.secure_round import ADVERTISED_FILE
from fedper.manifest import Manifest

MOSQUITTO_PUB = shutil.which("mosquitto_pub")
needs_mosquitto_pub = pytest.mark.skipif(MOSQUITTO_PUB is None, reason="mosquitto_pub not installed "
                                                                       "(apt-get install mosquitto-clients)")


def publish(url: str, topic: str, payload: bytes, retain: bool = False) -> None:
    """One message from Debian's mosquitto_pub (no fedper code), its payload read from stdin as is."""
    host, port = url.removeprefix("mqtt://").split(":")
    command = [str(MOSQUITTO_PUB), "-h", host, "-p", port, "-q", "1", "-t", topic, "-s", *(["-r"] if retain else [])]
    subprocess.run(command, input=payload, check=True, timeout=10)

# ---------------------------------------------------------------- the weight cap in asynchronous rounds


def test_a_device_claiming_a_million_samples_moves_an_async_version_no_more_than_the_cap(tmp_path: Path) -> None:
    """Issue 39: FedBuff was built without --max-weight-ratio, so a device registered at 1,000,000 samples among
    four of 100 moved a version 1,000,000 / 1,000,400 of the way to its poison. With the default c = 10 it weighs
    at most 10 x the registered median: its share of the step is derived here from the registered counts."""
    honest = {f"h{i}": 100 for i in range(4)}
    claims = {**honest, "evil": 1_000_000}

    def run(state: Path, **config: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
        c = make(state, rounds=2, buffer_size=5, **config)
        register(c, claims)
        v1 = copy(c.model)
        assert send(c, "evil", plus(v1, -1000.0), 1, 1_000_000) == []
        for i, device in enumerate(honest):
            assert send(c, device, plus(v1, 0.1 * (i + 1)), 1, 100) == []
        assert c.round.number == 2  # the fifth fold released version 2
        return v1, copy(c.model), records(state)[0]

    median = float(np.median(list(claims.values())))  # 100: the evil claim is one rank of five
    for name, config, evil_weight in (("capped", {}, min(1_000_000, 10 * median)),
                                      ("lifted", {"max_weight_ratio": float("inf")}, 1_000_000.0)):
        v1, v2, record = run(tmp_path / name, **config)
        for k in v1:  # float64: the step as each device's float32 tensor minus the version it trained on
            deltas = [(100.0, plus(v1, 0.1 * (i + 1))[k].astype(np.float64) - v1[k]) for i in range(4)]
            deltas.append((evil_weight, plus(v1, -1000.0)[k].astype(np.float64) - v1[k]))
            expected = v1[k] + sum(w * d for w, d in deltas) / sum(w for w, _ in deltas)
            np.testing.assert_allclose(v2[k], expected, rtol=1e-6, atol=1e-4, err_msg=(name, k))
        share = float(np.mean((v2["stem.weight"] - v1["stem.weight"]) / -1000.0))
        assert abs(share - evil_weight / (evil_weight + 400)) < 1e-3, (name, share)
        if name == "capped":
            assert share < 0.72 and record["weight_cap"] == 10 * median and record["capped"] == ["evil"]
        else:
            assert share > 0.999 and "weight_cap" not in record
    assert json.loads((tmp_path / "capped" / "metrics.jsonl").read_text().splitlines()[0])["weight_cap"] == 1000.0


# ---------------------------------------------------------------- device-chosen text in the log


FORGED = "\n2026-11-28 04:00:00,000 round 99 closed: 48 participant(s)"
CLEAR_SCREEN = "\x1b[2J"


@pytest.mark.mosquitto
@needs_mosquitto_pub
def test_device_chosen_text_reaches_the_coordinators_log_escaped(mosquitto, tmp_path: Path,
                                                                   processes: Processes) -> None:
    """Issue 39: a registration's software string went into the log as sent, so a device could forge a
    "round 99 closed" line or clear an operator's terminal. Hand-written registrations published with
    mosquitto_pub carry a forged line and ESC [2J in the software string and in the base digest (quoted in the
    digest_mismatch error text); the live coordinator's output holds each escaped, on the line of the record it
    belongs to. (A device id is a topic level: NAME_RE's characters only, and Mosquitto refuses control
    characters in topics.)"""
    manifest = tiny_manifest()
    artifacts = write_artifacts(tmp_path / "export", manifest, tiny_tensors())
    state = tmp_path / "state"
    coordinator = processes.start("coordinator", *coordinator_args(artifacts, mosquitto.url, state, FLEET, 1, 1, 60))
    hostile = FORGED + CLEAR_SCREEN
    software = json.dumps({"v": 1, "n_samples": 5, "base_digest": manifest.base_digest, "software": hostile})
    digest = json.dumps({"v": 1, "n_samples": 5, "base_digest": "sha256:" + hostile, "software": "x"})
    publish(mosquitto.url, TOPICS.register("evil"), software.encode(), retain=True)
    publish(mosquitto.url, TOPICS.register("liar"), digest.encode(), retain=True)  # read at its subscription
    wait_for(lambda: "evil" in (saved_state(state) or {}).get("registered", {}), 30, "the registration")
    wait_for(lambda: processes.log("coordinator").count("round 99 closed") >= 2, 30, "both hostile records")
    assert coordinator.poll() is None, processes.log("coordinator")
    assert saved_state(state)["registered"]["evil"]["software"] == hostile  # the data is kept as sent
    text = (tmp_path / "coordinator.log").read_bytes().decode()
    assert "\x1b" not in text  # no ESC byte at all (the progress bar writes none into a file)
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith("2026-11-28 04:00:00,000")], text  # no forged line
    escaped = FORGED.replace("\n", "\\n")
    for what in ("registered evil: 5 samples, software " + escaped + "\\x1b[2J", "digest_mismatch from liar"):
        [line] = [line for line in lines if what in line]  # the record is one line, the forgery inside it
        assert escaped + "\\x1b[2J" in line, (what, line)


def test_an_exception_quoting_device_text_is_logged_on_its_own_lines() -> None:
    """An internal error's message (the one record whose text is not the code's arguments) is escaped too; the
    traceback's own lines stay lines."""
    from fedper.coordinator.logs import log

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        try:
            raise ValueError("bad" + FORGED + CLEAR_SCREEN)
        except ValueError as e:
            log.error("internal error on a message from %s", "dev" + CLEAR_SCREEN, exc_info=e)
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "\x1b" not in text and "\nValueError" in text and "Traceback (most recent call last):\n" in text
    assert not [line for line in text.splitlines() if line.startswith("2026-11-28")], text
    assert text.splitlines()[-1] == "ValueError: bad" + FORGED.replace("\n", "\\n") + "\\x1b[2J"


# ---------------------------------------------------------------- state modes


def modes(directory: Path) -> dict[str, str]:
    """Each entry's permission bits under `directory` (itself as "."), from os.stat, in octal."""
    entries = [directory, *directory.rglob("*")]
    return {str(p.relative_to(directory)): oct(stat.S_IMODE(os.lstat(p).st_mode)) for p in entries}


@pytest.mark.mosquitto
def test_state_files_are_the_owners_alone_after_a_real_run_and_open_ones_are_tightened(
        tmp_path: Path, tiny_artifacts: Path, mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39: the DP noise secret sat in state.json mode 644 in a 755 directory. One DP round of a coordinator
    process and two ORT agents, whose state directories an earlier release left 755 with a 644 file in each:
    afterwards every file is 600 and every directory 700, each role said so in one line at start, and the
    secret is in the file only its owner reads."""
    old = os.umask(0o022)  # what a login shell gives: files 644 unless the code says otherwise
    try:
        coordinator_dir, agent_dirs = tmp_path / "coordinator", [tmp_path / "state0", tmp_path / "state1"]
        for directory in (coordinator_dir, *agent_dirs):
            directory.mkdir(mode=0o755)
            (directory / "left-by-an-earlier-release.json").write_text("{}")
            assert modes(directory) == {".": "0o755", "left-by-an-earlier-release.json": "0o644"}
        command = [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(tiny_artifacts), "--fleet",
                   "modes", "--rounds", "1", "--min-clients", "2", "--round-timeout", "60", "--state-dir",
                   str(coordinator_dir), "--broker", mosquitto.url, "--clip-norm", "1.0", "--dp-noise-multiplier",
                   "1.0", "--dp-target-epsilon", "1e6"]
        coordinator = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        logs: list[str] = []
        agents = [Agent(agent_config(tiny_artifacts, path, mosquitto.url, "modes", j, tmp_path), log=logs.append)
                  for j, path in enumerate(device_data(tmp_path))]
        err = run_fleet(coordinator, agents, 120, "\n".join(logs))
    finally:
        os.umask(old)
    assert '"secret": "' in (coordinator_dir / "state.json").read_text()
    for directory in (coordinator_dir, *agent_dirs):
        found = modes(directory)
        assert len(found) >= 4, found  # the run wrote its state there
        assert {name: mode for name, mode in found.items()
                if mode != ("0o700" if (directory / name).is_dir() else "0o600")} == {}, (directory, found)
    lines = [line for line in err.splitlines() if "was open to other users" in line]
    assert len(lines) == 1 and "(was 0755)" in lines[0] and "(was 0644)" in lines[0], err
    agent_lines = [r.getMessage() for r in caplog.records if r.name == "fedper.edge" and "open to other" in r.message]
    assert sorted(line.split()[2] for line in agent_lines) == [str(d) for d in agent_dirs], agent_lines


@pytest.mark.parametrize("unit", sorted((Path(__file__).resolve().parents[1] / "deploy" / "systemd").glob("*.service")),
                         ids=lambda u: u.name)
def test_the_systemd_units_create_files_for_their_user_only(unit: Path) -> None:
    """UMask=0077 in [Service]: whatever a service creates outside the code's own modes is its user's alone."""
    section, umask = "", []
    for line in unit.read_text().splitlines():
        section = line if line.startswith("[") else section
        if line.startswith("UMask="):
            umask.append((section, line))
    assert umask == [("[Service]", "UMask=0077")]


# ---------------------------------------------------------------- a poisoner in a small secure fleet


@pytest.mark.parametrize("liar", ["d3", "d0"])
def test_a_fleet_of_four_with_one_poisoner_under_secure_aggregation_trains_on(
        tmp_path: Path, liar: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39: with --secagg-min-group 4 (the default) halves of 4 devices need 8, so one device masking values
    beyond its clip norm every round stopped a fleet of 4 for good (5 of 5 rounds released nothing, the log
    promising halves). Now each failing session leaves one more suspect out: a failure without it clears it (a
    failed sum holds a liar). d3, the last suspect, is the lone suspect after 4 failing rounds and excluded; d0
    sits out first, and every round from then on releases the honest three's exact weighted mean (d0 is never
    excluded on a pass: a pass shows no lie)."""
    caplog.set_level(logging.INFO, "fedper.coordinator")
    length, rounds = 64, 6
    base = np.random.default_rng(3).normal(0, 1, length).astype(np.float32)

    def tensors(j: int) -> dict[str, np.ndarray]:
        shift = 0.0 if j < 0 else 0.4 / math.sqrt(length) * (j + 1)
        return {"w": (base + shift).astype(np.float32), "bn.running_mean": np.zeros(4, np.float32)}

    fleet = Fleet(tmp_path, 4, flat_manifest(length), tensors, 4096, clip_norm=1.0, rounds=rounds)
    assert fleet.coordinator.config.secure.min_group == 4
    fleet.liars[liar] = np.full(length + 4, 1.0)  # L2 norm 8.2 where the clip norm is 1
    honest = [n for n in fleet.names if n != liar]
    records_, models = [], []
    for _ in range(rounds):
        number = fleet.coordinator.round.number
        fleet.model = {k: v.copy() for k, v in fleet.coordinator.model.items()}
        fleet.updates = {name: {k: v + (fleet.model[k] - base if k == "w" else 0) for k, v in tensors(j).items()}
                         for j, name in enumerate(fleet.names)}
        fleet.participants.clear()
        fleet.advertise([n for n in fleet.names if n not in fleet.coordinator.strategy.excluded])
        fleet.pump(ticks=4)
        assert fleet.coordinator.round.number == number + 1 or fleet.coordinator.finished
        records_.append(fleet.record())
        models.append((fleet.expected(honest), {k: v.copy() for k, v in fleet.coordinator.model.items()}))
    released = [bool(r["devices"]) for r in records_]
    first = 4 if liar == "d3" else 1  # rounds (from 0) before the first release: d3 is the last to sit out
    assert released == [False] * first + [True] * (rounds - first), [r["secagg"] for r in records_]
    assert all(r["secagg"]["devices"] >= 3 for r in records_)  # one device out at most: no sum of fewer than 3
    for r, (expected, model) in zip(records_[first:], models[first:], strict=True):
        assert sorted(r["devices"]) == honest
        for k, v in expected.items():
            np.testing.assert_allclose(model[k], v, atol=1e-5)
    assert records_[-1]["secagg"]["excluded"] == (["d3"] if liar == "d3" else [])
    promises = [r.message for r in caplog.records if "sums them in halves" in r.message]
    assert promises and all("or leaves one out" in m for m in promises)  # no promise of halves alone
    assert any("sits this session out" in r.message for r in caplog.records)


# ---------------------------------------------------------------- a lying coordinator across sessions


def test_real_agents_advertise_and_sign_once_per_session_across_sessions_and_restarts(
        tmp_path: Path, tiny_artifacts: Path, mosquitto) -> None:
    """Issue 39: a device signs the setup's digest and the survivor set, and the coordinator picks the session
    id, so one that runs a session to the signatures, aborts it and runs it again with the same id and roster
    (the same digest) could hand devices of the second run the first run's signatures on another survivor set
    (on the kernel that recovered a device's input to 1.46e-8). Three real ORT agents, a coordinator scripted by
    hand over Mosquitto: session 77 runs to the survivors' signatures, then RoundInfo names 78 (each advertises
    fresh keys) and 77 again: nobody advertises in 77 a second time, nor does an agent restarted on its state
    directory; their state directories name the sessions, mode 600."""
    fleet, session = "replay", 77
    manifest = Manifest.load(tiny_artifacts)
    impostor, info = Impostor.open_round(mosquitto.port, fleet, tiny_artifacts, session)
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 3, logs)
    names = [a.config.client_id for a in agents]
    stops = {name: threading.Event() for name in names}
    threads = run_agents(agents, stops)

    def relay(name: str, body: dict[str, Any]) -> None:
        impostor.publish(f"relay/{name}", to_json({"v": 1, "round": 1, "session": session, **body}).encode())

    def adverts_in(name: str, number: int) -> int:
        with impostor.lock:
            return len([m for m in impostor.inbox.get(name, [])
                        if m["stage"] == "advertise" and m["session"] == number])

    def wait_for_log(name: str, text: str) -> None:
        for _ in range(300):
            if any(text in line for line in logs[name]):
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} never logged {text!r}: {logs[name]}")

    try:
        impostor.exchange_keys(names, session, manifest, max(a.n_samples for a in agents))
        for name in names:
            relay(name, {"stage": "mask", "excluded": []})
        for name in names:
            wait_for_log(name, "masked input sent")
        for name in names:  # the first run's survivor set, signed by a majority: what a replay would hand out
            relay(name, {"stage": "consistency", "survivors": [0, 1]})
        signed = impostor.wait_for("consistency", ["dev0", "dev1"])
        assert all(m["session"] == session for m in signed.values())
        impostor.publish("round", to_json({**info, "secagg_session": session + 1}).encode(), retain=True)
        impostor.wait_for("advertise", names, count=2)  # a new session: fresh keys, allowed
        impostor.publish("round", to_json(info).encode(), retain=True)  # 77 again: the replay
        for name in names:
            wait_for_log(name, f"session {session}: not taking part: this device advertised keys in round 1 "
                               f"session {session} already")
        stops["dev0"].set()
        threads[0].join(20)
        restarted = Agent(agents[0].config, log=logs["dev0"].append)  # the same state directory
        logs["dev0"].append("-- restarted --")
        stops["dev0"] = threading.Event()
        threads += run_agents([restarted], stops)
        for _ in range(300):
            if logs["dev0"].count("-- restarted --") and "not taking part" in logs["dev0"][-1]:
                break
            time.sleep(0.1)
        time.sleep(1.0)
    finally:
        for stop in stops.values():
            stop.set()
        for thread in threads:
            thread.join(20)
        impostor.close()
    assert [adverts_in(name, session) for name in names] == [1, 1, 1], impostor.inbox
    assert [adverts_in(name, session + 1) for name in names] == [1, 1, 1]
    after_restart = logs["dev0"][logs["dev0"].index("-- restarted --"):]
    assert any("not taking part" in line and f"session {session} already" in line for line in after_restart), \
        after_restart
    for agent in agents:
        path = agent.config.state_dir / ADVERTISED_FILE
        assert json.loads(path.read_text()) == {"round": 1, "sessions": [session, session + 1]}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
