"""Aggregation rules, one implementation each, used by the emulator and the coordinator alike.

A rule is a small object with `add(tensors, n_samples)` and `result()`. The FedPer rule (paper,
Algorithm 2) is a running n_j-weighted sum, so memory is O(model) whatever the fleet size.
Tensors may be numpy arrays or torch tensors (on any device): only `*`, `+=` and a dtype cast
are used, so the emulator's GPU path runs the very same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Tensor = Any  # numpy.ndarray or torch.Tensor


def _as_float64(x: Tensor) -> Tensor:
    """Accumulate in float64 so the result does not depend on the order updates arrive in (to 1e-12)."""
    return x.double() if hasattr(x, "double") else x.astype("float64")


def _as_dtype_of(acc: Tensor, like: Tensor) -> Tensor:
    return acc.to(like.dtype) if hasattr(acc, "to") else acc.astype(like.dtype)


class WeightedMean:
    """W = sum_j gamma_j W_j with gamma_j = n_j / sum n_j over the updates that were added."""

    def __init__(self) -> None:
        self._sum: dict[str, Tensor] = {}
        self._like: dict[str, Tensor] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, Tensor], n_samples: float) -> None:
        if n_samples <= 0:
            raise ValueError(f"an update needs a positive sample count, got {n_samples}")
        if self._sum and set(tensors) != set(self._sum):
            missing, extra = set(self._sum) - set(tensors), set(tensors) - set(self._sum)
            raise ValueError(f"update layout differs: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
        for name, value in tensors.items():
            weighted = _as_float64(value) * float(n_samples)
            if name in self._sum:
                self._sum[name] += weighted
            else:
                self._sum[name] = weighted
                self._like[name] = value
        self.total_weight += float(n_samples)
        self.count += 1

    def result(self) -> dict[str, Tensor]:
        if not self.count:
            raise ValueError("no update to aggregate")
        return {
            name: _as_dtype_of(acc * (1.0 / self.total_weight), self._like[name]) for name, acc in self._sum.items()
        }


def weighted_mean(updates: list[tuple[Mapping[str, Tensor], float]]) -> dict[str, Tensor]:
    """Convenience for a list of (tensors, n_samples)."""
    rule = WeightedMean()
    for tensors, n in updates:
        rule.add(tensors, n)
    return rule.result()
