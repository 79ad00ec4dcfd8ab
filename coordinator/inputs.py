"""What devices send, each message checked before it changes anything: registrations, presence, updates (their
quotas and reassembly in coordinator/intake.py) and the messages on the strategy's own topic kinds; a refusal is
counted, logged at a bounded rate and answered on the device's error topic (docs/reliability.md, "Untrusted
devices"). Pure, as the engine that drives it: the open round comes in as an argument, the strategy's verdicts
go back to the engine, which acts on them by its round table.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Set

from fedper.coordinator.config import Config
from fedper.coordinator.intake import Intake, Resent
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.logs import DeviceLog
from fedper.coordinator.registry import Registry, registration, says_online
from fedper.coordinator.store import RoundRecord
from fedper.coordinator.strategies.base import Folded, Refused, Strategy, Verdict
from fedper.wire import MAX_ERROR_TEXT, ErrorMessage, Outgoing, Topics, UpdateMeta, WireError, decode_chunk


class Inputs:
    """The checks and refusals of device messages, and the run's counters (checkpointed by the engine)."""

    def __init__(self, config: Config, digest: str, topics: Topics, registry: Registry, invitations: Invitations,
                 intake: Intake, strategy: Strategy, device_log: DeviceLog) -> None:
        self.config, self.digest, self.topics, self.strategy = config, digest, topics, strategy
        self.registry, self.invitations, self.intake, self.log = registry, invitations, intake, device_log
        self.counters: Counter[str] = Counter()
        self.last_closed: tuple[int, frozenset[str]] = (0, frozenset())  # the round closed last, whose update it folded

    def register(self, device: str, payload: bytes, now: float, r: RoundRecord) -> list[Outgoing]:
        if not payload:  # the device cleared its retained registration: it left the fleet
            if self.registry.unregister(device):
                self.log.log(now, device, "unregistered", logging.INFO, "unregistered %s", device)
                self.invitations.forget(device)  # its misses are forgotten with it
            return []
        entry = registration(payload, self.digest, self.config.quotas.max_samples_per_device)
        if self.registry.register(device, entry):  # replaces an earlier one: see docs/reliability.md
            self.log.log(now, device, "registered", logging.INFO, "registered %s: %d samples, software %s", device,
                         entry.n_samples, entry.software)
        if device in self.registry.online:
            self.invitations.offer(device, r.number)
        return []

    def presence(self, device: str, payload: bytes, now: float, r: RoundRecord, collecting: bool) -> list[Outgoing]:
        is_online = says_online(payload)
        if self.registry.presence(device, is_online, now):
            self.invitations.offer(device, r.number)
        if not is_online and collecting:
            self.invitations.declined(device, r)  # or dropped out: the next top-up invites another
        return []

    def update(self, device: str, payload: bytes, r: RoundRecord,
               now: float) -> tuple[UpdateMeta, Folded | Verdict] | None:
        """An update chunk: None until its blob is whole (or when it is dropped); then the strategy's verdict on
        the update. A refusal raises WireError, after which the blob's other chunks are dropped unanswered."""
        r.bytes_received += len(payload)
        if self.intake.muted(device):  # a message admitted before it was muted: counted, dropped unread
            self.count(Counter(over_quota=1), r)
            return None
        chunk = decode_chunk(payload)  # its declared size is checked below, once per blob
        if self.intake.refused(device, chunk.blob_id):
            return None  # the rest of a blob already refused (and answered) once
        try:
            meta = self.intake.check(device, chunk, self.registry.registered.get(device), r.number,
                                     lambda meta: self._check_round(device, meta, r))
            self.invitations.answer(device)
            blob = self.intake.reassembler.add(device, chunk)
            if blob is None:
                return None
            verdict = refusing(self.strategy.accept(device, "update", blob.data, meta, now))
        except Exception:  # refused as a whole blob: its other chunks are dropped, the device is answered once
            self.intake.refuse(device, chunk.blob_id)
            raise
        return meta, verdict

    def _check_round(self, device: str, meta: UpdateMeta, r: RoundRecord) -> None:
        """Refuse an update its round does not take: accepted already, another round, not invited, another export."""
        closed, folded = self.last_closed
        if device in (r.folded if meta.round == r.number else folded if meta.round == closed else ()):
            raise Resent("duplicate_update" if meta.round == r.number else "late_update",
                         f"round {meta.round} update already accepted from {device}")
        refusing(self.strategy.check(meta))  # the round it is for, its codec
        if self.invitations.selecting and device not in r.invited:  # before reassembly: it costs no memory
            raise WireError("not_invited", f"{device} is not invited to round {meta.round}: wait for an "
                            f"invitation on {self.topics.invite(device)}")
        if meta.base_digest != self.digest:
            raise WireError("digest_mismatch", f"update base_digest {meta.base_digest} is not {self.digest}")

    def message(self, kind: str, device: str, payload: bytes, r: RoundRecord, finished: bool,
                now: float) -> Verdict:
        """A message on a topic kind of the strategy's own (secure aggregation's stages)."""
        if kind not in self.strategy.terms.kinds or finished:
            raise WireError(kind, f"this coordinator takes no {kind} messages (not in this mode, or the run is "
                            "finished)")
        if device not in self.registry.registered:
            raise WireError("unknown_device", f"{device} has not registered: publish register/{device} first")
        if self.invitations.selecting and device not in r.invited:
            raise WireError("not_invited", f"{device} is not invited to round {r.number}")
        verdict = refusing(self.strategy.accept(device, kind, payload, None, now))
        self.invitations.answer(device)
        return verdict.then if isinstance(verdict, Folded) else verdict

    def reject(self, device: str | None, code: str, message: str, now: float, r: RoundRecord,
               error: Exception | None = None, quiet: bool = False) -> list[Outgoing]:
        """Count, log (one record, with the traceback of an internal `error`; `quiet`: a harmless resend, at debug
        level; at most LOG_BURST a device per LOG_WINDOW_S, then a summary: coordinator/logs.py) and answer a
        refused message; a topic that names no device has nobody to answer."""
        self.count(Counter({code: 1}), r)
        self.log.log(now, device or "?", f"rejected {code}", logging.DEBUG if quiet else logging.WARNING,
                     "rejected %s from %s: %s", code, device or "?", message, exc_info=error)
        if device is None:
            return []
        answer = ErrorMessage(code, message[:MAX_ERROR_TEXT], r.number)
        return [Outgoing(self.topics.error(device), answer.encode())]

    def rate_limited(self, now: float, r: RoundRecord) -> list[Outgoing]:
        """Messages dropped unread since the last call, counted; answered once per report window per device."""
        counts, out = self.intake.rate_limited(now, r.number)
        self.count(counts, r)
        return out

    def count(self, counts: Counter[str], r: RoundRecord) -> None:
        """Refusals counted for the run and the open round."""
        self.counters.update(counts)
        r.rejected.update(counts)

    def closed(self, r: RoundRecord, contributors: Set[str]) -> None:
        """Round `r` closed with these contributors: their resends of its update are late, and harmless."""
        self.last_closed = (r.number, frozenset(contributors))


def refusing(verdict: Folded | Verdict | Refused | None) -> Folded | Verdict | None:
    """The strategy's verdict, or its refusal raised as the WireError the device is answered with."""
    if isinstance(verdict, Refused):
        raise WireError(verdict.code, verdict.text)
    return verdict
