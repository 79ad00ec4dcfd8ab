"""Secure aggregation at the coordinator (`--secure-aggregation`): one SecAgg+ session over MQTT.

The kernel (fedper.secagg) does the cryptography; this module runs its server's stages on messages that
arrive one at a time from untrusted devices, each stage with a deadline, checking every message on its own
so that a bad one is refused (`secagg`) without costing another device its place. A device whose shares do
not authenticate is reported by its neighbours and left out of the session; the session's groups (one, or
several while the strategy narrows down a device whose input spoils the sum: `plan_groups`) are checked and
released apart. The strategy that drives it is strategy.py beside this file. Stages, weights and
distributed DP: docs/privacy.md ("Secure aggregation"); messages: docs/protocol.md, 6.9.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedper.coordinator.logs import log
from fedper.manifest import Manifest, SummedTensors
from fedper.secagg import (
    AggregateResult,
    MaskedInput,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    advert_problem,
    usable_public_key,
)
from fedper.wire import (
    MAX_JSON_INT,
    MAX_SECAGG_DEVICES,
    Outgoing,
    SecAggAdvertise,
    SecAggReceived,
    SecAggShares,
    SecAggSignature,
    SecAggUnmask,
    Topics,
    WireError,
)


def new_session() -> int:
    """A session number no earlier session of the run is likely to have had (keys are derived per session)."""
    return 1 + secrets.randbelow(MAX_JSON_INT - 1)


class Stage(str, Enum):
    """Where a session is: its stages in order, then done or failed. A str, as the state message shows it."""

    ADVERTISE = "advertise"
    SHARES = "shares"
    RECEIVED = "received"
    MASKED = "masked"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


def flat_length(manifest: Manifest, tensors: SummedTensors = "shared") -> int:
    """Values of the vector a device masks."""
    return sum(int(np.prod(t.shape, dtype=np.int64)) for t in manifest.summed_tensors(tensors))


def plan_groups(devices: Sequence[str], suspects: Set[str], min_group: int, minimum: int = 2) -> list[list[str]]:
    """The groups a session sums apart: everyone in one; with suspects among `devices` (the contributors of a
    group whose sum failed last round), the suspects in two halves, each filled up to `min_group` with the
    others, and the others left in a group of their own (spread over the halves when fewer than `min_group`).
    Too few others to fill both halves: one group without the first suspect, who sits this session out (as if
    it had dropped out), when the rest are at least `minimum`; else everyone in one group (nothing to narrow)."""
    suspect = [d for d in devices if d in suspects]
    others = [d for d in devices if d not in suspects]
    if not suspect:
        return [list(devices)]
    middle = (len(suspect) + 1) // 2
    halves = [suspect[:middle], suspect[middle:]] if len(suspect) > 1 else [suspect]
    if sum(max(0, min_group - len(h)) for h in halves) > len(others):
        rest = [d for d in devices if d != suspect[0]]
        return [rest] if len(rest) >= minimum else [list(devices)]
    groups = []
    for half in halves:
        fill = max(0, min_group - len(half))
        groups.append(half + others[:fill])
        others = others[fill:]
    if len(others) >= min_group:
        groups.append(others)
    else:
        for i, device in enumerate(others):
            groups[i % len(groups)].append(device)
    return groups


@dataclass
class _Contribution:
    n_samples: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class SecureSettings:
    """What a session runs with, fixed when it opens (from the coordinator's configuration and manifest)."""

    clip: float  # C: the L2 norm a device clips its delta to, and (without noise) the quantization range
    length: int  # values of the vector a device masks: flat_length(manifest, tensors)
    stage_timeout: float  # seconds each of stages 2-6 waits
    fleet: str  # the fleet whose root certifies the devices' identities
    root: Ed25519PublicKey = field(repr=False)  # the fleet root's public key (--secagg-identity-root)
    degree: int | None = None  # k; None: fedper.secagg's default (at most MAX_SECAGG_NEIGHBOURS, checked by Config)
    tensors: SummedTensors = "shared"  # which tensors the vector holds: "shared", or "trainable" under DP
    min_group: int = 4  # the smallest group plan_groups makes


@dataclass(frozen=True)
class DistributedNoise:
    """Distributed DP for one session, decided when its stage 1 closes (the fleet may have grown since it opened):
    the noise multiplier z and m, the devices a round expects (the fixed denominator, uniform weights)."""

    noise_multiplier: float
    expected_weight: float


@dataclass(frozen=True)
class GroupOutcome:
    """One group of a finished session: its contributors, whether its sum is released, and if not why, and
    whether that shows a lie (a sum beyond the clip norm, secrets that do not check out) rather than dropouts."""

    devices: tuple[str, ...]
    released: bool
    why: str = ""
    suspect: bool = False


@dataclass
class SecureRound:
    """One session of one round; `stage` says where it is."""

    round: int
    session: int
    settings: SecureSettings
    noise: DistributedNoise | None = None  # given to close_adverts; None: clear sums weighted by n_j
    stage: Stage = Stage.ADVERTISE
    deadline: float = 0.0  # of stages 2-6 (stage 1 closes at the round's deadline, decided by the engine)
    adverts: dict[str, SecAggAdvertise] = field(default_factory=dict)  # device -> its verified advert
    roster: tuple[str, ...] = ()  # index -> device, fixed when stage 1 closes (grouped: plan_groups' order)
    weight_scale: int = 1
    weights: dict[str, int] = field(default_factory=dict)  # device -> registered n_j, fixed with the roster
    server: SecAggServer | None = None
    _bundles: dict[int, SecAggShares] = field(default_factory=dict)
    _reports: dict[int, SecAggReceived] = field(default_factory=dict)
    _expected: set[int] = field(default_factory=set)  # indices that may still answer the open stage
    _masked: dict[int, MaskedInput] = field(default_factory=dict)
    _signatures: dict[int, SecAggSignature] = field(default_factory=dict)
    _contributions: dict[str, _Contribution] = field(default_factory=dict)
    _responses: dict[int, SecAggUnmask] = field(default_factory=dict)
    result: AggregateResult | None = None
    failure: str = ""
    reported: tuple[str, ...] = ()  # devices left out of the session by their neighbours' reports
    sat_out: tuple[str, ...] = ()  # advertisers plan_groups left out of the session (a suspect, in a small round)
    _outcomes: list[GroupOutcome] | None = None

    @property
    def clip(self) -> float:
        return self.settings.clip

    @property
    def expected_weight(self) -> float | None:
        """m under distributed DP (what the sum is divided by); None: the contributors' n_j."""
        return None if self.noise is None else self.noise.expected_weight

    @property
    def noise_std(self) -> float:
        """Each device's noise std under distributed DP, z * C / sqrt(m): the sum of m of them has std z * C."""
        if self.noise is None:
            return 0.0
        return self.noise.noise_multiplier * self.clip / math.sqrt(self.noise.expected_weight)

    # ------------------------------------------------------------ messages from devices

    def on_message(self, device: str,
                   message: SecAggAdvertise | SecAggShares | SecAggReceived | SecAggSignature | SecAggUnmask) -> None:
        """One decoded stage message from `device`; WireError("secagg" or "bad_message") refuses it."""
        if (message.round, message.session) != (self.round, self.session):
            raise WireError("secagg", f"message for round {message.round} session {message.session}, the open one "
                            f"is round {self.round} session {self.session}")
        server = self.server  # it exists from stage 2 on, which _index checks first
        if isinstance(message, SecAggAdvertise):
            self._on_advert(device, message)
        elif isinstance(message, SecAggShares):
            self._take(self._bundles, self._index(device, Stage.SHARES), server.check_shares, message)
        elif isinstance(message, SecAggReceived):
            self._take(self._reports, self._index(device, Stage.RECEIVED), server.check_report, message)
        elif isinstance(message, SecAggSignature):
            self._take(self._signatures, self._index(device, Stage.CONSISTENCY), server.check_signature, message)
        else:
            self._take(self._responses, self._index(device, Stage.UNMASK), server.check_response, message)

    def _take(self, store: dict[int, Any], index: int, check: Callable[[int, Any], None], message: object) -> None:
        """A stage message the kernel's check accepts is kept; one it refuses is answered `secagg`."""
        self._refused_by_kernel(check, index, message)
        store[index] = message
        self._expected.discard(index)

    def _index(self, device: str, stage: Stage) -> int:
        if self.stage != stage:
            raise WireError("secagg", f"a {stage} message while session {self.session} is at stage {self.stage}")
        if device not in self.weights:
            raise WireError("secagg", f"{device} is not in session {self.session}: it did not advertise in time")
        index = self.roster.index(device)
        if index not in self._expected:
            raise WireError("secagg", f"{device} already answered stage {stage}, or dropped out of the session")
        return index

    def _on_advert(self, device: str, message: SecAggAdvertise) -> None:
        if self.stage != Stage.ADVERTISE:
            raise WireError("secagg", f"session {self.session} closed its advertisements: wait for the next session")
        problem = advert_problem(message, device, self.settings.fleet, self.settings.root)
        if problem:
            raise WireError("secagg", problem)
        keys = (message.c_public, message.s_public)
        if keys[0] == keys[1] or any(k in (a.c_public, a.s_public) for d, a in self.adverts.items() if d != device
                                     for k in keys):
            raise WireError("secagg", "public keys must be distinct, and not another device's")
        if not all(usable_public_key(k) for k in keys):
            raise WireError("secagg", "a public key is a low-order X25519 point: it agrees on no secret")
        self.adverts[device] = message  # a device that restarted in this stage replaces its keys

    def on_masked(self, device: str, blob: bytes, n_samples: int, metrics: dict[str, float]) -> None:
        """A reassembled update blob of codec `secagg` from `device` (its meta checked by the engine)."""
        index = self._index(device, Stage.MASKED)
        try:
            masked = MaskedInput.from_safetensors(blob)
        except SecAggError as e:
            raise WireError("secagg", str(e)) from None
        if masked.device != index:
            raise WireError("secagg", f"masked input for index {masked.device}, {device} is {index}")
        assert self.server is not None
        self._refused_by_kernel(self.server.check_masked, masked)
        self._masked[index] = masked
        self._contributions[device] = _Contribution(n_samples, metrics)
        self._expected.discard(index)

    @staticmethod
    def _refused_by_kernel(check: Callable[..., None], *message: object) -> None:
        try:
            check(*message)
        except SecAggError as e:
            raise WireError("secagg", str(e)) from None

    # ------------------------------------------------------------ stages

    @property
    def complete(self) -> bool:
        """Every device expected in the open stage (2-6) answered: close it now."""
        return self.stage not in (Stage.ADVERTISE, Stage.DONE, Stage.FAILED) and not self._expected

    def close_adverts(self, registered: Mapping[str, int], now: float, topics: Topics,
                      noise: DistributedNoise | None = None, suspects: Set[str] = frozenset(),
                      minimum: int = 2) -> list[Outgoing]:
        """Stage 1 -> 2: the advertisers (still registered) become the roster, in the groups plan_groups makes of
        them with `suspects` (`minimum`: the smallest session); each gets its setup and its advertising neighbours'
        adverts (and, with `noise`, its share of the noise)."""
        self.noise = noise
        advertisers = sorted(d for d in self.adverts if d in registered)[:MAX_SECAGG_DEVICES]
        if len(advertisers) < 2:
            return self._fail(f"{len(advertisers)} device(s) advertised keys: a sum needs at least 2")
        groups = plan_groups(advertisers, suspects, self.settings.min_group, minimum)
        self.roster = tuple(d for group in groups for d in group)
        self.sat_out = tuple(d for d in advertisers if d not in self.roster)
        if self.sat_out:
            log.warning("round %d: secure aggregation session %d: suspect %s sits this session out: too few devices "
                        "(%d) to sum the suspects in halves of --secagg-min-group %d", self.round, self.session,
                        ", ".join(self.sat_out), len(advertisers), self.settings.min_group)
        elif suspects & set(advertisers) and len(groups) == 1:
            log.warning("round %d: secure aggregation session %d: cannot narrow down the %d suspect(s) of spoiling "
                        "the sum: %d device(s) advertised, too few to leave one out", self.round, self.session,
                        len(suspects & set(advertisers)), len(advertisers))
        self.weights = {d: registered[d] for d in self.roster}
        self.weight_scale = max(self.weights.values())
        config = SecAggConfig.create(round=self.round, session=self.session, roster=self.roster,
                                     length=self.settings.length, clip=self.clip + 6 * self.noise_std,
                                     degree=self.settings.degree, graph_seed=secrets.randbits(32),
                                     groups=[len(g) for g in groups])
        self.server = SecAggServer(config, self.settings.fleet, self.settings.root)
        setups = self.server.neighbour_keys(
            {i: self.adverts[d] for i, d in enumerate(self.roster)}, self.weight_scale, clip_norm=self.clip,
            noise_std=self.noise_std, weights="samples" if self.noise is None else "uniform",
            tensors=self.settings.tensors)
        out = [Outgoing(topics.relay(self.roster[index]), setup.encode()) for index, setup in setups.items()]
        log.info("round %d: secure aggregation session %d: %d device(s) in %d group(s), k %d, t %d, %d-bit values",
                 self.round, self.session, config.devices, len(groups), config.degree, config.threshold,
                 config.value_bits)
        return self._next(Stage.SHARES, set(range(len(self.roster))), now, out)

    def close_open_stage(self, now: float, topics: Topics, minimum: int) -> list[Outgoing]:
        """Close stage 2 to 6 (all answered, or its deadline passed): relay the shares, ask for the masked inputs,
        send the survivors to sign, send the signatures with the unmask requests, or aggregate. A session fails
        (and the round opens another) only before any share is revealed: from the unmask stage on, it is done,
        whatever each group's outcome (a device answers one unmask request a round)."""
        assert self.server is not None
        closers = {Stage.SHARES: self._relay_shares, Stage.RECEIVED: self._ask_masked,
                   Stage.MASKED: self._ask_signatures, Stage.CONSISTENCY: self._ask_unmask}
        close = closers.get(self.stage)
        try:
            if close is not None:
                return close(self.server, now, topics.relay, minimum)
        except SecAggError as e:  # too few inputs or signatures for the consistency check
            return self._fail(str(e))
        self.result = self.server.aggregate(self._responses)
        self.stage = Stage.DONE
        return []

    def _relay_shares(self, server: SecAggServer, now: float, relay: Callable[[str], str],
                      minimum: int) -> list[Outgoing]:
        if len(self._bundles) < minimum:
            return self._fail(f"{len(self._bundles)} device(s) shared keys, fewer than {minimum}")
        inbox = server.relay_shares(self._bundles)
        out = [Outgoing(relay(self.roster[u]), m.encode()) for u, m in inbox.items()]
        return self._next(Stage.RECEIVED, set(inbox), now, out)

    def _ask_masked(self, server: SecAggServer, now: float, relay: Callable[[str], str],
                    minimum: int) -> list[Outgoing]:
        requests = server.mask_requests(self._reports)
        self.reported = tuple(self.roster[u] for u in server.excluded)
        if self.reported:
            log.warning("round %d: secure aggregation session %d: left out %s, whose shares did not "
                        "authenticate at a neighbour", self.round, self.session, ", ".join(self.reported))
        if len(requests) < minimum:
            return self._fail(f"{len(requests)} device(s) may send a masked input, fewer than {minimum}")
        out = [Outgoing(relay(self.roster[u]), m.encode()) for u, m in requests.items()]
        return self._next(Stage.MASKED, set(requests), now, out)

    def _ask_signatures(self, server: SecAggServer, now: float, relay: Callable[[str], str],
                        minimum: int) -> list[Outgoing]:
        if len(self._masked) < minimum:
            return self._fail(f"{len(self._masked)} masked input(s), fewer than {minimum}")
        lists = server.survivor_lists(self._masked.values())
        self._masked.clear()  # summed by the server
        out = [Outgoing(relay(self.roster[u]), m.encode()) for u, m in lists.items()]
        return self._next(Stage.CONSISTENCY, set(lists), now, out)

    def _ask_unmask(self, server: SecAggServer, now: float, relay: Callable[[str], str],
                    minimum: int) -> list[Outgoing]:
        requests = server.unmask_requests(self._signatures)
        out = [Outgoing(relay(self.roster[u]), m.encode()) for u, m in requests.items()]
        return self._next(Stage.UNMASK, set(requests), now, out)

    def _next(self, stage: Stage, expected: set[int], now: float, out: list[Outgoing]) -> list[Outgoing]:
        self.stage, self._expected, self.deadline = stage, expected, now + self.settings.stage_timeout
        return out

    def _fail(self, why: str) -> list[Outgoing]:
        self.stage, self.failure = Stage.FAILED, why
        log.warning("round %d: secure aggregation session %d failed: %s", self.round, self.session, why)
        return []

    # ------------------------------------------------------------ the result

    def outcomes(self) -> list[GroupOutcome]:
        """Each group's outcome. The per-update norm check, moved to each group's sum: honest devices' deltas each
        have an L2 norm of at most C, so their weighted mean has too (plus the quantization's error and, under DP,
        the noise's norm). A mean beyond that means a device sent values beyond its clip norm (each value is only
        bounded by the quantization range): that group's sum is not released."""
        assert self.result is not None
        if self._outcomes is not None:
            return self._outcomes
        out = []
        for group in self.result.groups:
            devices = tuple(self.roster[u] for u in group.survivors)
            if group.sum is None:
                out.append(GroupOutcome(devices, False, group.failure, group.lied))
                continue
            limit, norm = self._limit(devices), float(np.linalg.norm(group.sum)) / self._weight(devices)
            if norm > limit:
                why = (f"the mean delta's L2 norm {norm:.4g} exceeds the {limit:.4g} that devices clipped to "
                       f"{self.clip:g} can give: a device sent values beyond its clip norm")
                out.append(GroupOutcome(devices, False, why, True))
            else:
                out.append(GroupOutcome(devices, True))
        self._outcomes = out
        return out

    def _weight(self, devices: Sequence[str]) -> float:
        """What a sum is divided by: sum(n_j / s) over its contributors, or m under distributed DP."""
        if self.expected_weight is not None:
            return self.expected_weight
        return sum(self.weights[d] for d in devices) / self.weight_scale

    def _limit(self, devices: Sequence[str]) -> float:
        """The largest L2 norm of the mean of `devices`' honest inputs."""
        assert self.server is not None
        config, weight, contributors = self.server.config, self._weight(devices), len(devices)
        signal = self.clip * (contributors / weight if self.expected_weight is not None else 1.0)  # DP: c over m
        step = 2 * config.clip / (2**config.value_bits - 1)  # nearest rounding: half a step per value and device
        quantization = contributors * step / 2 * np.sqrt(config.length) / weight
        noise = self.noise_std * math.sqrt(contributors) / weight * (np.sqrt(config.length) + 6)  # generously
        return signal + quantization + noise

    def released(self) -> list[str]:
        """The devices whose inputs are in the released model."""
        return [d for outcome in self.outcomes() if outcome.released for d in outcome.devices]

    def contributions(self) -> dict[str, tuple[int, dict[str, float]]]:
        """The devices in the released sum: their registered n_j and the metrics their update carried."""
        return {d: (self._contributions[d].n_samples, self._contributions[d].metrics) for d in self.released()}

    def model(self, manifest: Manifest, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The round's model: base + the n_j-weighted mean of the released groups' clipped deltas (distributed DP:
        their noisy sum over m on the trainable tensors, the others as they were); the base itself when no group
        is released."""
        assert self.result is not None
        out, start = {t.name: base[t.name].astype(t.dtype) for t in manifest.shared_tensors}, 0
        released = [g for g, outcome in zip(self.result.groups, self.outcomes(), strict=True) if outcome.released]
        if not released:
            return out
        mean = sum(g.sum for g in released) / self._weight(self.released())
        for t in manifest.summed_tensors(self.settings.tensors):
            size = int(np.prod(t.shape, dtype=np.int64))
            delta = mean[start : start + size].reshape(t.shape)
            out[t.name] = (base[t.name].astype(np.float64) + delta).astype(t.dtype)
            start += size
        return out

    def noise_multiplier(self) -> float:
        """The noise multiplier the released sum carries: std z * C * sqrt(c / m) over C, c the released
        contributors."""
        return self.noise_std * len(self.released()) ** 0.5 / self.clip
