"""One device around the agent's engine: its artifacts, local data, training backend and state directory.

The engine (edge/engine.py) decides; this does the work it asks for (`run(job)`): check --only-when, train a
round and save it, evaluate and save the final model. The service (edge/service.py) runs those jobs in a
thread; `handle` runs them at once, for tests and scripts that drive a device without a broker.
What a round trains and evaluates, FedBABU's fine-tuned evaluation included: docs/architecture.md.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedper.algorithms import Phase, check_trained, get_algorithm
from fedper.batches import PURPOSE_FINETUNE
from fedper.data import DataError, chance_words, load_image_folder, load_npz, to_float_nchw
from fedper.edge.backend import check_artifacts, open_backend
from fedper.edge.eligibility import Conditions
from fedper.edge.engine import (
    Action,
    AgentEngine,
    AgentError,
    CheckConditions,
    ConditionsChecked,
    EngineSettings,
    EvaluateFinal,
    FinalEvaluated,
    Job,
    Message,
    Result,
    RoundTrained,
    Saved,
    TrainRound,
)
from fedper.edge.personal import PERSONAL_MODEL, PersonalModel
from fedper.edge.state import DeviceState
from fedper.manifest import Manifest
from fedper.wire import DEFAULT_CHUNK_SIZE, Outgoing, RoundInfo, UpdateMeta

if TYPE_CHECKING:
    from fedper.edge.secure_round import SecureParticipant


@dataclass(frozen=True)
class AgentConfig:
    artifacts: Path
    data: Path
    broker: str
    fleet: str
    client_id: str
    state_dir: Path
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    fine_tune_head: bool = False
    eval_finetune_epochs: int = 1  # FedBABU: fine-tuning epochs before each evaluation (0: serve the frozen head)
    eval_finetune: str = "all"  # FedBABU: what that fine-tune trains, "all" (their Algorithm 2) or "head"
    backend: str = "ort"
    device: str = "cpu"  # where the torch backend trains: "cpu" or "cuda" (the CLI resolves --device auto)
    seed: int = 0
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    mqtt_version: str = "5"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compression: str = "fp32"  # update codec: one of fedper.compression.CODECS
    only_when: tuple[str, ...] = ()  # eligibility conditions (fedper.edge.eligibility), all must hold
    recheck_s: float = 60.0  # while not eligible, check the conditions again after this long
    reconnect_spread_s: float = 30.0  # after losing the broker, reconnect within this window (fedper.mqtt.Backoff)
    secure_aggregation: bool = False  # never send the update in the clear: only under a SecAgg+ session
    identity: Path | None = None  # secure aggregation: the device's identity directory (deploy/provision-identity.sh)
    keep_updates: bool = False  # also keep every round's update under state_dir/updates/ (audits: the chaos soak)


@dataclass(frozen=True)
class LocalData:
    x_train: np.ndarray  # float32 NCHW, normalized with the manifest's mean/std
    y_train: np.ndarray  # int64, indices into the manifest's classes
    x_test: np.ndarray
    y_test: np.ndarray


def manifest_classes(manifest: Manifest) -> list[str]:
    """The label names the model was exported for; "0".."C-1" when the export named none."""
    return list(manifest.model.classes) or [str(i) for i in range(manifest.model.num_classes)]


def load_local_data(path: Path, manifest: Manifest, state: DeviceState, seed: int) -> LocalData:
    """An image-folder tree or an .npz, labels mapped onto the manifest's classes; without a test
    split of its own, the state dir's fixed split (chosen once) divides it."""
    _, height, width = manifest.model.input_shape
    splits = load_npz(path) if path.suffix == ".npz" else load_image_folder(path, image_size=height)
    classes = manifest_classes(manifest)
    unknown = [c for c in splits.train.classes if c not in classes]
    if unknown:
        raise DataError(f"{path}: class(es) {unknown} are not among the model's classes {classes}")
    if splits.train.x.shape[1:3] != (height, width):
        raise DataError(f"{path}: images are {splits.train.x.shape[1:3]}, the model takes {height}x{width}")
    if len(splits.train) == 0:
        raise DataError(f"{path}: no training images")
    to_manifest = np.array([classes.index(c) for c in splits.train.classes], np.int64)
    x, y = splits.train.x, to_manifest[splits.train.y]
    if splits.test is None:
        train, test = state.split(x, y, seed)
        x_test, y_test, x, y = x[test], y[test], x[train], y[train]
    else:
        x_test, y_test = splits.test.x, to_manifest[splits.test.y]
    mean, std = manifest.model.mean, manifest.model.std
    return LocalData(to_float_nchw(x, mean, std), y, to_float_nchw(x_test, mean, std), y_test)


def schedule(manifest: Manifest, fine_tune_head: bool) -> tuple[Phase, ...]:
    """The algorithm's phases; --fine-tune-head puts one head-only epoch first (the paper's A.3)."""
    phases = get_algorithm(manifest.algorithm).phases
    if fine_tune_head and phases[0].trained != "head":
        phases = (Phase("head", 1), *phases)
    return phases


