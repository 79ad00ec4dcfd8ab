"""Secure aggregation on the device: one SecAgg+ session (docs/protocol.md, 6.9; docs/privacy.md).

The kernel (fedper.secagg) does the cryptography; this module turns the coordinator's relayed stage
messages into the device's answers. The clear update never leaves this object: the device computes its
delta from the round's model, clips it to L2 norm C (the session's quantization range, so no coordinate
is clipped again), weights it by n_j / weight_scale, and sends it only quantized and masked. Under
distributed DP the setup says so: the trainable tensors only, weight 1, and Gaussian noise of the setup's
std added on the device before quantizing (numpy's generator from fresh OS entropy). Every
message from the coordinator is checked before it is acted on: a setup for another session, another
vector length, a threshold below a majority of the neighbours (with which a coordinator could collect
both kinds of share of one device), a weight scale below this device's n_j, shares that fail AES-GCM, or
an unmask request for both kinds of share of one device (`UnmaskRefused`) are refused, and the device
sends nothing for that stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedper.manifest import Manifest, SummedTensors
from fedper.privacy import clip_delta
from fedper.secagg import DeviceKeys, SecAggClient, SecAggError, SecAggWire
from fedper.wire import (
    Message,
    Outgoing,
    SecAggNeighbours,
    SecAggShares,
    SecAggUnmaskRequest,
    Topics,
    UpdateMeta,
    chunk,
)


def clipped_delta(manifest: Manifest, update: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray],
                  clip_norm: float, tensors: SummedTensors = "shared") -> np.ndarray:
    """update - model over the summed tensors in manifest order, float64, flat, scaled to an L2 norm of at most
    clip_norm (so every value lies in [-clip_norm, clip_norm]): DP's clip_delta, as one vector."""
    names = [t.name for t in manifest.summed_tensors(tensors)]
    clipped = clip_delta(update, model, clip_norm, names)
    delta = np.concatenate([np.asarray(clipped[name]).reshape(-1) for name in names])
    if not np.isfinite(delta).all():
        raise SecAggError("the update has NaN or Inf values: nothing is sent")
    return delta


@dataclass
class SecureParticipant:
    """This device's side of one session. `handle` takes a relayed stage message and returns what to publish;
    SecAggError (or ValueError from the kernel's setup checks) refuses it."""

    topics: Topics
    device: str
    round: int
    session: int
    manifest: Manifest
    update: Mapping[str, np.ndarray] = field(repr=False)
    model: Mapping[str, np.ndarray] = field(repr=False)
    n_samples: int
    meta: UpdateMeta  # of the masked input's chunks (codec secagg)
    chunk_size: int
    keys: DeviceKeys = field(default_factory=DeviceKeys.generate, repr=False)
    client: SecAggClient | None = None
    _vector: np.ndarray | None = field(default=None, repr=False)

    @property
    def wire(self) -> SecAggWire:
        return SecAggWire(self.round, self.session)

    def advertise(self) -> Outgoing:
        """Stage 1: the two public keys, for the session RoundInfo named."""
        return Outgoing(self.topics.secagg(self.device), self.wire.advertise(self.keys.public()).encode())

    def handle(self, message: Message) -> list[Outgoing]:
        if (getattr(message, "round", None), getattr(message, "session", None)) != (self.round, self.session):
            raise SecAggError(f"a message for round {getattr(message, 'round', '?')} session "
                              f"{getattr(message, 'session', '?')}, this device is in round {self.round} session "
                              f"{self.session}")
        if isinstance(message, SecAggNeighbours):
            return [self._share_keys(message)]
        if self.client is None:
            raise SecAggError("a stage message before the session's setup")
        if isinstance(message, SecAggShares):
            return self._masked_input(message)
        if isinstance(message, SecAggUnmaskRequest):
            return [self._unmask(message)]
        raise SecAggError(f"{type(message).__name__} is not a message for a device")

    def _share_keys(self, message: SecAggNeighbours) -> Outgoing:
        """Stage 2: check the setup, then Shamir-share the self-mask seed and the mask key to the neighbours."""
        if self.client is not None:
            raise SecAggError("a second setup for the same session")
        config, neighbours, spec = self.wire.setup(message)  # ValueError if the setup is unsound
        if config.threshold <= config.degree // 2:
            raise SecAggError(f"threshold {config.threshold} is not a majority of {config.degree} neighbours: a "
                              "coordinator could then gather both kinds of share of one device")
        uniform = spec.weights == "uniform"
        if spec.weight_scale < self.n_samples and not uniform:
            raise SecAggError(f"weight scale {spec.weight_scale} is below this device's {self.n_samples} samples")
        clip_norm = config.clip if spec.clip_norm is None else spec.clip_norm
        if not (0 < clip_norm <= config.clip and spec.noise_std >= 0):
            raise SecAggError(f"clip norm {clip_norm} must be in (0, {config.clip}], noise std {spec.noise_std} >= 0")
        vector = clipped_delta(self.manifest, self.update, self.model, clip_norm, spec.tensors)
        if vector.size != config.length:
            raise SecAggError(f"the session sums {config.length} values, this device's shared tensors hold "
                              f"{vector.size}")
        client = SecAggClient(config, neighbours.device, self.keys)
        client.advertise()  # stage 1 was the advert this device sent before the setup existed
        bundle = client.share_keys(neighbours)
        vector = vector if uniform else vector * (self.n_samples / spec.weight_scale)
        if spec.noise_std > 0:  # distributed DP: this device's share of the noise (fresh entropy)
            vector = vector + np.random.default_rng().normal(0.0, spec.noise_std, vector.size)
        self.client, self._vector = client, vector
        return Outgoing(self.topics.secagg(self.device), self.wire.shares(bundle, upward=True).encode())

    def _masked_input(self, message: SecAggShares) -> list[Outgoing]:
        """Stage 3: the neighbours' shares (each must authenticate), then the masked input as update chunks."""
        assert self.client is not None and self._vector is not None
        bundle = self.wire.bundle(message, self.client.device, upward=False)
        masked = self.client.masked_input(bundle, self._vector)
        self._vector = None  # masked once: the clear vector is no longer needed
        frames = chunk(masked.to_safetensors(), self.chunk_size, f"r{self.round}-s{self.session}",
                       self.meta.to_dict())
        return [Outgoing(self.topics.update(self.device), frame) for frame in frames]

    def _unmask(self, message: SecAggUnmaskRequest) -> Outgoing:
        """Stage 4: the requested shares; both kinds for one device are refused (UnmaskRefused)."""
        assert self.client is not None
        response = self.client.unmask(self.wire.request(message, self.client.device))
        return Outgoing(self.topics.secagg(self.device), self.wire.unmask(response).encode())

