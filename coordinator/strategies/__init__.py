"""Aggregation strategies, one file each: `strategy_class` picks the run's from its settings, and the strategy
builds itself from the config groups it declares (base.Strategy.build)."""

from __future__ import annotations

from fedper.coordinator.config import Config
from fedper.coordinator.store import Store
from fedper.coordinator.strategies.base import Fleet, Strategy
from fedper.coordinator.strategies.central_dp import CentralDP
from fedper.coordinator.strategies.mean import Mean
from fedper.manifest import Manifest
from fedper.wire import Topics


def strategy_class(config: Config) -> type[Strategy]:
    """Buffered rounds with --mode async (with or without DP); else the secure sum with --secure-aggregation, else
    central DP with --dp-noise-multiplier, else --aggregator."""
    if config.asynchronous.enabled:  # config.py refuses it with secure aggregation
        from fedper.coordinator.strategies.fedbuff import FedBuff

        return FedBuff
    if config.secure.enabled:
        try:
            from fedper.coordinator.strategies.secure import SecureSum  # the privacy extra's cryptography
        except ImportError as e:
            raise ValueError(f"--secure-aggregation needs the privacy extra ({e}): pip install "
                             "'fedper-edge[privacy]'") from None
        return SecureSum
    return Mean if config.privacy.noise_multiplier is None else CentralDP


def strategy_for(config: Config, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet) -> Strategy:
    """The run's strategy. `config`'s groups are valid; what they cannot check alone (the manifest, the extras) is
    checked here and by the strategy."""
    return strategy_class(config).build(config, manifest, store, topics, fleet)
