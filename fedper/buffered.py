"""Buffered asynchronous aggregation (FedBuff: Nguyen et al., AISTATS 2022), one rule for the coordinator and
the emulator: devices train at their own pace, and the model moves every K deltas instead of every round.

A device downloads model version v_j, trains, and uploads its base delta Δ_j = trained - downloaded
(`base_delta`) tagged with v_j. While version v is current the delta's staleness is s_j = v - v_j, and
`Buffer.fold` refuses it (`Refused`) when s_j > max_staleness, when v_j is not released yet, or when its id
was folded already. Otherwise Δ_j is clipped to an L2 norm of clip_norm over all its tensors when one is set
(fedper.privacy.clip_delta, as --clip-norm clips a synchronous update), scaled by w(s_j), and folded with
weight n_j into fedper.aggregation's rule. After K folded deltas the buffer releases version v + 1:

    model_{v+1} = model_v + server_lr * Σ_j n_j w(s_j) Δ_j / Σ_j n_j

Normalization. FedBuff's Algorithm 1 sums the staleness-scaled deltas and divides by K, each delta counted
once. Here each delta weighs n_j, as in FedPer's synchronous mean, so the denominator is Σ_j n_j (K n when
every device has n samples: the paper's rule). w(s) stays out of the denominator as in the paper: a buffer of
stale deltas takes a shorter step. (FLSim's FedBuff divides by Σ_j w_j n_j instead, which keeps the step's
length whatever the staleness.) With every s_j = 0, server_lr = 1 and K the round's updates it is the
synchronous round: model + mean(trained - model) = mean(trained), to float64 rounding.

Statistics (`statistics`: BatchNorm running means and variances, the manifest's shared tensors that are not
trainable) are estimates, not parameters, and are not stepped: a stale delta of a variance added to a newer
variance can make it negative (it did, in the emulator, within 70 uploads on CIFAR-10). Their released value
is the w(s_j) n_j-weighted mean of the values the devices hold, (statistics of version v_j) + Δ_j, a convex
combination as in a synchronous round; the buffer keeps each version's statistics while deltas trained on it
may still come (per channel vectors: small). server_lr does not apply to them.

Robust rules (aggregator "median" or "trimmed-mean", fedper.aggregation) take the w(s_j)-scaled deltas in
place of the mean (and the statistics' values in place of theirs) and ignore n_j, as in synchronous rounds;
they keep the buffer's K deltas (memory O(K x model)), the mean only its float64 sum (O(model)).

Staleness functions (`Staleness`; Xie et al. 2019, FedAsync, section 5.2):
    constant     w(s) = 1
    polynomial   w(s) = (1 + s)^-a                      a = 1/2: FedBuff's 1/sqrt(1 + s), the default
    hinge        w(s) = 1 if s <= b, else 1 / (a (s - b) + 1)

State. The current version and model, the open buffer (the rules' float64 sums, or their deltas, and a record
per folded delta), the statistics of the versions within max_staleness, and the ids of the deltas folded from
those versions, so that a delta sent again (a device retrying after a restart) is refused, never folded twice.
The whole state is `checkpoint()`: tensors (write them with fedper.checkpoint, safetensors) and one JSON
document; no clock and no randomness, so `Buffer.resume` continues bit for bit: the same folds after it give
the same bits.

For the callers. Tensors are numpy arrays, the shared (base) tensors only; the head never reaches the buffer.
`statistics` are the manifest's shared tensors with `trainable` False.
The coordinator folds each accepted update and writes `checkpoint()` with its own commit; the emulator
(fedper.emulate.async_fleet) does the same on a simulated clock. Either must know the model a device
downloaded to form its delta (`base_delta`), unless the device sends the delta itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedper.aggregation import RULES, WeightedMean, check_layout, sample_weight
from fedper.privacy import clip_delta

FORMAT = "fedper-buffer-1"  # the checkpoint's JSON "format": a later layout reads or refuses it by this
STALENESS_KINDS = ("constant", "polynomial", "hinge")
_ORIGIN = np.zeros(())  # a delta's norm is its distance to the origin: clip_delta(delta, origin) clips a delta


@dataclass(frozen=True)
class Staleness:
    """w(s), the weight of a delta trained on a model s versions old (see the module's table)."""

    kind: str = "polynomial"
    a: float = 0.5
    b: int = 0  # hinge: deltas up to b versions old keep their full weight

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ValueError(f"unknown staleness function {self.kind!r}; choose one of {', '.join(STALENESS_KINDS)}")
        if not (math.isfinite(self.a) and self.a >= 0) or isinstance(self.b, bool) or not (
                isinstance(self.b, int) and self.b >= 0):
            raise ValueError(f"staleness a must be a finite number >= 0 and b an integer >= 0, got {self.a}, {self.b}")

    def weight(self, staleness: int) -> float:
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return (1.0 + staleness) ** -self.a
        return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)


