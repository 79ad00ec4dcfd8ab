"""The coordinator's engine: devices, rounds, selection and deadlines, as a state machine fed with
decoded MQTT messages and the time.

No I/O: `start(now)`, `handle(topic, payload, now)` and `tick(now)` return effects, the writes the state
directory must make (coordinator/effects.py) followed by the messages to publish; coordinator/durable.py
carries them out, so tests and fuzzers drive it without a broker and the paho loop stays thin. The clock is
an argument: `now` for events, `timer` for the figures that time the engine's own work. Its parts: the round
table (rounds.py) and its steps (machine.py, RoundMachine, which this class extends with its inputs and outputs),
device messages (inputs.py, intake.py), the registry, invitations and announcements. What is
done with updates is the run's aggregation strategy (coordinator/strategies/), whose verdicts drive the table;
the engine branches on no mode. docs/architecture.md draws the parts, docs/reliability.md what a restart keeps.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Set
from typing import Any

import numpy as np

from fedper.coordinator.announcements import Announcements
from fedper.coordinator.config import Config
from fedper.coordinator.effects import Effect, Outbox
from fedper.coordinator.inputs import Inputs
from fedper.coordinator.intake import Intake, Resent
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.logs import DeviceLog, log
from fedper.coordinator.machine import RoundMachine
from fedper.coordinator.records import Saved, check_resumable, log_resumed
from fedper.coordinator.registry import FleetView, Registry
from fedper.coordinator.rounds import Phase
from fedper.coordinator.store import Folded as Contribution
from fedper.coordinator.store import Registration, RoundRecord
from fedper.coordinator.strategies import strategy_for
from fedper.coordinator.strategies.base import Folded, Ready
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared
from fedper.selection import Backoff
from fedper.wire import Outgoing, Topics, WireError


class RoundEngine(RoundMachine):
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
        self._ready_at_start = False  # resumed with the open round ready to release (Opened.ready)
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
        if self._ready_at_start:  # released before any update can fold into the record of a round already full
            self._ready_at_start = False
            out = self._settle(Ready(), now)
            return [*self.outbox.drain(), *out]
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
        opened = self._open_strategy(saved.strategy)
        stopped, self._ready_at_start = opened.stopped, opened.ready and not self.finished
        resumed, finished = self.round, self.finished
        reopened = finished and self.rounds.rounds > resumed.number and not stopped
        if reopened:  # more rounds than it ran: the next opens over the final model
            self.phase, self.round = Phase.COLLECTING, RoundRecord(resumed.number + 1)
            self._open_strategy()
            self._commit()
        log_resumed(self.outbox.dir, resumed, self.rounds.rounds, finished, stopped, reopened, len(self.registered))

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

    def note_published(self, now: float) -> None:
        """The service published the latest call's messages at `now`: invitations among them are timed from it."""
        self._invitations.sent(now)

    # ------------------------------------------------------------ what it shows

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
