"""FedPer on a simulated clock: synchronous rounds and FedBuff's asynchronous versions, per simulated second
and per upload (`fedper-emulate figure async`, docs/reproducing.md "Figure async").

The devices are emulate/clock.py's (speeds and online spells from a trace in FedScale's format). Training is
the emulator's own (fleet.Fleet's per-client training, emulate/train.py) and so is evaluation: every device
with the released base and its own head, on its own test split. What the clock decides is when a device
trains, from which model, and whether its update arrives:

sync   A round at time t invites ceil(F * M) of the devices online at t (fedper.selection, the coordinator's
       rule, keyed by the run's seed; M = clients_per_round, default every device online, F = over_select).
       Each one downloads the model, trains and uploads (clock.Device.job_seconds); one whose online spell
       ends first drops out. The round closes when M updates have arrived, when every invited device has
       uploaded or dropped out, or at the deadline once one update has arrived; devices still training then
       stop, their work lost. The model becomes the n_j-weighted mean of the updates (fedper.aggregation's
       WeightedMean, as the coordinator's rounds). A round nobody answered is drawn again when it ends.
async  FedBuff (fedper.buffered.Buffer, the coordinator's rule): `concurrency` devices train at once, each on
       the version it downloaded. When one finishes, its delta is folded with its staleness (or refused as
       too stale) and its slot goes to a device online then, the finished one included, by the same seeded
       ranking; a device that drops out frees its slot when it goes. A new version every K folded deltas.

A run stops at the first release once `uploads` updates were uploaded (refused stale ones count: they were
sent). Its directory holds config.json, metrics.jsonl (one line per version, the initial model's first:
simulated time, uploads so far, each device's accuracy), state.safetensors (rewritten after every release)
and summary.json, as a `fedper-emulate run` directory does; a killed run resumes from its last release and
ends bit for bit where an uninterrupted one would (no randomness but the seeded selection and the batch keys:
a device's batches in its k-th training are the agent's of round k, or the round's in sync mode, as in
fleet.Fleet).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from fedper import checkpoint
from fedper.aggregation import WeightedMean
from fedper.buffered import Buffer, BufferConfig, Refused, Release, Staleness, base_delta
from fedper.emulate.clock import Device, fleet_from_trace, load_trace
from fedper.emulate.data import DataConfig, FleetData, load_fleet_data
from fedper.emulate.distributed import combine
from fedper.emulate.experiment import CONFIG, DATA, METRICS, STATE, SUMMARY, RunError, describe_data
from fedper.emulate.fleet import Fleet, FleetConfig, resolve_device
from fedper.emulate.progress import Board, Event
from fedper.selection import invitations, select

MODES = ("sync", "async")
Arrays = dict[str, np.ndarray]

log = logging.getLogger("fedper.emulate")


@dataclass(frozen=True)
class ClockConfig:
    mode: str = "async"
    trace: str | None = None  # a FedScale-format JSON trace; None: the shipped synthetic one
    uploads: int = 200  # the budget: the run ends at the first release after this many uploads
    clients_per_round: int | None = None  # sync: M, the updates a round closes at (None: every device online)
    over_select: float = 1.0  # sync: invite ceil(F * M)
    deadline_s: float | None = None  # sync: close a round this long after it opened, once it has one update
    concurrency: int | None = None  # async: devices training at once (None: every device)
    buffer_size: int = 5  # async: K
    max_staleness: int = 20
    staleness: str = "polynomial"  # fedper.buffered.Staleness: w(s) = (1 + s)^-a by default, a = 1/2
    staleness_a: float = 0.5
    staleness_b: int = 0
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.uploads < 1:
            raise ValueError(f"the upload budget must be >= 1, got {self.uploads}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"--deadline must be a positive number of seconds, got {self.deadline_s}")
        invitations(self.clients_per_round or 1, self.over_select)  # checks M >= 1 and F >= 1
        self.buffer_config(None)  # checks K, the staleness bound and function, the server lr

    def buffer_config(self, clip_norm: float | None, statistics: tuple[str, ...] = ()) -> BufferConfig:
        return BufferConfig(self.buffer_size, self.max_staleness, self.server_lr,
                            Staleness(self.staleness, self.staleness_a, self.staleness_b), "mean", clip_norm,
                            statistics)


@dataclass(frozen=True)
class ClockRunConfig:
    data: DataConfig
    fleet: FleetConfig
    clock: ClockConfig
    device: str = "auto"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ClockRunConfig:
        body = json.loads(text)
        return cls(DataConfig(**body["data"]), FleetConfig(**body["fleet"]), ClockConfig(**body["clock"]),
                   body["device"])

    def with_budget_of(self, other: ClockRunConfig) -> ClockRunConfig:
        """This run with `other`'s upload budget: a run extended or cut short is the same run."""
        return replace(self, clock=replace(self.clock, uploads=other.clock.uploads))

    def budget_spent(self, summary: dict) -> bool:
        """Whether a run that wrote `summary` spent this config's uploads (it stops at the release after them)."""
        return summary["uploads"] >= self.clock.uploads


