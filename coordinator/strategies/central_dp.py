"""Central differential privacy (`--dp-noise-multiplier`): the plain round's streaming fold with DP-FedAvg.

Clipped deltas, uniform weights, Gaussian noise from a generator derived from the run's secret and the
round, so a restart releases the same model bit for bit; each released round is accounted and the next
one checked against the budget (docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedper.coordinator.store import RoundRecord, Store
from fedper.coordinator.strategies.base import Fleet, Release
from fedper.coordinator.strategies.budget import PrivacyBudget
from fedper.coordinator.strategies.mean import Mean
from fedper.manifest import Manifest
from fedper.privacy import DPFedAvg, prepare_release, private_tensor_names, round_generator
from fedper.wire import Outgoing, Topics, UpdateMeta


class CentralDP(Mean):
    """DP-FedAvg in place of the mean; the rule clips (the trainable tensors), so no --clip-norm clip before."""

    private = True

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, budget: PrivacyBudget) -> None:
        super().__init__(manifest, store, topics, fleet)
        self.budget = budget
        self.partial_meta: dict[str, Any] | None = None  # the rule's meta when its partial sums were written

    def open(self, number: int, model: Mapping[str, np.ndarray], finished: bool) -> None:
        super().open(number, model, finished)
        self.partial_meta = None

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

    def accept(self, device: str, blob: bytes, meta: UpdateMeta, now: float) -> tuple[bool, list[Outgoing]]:
        partial = self.partial
        result = super().accept(device, blob, meta, now)
        if self.partial != partial:
            self.partial_meta = self.rule.meta()
        return result

    def release(self, closed: RoundRecord) -> Release:
        """The closing round's denominator m and adaptive clipping's split of z (fedper.privacy.prepare_release)."""
        prepare_release(self.rule, float(self.fleet.round_size()), self.budget.noise_multiplier,
                        self.budget.clipping)
        return super().release(closed)

    def record(self, closed: RoundRecord, last: bool) -> dict[str, Any]:
        rule = self.rule
        release = {"clip_norm": rule.clip_norm, "noise_std": rule.noise_std, "expected": rule.expected_weight,
                   "unclipped": rule.unclipped, "count": rule.count}
        figures = self.budget.account(closed.number, self.fleet.invited_fraction(closed), self.budget.noise_multiplier,
                                      release, len(self.fleet.registered), last)
        self.stopped = self.budget.stopped
        if self.budget.clipping is not None:  # the count's noise comes from the round's generator, after the model's
            figures["next_clip_norm"] = self.budget.clipping.step(rule.unclipped, rule.count, rule.expected_weight,
                                                                  rule.rng)
        return {"dp": figures}

    @property
    def epsilon(self) -> float | None:
        return self.budget.epsilon

    def state_fields(self) -> dict[str, Any]:
        return {"dp": self.budget.summary()}

    def checkpoint(self) -> dict[str, Any]:
        return {**super().checkpoint(), "privacy": {**self.budget.checkpoint(),
                                                    "partial_meta": self.partial_meta if self.partial else None}}

    def resume(self, part: Mapping[str, Any], round_: RoundRecord, model: Mapping[str, np.ndarray],
               finished: bool) -> None:
        if part.get("privacy") is not None:
            self.budget.resume(part["privacy"])
            self.stopped = self.budget.stopped
        super().resume(part, round_, model, finished)

    def _resumed(self, sums: dict[str, np.ndarray], part: Mapping[str, Any], round_: RoundRecord) -> DPFedAvg:
        self.partial_meta = part["privacy"]["partial_meta"]
        return DPFedAvg.resume(self.model, sums, self.partial_meta or {},
                               round_generator(self.budget.secret, round_.number))
