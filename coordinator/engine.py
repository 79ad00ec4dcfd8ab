"""The coordinator's engine: devices, rounds, selection and deadlines, as a state machine fed with
decoded MQTT messages and the time.

No I/O: `start(now)`, `handle(topic, payload, now)` and `tick(now)` return effects, the writes the state
directory must make (coordinator/effects.py) followed by the messages to publish; coordinator/durable.py
carries them out, so tests and fuzzers drive it without a broker and the paho loop stays thin. The clock is
an argument: `now` for events, `timer` for the figures that time the engine's own work. What is done
with updates is the run's aggregation strategy (coordinator/strategies/); the engine branches on no
mode. docs/architecture.md draws the parts, docs/reliability.md what a restart keeps.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedper.coordinator.announcements import Announcements
from fedper.coordinator.config import Config
from fedper.coordinator.effects import Effect, Outbox
from fedper.coordinator.intake import Intake, Resent
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.logs import DeviceLog, log
from fedper.coordinator.records import check_resumable, log_closed, log_resumed, round_record
from fedper.coordinator.registry import Registry, registration, says_online
from fedper.coordinator.rounds import TRANSITIONS, Event, Phase, Step
from fedper.coordinator.store import (
    BACKOFF_PREFIX,
    FINAL_FILE,
    CoordinatorState,
    Folded,
    Registration,
    RoundRecord,
)
from fedper.coordinator.strategies import strategy_for
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared
from fedper.selection import Backoff
from fedper.wire import (
    MAX_ERROR_TEXT,
    ErrorMessage,
    Outgoing,
    Topics,
    UpdateMeta,
    WireError,
    decode_chunk,
)


@dataclass(frozen=True)
class Saved:
    """A state directory's checkpoint as the shell read it: state.json and the files it names."""

    state: CoordinatorState
    model: Mapping[str, np.ndarray]
    registry: Mapping[str, Any]
    backoff: Mapping[str, Any] | None


