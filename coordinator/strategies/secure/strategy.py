"""The secure sum (`--secure-aggregation`): the open round runs a SecAgg+ session, and the coordinator
learns only n_j-weighted sums of the contributors' clipped deltas (with a noise multiplier the devices
add the noise: distributed DP, accounted like the central kind).

A session is not checkpointed: after a restart, or a session that fails before any share is revealed, the
round opens a new one and the devices take part again. Once the unmask requests go out the devices reveal
shares and take part in no other session of the round, so the round is checkpointed as unmasking before they
go out; a coordinator restarted in such a round cannot finish its session and releases it at start without
any device's update (the model unchanged), and the next round goes on.

A device whose input spoils its group's sum (beyond the clip norm, or secrets that do not check out) is narrowed
down over the next rounds: the contributors of the failed group are suspects, the next session splits them in
halves (plan_groups), each summed apart with others up to --secagg-min-group (a round too small for that leaves
one suspect out, and a failure without it clears it); the suspects become those of a half that fails again, and
a lone suspect is excluded from secure aggregation for the rest of the run (checkpointed). Meanwhile every group
that passes is released, so training goes on. The stages and their messages: session.py beside this file,
docs/privacy.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

import numpy as np

from fedper.coordinator.config import Aggregation, Privacy, Rounds, SecureAggregation, Selection
from fedper.coordinator.logs import log
from fedper.coordinator.store import Folded as Contribution
from fedper.coordinator.store import RoundRecord, Store
from fedper.coordinator.strategies.base import (
    Fleet,
    Opened,
    Ready,
    Refused,
    Released,
    Retry,
    Status,
    Strategy,
    Terms,
    Verdict,
    Wait,
)
from fedper.coordinator.strategies.budget import budget_for
from fedper.coordinator.strategies.secure.session import (
    DistributedNoise,
    GroupOutcome,
    SecureRound,
    SecureSettings,
    flat_length,
    new_session,
)
from fedper.manifest import Manifest
from fedper.payload import max_blob_size
from fedper.secagg import load_root
from fedper.wire import (
    DEVICE_KINDS,
    SECAGG_CODEC,
    SECAGG_UP,
    Outgoing,
    SecAggAdvertise,
    Topics,
    UpdateMeta,
    WireError,
    decode_secagg,
)


class SecureSum(Strategy):
    """One SecAgg+ session per round attempt; stage 1 (the keys) closes by the engine's rule, 2-4 by their own."""

    groups = ("secure", "aggregation", "privacy", "selection", "rounds")

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, secure: SecureAggregation,
                 aggregation: Aggregation, privacy: Privacy, selection: Selection, rounds: Rounds) -> None:
        odd = [t.name for t in manifest.shared_tensors if not np.issubdtype(np.dtype(t.dtype), np.floating)]
        if odd:
            raise ValueError(f"--secure-aggregation sums floating-point tensors; {odd[:3]} are not")
        # a masked input holds 4 bytes (uint32) per value, whatever the dtypes; a sum of one device is its update
        values = sum(int(np.prod(t.shape, dtype=np.int64)) for t in manifest.shared_tensors)
        terms = Terms(max(max_blob_size(manifest), 4 * values + 4096), DEVICE_KINDS, "advertisement(s)", quorum=2)
        budget = budget_for(privacy, aggregation.clip_norm, selection.clients_per_round)
        super().__init__(manifest, store, topics, fleet, terms, private=budget is not None)
        assert secure.identity_root is not None  # SecureAggregation requires it
        self.clip_norm, self.stage_timeout = float(aggregation.clip_norm or 0), secure.stage_timeout
        self.degree, self.min_clients, self.min_group = secure.degree, rounds.min_clients, secure.min_group
        self.root = load_root(Path(secure.identity_root))
        self.budget = budget
        self.tensors = "shared" if budget is None else "trainable"  # DP: private_tensor_names, as DPFedAvg
        self.session: SecureRound | None = None
        self.failures = 0  # sessions that could not finish in this process (monitoring; not checkpointed)
        self.suspects: set[str] = set()  # contributors of a group whose sum failed last round
        self.excluded: set[str] = set()  # found to spoil the sum: no longer admitted (checkpointed)
        self.unmasking = 0  # the last round whose unmask requests went out (checkpointed before they do)
        self.abandoned = False  # resumed in that round: its session is lost, it is released without updates

    def open(self, round_: RoundRecord, model: Mapping[str, np.ndarray], finished: bool,
             saved: Mapping[str, Any] | None = None) -> Opened:
        """The round's (new) session, which devices learn from RoundInfo; resumed: the budget, the suspects and
        the excluded (a session starts afresh)."""
        super().open(round_, model, finished, saved)
        if saved is not None:
            narrowing = saved.get("secagg") or {}
            self.suspects, self.excluded = set(narrowing.get("suspects", ())), set(narrowing.get("excluded", ()))
            self.unmasking = int(narrowing.get("unmasking", 0))
            self.abandoned = self.unmasking == round_.number and not finished
            if self.budget is not None:
                self.budget.resume(saved["privacy"])
        self.session = None if finished else SecureRound(round_.number, new_session(), SecureSettings(
            self.clip_norm, flat_length(self.manifest, self.tensors), self.stage_timeout, self.topics.fleet,
            self.root, self.degree, self.tensors, self.min_group))
        fields = {"secagg_session": self.session.session} if self.session is not None else {}
        return Opened(fields, bool(self.budget and self.budget.stopped), ready=self.abandoned)

    def _open_session(self) -> SecureRound:
        if self.session is None:
            raise WireError("secagg", "this coordinator does not run secure aggregation (or the run is finished)")
        return self.session

    def check(self, meta: UpdateMeta) -> Refused | None:
        refused = super().check(meta)
        if refused is None and meta.codec != SECAGG_CODEC:
            return Refused("secagg", "this round runs secure aggregation: run the agent with --secure-aggregation")
        return refused

    def accept(self, device: str, kind: str, payload: bytes, meta: UpdateMeta | None,
               now: float) -> Verdict | Refused:
        """A masked input (it joins the sum, no update is folded in the clear) or a stage's message; a stage
        (2-4) closes as soon as every device it waits for has answered."""
        if meta is not None:
            self._open_session().on_masked(device, payload, meta.n_samples, meta.metrics)
        else:
            message = decode_secagg(payload, SECAGG_UP)
            if device in self.excluded and isinstance(message, SecAggAdvertise):
                return Refused("secagg", f"{device} is excluded from secure aggregation in this run: its input "
                               "spoiled the sum of every group it was in")
            self._open_session().on_message(device, message)
        return self._step(now) if self._open_session().complete else Wait()

    def answered(self, folded: Set[str]) -> Set[str]:
        """Stage 1: the registered devices that advertised keys, and the excluded ones (never to be waited for)."""
        return (self._open_session().adverts.keys() | self.excluded) & self.fleet.registered.keys()

    def close(self, now: float) -> Verdict:
        """Stage 1 -> 2: the advertisers become the roster (under DP each one's share of the noise is set: the
        sum of m of them has std z * C); asked again at each tick, stages 2-4 close at their deadline."""
        session = self._open_session()
        if session.stage != "advertise":
            return self._step(now) if now >= session.deadline else Wait()
        noise = None if self.budget is None else DistributedNoise(self.budget.noise_multiplier,
                                                                  float(self.fleet.round_size()))
        registered = {d: r.n_samples for d, r in self.fleet.registered.items()}
        out = session.close_adverts(registered, now, self.topics, noise, self.suspects, max(self.min_clients, 2))
        return self._verdict(out)

    def _step(self, now: float) -> Verdict:
        return self._verdict(self._open_session().close_open_stage(now, self.topics, max(self.min_clients, 2)))

    def _verdict(self, out: list[Outgoing]) -> Verdict:
        """Where the session is: done releases the round, failed asks the engine to open it again."""
        stage = self._open_session().stage
        if stage == "failed":
            self.failures += 1
            return Retry(out)
        if stage == "unmask" and self.unmasking != self.number:
            self.unmasking = self.number  # on disk before the requests go out: the devices reveal shares
            return Wait(out, commit=True)
        return Ready(out) if stage == "done" else Wait(out)

    def release(self, closed: RoundRecord, last: bool) -> Released:
        """base + the n_j-weighted mean of the released groups' clipped deltas (the base when none is); the
        suspects narrowed by the groups that failed. A round resumed after its unmask requests went out (its
        devices take part in no other session of it): the base, without any update."""
        if self.abandoned:
            self.abandoned = False
            log.warning("round %d: this coordinator stopped after asking for its session's unmask shares; the devices "
                        "that revealed them take part in no other session of the round, so it is released without "
                        "any update and the next round opens", closed.number)
            return Released(dict(self.model), {"secagg": {"abandoned": True, "excluded": sorted(self.excluded)}},
                            bool(self.budget and self.budget.stopped), {})
        session = self._open_session()
        outcomes = session.outcomes()
        for outcome in outcomes:
            if not outcome.released:
                log.warning("round %d: the secure sum of %d device(s) is not released: %s", closed.number,
                            len(outcome.devices), outcome.why)
        self._narrow(closed.number, outcomes, set(session.sat_out))
        contributors = {d: Contribution(n, metrics) for d, (n, metrics) in session.contributions().items()}
        figures = self._figures(closed, last, len(contributors))
        return Released(session.model(self.manifest, self.model), figures, bool(self.budget and self.budget.stopped),
                        contributors)

    def _narrow(self, number: int, outcomes: list[GroupOutcome], sat_out: Set[str]) -> None:
        """Suspects: the contributors of the groups that showed a lie, within the last suspects when they are
        among them; none when every group passed, unless a suspect sat the session out (it stays a suspect, and
        sits out again: a pass shows no lie, so it never excludes anyone). A lone suspect is excluded."""
        failed = {d for outcome in outcomes if outcome.suspect for d in outcome.devices}
        if not failed and sat_out & self.suspects:
            log.warning("round %d: released without suspect %s, who sat the session out", number,
                        ", ".join(sorted(sat_out)))
            return
        self.suspects = (failed & self.suspects) or failed
        if len(self.suspects) == 1:
            log.warning("round %d: %s is excluded from secure aggregation: its input spoiled the sum of each group "
                        "it was narrowed down to", number, *self.suspects)
            self.excluded |= self.suspects
            self.suspects = set()
        elif self.suspects:
            log.warning("round %d: %d suspect(s) of spoiling the sum; the next session sums them in halves, or "
                        "leaves one out when too few devices advertise to halve them", number, len(self.suspects))

    def _figures(self, closed: RoundRecord, last: bool, count: int) -> dict[str, Any]:
        """The session's groups and narrowing; under DP the round accounted (distributed noise: what the
        contributors' shares of it add up to)."""
        session = self._open_session()
        groups = [{"devices": len(o.devices), "released": o.released, "why": o.why or None}
                  for o in session.outcomes()]
        refused = "; ".join(o.why for o in session.outcomes() if not o.released)
        record: dict[str, Any] = {"secagg": {"session": session.session, "devices": len(session.roster),
                                             "groups": groups, "sum_refused": refused or None,
                                             "reported": list(session.reported), "suspects": len(self.suspects),
                                             "excluded": sorted(self.excluded)}}
        if self.budget is not None:
            z, m = session.noise_multiplier(), float(session.expected_weight or 1)
            release = {"clip_norm": session.clip, "noise_std": z * session.clip / m, "expected": m,
                       "unclipped": None, "count": count}
            record["dp"] = self.budget.account(closed.number, self.fleet.invited_fraction(closed), z, release,
                                               len(self.fleet.registered), last)
        return record

    def status(self) -> Status:
        fields: dict[str, Any] = {"dp": self.budget.summary()} if self.budget is not None else {}
        if self.session is not None:
            fields["secagg"] = {"session": self.session.session, "stage": self.session.stage,
                                "devices": len(self.session.roster) or len(self.session.adverts),
                                "failed_sessions": self.failures, "suspects": len(self.suspects),
                                "excluded": sorted(self.excluded)}
        return Status(fields, None if self.budget is None else self.budget.epsilon)

    def checkpoint(self) -> dict[str, Any]:
        return {"privacy": None if self.budget is None else {**self.budget.checkpoint(), "partial_meta": None},
                "secagg": {"suspects": sorted(self.suspects), "excluded": sorted(self.excluded),
                           "unmasking": self.unmasking}}