@dataclass(frozen=True)
class Job:
    """A device at work: the version it downloaded, and when it uploads (`completes`) or drops out."""

    version: int
    end: float
    completes: bool


@dataclass
class ClockState:
    time: float  # simulated seconds
    version: int  # models released (sync: rounds)
    model: Arrays  # the shared tensors of that version
    local: list[dict[str, torch.Tensor]]
    trainings: list[int]  # per device: trainings finished (its batch key in async mode)
    draws: int = 0  # selections drawn: fedper.selection's round key
    uploads: int = 0
    refused: int = 0
    dropped: int = 0
    buffer: Buffer | None = None  # async
    jobs: dict[int, Job] = field(default_factory=dict)  # async: the devices at work
    versions: dict[int, Arrays] = field(default_factory=dict)  # async: the models they downloaded


def _numpy(tensors: dict[str, torch.Tensor]) -> Arrays:
    return {n: t.detach().cpu().numpy().copy() for n, t in tensors.items()}


class ClockedFleet:
    """`init() -> state`, then `release(state) -> metrics` until the upload budget is spent."""

    def __init__(self, config: ClockRunConfig, data: FleetData) -> None:
        self.config, self.clock = config, config.clock
        if config.fleet.dp_noise_multiplier is not None:
            raise ValueError("the clocked emulator has no differential privacy: drop --dp-noise-multiplier")
        self.fleet = Fleet(config.fleet, data)
        if not self.fleet.algorithm.federated:
            raise ValueError(f"{config.fleet.algorithm} shares nothing: there is no model to release on a clock")
        n_clients = len(data.clients)
        self.devices: list[Device] = fleet_from_trace(load_trace(self.clock.trace), n_clients)
        model_bytes = sum(self.fleet.initial[n].numel() * self.fleet.initial[n].element_size()
                          for n in self.fleet.shared_names)
        epochs = sum(phase.epochs or config.fleet.local_epochs for phase in self.fleet.algorithm.phases)
        self.job_s = [device.job_seconds(n, epochs, model_bytes, model_bytes)
                      for device, n in zip(self.devices, data.n_train, strict=True)]
        if not any(job <= d.longest_online() for job, d in zip(self.job_s, self.devices, strict=True)):
            raise ValueError("no device of the trace stays online long enough to train once")
        self.concurrency = min(self.clock.concurrency or n_clients, n_clients)
        statistics = tuple(t.name for t in self.fleet.manifest.shared_tensors if not t.trainable)  # BatchNorm's
        self.buffer_config = self.clock.buffer_config(config.fleet.clip_norm, statistics)

    def init(self) -> ClockState:
        start = self.fleet.init()
        model = _numpy(start.shared)
        state = ClockState(0.0, 0, model, start.local, [0] * len(self.devices))
        if self.clock.mode == "async":
            state.buffer = Buffer(self.buffer_config, model)
        return state

    def release(self, state: ClockState) -> dict:
        """Run the clock to the next release and evaluate every device on it; `state` moves in place."""
        started = time.perf_counter()
        participants, staleness = self._round(state) if self.clock.mode == "sync" else self._until_release(state)
        return self.evaluate(state, participants, staleness, started)

    def evaluate(self, state: ClockState, participants: list[int] | None = None, staleness: list[int] | None = None,
                 started: float | None = None) -> dict:
        """The metrics of the current version: every device with its base and its own head, on its own test split."""
        started = time.perf_counter() if started is None else started
        shared = self._torch(state.model)
        results = [self.fleet.evaluate_client(j, shared, state.local[j]) for j in range(len(self.devices))]
        accuracy = [a for a, _ in results]
        return {"version": state.version, "time_s": state.time, "uploads": state.uploads, "refused": state.refused,
                "dropped": state.dropped, "participants": participants or [], "staleness": staleness or [],
                "accuracy": accuracy, "loss": [loss for _, loss in results],
                "mean_accuracy": statistics.fmean(accuracy), "std_accuracy": statistics.pstdev(accuracy),
                "mean_loss": statistics.fmean(loss for _, loss in results), "wall_s": time.perf_counter() - started}

    def _torch(self, arrays: Arrays) -> dict[str, torch.Tensor]:
        return {n: torch.tensor(a, device=self.fleet.device) for n, a in arrays.items()}

    def _job(self, j: int, now: float, version: int) -> Job:
        end, online_until = now + self.job_s[j], self.devices[j].online_until(now)
        return Job(version, end, True) if end <= online_until else Job(version, online_until, False)

    def _online(self, now: float, busy: set[int] | dict[int, Job]) -> list[str]:
        return [str(j) for j, device in enumerate(self.devices) if j not in busy and device.online(now)]

    def _wake(self, now: float, idle: list[int]) -> float:
        """The first time after `now` that one of `idle` comes online (inf: none ever does)."""
        return min((self.devices[j].next_online(now) for j in idle), default=math.inf)

    # ------------------------------------------------------------ sync

    def _round(self, state: ClockState) -> tuple[list[int], list[int]]:
        """One synchronous round: invite, wait (see the module's docstring), average the updates that arrived."""
        clock = self.clock
        while True:
            online = self._online(state.time, ())
            if not online:
                state.time = self._wake(state.time, list(range(len(self.devices))))
                if math.isinf(state.time):
                    raise ValueError("no device of the trace ever comes online")
                continue
            m = min(clock.clients_per_round or len(online), len(online))
            state.draws += 1
            invited = [int(d) for d in select(online, invitations(m, clock.over_select), seed=self.config.fleet.seed,
                                              round_=state.draws)]
            jobs = {j: self._job(j, state.time, state.version) for j in invited}
            arrivals = sorted((job.end, j) for j, job in jobs.items() if job.completes)
            close = arrivals[m - 1][0] if len(arrivals) >= m else max(job.end for job in jobs.values())
            if clock.deadline_s is not None and arrivals:
                close = min(close, max(state.time + clock.deadline_s, arrivals[0][0]))
            state.dropped += sum(not job.completes and job.end <= close for job in jobs.values())
            state.time = close
            folded = sorted(j for end, j in arrivals[:m] if end <= close)
            if folded:
                break
        shared = self._torch(state.model)
        rule = WeightedMean()
        trained_clients = self.fleet.train_clients(shared, state.local, folded, state.version, self.config.fleet.seed)
        for j, (trained, own) in zip(folded, trained_clients, strict=True):
            rule.add(self.fleet.update(trained, shared), self.fleet.data.n_train[j])
            state.local[j] = own
            state.trainings[j] += 1
        state.model = _numpy(combine(rule, shared))
        state.version += 1
        state.uploads += len(folded)
        return folded, [0] * len(folded)

    # ------------------------------------------------------------ async

    def _until_release(self, state: ClockState) -> tuple[list[int], list[int]]:
        """Fill the free slots, take the next event (an upload, a dropout, a device coming online), until a release."""
        assert state.buffer is not None
        while True:
            self._fill(state)
            events = sorted((job.end, j) for j, job in state.jobs.items())
            if len(state.jobs) < self.concurrency:
                wake = self._wake(state.time, [j for j in range(len(self.devices)) if j not in state.jobs])
                if math.isfinite(wake) and (not events or wake < events[0][0]):
                    state.time = wake
                    continue
            if not events:
                raise ValueError("no device of the trace ever comes online")
            state.time, j = events[0]
            job = state.jobs.pop(j)
            release = self._upload(state, j, job) if job.completes else None
            state.dropped += not job.completes
            in_use = {other.version for other in state.jobs.values()}
            state.versions = {v: model for v, model in state.versions.items() if v in in_use}
            if release is not None:
                state.model, state.version = release.model, release.version
                return ([int(r.update_id.split("#")[0]) for r in release.folded],
                        [r.staleness for r in release.folded])

    def _fill(self, state: ClockState) -> None:
        """Invite devices online now into the free slots, by the seeded ranking; they download the current version."""
        free = self.concurrency - len(state.jobs)
        online = self._online(state.time, state.jobs) if free > 0 else []
        if not online:
            return
        state.draws += 1
        for device in select(online, free, seed=self.config.fleet.seed, round_=state.draws):
            state.jobs[int(device)] = self._job(int(device), state.time, state.version)
        state.versions[state.version] = state.model

    def _upload(self, state: ClockState, j: int, job: Job) -> Release | None:
        """Device j's training on the version it downloaded, its head kept, its delta folded (or refused)."""
        assert state.buffer is not None
        downloaded = state.versions[job.version]
        ((trained, own),) = self.fleet.train_clients(self._torch(downloaded), state.local, [j], state.trainings[j],
                                                     self.config.fleet.seed)
        upload = f"{j}#{state.trainings[j]}"  # unique per upload: a fast device may train twice on one version
        state.local[j] = own
        state.trainings[j] += 1
        state.uploads += 1
        try:
            _, release = state.buffer.fold(base_delta(_numpy(trained), downloaded), self.fleet.data.n_train[j],
                                           job.version, upload)
        except Refused:
            state.refused += 1
            return None
        return release


