"""A run on disk: DIR/config.json, DIR/data.json (what the data set is, each client's sample counts and
the accuracy of a guess from the label prior), DIR/metrics.jsonl (one line per round), DIR/summary.json,
DIR/state.safetensors (a fedper.checkpoint, rewritten atomically after every round), so a killed
run resumes from its last round and ends exactly where an uninterrupted one would, and, when it ends,
DIR/model.safetensors: its shared tensors, which `--init DIR` starts another run or an export from. A run saved
before the checkpoint format (DIR/state.pt, written by torch.save) is converted once on --resume.

Under torch.distributed (torchrun, or `run_spawned`) each rank trains its share of the clients;
rank 0 alone reads and writes the directory, and the state holds every client's local tensors."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from fedper import checkpoint
from fedper.algorithms import Algorithm
from fedper.emulate import distributed
from fedper.emulate.data import DataConfig, FleetData, load_fleet_data, same_images
from fedper.emulate.fleet import Fleet, FleetConfig, FleetState, load_state, resolve_device, save_state
from fedper.emulate.progress import Board, Event
from fedper.models.warm_start import RUN_WEIGHTS, save_weights, warm_start

CONFIG, METRICS, SUMMARY, STATE = "config.json", "metrics.jsonl", "summary.json", "state.safetensors"
DATA = "data.json"
STEP_REPORT_S = 0.5  # a run reports its steps within a round at most this often
LEGACY_STATE = "state.pt"  # torch.save's pickle, before the checkpoint format: read once, on --resume

log = logging.getLogger("fedper.emulate")


class RunError(ValueError):
    """A run directory that cannot be started or resumed as asked."""


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    fleet: FleetConfig
    rounds: int = 100
    device: str = "auto"
    init: str | None = None  # a checkpoint the run starts from (fedper.models.warm_start), else the seeded weights

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        body = json.loads(text)
        return cls(DataConfig(**body["data"]), FleetConfig(**body["fleet"]), body["rounds"], body["device"],
                   body.get("init"))

    def with_budget_of(self, other: RunConfig) -> RunConfig:
        """This run with `other`'s rounds: a run extended or cut short is the same run."""
        return replace(self, rounds=other.rounds)

    def budget_spent(self, summary: dict) -> bool:
        """Whether a run that wrote `summary` ran this config's rounds."""
        return summary["rounds"] == self.rounds


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
    report: Callable[[Event], None] | None = None,
    label: str | None = None,
) -> dict:
    """Run (or resume) `config` in `out`; returns the summary. On resume, the rounds of `config`
    may differ from the saved ones (to extend a run); everything else comes from DIR/config.json.
    Progress goes to `report` (events keyed by `out`, named `label`) when given, else to a bar of its own
    (or a line a round without a terminal) when `show_progress`."""
    if report is None:
        with Board(show_progress and distributed.rank() == 0) as board:
            return run_experiment(config, out, resume=resume, algorithm=algorithm, report=board.report, label=label)
    out = Path(out)
    config, saved, history = distributed.from_rank0(lambda: _prepare(config, out, resume))
    config = _broadcast_init(config, saved)
    device = distributed.local_device(resolve_device(config.device))
    data = load_fleet_data(config.data, device)
    if distributed.world_size() > len(data.clients):
        raise RunError(f"{distributed.world_size()} processes for {len(data.clients)} clients: at most one per client")
    if distributed.world_size() > 1 and config.fleet.clients_per_round is not None:
        raise RunError("--clients-per-round runs in one process: a rank could hold no selected client, "
                       "so drop --world-size (or torchrun) or --clients-per-round")
    members = distributed.share(len(data.clients), distributed.rank(), distributed.world_size())
    fleet = Fleet(config.fleet, data, algorithm, members=members)
    weights = _warm_start(fleet, config.init, device) if saved is None and config.init else None
    state = fleet.init() if saved is None else _to_device(saved, device)
    writer = distributed.rank() == 0
    if writer:
        _begin(out, config, fleet, history)
    tell = report if writer else (lambda event: None)
    key = str(out)
    tell({"event": "start", "run": key, "label": label or f"{config.fleet.algorithm} K_P={config.fleet.kp}",
          "rounds": config.rounds, "done": state.round})
    budget_stopped = False
    while state.round < config.rounds:
        if fleet.budget_stops(state):  # --dp-target-epsilon: also on resume, from the saved accountant
            budget_stopped = True
            break
        state, metrics = fleet.run_round(state, on_step=_StepReporter(tell, key, fleet.round_steps(state)))
        local = distributed.gather_local(state.local, members)
        if writer:
            _record(out, replace(state, local=local), metrics)
        history.append(metrics)
        tell({"event": "round", "run": key, "round": state.round, "rounds": config.rounds,
              "accuracy": metrics["mean_accuracy"], "wall_s": metrics["wall_s"]})
    tell({"event": "end", "run": key})
    if writer:
        _save_weights(out, config, fleet, state)
    summary = _summary(config, fleet, history)
    if weights is not None:
        summary["weights"] = weights
    if state.privacy is not None:
        summary["dp"] = _privacy_summary(config, state, budget_stopped)
    if writer:
        checkpoint.write_json(out / SUMMARY, summary, indent=2)
    return summary


