"""Central differential privacy (`--dp-noise-multiplier`): the plain round's streaming fold with DP-FedAvg.

Clipped deltas, uniform weights, Gaussian noise from a generator derived from the run's secret and the
round, so a restart releases the same model bit for bit; each released round is accounted and the next
one checked against the budget (docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedper.coordinator.config import Aggregation, Privacy, Selection
from fedper.coordinator.store import RoundRecord, Store
from fedper.coordinator.strategies.base import Fleet, Folded, Opened, Refused, Released, Status
from fedper.coordinator.strategies.budget import budget_for
from fedper.coordinator.strategies.mean import Mean
from fedper.manifest import Manifest
from fedper.privacy import DPFedAvg, prepare_release, private_tensor_names, round_generator
from fedper.wire import Topics, UpdateMeta


class CentralDP(Mean):
    """DP-FedAvg in place of the mean; the rule clips (the trainable tensors), so no --clip-norm clip before."""

    groups = ("aggregation", "privacy", "selection")

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, aggregation: Aggregation,
                 privacy: Privacy, selection: Selection) -> None:
        super().__init__(manifest, store, topics, fleet, aggregation, private=True)
        budget = budget_for(privacy, aggregation.clip_norm, selection.clients_per_round)
        assert budget is not None, "central DP runs with --dp-noise-multiplier"
        self.budget = budget
        self.max_weight_ratio = math.inf  # DP-FedAvg's weights are uniform: no n_j to cap
        self.partial_meta: dict[str, Any] | None = None  # the rule's meta when its partial sums were written

    def open(self, round_: RoundRecord, model: Mapping[str, np.ndarray], finished: bool,
             saved: Mapping[str, Any] | None = None) -> Opened:
        """Resumed: the budget first (the round's rule draws its noise from the run's secret)."""
        self.partial_meta = None
        if saved is not None and saved.get("privacy") is not None:
            self.budget.resume(saved["privacy"])
        return Opened(super().open(round_, model, finished, saved).fields, self.budget.stopped)

    def _new_rule(self) -> DPFedAvg:
        """This round's rule: its noise comes from the run's secret and the round number."""
        return DPFedAvg(self.model, clip_norm=self.budget.current_clip_norm, expected_weight=1.0,
                        noise_multiplier=self.budget.noise_multiplier,
                        rng=round_generator(self.budget.secret, self.number),
                        private_names=private_tensor_names(self.manifest))

    def _streaming(self) -> bool:
        return True

    def _prepared(self, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return tensors

    def accept(self, device: str, kind: str, payload: bytes, meta: UpdateMeta | None,
               now: float) -> Folded | Refused:
        partial = self.partial
        result = super().accept(device, kind, payload, meta, now)
        if self.partial != partial:
            self.partial_meta = self.rule.meta()
        return result

    def release(self, closed: RoundRecord, last: bool) -> Released:
        """The closing round's denominator m and adaptive clipping's split of z (fedper.privacy.prepare_release);
        the round accounted, and the next one checked against the budget."""
        prepare_release(self.rule, float(self.fleet.round_size()), self.budget.noise_multiplier,
                        self.budget.clipping)
        model = super().release(closed, last).model
        rule = self.rule
        release = {"clip_norm": rule.clip_norm, "noise_std": rule.noise_std, "expected": rule.expected_weight,
                   "unclipped": rule.unclipped, "count": rule.count}
        figures = self.budget.account(closed.number, self.fleet.invited_fraction(closed), self.budget.noise_multiplier,
                                      release, len(self.fleet.registered), last)
        if self.budget.clipping is not None:  # the count's noise comes from the round's generator, after the model's
            figures["next_clip_norm"] = self.budget.clipping.step(rule.unclipped, rule.count, rule.expected_weight,
                                                                  rule.rng)
        return Released(model, {"dp": figures}, self.budget.stopped)

    def status(self) -> Status:
        return Status({"dp": self.budget.summary()}, self.budget.epsilon)

    def checkpoint(self) -> dict[str, Any]:
        return {**super().checkpoint(), "privacy": {**self.budget.checkpoint(),
                                                    "partial_meta": self.partial_meta if self.partial else None}}

    def _resumed(self, sums: dict[str, np.ndarray], part: Mapping[str, Any], round_: RoundRecord) -> DPFedAvg:
        self.partial_meta = part["privacy"]["partial_meta"]
        return DPFedAvg.resume(self.model, sums, self.partial_meta or {},
                               round_generator(self.budget.secret, round_.number))
