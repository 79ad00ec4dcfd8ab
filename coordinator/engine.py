"""The coordinator's engine: devices, rounds, selection and deadlines, as a state machine fed with
decoded MQTT messages and the time.

No I/O: `start(now)`, `handle(topic, payload, now)` and `tick(now)` return effects, the writes the state
directory must make (coordinator/effects.py) followed by the messages to publish; coordinator/durable.py
carries them out, so tests and fuzzers drive it without a broker and the paho loop stays thin. The clock is
an argument: `now` for events, `timer` for the figures that time the engine's own work. Its parts: the round
table (rounds.py), device messages (inputs.py, intake.py), the registry, invitations and announcements. What is
done with updates is the run's aggregation strategy (coordinator/strategies/), whose verdicts drive the table;
the engine branches on no mode. docs/architecture.md draws the parts, docs/reliability.md what a restart keeps.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

import numpy as np

from fedper.coordinator.announcements import Announcements
from fedper.coordinator.config import Config
from fedper.coordinator.effects import Effect, Outbox
from fedper.coordinator.inputs import Inputs
from fedper.coordinator.intake import Intake, Resent
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.logs import DeviceLog, log
from fedper.coordinator.records import Saved, check_resumable, log_closed, log_resumed, round_record
from fedper.coordinator.registry import FleetView, Registry
from fedper.coordinator.rounds import TRANSITIONS, Event, Phase, Step, closing_event
from fedper.coordinator.store import BACKOFF_PREFIX, FINAL_FILE, CoordinatorState, Registration, RoundRecord
from fedper.coordinator.store import Folded as Contribution
from fedper.coordinator.strategies import strategy_for
from fedper.coordinator.strategies.base import Folded, Opened, Ready, Retry, Verdict
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared
from fedper.selection import Backoff
from fedper.wire import Outgoing, Topics, WireError


class RoundEngine:
    """The fleet's rounds; what is done with their updates is `strategy`'s."""

    def __init__(self, manifest: Manifest, initial: Mapping[str, np.ndarray], topics: Topics, config: Config,
                 outbox: Outbox, saved: Saved | None, timer: Callable[[], float]) -> None:
        self.manifest, self.topics, self.config, self.outbox, self._timer = manifest, topics, config, outbox, timer
        self.digest, self.rounds = manifest.base_digest, config.rounds
        self.model = decode_shared(manifest, encode_shared(manifest, initial))  # validated copy
        self._registry = Registry()
        self.strategy = strategy_for(config, manifest, outbox, topics, FleetView(
            self._registry, config.selection.clients_per_round, lambda *args: self._invitations.drawn_from(*args)))
        self.round, self.phase = RoundRecord(1), Phase.COLLECTING
        self._steps = {Step.CLOSE: self._close, Step.EXTEND: self._extend, Step.RELEASE: self._release,
                       Step.OPEN: self._open_next, Step.REOPEN: self._reopen}
        self._released: tuple[RoundRecord, dict[str, Any]] | None = None  # between RELEASE and OPEN
        self._round_fields: dict[str, Any] = {}  # the strategy's RoundInfo fields for the open round
        self.bytes_sent = 0  # payload bytes the service published for this process (monitoring)
        self._intake = Intake(config.quotas, self.rounds.chunk_size, self.strategy.terms.upload_size, topics)
        self._log = DeviceLog(log)  # per-device records at a bounded rate (coordinator/logs.py)
        # liveness of the open round's invitations (--clients-per-round), in this process: restarts begin afresh
        self._invitations = Invitations(config, self._registry.available, self.strategy, self._log)
        self.selecting = self._invitations.selecting
        self._inputs = Inputs(config, self.digest, topics, self._registry, self._invitations, self._intake,
                              self.strategy, self._log)
        self._announcements = Announcements(manifest, topics, self.rounds.chunk_size)
        self._deadline = self._opened_at = self._broadcast_s = 0.0
        self._published: dict[str, Any] | None = None  # the last state message (its time aside)
        self._last_state = self._last_top_up = self._next_registry_commit = self._paced_at = -1e18
        self._model_file = ""  # the open round's model file; "" until the first start writes it
        if saved is not None:
            self._resume(saved)
        else:
            self._open_strategy()

    # ------------------------------------------------------------ life cycle

    def start(self, now: float) -> list[Effect]:
        """Open the current round (round 1 on a fresh state directory) and announce it."""
        fresh = not self._model_file
        if fresh:
            self._model_file = self.outbox.write_tensors("model-r1.safetensors", self.model)
        selecting = self.selecting and not self.finished and not self.round.selected
        self._invitations.restart(self.round, now)  # resumed: answer from now on
        if selecting:
            self._select(now)
        if fresh or selecting or self._registry.dirty:  # dirty here: a registry migrated out of state.json
            self._commit(registry=True)
        self._opened_at, self._deadline = now, now + self.rounds.round_timeout
        return [*self.outbox.drain(), *self.announce(now)]

    def _resume(self, loaded: Saved) -> None:
        """Pick up the checkpoint of an earlier run in the same state directory."""
        saved = loaded.state
        check_resumable(saved, self.digest, self.topics.fleet, self.outbox.dir)
        self.model = decode_shared(self.manifest, encode_shared(self.manifest, loaded.model))
        self._model_file = saved.model
        self._registry.resume(loaded.registry, saved.registry, inline=saved.inline_registry is not None)
        if saved.inline_registry is not None:  # written before the registry had its own file: start() moves it
            log.info("migrating %d registration(s) from %s into a registry file", len(self.registered), self.outbox.dir)
        self._inputs.counters = Counter(saved.counters)
        self._invitations.resume(loaded.backoff, saved.backoff)
        self.phase, self.round = Phase.FINISHED if saved.finished else Phase.COLLECTING, saved.round
        self.outbox.trim_metrics(self.round.number if self.finished else self.round.number - 1)  # closed rounds'
        if not self.selecting:  # the open round keeps its invitations only when still selecting
            self.round.selected, self.round.invited, self.round.invite_cap, self.round.carried = False, set(), 0, {}
        stopped = self._open_strategy(saved.strategy).stopped
        resumed, finished = self.round, self.finished
        reopened = finished and self.rounds.rounds > resumed.number and not stopped
        if reopened:  # more rounds than it ran: the next opens over the final model
            self.phase, self.round = Phase.COLLECTING, RoundRecord(resumed.number + 1)
            self._open_strategy()
            self._commit()
        log_resumed(self.outbox.dir, resumed, self.rounds.rounds, finished, stopped, reopened, len(self.registered))

    def _open_strategy(self, saved: Mapping[str, Any] | None = None) -> Opened:
        """The strategy opens the open round (`saved`: resumes its checkpoint in it)."""
        opened = self.strategy.open(self.round, self.model, self.finished, saved)
        self._round_fields = opened.fields
        return opened

    def announce(self, now: float) -> list[Outgoing]:
        """Everything a device needs to join now (also after a broker restart lost retained messages)."""
        model = self._announcements.model(self.blob_id, self.round.number, self.model)
        invites = [self._invitation(device) for device in sorted(self.round.invited)]
        return [*model, self._round_message(), *invites, self.state_message(now)]

    # ------------------------------------------------------------ input

    def admit(self, topic: str, now: float) -> bool:
        """Whether a message on `topic` passes its device's rate limit; False: drop it unread. Thread-safe
        (coordinator/quota.py), unlike the rest of the engine: the service calls it from paho's network thread,
        so a flood is dropped as it arrives (counted at the next `handle` or `tick`). A message for `handle(...,
        admitted=True)`; one on a topic that is not a device's passes (handle refuses it)."""
        try:
            kind, device = self.topics.parse(topic)
        except WireError:
            return True
        return self._intake.admit(device, kind, now)

    def handle(self, topic: str, payload: bytes, now: float, *, admitted: bool = False) -> list[Effect]:
        """One incoming message; a bad one is refused before it changes anything, logged once, counted and
        answered on its device's error topic (a chunk of a blob already refused is dropped: one answer per
        blob). admitted: `admit` passed it already (its rate token is spent). Raises nothing: a bug is refused too."""
        device, inputs, r = None, self._inputs, self.round
        try:
            kind, device = self.topics.parse(topic)
            if not admitted and not self._intake.admit(device, kind, now):
                out = inputs.rate_limited(now, r)
            elif kind == "register":
                out = inputs.register(device, payload, now, r)
            elif kind == "presence":
                out = inputs.presence(device, payload, now, r, self.phase is Phase.COLLECTING)
            elif kind == "update":
                out = self._on_update(device, payload, now)
            else:
                out = self._settle(inputs.message(kind, device, payload, r, self.finished, now), now)
        except WireError as e:
            out = inputs.reject(device, e.code, str(e), now, self.round, quiet=isinstance(e, Resent))
        except Exception as e:  # a bug must cost one message, never the service; the device hears of it
            out = inputs.reject(device, "internal_error", f"{type(e).__name__}: {e}", now, self.round, error=e)
        return [*self.outbox.drain(), *out]

    def _on_update(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        taken = self._inputs.update(device, payload, self.round, now)
        if taken is None:
            return []
        meta, verdict = taken
        if isinstance(verdict, Folded):  # the strategy folded (and checkpointed) it: the round records it
            self.round.folded[device] = Contribution(meta.n_samples, meta.metrics)
            self.counters["accepted"] += 1
            self._commit(registry=not self._registry.in_file(device))  # see _commit
            log.debug("round %d: accepted %s (%d samples) [%d/%d]", self.round.number, device, meta.n_samples,
                      len(self.round.folded), self.invited_count)
            verdict = verdict.then
        return self._settle(verdict, now)

    def tick(self, now: float) -> list[Effect]:
        """Count the messages the rate limit dropped; close the round when it is complete or its deadline has
        passed with a quorum; top invitations up; checkpoint changed registrations and publish the state when it
        changed (each at most once per state_interval)."""
        out = self._inputs.rate_limited(now, self.round)
        self._log.flush(now)
        if not self.finished:
            out += self._advance(now)
        interval = self.rounds.state_interval
        if self.selecting and not self.finished and now - self._last_top_up >= interval:
            self._last_top_up = now  # devices that come online within one interval are ranked together
            if self.phase is Phase.COLLECTING:
                self._invitations.lapse(self.round, now)
            out += self._top_up(now)
        dirty = self._registry.dirty or self._invitations.backoff_dirty
        if dirty and now >= self._next_registry_commit:  # registrations are checkpointed at this pace, however
            self._commit(registry=True)  # often they change: a device re-registering must not buy an fsync each
            self._paced_at, self._next_registry_commit = now, now + interval
        if now - self._last_state >= interval and {**self.state(now), "time": None} != self._published:
            out.append(self.state_message(now))
        return [*self.outbox.drain(), *out]

    def note_registry_written(self, seconds: float) -> None:
        """The shell wrote the registry this tick committed in `seconds`: an O(fleet) write takes at most a fifth
        of the engine's time (at 66,000 devices it took longer than state_interval, and a registration storm then
        bought one registry write per message: quadratic)."""
        self._next_registry_commit = max(self._next_registry_commit, self._paced_at + 4 * seconds)

    def note_broadcast(self, seconds: float) -> None:
        self._broadcast_s += seconds

    def note_sent(self, n_bytes: int) -> None:
        """The service published this many payload bytes (monitoring; not checkpointed)."""
        self.bytes_sent += n_bytes

    # ------------------------------------------------------------ the round table (coordinator/rounds.py)

    def _step(self, event: Event | None, now: float) -> list[Outgoing]:
        """The table's row for (phase, event): move to its phase, run its steps."""
        if event is None:
            return []
        self.phase, steps = TRANSITIONS.get((self.phase, event), (self.phase, ()))
        return [message for step in steps for message in self._steps[step](now)]

    def _advance(self, now: float) -> list[Outgoing]:
        """Collecting: the engine's closing rule (rounds.closing_event); closing: the strategy's own stages."""
        if self.phase is Phase.CLOSING:
            return self._close(now)
        if self.phase is not Phase.COLLECTING:
            return []
        answered = self.strategy.answered(self.round.folded.keys())
        everyone = self.registered.keys() <= answered or (
            self.selecting and len(answered) >= (self.config.selection.clients_per_round or 0))
        return self._step(closing_event(len(answered), self._quorum(), everyone, now, self._deadline), now)

    def _quorum(self) -> int:
        return max(self.rounds.min_clients, self.strategy.terms.quorum)

    def _settle(self, verdict: Verdict, now: float) -> list[Outgoing]:
        """Act on the strategy's verdict (after an update, a message of its own, or its close): its messages, then
        READY or FAILED's row of the table (Wait moves nothing)."""
        event = Event.READY if isinstance(verdict, Ready) else Event.FAILED if isinstance(verdict, Retry) else None
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
            self.counters["accepted"] += len(closed.folded)
        self.model = {t.name: release.model[t.name].astype(t.dtype) for t in self.manifest.shared_tensors}
        record = round_record(closed, len(self.registered), self.selecting, now, collect_s=now - self._opened_at,
                              broadcast_s=self._broadcast_s, aggregate_s=self._timer() - started)
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
        state = CoordinatorState(self.digest, self._model_file, self.round, self.counters, self.finished,
                                 self._registry.file, self.strategy.checkpoint(),
                                 backoff=self._invitations.backoff_file, fleet=self.topics.fleet)
        self.outbox.commit(state.to_json())

    # ------------------------------------------------------------ selection (--clients-per-round)

    def _select(self, now: float, carried: Mapping[str, int] | None = None, released: Iterable[str] = ()) -> None:
        self._invitations.select(self.round, now, carried, released)
        log.info("round %d: invited %d of %d device(s) online", self.round.number, len(self.round.invited),
                 len(self.online))

    def _top_up(self, now: float) -> list[Outgoing]:
        """More invitations while fewer than ceil(F * M) are live: checkpointed before they go out."""
        chosen = self._invitations.top_up(self.round, now)
        if chosen:
            self._commit()
        return [self._invitation(device) for device in chosen]

    # ------------------------------------------------------------ what it shows

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def counters(self) -> Counter[str]:
        """Refusals by code, and accepted updates, over the run (checkpointed)."""
        return self._inputs.counters

    @property
    def registered(self) -> Mapping[str, Registration]:
        return self._registry.registered

    @property
    def online(self) -> Set[str]:
        return self._registry.online

    @property
    def backoff(self) -> Backoff:
        return self._invitations.backoff

    @property
    def dp_epsilon(self) -> float | None:
        """Epsilon spent by the rounds released so far (at --dp-delta); None without DP."""
        return self.strategy.status().epsilon

    @property
    def blob_id(self) -> str:
        return "final" if self.finished else f"r{self.round.number}"

    @property
    def invited_count(self) -> int:
        """The devices the open round takes updates from: its invitations, or every registered device."""
        return len(self.round.invited) if self.selecting else len(self.registered)

    def _round_message(self) -> Outgoing:
        return self._announcements.round_info(self.round.number, self.rounds.rounds, self.finished, self._deadline,
                                              self.round.selected, self._round_fields)

    def _invitation(self, device: str) -> Outgoing:
        return self._announcements.invitation(device, self.round.carried.get(device, self.round.number))

    def state(self, now: float) -> dict[str, Any]:
        return {
            "v": 1, "status": "finished" if self.finished else "online", "round": self.round.number,
            "rounds": self.rounds.rounds, "deadline": self._deadline, "registered": len(self.registered),
            "online": len(self.online), "accepted_this_round": len(self.round.folded),
            "min_clients": self.rounds.min_clients, "counters": dict(self.counters), "time": now,
            **({"invited": len(self.round.invited), "clients_per_round": self.config.selection.clients_per_round}
               if self.selecting else {}),
            **self.strategy.status().fields,
        }

    def state_message(self, now: float) -> Outgoing:
        state = self.state(now)
        self._published, self._last_state = {**state, "time": None}, now
        return Outgoing(self.topics.state, json.dumps(state, separators=(",", ":")).encode(), retain=True)
