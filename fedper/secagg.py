"""Secure aggregation (SecAgg+): the coordinator learns the sum of the devices' quantized updates and
nothing about any one of them, even when devices drop out mid-round.

The protocol is SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead"), the sparse-graph form of SecAgg (Bonawitz et al., CCS
2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning"). This module is its pure
kernel: explicit stages, one client object per device and one server object per round, and `SecAggWire`,
the one converter between its messages and fedper.wire's (the masked vector travels as safetensors). It
does no I/O: the transport (MQTT, relayed by the coordinator) is fedper.coordinator.secure_round and
fedper.edge.secure_round. Every primitive comes from `cryptography` (the `privacy` extra): X25519 key
agreement, HKDF-SHA256, AES-256-GCM for the shares, AES-256-CTR as the mask generator. Shamir sharing
is plain modular arithmetic over the Mersenne prime 2**521 - 1, large enough to share a 32-byte secret in one piece.

Stages (a device missing from a stage has dropped out; the server never waits for it):

0. Setup (`SecAggConfig`): n devices with indices 0..n-1 (the coordinator maps its device names to
   them), the vector length, the clipping range, and a k-regular neighbour graph: the devices placed
   on a ring in a seeded random order, each joined to the k/2 nearest on either side (a random Harary
   graph, as in Bell et al.); k = n - 1 gives the complete graph of the original SecAgg. The default k
   is 2 * ceil(1.5 * log2 n), so a device's cost grows as O(log n), and the default threshold is
   t = floor(k/2) + 1, a majority of the neighbours: the smallest t at which honest devices, each
   revealing one kind of share per neighbour, keep a server from collecting both kinds for a device.
   That default suits light dropout; `degree_for` gives the k that a majority threshold needs for a
   given dropout rate (heavy dropout needs a large k).
1. Advertise keys: each device makes two fresh X25519 pairs, c (share encryption) and s (masks).
2. Share keys: each device draws a self-mask seed b, Shamir-shares b and its s private key among the
   neighbours that advertised (threshold t), and encrypts each neighbour's pair of shares with AES-GCM
   under a key derived from their c agreement; the associated data binds round, sender and receiver.
3. Masked input: the device quantizes its clipped vector to integers mod 2**32 and adds PRG(b) and, for
   each neighbour v whose shares it received, +PRG(k_uv) if u < v else -PRG(k_uv), with k_uv derived
   from the s agreement; the pairwise masks cancel in the sum.
4. Unmask: for each neighbour the server asks either the share of b (the neighbour's masked input
   arrived) or the share of its s key (it dropped after stage 2). An honest device never reveals both
   kinds for one device, in one request or across requests (`UnmaskRefused`): with both, the server
   could strip every mask from that device's input.
Then the server reconstructs each survivor's b and each dropped device's s key from t shares, removes
those masks, and dequantizes the sum.

Quantization. Each coordinate is clipped to [-clip, clip] and mapped to an integer in [0, 2**value_bits
- 1] with scale (2**value_bits - 1) / (2 * clip), by nearest rounding (error at most 1/(2 scale) per
coordinate and device) or, given a generator, unbiased stochastic rounding (error below 1/scale).
value_bits defaults to 32 - ceil(log2 n), so the sum of n devices' values stays below 2**32 and the
modular sum is the exact integer sum. Non-finite values are refused on the device: the clear update is
only ever seen there, so the checks that need it (NaN, norm clipping) move to the device.

Threat model. Honest-but-curious server, or a server that actively asks for both kinds of shares (the
devices refuse). Not covered: devices that send wrong shares or malformed inputs (the server cannot
tell; no robust reconstruction), a server that lies about who dropped to different devices beyond the
one-kind rule, and the choice of the graph seed (public and chosen by the server here; against a
malicious server it should come from a joint coin). Dropout: the round closes as long as every
survivor and every device dropped after stage 2 keeps t neighbours that answer stage 4; otherwise
`NotEnoughShares` names the device.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedper.manifest import SummedTensors
from fedper.payload import safetensors_metadata
from fedper.wire import (
    SecAggAdvertise,
    SecAggNeighbours,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskRequest,
    WireError,
)

PRIME = 2**521 - 1  # Shamir's field: a Mersenne prime above any 32-byte secret
SHARE_BYTES = (PRIME.bit_length() + 7) // 8
MODULUS_BITS = 32  # masked vectors are uint32: arithmetic mod 2**32 is numpy's own wrap-around
SECRET_BYTES = 32  # a self-mask seed, an X25519 private key
PROTOCOL = b"fedper-secagg/1"
# Byte sizes of what crosses the wire (fedper.wire bounds their base64; docs/protocol.md, 6.9 states them).
KEY_BYTES = 32  # an X25519 public key
NONCE_BYTES = 12  # AES-GCM's nonce
TAG_BYTES = 16  # AES-GCM's tag
SHARE_PLAINTEXT_BYTES = 8 + 2 * SHARE_BYTES  # sender and receiver (u32 each), the seed share and the key share
SEALED_SHARE_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES  # nonce || AES-GCM ciphertext and tag


class SecAggError(Exception):
    """A message that breaks the protocol (wrong round, stage, sender, size): the round cannot use it."""


class UnmaskRefused(SecAggError):
    """The server asked for both the self-mask share and the key share of one device."""


class ShareDecryptionError(SecAggError):
    """An encrypted share failed AES-GCM authentication: tampered, misaddressed or from another round."""


class NotEnoughShares(SecAggError):
    """Fewer than t shares for a secret: the round cannot close (too many devices dropped)."""

    def __init__(self, device: int, kind: str, got: int, threshold: int) -> None:
        super().__init__(f"device {device}: {got} {kind} shares, {threshold} needed")
        self.device, self.kind = device, kind


# ---------------------------------------------------------------- arithmetic: Shamir, quantization, graph


def shamir_split(secret: int, threshold: int, xs: Sequence[int]) -> dict[int, int]:
    """Shares f(x) for each x in xs of a random polynomial of degree threshold - 1 with f(0) = secret:
    any threshold of them give the secret back, fewer are uniformly random and independent of it."""
    if not 0 <= secret < PRIME:
        raise ValueError("secret outside the field")
    if not 1 <= threshold <= len(xs) or len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
        raise ValueError(f"need {threshold} <= {len(xs)} distinct nonzero share points")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        value = 0
        for c in reversed(coefficients):  # Horner
            value = (value * x + c) % PRIME
        shares[x] = value
    return shares


def shamir_combine(shares: dict[int, int]) -> int:
    """Lagrange interpolation at 0 through the given points. With fewer points than the threshold the
    result is a field element unrelated to the secret (see `reconstruct`, which refuses that)."""
    secret = 0
    for xi, yi in shares.items():
        numerator, denominator = 1, 1
        for xj in shares:
            if xj != xi:
                numerator = numerator * -xj % PRIME
                denominator = denominator * (xi - xj) % PRIME
        secret = (secret + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    return secret


def reconstruct(shares: dict[int, int], threshold: int, device: int, kind: str) -> int:
    """The secret from the first `threshold` shares; fewer is `NotEnoughShares`."""
    if len(shares) < threshold:
        raise NotEnoughShares(device, kind, len(shares), threshold)
    return shamir_combine({x: shares[x] for x in sorted(shares)[:threshold]})


def default_value_bits(devices: int) -> int:
    """Bits per device value so that the sum of `devices` values fits in MODULUS_BITS without wrapping."""
    return MODULUS_BITS - math.ceil(math.log2(devices))


def quantization_scale(clip: float, value_bits: int) -> float:
    return (2**value_bits - 1) / (2 * clip)


def quantize(values: np.ndarray, clip: float, value_bits: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Clipped to [-clip, clip], mapped onto [0, 2**value_bits - 1] as uint32: nearest rounding, or
    unbiased stochastic rounding with `rng`. Non-finite values are refused."""
    values = np.asarray(values, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("the update has NaN or Inf values")
    scaled = (np.clip(values, -clip, clip) + clip) * quantization_scale(clip, value_bits)
    rounded = np.floor(scaled + rng.random(scaled.shape)) if rng is not None else np.rint(scaled)
    return np.minimum(rounded, 2**value_bits - 1).astype(np.uint32)


def dequantize(total: np.ndarray, clip: float, value_bits: int, count: int) -> np.ndarray:
    """The float64 sum of `count` devices' clipped values from the exact integer sum of their quantized ones."""
    return total.astype(np.float64) / quantization_scale(clip, value_bits) - count * clip


def default_degree(devices: int) -> int:
    """k = 2 * ceil(1.5 * log2 n), the complete graph (n - 1) when that is smaller."""
    return min(devices - 1, 2 * math.ceil(1.5 * math.log2(devices)))


def degree_for(devices: int, dropout: float, failure: float = 1e-3) -> int:
    """The smallest even k (or n - 1, the complete graph) at which, with the default majority threshold
    and each device silent in stage 4 with probability `dropout` independently, the chance that some
    neighbourhood keeps fewer than t answering devices is at most `failure` (a union bound over the n
    neighbourhoods, each Binomial(k, 1 - dropout))."""
    if not 0 <= dropout < 1 or not 0 < failure < 1:
        raise ValueError("need 0 <= dropout < 1 and 0 < failure < 1")
    for degree in range(2, devices - 1, 2):
        threshold = degree // 2 + 1
        short = sum(math.comb(degree, i) * (1 - dropout) ** i * dropout ** (degree - i) for i in range(threshold))
        if devices * short <= failure:
            return degree
    return devices - 1


def neighbour_graph(devices: int, degree: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Each device's neighbours in a random Harary graph: a seeded random ring order, each device joined to
    the degree/2 nearest on either side (degree >= n - 1: everyone)."""
    if degree >= devices - 1:
        return tuple(tuple(v for v in range(devices) if v != u) for u in range(devices))
    if degree < 2 or degree % 2:
        raise ValueError(f"a sparse graph needs an even degree >= 2, got {degree}")
    order = np.random.default_rng(seed).permutation(devices)
    position = np.empty(devices, dtype=np.int64)
    position[order] = np.arange(devices)
    half = degree // 2
    return tuple(tuple(sorted(int(order[(position[u] + step) % devices]) for step in range(-half, half + 1) if step))
                 for u in range(devices))


# ---------------------------------------------------------------- primitives from `cryptography`


def prg(key: bytes, length: int) -> np.ndarray:
    """`length` pseudorandom uint32 values: AES-256-CTR keystream under `key` (each key masks one vector)."""
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * length)) + encryptor.finalize(), dtype="<u4")


def _derive(shared_secret: bytes, purpose: bytes, round_id: int) -> bytes:
    info = PROTOCOL + b" " + purpose + struct.pack(">Q", round_id)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared_secret)


def usable_public_key(public: bytes) -> bool:
    """Whether an advertised X25519 key agrees with a fresh key: a low-order point (all zeros, say)
    gives no shared secret, and would make every neighbour of its device fail later in the session."""
    try:
        _agree(X25519PrivateKey.generate(), public)
    except ValueError:
        return False
    return True


def _agree(private: X25519PrivateKey, public: bytes) -> bytes:
    return private.exchange(X25519PublicKey.from_public_bytes(public))


def _share_aad(round_id: int, sender: int, receiver: int) -> bytes:
    return PROTOCOL + struct.pack(">QII", round_id, sender, receiver)


def _apply_pairwise(total: np.ndarray, mask: np.ndarray, me: int, other: int, sign: int = 1) -> None:
    """The pairwise rule: the smaller index adds the mask, the larger subtracts it (sign=-1 undoes it)."""
    if (me < other) == (sign > 0):
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class SecAggConfig:
    """Stage 0, sent by the server with the round: who takes part and how the vector is encoded."""

    round: int
    devices: int
    length: int
    clip: float
    degree: int
    threshold: int
    value_bits: int
    graph_seed: int

    @classmethod
    def create(cls, round: int, devices: int, length: int, clip: float, degree: int | None = None,
               threshold: int | None = None, graph_seed: int = 0) -> SecAggConfig:
        degree = default_degree(devices) if degree is None else min(degree, devices - 1)
        return cls(round, devices, length, clip, degree, degree // 2 + 1 if threshold is None else threshold,
                   default_value_bits(devices), graph_seed)

    def __post_init__(self) -> None:
        if self.devices < 2 or self.length < 1 or not self.clip > 0:
            raise ValueError("need >= 2 devices, a non-empty vector and a positive clipping range")
        if not 1 <= self.threshold <= self.degree:
            raise ValueError(f"threshold {self.threshold} outside 1..{self.degree}")
        if not 1 <= self.value_bits <= default_value_bits(self.devices):
            raise ValueError(f"{self.value_bits}-bit values of {self.devices} devices could overflow 2**32")

    @cached_property
    def graph(self) -> tuple[tuple[int, ...], ...]:
        return neighbour_graph(self.devices, self.degree, self.graph_seed)

    def neighbours(self, device: int) -> tuple[int, ...]:
        return self.graph[device]


@dataclass(frozen=True)
class KeyAdvert:
    """Stage 1, device -> server: the device's two public keys for this round."""

    round: int
    device: int
    c_public: bytes
    s_public: bytes


@dataclass(frozen=True)
class NeighbourKeys:
    """Stage 1, server -> device: the adverts of the device's neighbours that advertised."""

    round: int
    device: int
    adverts: tuple[KeyAdvert, ...]


@dataclass(frozen=True)
class EncryptedShare:
    """One neighbour's pair of shares (of b and of the s key), AES-GCM encrypted from sender to receiver."""

    sender: int
    receiver: int
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class EncryptedShares:
    """Stage 2: device -> server, the shares it sends (device = sender); server -> device, the shares
    addressed to it (device = receiver)."""

    round: int
    device: int
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class MaskedInput:
    """Stage 3, device -> server: the quantized vector plus its masks, uint32 (4 bytes a value, as fp32)."""

    round: int
    device: int
    masked: np.ndarray = field(repr=False)

    def to_safetensors(self) -> bytes:
        """The wire form of the vector: one U32 tensor, round and device in the metadata."""
        return st_save({"masked": np.ascontiguousarray(self.masked, dtype="<u4")},
                       metadata={"round": str(self.round), "device": str(self.device)})

    @classmethod
    def from_safetensors(cls, blob: bytes) -> MaskedInput:
        try:
            arrays = st_load(blob)
            metadata = safetensors_metadata(blob)
            masked = arrays["masked"]
            if masked.dtype != np.uint32 or masked.ndim != 1:
                raise SecAggError("the masked vector must be one-dimensional uint32")
            return cls(int(metadata["round"]), int(metadata["device"]), masked)
        except (SafetensorError, KeyError, ValueError) as e:
            raise SecAggError(f"not a masked-input blob: {e}") from None


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4, server -> device: which neighbours' self-mask shares (survivors) and which neighbours' key
    shares (dropped after stage 2) it must reveal."""

    round: int
    device: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class UnmaskResponse:
    """Stage 4, device -> server: the requested shares, keyed by the device whose secret they share."""

    round: int
    device: int
    seed_shares: dict[int, bytes]
    key_shares: dict[int, bytes]


@dataclass(frozen=True)
class AggregateResult:
    """What the server learns: who was summed, the exact integer sum, and its dequantized float64 form."""

    survivors: tuple[int, ...]
    total: np.ndarray = field(repr=False)
    sum: np.ndarray = field(repr=False)


# ---------------------------------------------------------------- the wire form (docs/protocol.md, 6.9)


@dataclass(frozen=True)
class VectorSpec:
    """How a device makes the vector it masks, sent with its setup: the tensors (every shared one, or the
    trainable ones under distributed DP), the L2 norm its delta is clipped to (None: the setup's clip), its
    weight (n_j / weight_scale, or 1 with uniform weights) and the std of the Gaussian noise it adds."""

    weight_scale: int = 1
    clip_norm: float | None = None
    noise_std: float = 0.0
    weights: Literal["samples", "uniform"] = "samples"
    tensors: SummedTensors = "shared"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, size: int, what: str) -> bytes:
    """The bytes of base64 `text`, exactly `size` of them (the wire bounded only its length and alphabet)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireError("bad_message", f"{what} is not base64") from None
    if len(data) != size:
        raise WireError("bad_message", f"{what} holds {len(data)} bytes, not {size}")
    return data


@dataclass(frozen=True)
class SecAggWire:
    """The kernel's messages <-> fedper.wire's stage messages of one session, both ways: the one translation
    the coordinator, the device and the tests use. The kernel's round is the session; the wire carries the
    RoundInfo round beside it, names a message's sender by its topic and a peer by its index (a map's key).
    Decoding checks base64 and byte sizes (WireError "bad_message"); the protocol's rules are the kernel's.
    The masked input travels as MaskedInput.to_safetensors, in an update's chunks."""

    round: int
    session: int

    def advertise(self, keys: tuple[bytes, bytes]) -> SecAggAdvertise:
        """Stage 1, up: a device's (c, s) public keys."""
        return SecAggAdvertise(self.round, self.session, _b64(keys[0]), _b64(keys[1]))

    def keys(self, message: SecAggAdvertise) -> tuple[bytes, bytes]:
        return _unb64(message.c_public, KEY_BYTES, "c_public"), _unb64(message.s_public, KEY_BYTES, "s_public")

    def neighbours(self, config: SecAggConfig, keys: NeighbourKeys, spec: VectorSpec) -> SecAggNeighbours:
        """Stage 1 -> 2, down: device `keys.device`'s setup and its advertising neighbours' keys."""
        return SecAggNeighbours(
            round=self.round, session=self.session, devices=config.devices, index=keys.device, length=config.length,
            clip=config.clip, degree=config.degree, threshold=config.threshold, value_bits=config.value_bits,
            graph_seed=config.graph_seed, weight_scale=spec.weight_scale,
            adverts={str(a.device): _b64(a.c_public + a.s_public) for a in keys.adverts},
            clip_norm=spec.clip_norm, noise_std=spec.noise_std, weights=spec.weights, tensors=spec.tensors)

    def setup(self, message: SecAggNeighbours) -> tuple[SecAggConfig, NeighbourKeys, VectorSpec]:
        """The setup a device got; ValueError when it is unsound (SecAggConfig's checks)."""
        config = SecAggConfig(self.session, message.devices, message.length, message.clip, message.degree,
                              message.threshold, message.value_bits, message.graph_seed)
        adverts = []
        for key, text in message.adverts.items():
            pair = _unb64(text, 2 * KEY_BYTES, f"neighbour {key}'s keys")
            adverts.append(KeyAdvert(self.session, int(key), pair[:KEY_BYTES], pair[KEY_BYTES:]))
        spec = VectorSpec(message.weight_scale, message.clip_norm, message.noise_std, message.weights, message.tensors)
        return config, NeighbourKeys(self.session, message.index, tuple(adverts)), spec

    def shares(self, bundle: EncryptedShares, *, upward: bool) -> SecAggShares:
        """Stage 2: up, a device's shares keyed by receiver; down, those relayed to `bundle.device`, by sender."""
        sealed = {str(s.receiver if upward else s.sender): _b64(s.nonce + s.ciphertext) for s in bundle.shares}
        return SecAggShares(self.round, self.session, sealed)

    def bundle(self, message: SecAggShares, device: int, *, upward: bool) -> EncryptedShares:
        """The shares `device` sent (upward) or gets, as the kernel's bundle."""
        shares = []
        for key, text in message.shares.items():
            sealed = _unb64(text, SEALED_SHARE_BYTES, f"share for {key}")
            sender, receiver = (device, int(key)) if upward else (int(key), device)
            shares.append(EncryptedShare(sender, receiver, sealed[:NONCE_BYTES], sealed[NONCE_BYTES:]))
        return EncryptedShares(self.session, device, tuple(shares))

    def unmask_request(self, request: UnmaskRequest) -> SecAggUnmaskRequest:
        """Stage 4, down: whose self-mask shares and whose key shares to reveal."""
        return SecAggUnmaskRequest(self.round, self.session, list(request.survivors), list(request.dropped))

    def request(self, message: SecAggUnmaskRequest, device: int) -> UnmaskRequest:
        return UnmaskRequest(self.session, device, tuple(message.survivors), tuple(message.dropped))

    def unmask(self, response: UnmaskResponse) -> SecAggUnmask:
        """Stage 4, up: the requested shares."""
        return SecAggUnmask(self.round, self.session, {str(v): _b64(s) for v, s in response.seed_shares.items()},
                            {str(v): _b64(s) for v, s in response.key_shares.items()})

    def response(self, message: SecAggUnmask, device: int) -> UnmaskResponse:
        seeds = {int(v): _unb64(s, SHARE_BYTES, f"seed share of {v}") for v, s in message.seed_shares.items()}
        keys = {int(v): _unb64(s, SHARE_BYTES, f"key share of {v}") for v, s in message.key_shares.items()}
        return UnmaskResponse(self.session, device, seeds, keys)


# ---------------------------------------------------------------- the device


@dataclass(frozen=True)
class DeviceKeys:
    """A device's two fresh X25519 pairs for one round (c: share encryption, s: masks). Over MQTT a device
    advertises them before the round's setup exists (the setup's roster is who advertised), then hands them
    to its `SecAggClient`."""

    c_key: X25519PrivateKey
    s_key: X25519PrivateKey

    @classmethod
    def generate(cls) -> DeviceKeys:
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    def public(self) -> tuple[bytes, bytes]:
        return (self.c_key.public_key().public_bytes_raw(), self.s_key.public_key().public_bytes_raw())


class SecAggClient:
    """One device's side of one round; each stage method takes the server's message and returns the reply.
    Stages run once each, in order: a second masked input under the same masks would reveal the
    difference of the two vectors."""

    def __init__(self, config: SecAggConfig, device: int, keys: DeviceKeys | None = None) -> None:
        if not 0 <= device < config.devices:
            raise ValueError(f"device {device} outside 0..{config.devices - 1}")
        self.config, self.device = config, device
        self._neighbours = set(config.neighbours(device))
        keys = keys or DeviceKeys.generate()
        self._c_key, self._s_key = keys.c_key, keys.s_key
        self._seed = os.urandom(SECRET_BYTES)
        self._peers: dict[int, KeyAdvert] = {}
        self._held: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (its seed share, its key share)
        self._revealed: dict[int, str] = {}  # neighbour -> "seed" | "key", what stage 4 gave away
        self._stage = 1

    def _enter(self, stage: int, round_id: int, device: int) -> None:
        if round_id != self.config.round or device != self.device:
            raise SecAggError(f"message for round {round_id} device {device}, not {self.config.round}/{self.device}")
        if self._stage != stage:
            raise SecAggError(f"stage {stage} requested, the device is at stage {self._stage}")
        self._stage = stage + 1

    def advertise(self) -> KeyAdvert:
        """Stage 1: the two public keys."""
        self._enter(1, self.config.round, self.device)
        return KeyAdvert(self.config.round, self.device, *self._public_keys())

    def share_keys(self, message: NeighbourKeys) -> EncryptedShares:
        """Stage 2: b and the s private key shared among the neighbours that advertised, encrypted to each."""
        self._enter(2, message.round, message.device)
        peers = {a.device: a for a in message.adverts}
        if len(peers) != len(message.adverts) or not set(peers) <= self._neighbours:
            raise SecAggError("neighbour keys from devices that are not distinct neighbours")
        if any(a.round != self.config.round for a in message.adverts):
            raise SecAggError("neighbour keys from another round")
        keys = [k for a in message.adverts for k in (a.c_public, a.s_public)]
        own = self._public_keys()
        if len(set(keys) | set(own)) != len(keys) + len(own):
            raise SecAggError("public keys are not all distinct")
        if len(peers) < self.config.threshold:
            raise NotEnoughShares(self.device, "neighbour key", len(peers), self.config.threshold)
        self._peers = peers
        xs = [v + 1 for v in sorted(peers)]
        seed_shares = shamir_split(int.from_bytes(self._seed, "big"), self.config.threshold, xs)
        key_shares = shamir_split(int.from_bytes(self._s_key.private_bytes_raw(), "big"), self.config.threshold, xs)
        out = []
        for v in sorted(peers):
            plaintext = (struct.pack(">II", self.device, v) + seed_shares[v + 1].to_bytes(SHARE_BYTES, "big")
                         + key_shares[v + 1].to_bytes(SHARE_BYTES, "big"))
            nonce = os.urandom(NONCE_BYTES)
            aad = _share_aad(self.config.round, self.device, v)
            out.append(EncryptedShare(self.device, v, nonce, AESGCM(self._share_key(v)).encrypt(nonce, plaintext, aad)))
        return EncryptedShares(self.config.round, self.device, tuple(out))

    def _public_keys(self) -> tuple[bytes, bytes]:
        return (self._c_key.public_key().public_bytes_raw(), self._s_key.public_key().public_bytes_raw())

    def _share_key(self, neighbour: int) -> bytes:
        return _derive(_agree(self._c_key, self._peers[neighbour].c_public), b"share-encryption", self.config.round)

    def _mask_key(self, neighbour: int) -> bytes:
        return _derive(_agree(self._s_key, self._peers[neighbour].s_public), b"pairwise-mask", self.config.round)

    def masked_input(self, message: EncryptedShares, vector: np.ndarray,
                     rng: np.random.Generator | None = None) -> MaskedInput:
        """Stage 3: store the neighbours' shares (each must authenticate), then the quantized vector plus
        the self mask and the pairwise masks with the neighbours whose shares arrived."""
        vector = np.asarray(vector).reshape(-1)
        if vector.size != self.config.length:
            raise ValueError(f"vector of {vector.size} values, the round expects {self.config.length}")
        quantized = quantize(vector, self.config.clip, self.config.value_bits, rng)  # refuses NaN before any state
        self._enter(3, message.round, message.device)
        held: dict[int, tuple[bytes, bytes]] = {}
        for share in message.shares:
            if share.receiver != self.device or share.sender not in self._peers or share.sender in held:
                raise SecAggError(f"share from {share.sender} to {share.receiver} is not for this device")
            try:
                plaintext = AESGCM(self._share_key(share.sender)).decrypt(
                    share.nonce, share.ciphertext, _share_aad(self.config.round, share.sender, self.device))
            except InvalidTag:
                raise ShareDecryptionError(f"the share from device {share.sender} does not authenticate") from None
            if len(plaintext) != SHARE_PLAINTEXT_BYTES or struct.unpack(">II", plaintext[:8]) != (share.sender,
                                                                                                   self.device):
                raise ShareDecryptionError(f"the share from device {share.sender} is malformed")
            held[share.sender] = (plaintext[8 : 8 + SHARE_BYTES], plaintext[8 + SHARE_BYTES :])
        if len(held) < self.config.threshold:
            raise NotEnoughShares(self.device, "neighbour", len(held), self.config.threshold)
        self._held = held
        masked = quantized + prg(self._seed, self.config.length)
        for v in sorted(held):
            _apply_pairwise(masked, prg(self._mask_key(v), self.config.length), self.device, v)
        return MaskedInput(self.config.round, self.device, masked)

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 4: the self-mask share of each surviving neighbour, the key share of each dropped one,
        never both for one device (in this request or with what an earlier one revealed)."""
        if request.round != self.config.round or request.device != self.device or self._stage != 4:
            raise SecAggError("unmask request out of order or not for this device")
        asked = [(v, "seed") for v in request.survivors] + [(v, "key") for v in request.dropped]
        kinds: dict[int, set[str]] = {}
        for v, kind in asked:
            kinds.setdefault(v, set()).add(kind)
            if v in self._revealed:
                kinds[v].add(self._revealed[v])
        both = sorted(v for v, k in kinds.items() if len(k) > 1)
        if both:
            raise UnmaskRefused(f"both share kinds requested for devices {both}")
        unknown = sorted(v for v in kinds if v not in self._held)
        if unknown:
            raise SecAggError(f"no shares held for devices {unknown}")
        for v, kind in asked:
            self._revealed[v] = kind
        return UnmaskResponse(self.config.round, self.device, {v: self._held[v][0] for v in request.survivors},
                              {v: self._held[v][1] for v in request.dropped})


# ---------------------------------------------------------------- the server


class SecAggServer:
    """The server's side of one round. Each stage method takes the messages that arrived before the stage
    closed (absent devices have dropped) and returns the messages to send, keyed by device."""

    def __init__(self, config: SecAggConfig) -> None:
        self.config = config
        self._adverts: dict[int, KeyAdvert] = {}
        self._sharers: set[int] = set()  # U2: the devices whose shares were relayed
        self._requests: dict[int, UnmaskRequest] = {}  # U3 -> its stage-4 request
        self._total = np.zeros(config.length, dtype=np.uint32)
        self._stage = 1

    def _enter(self, stage: int) -> None:
        if self._stage != stage:
            raise SecAggError(f"stage {stage} requested, the server is at stage {self._stage}")
        self._stage += 1

    def _check(self, round_id: int, device: int, allowed: Iterable[int], seen: set[int]) -> None:
        if round_id != self.config.round:
            raise SecAggError(f"message for round {round_id}, this is round {self.config.round}")
        if device not in allowed or device in seen:
            raise SecAggError(f"device {device} is not expected at this stage, or sent twice")
        seen.add(device)

    def neighbour_keys(self, adverts: Iterable[KeyAdvert]) -> dict[int, NeighbourKeys]:
        """Stage 1: each advertising device gets its advertising neighbours' keys."""
        self._enter(1)
        seen: set[int] = set()
        for advert in adverts:
            self._check(advert.round, advert.device, range(self.config.devices), seen)
            self._adverts[advert.device] = advert
        return {u: NeighbourKeys(self.config.round, u, tuple(self._adverts[v] for v in self.config.neighbours(u)
                                                             if v in self._adverts))
                for u in sorted(self._adverts)}

    def check_shares(self, bundle: EncryptedShares) -> None:
        """One device's stage-2 bundle on its own (a transport checks each as it arrives): SecAggError unless
        it holds exactly one share from the device to each of its advertising neighbours."""
        if bundle.round != self.config.round or bundle.device not in self._adverts:
            raise SecAggError(f"shares from device {bundle.device} for round {bundle.round}: not expected")
        expected = {v for v in self.config.neighbours(bundle.device) if v in self._adverts}
        if ({s.receiver for s in bundle.shares} != expected or len(bundle.shares) != len(expected)
                or any(s.sender != bundle.device for s in bundle.shares)):
            raise SecAggError(f"device {bundle.device} did not send one share to each advertising neighbour")

    def check_masked(self, masked: MaskedInput) -> None:
        """One stage-3 input on its own: from a device whose shares were relayed, `length` uint32 values."""
        if masked.round != self.config.round or masked.device not in self._sharers:
            raise SecAggError(f"masked input from device {masked.device} for round {masked.round}: not expected")
        if masked.masked.dtype != np.uint32 or masked.masked.shape != (self.config.length,):
            raise SecAggError(f"device {masked.device}: masked vector is not {self.config.length} uint32 values")

    def check_response(self, response: UnmaskResponse) -> None:
        """One stage-4 answer on its own: exactly the shares its request asked for, each of the right size."""
        request = self._requests.get(response.device)
        if response.round != self.config.round or request is None:
            raise SecAggError(f"unmask response from device {response.device} for round {response.round}: "
                              "not expected")
        for wanted, given in ((request.survivors, response.seed_shares), (request.dropped, response.key_shares)):
            if set(given) != set(wanted) or any(len(s) != SHARE_BYTES for s in given.values()):
                raise SecAggError(f"device {response.device} did not answer its unmask request")

    def relay_shares(self, bundles: Iterable[EncryptedShares]) -> dict[int, EncryptedShares]:
        """Stage 2: every sharing device gets the shares addressed to it."""
        self._enter(2)
        inbox: dict[int, list[EncryptedShare]] = {}
        for bundle in bundles:
            self._check(bundle.round, bundle.device, self._adverts, self._sharers)
            self.check_shares(bundle)
            for share in bundle.shares:
                inbox.setdefault(share.receiver, []).append(share)
        return {u: EncryptedShares(self.config.round, u, tuple(inbox.get(u, ()))) for u in sorted(self._sharers)}

    def unmask_requests(self, inputs: Iterable[MaskedInput]) -> dict[int, UnmaskRequest]:
        """Stage 3: sum the masked inputs (mod 2**32); ask each contributor for its neighbours' shares."""
        self._enter(3)
        seen: set[int] = set()
        for masked in inputs:
            self._check(masked.round, masked.device, self._sharers, seen)
            self.check_masked(masked)
            np.add(self._total, masked.masked, out=self._total)
        for u in sorted(seen):
            sharing = [v for v in self.config.neighbours(u) if v in self._sharers]
            self._requests[u] = UnmaskRequest(self.config.round, u, tuple(v for v in sharing if v in seen),
                                              tuple(v for v in sharing if v not in seen))
        return dict(self._requests)

    def aggregate(self, responses: Iterable[UnmaskResponse]) -> AggregateResult:
        """Stage 4: reconstruct each contributor's b and each dropped device's s key, remove their masks,
        dequantize the sum of the contributors' vectors."""
        self._enter(4)
        seed_shares: dict[int, dict[int, int]] = {}
        key_shares: dict[int, dict[int, int]] = {}
        seen: set[int] = set()
        for response in responses:
            self._check(response.round, response.device, self._requests, seen)
            self.check_response(response)
            for given, into in ((response.seed_shares, seed_shares), (response.key_shares, key_shares)):
                for v, share in given.items():
                    into.setdefault(v, {})[response.device + 1] = int.from_bytes(share, "big")
        total = self._total.copy()
        threshold, length = self.config.threshold, self.config.length
        for u in sorted(self._requests):
            seed = reconstruct(seed_shares.get(u, {}), threshold, u, "self-mask")
            if seed >= 1 << (8 * SECRET_BYTES):
                raise SecAggError(f"device {u}: the reconstructed self-mask seed is not a {SECRET_BYTES}-byte value")
            np.subtract(total, prg(seed.to_bytes(SECRET_BYTES, "big"), length), out=total)
        for v in sorted(self._sharers - set(self._requests)):
            secret = reconstruct(key_shares.get(v, {}), threshold, v, "mask key")
            if secret >= 1 << (8 * SECRET_BYTES):
                raise SecAggError(f"device {v}: the reconstructed key is not a {SECRET_BYTES}-byte value")
            s_key = X25519PrivateKey.from_private_bytes(secret.to_bytes(SECRET_BYTES, "big"))
            if s_key.public_key().public_bytes_raw() != self._adverts[v].s_public:
                raise SecAggError(f"device {v}: the reconstructed key does not match its advertised key")
            for w in self.config.neighbours(v):
                if w in self._requests:  # w masked with v; undo w's side of the pair
                    key = _derive(_agree(s_key, self._adverts[w].s_public), b"pairwise-mask", self.config.round)
                    _apply_pairwise(total, prg(key, length), w, v, sign=-1)
        survivors = tuple(sorted(self._requests))
        return AggregateResult(survivors, total, dequantize(total, self.config.clip, self.config.value_bits,
                                                            len(survivors)))
