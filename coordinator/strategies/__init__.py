"""Aggregation strategies, one file each; `strategy_for` picks the run's from its settings."""

from __future__ import annotations

import math

import numpy as np

from fedper.coordinator.config import Config
from fedper.coordinator.store import Store
from fedper.coordinator.strategies.base import Fleet, Strategy
from fedper.coordinator.strategies.budget import PrivacyBudget
from fedper.coordinator.strategies.central_dp import CentralDP
from fedper.coordinator.strategies.mean import AGGREGATORS, Mean
from fedper.manifest import Manifest
from fedper.wire import MAX_SECAGG_NEIGHBOURS, Topics


def strategy_for(config: Config, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet) -> Strategy:
    """The secure sum with --secure-aggregation, else central DP with --dp-noise-multiplier, else --aggregator."""
    if config.aggregator not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {config.aggregator!r}; choose one of {', '.join(AGGREGATORS)}")
    budget = _budget(config)
    if config.secure_aggregation:
        _check_secure(manifest, config)
        from fedper.coordinator.strategies.secure import SecureSum  # the privacy extra's cryptography

        return SecureSum(manifest, store, topics, fleet, clip_norm=float(config.clip_norm or 0),
                         stage_timeout=config.secagg_stage_timeout, degree=config.secagg_degree,
                         min_clients=config.min_clients, budget=budget)
    if budget is not None:
        return CentralDP(manifest, store, topics, fleet, budget)
    return Mean(manifest, store, topics, fleet, config.aggregator, config.clip_norm)


def _budget(config: Config) -> PrivacyBudget | None:
    """The run's DP state, a fresh secret (a resumed run replaces it with its own); None without DP."""
    z = config.dp_noise_multiplier
    if z is None:
        if config.dp_target_epsilon is not None or config.dp_adaptive_quantile is not None:
            raise ValueError("--dp-target-epsilon and --dp-adaptive-clipping need --dp-noise-multiplier")
        return None
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(f"--dp-noise-multiplier must be >= 0, got {z}")
    if config.clip_norm is None or not config.clip_norm > 0:
        raise ValueError("--dp-noise-multiplier needs --clip-norm > 0: the bound each update is clipped to")
    if config.aggregator != "mean":
        raise ValueError(f"--dp-noise-multiplier replaces the mean with DP-FedAvg; --aggregator "
                         f"{config.aggregator} cannot be combined with it")
    if config.dp_budget_action not in ("stop", "warn"):
        raise ValueError(f"--dp-budget-action must be stop or warn, got {config.dp_budget_action!r}")
    budget = PrivacyBudget(z, config.dp_delta, config.dp_target_epsilon, config.dp_budget_action, config.clip_norm,
                           config.dp_adaptive_quantile)
    if not config.clients_per_round:
        budget.check_first_round()
    return budget


def _check_secure(manifest: Manifest, config: Config) -> None:
    if config.clip_norm is None or not (math.isfinite(config.clip_norm) and config.clip_norm > 0):
        raise ValueError("--secure-aggregation needs --clip-norm C > 0: each device clips its delta to L2 norm "
                         "C, and [-C, C] is the range its values are quantized in")
    if config.aggregator != "mean":
        raise ValueError("--secure-aggregation sums the updates: it combines with --aggregator mean only")
    if config.dp_adaptive_quantile is not None:
        raise ValueError("--dp-adaptive-clipping needs the count of unclipped updates, which secure aggregation "
                         "hides: use a fixed --clip-norm")
    if config.secagg_degree is not None and (
            not 2 <= config.secagg_degree <= MAX_SECAGG_NEIGHBOURS or config.secagg_degree % 2):
        raise ValueError(f"--secagg-degree must be an even number in 2..{MAX_SECAGG_NEIGHBOURS}")
    if not config.secagg_stage_timeout > 0:
        raise ValueError("--secagg-stage-timeout must be > 0")
    odd = [t.name for t in manifest.shared_tensors if not np.issubdtype(np.dtype(t.dtype), np.floating)]
    if odd:
        raise ValueError(f"--secure-aggregation sums floating-point tensors; {odd[:3]} are not")
    try:
        import fedper.secagg  # noqa: F401  (cryptography, the privacy extra)
    except ImportError as e:
        raise ValueError(f"--secure-aggregation needs the privacy extra ({e}): pip install "
                         "'fedper-edge[privacy]'") from None
