"""Secure aggregation on the device: one SecAgg+ session (docs/protocol.md, 6.9; docs/privacy.md).

The kernel (fedper.secagg) does the cryptography; this module turns the coordinator's relayed stage
messages into the device's answers. The clear update never leaves this object: the device computes its
delta from the round's model, clips it to an L2 norm within the session's quantization range [-C, C] (so
quantizing clips none of it), weights it by n_j / weight_scale, and sends it only quantized and masked. Under
distributed DP the setup says so: the trainable tensors only, weight 1, and Gaussian noise of the setup's
std added on the device before quantizing (numpy's generator from fresh OS entropy), which quantizing does
clip where it leaves [-C, C] (the coordinator widens C by 6 noise stds for it).

The device's identity (--identity: its Ed25519 key, the fleet root's certificate of it and the root's public
key, from deploy/provision-identity.sh) signs its advertised keys and the survivor set of the consistency check.
Every message from the coordinator is checked before it is acted on: a setup for another session, another
vector length, a threshold below a majority of the neighbours (with which a coordinator could collect both
kinds of share of one device), a weight scale below this device's n_j, a neighbour's advert that the fleet's
root does not vouch for, a survivor set too small to be signed by more than half of the session, or an unmask
request without such signatures on the set this device signed are refused, and the device sends nothing for
that stage. Shares that do not authenticate are reported, not refused. Once it has answered an unmask request
in a round, the device takes part in no other session of that round (`answered_round`, kept in its state
directory across restarts): two sums over the same saved update could be subtracted.

A device advertises keys once per (round, session), ever: the sessions it advertised in are written to its state
directory (fsynced) before the advert goes out, and a session already there, or a round older than the one there,
is refused, in this process or after a restart. The signed survivor message holds the setup's digest, and the
coordinator chooses the session id: without this, it could run a session again with the same id and roster
(5 -> 6 -> 5, or a device restarted), so the same setup digest, and hand devices of the second run the signatures
collected in the first on another survivor set (issue 39). Signing needs a setup for a session the participant
advertised in itself, so a device also signs once per (round, session).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedper.checkpoint import PRIVATE, atomic_write
from fedper.manifest import Manifest, SummedTensors
from fedper.privacy import clip_delta
from fedper.secagg import DeviceKeys, Identity, SecAggClient, SecAggConfig, SecAggError
from fedper.wire import (
    Message,
    Outgoing,
    SecAggMask,
    SecAggNeighbours,
    SecAggShares,
    SecAggSurvivors,
    SecAggUnmaskRequest,
    Topics,
    UpdateMeta,
    chunk,
)

ANSWERED_FILE = "secagg-answered.json"  # in the agent's state directory: the round it revealed shares in
ADVERTISED_FILE = "secagg-advertised.json"  # in the agent's state directory: the newest round it advertised keys
# in, and that round's sessions
SENT = {"neighbours": "shares sent", "shares": "shares received", "mask": "masked input sent",
        "consistency": "survivors signed", "unmask": "unmask shares sent"}  # what each relayed stage led to


def answered_round(state_dir: Path) -> tuple[int, str] | None:
    """(round, its model's sha256) of the last round this device answered an unmask request in; None if none."""
    try:
        body = json.loads((state_dir / ANSWERED_FILE).read_text())
        return int(body["round"]), str(body["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_session(state_dir: Path, round_: int, session: int) -> None:
    """Write down (fsynced) that this device advertises in `session` of `round_`, before it does; SecAggError for
    a session it advertised in already, or a round older than its newest (what a replaying coordinator asks)."""
    path = state_dir / ADVERTISED_FILE
    try:
        body = json.loads(path.read_text())
        newest, sessions = int(body["round"]), [int(s) for s in body["sessions"]]
    except FileNotFoundError:
        newest, sessions = 0, []
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SecAggError(f"{path} is unreadable ({e}): it takes part in no session until it is fixed or "
                          "removed") from None
    if round_ < newest or (session in sessions and round_ == newest):
        raise SecAggError(f"this device advertised keys in round {newest}"
                          f"{f' session {session}' if round_ == newest else ''} already: it advertises once per "
                          "session, and never in an older round (a second run of one session could reuse its "
                          "signatures)")
    sessions = [*sessions, session] if round_ == newest else [session]
    atomic_write(path, json.dumps({"round": round_, "sessions": sessions}).encode(), PRIVATE)


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
    identity_dir: Path | None  # --identity
    state_dir: Path  # where answered_round is kept
    model_sha256: str  # of the round's model: with the round, it names the round across runs
    keys: DeviceKeys = field(default_factory=DeviceKeys.generate, repr=False)
    client: SecAggClient | None = None
    _identity: Identity | None = field(default=None, repr=False)
    _vector: np.ndarray | None = field(default=None, repr=False)

    @property
    def answered(self) -> bool:
        """Whether this device revealed shares in this round (in this session or an earlier one)."""
        return answered_round(self.state_dir) == (self.round, self.model_sha256)

    def advertise(self) -> Outgoing:
        """Stage 1: the two public keys for the session RoundInfo named, signed by the device's identity.
        SecAggError without a usable identity, or once the device answered an unmask request in this round."""
        if self.answered:
            raise SecAggError(f"this device revealed shares in round {self.round} already: it takes part in no "
                              "other session of the round (two sums could be subtracted)")
        if self.identity_dir is None:
            raise SecAggError("secure aggregation needs the device's identity: --identity DIR "
                              "(deploy/provision-identity.sh)")
        self._identity = Identity.load(self.identity_dir)
        if self._identity.name != self.device:
            raise SecAggError(f"the identity in {self.identity_dir} is {self._identity.name}'s, not {self.device}'s")
        claim_session(self.state_dir, self.round, self.session)
        advert = self.keys.advert(self._identity, self.round, self.session)
        return Outgoing(self.topics.secagg(self.device), advert.encode())

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
            return [Outgoing(self.topics.secagg(self.device), self.client.receive_shares(message).encode())]
        if isinstance(message, SecAggMask):
            return self._masked_input(message)
        if isinstance(message, SecAggSurvivors):
            return [Outgoing(self.topics.secagg(self.device), self.client.sign_survivors(message).encode())]
        if isinstance(message, SecAggUnmaskRequest):
            return [self._unmask(message)]
        raise SecAggError(f"{type(message).__name__} is not a message for a device")

    def _share_keys(self, message: SecAggNeighbours) -> Outgoing:
        """Stage 2: check the setup, then Shamir-share the self-mask seed and the mask key to the neighbours."""
        if self.client is not None or self._identity is None:
            raise SecAggError("a setup for a session this device did not advertise in, or a second one")
        config = SecAggConfig.of(message)  # ValueError if the setup is unsound
        if config.threshold <= config.degree // 2:
            raise SecAggError(f"threshold {config.threshold} is not a majority of {config.degree} neighbours: a "
                              "coordinator could then gather both kinds of share of one device")
        uniform = message.weights == "uniform"
        if message.weight_scale < self.n_samples and not uniform:
            raise SecAggError(f"weight scale {message.weight_scale} is below this device's {self.n_samples} samples")
        clip_norm = config.clip if message.clip_norm is None else message.clip_norm
        if not (0 < clip_norm <= config.clip and message.noise_std >= 0):
            raise SecAggError(f"clip norm {clip_norm} must be in (0, {config.clip}], noise std {message.noise_std} "
                              ">= 0")
        vector = clipped_delta(self.manifest, self.update, self.model, clip_norm, message.tensors)
        if vector.size != config.length:
            raise SecAggError(f"the session sums {config.length} values, this device's shared tensors hold "
                              f"{vector.size}")
        client = SecAggClient(config, message.index, self._identity, self.keys)
        client.advertise()  # stage 1 was the advert this device sent before the setup existed
        shares = client.share_keys(message)
        vector = vector if uniform else vector * (self.n_samples / message.weight_scale)
        if message.noise_std > 0:  # distributed DP: this device's share of the noise (fresh entropy)
            vector = vector + np.random.default_rng().normal(0.0, message.noise_std, vector.size)
        self.client, self._vector = client, vector
        return Outgoing(self.topics.secagg(self.device), shares.encode())

    def _masked_input(self, message: SecAggMask) -> list[Outgoing]:
        """Stage 4: the masked input as update chunks, masked with none of the excluded neighbours."""
        assert self.client is not None and self._vector is not None
        masked = self.client.masked_input(message, self._vector)
        self._vector = None  # masked once: the clear vector is no longer needed
        frames = chunk(masked.to_safetensors(), self.chunk_size, f"r{self.round}-s{self.session}",
                       self.meta.to_dict())
        return [Outgoing(self.topics.update(self.device), frame) for frame in frames]

    def _unmask(self, message: SecAggUnmaskRequest) -> Outgoing:
        """Stage 6: the shares, given the signatures of more than half of the session on the survivors this device
        signed (UnmaskRefused otherwise). The round is written down as answered before the shares go out."""
        assert self.client is not None
        response = self.client.unmask(message)
        atomic_write(self.state_dir / ANSWERED_FILE, json.dumps({"round": self.round,
                                                                 "model": self.model_sha256}).encode(), PRIVATE)
        return Outgoing(self.topics.secagg(self.device), response.encode())