def _broadcast_init(config: RunConfig, saved: FleetState | None) -> RunConfig:
    """With --init, every client starts from the checkpoint (its local tensors too), as agents from one export do."""
    if config.init and saved is None:
        return replace(config, fleet=replace(config.fleet, local_init="broadcast"))
    return config


def _save_weights(out: Path, config: RunConfig, fleet: Fleet, state: FleetState) -> None:
    """What `--init DIR` starts another run or an export from."""
    save_weights(out / RUN_WEIGHTS, state.shared, architecture=config.fleet.model, width=config.fleet.width,
                 input_size=fleet.data.input_size, classes=fleet.data.classes, device_local=fleet.local_names)


def _warm_start(fleet: Fleet, init: str, device: torch.device) -> dict:
    """Start `fleet` from the checkpoint `init` (every client's local tensors from it too, as agents from one
    export start); returns where the weights came from, with its notes."""
    from fedper.training import load_tensors

    start = warm_start(init, fleet.model, fleet.config.model)
    fleet.initial = {n: t.to(device) for n, t in start.state.items()}
    load_tensors(fleet.model, fleet.initial)
    return {**start.record, "notes": list(start.notes)}


def _begin(out: Path, config: RunConfig, fleet: Fleet, history: list[dict]) -> None:
    """A run directory's config.json, data.json and the metrics of its saved rounds."""
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write(out / CONFIG, config.to_json().encode())
    checkpoint.write_json(out / DATA, describe_data(fleet), indent=2)
    with (out / METRICS).open("w") as f:
        f.writelines(json.dumps(m) + "\n" for m in history)


def _record(out: Path, state: FleetState, metrics: dict) -> None:
    """A finished round: its metrics line, then the state (so a line without its state is dropped on resume)."""
    with (out / METRICS).open("a") as f:
        f.write(json.dumps(metrics) + "\n")
    save_state(state, out / STATE)


Pending = tuple[RunConfig, Path, bool, str]  # a run's config, directory, whether to resume it, its label