class RoundEngine:
    """The fleet's rounds; what is done with their updates is `strategy`'s (a `Fleet` to it)."""

    def __init__(self, manifest: Manifest, initial: Mapping[str, np.ndarray], topics: Topics, config: Config,
                 outbox: Outbox, saved: Saved | None, timer: Callable[[], float]) -> None:
        self.manifest, self.topics, self.config, self.outbox, self._timer = manifest, topics, config, outbox, timer
        self.strategy = strategy_for(config, manifest, outbox, topics, self)
        self.digest = manifest.base_digest
        self.model = decode_shared(manifest, encode_shared(manifest, initial))  # validated copy
        self._registry = Registry()
        self.counters: Counter[str] = Counter()
        self.round = RoundRecord(1)
        self.phase = Phase.COLLECTING
        self._steps = {Step.CLOSE: self._close, Step.EXTEND: self._extend, Step.RELEASE: self._release,
                       Step.OPEN: self._open_next, Step.REOPEN: self._reopen}
        self._released: tuple[RoundRecord, dict[str, Any]] | None = None  # between RELEASE and OPEN
        self.bytes_sent = 0  # payload bytes the service published for this process (monitoring)
        self._intake = Intake(config.quotas, config.rounds.chunk_size, self.strategy.upload_size(), topics)
        self._log = DeviceLog(log)  # per-device records at a bounded rate (coordinator/logs.py)
        # liveness of the open round's invitations (--clients-per-round), in this process: restarts begin afresh
        self._invitations = Invitations(config, self._registry.available, self.strategy, self._log)
        self.selecting = self._invitations.selecting
        self._deadline = 0.0
        self._opened_at = 0.0
        self._broadcast_s = 0.0
        self._announcements = Announcements(manifest, topics, config.rounds.chunk_size)
        self._state_dirty = True
        self._last_state = -1e18
        self._next_registry_commit = self._paced_at = -1e18
        self._last_top_up = -1e18
        self._model_file = ""  # the open round's model file; "" until the first start writes it
        self._last_closed: tuple[int, frozenset[str]] = (0, frozenset())  # its number and whose update it folded
        if saved is not None:
            self._resume(saved)
        else:
            self.strategy.open(1, self.model, finished=False)

    # ------------------------------------------------------------ what a strategy may read (strategies.base.Fleet)

    def round_size(self) -> int:
        """The updates a round closes at: M with --clients-per-round, else every registered device; DP-FedAvg's
        data-independent denominator m, whoever actually answered."""
        return max(1, self.config.selection.clients_per_round or len(self.registered))

    def invited_fraction(self, closed: RoundRecord) -> float:
        """The accountant's q: with --clients-per-round, invited / the devices they were drawn from (eligible now
        or invited), sampled without replacement (docs/privacy.md); else 1."""
        if not self.selecting:
            return 1.0
        return min(1.0, max(len(closed.invited), 1) /
                   max(self._invitations.drawn_from(closed.invited, self.round.number), 1))

    def median_samples(self) -> float | None:
        """The registered devices' median n_samples (None: nobody registered)."""
        return self._registry.median_samples()

    @property
    def registered(self) -> Mapping[str, Registration]:
        return self._registry.registered

    @property
    def online(self) -> Set[str]:
        return self._registry.online

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
        self._opened_at = now
        self._deadline = now + self.config.rounds.round_timeout
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
        self.counters = Counter(saved.counters)
        self._invitations.resume(loaded.backoff, saved.backoff)
        self.phase = Phase.FINISHED if saved.finished else Phase.COLLECTING
        self.round = saved.round
        self.outbox.trim_metrics(self.round.number if self.finished else self.round.number - 1)  # closed rounds'
        if not self.selecting:  # the open round keeps its invitations only when still selecting
            self.round.selected, self.round.invited, self.round.invite_cap = False, set(), 0
            self.round.carried = {}
        self.strategy.resume(saved.strategy, self.round, self.model, self.finished)
        resumed, finished = self.round, self.finished
        reopened = finished and self.config.rounds.rounds > resumed.number and not self.strategy.stopped
        if reopened:  # more rounds than it ran: the next opens over the final model
            self.phase, self.round = Phase.COLLECTING, RoundRecord(resumed.number + 1)
            self.strategy.open(self.round.number, self.model, finished=False)
            self._commit()
        log_resumed(self.outbox.dir, resumed, self.config.rounds.rounds, finished, self.strategy.stopped, reopened,
                    len(self.registered))

    def announce(self, now: float) -> list[Outgoing]:
        """Everything a device needs to join now (also after a broker restart lost retained messages)."""
        invites = [self._invitation(device) for device in sorted(self.round.invited)]
        return [*self._model_messages(), self._round_message(), *invites, self.state_message(now)]

    # ------------------------------------------------------------ input

    def admit(self, topic: str, now: float) -> bool:
        """Whether a message on `topic` passes its device's rate limit; False: drop it unread. Thread-safe
        (coordinator/quota.py), unlike the rest of the engine: the service calls it from paho's network
        thread, so a flood is dropped as it arrives; the drops are counted at the next `handle` or `tick`.
        A message for `handle(..., admitted=True)`; one on a topic that is not a device's passes (handle
        refuses it)."""
        try:
            kind, device = self.topics.parse(topic)
        except WireError:
            return True
        return self._intake.admit(device, kind, now)

    def handle(self, topic: str, payload: bytes, now: float, *, admitted: bool = False) -> list[Effect]:
        """One incoming message; a bad one is refused before it changes anything, logged once, counted and
        answered on its device's error topic (a chunk of a blob already refused is dropped: one answer per
        blob). admitted: `admit` passed it already (its rate token is spent). Raises nothing: a bug is refused too."""
        device = None
        try:
            kind, device = self.topics.parse(topic)
            if not admitted and not self._intake.admit(device, kind, now):
                out = self._count_rate_limited(now)
            elif kind == "register":
                out = self._on_register(device, payload, now)
            elif kind == "presence":
                out = self._on_presence(device, payload, now)
            elif kind == "update":
                out = self._on_update(device, payload, now)
            else:
                out = self._on_strategy_message(kind, device, payload, now)
        except WireError as e:
            out = self._reject(device, e.code, str(e), now, quiet=isinstance(e, Resent))
        except Exception as e:  # a bug must cost one message, never the service; the device hears of it
            out = self._reject(device, "internal_error", f"{type(e).__name__}: {e}", now, error=e)
        return [*self.outbox.drain(), *out]

    def tick(self, now: float) -> list[Effect]:
        """Count the messages the rate limit dropped; close the round when it is complete or its deadline has
        passed with a quorum; checkpoint changed registrations (at most once per state_interval) and publish
        the state when it changed."""
        out = self._count_rate_limited(now)
        self._log.flush(now)
        if not self.finished:
            out += self._advance(now)
        if self.selecting and not self.finished and now - self._last_top_up >= self.config.rounds.state_interval:
            self._last_top_up = now  # devices that come online within one interval are ranked together
            if self.phase is Phase.COLLECTING:
                self._invitations.lapse(self.round, now)
            out += self._top_up(now)
        dirty = self._registry.dirty or self._invitations.backoff_dirty
        if dirty and now >= self._next_registry_commit:  # registrations are checkpointed at this pace, however
            self._commit(registry=True)  # often they change: a device re-registering must not buy an fsync each
            self._paced_at, self._next_registry_commit = now, now + self.config.rounds.state_interval
        if self._state_dirty and now - self._last_state >= self.config.rounds.state_interval:
            out.append(self.state_message(now))
        return [*self.outbox.drain(), *out]

    def note_registry_written(self, seconds: float) -> None:
        """The shell wrote the registry this tick committed in `seconds`: an O(fleet) write takes at most a fifth
        of the engine's time (at 66,000 devices it took longer than state_interval, and a registration storm then
        bought one registry write per message: quadratic)."""
        self._next_registry_commit = max(self._next_registry_commit, self._paced_at + 4 * seconds)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def _step(self, event: Event | None, now: float) -> list[Outgoing]:
        """The table's row for (phase, event) (coordinator/rounds.py): move to its phase, run its steps."""
        if event is None:
            return []
        self.phase, steps = TRANSITIONS.get((self.phase, event), (self.phase, ()))
        out: list[Outgoing] = []
        for step in steps:
            out += self._steps[step](now)
        return out

    def _advance(self, now: float) -> list[Outgoing]:
        """The strategy's own deadlines; then the round's rule: it closes at quorum (--min-clients, and the
        strategy's) once everyone answered, M did with --clients-per-round, or the deadline passed."""
        out = self.strategy.tick(now)
        self._state_dirty |= bool(out)
        verdict = self._verdict()
        if self.phase is Phase.COLLECTING and verdict is None:
            done = len(self.strategy.answered(self.round.folded.keys()))
            if done >= self._quorum() and (self._complete(done) or now >= self._deadline):
                out += self._step(Event.COMPLETE, now)
            elif now >= self._deadline:
                return out + self._step(Event.SHORT, now)
        return out + self._settle(now)

    def _quorum(self) -> int:
        return max(self.config.rounds.min_clients, self.strategy.quorum)

    def _complete(self, done: int) -> bool:
        """Whether everyone the round waits for answered: every registered device, or M with selection."""
        answered = self.strategy.answered(self.round.folded.keys())
        return self.registered.keys() <= answered or (
            self.selecting and done >= (self.config.selection.clients_per_round or 0))

    def _verdict(self) -> Event | None:
        """What the strategy says of the round now: it may be released, or its attempt failed."""
        return Event.READY if self.strategy.ready else Event.FAILED if self.strategy.failed else None

    def _settle(self, now: float) -> list[Outgoing]:
        """Act on the strategy's verdict (after an update, a stage of its own, or a tick)."""
        return self._step(self._verdict(), now)

    def _close(self, now: float) -> list[Outgoing]:
        return self.strategy.close(now)

    def _reopen(self, now: float) -> list[Outgoing]:
        """A new attempt at the round: its deadline at least one round_timeout away, partial uploads dropped."""
        self.strategy.open(self.round.number, self.model, finished=False)
        self._deadline = max(self._deadline, now + self.config.rounds.round_timeout)
        self._intake.reassembler.discard()
        self._intake.new_attempt()
        self._state_dirty = True
        return [self._round_message()]

    def _extend(self, now: float) -> list[Outgoing]:
        """The deadline passed below --min-clients: wait one more round_timeout (replacing dropouts when selecting)."""
        self.round.extensions += 1
        if self.selecting:
            self._invitations.replace_dropouts(self.round)
            self._last_top_up = -1e18  # top up at once
        self._deadline = now + self.config.rounds.round_timeout
        log.warning("round %d: deadline passed with %d/%d %s, fewer than the %d it closes with: waiting %.1f s more "
                    "(extension %d)", self.round.number, len(self.strategy.answered(self.round.folded.keys())),
                    self.invited_count, self.strategy.answers, self._quorum(), self.config.rounds.round_timeout,
                    self.round.extensions)
        self._state_dirty = True
        return [self._round_message()]

    def note_broadcast(self, seconds: float) -> None:
        self._broadcast_s += seconds

    def note_sent(self, n_bytes: int) -> None:
        """The service published this many payload bytes (monitoring; not checkpointed)."""
        self.bytes_sent += n_bytes

    def note_published(self, now: float) -> None:
        """The service published the latest call's messages at `now`: invitations among them are timed from it."""
        self._invitations.sent(now)

    # ------------------------------------------------------------ messages

    def _on_register(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        if not payload:  # the device cleared its retained registration: it left the fleet
            if self._registry.unregister(device):
                self._log.log(now, device, "unregistered", logging.INFO, "unregistered %s", device)
                self._state_dirty = True
                self._invitations.forget(device)  # its misses are forgotten with it
            return []
        entry = registration(payload, self.digest, self.config.quotas.max_samples_per_device)
        if self._registry.register(device, entry):  # replaces an earlier one: see docs/reliability.md
            self._log.log(now, device, "registered", logging.INFO, "registered %s: %d samples, software %s", device,
                          entry.n_samples, entry.software)
            self._state_dirty = True
        if device in self.online:
            self._invitations.offer(device, self.round.number)
        return []

    def _on_presence(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        is_online = says_online(payload)
        if self._registry.presence(device, is_online, now):
            self._invitations.offer(device, self.round.number)
        self._state_dirty = True
        if not is_online and self.phase is Phase.COLLECTING:
            self._invitations.declined(device, self.round)  # or dropped out: the next top-up invites another
        return []

    def _on_update(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        self.round.bytes_received += len(payload)
        if self._intake.muted(device):  # a message admitted before it was muted: counted, dropped unread
            self._count(Counter(over_quota=1), state=False)
            return []
        chunk = decode_chunk(payload)  # its declared size is checked below, once per blob
        if self._intake.refused(device, chunk.blob_id):
            return []  # the rest of a blob already refused (and answered) once
        try:
            meta = self._intake.check(device, chunk, self.registered.get(device), self.round.number,
                                      lambda meta: self._check_round(device, meta))
            self._invitations.answer(device)
            blob = self._intake.reassembler.add(device, chunk)
            if blob is None:
                return []
            folded, out = self.strategy.accept(device, blob.data, meta, now)
        except Exception:  # refused as a whole blob: its other chunks are dropped, the device is answered once
            self._intake.refuse(device, chunk.blob_id)
            raise
        if folded:
            self._folded(device, meta.n_samples, meta.metrics)
        return out + self._settle(now)

    def _check_round(self, device: str, meta: UpdateMeta) -> None:
        """Refuse an update its round does not take: accepted already, another round, not invited, another export."""
        if self._accepted(device, meta.round):
            raise Resent("duplicate_update" if meta.round == self.round.number else "late_update",
                         f"round {meta.round} update already accepted from {device}")
        self.strategy.check(meta)  # the round it is for, its codec
        if self.selecting and device not in self.round.invited:  # before reassembly: it costs no memory
            raise WireError("not_invited", f"{device} is not invited to round {meta.round}: wait for an "
                            f"invitation on {self.topics.invite(device)}")
        if meta.base_digest != self.digest:
            raise WireError("digest_mismatch", f"update base_digest {meta.base_digest} is not {self.digest}")

    def _accepted(self, device: str, round_: int) -> bool:
        """Whether this device's update for `round_` was folded: in the open round, or in the one closed last."""
        closed, folded = self._last_closed
        return device in (self.round.folded if round_ == self.round.number else folded if round_ == closed else ())

    def _folded(self, device: str, n_samples: int, metrics: dict[str, float]) -> None:
        """The strategy folded (and checkpointed) the update: the round records it, then the commit."""
        self.round.folded[device] = Folded(n_samples, metrics)
        self.counters["accepted"] += 1
        self._commit(registry=not self._registry.in_file(device))  # see _commit
        log.debug("round %d: accepted %s (%d samples, accuracy %s) [%d/%d]", self.round.number, device, n_samples,
                  metrics.get("accuracy", "n/a"), len(self.round.folded), self.invited_count)

    def _on_strategy_message(self, kind: str, device: str, payload: bytes, now: float) -> list[Outgoing]:
        """A message on a topic kind of the strategy's own (secure aggregation's stages)."""
        if kind not in self.strategy.kinds or self.finished:
            raise WireError(kind, f"this coordinator takes no {kind} messages (not in this mode, or the run is "
                            "finished)")
        if device not in self.registered:
            raise WireError("unknown_device", f"{device} has not registered: publish register/{device} first")
        if self.selecting and device not in self.round.invited:
            raise WireError("not_invited", f"{device} is not invited to round {self.round.number}")
        out = self.strategy.on_message(device, kind, payload, now)
        self._invitations.answer(device)
        self._state_dirty = True  # at most one state message per state_interval
        return out + self._settle(now)

    def _reject(self, device: str | None, code: str, message: str, now: float,
                error: Exception | None = None, quiet: bool = False) -> list[Outgoing]:
        """Count, log (one record, with the traceback of an internal `error`; `quiet`: a harmless resend, at debug
        level; at most LOG_BURST a device per LOG_WINDOW_S, then a summary: coordinator/logs.py) and answer a
        refused message; a topic that names no device has nobody to answer."""
        self._count(Counter({code: 1}))
        self._log.log(now, device or "?", f"rejected {code}", logging.DEBUG if quiet else logging.WARNING,
                      "rejected %s from %s: %s", code, device or "?", message, exc_info=error)
        if device is None:
            return []
        answer = ErrorMessage(code, message[:MAX_ERROR_TEXT], self.round.number)
        return [Outgoing(self.topics.error(device), answer.encode())]

    def _count_rate_limited(self, now: float) -> list[Outgoing]:
        """Messages dropped unread since the last call, counted; answered once per report window per device."""
        counts, out = self._intake.rate_limited(now, self.round.number)
        self._count(counts)
        return out

    def _count(self, counts: Counter[str], state: bool = True) -> None:
        """Refusals counted for the run and the open round (and, with `state`, the state message updated)."""
        self.counters.update(counts)
        self.round.rejected.update(counts)
        self._state_dirty |= state and bool(counts)

    # ------------------------------------------------------------ selection (--clients-per-round)

    @property
    def backoff(self) -> Backoff:
        return self._invitations.backoff

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

    # ------------------------------------------------------------ rounds

    def _release(self, now: float) -> list[Outgoing]:
        """The strategy's model and figures for the closed round; the run goes on (NEXT) or ends (LAST)."""
        started = self._timer()
        closed = self.round
        release = self.strategy.release(closed)
        if release.contributors is not None:  # known only now (a secure sum)
            closed.folded = release.contributors
            self.counters["accepted"] += len(closed.folded)
        self.model = {t.name: release.model[t.name].astype(t.dtype) for t in self.manifest.shared_tensors}
        record = round_record(closed, len(self.registered), self.selecting, now, collect_s=now - self._opened_at,
                              broadcast_s=self._broadcast_s, aggregate_s=self._timer() - started)
        last = closed.number >= self.config.rounds.rounds
        record.update(self.strategy.record(closed, last))  # a DP strategy then adapts its clip norm
        self._released = (closed, record)
        self._last_closed = (closed.number, frozenset(closed.folded))
        return self._step(Event.LAST if last or self.strategy.stopped else Event.NEXT, now)

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
        self.strategy.open(self.round.number, self.model, self.finished)
        self._intake.new_round(self.finished, self._takes)
        if self.finished:
            self.outbox.write_tensors(FINAL_FILE, self.model)
        self.outbox.append_metrics(record)  # before the commit that closes the round: a restart trims it if need be
        self._commit(registry=True)  # once a round, registrations changed since the last tick go with it
        log_closed(record)
        self._opened_at, self._deadline, self._broadcast_s = now, now + self.config.rounds.round_timeout, 0.0
        self._announcements.forget_model()
        stale = sorted(closed.invited - self.round.invited)  # retained invitations of the closed round
        return self._announcements.cleared(stale) + self.announce(now)

    def _carried(self, closed: RoundRecord) -> dict[str, int]:
        """The closed round's invitations not answered yet (its own and those it carried) whose round the next
        round still takes updates for (Strategy.oldest_round): they stay, each with its round."""
        oldest = self.strategy.oldest_round(closed.number + 1)
        waiting = closed.invited - self.strategy.answered(closed.folded.keys())
        return {device: r for device in waiting if (r := closed.carried.get(device, closed.number)) >= oldest}

    def _takes(self, meta: UpdateMeta) -> bool:
        """Whether the open round still takes an update with this meta (a partial upload is kept for it)."""
        try:
            self.strategy.check(meta)
        except WireError:
            return False
        return True

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
        self._state_dirty = True

    # ------------------------------------------------------------ outgoing

    @property
    def dp_epsilon(self) -> float | None:
        """Epsilon spent by the rounds released so far (at --dp-delta); None without DP."""
        return self.strategy.epsilon

    @property
    def blob_id(self) -> str:
        return "final" if self.finished else f"r{self.round.number}"

    def _model_messages(self) -> list[Outgoing]:
        return self._announcements.model(self.blob_id, self.round.number, self.model)

    def _round_message(self) -> Outgoing:
        return self._announcements.round_info(self.round.number, self.config.rounds.rounds, self.finished,
                                              self._deadline, self.round.selected, self.strategy.round_fields())

    def _invitation(self, device: str) -> Outgoing:
        return self._announcements.invitation(device, self.round.carried.get(device, self.round.number))

    @property
    def invited_count(self) -> int:
        """The devices the open round takes updates from: its invitations, or every registered device."""
        return len(self.round.invited) if self.selecting else len(self.registered)

    def state(self, now: float) -> dict[str, Any]:
        return {
            "v": 1, "status": "finished" if self.finished else "online", "round": self.round.number,
            "rounds": self.config.rounds.rounds, "deadline": self._deadline, "registered": len(self.registered),
            "online": len(self.online), "accepted_this_round": len(self.round.folded),
            "min_clients": self.config.rounds.min_clients, "counters": dict(self.counters), "time": now,
            **({"invited": len(self.round.invited), "clients_per_round": self.config.selection.clients_per_round}
               if self.selecting else {}),
            **self.strategy.state_fields(),
        }

    def state_message(self, now: float) -> Outgoing:
        self._state_dirty, self._last_state = False, now
        return Outgoing(self.topics.state, json.dumps(self.state(now), separators=(",", ":")).encode(), retain=True)