# ---------------------------------------------------------------- state on disk


def save_state(state: ClockState, path: Path) -> None:
    """One fedper.checkpoint: "model/", "local/j/", the in-flight versions "version/v/" and the buffer's
    "buffer/" tensors, the rest in the JSON document."""
    tensors = {f"model/{n}": a for n, a in state.model.items()}
    for j, own in enumerate(state.local):
        tensors |= {f"local/{j}/{n}": t.detach().cpu().numpy() for n, t in own.items()}
    for v, model in state.versions.items():
        tensors |= {f"version/{v}/{n}": a for n, a in model.items()}
    buffer_meta = None
    if state.buffer is not None:
        buffer_tensors, buffer_meta = state.buffer.checkpoint()
        tensors |= {f"buffer/{k}": a for k, a in buffer_tensors.items()}
    meta = {"time": state.time, "version": state.version, "trainings": state.trainings, "draws": state.draws,
            "uploads": state.uploads, "refused": state.refused, "dropped": state.dropped,
            "local": [list(own) for own in state.local], "model": list(state.model),
            "jobs": {str(j): asdict(job) for j, job in state.jobs.items()}, "versions": list(state.versions),
            "buffer": buffer_meta}
    checkpoint.write_checkpoint(path, tensors, meta)


def load_state(path: Path, buffer_config: BufferConfig, device: torch.device) -> ClockState:
    arrays, meta = checkpoint.read_checkpoint(path)

    def part(prefix: str, names: list[str]) -> Arrays:
        return {n: arrays[f"{prefix}{n}"] for n in names}

    names = meta["model"]
    state = ClockState(meta["time"], meta["version"], part("model/", names),
                       [{n: torch.from_numpy(a).to(device) for n, a in part(f"local/{j}/", own).items()}
                        for j, own in enumerate(meta["local"])],
                       meta["trainings"], meta["draws"], meta["uploads"], meta["refused"], meta["dropped"])
    state.jobs = {int(j): Job(**job) for j, job in meta["jobs"].items()}
    state.versions = {int(v): part(f"version/{v}/", names) for v in meta["versions"]}
    if meta["buffer"] is not None:
        buffer_arrays = {k.removeprefix("buffer/"): a for k, a in arrays.items() if k.startswith("buffer/")}
        state.buffer = Buffer.resume(buffer_config, buffer_arrays, meta["buffer"])
    return state


