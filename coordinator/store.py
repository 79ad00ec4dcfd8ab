"""The coordinator's state directory: atomic files, and state.json (`CoordinatorState`) as the one commit point.

Tensor and registry files get a new name per version and state.json, written last, names the current
ones, so a kill at any instant leaves the old or the new checkpoint whole; the registry has its own
file so that a commit grows with the round, not the fleet. An accepted update's blob goes into a slot
file reused in place (flushed before state.json names it), since a new 13 MB file per update cost more
than everything else on the update path (docs/reliability.md, "State directory").
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedper import checkpoint
from fedper.checkpoint import PRIVATE
from fedper.coordinator.logs import log

STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
FINAL_FILE = "final.safetensors"
REGISTRY_PREFIX = "registry-"
SLOT_PREFIX = "slot-"  # slot-N.bin: an accepted update's blob, in a file reused from update to update
BACKOFF_PREFIX = "backoff-"  # fedper.selection.Backoff: devices that left invitations unanswered
STATE_VERSION = 2  # 2: the strategy's part under "strategy"; earlier files (no "version") are migrated on reading


@dataclass(frozen=True)
class Registration:
    """What a device said about itself: its n_j (which each of its updates must repeat) and its software."""

    n_samples: int
    software: str

    def to_json(self) -> dict[str, Any]:
        return {"n_samples": self.n_samples, "software": self.software}  # dataclasses.asdict: 10x slower


@dataclass(frozen=True)
class Folded:
    """An update folded into the open round's aggregate: the weight it was folded with and its metrics."""

    n_samples: int
    metrics: dict[str, float]


@dataclass
class RoundRecord:
    """What a restart must not lose about the open round."""

    number: int
    folded: dict[str, Folded] = field(default_factory=dict)  # by device
    bytes_received: int = 0
    extensions: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    selected: bool = False  # with --clients-per-round: its opening selection is made (and checkpointed)
    invited: set[str] = field(default_factory=set)  # the devices it invited, the opening selection and top-ups
    invite_cap: int = 0  # invitations it may make: ceil(F * M), raised at an extension to replace dropouts
    seed: int = 0  # the seed its selection was ranked with (recorded, not read back: a restart keeps `invited`)
    carried: dict[str, int] = field(default_factory=dict)  # invited devices still training on an earlier round's
    # model, by that round (asynchronous rounds: Strategy.oldest_round); the others are invited to this round

    def to_json(self) -> dict[str, Any]:
        carried = {"carried": dict(self.carried)} if self.carried else {}
        selection = {"selection": {"seed": self.seed, "invite_cap": self.invite_cap,
                                   "invited": sorted(self.invited), **carried}} if self.selected else {}
        return {"number": self.number, "folded": {d: asdict(f) for d, f in self.folded.items()},
                "bytes_received": self.bytes_received, "extensions": self.extensions,
                "rejected": dict(self.rejected), **selection}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RoundRecord:
        record = cls(body["number"], {d: Folded(**f) for d, f in body["folded"].items()}, body["bytes_received"],
                     body["extensions"], Counter(body["rejected"]))
        if "selection" in body:
            selection = body["selection"]
            record.selected, record.invite_cap = True, selection["invite_cap"]
            record.invited, record.seed = set(selection["invited"]), selection["seed"]
            record.carried = {device: int(round_) for device, round_ in selection.get("carried", {}).items()}
        return record


@dataclass
class CoordinatorState:
    """Everything a restart resumes from, each aggregation strategy's part included (its `checkpoint()`)."""

    base_digest: str  # of the export the run serves: another export's state is refused
    model: str  # the open round's model file
    round: RoundRecord
    counters: dict[str, int]
    finished: bool
    registry: str | None  # the registry file; None: nobody registered
    strategy: dict[str, Any]  # the strategy's own part (coordinator/strategies/base.py)
    inline_registry: dict[str, Any] | None = None  # a version-0 file's registrations, to be moved into a file
    backoff: str | None = None  # the backoff file (selection); None: no device is backed off
    version: int = STATE_VERSION
    fleet: str | None = None  # the fleet it serves (None: written before it was recorded)

    def write(self, store: Store) -> None:
        """Commit: state.json names exactly the files that stay."""
        store.commit(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "base_digest": self.base_digest, "model": self.model,
                "round": self.round.to_json(), "counters": dict(self.counters), "finished": self.finished,
                "registry": self.registry, "strategy": self.strategy, "backoff": self.backoff, "fleet": self.fleet}

    @classmethod
    def read(cls, store: Store) -> CoordinatorState | None:
        """The committed state, migrated from an earlier layout; None in a fresh state directory."""
        body = store.load_state()
        if body is None:
            return None
        version = body.get("version", 0 if "registry" not in body else 1)
        if version > STATE_VERSION:
            raise ValueError(f"{store.dir / STATE_FILE} is version {version}, newer than this coordinator's "
                             f"{STATE_VERSION}: run the release that wrote it")
        if version < 2:  # version 0 and 1 kept the strategy's part at the top level, DP's under "dp"
            body = {**body, "strategy": {"privacy": body.get("dp"), "partial": body.get("partial"),
                                         "updates": body.get("updates", {})}}
        return cls(body.get("base_digest", ""), body["model"], RoundRecord.from_json(body["round"]),
                   dict(body["counters"]), body["finished"], body.get("registry"), body["strategy"],
                   inline_registry=body["registered"] if version == 0 else None, backoff=body.get("backoff"),
                   fleet=body.get("fleet"))


