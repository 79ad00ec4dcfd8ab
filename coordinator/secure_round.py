"""Secure aggregation at the coordinator (`--secure-aggregation`): one SecAgg+ session over MQTT.

The kernel (fedper.secagg) does the cryptography; this module runs its server's four stages on messages
that arrive one at a time from untrusted devices, each stage with a deadline, checking every message on
its own so that a bad one is refused (`secagg`) without costing another device its place. The strategy
that drives it is coordinator/strategies/secure.py. Stages, weights and distributed DP: docs/privacy.md
("Secure aggregation"); messages: docs/protocol.md, 6.9.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from fedper.manifest import Manifest, SummedTensors
from fedper.secagg import (
    AggregateResult,
    EncryptedShares,
    KeyAdvert,
    MaskedInput,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    SecAggWire,
    UnmaskResponse,
    VectorSpec,
    usable_public_key,
)
from fedper.wire import (
    MAX_JSON_INT,
    MAX_SECAGG_DEVICES,
    Outgoing,
    SecAggAdvertise,
    SecAggShares,
    SecAggUnmask,
    Topics,
    WireError,
)

log = logging.getLogger("fedper.coordinator")


def new_session() -> int:
    """A session number no earlier session of the run is likely to have had (keys are derived per session)."""
    return 1 + secrets.randbelow(MAX_JSON_INT - 1)


class Stage(str, Enum):
    """Where a session is: its four stages in order, then done or failed. A str, as the state message shows it."""

    ADVERTISE = "advertise"
    SHARES = "shares"
    MASKED = "masked"
    UNMASK = "unmask"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


def flat_length(manifest: Manifest, tensors: SummedTensors = "shared") -> int:
    """Values of the vector a device masks."""
    return sum(int(np.prod(t.shape, dtype=np.int64)) for t in manifest.summed_tensors(tensors))


@dataclass
class _Contribution:
    n_samples: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class SecureSettings:
    """What a session runs with, fixed when it opens (from the coordinator's configuration and manifest)."""

    clip: float  # C: the L2 norm a device clips its delta to, and (without noise) the quantization range
    length: int  # values of the vector a device masks: flat_length(manifest, tensors)
    stage_timeout: float  # seconds each of stages 2-4 waits
    degree: int | None = None  # k; None: fedper.secagg's default (at most MAX_SECAGG_NEIGHBOURS, checked by Config)
    tensors: SummedTensors = "shared"  # which tensors the vector holds: "shared", or "trainable" under DP


@dataclass(frozen=True)
class DistributedNoise:
    """Distributed DP for one session, decided when its stage 1 closes (the fleet may have grown since it opened):
    the noise multiplier z and m, the devices a round expects (the fixed denominator, uniform weights)."""

    noise_multiplier: float
    expected_weight: float


@dataclass
class SecureRound:
    """One session of one round; `stage` says where it is."""

    round: int
    session: int
    settings: SecureSettings
    noise: DistributedNoise | None = None  # given to close_adverts; None: clear sums weighted by n_j
    stage: Stage = Stage.ADVERTISE
    deadline: float = 0.0  # of stages 2-4 (stage 1 closes at the round's deadline, decided by the engine)
    adverts: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # device -> (c, s) public keys
    roster: tuple[str, ...] = ()  # index -> device, fixed when stage 1 closes
    weight_scale: int = 1
    weights: dict[str, int] = field(default_factory=dict)  # device -> registered n_j, fixed with the roster
    server: SecAggServer | None = None
    _bundles: dict[int, EncryptedShares] = field(default_factory=dict)
    _expected: set[int] = field(default_factory=set)  # indices that may still answer the open stage
    _masked: dict[int, MaskedInput] = field(default_factory=dict)
    _contributions: dict[str, _Contribution] = field(default_factory=dict)
    _responses: dict[int, UnmaskResponse] = field(default_factory=dict)
    result: AggregateResult | None = None
    failure: str = ""
    refused_sum: str = ""  # why the sum was not released (the check on the sum); "": released

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

    def on_message(self, device: str, message: SecAggAdvertise | SecAggShares | SecAggUnmask) -> None:
        """One decoded stage message from `device`; WireError("secagg" or "bad_message") refuses it."""
        if (message.round, message.session) != (self.round, self.session):
            raise WireError("secagg", f"message for round {message.round} session {message.session}, the open one "
                            f"is round {self.round} session {self.session}")
        if isinstance(message, SecAggAdvertise):
            self._on_advert(device, message)
        elif isinstance(message, SecAggShares):
            self._on_shares(device, message)
        else:
            self._on_unmask(device, message)

    @property
    def wire(self) -> SecAggWire:
        return SecAggWire(self.round, self.session)

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
        keys = self.wire.keys(message)
        if keys[0] == keys[1] or any(k in other for d, other in self.adverts.items() if d != device for k in keys):
            raise WireError("secagg", "public keys must be distinct, and not another device's")
        if not all(usable_public_key(k) for k in keys):
            raise WireError("secagg", "a public key is a low-order X25519 point: it agrees on no secret")
        self.adverts[device] = keys  # a device that restarted in this stage replaces its keys

    def _on_shares(self, device: str, message: SecAggShares) -> None:
        index = self._index(device, Stage.SHARES)
        bundle = self.wire.bundle(message, index, upward=True)
        assert self.server is not None
        self._refused_by_kernel(self.server.check_shares, bundle)
        self._bundles[index] = bundle
        self._expected.discard(index)

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

    def _on_unmask(self, device: str, message: SecAggUnmask) -> None:
        index = self._index(device, Stage.UNMASK)
        response = self.wire.response(message, index)
        assert self.server is not None
        self._refused_by_kernel(self.server.check_response, response)
        self._responses[index] = response
        self._expected.discard(index)

    @staticmethod
    def _refused_by_kernel(check: object, message: object) -> None:
        try:
            check(message)  # type: ignore[operator]
        except SecAggError as e:
            raise WireError("secagg", str(e)) from None

    # ------------------------------------------------------------ stages

    @property
    def complete(self) -> bool:
        """Every device expected in the open stage (2-4) answered: close it now."""
        return self.stage in (Stage.SHARES, Stage.MASKED, Stage.UNMASK) and not self._expected

    def close_adverts(self, registered: Mapping[str, int], now: float, topics: Topics,
                      noise: DistributedNoise | None = None) -> list[Outgoing]:
        """Stage 1 -> 2: the advertisers (still registered) become the roster; each gets its setup and its
        advertising neighbours' keys (and, with `noise`, its share of the noise)."""
        self.noise = noise
        self.roster = tuple(sorted(d for d in self.adverts if d in registered))[:MAX_SECAGG_DEVICES]
        if len(self.roster) < 2:
            return self._fail(f"{len(self.roster)} device(s) advertised keys: a sum needs at least 2")
        self.weights = {d: registered[d] for d in self.roster}
        self.weight_scale = max(self.weights.values())
        config = SecAggConfig.create(round=self.session, devices=len(self.roster), length=self.settings.length,
                                     clip=self.clip + 6 * self.noise_std, degree=self.settings.degree,
                                     graph_seed=secrets.randbits(32))
        self.server = SecAggServer(config)
        keys = self.server.neighbour_keys([KeyAdvert(self.session, i, *self.adverts[d])
                                           for i, d in enumerate(self.roster)])
        spec = VectorSpec(self.weight_scale, self.clip, self.noise_std,
                          "samples" if self.noise is None else "uniform", self.settings.tensors)
        out = [Outgoing(topics.relay(self.roster[index]), self.wire.neighbours(config, neighbours, spec).encode())
               for index, neighbours in keys.items()]
        log.info("round %d: secure aggregation session %d: %d device(s), k %d, t %d, %d-bit values", self.round,
                 self.session, config.devices, config.degree, config.threshold, config.value_bits)
        return self._next(Stage.SHARES, set(range(len(self.roster))), now, out)

    def close_open_stage(self, now: float, topics: Topics, minimum: int) -> list[Outgoing]:
        """Close stage 2, 3 or 4 (all answered, or its deadline passed): relay, request, or aggregate."""
        assert self.server is not None
        try:
            if self.stage == Stage.SHARES:
                if len(self._bundles) < minimum:
                    return self._fail(f"{len(self._bundles)} device(s) shared keys, fewer than {minimum}")
                inbox = self.server.relay_shares(self._bundles.values())
                out = [Outgoing(topics.relay(self.roster[u]), self.wire.shares(m, upward=False).encode())
                       for u, m in inbox.items()]
                return self._next(Stage.MASKED, set(inbox), now, out)
            if self.stage == Stage.MASKED:
                if len(self._masked) < minimum:
                    return self._fail(f"{len(self._masked)} masked input(s), fewer than {minimum}")
                requests = self.server.unmask_requests(self._masked.values())
                self._masked.clear()  # summed by the server
                out = [Outgoing(topics.relay(self.roster[u]), self.wire.unmask_request(r).encode())
                       for u, r in requests.items()]
                return self._next(Stage.UNMASK, set(requests), now, out)
            self.result = self.server.aggregate(self._responses.values())
            self.stage = Stage.DONE
            return []
        except (SecAggError, ValueError) as e:  # NotEnoughShares, a reconstruction that does not check out, a bad key
            return self._fail(str(e))

    def _next(self, stage: Stage, expected: set[int], now: float, out: list[Outgoing]) -> list[Outgoing]:
        self.stage, self._expected, self.deadline = stage, expected, now + self.settings.stage_timeout
        return out

    def _fail(self, why: str) -> list[Outgoing]:
        self.stage, self.failure = Stage.FAILED, why
        log.warning("round %d: secure aggregation session %d failed: %s", self.round, self.session, why)
        return []

    # ------------------------------------------------------------ the result

    def contributions(self) -> dict[str, tuple[int, dict[str, float]]]:
        """The devices in the sum: their registered n_j and the metrics their update carried."""
        assert self.result is not None
        return {self.roster[u]: (c.n_samples, c.metrics) for u in self.result.survivors
                for c in [self._contributions[self.roster[u]]]}

    def _weight(self) -> float:
        """What the sum is divided by: sum(n_j / s) over the contributors, or m under distributed DP."""
        assert self.result is not None
        if self.expected_weight is not None:
            return self.expected_weight
        return sum(self.weights[self.roster[u]] for u in self.result.survivors) / self.weight_scale

    def check_sum(self) -> str:
        """The per-update norm check, moved to the sum: honest devices' deltas each have an L2 norm of at most C,
        so their weighted mean has too (plus the quantization's error and, under DP, the noise's norm). A mean
        beyond that means a device sent values beyond its clip norm (each value is only bounded by the
        quantization range): "" when the sum passes, else why it does not (the round then releases nothing)."""
        assert self.result is not None and self.server is not None
        config, weight, contributors = self.server.config, self._weight(), len(self.result.survivors)
        signal = self.clip * (contributors / weight if self.expected_weight is not None else 1.0)  # DP: c over m
        step = 2 * config.clip / (2**config.value_bits - 1)  # nearest rounding: half a step per value and device
        quantization = contributors * step / 2 * np.sqrt(config.length) / weight
        noise = self.noise_multiplier() * self.clip / weight * (np.sqrt(config.length) + 6)  # its norm, generously
        limit = signal + quantization + noise
        norm = float(np.linalg.norm(self.result.sum)) / weight
        if norm <= limit:
            return ""
        self.refused_sum = (f"the mean delta's L2 norm {norm:.4g} exceeds the {limit:.4g} that devices clipped to "
                            f"{self.clip:g} can give: a device sent values beyond its clip norm")
        return self.refused_sum

    def model(self, manifest: Manifest, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The round's model: base + the n_j-weighted mean of the contributors' clipped deltas (distributed DP:
        their noisy sum over m on the trainable tensors, the others as they were); the base itself when the sum
        failed its check."""
        assert self.result is not None
        out, start = {t.name: base[t.name].astype(t.dtype) for t in manifest.shared_tensors}, 0
        if self.refused_sum:
            return out
        mean = self.result.sum / self._weight()
        for t in manifest.summed_tensors(self.settings.tensors):
            size = int(np.prod(t.shape, dtype=np.int64))
            delta = mean[start : start + size].reshape(t.shape)
            out[t.name] = (base[t.name].astype(np.float64) + delta).astype(t.dtype)
            start += size
        return out

    def noise_multiplier(self) -> float:
        """The noise multiplier the released sum carries: std z * C * sqrt(c / m) over C, c the contributors."""
        assert self.result is not None
        return self.noise_std * len(self.result.survivors) ** 0.5 / self.clip