# ---------------------------------------------------------------- a run


def run_clocked(config: ClockRunConfig, out: str | Path, *, resume: bool = False, show_progress: bool = True,
                report: Callable[[Event], None] | None = None, label: str | None = None) -> dict:
    """Run (or resume) `config` in `out` and return its summary; on resume the upload budget may differ from the
    saved one (to extend a run), everything else comes from OUT/config.json. Progress goes to `report` (events
    keyed by `out`, named `label`) when given, else to a bar of its own when `show_progress`."""
    if report is None:
        with Board(show_progress) as board:  # bars in a terminal, a line a release elsewhere
            return run_clocked(config, out, resume=resume, report=board.report, label=label)
    out = Path(out)
    history: list[dict] = []
    if resume:
        if not (out / STATE).exists():
            raise RunError(f"nothing to resume: {out / STATE} does not exist")
        saved = ClockRunConfig.from_json((out / CONFIG).read_text())
        config = saved.with_budget_of(config)
    elif (out / STATE).exists():
        raise RunError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    device = resolve_device(config.device)
    clocked = ClockedFleet(config, load_fleet_data(config.data, device))
    state = load_state(out / STATE, clocked.buffer_config, device) if resume else clocked.init()
    if resume and (out / METRICS).exists():
        lines = (json.loads(line) for line in (out / METRICS).read_text().splitlines() if line.strip())
        history = [m for m in lines if m["version"] <= state.version]
    elif not resume:
        history = [clocked.evaluate(state)]  # version 0: the initial model, at time 0 and no upload
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write(out / CONFIG, config.to_json().encode())
    with (out / METRICS).open("w") as f:
        f.writelines(json.dumps(m) + "\n" for m in history)
    checkpoint.write_json(out / DATA, describe_data(clocked.fleet), indent=2)  # the figure's name and chance line
    budget, key = config.clock.uploads, str(out)
    report({"event": "start", "run": key, "label": label or f"{config.clock.mode} {config.fleet.algorithm}",
            "rounds": budget, "done": min(state.uploads, budget), "unit": "upload"})
    while state.uploads < budget:
        metrics = clocked.release(state)
        with (out / METRICS).open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        save_state(state, out / STATE)
        history.append(metrics)
        report({"event": "round", "run": key, "round": min(state.uploads, budget),
                "accuracy": metrics["mean_accuracy"], "wall_s": metrics["wall_s"]})
    report({"event": "end", "run": key})
    last = history[-1] if history else {}
    summary = {"mode": config.clock.mode, "algorithm": config.fleet.algorithm, "kp": config.fleet.kp,
               "clients": len(clocked.devices), "releases": state.version, "uploads": state.uploads,
               "refused": state.refused, "dropped": state.dropped, "time_s": state.time,
               "final_mean_accuracy": last.get("mean_accuracy"),
               "best_mean_accuracy": max((m["mean_accuracy"] for m in history), default=None),
               "wall_s": sum(m["wall_s"] for m in history)}
    checkpoint.write_json(out / SUMMARY, summary, indent=2)
    return summary
