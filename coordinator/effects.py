"""What the coordinator's engine asks the state directory to do: its effects, as values.

The engine (coordinator/engine.py) and its strategy decide writes; they do none. Each write is recorded
in an `Outbox`, in the order it was decided, and `handle`/`tick`/`start` return those writes followed
by the messages to publish (`fedper.wire.Outgoing`). The shell (coordinator/durable.py) carries the
writes out with coordinator/store.py in that order, then the service publishes the messages and only
then acknowledges the broker's message: an accepted update is committed before the broker forgets it,
as when the engine wrote its files itself. docs/architecture.md lists the effects.

A strategy keeps calling `store.write_tensors(...)`, `store.write_slot(...)`: the outbox stands in for
the store, records the write and returns the name the store would give; reads (only when a strategy
resumes, at construction) go to the real store.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedper.coordinator.store import REGISTRY_PREFIX, SLOT_PREFIX, registry_file
from fedper.wire import Outgoing


@dataclass(frozen=True)
class WriteTensors:
    """A safetensors file (a round's model, a partial sum, a buffer checkpoint), named for a later commit."""

    name: str
    tensors: Mapping[str, np.ndarray]  # arrays nothing modifies before the effect is carried out


@dataclass(frozen=True)
class WriteSlot:
    """An accepted update's blob as received, into the reused file of `slot` (store.Store.write_slot)."""

    slot: int
    data: bytes


@dataclass(frozen=True)
class WriteFile:
    """A JSON file of the fleet's size (the registry, the backoff), named by its content."""

    name: str
    data: bytes


@dataclass(frozen=True)
class AppendMetrics:
    """A closed round's record, appended to metrics.jsonl before the commit that closes the round."""

    record: dict[str, Any]


@dataclass(frozen=True)
class TrimMetrics:
    """At a resume: keep the records of the rounds up to `last_round`, those state.json says are closed."""

    last_round: int


@dataclass(frozen=True)
class Commit:
    """state.json made current (a snapshot of `CoordinatorState`); files it no longer names are deleted."""

    state: dict[str, Any]


Write = WriteTensors | WriteSlot | WriteFile | AppendMetrics | TrimMetrics | Commit
Effect = Write | Outgoing


class Reader(Protocol):
    """What a strategy reads back when it resumes (coordinator/store.py's Store)."""

    dir: Path

    def read_tensors(self, name: str) -> dict[str, np.ndarray]: ...

    def read_slot(self, entry: Mapping[str, Any]) -> bytes: ...

    def read_bytes(self, name: str) -> bytes: ...


class Outbox:
    """The writes decided since the last `drain`, in order; the store's write methods, recorded."""

    def __init__(self, reader: Reader) -> None:
        self.reader, self.dir = reader, reader.dir
        self._writes: list[Write] = []

    def drain(self) -> list[Write]:
        writes, self._writes = self._writes, []
        return writes

    def write_tensors(self, name: str, tensors: Mapping[str, np.ndarray]) -> str:
        self._writes.append(WriteTensors(name, dict(tensors)))
        return name

    def write_slot(self, slot: int, data: bytes) -> dict[str, Any]:
        self._writes.append(WriteSlot(slot, bytes(data)))
        return {"file": f"{SLOT_PREFIX}{slot}.bin", "size": len(data)}

    def write_registry(self, registry: Mapping[str, Any], prefix: str = REGISTRY_PREFIX) -> str:
        name, data = registry_file(registry, prefix)
        self._writes.append(WriteFile(name, data))
        return name

    def append_metrics(self, record: dict[str, Any]) -> None:
        self._writes.append(AppendMetrics(record))

    def trim_metrics(self, last_round: int) -> None:
        self._writes.append(TrimMetrics(last_round))

    def commit(self, state: dict[str, Any]) -> None:
        """A snapshot: the engine goes on changing its round after deciding the commit, in the same call."""
        self._writes.append(Commit(json.loads(json.dumps(state))))

    def read_tensors(self, name: str) -> dict[str, np.ndarray]:
        return self.reader.read_tensors(name)

    def read_slot(self, entry: Mapping[str, Any]) -> bytes:
        return self.reader.read_slot(entry)

    def read_bytes(self, name: str) -> bytes:
        return self.reader.read_bytes(name)
