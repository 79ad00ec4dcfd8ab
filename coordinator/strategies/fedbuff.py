"""Asynchronous buffered rounds (`--mode async`, FedBuff: Nguyen et al., AISTATS 2022): a round is one model
version, released by its K-th folded update instead of waiting for its devices.

A device trains on the version it downloaded (round k's model) and sends its trained shared tensors tagged
with k, as in a synchronous round; this strategy takes updates for rounds k - max_staleness .. k while round
k is open (older: stale_update), forms the delta against the model of the round it names and folds it into
fedper.buffered's Buffer (the one rule, shared with the emulator): clipped, weighted by w(staleness) and by
n_j (at most the weight cap), or a robust rule. The K-th fold releases the next version, and the engine
closes the round. A device adds at most one update to a version (the engine's round takes one per device).

Under DP (--dp-noise-multiplier) each release is DP-FedAvg's over the buffer: deltas clipped to C, uniform
weights, the fixed denominator K, Gaussian noise of std z C on the sum from the run's secret and the version;
BatchNorm statistics stay as they are. Accounting: docs/privacy.md ("Asynchronous rounds").

Checkpoint: at each version's opening the buffer's checkpoint (fedper.buffered: the model, the statistics and
ids of the versions within the staleness window) in `version-r<k>.safetensors`, kept while k is in the window
(the model a stale delta is formed against); every PARTIAL_EVERY folds the buffer's checkpoint again; the
blobs folded since, as received, in slot files. A restart folds them again, in order: the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedper import buffered
from fedper.buffered import Buffer, BufferConfig, base_delta
from fedper.coordinator.config import Aggregation, Asynchronous, Privacy
from fedper.coordinator.store import RoundRecord, Store
from fedper.coordinator.strategies.base import (
    Fleet,
    Folded,
    Opened,
    Ready,
    Refused,
    Released,
    Status,
    Strategy,
    Terms,
    Wait,
    weight_cap,
)
from fedper.coordinator.strategies.budget import budget_for
from fedper.coordinator.strategies.mean import PARTIAL_EVERY
from fedper.manifest import Manifest
from fedper.payload import decode_shared, max_blob_size
from fedper.privacy import private_tensor_names, round_generator
from fedper.wire import SECAGG_CODEC, Topics, UpdateMeta, WireError

REFUSALS = {"too_stale": "stale_update", "unknown_version": "late_update", "duplicate": "duplicate_update"}
CACHED_VERSIONS = 4  # models of older versions kept in memory for the stale deltas to come


class FedBuff(Strategy):
    """Staleness-weighted deltas in a buffer of K; a version released per K folds."""

    groups = ("asynchronous", "aggregation", "privacy")

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, asynchronous: Asynchronous,
                 aggregation: Aggregation, privacy: Privacy) -> None:
        config = asynchronous.buffer_config(aggregation.clip_norm, aggregation.aggregator)
        # the engine's closing rule never closes a buffer (its quorum is K): its K-th fold does; a version every K
        # updates: ranking the fleet at each would cost O(N / K) an update
        terms = Terms(max_blob_size(manifest), answers="buffered update(s)", quorum=config.buffer_size,
                      staleness=config.max_staleness, folded_frees_place=True, rerank_each_round=False)
        budget = budget_for(privacy, aggregation.clip_norm, None, buffered=True)
        super().__init__(manifest, store, topics, fleet, terms, private=budget is not None)
        self.budget = budget
        if budget is None:  # BatchNorm statistics averaged by value (fedper.buffered); under DP left unchanged
            statistics = tuple(t.name for t in manifest.shared_tensors if not t.trainable)
            self.config = BufferConfig(**{**config.to_json(), "staleness": config.staleness,
                                          "statistics": statistics})
            self.frozen: tuple[str, ...] = ()
        else:  # DP: the clip norm is C, the weights uniform (n_j = 1: K in the denominator)
            self.config = BufferConfig(**{**config.to_json(), "staleness": config.staleness,
                                          "clip_norm": budget.clip_norm, "aggregator": "mean"})
            private = set(private_tensor_names(manifest))
            self.frozen = tuple(t.name for t in manifest.shared_tensors if t.name not in private)
        self.max_weight_ratio = aggregation.max_weight_ratio if config.aggregator == "mean" and budget is None \
            else math.inf
        self.weight_cap: float | None = None  # the open buffer's cap once its first update is folded (inf: none)
        self.buffer: Buffer | None = None
        self.versions: dict[int, str] = {}  # version -> its opening checkpoint (its model), within the window
        self.partial: tuple[str, dict[str, Any]] | None = None  # the buffer's latest checkpoint: file, JSON
        self.updates: list[dict[str, Any]] = []  # the folds since that checkpoint, in order: device, round, slot
        self.released: buffered.Release | None = None
        self.finished = False
        self._models: dict[int, Mapping[str, np.ndarray]] = {}  # a few older versions' models, as decoded

    # ------------------------------------------------------------ the round (one version)

    def open(self, round_: RoundRecord, model: Mapping[str, np.ndarray], finished: bool,
             saved: Mapping[str, Any] | None = None) -> Opened:
        """Version `number` opens: the buffer starts empty (the first time, over `model`) and is checkpointed.
        Resumed: the buffer from its latest checkpoint, then the blobs folded after it, folded again in order."""
        super().open(round_, model, finished, saved)
        number, self.finished = round_.number, finished
        if saved is not None:
            self._resume(saved, round_)
            return Opened({"max_staleness": self.config.max_staleness}, bool(self.budget and self.budget.stopped),
                          ready=self.released is not None)
        self.released, self.updates, self.weight_cap = None, [], None
        if self.buffer is None:
            self.buffer = Buffer(self.config, model, number)
        if not finished:
            self.partial = self._write_checkpoint(f"version-r{number}.safetensors")
            oldest = self.terms.oldest_round(number)
            self.versions = {v: name for v, name in self.versions.items() if v >= oldest} | {number: self.partial[0]}
            self._models = {v: m for v, m in self._models.items() if v >= oldest}
        return Opened({"max_staleness": self.config.max_staleness})

    def check(self, meta: UpdateMeta) -> Refused | None:
        if self.finished:
            return Refused("late_update", f"the run is finished: round {self.number} was the last")
        if meta.round > self.number:
            return Refused("late_update", f"update for round {meta.round}, but round {self.number} is open")
        if meta.round < self.terms.oldest_round(self.number):
            return Refused("stale_update", f"update trained on round {meta.round}'s model, more than "
                           f"--max-staleness {self.config.max_staleness} versions before the open round {self.number}")
        if meta.codec == SECAGG_CODEC:
            return Refused("secagg", "this round takes clear updates")
        return None

    def accept(self, device: str, kind: str, payload: bytes, meta: UpdateMeta | None,
               now: float) -> Folded | Refused:
        """The delta against the model of the round it names, folded all or nothing; checkpointed as Mean does.
        The K-th fold releases the version: Ready."""
        assert meta is not None, "a strategy of no topic kinds of its own"
        self._fold(device, payload, meta.round, meta.n_samples, meta.codec)
        if len(self.updates) >= PARTIAL_EVERY and self.released is None:
            self.partial = self._write_checkpoint(f"buffer-r{self.number}-{len(self._buffer().folded)}.safetensors")
            self.updates = []  # the checkpoint covers them: their slots are free once the commit names it
        else:  # the next slot: the committed state names slots 0 .. len(updates) - 2 alone
            self.updates[-1]["slot"] = self.store.write_slot(len(self.updates) - 1, payload)
        return Folded(Wait() if self.released is None else Ready())

    def _fold(self, device: str, blob: bytes, version: int, n_samples: int, codec: str | None = None) -> None:
        buffer = self._buffer()
        downloaded = self._model(version)
        trained = decode_shared(self.manifest, blob, codec, base=downloaded)
        delta = base_delta(trained, downloaded)
        for name in self.frozen:
            delta[name][...] = 0.0
        try:
            _, release = buffer.fold(delta, self._weight(n_samples), version, f"{device}@{version}")
        except buffered.Refused as e:
            raise WireError(REFUSALS[e.reason], str(e)) from None
        except ValueError as e:
            raise WireError("rejected", f"the aggregation rule refused the update: {e}") from None
        self.updates.append({"device": device, "round": version, "n_samples": n_samples})
        if release is not None:
            self.released = self._noised(release)

    def _weight(self, n_samples: int) -> float:
        """1 under DP (K in the denominator); else n_j, at most the buffer's cap (set at its first fold from the
        registered devices' median, as Mean's)."""
        if self.budget is not None:
            return 1.0
        if self.weight_cap is None:
            self.weight_cap = weight_cap(self.fleet, self.max_weight_ratio)
        return min(n_samples, self.weight_cap)

    def _noised(self, release: buffered.Release) -> buffered.Release:
        """DP: Gaussian noise of std server_lr z C / K on each private tensor of the released version, drawn from
        the run's secret and the version (a restart draws the same), and the buffer goes on from it."""
        if self.budget is None:
            return release
        rng = round_generator(self.budget.secret, release.version)
        std = self.config.server_lr * self.budget.noise_multiplier * self.budget.clip_norm / self.config.buffer_size
        buffer = self._buffer()
        for name in private_tensor_names(self.manifest):
            value = buffer.model[name]
            buffer.model[name] = (value.astype(np.float64) + rng.normal(0.0, std, value.shape)).astype(value.dtype)
        return buffered.Release(release.version, buffer.model, release.folded)

    def release(self, closed: RoundRecord, last: bool) -> Released:
        """The version; figures: its deltas (staleness, weight), its weight cap and, under DP, its privacy."""
        assert self.released is not None, "the engine releases a buffer only once it is ready"
        folded = self.released.folded
        figures: dict[str, Any] = {"buffer": {
            "version": self.released.version, "updates": [r.update_id for r in folded],
            "staleness": [r.staleness for r in folded], "staleness_weight": [r.weight for r in folded],
            "max_staleness": self.config.max_staleness}}
        cap = self.weight_cap
        if cap is not None and math.isfinite(cap):
            figures |= {"weight_cap": cap, "capped": sorted(d for d, f in closed.folded.items() if f.n_samples > cap)}
        if self.budget is not None:
            z, c, k = self.budget.noise_multiplier, self.budget.clip_norm, self.config.buffer_size
            release = {"clip_norm": c, "noise_std": self.config.server_lr * z * c / k, "expected": k,
                       "unclipped": None, "count": len(folded)}
            figures["dp"] = self.budget.account(closed.number, 1.0, z, release, len(self.fleet.registered), last)
        stop = self.budget is not None and self.budget.stopped
        return Released(dict(self.released.model), figures, stop)

    def status(self) -> Status:
        buffer = self.buffer
        fields: dict[str, Any] = {"buffer": {"folded": len(buffer.folded) if buffer else 0,
                                             "buffer_size": self.config.buffer_size,
                                             "max_staleness": self.config.max_staleness}}
        if self.budget is None:
            return Status(fields)
        return Status(fields | {"dp": self.budget.summary()}, self.budget.epsilon)

    # ------------------------------------------------------------ checkpoint

    def checkpoint(self) -> dict[str, Any]:
        assert self.partial is not None
        cap = self.weight_cap if self.weight_cap is not None and math.isfinite(self.weight_cap) else None
        privacy = None if self.budget is None else {**self.budget.checkpoint(), "partial_meta": None}
        return {"privacy": privacy, "versions": {str(v): name for v, name in self.versions.items()},
                "buffer": {"file": self.partial[0], "meta": self.partial[1]}, "updates": list(self.updates),
                "weight_cap": cap}

    def _resume(self, part: Mapping[str, Any], round_: RoundRecord) -> None:
        if "buffer" not in part:
            raise ValueError(f"{self.store.dir} holds a run in synchronous rounds: resume it without --mode async, "
                             "or use a fresh --state-dir")
        if self.budget is not None:
            self.budget.resume(part["privacy"])
        self.versions = {int(v): name for v, name in part["versions"].items()}
        file, meta = part["buffer"]["file"], part["buffer"]["meta"]
        self.partial = (file, meta)
        self.buffer = Buffer.resume(self.config, self.store.read_tensors(file), meta)
        self.weight_cap = part.get("weight_cap")
        if self.weight_cap is None and round_.folded:
            self.weight_cap = math.inf
        self.released, self.updates, self._models = None, [], {}
        for entry in part["updates"]:
            blob = self.store.read_slot(entry["slot"])
            self._fold(entry["device"], blob, entry["round"], entry["n_samples"])
            self.updates[-1]["slot"] = entry["slot"]

    # ------------------------------------------------------------ helpers

    def _buffer(self) -> Buffer:
        assert self.buffer is not None, "a version opens (or is resumed) before any update"
        return self.buffer

    def _write_checkpoint(self, name: str) -> tuple[str, dict[str, Any]]:
        tensors, meta = self._buffer().checkpoint()
        return self.store.write_tensors(name, tensors), meta

    def _model(self, version: int) -> Mapping[str, np.ndarray]:
        """The shared tensors of `version`: the open round's, or read back from its opening checkpoint."""
        if version == self.number:
            return self.model
        model = self._models.pop(version, None)
        if model is None:
            if version not in self.versions:
                raise WireError("stale_update", f"the model of round {version} is no longer kept")
            tensors = self.store.read_tensors(self.versions[version])
            model = {t.name: tensors[f"model/{t.name}"] for t in self.manifest.shared_tensors}
        self._models[version] = model  # the most recently used last
        while len(self._models) > CACHED_VERSIONS:
            del self._models[next(iter(self._models))]
        return model
