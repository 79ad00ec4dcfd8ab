"""What the engine does with updates, behind one small interface (docs/architecture.md, "Aggregation strategies").

The engine keeps devices, rounds, selection and deadlines; a strategy folds what devices send and releases the
round's model. In the spirit of Flower's `Strategy`, it has eight hooks, and each answers in a value (a verdict,
the released model, its figures) that the engine acts on at once: there is no flag for the engine to read
afterwards. What the engine must know of it for the whole run (its topic kinds, its quorum, its upload size,
how long its invitations live) is declared once, as `Terms`. A strategy is built from the whole of each config
group it declares (`groups`), so no option is picked, or dropped, on the way (tests/test_strategy_options.py).
A strategy reads the engine only through `Fleet`, so it may not import the engine or the service
(tests/test_architecture.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from fedper.coordinator.config import Config
from fedper.coordinator.store import Folded as Contribution
from fedper.coordinator.store import Registration, RoundRecord, Store
from fedper.manifest import Manifest
from fedper.payload import max_blob_size
from fedper.wire import Outgoing, Topics, UpdateMeta

ENGINE_KINDS = ("register", "presence", "update")  # the topic kinds every run takes from devices


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
class Terms:
    """What the engine knows of a strategy for the whole run, declared when it is built."""

    upload_size: int  # the largest update blob an honest device sends (the upload quotas are sized on it)
    kinds: tuple[str, ...] = ENGINE_KINDS  # the topic kinds devices may write
    answers: str = "update(s)"  # what `answered` counts, for the log
    quorum: int = 1  # fewest answers a round may close with (the engine also applies --min-clients)
    staleness: int = 0  # while round k is open, updates for rounds k - staleness .. k are taken (invitations live)
    folded_frees_place: bool = False  # a device whose update was folded gives its --clients-per-round place up
    rerank_each_round: bool = True  # a round's selection ranks every device anew (False: fedper.selection.Ranking's
    # devices keep their keys until invited, so that a version released every few updates costs no key a device)

    def oldest_round(self, number: int) -> int:
        """The oldest round whose updates are taken while round `number` is open: an invitation to an earlier round
        not answered when `number` opens stays live if its round is not older."""
        return max(1, number - self.staleness)

    def places(self, live: Set[str], folded: Set[str]) -> Set[str]:
        """Of the open round's live invitations, those that hold one of its --clients-per-round places."""
        return live - folded if self.folded_frees_place else live


# ------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Wait:
    """The round goes on; `out`: messages to publish; `commit`: the strategy's checkpoint changed and must be on
    disk before they go out."""

    out: list[Outgoing] = field(default_factory=list)
    commit: bool = False


@dataclass(frozen=True)
class Ready:
    """The round may be released now (the engine calls `release`)."""

    out: list[Outgoing] = field(default_factory=list)


@dataclass(frozen=True)
class Retry:
    """This attempt at the round failed (a secure sum without enough shares): the engine opens it again."""

    out: list[Outgoing] = field(default_factory=list)


Verdict = Wait | Ready | Retry


@dataclass(frozen=True)
class Folded:
    """`accept`: the update joined the round and is checkpointed; `then`: what the round may do now."""

    then: Verdict = field(default_factory=Wait)


@dataclass(frozen=True)
class Refused:
    """`check`, `accept`: not taken, with the code the device is answered with (a WireError raised while
    decoding is a refusal too)."""

    code: str
    text: str


@dataclass(frozen=True)
class Opened:
    """`open`: the round's extra RoundInfo fields; `stopped`: a resumed run may open no further round (a budget);
    `ready`: resumed, the round is ready to release already (a buffer whose K-th fold was committed before the
    process died, its release not): the engine releases it before it takes another update."""

    fields: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    ready: bool = False


@dataclass(frozen=True)
class Released:
    """`release`: the round's model, its figures for metrics.jsonl, whether the run stops after it (a privacy
    budget), and the devices it holds when only the strategy knows them (a secure sum)."""

    model: dict[str, np.ndarray]
    figures: dict[str, Any] = field(default_factory=dict)
    stop: bool = False
    contributors: dict[str, Contribution] | None = None


@dataclass(frozen=True)
class Status:
    """`status`: the state message's entries of the strategy, and the epsilon spent so far (None without DP)."""

    fields: dict[str, Any] = field(default_factory=dict)
    epsilon: float | None = None


class Strategy:
    """Accept updates, say when the round may close and release it, checkpoint and resume its own state.

    The round's life: `open`, then `check` per upload's first chunk and `accept` per reassembled update (or
    message on the strategy's own topic kinds); the engine closes collection by its rule over `answered`
    (quorum, M, deadline) and calls `close` (again at each tick while it says Wait: its own stages' deadlines);
    at Ready, `release`. `checkpoint()` is the strategy's part of state.json, given back to `open` at a restart;
    `status()` what the state message shows."""

    groups: ClassVar[tuple[str, ...]] = ()  # the config groups it is built from (coordinator/config.py, GROUPS)

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, terms: Terms | None = None,
                 private: bool = False) -> None:
        self.manifest, self.store, self.topics, self.fleet = manifest, store, topics, fleet
        self.terms = terms or Terms(max_blob_size(manifest))
        self.private = private  # its checkpoint holds a privacy part (a run may not switch mode)

    @classmethod
    def build(cls, config: Config, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet) -> Strategy:
        """The strategy over the whole of each config group it declares, passed by the group's name."""
        return cls(manifest, store, topics, fleet, **{name: getattr(config, name) for name in cls.groups})

    def open(self, round_: RoundRecord, model: Mapping[str, np.ndarray], finished: bool,
             saved: Mapping[str, Any] | None = None) -> Opened:
        """Start collecting round `round_` over `model` (`finished`: the run is over, nothing is collected);
        `saved`: this strategy's `checkpoint()` of an earlier run, resumed in that round."""
        if saved is not None and (saved.get("privacy") is not None) != self.private:
            raise ValueError(f"{self.store.dir} holds a run {'without' if self.private else 'with'} differential "
                             f"privacy: resume it with the same mode, or use a fresh --state-dir")
        self.number, self.model = round_.number, model
        return Opened()

    def check(self, meta: UpdateMeta) -> Refused | None:
        """Refuse an update that this strategy cannot take, before it is reassembled."""
        if meta.round != self.number:
            return Refused("late_update", f"update for round {meta.round}, but round {self.number} is open")
        return None

    def accept(self, device: str, kind: str, payload: bytes, meta: UpdateMeta | None,
               now: float) -> Folded | Verdict | Refused:
        """All or nothing: a reassembled update (`kind` "update", `meta` its checked meta) or a message on one of
        the strategy's own topic kinds (`meta` None). A verdict that is not `Folded`: taken, nothing folded."""
        return Refused(kind, f"this coordinator takes no {kind} messages")

    def answered(self, folded: Set[str]) -> Set[str]:
        """The devices that count toward closing the round; `folded`: those whose update was accepted."""
        return folded

    def close(self, now: float) -> Verdict:
        """The engine's rule closed collection (quorum, and everyone, M or the deadline); asked again at each tick
        while the answer is Wait."""
        return Ready()

    def release(self, closed: RoundRecord, last: bool) -> Released:
        """The closed round's model and figures (`last`: no round follows it)."""
        raise NotImplementedError

    def status(self) -> Status:
        return Status()

    def checkpoint(self) -> dict[str, Any]:
        """The strategy's part of state.json (JSON, tensor files by name)."""
        return {"privacy": None}
