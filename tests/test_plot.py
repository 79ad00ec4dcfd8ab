"""`fedper plot RUN...`: accuracy (mean and spread over devices) and loss per round of emulator runs and
coordinator state dirs on one figure, with each emulated run's chance line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedper.cli import app
from fedper.cli.plot import PlotError, read_run
from fedper.emulate.data import DataConfig
from fedper.emulate.experiment import RunConfig, run_experiment
from fedper.emulate.fleet import FleetConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-round emulator run: 3 clients of 2 digits classes each."""
    out = tmp_path_factory.mktemp("plot") / "run"
    config = RunConfig(DataConfig(clients=3, classes_per_client=2, input_size=8, scale=0.2),
                       FleetConfig(width=0.25, local_epochs=1, batch_size=16), rounds=2, device="cpu")
    run_experiment(config, out, show_progress=False)
    return out


def test_an_emulated_run_gives_its_clients_spread_its_loss_and_its_chance_line(emulated: Path) -> None:
    rows = [json.loads(line) for line in (emulated / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((emulated / "data.json").read_text())
    series = read_run(emulated)
    assert series.x == [1, 2] and not series.fleet
    assert series.accuracy == pytest.approx([np.mean(r["accuracy"]) for r in rows])
    assert series.low == [min(r["accuracy"]) for r in rows] and series.high == [max(r["accuracy"]) for r in rows]
    assert series.loss == pytest.approx([np.mean(r["loss"]) for r in rows])
    assert series.data == "digits (scikit-learn)" and "fedper, K_P=2" in series.label
    # FedPer has a head per client: chance is each client's most frequent test class, counted here by hand
    from fedper.emulate.data import client_split, read_source

    cfg = DataConfig(clients=3, classes_per_client=2, input_size=8, scale=0.2)
    arrays, indices = client_split(cfg, read_source(cfg))
    y = np.concatenate([a.y for a in arrays])
    shares = [max(np.unique(y[test], return_counts=True)[1]) / len(test) for _, test in indices]
    assert series.chance == pytest.approx(np.mean(shares)) == pytest.approx(info["chance_accuracy"])


def test_a_coordinator_state_dir_counts_the_served_models_aggregations(tmp_path: Path) -> None:
    """The devices measure the model served at the start of round r, which holds r - 1 aggregations; the band
    is the mean ± the std the coordinator recorded, clipped to 0..1."""
    state = tmp_path / "coord-state"
    state.mkdir()
    records = [{"round": 1, "accuracy_mean": 0.2, "accuracy_std": 0.3, "participants": 2},
               {"round": 2, "accuracy_mean": None, "accuracy_std": None, "participants": 0},
               {"round": 3, "accuracy_mean": 0.9, "accuracy_std": 0.25, "participants": 2}]
    (state / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    series = read_run(state)
    assert series.fleet and series.x == [0, 2] and series.accuracy == [0.2, 0.9]
    assert series.low == pytest.approx([0.0, 0.65]) and series.high == pytest.approx([0.5, 1.0])
    assert series.loss == [] and series.chance is None


def test_plot_draws_several_runs_on_one_png(emulated: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy_mean": 0.5, "accuracy_std": 0.1}) + "\n")
    png = tmp_path / "both.png"
    result = CliRunner().invoke(app, ["plot", str(emulated), str(state), "--label", "emulated", "--out", str(png)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 20_000 and f"wrote {png}" in result.output


@pytest.mark.parametrize(("name", "content", "message"), [
    (None, None, "holds no metrics.jsonl"),
    ("f.txt", "x", "is not a folder"),
    ("metrics.jsonl", "", "no finished round yet"),
    ("metrics.jsonl", '{"round": 1}\n', "neither an emulator's nor a coordinator's"),
])
def test_what_cannot_be_drawn_is_one_line_naming_it(tmp_path: Path, name: str | None, content: str | None,
                                                     message: str) -> None:
    if name is not None:
        (tmp_path / name).write_text(content or "")
    path = tmp_path / name if name == "f.txt" else tmp_path
    with pytest.raises(PlotError, match=message):
        read_run(path)
    result = CliRunner().invoke(app, ["plot", str(path), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