class CheckpointError(RuntimeError):
    """The state directory could not be written (e.g. disk full): the previous checkpoint is intact."""


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A failure to write `path` (e.g. a full disk) raised as a CheckpointError."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e


class Store:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        tightened = checkpoint.private_dir(self.dir)  # made 700, or tightened: the DP secret is in state.json
        if tightened:
            log.warning("%s", checkpoint.tightened_line(self.dir, tightened))

    def load_state(self) -> dict[str, Any] | None:
        path = self.dir / STATE_FILE
        return checkpoint.read_json(path) if path.exists() else None

    def commit(self, state: dict[str, Any]) -> None:
        """Make `state` current, then delete tensor files it no longer names."""
        path = self.dir / STATE_FILE
        with _writing(path):
            checkpoint.write_json(path, state, indent=1, mode=PRIVATE)
        keep = set(_file_refs(state))
        named = [path for prefix in (REGISTRY_PREFIX, BACKOFF_PREFIX) for path in self.dir.glob(f"{prefix}*.json")]
        for path in [*self.dir.glob("*.safetensors"), *named]:
            if path.name not in keep and path.name != FINAL_FILE:
                path.unlink(missing_ok=True)

    def write_registry(self, registry: Mapping[str, Any], prefix: str = REGISTRY_PREFIX) -> str:
        """`registry` (or another JSON object of the fleet's size, named by `prefix`) as a file named by its
        content (`registry_file`), for a later commit to name."""
        name, data = registry_file(registry, prefix)
        self.write_file(name, data)
        return name

    def write_file(self, name: str, data: bytes) -> None:
        """A file named by its content; one already written (the same content) is not written again."""
        path = self.dir / name
        if not path.exists():
            with _writing(path):
                checkpoint.atomic_write(path, data, PRIVATE)

    def load_registry(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The registered devices of a committed `state` (as JSON): the registry file it names (None: nobody),
        or, in a state.json written before the registry had a file of its own, its inline `registered`."""
        if "registry" not in state:
            return dict(state["registered"])
        return self.read_registry(state["registry"])

    def read_registry(self, name: str | None) -> dict[str, Any]:
        """The registry file `name` (None: nobody registered)."""
        return checkpoint.read_json(self.dir / name) if name else {}

    def write_tensors(self, name: str, tensors: Mapping[str, np.ndarray]) -> str:
        path = self.dir / name
        with _writing(path):
            checkpoint.write_checkpoint(path, tensors, mode=PRIVATE)
        return name

    def write_slot(self, slot: int, data: bytes) -> dict[str, Any]:
        """`data` into the reused file of `slot` (fedper.checkpoint.overwrite), for a commit to name: what
        `read_slot` reads back. The caller picks a slot that the current state.json does not name."""
        path = self.dir / f"{SLOT_PREFIX}{slot}.bin"
        with _writing(path):
            checkpoint.overwrite(path, data, PRIVATE)
        return {"file": path.name, "size": len(data)}

    def read_slot(self, entry: Mapping[str, Any]) -> bytes:
        return checkpoint.read_prefix(self.dir / entry["file"], entry["size"])

    def read_tensors(self, name: str) -> dict[str, np.ndarray]:
        tensors, _ = checkpoint.read_checkpoint(self.dir / name)
        return tensors

    def read_bytes(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def trim_metrics(self, last_round: int) -> None:
        """Keep the records of rounds up to `last_round` (those state.json says are closed): a round's record is
        appended before the commit that closes it, so a kill in between leaves one the restart closes again."""
        path = self.dir / METRICS_FILE
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["round"] <= last_round:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill mid-write
        data = "".join(kept).encode()
        if data != path.read_bytes():
            checkpoint.atomic_write(path, data, PRIVATE)

    def append_metrics(self, record: dict[str, Any]) -> None:
        try:
            with open(self.dir / METRICS_FILE, "a", opener=checkpoint.opener(PRIVATE)) as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CheckpointError(f"cannot append to {self.dir / METRICS_FILE}: {e}") from e


def registry_file(registry: Mapping[str, Any], prefix: str = REGISTRY_PREFIX) -> tuple[str, bytes]:
    """The name and bytes of a JSON object of the fleet's size: named by its content."""
    data = json.dumps(registry, sort_keys=True, separators=(",", ":")).encode()
    return f"{prefix}{hashlib.sha256(data).hexdigest()[:16]}.json", data


def _file_refs(state: dict[str, Any]) -> list[str]:
    """Every tensor file (*.safetensors) and registry file name that a state mentions, however deep."""
    if isinstance(state, dict):
        return [r for v in state.values() for r in _file_refs(v)]
    if isinstance(state, list):
        return [r for v in state for r in _file_refs(v)]
    named = isinstance(state, str) and (state.endswith(".safetensors") or state.startswith((REGISTRY_PREFIX,
                                                                                              BACKOFF_PREFIX)))
    return [state] if named else []
