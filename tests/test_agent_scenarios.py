"""The scenario vectors (tests/vectors/scenarios/, docs/protocol.md 9.1): make_scenarios.py reproduces them from
edge/engine.py byte for byte (so they cannot drift from the engine), and the checked-in files show what each
scenario claims, read from the JSON alone: an update carries exactly the tensors that training returned (or that
were saved), never a head tensor; one job is out at a time; and the claims of the divergence scenarios. The web
agent replays the same files: web/test/scenarios.test.mjs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vectors import make_scenarios

from fedper.manifest import Manifest

VECTORS = Path(__file__).parent / "vectors"
DIR = VECTORS / "scenarios"
FILES = sorted(DIR.glob("*.json"))
MANIFEST = Manifest.load(VECTORS)


def load(name: str) -> dict[str, Any]:
    return json.loads((DIR / f"{name}.json").read_text())


def outputs(scenario: dict[str, Any], kind: str) -> list[tuple[int, dict[str, Any]]]:
    """(step index, entry) of every output of `kind` ("job", "update", "publish")."""
    return [(i, o) for i, step in enumerate(scenario["steps"]) for o in step.get("out", []) if kind in o]


def test_the_scenarios_are_reproduced_from_the_engine(tmp_path: Path) -> None:
    assert {p.stem for p in FILES} == set(make_scenarios.SCENARIOS)
    make_scenarios.write(tmp_path)
    for path in FILES:
        stale = f"{path.name} is stale: rerun make_scenarios.py"
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), stale


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_updates_carry_what_training_returned_and_one_job_is_out_at_a_time(path: Path) -> None:
    scenario = json.loads(path.read_text())
    trained = {scenario["saved"]["round"]: scenario["saved"]["update"]} if scenario["saved"] else {}
    out_jobs: list[dict[str, Any]] = []
    shared = set(MANIFEST.names(shared=True))
    for step in scenario["steps"]:
        event = step["event"]
        answers = {"checked": "check", "trained": "train", "evaluated": "evaluate"}.get(event["type"])
        if answers:
            assert [j["job"] for j in out_jobs] == [answers], f"{event['type']} answers the one job out"
            job = out_jobs.pop()
            if answers == "train":
                trained[job["round"]] = event["update"]
        for entry in step.get("out", []):
            if "job" in entry:
                out_jobs.append(entry)
                assert len(out_jobs) == 1, "a second job while one is out"
            if "update" in entry:
                update = entry["update"]
                assert set(update["tensors"]) == shared  # the head never leaves
                assert update["tensors"] == trained[update["meta"]["round"]]
                assert update["meta"]["base_digest"] == MANIFEST.base_digest


def test_a_round_info_while_training_asks_for_no_second_job_and_a_stale_one_is_ignored() -> None:
    s = load("round-info-during-training")
    assert [o["round"] for _, o in outputs(s, "job")] == [2]
    assert [o["update"]["meta"]["round"] for _, o in outputs(s, "update")] == [2]
    assert s["steps"][-1]["phase"] == "answered"  # round 1's model is no reason to move back to round 1
    assert not any("/model/r1/" in topic for topic in s["steps"][-1]["subscriptions"])


def test_an_update_trained_on_a_version_out_of_the_window_is_not_sent() -> None:
    s = load("async-versions")
    sent = [o["update"]["meta"]["round"] for _, o in outputs(s, "update")]
    assert sent == [1, 1]  # the saved update of round 1, resent twice; round 2's update is never sent
    assert s["steps"][-1]["event"]["type"] == "trained" and s["steps"][-1]["out"] == []


def test_presence_follows_the_conditions_and_is_online_at_once_without_them() -> None:
    presences = [o["text"] for _, o in outputs(load("presence"), "publish") if "/presence/" in o["publish"]]
    assert presences == ["offline", "online", "offline", "online"]
    for path in FILES:
        scenario = json.loads(path.read_text())
        if not scenario["settings"]["conditions"]:
            assert {o["text"] for _, o in outputs(scenario, "publish") if "/presence/" in o["publish"]} == {"online"}


def test_stale_input_and_refused_input_ask_for_no_work() -> None:
    assert outputs(load("stale-round-info"), "job") == []
    refusals = load("refusals")
    assert [i for i, _ in outputs(refusals, "job")] == [len(refusals["steps"]) - 2]  # only the right model trains
    selection = load("selection")
    first_job = outputs(selection, "job")[0][0]
    invited = selection["steps"][first_job - 3]["event"]  # the step before round 2's three chunks
    assert json.loads(invited["text"]) == {"v": 1, "round": 2}
    assert load("errors")["steps"][-1]["raises"] == "AgentError"