def run_stacked(runs: Sequence[Pending], *, report: Callable[[Event], None], budget: int | None = None) -> list[dict]:
    """Run (or resume) every run of `runs` in this process, their rounds stacked (emulate/stacked.py: the runs
    that share a step train as rows of one vmapped step, chunked to `budget` bytes or the device's memory);
    each directory ends as run_experiment leaves it, and every run keeps its own rounds. Returns the summaries.
    A run's wall_s per round is its share of the stacked training plus its own aggregation and evaluation."""
    from fedper.emulate.stacked import stacked_round

    if distributed.world_size() > 1:
        raise RunError("stacked runs train in one process: drop --world-size (or torchrun)")
    configs, fleets, states, histories, loaded, weights = [], [], [], [], [], []
    for config, out, resume, label in runs:
        config, saved, history = _prepare(config, out, resume)
        config = _broadcast_init(config, saved)
        configs.append(config)
        device = resolve_device(config.device)
        data = _share_tensors(load_fleet_data(config.data, device), loaded)
        fleet = Fleet(replace(config.fleet, engine="vmap"), data)
        fleets.append(fleet)
        weights.append(_warm_start(fleet, config.init, device) if saved is None and config.init else None)
        states.append(fleet.init() if saved is None else _to_device(saved, device))
        histories.append(history)
        _begin(out, config, fleet, history)
        report({"event": "start", "run": str(out), "label": label, "rounds": config.rounds, "done": states[-1].round})
    stopped = [False] * len(runs)
    while active := [i for i, (c, s) in enumerate(zip(configs, states, strict=True))
                     if s.round < c.rounds and not stopped[i]]:
        for i in active:
            stopped[i] = fleets[i].budget_stops(states[i])
        active = [i for i in active if not stopped[i]]
        if not active:
            break
        tells = [_StepReporter(report, str(runs[i][1]), fleets[i].round_steps(states[i])) for i in active]
        results = stacked_round([fleets[i] for i in active], [states[i] for i in active], budget=budget,
                                on_steps=tells)
        for i, (state, metrics) in zip(active, results, strict=True):
            states[i] = state
            out = runs[i][1]
            _record(out, state, metrics)
            histories[i].append(metrics)
            report({"event": "round", "run": str(out), "round": state.round, "rounds": configs[i].rounds,
                    "accuracy": metrics["mean_accuracy"], "wall_s": metrics["wall_s"]})
    summaries = []
    for i, (config, (_, out, _, _)) in enumerate(zip(configs, runs, strict=True)):
        report({"event": "end", "run": str(out)})
        _save_weights(out, config, fleets[i], states[i])
        summary = _summary(config, fleets[i], histories[i])
        summary["stacked"] = len(runs)
        if weights[i] is not None:
            summary["weights"] = weights[i]
        if states[i].privacy is not None:
            summary["dp"] = _privacy_summary(config, states[i], stopped[i])
        checkpoint.write_json(out / SUMMARY, summary, indent=2)
        summaries.append(summary)
    return summaries


def _share_tensors(data: FleetData, loaded: list[FleetData]) -> FleetData:
    """`data` holding the image and label tensors of an earlier run when they are equal (runs that differ only in
    their partition, k or seed at full scale), so stacked runs keep one copy on the device; `loaded` grows."""
    for other in loaded:
        if same_images(other.x, data.x) and torch.equal(other.y, data.y):
            return replace(data, x=other.x, y=other.y)
    loaded.append(data)
    return data


class _StepReporter:
    """run_round's on_step: counts the round's client-batches and reports them at most every STEP_REPORT_S."""

    def __init__(self, report: Callable[[Event], None], key: str, steps: int) -> None:
        self.report, self.key, self.steps = report, key, steps
        self.done, self.last = 0, 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= STEP_REPORT_S:
            self.last = now
            self.report({"event": "step", "run": self.key, "steps": self.done, "of": self.steps})


def describe_data(fleet: Fleet) -> dict:
    """DIR/data.json: what the data set is (an .npz of CIFAR-10 is CIFAR-10), its classes, each client's
    sample counts, and the accuracy of a guess from the label prior alone (a model with a head of its own per
    client can answer each client's most frequent class; one shared model, one class for all), the line
    a figure draws as chance."""
    data = fleet.data
    personal = bool(fleet.local_names)
    return {"name": data.name, "classes": data.classes, "n_train": data.n_train,
            "n_test": [len(test) for _, test in data.clients],
            "chance_accuracy": data.chance_accuracy(personal),
            "chance_rule": "each client's most frequent test class" if personal
            else "the one class most frequent over the clients' test splits"}


def _prepare(config: RunConfig, out: Path, resume: bool) -> tuple[RunConfig, FleetState | None, list[dict]]:
    """Check `out`: the run's config, the saved state (None for a new run) and the metrics of its
    saved rounds (a line written after the last saved state is dropped)."""
    state_path = out / STATE
    if resume:
        if not holds_run(out):
            raise RunError(f"nothing to resume: {state_path} does not exist")
        saved = RunConfig.from_json((out / CONFIG).read_text())
        config = RunConfig(saved.data, saved.fleet, config.rounds, saved.device)
        if not state_path.exists():
            _migrate(out)
    elif holds_run(out):
        raise RunError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    state = load_state(state_path) if resume else None
    return config, state, _read_metrics(out / METRICS, state.round if state else 0)


