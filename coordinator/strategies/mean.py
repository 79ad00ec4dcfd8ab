"""The plain rounds: the n_j-weighted mean (streaming, O(model)) or a robust rule over clear updates.

Each accepted update is folded at once and checkpointed as its blob as received, in a reused slot file;
every PARTIAL_EVERY updates the streaming rule's float64 sum is written instead and the slots it covers
freed, so a restart resumes the sum bit for bit, then folds the blobs after it (docs/reliability.md).

The weight cap (--max-weight-ratio c, the mean only): a device's weight is min(n_j, c x median), the
median over the n_samples of the devices registered when the round folds its first update. Not the
median of the round's contributors: a streaming fold cannot wait for the round to close, and the
registered fleet is known before anything is folded, is no smaller than the round (it holds every
possible contributor) and moves by at most one rank per device that lies. The cap is fixed for the
round (checkpointed) and applied to the weight handed to the fold, never inside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedper.aggregation import CoordinateMedian, TrimmedMean, WeightedMean, clip_update
from fedper.coordinator.config import Aggregation
from fedper.coordinator.store import RoundRecord, Store
from fedper.coordinator.strategies.base import Fleet, Folded, Opened, Refused, Released, Strategy, weight_cap
from fedper.manifest import Manifest
from fedper.payload import decode_shared
from fedper.wire import SECAGG_CODEC, Topics, UpdateMeta

AGGREGATORS: dict[str, Callable[[], Any]] = {  # by name: coordinator/config.py's AGGREGATOR_NAMES
    "mean": WeightedMean,
    "median": CoordinateMedian,
    "trimmed-mean": TrimmedMean,
}
PARTIAL_EVERY = 8  # a streaming rule: a checkpoint of its float64 sum per this many accepted updates


class Mean(Strategy):
    """--aggregator over clear updates, each clipped to --clip-norm against the round's model when set."""

    groups = ("aggregation",)

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, aggregation: Aggregation,
                 private: bool = False) -> None:
        super().__init__(manifest, store, topics, fleet, private=private)
        self.aggregator, self.clip_norm = aggregation.aggregator, aggregation.clip_norm
        # the robust rules ignore n_j
        self.max_weight_ratio = aggregation.max_weight_ratio if self.aggregator == "mean" else math.inf
        self.weight_cap: float | None = None  # the round's cap once its first update is folded (inf: none)
        self.partial: str | None = None  # the rule's float64 running sum, if one was written this round
        self.updates: dict[str, dict[str, Any]] = {}  # device -> the slot of its update (as received) after the partial

    def open(self, round_: RoundRecord, model: Mapping[str, np.ndarray], finished: bool,
             saved: Mapping[str, Any] | None = None) -> Opened:
        """A fresh rule; resumed: the partial sum, then the blobs folded after it."""
        opened = super().open(round_, model, finished, saved)
        self.rule = self._new_rule()
        self.partial, self.updates, self.weight_cap = None, {}, None
        if saved is not None:
            self._resume(saved, round_)
        return opened

    def _new_rule(self) -> Any:
        return AGGREGATORS[self.aggregator]()

    def _streaming(self) -> bool:
        """Whether the rule keeps a running sum (checkpointed as such) rather than every update."""
        return isinstance(self.rule, WeightedMean)

    def check(self, meta: UpdateMeta) -> Refused | None:
        refused = super().check(meta)
        if refused is None and meta.codec == SECAGG_CODEC:
            return Refused("secagg", "this round takes clear updates")
        return refused

    def accept(self, device: str, kind: str, payload: bytes, meta: UpdateMeta | None,
               now: float) -> Folded | Refused:
        """Fold an update checked in full: the rule's add is all or nothing, then its checkpoint file is written."""
        assert meta is not None, "a strategy of no topic kinds of its own"
        tensors = self._prepared(decode_shared(self.manifest, payload, meta.codec, base=self.model))
        try:
            self.rule.add(tensors, self._weight(meta.n_samples))
        except ValueError as e:
            return Refused("rejected", f"the aggregation rule refused the update: {e}")
        if self._streaming() and len(self.updates) + 1 >= PARTIAL_EVERY:
            self.partial = self.store.write_tensors(f"partial-r{self.number}-{self.rule.count}.safetensors",
                                                    self.rule.sums())
            self.updates = {}  # the partial covers them: their slots are free once the commit names it
        else:  # the next slot: the committed state names slots 0 .. len(updates) - 1 alone
            self.updates[device] = self.store.write_slot(len(self.updates), payload)
        return Folded()

    def _weight(self, n_samples: int) -> float:
        """The device's weight in the fold: n_j, at most the round's cap (set here, at the first fold)."""
        if self.weight_cap is None:
            self.weight_cap = weight_cap(self.fleet, self.max_weight_ratio)
        return min(n_samples, self.weight_cap)

    def _prepared(self, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Clipped (with --clip-norm) against the round's model."""
        if self.clip_norm is not None:
            tensors = clip_update(tensors, self.model, self.clip_norm)
        return tensors

    def release(self, closed: RoundRecord, last: bool) -> Released:
        """The rule's result; figures: the weight cap and the devices it bounded (with --max-weight-ratio)."""
        cap = self.weight_cap
        if cap is None or not math.isfinite(cap):
            return Released(self.rule.result())
        capped = sorted(d for d, f in closed.folded.items() if f.n_samples > cap)
        return Released(self.rule.result(), {"weight_cap": cap, "capped": capped})

    def checkpoint(self) -> dict[str, Any]:
        cap = self.weight_cap if self.weight_cap is not None and math.isfinite(self.weight_cap) else None
        return {**super().checkpoint(), "partial": self.partial, "updates": dict(self.updates), "weight_cap": cap}

    def _resume(self, part: Mapping[str, Any], round_: RoundRecord) -> None:
        """The partial sum, then the blobs folded after it."""
        self.partial = part.get("partial")
        self.weight_cap = part.get("weight_cap")  # None with updates folded: uncapped (lifted, or an earlier release)
        if self.weight_cap is None and round_.folded:
            self.weight_cap = math.inf
        if self.partial:
            self.rule = self._resumed(self.store.read_tensors(self.partial), part, round_)
        for device, kept in part.get("updates", {}).items():
            # a state.json of an earlier release names a file of its own per blob
            blob = self.store.read_bytes(kept) if isinstance(kept, str) else self.store.read_slot(kept)
            self.updates[device] = self.store.write_slot(len(self.updates), blob) if isinstance(kept, str) else kept
            tensors = decode_shared(self.manifest, blob, base=self.model)
            self.rule.add(self._prepared(tensors), self._weight(round_.folded[device].n_samples))

    def _resumed(self, sums: dict[str, np.ndarray], part: Mapping[str, Any], round_: RoundRecord) -> Any:
        """The rule from its partial sum, which holds the folded updates not kept as blobs."""
        blobs = part.get("updates", {})
        in_partial = [self._weight(f.n_samples) for device, f in round_.folded.items() if device not in blobs]
        dtypes = {t.name: t.dtype for t in self.manifest.shared_tensors}
        return WeightedMean.from_sums(sums, float(sum(in_partial)), len(in_partial), dtypes)
