"""The run's differential-privacy state, shared by central DP and the secure sum with distributed noise.

A restart must keep the noise secret (as sensitive as the clear updates: whoever knows it can subtract
the noise), the accountant and whether the budget stopped the run (docs/privacy.md).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

from fedper.coordinator.config import Privacy
from fedper.coordinator.logs import log
from fedper.privacy import AdaptiveClipping, PrivacyAccountant, budget_action


def json_epsilon(epsilon: float) -> float | None:
    """Epsilon for JSON (metrics.jsonl, the state topic): null when unbounded (a noise multiplier of 0)."""
    return epsilon if math.isfinite(epsilon) else None


def budget_for(privacy: Privacy, clip_norm: float | None, clients_per_round: int | None,
               buffered: bool = False) -> PrivacyBudget | None:
    """The run's DP state, a fresh secret (a resumed run replaces it with its own); None without DP. Sampling is
    fixed with M of the online devices (--clients-per-round), or every device in every version (`buffered`), each
    replace-one; else Poisson (docs/privacy.md)."""
    if privacy.noise_multiplier is None:
        return None
    fixed = clients_per_round is not None or buffered
    budget = PrivacyBudget(privacy.noise_multiplier, privacy.delta, privacy.target_epsilon, privacy.budget_action,
                           float(clip_norm or 0), privacy.adaptive_quantile, sampling="fixed" if fixed else "poisson")
    if not clients_per_round or buffered:
        budget.check_first_round()
    return budget


class PrivacyBudget:
    """Epsilon spent so far at `delta`, checked against `target_epsilon` before each round opens."""

    def __init__(self, noise_multiplier: float, delta: float, target_epsilon: float | None, action: str,
                 clip_norm: float, adaptive_quantile: float | None = None, sampling: str = "poisson") -> None:
        self.noise_multiplier, self.delta = noise_multiplier, delta
        self.target_epsilon, self.action = target_epsilon, action
        self.clip_norm = clip_norm  # the fixed clip norm, or adaptive clipping's start
        self.secret = secrets.randbits(128)  # a resumed run replaces it with its own
        self.accountant = PrivacyAccountant(delta, sampling=sampling)  # "fixed": M of the online, docs/privacy.md
        try:
            self.accountant.epsilon()  # imports dp-accounting now rather than at the first round's close
        except ImportError as e:
            raise ValueError(str(e)) from None
        self.epsilon = 0.0  # after the closed rounds (cached: the state message is sent often)
        self.stopped = False
        self.clipping = (None if adaptive_quantile is None
                         else AdaptiveClipping(clip_norm, target_quantile=adaptive_quantile))

    def check_first_round(self) -> None:
        """Refuse a budget that one round with every device already spends."""
        projected = self.accountant.projected_epsilon(1.0, self.noise_multiplier)
        if budget_action(projected, self.target_epsilon, "stop") == "stop":
            raise ValueError(f"--dp-target-epsilon {self.target_epsilon}: one round with every device at noise "
                             f"multiplier {self.noise_multiplier} already spends more (epsilon {projected:.4g} at "
                             f"delta {self.delta})")

    @property
    def current_clip_norm(self) -> float:
        """The clip norm of the open round: adaptive clipping's, else the fixed one."""
        return self.clipping.clip_norm if self.clipping else self.clip_norm

    def account(self, number: int, q: float, z: float, release: Mapping[str, Any], registered: int,
                last: bool) -> dict[str, Any]:
        """Record released round `number` (sampling rate q, effective noise multiplier z), then check the next
        one's projected epsilon against the budget; the round's DP figures for metrics.jsonl."""
        if self.delta * registered >= 1:
            log.warning("--dp-delta %g is not below 1/N for N = %d registered devices: epsilon means little",
                        self.delta, registered)
        self.accountant.record(q, z)
        self.epsilon = self.accountant.epsilon()
        if not last:
            projected = self.accountant.projected_epsilon(q, self.noise_multiplier)
            action = budget_action(projected, self.target_epsilon, self.action)  # type: ignore[arg-type]
            if action != "continue":
                log.warning("privacy budget: round %d would bring epsilon to %.4g, above --dp-target-epsilon %g "
                            "(delta %g)%s", number + 1, projected, self.target_epsilon, self.delta,
                            f": run stopped, the final model is round {number}'s" if action == "stop"
                            else ": going on (--dp-budget-action warn)")
                self.stopped = action == "stop"
        log.info("round %d: DP epsilon %.4g at delta %g (q %.4g, z %g, %s of %d update(s) within clip norm %g)",
                 number, self.epsilon, self.delta, q, z, "?" if release["unclipped"] is None else release["unclipped"],
                 release["count"], release["clip_norm"])
        return {"epsilon": json_epsilon(self.epsilon), "delta": self.delta, "sampling_rate": q,
                "noise_multiplier": z, "clip_norm": release["clip_norm"], "noise_std": release["noise_std"],
                "expected_participants": release["expected"], "unclipped": release["unclipped"],
                "stopped": self.stopped}

    def summary(self) -> dict[str, Any]:
        """The state message's `dp` entry."""
        return {"epsilon": json_epsilon(self.epsilon), "delta": self.delta, "target_epsilon": self.target_epsilon,
                "noise_multiplier": self.noise_multiplier, "clip_norm": self.current_clip_norm,
                "rounds_accounted": self.accountant.rounds, "budget_stopped": self.stopped}

    def checkpoint(self) -> dict[str, Any]:
        return {"secret": f"{self.secret:x}", "accountant": self.accountant.to_json(), "stopped": self.stopped,
                "clipping": self.clipping.to_json() if self.clipping else None}

    def resume(self, part: Mapping[str, Any]) -> None:
        self.secret = int(part["secret"], 16)
        self.accountant = PrivacyAccountant.from_json(part["accountant"])
        self.stopped = part["stopped"]
        self.epsilon = self.accountant.epsilon()
        if self.clipping is not None:  # the clip norm the run has adapted to, not --clip-norm's start
            self.clipping = AdaptiveClipping.from_json(part["clipping"])