@dataclass(frozen=True)
class LocalTraining:
    """What a round trains with: the device's own flags (--lr, --local-epochs, --batch-size), replaced by the
    settings the coordinator sends with the round (RoundInfo's lr, local_epochs, batch_size) where it sends them."""

    lr: float
    local_epochs: int
    batch_size: int

    def of_round(self, info: RoundInfo) -> LocalTraining:
        sent = {"lr": info.lr, "local_epochs": info.local_epochs, "batch_size": info.batch_size}
        return replace(self, **{name: value for name, value in sent.items() if value is not None})

    def __str__(self) -> str:
        return f"lr {self.lr:g}, {self.local_epochs} local epoch(s), batch {self.batch_size}"


def peak_rss_mb() -> float:
    """This process's peak resident memory: /proc's VmHWM where there is one (ru_maxrss also counts what the
    process it was forked from held before its exec: a pytest worker's 800 MB), else ru_maxrss."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024


class Agent:
    """One FedPer participant: its engine, and the artifacts, data, backend and state directory its jobs use.

    conditions: when it may take part (default: config.only_when on this machine's /sys and /proc);
    clock: unix time, for the eligibility back-off."""

    def __init__(self, config: AgentConfig, log: Callable[[str], None] = print, *,
                 conditions: Conditions | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config, self.log, self.clock = config, log, clock
        self.conditions = conditions if conditions is not None else Conditions(tuple(config.only_when))
        self.manifest = check_artifacts(config.artifacts)
        self.phases = schedule(self.manifest, config.fine_tune_head)
        fine_tunes = get_algorithm(self.manifest.algorithm).fine_tune_head_at_eval
        self.serve_tuned = fine_tunes and config.eval_finetune_epochs > 0  # FedBABU serves a fine-tuned copy
        if self.serve_tuned:
            check_trained(config.eval_finetune)
        if config.backend == "ort":
            needed = {p.trained for p in self.phases} | ({config.eval_finetune} if self.serve_tuned else set())
            missing = sorted(needed - set(self.manifest.artifact_sets))
            if missing:
                raise AgentError(
                    f"the algorithm's phases train {missing} but {config.artifacts} has no such artifact set "
                    f"(it has {sorted(self.manifest.artifact_sets)}); export with an algorithm that needs them"
                )
        self.state = DeviceState(config.state_dir)
        self.data = load_local_data(config.data, self.manifest, self.state, config.seed)
        self.backend = open_backend(config.backend, config.artifacts, self.manifest, config.device)
        self.personal = PersonalModel(config.artifacts, self.manifest, manifest_classes(self.manifest))
        self.chance = chance_words(self.data.y_test)  # beside every accuracy a person reads
        self.last_training = self.own_training  # FedBABU's fine-tune for serving: the last round's settings
        saved = self.state.load(self.manifest)
        if saved is not None:
            self.backend.load(saved.local)
            log(f"restored the head of round {saved.round} from {config.state_dir}")
        settings = EngineSettings(
            client_id=config.client_id, fleet=config.fleet, n_samples=len(self.data.y_train),
            chunk_size=config.chunk_size, compression=config.compression,
            secure_aggregation=config.secure_aggregation, conditions=bool(self.conditions.specs),
            recheck_s=config.recheck_s)
        self.engine = AgentEngine(self.manifest, settings, saved, lambda line: self.log(line),  # agent.log may change
                                  self._secure_participant)
        self.topics = self.engine.topics

    def _secure_participant(self, info: RoundInfo, saved: Saved, model: Mapping[str, np.ndarray],
                            meta: UpdateMeta) -> SecureParticipant:
        """This device in the secure session `info` names, with its identity and its state directory."""
        from fedper.edge.secure_round import SecureParticipant  # cryptography: the privacy extra

        c = self.config
        return SecureParticipant(self.topics, c.client_id, saved.round, int(info.secagg_session or 0), self.manifest,
                                 saved.update, model, saved.n_samples, meta, c.chunk_size, c.identity, c.state_dir,
                                 info.sha256)

    @property
    def n_samples(self) -> int:
        return len(self.data.y_train)

    @property
    def saved(self) -> Saved | None:
        return self.engine.saved

    @property
    def final_accuracy(self) -> float | None:
        return self.engine.final_accuracy

    # ------------------------------------------------------------ the engine's jobs

    def run(self, job: Job) -> Result:
        """Do what the engine asked (blocking: the service calls this in a thread); the event to feed it back."""
        if isinstance(job, CheckConditions):
            return ConditionsChecked(job, self.conditions.problem())
        if isinstance(job, TrainRound):
            self.backend.load(job.model)
            training = self.own_training.of_round(job.info)
            if training != self.own_training:
                self.log(f"round {job.info.round}: training as the coordinator says: {training}")
            return RoundTrained(job, self.train_round(job.info.round, training))
        return FinalEvaluated(job, self.finish(job))

    def handle(self, topic: str, payload: bytes) -> list[Outgoing]:
        """One MQTT message, and the jobs it leads to done at once: what to publish."""
        return self.settle(self.engine.handle(Message(topic, payload), self.clock()))

    def settle(self, actions: list[Action]) -> list[Outgoing]:
        """Run the jobs among `actions` (and the jobs their results lead to) in order: what to publish."""
        out: list[Outgoing] = []
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            if isinstance(action, Outgoing):
                out.append(action)
            else:
                pending += self.engine.handle(self.run(action), self.clock())
        return out

    @property
    def own_training(self) -> LocalTraining:
        c = self.config
        return LocalTraining(c.lr, c.local_epochs, c.batch_size)

    def train_round(self, round_: int, training: LocalTraining | None = None) -> Saved:
        """Evaluate the served model, train every phase with `training` (default: the device's own flags), save
        the state; the base is already loaded."""
        c, d = self.config, self.data
        t = self.last_training = training or self.own_training
        untuned = self._tune_for_serving(round_) if len(d.y_test) else None
        accuracy, test_loss = self.backend.evaluate(d.x_test, d.y_test)
        served = self.backend.read(self.manifest.names())
        if untuned is not None:
            self.backend.load(untuned)  # training goes on from the untuned model, as the emulator's state does
        samples, seconds, losses = 0, 0.0, []
        for index, phase in enumerate(self.phases):
            stats = self.backend.train(
                phase.trained, d.x_train, d.y_train, epochs=phase.epochs or t.local_epochs,
                batch_size=t.batch_size, lr=t.lr, seed=(c.seed, round_, index),
            )
            samples, seconds = samples + stats.samples, seconds + stats.seconds
            losses.append(stats.loss)
        metrics = {"accuracy": accuracy, "loss": test_loss, "train_loss": losses[-1],
                   "samples_per_s": samples / seconds if seconds else 0.0}
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}  # no test split: no accuracy
        saved = Saved(
            round=round_, base_digest=self.manifest.base_digest, n_samples=self.n_samples,
            local=self.backend.read(self.manifest.names(shared=False)),
            update=self.backend.read(self.manifest.names(shared=True)), metrics=metrics,
        )
        self.state.save(saved)
        if c.keep_updates:
            self.state.keep_update(saved)
        self._serve(served, round_, accuracy)
        self.log(f"round {round_}: served accuracy {accuracy:.4f} ({self.chance}; test loss {test_loss:.4f}); trained "
                 f"{samples} samples in {seconds:.1f} s ({samples / max(seconds, 1e-9):.0f} samples/s), "
                 f"train loss {losses[-1]:.4f}; peak RSS {peak_rss_mb():.0f} MB")
        return saved

    def finish(self, job: EvaluateFinal) -> float:
        """Evaluate the model the device serves from now on and save it with its accuracy (served.safetensors,
        final.json). The device state keeps the untuned head: a restart derives the same."""
        info = job.info
        self.backend.load(job.model)
        self._tune_for_serving(info.rounds + 1)  # the emulator's evaluation after round R keys it R + 1
        accuracy, loss = self.backend.evaluate(self.data.x_test, self.data.y_test)
        self.log(f"finished after {info.rounds} rounds: personalized accuracy {accuracy:.4f} ({self.chance}); "
                 f"the model: {self.state.dir / PERSONAL_MODEL}")
        served = self.backend.read(self.manifest.names())
        self.state.save_served(served, {"rounds": info.rounds, "accuracy": accuracy, "loss": loss})
        self._serve(served, info.rounds + 1, accuracy, final=True)
        return accuracy

    def _serve(self, served: Mapping[str, np.ndarray], round_: int, accuracy: float, final: bool = False) -> None:
        """The personal model an app runs (edge/personal.py), with the accuracy measured on it and its chance line."""
        record = {"round": round_, "final": final, "accuracy": accuracy if math.isfinite(accuracy) else None,
                  "chance": self.chance}
        with self.state.saving(self.state.dir / PERSONAL_MODEL):
            self.personal.write(self.state.dir, served, record)

    def _tune_for_serving(self, round_: int) -> Mapping[str, np.ndarray] | None:
        """FedBABU: fine-tune the loaded model in place, as the device serves it (their Algorithm 2), with
        the batch key the emulator gives client_seed = --seed in the same round; returns the untuned
        tensors for the caller to load back. Other algorithms serve the model as it is: None."""
        if not self.serve_tuned:
            return None
        c, d, t = self.config, self.data, self.last_training
        untuned = self.backend.read(self.manifest.names())
        self.backend.train(c.eval_finetune, d.x_train, d.y_train, epochs=c.eval_finetune_epochs,
                           batch_size=t.batch_size, lr=t.lr, seed=(c.seed, round_, PURPOSE_FINETUNE))
        return untuned
