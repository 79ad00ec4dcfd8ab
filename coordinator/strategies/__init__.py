"""Aggregation strategies, one file each; `strategy_for` picks the run's from its settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedper.coordinator.config import Config
from fedper.coordinator.store import Store
from fedper.coordinator.strategies.base import Fleet, Strategy
from fedper.coordinator.strategies.budget import PrivacyBudget
from fedper.coordinator.strategies.central_dp import CentralDP
from fedper.coordinator.strategies.mean import Mean
from fedper.manifest import Manifest
from fedper.wire import Topics


def strategy_for(config: Config, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet) -> Strategy:
    """Buffered rounds with --mode async (with or without DP); else the secure sum with --secure-aggregation, else
    central DP with --dp-noise-multiplier, else --aggregator.
    `config`'s groups are valid; what they cannot check alone (the manifest, the extras) is checked here."""
    budget = _budget(config)
    if config.asynchronous.enabled:  # config.py refuses it with secure aggregation
        from fedper.coordinator.strategies.fedbuff import FedBuff

        buffer = config.asynchronous.buffer_config(config.aggregation.clip_norm, config.aggregation.aggregator)
        return FedBuff(manifest, store, topics, fleet, buffer, config.aggregation.max_weight_ratio, budget=budget)
    if config.secure.enabled:
        _check_secure(manifest)
        from fedper.coordinator.strategies.secure import SecureSum  # the privacy extra's cryptography
        from fedper.secagg import load_root

        assert config.secure.identity_root is not None  # SecureAggregation requires it
        return SecureSum(manifest, store, topics, fleet, clip_norm=float(config.aggregation.clip_norm or 0),
                         stage_timeout=config.secure.stage_timeout, degree=config.secure.degree,
                         min_clients=config.rounds.min_clients, budget=budget,
                         root=load_root(Path(config.secure.identity_root)), min_group=config.secure.min_group)
    if budget is not None:
        return CentralDP(manifest, store, topics, fleet, budget)
    return Mean(manifest, store, topics, fleet, config.aggregation.aggregator, config.aggregation.clip_norm,
                config.aggregation.max_weight_ratio)


def _budget(config: Config) -> PrivacyBudget | None:
    """The run's DP state, a fresh secret (a resumed run replaces it with its own); None without DP."""
    dp = config.privacy
    if dp.noise_multiplier is None:
        return None
    # fixed: M of the online devices, or (async) every device in every version, replace-one (docs/privacy.md)
    fixed = config.selection.clients_per_round is not None or config.asynchronous.enabled
    budget = PrivacyBudget(dp.noise_multiplier, dp.delta, dp.target_epsilon, dp.budget_action,
                           float(config.aggregation.clip_norm or 0), dp.adaptive_quantile,
                           sampling="fixed" if fixed else "poisson")
    if not config.selection.clients_per_round or config.asynchronous.enabled:
        budget.check_first_round()
    return budget


def _check_secure(manifest: Manifest) -> None:
    odd = [t.name for t in manifest.shared_tensors if not np.issubdtype(np.dtype(t.dtype), np.floating)]
    if odd:
        raise ValueError(f"--secure-aggregation sums floating-point tensors; {odd[:3]} are not")
    try:
        import fedper.secagg  # noqa: F401  (cryptography, the privacy extra)
    except ImportError as e:
        raise ValueError(f"--secure-aggregation needs the privacy extra ({e}): pip install "
                         "'fedper-edge[privacy]'") from None
