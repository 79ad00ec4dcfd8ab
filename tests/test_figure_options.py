"""The figure command's options: the smoke preset is what docs/reproducing.md says it is and the command line
overrides it; --jobs runs curves in parallel processes with the results of one process."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch
from typer.testing import CliRunner

from fedper.emulate.cli import app
from fedper.emulate.figures import PRESETS, make_figure, with_preset

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproducing.md"
UNSET = {"scale": None, "rounds": None, "model": None, "width": None, "local_epochs": None, "batch_size": None,
         "lr": None, "momentum": None, "clients": None, "dataset": None}


def documented_smoke_flags() -> dict[str, object]:
    """The options of the docs' `SMOKE="..."` line (the flags `--preset smoke` stands for), typed as the preset's."""
    lines = re.findall(r'^SMOKE="([^"]+)"$', DOCS.read_text(), flags=re.MULTILINE)
    assert len(lines) == 1, f"expected one SMOKE=\"...\" line in {DOCS}, found {len(lines)}"
    tokens = shlex.split(lines[0])
    flags: dict[str, object] = {}
    for flag, value in zip(tokens[::2], tokens[1::2], strict=True):
        key = flag.removeprefix("--").replace("-", "_")
        preset_value = PRESETS["smoke"].get(key)
        if isinstance(preset_value, list):
            flags.setdefault(key, []).append(value)  # repeatable (--model)
        else:
            flags[key] = type(preset_value)(value) if preset_value is not None else value
    return flags


def test_smoke_preset_is_the_documented_flags():
    assert documented_smoke_flags() == PRESETS["smoke"]


def test_smoke_preset_fills_only_what_the_command_left_unset():
    resolved = with_preset("smoke", UNSET | {"lr": 0.01, "clients": 5})
    assert resolved["lr"] == 0.01 and resolved["clients"] == 5  # the command's own values win
    assert {k: resolved[k] for k in PRESETS["smoke"]} == PRESETS["smoke"] | {"lr": 0.01}
    assert with_preset(None, UNSET) == UNSET


def test_digits_preset_is_the_smoke_training_on_digits():
    resolved = with_preset("digits", UNSET)
    assert resolved["dataset"] == "digits" and resolved["scale"] is None
    assert {k: resolved[k] for k in ("width", "local_epochs", "batch_size", "lr", "momentum", "model")} == \
        {k: PRESETS["smoke"][k] for k in ("width", "local_epochs", "batch_size", "lr", "momentum", "model")}


def test_a_setting_that_leaves_a_client_without_samples_stops_before_any_curve_trains(tmp_path):
    """5 % of digits is 90 images: at k = 8 some of 10 clients get no test image. The command says so at once,
    naming the curve and the options to change, instead of after the k = 4 curves have trained."""
    result = CliRunner().invoke(app, ["figure", "fig2", "--scale", "0.05", "--dataset", "digits", "--out",
                                      str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "curve mobilenet_v1, k=8" in result.output and "--scale" in result.output
    assert "--classes-per-client" in result.output
    assert not (tmp_path / "fig2").exists()


def test_unknown_preset_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["figure", "fig2", "--preset", "fast", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown preset 'fast'" in result.output and "smoke" in result.output


def test_smoke_preset_still_needs_the_data(tmp_path):
    """The preset names no data: fig2 under it asks for CIFAR-10, and nothing has run."""
    result = CliRunner().invoke(app, ["figure", "fig2", "--preset", "smoke", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "cifar10, which needs --data" in result.output
    assert not (tmp_path / "fig2").exists()


def _metrics_without_wall_time(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def test_jobs_runs_the_curves_in_processes_with_the_same_results(tmp_path, capfd):
    """--jobs 2 trains fig3's two curves in two single-threaded processes: each run's metrics equal those of
    the same run done in this process, single-threaded; without a terminal each curve's progress comes back
    from its process as a line a round, named by its curve."""
    common = {"dataset": "digits", "scale": 0.2, "rounds": 5, "models": ("mobilenet_v1",),
              "fleet_overrides": {"width": 0.25, "local_epochs": 1, "batch_size": 32},
              "data_overrides": {"clients": 3, "input_size": 16}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        make_figure("fig3", out=tmp_path / "one", jobs=1, show_progress=False, **common)
        capfd.readouterr()
        png = make_figure("fig3", out=tmp_path / "two", jobs=2, show_progress=True, **common)
    finally:
        torch.set_num_threads(threads)
    assert png.exists()
    lines = capfd.readouterr().err.splitlines()
    assert "2 runs, 2 at a time" in lines
    for curve in ("mobilenet_v1: fedavg", "mobilenet_v1: fedper"):
        assert f"{curve}: started, 1 round" in lines, lines  # 5 rounds x --scale 0.2
        assert any(line.startswith(f"{curve}: round 1/1, mean acc ") for line in lines), lines
        assert f"{curve}: done" in lines
    runs = sorted(p.name for p in (tmp_path / "one" / "fig3").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert _metrics_without_wall_time(tmp_path / "one" / "fig3" / run) == \
            _metrics_without_wall_time(tmp_path / "two" / "fig3" / run)
