"""Where the open round stands, and every transition of the coordinator's round machine, in one table.

As for the agent (edge/engine.py), `TRANSITIONS` is the one place a transition is decided: the engine
turns what happened (its closing rule at a tick, the strategy's answer after an update, a stage or a
tick) into an `Event`, and the row for (phase, event) gives the next phase and the steps to run; a pair
the table does not list changes nothing. docs/architecture.md draws it.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    COLLECTING = "collecting"  # the round takes updates; the engine's rule (quorum, everyone or M, deadline) applies
    CLOSING = "closing"  # collection closed: the strategy's own stages run (a secure sum's), then it releases
    RELEASING = "releasing"  # the round's model is released: the next round opens, or the run ends
    FINISHED = "finished"  # the last round was released (or a privacy budget stopped the run)


class Event(Enum):
    COMPLETE = "complete"  # quorum, and everyone (or M) answered or the deadline passed
    SHORT = "short"  # the deadline passed below quorum
    READY = "ready"  # the strategy may release the round (after its close, or at a buffer's K-th fold)
    FAILED = "failed"  # the strategy's attempt at the round failed (a secure sum without enough shares)
    NEXT = "next"  # a round was released and the run goes on
    LAST = "last"  # a round was released and the run is over


class Step(Enum):
    CLOSE = "close"  # the strategy closes collection (and may start its own stages)
    EXTEND = "extend"  # one more round_timeout, dropouts replaced when selecting; RoundInfo again
    RELEASE = "release"  # the strategy's model and figures; then NEXT or LAST
    OPEN = "open"  # the next round (or the final model) is opened, checkpointed and announced
    REOPEN = "reopen"  # the same round opens again: a new attempt, uploads under way dropped


P, E, S = Phase, Event, Step
TRANSITIONS: dict[tuple[Phase, Event], tuple[Phase, tuple[Step, ...]]] = {
    (P.COLLECTING, E.COMPLETE): (P.CLOSING, (S.CLOSE,)),
    (P.COLLECTING, E.SHORT): (P.COLLECTING, (S.EXTEND,)),
    (P.COLLECTING, E.READY): (P.RELEASING, (S.RELEASE,)),  # a buffer released by its K-th fold
    (P.CLOSING, E.READY): (P.RELEASING, (S.RELEASE,)),
    (P.COLLECTING, E.FAILED): (P.COLLECTING, (S.REOPEN,)),
    (P.CLOSING, E.FAILED): (P.COLLECTING, (S.REOPEN,)),
    (P.RELEASING, E.NEXT): (P.COLLECTING, (S.OPEN,)),
    (P.RELEASING, E.LAST): (P.FINISHED, (S.OPEN,)),
}


def closing_event(answered: int, quorum: int, everyone: bool, now: float, deadline: float) -> Event | None:
    """The engine's rule while collecting: COMPLETE at quorum (--min-clients, and the strategy's) once everyone
    (every registered device, or M with --clients-per-round) answered or the deadline passed; SHORT when the
    deadline passed below quorum."""
    if answered >= quorum and (everyone or now >= deadline):
        return Event.COMPLETE
    return Event.SHORT if now >= deadline else None
