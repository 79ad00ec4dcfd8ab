"""The coordinator's engine over its state directory: reads the checkpoint it resumes from and carries out
the writes the engine returns (coordinator/effects.py), in order, before anything it says is published.

`Coordinator` is what the service, the CLI and tests run: the pure `RoundEngine` whose `start`, `handle`
and `tick` return only the messages to publish, every write they decided already done. A write that fails
(e.g. a full disk) raises CheckpointError there, so the service stops without acknowledging the message:
the broker redelivers it to the restarted coordinator (docs/reliability.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from fedper.coordinator.config import Config
from fedper.coordinator.effects import (
    AppendMetrics,
    Commit,
    Effect,
    Outbox,
    TrimMetrics,
    WriteFile,
    WriteSlot,
    WriteTensors,
)
from fedper.coordinator.engine import RoundEngine
from fedper.coordinator.records import Saved
from fedper.coordinator.store import CoordinatorState, Store
from fedper.manifest import Manifest
from fedper.wire import Outgoing, Topics


class Coordinator(RoundEngine):
    """The engine whose writes are done in `store` as it decides them."""

    def __init__(self, manifest: Manifest, initial: Mapping[str, np.ndarray], topics: Topics, config: Config,
                 store: Store) -> None:
        self.store = store
        self.fold_seconds = 0.0  # spent handling updates that were folded and checkpointed, in this process
        super().__init__(manifest, initial, topics, config, Outbox(store), load(store), time.perf_counter)
        self._carry_out(self.outbox.drain())

    def start(self, now: float) -> list[Outgoing]:  # type: ignore[override]
        return self._carry_out(super().start(now))

    def handle(self, topic: str, payload: bytes, now: float, *,  # type: ignore[override]
               admitted: bool = False) -> list[Outgoing]:
        started, accepted = time.perf_counter(), self.counters["accepted"]
        out = self._carry_out(super().handle(topic, payload, now, admitted=admitted))
        if self.counters["accepted"] > accepted:
            self.fold_seconds += time.perf_counter() - started
        return out

    def tick(self, now: float) -> list[Outgoing]:  # type: ignore[override]
        effects = super().tick(now)
        started = time.perf_counter()
        out = self._carry_out(effects)
        if any(isinstance(e, WriteFile) for e in effects):
            self.note_registry_written(time.perf_counter() - started)
        return out

    def _carry_out(self, effects: list[Effect]) -> list[Outgoing]:
        """Every write, in order; the messages, for the service to publish after them."""
        for effect in effects:
            if isinstance(effect, WriteTensors):
                self.store.write_tensors(effect.name, effect.tensors)
            elif isinstance(effect, WriteSlot):
                self.store.write_slot(effect.slot, effect.data)
            elif isinstance(effect, WriteFile):
                self.store.write_file(effect.name, effect.data)
            elif isinstance(effect, AppendMetrics):
                self.store.append_metrics(effect.record)
            elif isinstance(effect, TrimMetrics):
                self.store.trim_metrics(effect.last_round)
            elif isinstance(effect, Commit):
                self.store.commit(effect.state)
        return [e for e in effects if isinstance(e, Outgoing)]


def load(store: Store) -> Saved | None:
    """The checkpoint in `store` and the files it names; None in a fresh state directory."""
    state = CoordinatorState.read(store)
    if state is None:
        return None
    registry = state.inline_registry if state.inline_registry is not None else store.read_registry(state.registry)
    backoff = store.read_registry(state.backoff) if state.backoff else None
    return Saved(state, store.read_tensors(state.model), registry, backoff)
