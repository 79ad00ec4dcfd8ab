"""Secure aggregation (SecAgg+): the coordinator learns sums of the devices' quantized updates and nothing about
any one of them, even when devices drop out mid-round and even when the coordinator lies.

The protocol is SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead"), the sparse-graph form of SecAgg (Bonawitz et al., CCS
2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning"), with the latter's consistency
check against a malicious server (its round 3, ConsistencyCheck). This module is its pure kernel: explicit
stages, one client object per device and one server object per session, whose stage methods take and return
fedper.wire's stage messages themselves (the wire's codec turns their bytes into base64; the masked vector
travels as safetensors, `MaskedInput`). It does no I/O: the transport (MQTT, relayed by the coordinator) is
fedper.coordinator.strategies.secure and fedper.edge.secure_round.
Every primitive comes from `cryptography` (the `privacy` extra): X25519 key agreement, HKDF-SHA256,
AES-256-GCM for the shares, AES-256-CTR as the mask generator, Ed25519 for identities. Shamir sharing is plain
modular arithmetic over the Mersenne prime 2**521 - 1, large enough to share a 32-byte secret in one piece.

Identities. Every device holds an Ed25519 identity key and a certificate of it: the signature of the fleet's
root key over (fleet, device name, public key), made when the device is provisioned (deploy/
provision-identity.sh), with the root's public key pinned on the device. The root's private key stays with the
operator; the coordinator never holds it, nor any device's identity key, so it can neither forge a device nor
substitute a device's X25519 keys.

Stages (a device missing from a stage has dropped out; the server never waits for it):

0. Setup (`SecAggConfig`): the roster (device names by index 0..n-1), the vector length, the clipping range,
   the groups (consecutive index ranges summed apart, each of at least 2 devices; one group by default) and in
   each group a k-regular neighbour graph: the group's devices placed on a ring in a seeded random order, each
   joined to the k/2 nearest on either side (a random Harary graph, as in Bell et al.); k = n - 1 gives the
   complete graph of the original SecAgg. The default k is 2 * ceil(1.5 * log2 n), and the default threshold
   is t = floor(k/2) + 1, a majority of the neighbours (a group smaller than k + 1 uses its own majority): the
   smallest t at which honest devices, each revealing one kind of share per neighbour, keep a server from
   collecting both kinds for a device. `degree_for` gives the k that a majority threshold needs for a given
   dropout rate.
1. Advertise keys: each device makes two fresh X25519 pairs, c (share encryption) and s (masks), and signs
   them (with the session and its name) with its identity key. Every advert is checked against the certificate
   and the fleet's root, by the server and by each neighbour.
2. Share keys: each device draws a self-mask seed b, Shamir-shares b and its s private key among the
   neighbours that advertised (threshold t), and encrypts each neighbour's pair of shares with AES-GCM
   under a key derived from their c agreement; the associated data binds the setup's digest, sender and
   receiver.
3. Receive shares: each device decrypts the shares relayed to it and reports the senders whose share does not
   authenticate (`SecAggReceived`); it needs t that do. The server excludes every reported device from the
   session (nobody masks with it) and tells each device which of its neighbours are excluded.
4. Masked input: the device quantizes its clipped vector to integers mod 2**32 and adds PRG(b) and, for
   each neighbour v whose share it holds and that is not excluded (at least t of them), +PRG(k_uv) if u < v
   else -PRG(k_uv), with k_uv derived from the s agreement; the pairwise masks cancel in the sum.
5. Consistency check: the server sends the survivor set S (the devices whose masked inputs it sums) to each of
   them; a device in S signs (setup digest, S) with its identity key.
6. Unmask: the server sends each signer the signatures of more than half of the session's n devices on that
   same (setup, S). A device that verifies them (certificates, signatures, signers in S) reveals, once, for
   each neighbour it masked with, the share of b if that neighbour is in S, or the share of its s key if it is
   not; never both kinds of one device, and never a second time in the session.
Then the server reconstructs, group by group, each survivor's b and each dropped device's s key from t shares,
removes those masks, and dequantizes each group's sum; a group whose secrets cannot be rebuilt (too few
answers) or do not check out (a seed beyond 32 bytes, a key that does not match its advert: somebody lied) has
no sum, and the others still do.

Why the check holds: each honest device signs one survivor set per session, so two different sets cannot both
gather signatures from more than half of the n devices; every honest device that reveals anything has seen the
same S, and for any device only one kind of share is ever revealed. The server then learns only sums: of a
group's survivors, and, when S cuts a group's graph, of each connected part of it, each holding a survivor and
at least t of its neighbours (its seed needs t shares from survivors, whose pairwise masks with it stay
secret).

Quantization. Each coordinate is clipped to [-clip, clip] and mapped to an integer in [0, 2**value_bits
- 1] with scale (2**value_bits - 1) / (2 * clip), by nearest rounding (error at most 1/(2 scale) per
coordinate and device) or, given a generator, unbiased stochastic rounding (error below 1/scale).
value_bits defaults to 32 - ceil(log2 n), so the sum of n devices' values stays below 2**32 and the
modular sum is the exact integer sum. Non-finite values are refused on the device: the clear update is
only ever seen there, so the checks that need it (NaN, norm clipping) move to the device.

Threat model and assumptions (docs/privacy.md states them in full): a server that deviates arbitrarily, no
device colluding with it (with c colluding devices the signature count must exceed (n + c) / 2), identity keys
and the root's private key out of the server's reach, and t a majority of each device's neighbours. A device
that sends shares which do not authenticate is reported and excluded; one that sends authentic but wrong
shares, or a wrong masked input, spoils its own group's sum, which the server sees fail (the coordinator then
narrows the groups down to the device: fedper.coordinator.strategies.secure).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import secrets
import struct
from bisect import bisect_right
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedper.payload import safetensors_metadata
from fedper.wire import (
    KEY_BYTES,
    NAME_RE,
    SHARE_BYTES,
    SIGNATURE_BYTES,
    SecAggAdvertise,
    SecAggMask,
    SecAggNeighbours,
    SecAggReceived,
    SecAggShares,
    SecAggSignature,
    SecAggSurvivors,
    SecAggUnmask,
    SecAggUnmaskRequest,
)

PRIME = 2**521 - 1  # Shamir's field: a Mersenne prime above any 32-byte secret (a share: SHARE_BYTES of it)
MODULUS_BITS = 32  # masked vectors are uint32: arithmetic mod 2**32 is numpy's own wrap-around
SECRET_BYTES = 32  # a self-mask seed, an X25519 private key
PROTOCOL = b"fedper-secagg/2"
IDENTITY_CONTEXT = b"fedper-identity/1"  # what a certificate signs: this, fleet, device, key (NUL-separated)
# A sealed share (fedper.wire's SEALED_SHARE_BYTES): nonce || AES-GCM ciphertext of the plaintext below, and tag.
NONCE_BYTES = 12
TAG_BYTES = 16
SHARE_PLAINTEXT_BYTES = 8 + 2 * SHARE_BYTES  # sender and receiver (u32 each), the seed share and the key share
# The stage messages the kernel takes and returns: fedper.wire's, as they go on the wire (docs/protocol.md, 6.9).
SecAggMessage = (SecAggAdvertise | SecAggNeighbours | SecAggShares | SecAggReceived | SecAggMask | SecAggSurvivors
                 | SecAggSignature | SecAggUnmaskRequest | SecAggUnmask)
# A device's identity directory (deploy/provision-identity.sh writes it).
IDENTITY_KEY_FILE, CERTIFICATE_FILE, ROOT_FILE = "identity.pem", "identity.cert", "fleet-root.pub"


class SecAggError(Exception):
    """A message that breaks the protocol (wrong round, stage, sender, size): the session cannot use it."""


class IdentityError(SecAggError):
    """A certificate or a signature that does not verify: a forged device, or keys substituted in transit."""


class UnmaskRefused(SecAggError):
    """An unmask request without signatures of more than half of the session on the survivors this device
    signed, or a second request: answering it could reveal both kinds of share of one device."""


class ReconstructionError(SecAggError):
    """Shares that interpolate to no valid secret (a seed beyond 32 bytes, a key unlike its advert): a lie."""


class NotEnoughShares(SecAggError):
    """Fewer than t shares for a secret: it cannot be rebuilt (too many devices dropped)."""

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


def _share_aad(setup: bytes, sender: int, receiver: int) -> bytes:
    """A share's associated data: the setup's digest (session, roster, graph) and who sends it to whom, so a share
    opens only for its receiver under the setup it was made for."""
    return PROTOCOL + setup + struct.pack(">II", sender, receiver)


def _apply_pairwise(total: np.ndarray, mask: np.ndarray, me: int, other: int, sign: int = 1) -> None:
    """The pairwise rule: the smaller index adds the mask, the larger subtracts it (sign=-1 undoes it)."""
    if (me < other) == (sign > 0):
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)


# ---------------------------------------------------------------- identities (Ed25519)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def certificate_message(fleet: str, device: str, public: bytes) -> bytes:
    """What the fleet's root signs to certify `public` as `device`'s identity key in `fleet`."""
    return b"\0".join((IDENTITY_CONTEXT, fleet.encode(), device.encode(), public))


def signature_valid(public: Ed25519PublicKey | bytes, signature: bytes, message: bytes) -> bool:
    try:
        key = public if isinstance(public, Ed25519PublicKey) else Ed25519PublicKey.from_public_bytes(public)
        key.verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def certified(root: Ed25519PublicKey, fleet: str, device: str, public: bytes, certificate: bytes) -> bool:
    """Whether `certificate` is the root's signature making `public` the identity of `device` in `fleet`."""
    return signature_valid(root, certificate, certificate_message(fleet, device, public))