def holds_run(out: Path) -> bool:
    """Whether `out` holds a saved state (in either format) that --resume continues."""
    return (out / STATE).exists() or (out / LEGACY_STATE).exists()


def _migrate(out: Path) -> None:
    """DIR/state.pt (torch.save of round, seed, shared and local) rewritten as DIR/state.safetensors,
    then removed: read once, with torch.load's weights_only (no arbitrary pickle)."""
    body = torch.load(out / LEGACY_STATE, map_location="cpu", weights_only=True)
    save_state(FleetState(body["round"], body["shared"], body["local"], body["seed"]), out / STATE)
    (out / LEGACY_STATE).unlink()
    log.warning("%s: converted to %s (round %d)", out / LEGACY_STATE, STATE, body["round"])


def _to_device(state: FleetState, device: torch.device) -> FleetState:
    return FleetState(state.round, {n: t.to(device) for n, t in state.shared.items()},
                      [{n: t.to(device) for n, t in own.items()} for own in state.local], state.seed, state.privacy)


def run_launched(config: RunConfig, out: str | Path, **kwargs) -> dict:
    """run_experiment as one of the processes torchrun started (it sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT)."""
    env = os.environ
    return _in_group(int(env["RANK"]), int(env["WORLD_SIZE"]), "env://", config, out, kwargs,
                     local_rank=int(env.get("LOCAL_RANK", "0")))


def run_spawned(world_size: int, config: RunConfig, out: str | Path, **kwargs) -> dict:
    """run_experiment in `world_size` processes on this host (torch.multiprocessing), no torchrun
    needed; returns rank 0's summary and raises rank 0's RunError/DataError/OSError as a RunError."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        mp.spawn(_spawned, args=(world_size, distributed.free_rendezvous(), config, str(out), kwargs, str(result)),
                 nprocs=world_size, join=True)
        body = json.loads(result.read_text())
    if "error" in body:
        raise RunError(body["error"])
    return body["summary"]


def _spawned(rank: int, world_size: int, rendezvous: str, config: RunConfig, out: str, kwargs: dict,
             result: str) -> None:
    """One spawned process: its bad-input error goes back to the parent as a message, not a traceback."""
    if resolve_device(config.device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as torchrun: no oversubscription
    try:
        body = {"summary": _in_group(rank, world_size, rendezvous, config, out, kwargs)}
    except (ValueError, OSError) as e:  # RunError and DataError are ValueErrors; the same on every rank
        body = {"error": str(e)}
    if rank == 0:
        Path(result).write_text(json.dumps(body))


def _in_group(rank: int, world_size: int, rendezvous: str, config: RunConfig, out: str | Path, kwargs: dict,
              local_rank: int | None = None) -> dict:
    distributed.init_process_group(rank, world_size, rendezvous, local_rank=local_rank,
                                   cuda=resolve_device(config.device).type == "cuda")
    try:
        return run_experiment(config, out, **kwargs)
    finally:
        distributed.destroy()


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
        "clients_per_round": config.fleet.clients_per_round,
        "n_train": fleet.data.n_train,
        "final_mean_accuracy": last.get("mean_accuracy"),
        "final_std_accuracy": last.get("std_accuracy"),
        "final_accuracy": last.get("accuracy"),
        "best_mean_accuracy": max((m["mean_accuracy"] for m in history), default=None),
        "wall_s": sum(m["wall_s"] for m in history),
        "mean_round_s": statistics.fmean(m["wall_s"] for m in history) if history else None,
    }


def _privacy_summary(config: RunConfig, state: FleetState, budget_stopped: bool) -> dict:
    """The coordinator's DP summary: epsilon spent (null when unbounded), the budget, the clip norm now."""
    assert state.privacy is not None
    fleet, epsilon = config.fleet, state.privacy.accountant.epsilon()
    clipping = state.privacy.clipping
    return {"epsilon": epsilon if math.isfinite(epsilon) else None, "delta": fleet.dp_delta,
            "target_epsilon": fleet.dp_target_epsilon, "noise_multiplier": fleet.dp_noise_multiplier,
            "clip_norm": clipping.clip_norm if clipping else fleet.clip_norm,
            "rounds_accounted": state.privacy.accountant.rounds, "budget_stopped": budget_stopped}

