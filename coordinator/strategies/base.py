"""What the engine does with updates, behind one small interface (docs/architecture.md, "Aggregation strategies").

The engine keeps devices, rounds, selection and deadlines; a strategy folds what devices send and
releases the round's model. A strategy reads the engine only through `Fleet`, so it may not import
the engine or the service (tests/test_architecture.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from fedper.coordinator.store import Folded, Registration, RoundRecord, Store
from fedper.manifest import Manifest
from fedper.payload import max_blob_size
from fedper.wire import Outgoing, Topics, UpdateMeta, WireError


class Fleet(Protocol):
    """What a strategy may know of the engine: who is registered and how rounds are sized."""

    registered: Mapping[str, Registration]

    def round_size(self) -> int:
        """The updates a round closes at: M with --clients-per-round, else every registered device (at least 1)."""

    def invited_fraction(self, closed: RoundRecord) -> float:
        """The share of the registered fleet that `closed` invited (1 without --clients-per-round)."""

    def median_samples(self) -> float | None:
        """The registered devices' median n_samples (None: nobody registered)."""


def weight_cap(fleet: Fleet, max_weight_ratio: float) -> float:
    """--max-weight-ratio c: a device weighs at most c x the registered devices' median n_samples (inf: no cap)."""
    median = fleet.median_samples()
    return max_weight_ratio * median if math.isfinite(max_weight_ratio) and median is not None else math.inf


@dataclass(frozen=True)
class Release:
    """A closed round's model, and the devices it holds when only the strategy knows them (a secure sum)."""

    model: dict[str, np.ndarray]
    contributors: dict[str, Folded] | None = None


class Strategy:
    """Accept updates, say when the round may close and release it, checkpoint and resume its own state.

    The round's life: `open`, then `accept` per reassembled update (and `on_message` for the strategy's
    own topics); the engine closes collection by its rule over `answered()` (quorum, M, deadline) and calls
    `close`; once `ready`, `release` gives the model and `record` its figures; `failed` asks the engine to
    open the round again. `checkpoint()` is the strategy's part of state.json, given back to `resume`."""

    kinds: ClassVar[tuple[str, ...]] = ("register", "presence", "update")  # the topic kinds devices may write
    answers: ClassVar[str] = "update(s)"  # what `answered` counts, for the log
    quorum: ClassVar[int] = 1  # fewest answers a round may close with (the engine also applies --min-clients)
    private = False  # its checkpoint holds a privacy part (a run may not switch mode)
    rerank_each_round = True  # a round's selection ranks every device anew (False: fedper.selection.Ranking's
    # devices keep their keys until invited, so that a version released every few updates costs no key a device)

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet) -> None:
        self.manifest, self.store, self.topics, self.fleet = manifest, store, topics, fleet
        self.collecting = True  # the engine's closing rule applies; False once `close` ran
        self.ready = False  # the round may be released
        self.failed = False  # the round's attempt failed: the engine opens it again
        self.stopped = False  # after `record`: no further round may open (a privacy budget)

    # ------------------------------------------------------------ the round

    def open(self, number: int, model: Mapping[str, np.ndarray], finished: bool) -> None:
        """Start collecting round `number` over `model` (`finished`: the run is over, nothing is collected)."""
        self.number, self.model = number, model
        self.collecting, self.ready, self.failed = True, False, False

    def check(self, meta: UpdateMeta) -> None:
        """Refuse (WireError) an update that this strategy cannot take, before it is reassembled."""
        if meta.round != self.number:
            raise WireError("late_update", f"update for round {meta.round}, but round {self.number} is open")

    def accept(self, device: str, blob: bytes, meta: UpdateMeta, now: float) -> tuple[bool, list[Outgoing]]:
        """A reassembled update, all or nothing: whether it was folded (and checkpointed), and what to send."""
        raise NotImplementedError

    def on_message(self, device: str, kind: str, payload: bytes, now: float) -> list[Outgoing]:
        """A message on one of the strategy's own topic kinds (beyond the engine's)."""
        raise WireError(kind, f"this coordinator takes no {kind} messages")

    def oldest_round(self, number: int) -> int:
        """The oldest round whose updates `check` takes while round `number` is open: an invitation to an
        earlier round that is not answered when `number` opens stays live if its round is not older (default:
        the open round only, so a synchronous round's invitations end with it)."""
        return number

    def places(self, live: Set[str], folded: Set[str]) -> Set[str]:
        """Of the open round's live invitations, those that hold one of its --clients-per-round places (`folded`:
        the devices whose update was accepted). Default: all, a round making that many invitations in all."""
        return live

    def answered(self, folded: Set[str]) -> Set[str]:
        """The devices that count toward closing the round; `folded`: those whose update was accepted."""
        return folded

    def close(self, now: float) -> list[Outgoing]:
        """The engine's rule closed collection (quorum, and everyone, M or the deadline)."""
        self.collecting, self.ready = False, True
        return []

    def tick(self, now: float) -> list[Outgoing]:
        """The strategy's own deadlines."""
        return []

    def release(self, closed: RoundRecord) -> Release:
        raise NotImplementedError

    def record(self, closed: RoundRecord, last: bool) -> dict[str, Any]:
        """Figures of the released round for metrics.jsonl (and `stopped`)."""
        return {}

    # ------------------------------------------------------------ what it publishes

    def upload_size(self) -> int:
        """The largest update blob an honest device sends (the upload quotas are sized on it)."""
        return max_blob_size(self.manifest)

    def round_fields(self) -> dict[str, Any]:
        """Extra RoundInfo fields."""
        return {}

    def state_fields(self) -> dict[str, Any]:
        """Extra entries of the state message."""
        return {}

    @property
    def epsilon(self) -> float | None:
        """Epsilon spent by the rounds released so far; None without differential privacy."""
        return None

    # ------------------------------------------------------------ checkpoint

    def checkpoint(self) -> dict[str, Any]:
        """The strategy's part of state.json (JSON, tensor files by name)."""
        return {"privacy": None}

    def resume(self, part: Mapping[str, Any], round_: RoundRecord, model: Mapping[str, np.ndarray],
               finished: bool) -> None:
        """Pick up `checkpoint()`'s part of an earlier run, in open round `round_` over `model`."""
        if (part.get("privacy") is not None) != self.private:
            raise ValueError(f"{self.store.dir} holds a run {'without' if self.private else 'with'} differential "
                             f"privacy: resume it with the same mode, or use a fresh --state-dir")
        self.number, self.model = round_.number, model
