"""The steps of the coordinator's round table (coordinator/rounds.py): how a round closes, is extended, released
or opened again, and how the next one opens, selected and checkpointed; the engine (coordinator/engine.py) runs
them from its inputs and its clock. Pure, as the engine: the writes are effects in its outbox.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from fedper.coordinator.announcements import Announcements
from fedper.coordinator.config import Config, Rounds
from fedper.coordinator.effects import Outbox
from fedper.coordinator.inputs import Inputs
from fedper.coordinator.intake import Intake
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.logs import log
from fedper.coordinator.records import log_closed, round_record
from fedper.coordinator.registry import Registry
from fedper.coordinator.rounds import TRANSITIONS, Event, Phase, Step, closing_event
from fedper.coordinator.store import BACKOFF_PREFIX, FINAL_FILE, CoordinatorState, RoundRecord
from fedper.coordinator.strategies.base import Opened, Ready, Retry, Strategy, Verdict, Wait
from fedper.manifest import Manifest
from fedper.wire import Outgoing, Topics


class RoundMachine:
    """The table's steps over the engine's parts; `RoundEngine` builds the parts and feeds it."""

    manifest: Manifest
    topics: Topics
    config: Config
    rounds: Rounds
    outbox: Outbox
    digest: str
    strategy: Strategy
    model: dict[str, np.ndarray]
    round: RoundRecord
    phase: Phase
    selecting: bool
    _timer: Callable[[], float]
    _registry: Registry
    _intake: Intake
    _invitations: Invitations
    _inputs: Inputs
    _announcements: Announcements
    _released: tuple[RoundRecord, dict[str, Any]] | None
    _round_fields: dict[str, Any]
    _model_file: str
    _deadline: float
    _opened_at: float
    _broadcast_s: float
    _last_top_up: float

    def announce(self, now: float) -> list[Outgoing]:
        """Everything a device needs to join now (the engine's)."""
        raise NotImplementedError

    def _round_message(self) -> Outgoing:
        return self._announcements.round_info(self.round.number, self.rounds.rounds, self.finished, self._deadline,
                                              self.round.selected, self._training_fields() | self._round_fields)

    def _training_fields(self) -> dict[str, Any]:
        """The open round's local training as the coordinator decides it (none once the run is finished)."""
        return {} if self.finished else self.config.training.round_fields(self.round.number)

    def _invitation(self, device: str) -> Outgoing:
        return self._announcements.invitation(device, self.round.carried.get(device, self.round.number))

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def invited_count(self) -> int:
        """The devices the open round takes updates from: its invitations, or every registered device."""
        return len(self.round.invited) if self.selecting else len(self._registry.registered)

    def _open_strategy(self, saved: Mapping[str, Any] | None = None) -> Opened:
        """The strategy opens the open round (`saved`: resumes its checkpoint in it)."""
        opened = self.strategy.open(self.round, self.model, self.finished, saved)
        self._round_fields = opened.fields
        return opened

    def _step(self, event: Event | None, now: float) -> list[Outgoing]:
        """The table's row for (phase, event): move to its phase, run its steps."""
        if event is None:
            return []
        self.phase, steps = TRANSITIONS.get((self.phase, event), (self.phase, ()))
        run = {Step.CLOSE: self._close, Step.EXTEND: self._extend, Step.RELEASE: self._release,
               Step.OPEN: self._open_next, Step.REOPEN: self._reopen}
        return [message for step in steps for message in run[step](now)]

    def _advance(self, now: float) -> list[Outgoing]:
        """Collecting: the engine's closing rule (rounds.closing_event); closing: the strategy's own stages."""
        if self.phase is Phase.CLOSING:
            return self._close(now)
        if self.phase is not Phase.COLLECTING:
            return []
        answered = self.strategy.answered(self.round.folded.keys())
        everyone = self._registry.registered.keys() <= answered or (
            self.selecting and len(answered) >= (self.config.selection.clients_per_round or 0))
        return self._step(closing_event(len(answered), self._quorum(), everyone, now, self._deadline), now)

    def _quorum(self) -> int:
        return max(self.rounds.min_clients, self.strategy.terms.quorum)

    def _settle(self, verdict: Verdict, now: float) -> list[Outgoing]:
        """Act on the strategy's verdict (after an update, a message of its own, or its close): its messages, then
        READY or FAILED's row of the table (Wait moves nothing)."""
        event = Event.READY if isinstance(verdict, Ready) else Event.FAILED if isinstance(verdict, Retry) else None
        if isinstance(verdict, Wait) and verdict.commit:
            self._commit()
        return verdict.out + self._step(event, now)

    def _close(self, now: float) -> list[Outgoing]:
        return self._settle(self.strategy.close(now), now)

    def _reopen(self, now: float) -> list[Outgoing]:
        """A new attempt at the round: its deadline at least one round_timeout away, partial uploads dropped."""
        self._open_strategy()
        self._deadline = max(self._deadline, now + self.rounds.round_timeout)
        self._intake.reassembler.discard()
        self._intake.new_attempt()
        return [self._round_message()]

    def _extend(self, now: float) -> list[Outgoing]:
        """The deadline passed below --min-clients: wait one more round_timeout (replacing dropouts when selecting)."""
        self.round.extensions += 1
        if self.selecting:
            self._invitations.replace_dropouts(self.round)
            self._last_top_up = -1e18  # top up at once
        self._deadline = now + self.rounds.round_timeout
        log.warning("round %d: deadline passed with %d/%d %s, fewer than the %d it closes with: waiting %.1f s more "
                    "(extension %d)", self.round.number, len(self.strategy.answered(self.round.folded.keys())),
                    self.invited_count, self.strategy.terms.answers, self._quorum(), self.rounds.round_timeout,
                    self.round.extensions)
        return [self._round_message()]

    def _release(self, now: float) -> list[Outgoing]:
        """The strategy's model and figures for the closed round; the run goes on (NEXT) or ends (LAST)."""
        started, closed = self._timer(), self.round
        last = closed.number >= self.rounds.rounds
        release = self.strategy.release(closed, last)  # a DP strategy accounts the round, adapts its clip norm
        if release.contributors is not None:  # known only now (a secure sum)
            closed.folded = release.contributors
            self._inputs.counters["accepted"] += len(closed.folded)
        self.model = {t.name: release.model[t.name].astype(t.dtype) for t in self.manifest.shared_tensors}
        record = round_record(closed, len(self._registry.registered), self.selecting, now,
                              collect_s=now - self._opened_at, broadcast_s=self._broadcast_s,
                              aggregate_s=self._timer() - started)
        self._released = (closed, record | release.figures)
        self._inputs.closed(closed, closed.folded.keys())
        return self._step(Event.LAST if last or release.stop else Event.NEXT, now)

    def _open_next(self, now: float) -> list[Outgoing]:
        """The next round (or, finished, the final model): selected, written, checkpointed, then announced."""
        assert self._released is not None, "OPEN follows RELEASE"
        (closed, record), self._released = self._released, None
        self.round = RoundRecord(closed.number if self.finished else closed.number + 1)
        self._invitations.new_round()
        if self.selecting and not self.finished:
            carried = self._carried(closed)
            self._select(now, carried, closed.invited - carried.keys())
        self._model_file = self.outbox.write_tensors(f"model-r{closed.number + 1}.safetensors", self.model)
        self._open_strategy()
        self._intake.new_round(self.finished, lambda meta: self.strategy.check(meta) is None)
        if self.finished:
            self.outbox.write_tensors(FINAL_FILE, self.model)
        self.outbox.append_metrics(record)  # before the commit that closes the round: a restart trims it if need be
        self._commit(registry=True)  # once a round, registrations changed since the last tick go with it
        log_closed(record)
        self._opened_at, self._deadline, self._broadcast_s = now, now + self.rounds.round_timeout, 0.0
        self._announcements.forget_model()
        stale = sorted(closed.invited - self.round.invited)  # retained invitations of the closed round
        return self._announcements.cleared(stale) + self.announce(now)

    def _carried(self, closed: RoundRecord) -> dict[str, int]:
        """The closed round's invitations not answered yet (its own and those it carried) whose round the next
        round still takes updates for (Terms.oldest_round): they stay, each with its round."""
        oldest = self.strategy.terms.oldest_round(closed.number + 1)
        waiting = closed.invited - self.strategy.answered(closed.folded.keys())
        return {device: r for device in waiting if (r := closed.carried.get(device, closed.number)) >= oldest}

    def _commit(self, registry: bool = False) -> None:
        """Make the open round current in state.json; with `registry`, first write the registry file if a
        registration changed. Only then is the commit O(fleet), so an accepted update asks for it only when
        its own device's registration is not in the file yet (a restart then knows every folded device):
        otherwise its commit is O(round + model) whatever the fleet's size."""
        if registry:
            self._registry.write(self.outbox)
            self._invitations.write(lambda misses: self.outbox.write_registry(misses, BACKOFF_PREFIX))
        state = CoordinatorState(self.digest, self._model_file, self.round, self._inputs.counters, self.finished,
                                 self._registry.file, self.strategy.checkpoint(),
                                 backoff=self._invitations.backoff_file, fleet=self.topics.fleet)
        self.outbox.commit(state.to_json())

    # ------------------------------------------------------------ selection (--clients-per-round)

    def _select(self, now: float, carried: Mapping[str, int] | None = None, released: Iterable[str] = ()) -> None:
        self._invitations.select(self.round, now, carried, released)
        log.info("round %d: invited %d of %d device(s) online", self.round.number, len(self.round.invited),
                 len(self._registry.online))

    def _top_up(self, now: float) -> list[Outgoing]:
        """More invitations while fewer than ceil(F * M) are live: checkpointed before they go out."""
        chosen = self._invitations.top_up(self.round, now)
        if chosen:
            self._commit()
        return [self._invitation(device) for device in chosen]