def load_root(path: Path) -> Ed25519PublicKey:
    """A fleet's root public key (PEM); ValueError (one line) when it is not one."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read the fleet root key {path}: {e.strerror or e}") from None
    except ValueError:
        raise ValueError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key")
    return key


@dataclass(frozen=True)
class Certificate:
    """A device's identity key, certified by the fleet's root (the file identity.cert, JSON with base64 keys)."""

    fleet: str
    device: str
    public: bytes
    signature: bytes

    def to_json(self) -> bytes:
        return json.dumps({"fleet": self.fleet, "device": self.device, "public": _b64(self.public),
                           "signature": _b64(self.signature)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Certificate:
        try:
            body = json.loads(data)
            fleet, device = str(body["fleet"]), str(body["device"])
            public = base64.b64decode(body["public"], validate=True)
            signature = base64.b64decode(body["signature"], validate=True)
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise ValueError(f"not an identity certificate: {e}") from None
        if len(public) != KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            raise ValueError("an identity certificate holds a 32-byte key and a 64-byte signature")
        return cls(fleet, device, public, signature)


@dataclass(frozen=True)
class Identity:
    """A device's identity: its Ed25519 key, the root's certificate of it, and the fleet's root public key."""

    key: Ed25519PrivateKey
    certificate: Certificate
    root: Ed25519PublicKey

    @property
    def name(self) -> str:
        return self.certificate.device

    @property
    def fleet(self) -> str:
        return self.certificate.fleet

    @classmethod
    def issue(cls, root: Ed25519PrivateKey, fleet: str, device: str) -> Identity:
        """A fresh identity for `device`, certified by `root` (what deploy/provision-identity.sh does)."""
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes_raw()
        signature = root.sign(certificate_message(fleet, device, public))
        return cls(key, Certificate(fleet, device, public, signature), root.public_key())

    @classmethod
    def load(cls, directory: Path) -> Identity:
        """identity.pem, identity.cert and fleet-root.pub from `directory`; IdentityError (one line) otherwise."""
        directory = Path(directory)
        try:
            key = serialization.load_pem_private_key((directory / IDENTITY_KEY_FILE).read_bytes(), password=None)
            certificate = Certificate.from_json((directory / CERTIFICATE_FILE).read_bytes())
            root = load_root(directory / ROOT_FILE)
        except OSError as e:
            raise IdentityError(f"cannot read the identity in {directory}: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:
            raise IdentityError(f"{directory}: {e}") from None
        if not isinstance(key, Ed25519PrivateKey) or key.public_key().public_bytes_raw() != certificate.public:
            raise IdentityError(f"{directory}: {CERTIFICATE_FILE} does not certify the Ed25519 key in "
                                f"{IDENTITY_KEY_FILE}")
        if not certified(root, certificate.fleet, certificate.device, certificate.public, certificate.signature):
            raise IdentityError(f"{directory}: {CERTIFICATE_FILE} is not signed by the root in {ROOT_FILE}")
        return cls(key, certificate, root)

    def save(self, directory: Path) -> Path:
        """The three files `load` reads (identity.pem mode 600), as deploy/provision-identity.sh writes them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = directory / IDENTITY_KEY_FILE
        key.touch(mode=0o600)
        key.write_bytes(self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        (directory / CERTIFICATE_FILE).write_bytes(self.certificate.to_json())
        (directory / ROOT_FILE).write_bytes(self.root.public_bytes(serialization.Encoding.PEM,
                                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
        return directory

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def advert_message(session: int, device: str, c_public: bytes, s_public: bytes) -> bytes:
    """What a device signs to advertise its keys: the session, its name, the two X25519 public keys."""
    return PROTOCOL + b" advert" + struct.pack(">Q", session) + device.encode() + b"\0" + c_public + s_public


def survivors_message(setup: bytes, survivors: Iterable[int]) -> bytes:
    """What a device signs in the consistency check: the setup's digest and the survivor set, sorted."""
    ordered = sorted(survivors)
    return PROTOCOL + b" survivors" + setup + struct.pack(f">I{len(ordered)}I", len(ordered), *ordered)


# ---------------------------------------------------------------- the setup


@dataclass(frozen=True)
class SecAggConfig:
    """Stage 0, sent by the server in each device's SecAggNeighbours: who takes part, in which groups, and how the
    vector is encoded. Every stage message names `round` (RoundInfo's) and `session`; keys, shares and the setup's
    digest are bound to the session."""

    round: int
    session: int
    roster: tuple[str, ...]  # index -> device name
    length: int
    clip: float
    degree: int
    threshold: int
    value_bits: int
    graph_seed: int
    groups: tuple[int, ...]  # sizes of the groups summed apart, in index order

    @classmethod
    def create(cls, round: int, session: int, roster: Sequence[str], length: int, clip: float,
               degree: int | None = None, threshold: int | None = None, graph_seed: int = 0,
               groups: Sequence[int] = ()) -> SecAggConfig:
        roster = tuple(roster)
        devices = len(roster)
        degree = default_degree(devices) if degree is None else min(degree, devices - 1)
        return cls(round, session, roster, length, clip, degree, degree // 2 + 1 if threshold is None else threshold,
                   default_value_bits(devices), graph_seed, tuple(groups) or (devices,))

    @classmethod
    def of(cls, setup: SecAggNeighbours) -> SecAggConfig:
        """The setup a device got; ValueError when it is unsound."""
        return cls(setup.round, setup.session, tuple(setup.roster), setup.length, setup.clip, setup.degree,
                   setup.threshold, setup.value_bits, setup.graph_seed, tuple(setup.groups))

    def __post_init__(self) -> None:
        if self.devices < 2 or self.length < 1 or not self.clip > 0:
            raise ValueError("need >= 2 devices, a non-empty vector and a positive clipping range")
        if len(set(self.roster)) != self.devices or not all(isinstance(d, str) and NAME_RE.match(d)
                                                            for d in self.roster):
            raise ValueError("the roster must name distinct devices")
        if sum(self.groups) != self.devices or min(self.groups) < 2:
            raise ValueError(f"groups {list(self.groups)[:8]} must each hold >= 2 devices, {self.devices} in all")
        if not 1 <= self.threshold <= self.degree:
            raise ValueError(f"threshold {self.threshold} outside 1..{self.degree}")
        if not 1 <= self.value_bits <= default_value_bits(self.devices):
            raise ValueError(f"{self.value_bits}-bit values of {self.devices} devices could overflow 2**32")

    @property
    def devices(self) -> int:
        return len(self.roster)

    @property
    def signatures_needed(self) -> int:
        """Signers of one survivor set an unmask request must carry: more than half of the session."""
        return self.devices // 2 + 1

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        return (0, *accumulate(self.groups))

    def group(self, device: int) -> int:
        """The group of index `device`."""
        return bisect_right(self._starts, device) - 1

    def members(self, group: int) -> range:
        return range(self._starts[group], self._starts[group + 1])

    def group_degree(self, group: int) -> int:
        return min(self.degree, self.groups[group] - 1)

    def group_threshold(self, group: int) -> int:
        """t, or a majority of the neighbours in a group too small for k of them."""
        degree = self.group_degree(group)
        return self.threshold if degree == self.degree else degree // 2 + 1

    def threshold_of(self, device: int) -> int:
        return self.group_threshold(self.group(device))

    @cached_property
    def graph(self) -> tuple[tuple[int, ...], ...]:
        """Each device's neighbours: a random Harary graph within each group (the seed offset by the group)."""
        out: list[tuple[int, ...]] = []
        for group, start in enumerate(self._starts[:-1]):
            local = neighbour_graph(self.groups[group], self.group_degree(group), self.graph_seed + group)
            out += [tuple(start + v for v in neighbours) for neighbours in local]
        return tuple(out)

    def neighbours(self, device: int) -> tuple[int, ...]:
        return self.graph[device]

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of everything the setup fixes: shares are bound to it, devices sign it with the survivors."""
        head = struct.pack(">QQd5Q", self.session, self.length, self.clip, self.degree, self.threshold,
                           self.value_bits, self.graph_seed, len(self.groups))
        groups = struct.pack(f">{len(self.groups)}Q", *self.groups)
        return hashlib.sha256(PROTOCOL + b" setup" + head + groups + "\0".join(self.roster).encode()).digest()


# ---------------------------------------------------------------- messages: fedper.wire's stage messages


def _expect(config: SecAggConfig, message: SecAggMessage) -> None:
    """A stage message of this session (its round and session), else SecAggError."""
    if (message.round, message.session) != (config.round, config.session):
        raise SecAggError(f"message for round {message.round} session {message.session}, this is round "
                          f"{config.round} session {config.session}")


def advert_problem(advert: SecAggAdvertise, name: str, fleet: str, root: Ed25519PublicKey) -> str:
    """"" when `advert` is `name`'s in `fleet`: its identity certified by the root, its keys signed for its session."""
    if not certified(root, fleet, name, advert.identity, advert.certificate):
        return f"the identity key of {name} is not certified by fleet {fleet}'s root"
    if not signature_valid(advert.identity, advert.signature,
                           advert_message(advert.session, name, advert.c_public, advert.s_public)):
        return f"the keys advertised for {name} are not signed by its identity key"
    return ""


def _split(raw: bytes, *sizes: int) -> list[bytes]:
    """Consecutive fields of the given sizes."""
    return [raw[end - size : end] for size, end in zip(sizes, accumulate(sizes), strict=True)]


def _packed_advert(advert: SecAggAdvertise) -> bytes:
    """A neighbour's advert as the setup relays it: c_public || s_public || identity || certificate || signature."""
    return advert.c_public + advert.s_public + advert.identity + advert.certificate + advert.signature


def _unpacked_advert(config: SecAggConfig, raw: bytes) -> SecAggAdvertise:
    return SecAggAdvertise(config.round, config.session,
                           *_split(raw, KEY_BYTES, KEY_BYTES, KEY_BYTES, SIGNATURE_BYTES, SIGNATURE_BYTES))


@dataclass(frozen=True)
class MaskedInput:
    """Stage 4, device -> server: the quantized vector plus its masks, uint32 (4 bytes a value, as fp32). It travels
    as an update blob (safetensors), not as a stage message."""

    session: int
    device: int
    masked: np.ndarray = field(repr=False)

    def to_safetensors(self) -> bytes:
        """The wire form of the vector: one U32 tensor, the session (as `round`) and device in the metadata."""
        return st_save({"masked": np.ascontiguousarray(self.masked, dtype="<u4")},
                       metadata={"round": str(self.session), "device": str(self.device)})

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
class GroupSum:
    """One group's outcome: its survivors, and their exact integer sum and dequantized float64 sum; or, when its
    masks could not be removed, why (`lied`: shares that did not check out, rather than too few of them)."""

    group: int
    survivors: tuple[int, ...]
    total: np.ndarray | None = field(default=None, repr=False)
    sum: np.ndarray | None = field(default=None, repr=False)
    failure: str = ""
    lied: bool = False


@dataclass(frozen=True)
class AggregateResult:
    """What the server learns: who was summed (the signed survivor set) and each group's sum."""

    survivors: tuple[int, ...]
    groups: tuple[GroupSum, ...]


# ---------------------------------------------------------------- the device


@dataclass(frozen=True)
class DeviceKeys:
    """A device's two fresh X25519 pairs for one session (c: share encryption, s: masks). Over MQTT a device
    advertises them before the session's setup exists (the setup's roster is who advertised), then hands them
    to its `SecAggClient`."""

    c_key: X25519PrivateKey
    s_key: X25519PrivateKey

    @classmethod
    def generate(cls) -> DeviceKeys:
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    def public(self) -> tuple[bytes, bytes]:
        return (self.c_key.public_key().public_bytes_raw(), self.s_key.public_key().public_bytes_raw())

    def advert(self, identity: Identity, round: int, session: int) -> SecAggAdvertise:
        """The public keys, signed for `session` by `identity` (Ed25519 signatures are deterministic)."""
        c_public, s_public = self.public()
        signature = identity.sign(advert_message(session, identity.name, c_public, s_public))
        return SecAggAdvertise(round, session, c_public, s_public, identity.certificate.public,
                               identity.certificate.signature, signature)


class SecAggClient:
    """One device's side of one session; each stage method takes the server's message and returns the reply.
    Stages run once each, in order: a second masked input under the same masks would reveal the difference of
    the two vectors, a second unmask answer both kinds of share."""

    def __init__(self, config: SecAggConfig, device: int, identity: Identity, keys: DeviceKeys | None = None) -> None:
        if not 0 <= device < config.devices:
            raise ValueError(f"device {device} outside 0..{config.devices - 1}")
        if config.roster[device] != identity.name:
            raise ValueError(f"the setup gives index {device} to {config.roster[device]}, not to {identity.name}")
        self.config, self.device, self.identity = config, device, identity
        self._neighbours = set(config.neighbours(device))
        self._threshold = config.threshold_of(device)
        self._keys = keys or DeviceKeys.generate()
        self._seed = os.urandom(SECRET_BYTES)
        self._peers: dict[int, SecAggAdvertise] = {}
        self._held: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (its seed share, its key share)
        self._masked_with: tuple[int, ...] = ()
        self._survivors: frozenset[int] = frozenset()
        self._stage = 1

    def _enter(self, stage: int, message: SecAggMessage | None = None) -> None:
        if message is not None:
            _expect(self.config, message)
        if self._stage != stage:
            raise SecAggError(f"stage {stage} requested, the device is at stage {self._stage}")
        self._stage = stage + 1

    def advertise(self) -> SecAggAdvertise:
        """Stage 1: the two public keys, signed."""
        self._enter(1)
        return self._keys.advert(self.identity, self.config.round, self.config.session)

    def share_keys(self, setup: SecAggNeighbours) -> SecAggShares:
        """Stage 2: the setup checked to be the one this client runs, every neighbour's advert verified; b and the
        s private key shared among them, encrypted to each (keyed by receiver)."""
        self._enter(2, setup)
        if setup.index != self.device or SecAggConfig.of(setup) != self.config:
            raise SecAggError("a setup unlike the one this device runs")
        peers = {v: _unpacked_advert(self.config, raw) for v, raw in setup.adverts.items()}
        if not set(peers) <= self._neighbours:
            raise SecAggError("neighbour keys from devices that are not neighbours")
        for v, advert in peers.items():
            problem = advert_problem(advert, self.config.roster[v], self.identity.fleet, self.identity.root)
            if problem:
                raise IdentityError(problem)
        keys = [k for a in peers.values() for k in (a.c_public, a.s_public)]
        own = self._keys.public()
        if len(set(keys) | set(own)) != len(keys) + len(own):
            raise SecAggError("public keys are not all distinct")
        if len(peers) < self._threshold:
            raise NotEnoughShares(self.device, "neighbour key", len(peers), self._threshold)
        self._peers = peers
        xs = [v + 1 for v in sorted(peers)]
        seed_shares = shamir_split(int.from_bytes(self._seed, "big"), self._threshold, xs)
        key_shares = shamir_split(int.from_bytes(self._keys.s_key.private_bytes_raw(), "big"), self._threshold, xs)
        sealed = {}
        for v in sorted(peers):
            plaintext = (struct.pack(">II", self.device, v) + seed_shares[v + 1].to_bytes(SHARE_BYTES, "big")
                         + key_shares[v + 1].to_bytes(SHARE_BYTES, "big"))
            nonce = os.urandom(NONCE_BYTES)
            aad = _share_aad(self.config.digest, self.device, v)
            sealed[v] = nonce + AESGCM(self._share_key(v)).encrypt(nonce, plaintext, aad)
        return SecAggShares(self.config.round, self.config.session, sealed)

    def _share_key(self, neighbour: int) -> bytes:
        return _derive(_agree(self._keys.c_key, self._peers[neighbour].c_public), b"share-encryption",
                       self.config.session)

    def _mask_key(self, neighbour: int) -> bytes:
        return _derive(_agree(self._keys.s_key, self._peers[neighbour].s_public), b"pairwise-mask",
                       self.config.session)

    def receive_shares(self, message: SecAggShares) -> SecAggReceived:
        """Stage 3: keep the neighbours' shares (keyed by sender) that authenticate and report the senders of those
        that do not; fewer than t that do is NotEnoughShares (the device goes no further)."""
        self._enter(3, message)
        held: dict[int, tuple[bytes, bytes]] = {}
        skipped: list[int] = []
        for sender, sealed in message.shares.items():
            if sender not in self._peers:
                raise SecAggError(f"a share from {sender}, which is not a neighbour that advertised")
            try:
                plaintext = AESGCM(self._share_key(sender)).decrypt(
                    sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _share_aad(self.config.digest, sender, self.device))
            except InvalidTag:
                plaintext = b""
            if len(plaintext) != SHARE_PLAINTEXT_BYTES or struct.unpack(">II", plaintext[:8]) != (sender, self.device):
                skipped.append(sender)
                continue
            held[sender] = (plaintext[8 : 8 + SHARE_BYTES], plaintext[8 + SHARE_BYTES :])
        if len(held) < self._threshold:
            raise NotEnoughShares(self.device, "neighbour", len(held), self._threshold)
        self._held = held
        return SecAggReceived(self.config.round, self.config.session, sorted(skipped))

    def masked_input(self, request: SecAggMask, vector: np.ndarray,
                     rng: np.random.Generator | None = None) -> MaskedInput:
        """Stage 4: the quantized vector plus the self mask and the pairwise masks with the neighbours whose shares
        it holds, less the excluded ones; at least t of them (else a coordinator that excluded the others could
        strip every mask it lacks the seed of, see docs/privacy.md)."""
        vector = np.asarray(vector).reshape(-1)
        if vector.size != self.config.length:
            raise ValueError(f"vector of {vector.size} values, the round expects {self.config.length}")
        quantized = quantize(vector, self.config.clip, self.config.value_bits, rng)  # refuses NaN before any state
        self._enter(4, request)
        if not set(request.excluded) <= self._neighbours:
            raise SecAggError("excluded devices that are not this device's neighbours")
        masked_with = tuple(sorted(set(self._held) - set(request.excluded)))
        if len(masked_with) < self._threshold:
            raise NotEnoughShares(self.device, "neighbour", len(masked_with), self._threshold)
        self._masked_with = masked_with
        masked = quantized + prg(self._seed, self.config.length)
        for v in masked_with:
            _apply_pairwise(masked, prg(self._mask_key(v), self.config.length), self.device, v)
        return MaskedInput(self.config.session, self.device, masked)

    def sign_survivors(self, message: SecAggSurvivors) -> SecAggSignature:
        """Stage 5: sign the survivor set, one per session, if it holds this device and could gather enough
        signatures to be acted on."""
        self._enter(5, message)
        survivors = frozenset(message.survivors)
        if len(survivors) != len(message.survivors) or not survivors <= set(range(self.config.devices)):
            raise SecAggError("the survivors are not distinct devices of the session")
        if self.device not in survivors:
            raise SecAggError("the survivors leave out this device, whose masked input was sent")
        if len(survivors) < self.config.signatures_needed:
            raise SecAggError(f"{len(survivors)} survivors: the check needs {self.config.signatures_needed} to sign")
        self._survivors = survivors
        signature = self.identity.sign(survivors_message(self.config.digest, survivors))
        return SecAggSignature(self.config.round, self.config.session, signature)

    def unmask(self, request: SecAggUnmaskRequest) -> SecAggUnmask:
        """Stage 6: given valid signatures of more than half of the session on the survivor set this device signed
        (index -> identity || certificate || signature), for each neighbour it masked with, the self-mask share of a
        survivor or the key share of one that is not. Answered once (UnmaskRefused otherwise)."""
        _expect(self.config, request)
        if self._stage == 7:
            raise UnmaskRefused("this device answered an unmask request of this session already")
        if self._stage != 6:
            raise SecAggError(f"unmask request out of order: the device is at stage {self._stage}")
        statement = survivors_message(self.config.digest, self._survivors)
        valid = set()
        for signer, raw in request.signatures.items():
            identity, certificate, signature = _split(raw, KEY_BYTES, SIGNATURE_BYTES, SIGNATURE_BYTES)
            if (signer in self._survivors
                    and certified(self.identity.root, self.identity.fleet, self.config.roster[signer], identity,
                                  certificate)
                    and signature_valid(identity, signature, statement)):
                valid.add(signer)
        if len(valid) < self.config.signatures_needed:
            raise UnmaskRefused(f"{len(valid)} valid signatures of the survivor set this device signed, "
                                f"{self.config.signatures_needed} needed (more than half of {self.config.devices})")
        self._stage = 7
        return SecAggUnmask(self.config.round, self.config.session,
                            {v: self._held[v][0] for v in self._masked_with if v in self._survivors},
                            {v: self._held[v][1] for v in self._masked_with if v not in self._survivors})


# ---------------------------------------------------------------- the server


class SecAggServer:
    """The server's side of one session. Each stage method takes the messages that arrived before the stage
    closed, keyed by their senders' indices (absent devices have dropped), and returns the messages to send,
    keyed the same way; `check_*` checks one message on its own (a transport checks each as it arrives)."""

    def __init__(self, config: SecAggConfig, fleet: str, root: Ed25519PublicKey) -> None:
        self.config, self.fleet, self.root = config, fleet, root
        self._adverts: dict[int, SecAggAdvertise] = {}
        self._relayed: dict[int, set[int]] = {}  # receiver -> the senders whose shares it was sent
        self._excluded: set[int] = set()  # reported by a neighbour: nobody masks with them
        self._masked_with: dict[int, set[int]] = {}  # a device asked for its input -> the neighbours it masks with
        self._survivors: tuple[int, ...] = ()  # U3: the masked inputs summed
        self._totals = [np.zeros(config.length, dtype=np.uint32) for _ in config.groups]
        self._requests: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # signer -> (seeds of, keys of)
        self._stage = 1

    def _enter(self, stage: int) -> None:
        if self._stage != stage:
            raise SecAggError(f"stage {stage} requested, the server is at stage {self._stage}")
        self._stage += 1

    def _expected(self, what: str, device: int, allowed: Container[int], message: SecAggMessage) -> None:
        if device not in allowed:
            raise SecAggError(f"{what} from device {device}: not expected at this stage")
        _expect(self.config, message)

    def neighbour_keys(self, adverts: Mapping[int, SecAggAdvertise], weight_scale: int = 1,
                       **vector: Any) -> dict[int, SecAggNeighbours]:
        """Stage 1: each advertising device (each advert verified) gets the setup and its advertising neighbours'
        adverts. How a device makes its vector (`weight_scale` and SecAggNeighbours' other options) is the
        caller's: it rides along in the setup."""
        self._enter(1)
        for device, advert in adverts.items():
            self._expected("an advert", device, range(self.config.devices), advert)
            problem = advert_problem(advert, self.config.roster[device], self.fleet, self.root)
            if problem:
                raise IdentityError(problem)
        self._adverts = dict(adverts)
        c = self.config
        return {u: SecAggNeighbours(
            round=c.round, session=c.session, roster=list(c.roster), groups=list(c.groups), index=u, length=c.length,
            clip=c.clip, degree=c.degree, threshold=c.threshold, value_bits=c.value_bits, graph_seed=c.graph_seed,
            weight_scale=weight_scale, adverts={v: _packed_advert(self._adverts[v]) for v in c.neighbours(u)
                                                if v in self._adverts}, **vector)
            for u in sorted(self._adverts)}

    def check_shares(self, device: int, bundle: SecAggShares) -> None:
        """One stage-2 bundle: exactly one share from the device to each of its advertising neighbours."""
        self._expected("shares", device, self._adverts, bundle)
        if set(bundle.shares) != {v for v in self.config.neighbours(device) if v in self._adverts}:
            raise SecAggError(f"device {device} did not send one share to each advertising neighbour")

    def relay_shares(self, bundles: Mapping[int, SecAggShares]) -> dict[int, SecAggShares]:
        """Stage 2: every sharing device gets the shares addressed to it, keyed by sender."""
        self._enter(2)
        inbox: dict[int, dict[int, bytes]] = {}
        for device, bundle in sorted(bundles.items()):
            self.check_shares(device, bundle)
            for receiver, sealed in bundle.shares.items():
                inbox.setdefault(receiver, {})[device] = sealed
        self._relayed = {u: set(inbox.get(u, {})) for u in bundles}  # U2: the devices whose shares were relayed
        return {u: SecAggShares(self.config.round, self.config.session, inbox.get(u, {})) for u in sorted(bundles)}

    def check_report(self, device: int, report: SecAggReceived) -> None:
        """One stage-3 report: senders whose shares the device was sent, few enough to leave it t shares."""
        self._expected("a share report", device, self._relayed, report)
        relayed, skipped = self._relayed[device], set(report.skipped)
        if len(skipped) != len(report.skipped) or not skipped <= relayed:
            raise SecAggError(f"device {device} reports devices whose shares it was not sent")
        if len(relayed) - len(skipped) < self.config.threshold_of(device):
            raise SecAggError(f"device {device} reports {len(skipped)} of {len(relayed)} shares: it would "
                              f"keep fewer than t = {self.config.threshold_of(device)}")

    def mask_requests(self, reports: Mapping[int, SecAggReceived]) -> dict[int, SecAggMask]:
        """Stage 3: every reported device leaves the session (nobody masks with it); each reporter not reported
        that keeps t neighbours to mask with is asked for its masked input."""
        self._enter(3)
        for device, report in reports.items():
            self.check_report(device, report)
        skipped = {device: set(report.skipped) for device, report in reports.items()}
        self._excluded = set().union(*skipped.values())
        requests = {}
        for u in sorted(set(skipped) - self._excluded):
            masked_with = self._relayed[u] - skipped[u] - self._excluded
            if len(masked_with) >= self.config.threshold_of(u):
                self._masked_with[u] = masked_with
                excluded = sorted(self._excluded & set(self.config.neighbours(u)))
                requests[u] = SecAggMask(self.config.round, self.config.session, excluded)
        return requests

    @property
    def excluded(self) -> tuple[int, ...]:
        """The devices reported in stage 3."""
        return tuple(sorted(self._excluded))

    def check_masked(self, masked: MaskedInput) -> None:
        """One stage-4 input: from a device asked for it, `length` uint32 values."""
        if masked.session != self.config.session or masked.device not in self._masked_with:
            raise SecAggError(f"masked input from device {masked.device} for session {masked.session}: not expected")
        if masked.masked.dtype != np.uint32 or masked.masked.shape != (self.config.length,):
            raise SecAggError(f"device {masked.device}: masked vector is not {self.config.length} uint32 values")

    def survivor_lists(self, inputs: Iterable[MaskedInput]) -> dict[int, SecAggSurvivors]:
        """Stage 4: sum the masked inputs per group (mod 2**32); send the survivor set to each survivor to sign.
        SecAggError when fewer than the signatures the check needs arrived (the session cannot finish)."""
        self._enter(4)
        seen: set[int] = set()
        for masked in inputs:
            self.check_masked(masked)
            if masked.device in seen:
                raise SecAggError(f"device {masked.device} sent two masked inputs")
            seen.add(masked.device)
            total = self._totals[self.config.group(masked.device)]
            np.add(total, masked.masked, out=total)
        self._survivors = tuple(sorted(seen))
        if len(seen) < self.config.signatures_needed:
            raise SecAggError(f"{len(seen)} masked inputs: the consistency check needs {self.config.signatures_needed}"
                              f" (more than half of the session's {self.config.devices})")
        return {u: SecAggSurvivors(self.config.round, self.config.session, list(self._survivors))
                for u in self._survivors}

    def check_signature(self, device: int, signature: SecAggSignature) -> None:
        """One stage-5 signature: a survivor's identity key signed the setup and the survivors."""
        self._expected("a signature", device, self._survivors, signature)
        statement = survivors_message(self.config.digest, self._survivors)
        if not signature_valid(self._adverts[device].identity, signature.signature, statement):
            raise IdentityError(f"device {device}'s signature of the survivors does not verify")

    def unmask_requests(self, signatures: Mapping[int, SecAggSignature]) -> dict[int, SecAggUnmaskRequest]:
        """Stage 5: each signer gets the signatures of more than half of the session (the first by index), and is
        asked, for each neighbour it masked with, the seed share of a survivor or the key share of one that is not.
        SecAggError when fewer signed."""
        self._enter(5)
        for device, signature in signatures.items():
            self.check_signature(device, signature)
        if len(signatures) < self.config.signatures_needed:
            raise SecAggError(f"{len(signatures)} devices signed the survivors, the check needs "
                              f"{self.config.signatures_needed}")
        survivors = set(self._survivors)
        for u in signatures:
            masked_with = sorted(self._masked_with[u])
            self._requests[u] = (tuple(v for v in masked_with if v in survivors),
                                 tuple(v for v in masked_with if v not in survivors))
        chosen = {u: self._adverts[u].identity + self._adverts[u].certificate + signatures[u].signature
                  for u in sorted(signatures)[: self.config.signatures_needed]}
        return {u: SecAggUnmaskRequest(self.config.round, self.config.session, chosen) for u in sorted(signatures)}

    def check_response(self, device: int, response: SecAggUnmask) -> None:
        """One stage-6 answer: exactly the shares its device was asked for, each of the right size."""
        self._expected("an unmask response", device, self._requests, response)
        for wanted, given in zip(self._requests[device], (response.seed_shares, response.key_shares), strict=True):
            if set(given) != set(wanted) or any(len(s) != SHARE_BYTES for s in given.values()):
                raise SecAggError(f"device {device} did not answer its unmask request")

    def aggregate(self, responses: Mapping[int, SecAggUnmask]) -> AggregateResult:
        """Stage 6: group by group, reconstruct each survivor's b and each dropped device's s key, remove their
        masks, dequantize the sum. A group whose secrets cannot be rebuilt, or do not check out, has no sum."""
        self._enter(6)
        seed_shares: dict[int, dict[int, int]] = {}
        key_shares: dict[int, dict[int, int]] = {}
        for device, response in responses.items():
            self.check_response(device, response)
            for given, into in ((response.seed_shares, seed_shares), (response.key_shares, key_shares)):
                for v, share in given.items():
                    into.setdefault(v, {})[device + 1] = int.from_bytes(share, "big")
        groups = []
        for group in range(len(self.config.groups)):
            survivors = tuple(u for u in self._survivors if self.config.group(u) == group)
            if not survivors:
                continue
            try:
                total = self._unmask_group(group, survivors, seed_shares, key_shares)
            except (ReconstructionError, NotEnoughShares) as e:
                groups.append(GroupSum(group, survivors, failure=str(e), lied=isinstance(e, ReconstructionError)))
                continue
            groups.append(GroupSum(group, survivors, total,
                                   dequantize(total, self.config.clip, self.config.value_bits, len(survivors))))
        return AggregateResult(self._survivors, tuple(groups))

    def _unmask_group(self, group: int, survivors: tuple[int, ...], seed_shares: dict[int, dict[int, int]],
                      key_shares: dict[int, dict[int, int]]) -> np.ndarray:
        total, length = self._totals[group].copy(), self.config.length
        for u in survivors:
            seed = reconstruct(seed_shares.get(u, {}), self.config.threshold_of(u), u, "self-mask")
            if seed >= 1 << (8 * SECRET_BYTES):
                raise ReconstructionError(f"device {u}: the reconstructed self-mask seed is not a {SECRET_BYTES}-byte "
                                          "value")
            np.subtract(total, prg(seed.to_bytes(SECRET_BYTES, "big"), length), out=total)
        alive = set(self._survivors)
        for v in self.config.members(group):
            maskers = [w for w in self.config.neighbours(v) if w in alive and v in self._masked_with.get(w, ())]
            if v in alive or not maskers:
                continue
            secret = reconstruct(key_shares.get(v, {}), self.config.threshold_of(v), v, "mask key")
            if secret >= 1 << (8 * SECRET_BYTES):
                raise ReconstructionError(f"device {v}: the reconstructed key is not a {SECRET_BYTES}-byte value")
            s_key = X25519PrivateKey.from_private_bytes(secret.to_bytes(SECRET_BYTES, "big"))
            if s_key.public_key().public_bytes_raw() != self._adverts[v].s_public:
                raise ReconstructionError(f"device {v}: the reconstructed key does not match its advertised key")
            for w in maskers:  # w masked with v; undo w's side of the pair
                key = _derive(_agree(s_key, self._adverts[w].s_public), b"pairwise-mask", self.config.session)
                _apply_pairwise(total, prg(key, length), w, v, sign=-1)
        return total
