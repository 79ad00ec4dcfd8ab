"""Secure aggregation in one place: the strategy (strategy.py, `SecureSum`) and the SecAgg+ session it runs per
round attempt (session.py, `SecureRound`); the protocol's kernel is fedper/secagg.py, its messages
fedper/wire/messages.py (docs/privacy.md)."""

from fedper.coordinator.strategies.secure.strategy import SecureSum

__all__ = ["SecureSum"]
