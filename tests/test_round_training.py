"""The fleet's training settings in one place (docs/protocol.md, RoundInfo): the coordinator's Training group sends
each round's lr (after its schedule), local epochs and batch size; the Python agent trains with them where sent
and with its own flags otherwise. The live run is tests/test_agent_fleet.py's settings test; the page's side is
web/test/training.test.mjs on the same vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedper.coordinator.config import Config, Training
from fedper.edge.agent import LocalTraining
from fedper.wire import RoundInfo, WireError

VECTORS = Path(__file__).parent / "vectors"
OWN = LocalTraining(lr=0.3, local_epochs=1, batch_size=4)


def vector(name: str) -> bytes:
    return (VECTORS / f"{name}.bin").read_bytes()


def test_the_coordinators_settings_replace_the_devices_own_where_sent() -> None:
    expected = json.loads((VECTORS / "round-training.expected.json").read_text())["message"]
    assert OWN.of_round(RoundInfo.decode(vector("round-training"))) == LocalTraining(
        expected["lr"], expected["local_epochs"], expected["batch_size"])
    assert OWN.of_round(RoundInfo.decode(vector("round"))) == OWN
    lr_only = vector("round-training").replace(b',"local_epochs":3,"batch_size":64', b"")
    assert OWN.of_round(RoundInfo.decode(lr_only)) == LocalTraining(expected["lr"], 1, 4)


@pytest.mark.parametrize(("field", "bad"), [("local_epochs", b"0"), ("local_epochs", b"1001"), ("batch_size", b"0"),
                                            ("batch_size", b"2.5"), ("lr", b'"fast"')])
def test_settings_out_of_range_are_refused(field: str, bad: bytes) -> None:
    frame = vector("round-training")
    start = frame.index(f'"{field}":'.encode()) + len(field) + 3
    end = min(i for i in (frame.find(b",", start), frame.find(b"}", start)) if i >= 0)
    with pytest.raises(WireError, match=field):
        RoundInfo.decode(frame[:start] + bad + frame[end:])


def test_an_agent_that_knows_no_settings_ignores_them() -> None:
    """Compatibility: a field a receiver does not know is ignored, so an older agent reads a RoundInfo with settings
    as before and trains with its own flags."""
    body = json.loads(vector("round-training"))
    body["momentum"] = 0.9  # a setting a later coordinator might add
    info = RoundInfo.decode(json.dumps(body).encode())
    assert (info.round, info.lr) == (body["round"], body["lr"])


def test_the_lr_schedule_per_round() -> None:
    """--lr 0.08 --lr-milestones 2,4 --lr-decay 0.5: rounds 1-2 at 0.08, 3-4 at 0.04, then 0.02 (by hand)."""
    training = Training(lr=0.08, lr_milestones="2,4", lr_decay=0.5, local_epochs=3)
    assert [training.round_fields(r)["lr"] for r in range(1, 7)] == pytest.approx([0.08, 0.08, 0.04, 0.04, 0.02, 0.02])
    assert training.round_fields(1) == {"lr": 0.08, "local_epochs": 3}  # batch size left to the devices
    assert Training().round_fields(5) == {}  # nothing set: RoundInfo is what it was before settings existed


@pytest.mark.parametrize(("options", "message"), [
    ({"lr": 0.0}, "--lr must be > 0"), ({"lr": float("nan")}, "--lr must be > 0"),
    ({"lr_milestones": "3"}, "--lr-milestones needs --lr"), ({"lr": 0.1, "lr_milestones": "3,x"}, "'x'"),
    ({"lr": 0.1, "lr_decay": 0.0}, "--lr-decay must be > 0"),
])
def test_bad_settings_are_refused_in_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config.of(rounds=2, **options)
