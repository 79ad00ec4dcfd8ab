"""A run on disk: DIR/config.json, DIR/metrics.jsonl (one line per round), DIR/summary.json and
DIR/state.pt (rewritten atomically after every round), so a killed run resumes from its last round
and ends exactly where an uninterrupted one would."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from fedper.algorithms import Algorithm
from fedper.emulate.data import DataConfig, load_fleet_data
from fedper.emulate.fleet import Fleet, FleetConfig, load_state, resolve_device, save_state

CONFIG, METRICS, SUMMARY, STATE = "config.json", "metrics.jsonl", "summary.json", "state.pt"


class RunError(ValueError):
    """A run directory that cannot be started or resumed as asked."""


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    fleet: FleetConfig
    rounds: int = 100
    device: str = "auto"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        body = json.loads(text)
        return cls(DataConfig(**body["data"]), FleetConfig(**body["fleet"]), body["rounds"], body["device"])


def _read_metrics(path: Path, upto: int) -> list[dict]:
    """The metric lines of rounds 1..upto: a line written after the last saved state is dropped."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in lines if m["round"] <= upto]


def run_experiment(
    config: RunConfig,
    out: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    algorithm: Algorithm | None = None,
) -> dict:
    """Run (or resume) `config` in `out`; returns the summary. On resume, the rounds of `config`
    may differ from the saved ones (to extend a run); everything else comes from DIR/config.json."""
    out = Path(out)
    state_path = out / STATE
    if resume:
        if not state_path.exists():
            raise RunError(f"nothing to resume: {state_path} does not exist")
        saved = RunConfig.from_json((out / CONFIG).read_text())
        config = RunConfig(saved.data, saved.fleet, config.rounds, saved.device)
    elif state_path.exists():
        raise RunError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    device = resolve_device(config.device)
    fleet = Fleet(config.fleet, load_fleet_data(config.data, device), algorithm)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(config.to_json())
    state = load_state(state_path, device) if resume else fleet.init()
    history = _read_metrics(out / METRICS, state.round)
    with (out / METRICS).open("w") as f:
        f.writelines(json.dumps(m) + "\n" for m in history)
    with _progress(show_progress) as progress:
        task = progress.add_task(f"{config.fleet.algorithm} ({fleet.engine})", total=config.rounds,
                                 completed=state.round, acc=history[-1]["mean_accuracy"] if history else 0.0)
        while state.round < config.rounds:
            state, metrics = fleet.run_round(state)
            with (out / METRICS).open("a") as f:
                f.write(json.dumps(metrics) + "\n")
            save_state(state, state_path)
            history.append(metrics)
            progress.update(task, advance=1, acc=metrics["mean_accuracy"])
    summary = _summary(config, fleet, history)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(config: RunConfig, fleet: Fleet, history: list[dict]) -> dict:
    last = history[-1] if history else {}
    return {
        "algorithm": config.fleet.algorithm,
        "model": config.fleet.model,
        "kp": config.fleet.kp,
        "engine": fleet.engine,
        "device": str(fleet.device),
        "rounds": len(history),
        "clients": len(fleet.data.clients),
        "n_train": fleet.data.n_train,
        "final_mean_accuracy": last.get("mean_accuracy"),
        "final_std_accuracy": last.get("std_accuracy"),
        "final_accuracy": last.get("accuracy"),
        "best_mean_accuracy": max((m["mean_accuracy"] for m in history), default=None),
        "wall_s": sum(m["wall_s"] for m in history),
        "mean_round_s": statistics.fmean(m["wall_s"] for m in history) if history else None,
    }


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("round"),
        TextColumn("mean acc {task.fields[acc]:.3f}"), TimeRemainingColumn(), disable=not enabled,
    )