@dataclass(frozen=True)
class BufferConfig:
    """K (`buffer_size`), the staleness bound and function, the server step, the rule and the clip norm."""

    buffer_size: int
    max_staleness: int
    server_lr: float = 1.0
    staleness: Staleness = field(default_factory=Staleness)
    aggregator: str = "mean"  # a name of fedper.aggregation.RULES
    clip_norm: float | None = None
    statistics: tuple[str, ...] = ()  # tensors averaged by value, not stepped (see the module's docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "statistics", tuple(self.statistics))  # JSON holds a list
        for name in ("buffer_size", "max_staleness"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "buffer_size" else 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'buffer_size' else 0}, got {value!r}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"server_lr must be a positive number, got {self.server_lr}")
        if self.aggregator not in RULES:
            raise ValueError(f"unknown aggregator {self.aggregator!r}; choose one of {', '.join(RULES)}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a positive number, got {self.clip_norm}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> BufferConfig:
        return cls(**{**body, "staleness": Staleness(**body["staleness"])})


@dataclass(frozen=True)
class FoldRecord:
    """One folded delta: its id, the version it was trained on, its staleness, w(staleness) and n_j."""

    update_id: str
    version: int
    staleness: int
    weight: float
    n_samples: float


@dataclass(frozen=True)
class Release:
    """A new model version and the deltas it holds."""

    version: int
    model: dict[str, np.ndarray]
    folded: tuple[FoldRecord, ...]


class Refused(ValueError):
    """A delta the buffer does not fold; `reason`: "too_stale", "unknown_version" or "duplicate"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def base_delta(trained: Mapping[str, Any], downloaded: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """trained - downloaded in float64, over the tensors of `downloaded` (the shared ones a device received)."""
    return {name: np.asarray(trained[name], np.float64) - np.asarray(value, np.float64)
            for name, value in downloaded.items()}


class Buffer:
    """The FedBuff buffer over a model: `fold` deltas, a `Release` every K; `checkpoint`/`resume` its state."""

    def __init__(self, config: BufferConfig, model: Mapping[str, np.ndarray], version: int = 0) -> None:
        unknown = set(config.statistics) - set(model)
        if unknown:
            raise ValueError(f"statistics {sorted(unknown)[:3]} are not tensors of the model")
        self.config = config
        self.version = version
        self.model = {name: np.array(value) for name, value in model.items()}  # its own copy, in its dtypes
        self.parameters = [name for name in self.model if name not in config.statistics]
        self.folded: list[FoldRecord] = []  # the open buffer's deltas, in the order they were folded
        self.seen: dict[str, int] = {}  # id -> version of the deltas folded within the staleness window
        self.history = {version: self._statistics()}  # the statistics of the versions within the window
        self.rule: Any = RULES[config.aggregator]()  # w(s_j)-scaled parameter deltas, weights n_j
        self.values: Any = RULES[config.aggregator]()  # statistics' values, weights w(s_j) n_j

    def _statistics(self) -> dict[str, np.ndarray]:
        return {name: self.model[name] for name in self.config.statistics}

    def staleness(self, version: int) -> int:
        """How many versions old a delta trained on `version` is now; Refused if the buffer would not fold it."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= self.version:
            raise Refused("unknown_version", f"a delta trained on version {version!r}, but version {self.version} "
                                             f"is the latest")
        staleness = self.version - version
        if staleness > self.config.max_staleness:
            raise Refused("too_stale", f"a delta trained on version {version} is {staleness} versions old, more than "
                                       f"the {self.config.max_staleness} allowed")
        if self.config.statistics and version not in self.history:  # a buffer started (not resumed) later
            raise Refused("unknown_version", f"the buffer holds no statistics of version {version}")
        return staleness

    def fold(self, delta: Mapping[str, np.ndarray], n_samples: float, version: int,
             update_id: str) -> tuple[FoldRecord, Release | None]:
        """Fold one delta, all or nothing (Refused or ValueError leave the buffer as it was); its record, and
        the release when it was the K-th. `update_id` names this upload, not the device or the version: a
        fast device may train twice on one version (the emulator uses "device#k", its k-th training)."""
        staleness = self.staleness(version)
        if update_id in self.seen:
            raise Refused("duplicate", f"update {update_id!r} was folded already")
        check_layout(delta, {name: value.shape for name, value in self.model.items()})
        weight = self.config.staleness.weight(staleness)
        sample_weight(n_samples, self.rule.total_weight)  # checked before anything changes: the adds below succeed
        if self.config.statistics:
            sample_weight(weight * float(n_samples), self.values.total_weight)
        clipped = clip_delta(delta, dict.fromkeys(delta, _ORIGIN), self.config.clip_norm or math.inf, delta)
        if self.parameters:
            for name in self.parameters:
                np.multiply(clipped[name], weight, out=clipped[name])  # our own float64 copy
            self.rule.add({name: clipped[name] for name in self.parameters}, n_samples)
        if self.config.statistics:
            old = self.history[version]
            self.values.add({name: old[name] + clipped[name] for name in old}, weight * float(n_samples))
        record = FoldRecord(update_id, version, staleness, weight, float(n_samples))
        self.folded.append(record)
        self.seen[update_id] = version
        return record, self._release() if len(self.folded) >= self.config.buffer_size else None

    def _release(self) -> Release:
        """Parameters: model + server_lr * the rule's step; statistics: the rule's mean of their values; each
        tensor in its own dtype. The buffer starts empty."""
        model = dict(self.model)
        if self.parameters:
            step = self.rule.result(np.float64) if isinstance(self.rule, WeightedMean) else self.rule.result()
            for name in self.parameters:
                model[name] = (model[name].astype(np.float64) + self.config.server_lr * step[name]).astype(
                    model[name].dtype)
        if self.config.statistics:
            values = self.values.result(np.float64) if isinstance(self.values, WeightedMean) else self.values.result()
            model |= {name: values[name].astype(model[name].dtype) for name in self.config.statistics}
        self.model, self.version = model, self.version + 1
        release = Release(self.version, self.model, tuple(self.folded))
        self.folded, self.rule, self.values = [], RULES[self.config.aggregator](), RULES[self.config.aggregator]()
        oldest = self.version - self.config.max_staleness  # a delta of an older version is refused as too stale
        self.seen = {key: version for key, version in self.seen.items() if version >= oldest}
        self.history = {v: stats for v, stats in self.history.items() if v >= oldest} | {
            self.version: self._statistics()}
        return release

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The whole state: tensors ("model/NAME", each kept version's statistics "history/V/NAME", and per rule
        ("step", "values") the mean's float64 sums "RULE/sum/NAME" or a robust rule's kept deltas
        "RULE/I/NAME") and a JSON-serializable document. The arrays are the buffer's own: write, don't modify."""
        tensors = {f"model/{name}": value for name, value in self.model.items()}
        for version, stats in self.history.items():
            tensors |= {f"history/{version}/{name}": value for name, value in stats.items()}
        rules = {}
        for key, rule in (("step", self.rule), ("values", self.values)):
            if isinstance(rule, WeightedMean):
                tensors |= {f"{key}/sum/{name}": value for name, value in rule.sums().items()}
                rules[key] = {"total_weight": rule.total_weight, "count": rule.count}
            else:
                for i, kept in enumerate(rule.updates()):
                    tensors |= {f"{key}/{i}/{name}": value for name, value in kept.items()}
        meta = {"format": FORMAT, "config": self.config.to_json(), "version": self.version, "names": list(self.model),
                "folded": [asdict(record) for record in self.folded], "seen": dict(self.seen),
                "history": list(self.history), "rules": rules}
        return tensors, meta

    @classmethod
    def resume(cls, config: BufferConfig, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Buffer:
        """The buffer `checkpoint()` described; ValueError if it is not one, or was written under other settings."""
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a buffer checkpoint (format {meta.get('format')!r}, expected {FORMAT})")
        if BufferConfig.from_json(meta["config"]) != config:
            raise ValueError(f"the buffer was written with {meta['config']}, not {config.to_json()}: resume it "
                             f"with the same settings")
        buffer = cls(config, {name: tensors[f"model/{name}"] for name in meta["names"]}, int(meta["version"]))
        buffer.folded = [FoldRecord(**record) for record in meta["folded"]]
        buffer.seen = {str(key): int(version) for key, version in meta["seen"].items()}
        buffer.history = {int(v): {name: tensors[f"history/{v}/{name}"] for name in config.statistics}
                          for v in meta["history"]}
        if buffer.folded and buffer.parameters:
            buffer.rule = _resumed_rule(config, tensors, meta, "step", buffer.parameters,
                                        [r.n_samples for r in buffer.folded])
        if buffer.folded and config.statistics:
            buffer.values = _resumed_rule(config, tensors, meta, "values", list(config.statistics),
                                          [r.weight * r.n_samples for r in buffer.folded])
        return buffer


def _resumed_rule(config: BufferConfig, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], key: str,
                  names: list[str], weights: list[float]) -> Any:
    """One of a buffer's rules as `checkpoint()` wrote it: the mean from its float64 sums, a robust rule by
    adding its kept deltas again in order."""
    if key in meta["rules"]:
        sums = {name: tensors[f"{key}/sum/{name}"] for name in names}
        return WeightedMean.from_sums(sums, meta["rules"][key]["total_weight"], meta["rules"][key]["count"],
                                      dict.fromkeys(names, np.float64))
    rule = RULES[config.aggregator]()
    for i, weight in enumerate(weights):
        rule.add({name: tensors[f"{key}/{i}/{name}"] for name in names}, weight)
    return rule
