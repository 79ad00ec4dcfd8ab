"""The emulator's commands change no option silently, say how far they are, and read at 80 columns: 0 rounds or
clients are refused, --resume names each option it does not apply, progress goes to a log a line a round
(and through the steps of a round), and every option name stands whole in --help."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedper.cli import app as fedper_app
from fedper.emulate.cli import app
from fedper.emulate.data import DataConfig, load_fleet_data
from fedper.emulate.fleet import Fleet, FleetConfig
from fedper.emulate.progress import Board

# --scale 0.2 also scales --rounds: --rounds 10 is 2 rounds
TINY = ["--dataset", "digits", "--clients", "2", "--classes-per-client", "2", "--input-size", "16", "--width", "0.25",
        "--local-epochs", "1", "--batch-size", "16", "--scale", "0.2", "--device", "cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.mark.parametrize("option", ["--rounds", "--clients", "--local-epochs", "--batch-size", "--classes-per-client"])
def test_zero_is_refused_not_replaced(tmp_path: Path, option: str) -> None:
    result = CliRunner().invoke(app, ["run", option, "0", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and option in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_resume_names_each_option_it_does_not_apply_and_keeps_the_saved_rounds(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    first = CliRunner().invoke(app, ["run", *TINY, "--lr", "0.05", "--rounds", "1", "--out", out, "--no-progress"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["run", "--resume", "--lr", "0.5", "--width", "0.25", "--out", out,
                                     "--no-progress"])
    assert again.exit_code == 0, again.output
    assert "--lr 0.5 does not apply: the resumed run keeps its saved lr 0.05" in again.output
    assert "--width" not in again.output  # given, but the saved value: nothing to say
    assert "after 1 rounds" in again.output  # no --rounds: the saved 1, not the default 100
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["fleet"]["lr"] == 0.05 and config["rounds"] == 1
    more = CliRunner().invoke(app, ["run", "--resume", "--rounds", "10", "--out", out, "--no-progress"])
    assert more.exit_code == 0 and "after 2 rounds" in more.output and "does not apply" not in more.output
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_without_a_terminal_a_run_prints_a_line_a_round(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", *TINY, "--rounds", "10", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("fedper K_P=2: started, 2 rounds") for line in lines)
    for r in (1, 2):
        assert sum(line.startswith(f"fedper K_P=2: round {r}/2, mean acc ") for line in lines) == 1, result.output


@pytest.mark.parametrize(("algorithm", "engine"), [("fedper", "sequential"), ("fedbabu", "vmap")])
def test_a_rounds_steps_are_counted_as_round_steps_says(algorithm: str, engine: str) -> None:
    """The bar's unit: every client-batch of local training and of the fine-tune at evaluation (FedBABU), on both
    engines, adds up to round_steps, so the bar reaches the round's end exactly when the round does."""
    data = load_fleet_data(DataConfig(clients=3, classes_per_client=2, input_size=8, scale=0.1))
    fleet = Fleet(FleetConfig(width=0.25, algorithm=algorithm, kp=1, local_epochs=2, batch_size=8, engine=engine,
                              clients_per_round=2), data)
    state = fleet.init()
    expected, steps = fleet.round_steps(state), []
    state, _ = fleet.run_round(state, on_step=steps.append)
    assert sum(steps) == expected > 0
    # by hand: two training epochs of ceil(n / 8) batches for each of the 2 selected clients, and FedBABU's
    # fine-tune epoch for all 3 (when no client's count is 1 mod 8, whose lone last sample joins a batch)
    n = [int(torch.numel(train)) for train, _ in data.clients]
    by_hand = sum(2 * -(-n[j] // 8) for j in fleet.selected(1, 0))
    by_hand += sum(-(-k // 8) for k in n) if algorithm == "fedbabu" else 0
    if all(k % 8 != 1 for k in n):
        assert expected == by_hand


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_terminal_the_bar_moves_within_a_round() -> None:
    board = Board(stream=Terminal())
    with board:
        board.report({"event": "start", "run": "r", "label": "fedper", "rounds": 4, "done": 1})
        board.report({"event": "step", "run": "r", "steps": 3, "of": 10})
        task = board.bars.tasks[0]
        assert task.completed == pytest.approx(1.3) and "round 2/4, step 3/10" in task.fields["where"]
        board.report({"event": "round", "run": "r", "round": 2, "rounds": 4, "accuracy": 0.5, "wall_s": 1.0})
        assert task.completed == 2 and task.fields["acc"] == "mean acc 0.500"


def _option_names(command) -> list[str]:
    return [name for param in command.params for name in (*param.opts, *param.secondary_opts) if name.startswith("--")]


@pytest.mark.parametrize("path", [["emulate", "run"], ["emulate", "figure"], ["plot"], ["demo"]])
def test_every_option_name_is_whole_in_help_at_80_columns(path: list[str]) -> None:
    import typer.main

    group = typer.main.get_command(fedper_app)
    command = group
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    for runner_app, args in ((fedper_app, path),) + (((app, path[1:]),) if path[0] == "emulate" else ()):
        result = CliRunner().invoke(runner_app, [*args, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        words = set(result.output.replace(",", " ").split())
        missing = [name for name in _option_names(command) if name not in words]
        assert not missing, f"cut or missing in `{' '.join(args)} --help`: {missing}\n{result.output}"
        assert "…" not in result.output
