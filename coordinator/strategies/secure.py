"""The secure sum (`--secure-aggregation`): the open round runs a SecAgg+ session, and the coordinator
learns only n_j-weighted sums of the contributors' clipped deltas (with a noise multiplier the devices
add the noise: distributed DP, accounted like the central kind).

A session is not checkpointed: after a restart, or a session that fails before any share is revealed, the
round opens a new one and the devices take part again. A device whose input spoils its group's sum (beyond
the clip norm, or secrets that do not check out) is narrowed down over the next rounds: the contributors of
the failed group are suspects, the next session splits them in halves (plan_groups), each summed apart with
others up to --secagg-min-group (a round too small for that leaves one suspect out, and a failure without it
clears it); the suspects become those of a half that fails again, and a lone suspect is excluded from secure
aggregation for the rest of the run (checkpointed). Meanwhile every group that passes is released, so
training goes on. The stages and their messages: coordinator/secure_round.py, docs/privacy.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedper.coordinator.logs import log
from fedper.coordinator.secure_round import (
    DistributedNoise,
    GroupOutcome,
    SecureRound,
    SecureSettings,
    flat_length,
    new_session,
)
from fedper.coordinator.store import Folded, RoundRecord, Store
from fedper.coordinator.strategies.base import Fleet, Release, Strategy
from fedper.coordinator.strategies.budget import PrivacyBudget
from fedper.manifest import Manifest
from fedper.payload import max_blob_size
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

    kinds = DEVICE_KINDS
    answers = "advertisement(s)"
    quorum = 2  # a sum of one device is that device's update

    def __init__(self, manifest: Manifest, store: Store, topics: Topics, fleet: Fleet, *, clip_norm: float,
                 stage_timeout: float, degree: int | None, min_clients: int, budget: PrivacyBudget | None,
                 root: Ed25519PublicKey, min_group: int = 4) -> None:
        super().__init__(manifest, store, topics, fleet)
        self.clip_norm, self.stage_timeout, self.degree = clip_norm, stage_timeout, degree
        self.min_clients, self.root, self.min_group = min_clients, root, min_group
        self.budget = budget
        self.private = budget is not None
        self.tensors = "shared" if budget is None else "trainable"  # DP: private_tensor_names, as DPFedAvg
        self.session: SecureRound | None = None
        self.failures = 0  # sessions that could not finish in this process (monitoring; not checkpointed)
        self.suspects: set[str] = set()  # contributors of a group whose sum failed last round
        self.excluded: set[str] = set()  # found to spoil the sum: no longer admitted (checkpointed)

    def open(self, number: int, model: Mapping[str, np.ndarray], finished: bool) -> None:
        """The round's (new) session; devices learn it from RoundInfo."""
        super().open(number, model, finished)
        self.session = None if finished else SecureRound(number, new_session(), SecureSettings(
            self.clip_norm, flat_length(self.manifest, self.tensors), self.stage_timeout, self.topics.fleet,
            self.root, self.degree, self.tensors, self.min_group))

    def _open_session(self) -> SecureRound:
        if self.session is None:
            raise WireError("secagg", "this coordinator does not run secure aggregation (or the run is finished)")
        return self.session

    def check(self, meta: UpdateMeta) -> None:
        super().check(meta)
        if meta.codec != SECAGG_CODEC:
            raise WireError("secagg", "this round runs secure aggregation: run the agent with --secure-aggregation")

    def accept(self, device: str, blob: bytes, meta: UpdateMeta, now: float) -> tuple[bool, list[Outgoing]]:
        """A masked input: it joins the sum, no update is folded in the clear."""
        self._open_session().on_masked(device, blob, meta.n_samples, meta.metrics)
        return False, self._progress(now)

    def on_message(self, device: str, kind: str, payload: bytes, now: float) -> list[Outgoing]:
        message = decode_secagg(payload, SECAGG_UP)
        if device in self.excluded and isinstance(message, SecAggAdvertise):
            raise WireError("secagg", f"{device} is excluded from secure aggregation in this run: its input spoiled "
                            "the sum of every group it was in")
        self._open_session().on_message(device, message)
        return self._progress(now)

    def answered(self, folded: Set[str]) -> Set[str]:
        """Stage 1: the registered devices that advertised keys, and the excluded ones (never to be waited for)."""
        return (self._open_session().adverts.keys() | self.excluded) & self.fleet.registered.keys()

    def close(self, now: float) -> list[Outgoing]:
        """Stage 1 -> 2: the advertisers become the roster (under DP each one's share of the noise is set: the
        sum of m of them has std z * C)."""
        session = self._open_session()
        noise = None if self.budget is None else DistributedNoise(self.budget.noise_multiplier,
                                                                  float(self.fleet.round_size()))
        registered = {d: r.n_samples for d, r in self.fleet.registered.items()}
        out = session.close_adverts(registered, now, self.topics, noise, self.suspects, max(self.min_clients, 2))
        self.collecting = False
        self._settle()
        return out

    def tick(self, now: float) -> list[Outgoing]:
        """Stages 2-4 close at their deadline."""
        session = self.session
        if session is None or self.collecting or self.ready or self.failed or now < session.deadline:
            return []
        return self._step(now)

    def _progress(self, now: float) -> list[Outgoing]:
        """Close a stage (2-4) as soon as every device it waits for has answered."""
        return self._step(now) if self._open_session().complete else []

    def _step(self, now: float) -> list[Outgoing]:
        out = self._open_session().close_open_stage(now, self.topics, max(self.min_clients, 2))
        self._settle()
        return out

    def _settle(self) -> None:
        """Where the session is: done releases the round, failed asks the engine to open it again."""
        stage = self._open_session().stage
        self.ready, self.failed = stage == "done", stage == "failed"
        self.failures += self.failed

    def release(self, closed: RoundRecord) -> Release:
        """base + the n_j-weighted mean of the released groups' clipped deltas (the base when none is); the
        suspects narrowed by the groups that failed."""
        session = self._open_session()
        outcomes = session.outcomes()
        for outcome in outcomes:
            if not outcome.released:
                log.warning("round %d: the secure sum of %d device(s) is not released: %s", closed.number,
                            len(outcome.devices), outcome.why)
        self._narrow(closed.number, outcomes, set(session.sat_out))
        contributors = {d: Folded(n, metrics) for d, (n, metrics) in session.contributions().items()}
        return Release(session.model(self.manifest, self.model), contributors)

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

    def record(self, closed: RoundRecord, last: bool) -> dict[str, Any]:
        session = self._open_session()
        groups = [{"devices": len(o.devices), "released": o.released, "why": o.why or None}
                  for o in session.outcomes()]
        refused = "; ".join(o.why for o in session.outcomes() if not o.released)
        record: dict[str, Any] = {"secagg": {"session": session.session, "devices": len(session.roster),
                                             "groups": groups, "sum_refused": refused or None,
                                             "reported": list(session.reported), "suspects": len(self.suspects),
                                             "excluded": sorted(self.excluded)}}
        if self.budget is not None:  # distributed noise: what the contributors' shares of it add up to
            z, m = session.noise_multiplier(), float(session.expected_weight or 1)
            release = {"clip_norm": session.clip, "noise_std": z * session.clip / m, "expected": m,
                       "unclipped": None, "count": len(closed.folded)}
            record["dp"] = self.budget.account(closed.number, self.fleet.invited_fraction(closed), z, release,
                                               len(self.fleet.registered), last)
            self.stopped = self.budget.stopped
        return record

    def upload_size(self) -> int:
        """A masked input holds 4 bytes (uint32) per value, whatever the dtypes."""
        values = sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.manifest.shared_tensors)
        return max(max_blob_size(self.manifest), 4 * values + 4096)

    def round_fields(self) -> dict[str, Any]:
        return {"secagg_session": self.session.session} if self.session is not None else {}

    def state_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"dp": self.budget.summary()} if self.budget is not None else {}
        if self.session is not None:
            fields["secagg"] = {"session": self.session.session, "stage": self.session.stage,
                                "devices": len(self.session.roster) or len(self.session.adverts),
                                "failed_sessions": self.failures, "suspects": len(self.suspects),
                                "excluded": sorted(self.excluded)}
        return fields

    @property
    def epsilon(self) -> float | None:
        return None if self.budget is None else self.budget.epsilon

    def checkpoint(self) -> dict[str, Any]:
        return {"privacy": None if self.budget is None else {**self.budget.checkpoint(), "partial_meta": None},
                "secagg": {"suspects": sorted(self.suspects), "excluded": sorted(self.excluded)}}

    def resume(self, part: Mapping[str, Any], round_: RoundRecord, model: Mapping[str, np.ndarray],
               finished: bool) -> None:
        """The budget, the suspects and the excluded; the session starts afresh."""
        super().resume(part, round_, model, finished)
        narrowing = part.get("secagg") or {}
        self.suspects, self.excluded = set(narrowing.get("suspects", ())), set(narrowing.get("excluded", ()))
        if self.budget is not None:
            self.budget.resume(part["privacy"])
            self.stopped = self.budget.stopped
        self.open(round_.number, model, finished)
