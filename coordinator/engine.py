"""The coordinator's round logic: a state machine fed with decoded MQTT messages and the time.

No I/O but its state directory: `handle(topic, payload, now)` and `tick(now)` return the
messages to publish, so tests and fuzzers drive it directly and the paho loop stays thin.
Each accepted update is folded into the running aggregate at once and checkpointed, so memory
is O(model) for the weighted mean and a restart loses no accepted update. The checkpoint of an
update is its blob as received (no copy, float32 or smaller); every PARTIAL_EVERY updates the
weighted mean writes its float64 running sum instead (twice the bytes, straight from the rule's own
arrays), and the blobs it covers are deleted. A restart resumes the sum bit for bit, then folds
the blobs after it.

With a number of clients per round, a round invites devices by fedper.selection's seeded ranking
(checkpointed with the round) and refuses an update from any other before reassembling it.

With a noise multiplier (differential privacy, docs/privacy.md) each round folds with fedper.privacy's
DPFedAvg instead of the weighted mean: clipped deltas, uniform weights, Gaussian noise drawn from a
generator derived from the run's secret and the round number. The secret and the accountant are
checkpointed in state.json, and the rule's float64 sums like the mean's, so a restart releases the same
model bit for bit. Each closed round is recorded in the accountant; before the next round opens, its
projected epsilon is checked against the budget, which stops the run or warns.

With secure aggregation (coordinator/secure_round.py) the open round runs a SecAgg+ session instead of
folding clear updates: the coordinator relays the stage messages and, when the session closes, releases
base + the n_j-weighted mean of the contributors' clipped deltas, which is all it learns (with a noise
multiplier the devices add the noise: distributed DP, accounted like the central kind). A session is not
checkpointed: after a restart (or a failed session) the round opens a new one and the devices take part again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedper.aggregation import CoordinateMedian, TrimmedMean, WeightedMean, clip_update
from fedper.coordinator.quota import BURST_SECONDS, MessageRateLimit
from fedper.coordinator.store import FINAL_FILE, CheckpointError, Store
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.privacy import (
    DEFAULT_DELTA,
    AdaptiveClipping,
    DPFedAvg,
    PrivacyAccountant,
    budget_action,
    prepare_release,
    private_tensor_names,
    round_generator,
)
from fedper.selection import check_seed, invitations, new_seed, select
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    MAX_ERROR_TEXT,
    MAX_SECAGG_NEIGHBOURS,
    SECAGG_CODEC,
    SECAGG_UP,
    ErrorMessage,
    Invitation,
    Outgoing,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    WireError,
    chunk,
    chunk_count,
    decode_chunk,
    decode_secagg,
    decode_update_meta,
)

if TYPE_CHECKING:
    from fedper.coordinator.secure_round import SecureRound

log = logging.getLogger("fedper.coordinator")

AGGREGATORS: dict[str, Callable[[], Any]] = {
    "mean": WeightedMean,
    "median": CoordinateMedian,
    "trimmed-mean": TrimmedMean,
}
MAX_REJECTED_PER_DEVICE = 1_000  # refused blob ids remembered per device (its later chunks are dropped unanswered)
MAX_REJECTED_DEVICES = 10_000
DEFAULT_MAX_SAMPLES_PER_DEVICE = 1_000_000  # a registration claiming more is refused (too_many_samples)
DEFAULT_REASSEMBLY_BYTES = 1 << 30  # all devices' partial uploads together, unless 4 devices' quotas are more
PARTIAL_EVERY = 8  # weighted mean (or DP rule): a checkpoint of its float64 sum per this many accepted updates


@dataclass(frozen=True)
class Config:
    rounds: int
    min_clients: int
    round_timeout: float
    chunk_size: int = DEFAULT_CHUNK_SIZE
    aggregator: str = "mean"
    clip_norm: float | None = None
    max_samples_per_device: int = DEFAULT_MAX_SAMPLES_PER_DEVICE  # the cap on a device's claimed n_j
    max_open_blobs: int = 64  # partial update blobs of all devices together; a newcomer beyond is refused
    max_uploads_per_device: int = 2  # partial update blobs per device: its newer one displaces its oldest
    max_upload_bytes_per_device: int | None = None  # bytes held in them; None: two blobs of the model
    max_reassembly_bytes: int | None = None  # all devices' partial blobs; None: DEFAULT_REASSEMBLY_BYTES
    max_messages_per_second: float = 1000.0  # per device (coordinator/quota.py); more are dropped unread
    state_interval: float = 0.5  # at most one state message (and one invitation top-up) per this many seconds
    clients_per_round: int | None = None  # M: a round closes at M accepted updates; None: every registered device
    over_select: float = 1.0  # F: a round invites ceil(F * M) devices, to absorb those that drop out
    selection_seed: int | None = None  # the seed of fedper.selection's ranking; None: a secret drawn per process
    dp_noise_multiplier: float | None = None  # z: DP-FedAvg with noise std z * clip_norm on the sum; None: no DP
    dp_delta: float = DEFAULT_DELTA
    dp_target_epsilon: float | None = None  # the budget: no round opens whose projected epsilon exceeds it
    dp_budget_action: str = "stop"  # at the budget: "stop" or "warn"
    dp_adaptive_quantile: float | None = None  # adaptive clipping: the quantile of update norms C tracks
    secure_aggregation: bool = False  # SecAgg+ (coordinator/secure_round.py): only the sum is learned
    secagg_stage_timeout: float = 30.0  # seconds each of its stages 2-4 waits for the devices
    secagg_degree: int | None = None  # its neighbour degree k; None: fedper.secagg's default (O(log n))


@dataclass
class _Privacy:
    """The run's DP state that a restart must keep: the noise secret (as sensitive as the clear updates:
    whoever knows it can subtract the noise), the accountant, and whether the budget stopped the run."""

    secret: int
    accountant: PrivacyAccountant
    epsilon: float = 0.0  # after the closed rounds (cached: the state message is sent often)
    stopped: bool = False
    clipping: AdaptiveClipping | None = None  # with --dp-adaptive-clipping: the clip norm of the open round


@dataclass(frozen=True)
class Registration:
    """What a device said about itself: its n_j (which each of its updates must repeat) and its software."""

    n_samples: int
    software: str


@dataclass(frozen=True)
class Folded:
    """An update folded into the open round's aggregate: the weight it was folded with and its metrics."""

    n_samples: int
    metrics: dict[str, float]


@dataclass
class _Files:
    """The tensor files of the checkpoint that state.json names as current."""

    model: str = ""  # the open round's model; "" until the first start writes it
    partial: str | None = None  # the weighted mean's float64 running sum, if one was written this round
    updates: dict[str, str] = field(default_factory=dict)  # device -> its accepted update as received, after it


@dataclass
class _Round:
    """What a restart must not lose about the open round."""

    number: int
    folded: dict[str, Folded] = field(default_factory=dict)  # by device
    bytes_received: int = 0
    extensions: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    selected: bool = False  # with --clients-per-round: its opening selection is made (and checkpointed)
    invited: set[str] = field(default_factory=set)  # the devices it invited, the opening selection and top-ups
    invite_cap: int = 0  # invitations it may make: ceil(F * M), raised at an extension to replace dropouts


def _json_epsilon(epsilon: float) -> float | None:
    """Epsilon for JSON (metrics.jsonl, the state topic): null when unbounded (a noise multiplier of 0), since
    JSON has no infinity."""
    return epsilon if math.isfinite(epsilon) else None


class Coordinator:
    def __init__(self, manifest: Manifest, initial: Mapping[str, np.ndarray], topics: Topics, config: Config,
                 store: Store) -> None:
        if config.aggregator not in AGGREGATORS:
            raise ValueError(f"unknown aggregator {config.aggregator!r}; choose one of {', '.join(AGGREGATORS)}")
        if config.rounds < 1 or config.min_clients < 1:
            raise ValueError("rounds and min_clients must be >= 1")
        self.selecting = config.clients_per_round is not None  # else every registered device takes part
        # secret, so no device learns its future rounds; under DP also what the "fixed" sampling assumes
        self._seed = new_seed() if config.selection_seed is None else config.selection_seed
        if config.dp_noise_multiplier is not None and config.selection_seed is not None:
            check_seed(config.selection_seed)
        if not self.selecting and config.over_select != 1.0:
            raise ValueError("--over-select needs --clients-per-round: without it every registered device takes part")
        if config.clients_per_round is not None:
            self._invitations = invitations(config.clients_per_round, config.over_select)
            if config.min_clients > config.clients_per_round:
                raise ValueError(f"--min-clients {config.min_clients} is above --clients-per-round "
                                 f"{config.clients_per_round}: a round closes at --clients-per-round updates")
        self.manifest, self.topics, self.config, self.store = manifest, topics, config, store
        self.dp = self._privacy(config)
        self._check_secure(manifest, config)
        self._secure: SecureRound | None = None  # the open round's session, with --secure-aggregation
        self.secagg_failures = 0  # sessions that could not finish in this process (monitoring; not checkpointed)
        self.digest = manifest.base_digest
        self.model = decode_shared(manifest, encode_shared(manifest, initial))  # validated copy
        self.registered: dict[str, Registration] = {}
        self.counters: Counter[str] = Counter()
        self.round = _Round(1)
        self.finished = False
        self.online: set[str] = set()
        self.fold_seconds = 0.0  # spent folding and checkpointing accepted updates in this process (monitoring)
        self.bytes_sent = 0  # payload bytes the service published for this process (monitoring)
        self._aggregator: Any = self._new_rule()
        self._dp_partial_meta: dict[str, Any] | None = None  # the DP rule's meta when its partial sums were written
        self._reassembler, self._rate = self._quotas(manifest, config)
        self._rejected: dict[str, set[str]] = {}  # device -> blob ids refused (and answered) in the open round
        self._deadline = 0.0
        self._opened_at = 0.0
        self._broadcast_s = 0.0
        self._model_blob: tuple[str, bytes, list[bytes], str] | None = None  # id, blob, frames, sha256
        self._published_blob: tuple[str, int] | None = None  # retained chunks to clear when the model changes
        self._state_dirty = True
        self._last_state = -1e18
        self._registry_dirty = False  # a registration changed since the registry file was last written
        self._registry_file: str | None = None  # the registry file state.json names (None: nobody registered)
        self._written_registry: dict[str, Registration] = {}  # what that file holds
        self._last_registry_commit = -1e18
        self._last_top_up = -1e18
        self._files = _Files()
        saved = store.load_state()
        if saved is not None:
            self._resume(saved)

    # ------------------------------------------------------------ life cycle

    def start(self, now: float) -> list[Outgoing]:
        """Open the current round (round 1 on a fresh state directory) and announce it."""
        fresh = not self._files.model
        if fresh:
            self._files.model = self.store.write_tensors("model-r1.safetensors", self.model)
        selecting = self.selecting and not self.finished and not self.round.selected
        if selecting:
            self._select()
        if fresh or selecting or self._registry_dirty:  # dirty here: a registry migrated out of state.json
            self._commit(registry=True)
        self._opened_at = now
        self._deadline = now + self.config.round_timeout
        self._new_session()
        return self.announce(now)

    def _resume(self, saved: dict[str, Any]) -> None:
        """Pick up the checkpoint of an earlier run in the same state directory."""
        if saved.get("base_digest") != self.digest:
            raise ValueError(f"{self.store.dir} holds the state of a run with another export (base_digest "
                             f"{saved.get('base_digest')}): use a fresh --state-dir")
        self.model = decode_shared(self.manifest, encode_shared(self.manifest, self.store.read_tensors(saved["model"])))
        self._files.model = saved["model"]
        registry = self.store.load_registry(saved)
        self.registered = {device: Registration(**entry) for device, entry in registry.items()}
        self._registry_file = saved.get("registry")
        self._written_registry = dict(self.registered) if self._registry_file else {}
        if "registry" not in saved:  # written before the registry had its own file: start() moves it there
            log.info("migrating %d registration(s) from %s into a registry file", len(self.registered), self.store.dir)
            self._registry_dirty = True
        self.counters = Counter(saved["counters"])
        self.finished = saved["finished"]
        r = saved["round"]
        folded = {device: Folded(**entry) for device, entry in r["folded"].items()}
        self.round = _Round(r["number"], folded, r["bytes_received"], r["extensions"], Counter(r["rejected"]))
        if self.selecting and "selection" in r:  # the open round keeps its invitations, whatever the seed is now
            self.round.selected = True
            self.round.invited = set(r["selection"]["invited"])
            self.round.invite_cap = r["selection"]["invite_cap"]
        if (self.dp is None) != ("dp" not in saved):
            raise ValueError(f"{self.store.dir} holds a run {'without' if self.dp else 'with'} differential "
                             f"privacy: resume it with the same mode, or use a fresh --state-dir")
        if self.dp is not None:
            self.dp.secret = int(saved["dp"]["secret"], 16)
            self.dp.accountant = PrivacyAccountant.from_json(saved["dp"]["accountant"])
            self.dp.stopped = saved["dp"]["stopped"]
            self.dp.epsilon = self.dp.accountant.epsilon()
            if self.dp.clipping is not None:  # the clip norm the run has adapted to, not --clip-norm's start
                self.dp.clipping = AdaptiveClipping.from_json(saved["dp"]["clipping"])
            self._aggregator = self._new_rule()
        if saved.get("partial"):
            self._files.partial = saved["partial"]
            sums = self.store.read_tensors(saved["partial"])
            if self.dp is not None:
                self._dp_partial_meta = saved["dp"]["partial_meta"]
                self._aggregator = DPFedAvg.resume(self.model, sums, self._dp_partial_meta,
                                                   round_generator(self.dp.secret, self.round.number))
            else:
                blobs = saved.get("updates", {})  # the partial sum holds the folded updates not kept as blobs
                in_partial = [f.n_samples for device, f in self.round.folded.items() if device not in blobs]
                dtypes = {t.name: t.dtype for t in self.manifest.shared_tensors}
                self._aggregator = WeightedMean.from_sums(sums, float(sum(in_partial)), len(in_partial), dtypes)
        for device, blob_name in saved.get("updates", {}).items():
            self._files.updates[device] = blob_name
            tensors = decode_shared(self.manifest, self.store.read_bytes(blob_name), base=self.model)
            self._aggregator.add(self._prepared(tensors), self.round.folded[device].n_samples)
        log.info("resumed from %s: round %d of %d, %d update(s) already accepted, %d device(s) registered",
                 self.store.dir, self.round.number, self.config.rounds, len(self.round.folded), len(self.registered))

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
            _, device = self.topics.parse(topic)
        except WireError:
            return True
        return self._rate.admit(device, now)

    def handle(self, topic: str, payload: bytes, now: float, *, admitted: bool = False) -> list[Outgoing]:
        """One incoming message; a bad one is refused before it changes anything, logged once, counted and
        answered on its device's error topic (a chunk of a blob already refused is dropped: one answer per
        blob). admitted: `admit` passed it already (its rate token is spent). Raises only CheckpointError."""
        device = None
        try:
            kind, device = self.topics.parse(topic)
            if not admitted and not self._rate.admit(device, now):
                return self._count_rate_limited(now)
            if kind == "register":
                return self._on_register(device, payload)
            if kind == "presence":
                self._on_presence(device, payload)
                return []
            if kind == "secagg":
                return self._on_secagg(device, payload, now)
            return self._on_update(device, payload, now)
        except WireError as e:
            return self._reject(device, e.code, str(e))
        except CheckpointError:
            raise  # the service must stop unacknowledged: the broker redelivers to the restarted one
        except Exception as e:  # a bug must cost one message, never the service; the device hears of it
            return self._reject(device, "internal_error", f"{type(e).__name__}: {e}", error=e)

    def tick(self, now: float) -> list[Outgoing]:
        """Count the messages the rate limit dropped; close the round when it is complete or its deadline has
        passed with a quorum; checkpoint changed registrations (at most once per state_interval) and publish
        the state when it changed."""
        out = self._count_rate_limited(now)
        if self._secure is not None and not self.finished:
            out += self._secure_tick(now)
        elif not self.finished:
            done = len(self.round.folded)
            everyone = self.registered.keys() <= self.round.folded.keys()
            complete = everyone or (self.selecting and done >= (self.config.clients_per_round or 0))
            if done >= self.config.min_clients and (complete or now >= self._deadline):
                out += self._close_round(now)
            elif now >= self._deadline:
                out += self._extend(now, done, "update(s)")
        if self.selecting and not self.finished and now - self._last_top_up >= self.config.state_interval:
            self._last_top_up = now  # devices that come online within one interval are ranked together
            out += self._top_up()
        if self._registry_dirty and now - self._last_registry_commit >= self.config.state_interval:
            self._last_registry_commit = now  # registrations are checkpointed at this pace, however often they
            self._commit(registry=True)  # change: a device re-registering in a loop must not buy an fsync each
        if self._state_dirty and now - self._last_state >= self.config.state_interval:
            out.append(self.state_message(now))
        return out

    def _extend(self, now: float, done: int, what: str) -> list[Outgoing]:
        """The deadline passed below --min-clients: wait one more round_timeout (replacing dropouts when selecting)."""
        self.round.extensions += 1
        if self.selecting:
            self._replace_dropouts()
        self._deadline = now + self.config.round_timeout
        log.warning("round %d: deadline passed with %d/%d %s, fewer than --min-clients %d: waiting %.1f s more "
                    "(extension %d)", self.round.number, done, self.invited_count, what, self.config.min_clients,
                    self.config.round_timeout, self.round.extensions)
        self._state_dirty = True
        return [self._round_message()]

    def note_broadcast(self, seconds: float) -> None:
        self._broadcast_s += seconds

    def note_sent(self, n_bytes: int) -> None:
        """The service published this many payload bytes (monitoring; not checkpointed)."""
        self.bytes_sent += n_bytes

    # ------------------------------------------------------------ messages

    def _on_register(self, device: str, payload: bytes) -> list[Outgoing]:
        if not payload:  # the device cleared its retained registration: it left the fleet
            if self.registered.pop(device, None) is not None:
                log.info("unregistered %s", device)
                self._registry_dirty = self._state_dirty = True
            return []
        msg = Register.decode(payload)  # every field checked: n_samples an integer in 1..2**53-1
        if msg.base_digest != self.digest:
            raise WireError("digest_mismatch", f"manifest base_digest {msg.base_digest} is not the coordinator's "
                            f"{self.digest}: use the same export")
        if msg.n_samples > self.config.max_samples_per_device:
            raise WireError("too_many_samples", f"n_samples {msg.n_samples} is above the coordinator's "
                            f"--max-samples-per-device {self.config.max_samples_per_device}: not registered")
        entry = Registration(msg.n_samples, msg.software)  # replaces an earlier one: see docs/reliability.md
        if self.registered.get(device) != entry:
            log.info("registered %s: %d samples, software %s", device, msg.n_samples, msg.software)
            self.registered[device] = entry
            self._registry_dirty = self._state_dirty = True
        return []

    def _on_presence(self, device: str, payload: bytes) -> None:
        status = bytes(payload)
        if status not in (b"online", b"offline", b""):  # b"": the retained presence cleared
            raise WireError("bad_message", f"presence must be online or offline, got {len(status)} other bytes")
        (self.online.add if status == b"online" else self.online.discard)(device)
        self._state_dirty = True

    def _on_update(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        self.round.bytes_received += len(payload)
        chunk = decode_chunk(payload)  # its declared size is checked below, once per blob
        if chunk.blob_id in self._rejected.get(device, ()):
            return []  # the rest of a blob already refused (and answered) once
        try:
            registration = self.registered.get(device)
            if registration is None:
                raise WireError("unknown_device", f"{device} has not registered: publish register/{device} first")
            meta = decode_update_meta(chunk.meta)  # every field checked: types, ranges, metrics' names and values
            if meta.round != self.round.number:
                raise WireError("late_update", f"update for round {meta.round}, but round {self.round.number} is open")
            if self.selecting and device not in self.round.invited:  # before reassembly: it costs no memory
                raise WireError("not_invited", f"{device} is not invited to round {meta.round}: wait for an "
                                f"invitation on {self.topics.invite(device)}")
            if device in self.round.folded:
                raise WireError("duplicate_update", f"round {meta.round} update already accepted from {device}")
            if meta.base_digest != self.digest:
                raise WireError("digest_mismatch", f"update base_digest {meta.base_digest} is not {self.digest}")
            if meta.n_samples > self.config.max_samples_per_device:  # registered under a higher cap before a restart
                raise WireError("too_many_samples", f"n_samples {meta.n_samples} is above --max-samples-per-device "
                                f"{self.config.max_samples_per_device}")
            if meta.n_samples != registration.n_samples:
                raise WireError("n_samples_mismatch", f"the update claims {meta.n_samples} samples, {device} "
                                f"registered {registration.n_samples}: re-register, then resend")
            if (meta.codec == SECAGG_CODEC) != (self._secure is not None):
                raise WireError("secagg", "this round runs secure aggregation: run the agent with "
                                "--secure-aggregation" if self._secure else "this round takes clear updates")
            blob = self._reassembler.add(device, chunk)
            if blob is None:
                return []
            if self._secure is not None:
                self._secure.on_masked(device, blob.data, meta.n_samples, meta.metrics)
                return self._secure_progress(now)
            tensors = self._prepared(decode_shared(self.manifest, blob.data, meta.codec, base=self.model))
            self._fold(device, tensors, blob.data, meta.n_samples, meta.metrics)
        except CheckpointError:
            raise
        except Exception:  # refused as a whole blob: its other chunks are dropped, the device is answered once
            self._remember_rejected(device, chunk.blob_id)
            self._reassembler.discard(device)
            raise
        return []

    def _fold(self, device: str, tensors: Mapping[str, np.ndarray], blob: bytes, n_samples: int,
              metrics: dict[str, float]) -> None:
        """Fold an update checked in full (tensors prepared) into the round: the aggregator's add is all or
        nothing, and nothing else changes before it succeeded."""
        k, started = self.round.number, time.perf_counter()
        try:
            self._aggregator.add(tensors, n_samples)
        except ValueError as e:
            raise WireError("rejected", f"the aggregation rule refused the update: {e}") from None
        self.round.folded[device] = Folded(n_samples, metrics)
        files = self._files
        if isinstance(self._aggregator, (WeightedMean, DPFedAvg)) and len(files.updates) + 1 >= PARTIAL_EVERY:
            files.partial = self.store.write_tensors(f"partial-r{k}-{len(self.round.folded)}.safetensors",
                                                     self._aggregator.sums())
            if self.dp is not None:
                self._dp_partial_meta = self._aggregator.meta()
            files.updates = {}  # the partial covers them; the commit deletes their files
        else:
            files.updates[device] = self.store.write_bytes(f"update-r{k}-{device}.safetensors", blob)
        self.counters["accepted"] += 1
        self._commit(registry=self._written_registry.get(device) != self.registered.get(device))  # see _commit
        self.fold_seconds += time.perf_counter() - started
        log.debug("round %d: accepted %s (%d samples, accuracy %s) [%d/%d]", k, device, n_samples,
                 metrics.get("accuracy", "n/a"), len(self.round.folded), self.invited_count)

    def _prepared(self, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Clipped (with --clip-norm) against the round's base; under DP the rule clips (the trainable tensors)."""
        if self.config.clip_norm is not None and self.dp is None:
            tensors = clip_update(tensors, self.model, self.config.clip_norm)
        return tensors

    def _reject(self, device: str | None, code: str, message: str, error: Exception | None = None) -> list[Outgoing]:
        """Count, log (one record, with the traceback of an internal `error`) and answer a refused message;
        a topic that names no device has nobody to answer."""
        self.counters[code] += 1
        self.round.rejected[code] += 1
        self._state_dirty = True
        log.warning("rejected %s from %s: %s", code, device or "?", message, exc_info=error)
        if device is None:
            return []
        answer = ErrorMessage(code, message[:MAX_ERROR_TEXT], self.round.number)
        return [Outgoing(self.topics.error(device), answer.encode())]

    @staticmethod
    def _quotas(manifest: Manifest, config: Config) -> tuple[Reassembler, MessageRateLimit]:
        """Per-device quotas (docs/reliability.md, "Untrusted devices"): in-flight uploads, their
        bytes and the message rate, each sized so that an honest device's upload always fits."""
        blob = max_blob_size(manifest)
        if config.secure_aggregation:  # a masked input holds 4 bytes (uint32) per value, whatever the dtypes
            blob = max(blob, 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in manifest.shared_tensors) + 4096)
        per_device = config.max_upload_bytes_per_device or 2 * blob + Reassembler.PARTIAL_COST
        everyone = config.max_reassembly_bytes or max(DEFAULT_REASSEMBLY_BYTES, 4 * per_device)
        if per_device < blob or everyone < per_device:
            raise ValueError(f"--max-upload-bytes-per-device ({per_device}) must hold one update of the model "
                             f"({blob} bytes) and --max-reassembly-bytes ({everyone}) one device's quota")
        if config.max_uploads_per_device < 1 or config.max_open_blobs < 1:
            raise ValueError("--max-uploads-per-device and max_open_blobs must be >= 1")
        reassembler = Reassembler(blob, config.max_open_blobs, max_blobs_per_source=config.max_uploads_per_device,
                                  max_bytes_per_source=per_device, max_bytes=everyone)
        upload = chunk_count(blob, config.chunk_size)  # messages of one update at the coordinator's chunk size
        rate = config.max_messages_per_second
        return reassembler, MessageRateLimit(rate, burst=max(BURST_SECONDS * rate, 2 * upload + 16))

    def _count_rate_limited(self, now: float) -> list[Outgoing]:
        """Messages dropped unread since the last call (here or by `admit` in the service's network thread):
        all counted; logged and answered once per report window per device."""
        out: list[Outgoing] = []
        for device, count in self._rate.take_dropped().items():
            self.counters["rate_limited"] += count
            self.round.rejected["rate_limited"] += count
            self._state_dirty = True
            dropped = self._rate.report_due(device, now)
            if dropped:
                message = (f"dropped {dropped} message(s) unread since the last report: above "
                           f"--max-messages-per-second {self.config.max_messages_per_second:g}")
                log.warning("rate_limited %s: %s", device, message)
                out.append(Outgoing(self.topics.error(device),
                                    ErrorMessage("rate_limited", message, self.round.number).encode()))
        return out

    def _remember_rejected(self, device: str, blob_id: str) -> None:
        """Per device, so that one device's flood of refused blobs never makes another's be answered twice."""
        if device not in self._rejected and len(self._rejected) >= MAX_REJECTED_DEVICES:
            self._rejected.clear()
        refused = self._rejected.setdefault(device, set())
        if len(refused) >= MAX_REJECTED_PER_DEVICE:
            refused.clear()
        refused.add(blob_id)

    # ------------------------------------------------------------ selection (--clients-per-round)

    def _select(self) -> None:
        """The opening selection of the (new) open round, among the devices registered and online now; the
        caller checkpoints it. Fewer than ceil(F * M) of them: _top_up invites more as they come online."""
        r = self.round
        r.selected, r.invite_cap = True, self._invitations
        r.invited = set(select(self._eligible(), r.invite_cap, seed=self._seed, round_=r.number))
        log.info("round %d: invited %d of %d device(s) online", r.number, len(r.invited), len(self.online))

    def _eligible(self) -> set[str]:
        return self.online & self.registered.keys()

    def _top_up(self) -> list[Outgoing]:
        """Invite eligible devices not invited yet, next in the seeded ranking, while the round has room;
        checkpointed before the invitations go out, so a restart re-sends the same ones."""
        r = self.round
        room = r.invite_cap - len(r.invited)
        if room <= 0:
            return []
        chosen = select(self._eligible() - r.invited, room, seed=self._seed, round_=r.number)
        if not chosen:
            return []
        r.invited.update(chosen)
        self._commit()
        log.info("round %d: invited %d more device(s) that came online [%d/%d]", r.number, len(chosen),
                 len(r.invited), r.invite_cap)
        return [self._invitation(device) for device in chosen]

    def _replace_dropouts(self) -> None:
        """At an extension (the deadline passed below --min-clients): make room for as many new invitations
        as invited devices went offline without answering, so the round still has ceil(F * M) that may answer.
        A dropout stays invited: its update is accepted if it comes back."""
        r = self.round
        live = len(r.invited & (r.folded.keys() | self.online))
        r.invite_cap = max(r.invite_cap, len(r.invited) + self._invitations - live)
        self._last_top_up = -1e18  # top up at once

    # ------------------------------------------------------------ rounds

    def _close_round(self, now: float) -> list[Outgoing]:
        started = time.perf_counter()
        closed = self.round
        if self.dp is not None and self._secure is None:
            self._ready_to_release()
        if self._secure is not None:
            result = self._secure.model(self.manifest, self.model)
        else:
            result = self._aggregator.result()
        self.model = {t.name: result[t.name].astype(t.dtype) for t in self.manifest.shared_tensors}
        aggregate_s = time.perf_counter() - started
        record = self._metrics(closed, now, aggregate_s)
        last = closed.number >= self.config.rounds
        if self._secure is not None:
            record["secagg"] = {"session": self._secure.session, "devices": len(self._secure.roster),
                                "sum_refused": self._secure.refused_sum or None}
        if self.dp is not None:
            record["dp"] = self._account(closed, last)  # then adapts the clip norm for the next round
        self.finished = last or (self.dp is not None and self.dp.stopped)
        self.round = _Round(closed.number if self.finished else closed.number + 1)
        if self.selecting and not self.finished:
            self._select()
        self._aggregator = self._new_rule()
        self._dp_partial_meta = None
        self._reassembler.discard()
        self._rejected.clear()
        self._files = _Files(self.store.write_tensors(f"model-r{closed.number + 1}.safetensors", self.model))
        if self.finished:
            self.store.write_tensors(FINAL_FILE, self.model)
        self._commit(registry=True)  # once a round, registrations changed since the last tick go with it
        self.store.append_metrics(record)
        log.info("round %d closed: %d participant(s), %d samples, accuracy %.4f ± %.4f, %.1f KiB received",
                 closed.number, record["participants"], record["n_samples"], record["accuracy_mean"] or 0.0,
                 record["accuracy_std"] or 0.0, record["bytes_received"] / 1024)
        self._opened_at, self._deadline, self._broadcast_s = now, now + self.config.round_timeout, 0.0
        self._model_blob = None
        self._new_session()
        stale = sorted(closed.invited - self.round.invited)  # retained invitations of the closed round
        cleared = [Outgoing(self.topics.invite(device), b"", retain=True) for device in stale]
        return cleared + self.announce(now)

    def _metrics(self, closed: _Round, now: float, aggregate_s: float) -> dict[str, Any]:
        accuracies = [f.metrics["accuracy"] for f in closed.folded.values() if "accuracy" in f.metrics]
        return {
            "round": closed.number,
            "participants": len(closed.folded),
            "devices": sorted(closed.folded),
            "registered": len(self.registered),
            "n_samples": sum(f.n_samples for f in closed.folded.values()),
            "accuracy_mean": float(np.mean(accuracies)) if accuracies else None,
            "accuracy_std": float(np.std(accuracies)) if accuracies else None,
            "bytes_received": closed.bytes_received,
            "broadcast_s": round(self._broadcast_s, 4),
            "collect_s": round(now - self._opened_at, 4),
            "aggregate_s": round(aggregate_s, 4),
            "deadline_extensions": closed.extensions,
            "rejected": dict(closed.rejected),
            "time": now,
            **({"invited": len(closed.invited)} if self.selecting else {}),
        }

    # ------------------------------------------------------------ secure aggregation (--secure-aggregation)

    @staticmethod
    def _check_secure(manifest: Manifest, config: Config) -> None:
        if not config.secure_aggregation:
            return
        if config.clip_norm is None or not (math.isfinite(config.clip_norm) and config.clip_norm > 0):
            raise ValueError("--secure-aggregation needs --clip-norm C > 0: each device clips its delta to L2 norm "
                             "C, and [-C, C] is the range its values are quantized in")
        if config.aggregator != "mean":
            raise ValueError("--secure-aggregation sums the updates: it combines with --aggregator mean only")
        if config.dp_adaptive_quantile is not None:
            raise ValueError("--dp-adaptive-clipping needs the count of unclipped updates, which secure aggregation "
                             "hides: use a fixed --clip-norm")
        if config.secagg_degree is not None and (
                not 2 <= config.secagg_degree <= MAX_SECAGG_NEIGHBOURS or config.secagg_degree % 2):
            raise ValueError(f"--secagg-degree must be an even number in 2..{MAX_SECAGG_NEIGHBOURS}")
        if not config.secagg_stage_timeout > 0:
            raise ValueError("--secagg-stage-timeout must be > 0")
        odd = [t.name for t in manifest.shared_tensors if not np.issubdtype(np.dtype(t.dtype), np.floating)]
        if odd:
            raise ValueError(f"--secure-aggregation sums floating-point tensors; {odd[:3]} are not")
        try:
            import fedper.secagg  # noqa: F401  (cryptography, the privacy extra)
        except ImportError as e:
            raise ValueError(f"--secure-aggregation needs the privacy extra ({e}): pip install "
                             "'fedper-edge[privacy]'") from None

    def _new_session(self) -> None:
        """The open round's (new) secure-aggregation session; devices learn it from RoundInfo."""
        if not self.config.secure_aggregation or self.finished:
            self._secure = None
            return
        from fedper.coordinator.secure_round import SecureRound, flat_length, new_session

        c = self.config
        tensors = "shared" if self.dp is None else "trainable"  # DP: private_tensor_names, as DPFedAvg
        self._secure = SecureRound(self.round.number, new_session(), float(c.clip_norm or 0),
                                   flat_length(self.manifest, tensors), c.secagg_stage_timeout, c.secagg_degree,
                                   tensors=tensors)

    def _on_secagg(self, device: str, payload: bytes, now: float) -> list[Outgoing]:
        if self._secure is None:
            raise WireError("secagg", "this coordinator does not run secure aggregation (or the run is finished)")
        if device not in self.registered:
            raise WireError("unknown_device", f"{device} has not registered: publish register/{device} first")
        if self.selecting and device not in self.round.invited:
            raise WireError("not_invited", f"{device} is not invited to round {self.round.number}")
        self._secure.on_message(device, decode_secagg(payload, SECAGG_UP))
        self._state_dirty = True  # the state's secagg entry (at most one state message per state_interval)
        return self._secure_progress(now)

    def _secure_progress(self, now: float) -> list[Outgoing]:
        """Close a stage of the session (2-4) as soon as every device it waits for has answered."""
        secure = self._secure
        if secure is None or not secure.complete:
            return []
        return self._secure_step(now)

    def _secure_tick(self, now: float) -> list[Outgoing]:
        """Stage 1 closes like a plain round (everyone, M with selection, or the deadline with a quorum); the
        later stages at their own deadlines. A done session closes the round; a failed one is replaced."""
        secure = self._secure
        assert secure is not None
        if secure.stage == "advertise":
            done = len(secure.adverts.keys() & self.registered.keys())
            expected = self.round.invited if self.selecting else self.registered.keys()
            complete = expected <= secure.adverts.keys() or (
                self.selecting and done >= (self.config.clients_per_round or 0))
            if done >= max(self.config.min_clients, 2) and (complete or now >= self._deadline):
                if self.dp is not None:  # each device's share of the noise: the sum of m of them has std z * C
                    m = float(self._expected_participants())
                    secure.expected_weight = m
                    secure.noise_std = float(self.config.dp_noise_multiplier or 0) * secure.clip / math.sqrt(m)
                registered = {d: r.n_samples for d, r in self.registered.items()}
                return secure.close_adverts(registered, now, self.topics) + self._secure_step(now, closing=False)
            return self._extend(now, done, "advertisement(s)") if now >= self._deadline else []
        return self._secure_step(now) if now >= secure.deadline else []

    def _secure_step(self, now: float, closing: bool = True) -> list[Outgoing]:
        """Close the open stage (closing), then act on where the session is: done closes the round, failed opens
        a new session in the same round."""
        secure = self._secure
        assert secure is not None
        out = secure.close_open_stage(now, self.topics, max(self.config.min_clients, 2)) if closing else []
        self._state_dirty = True
        if secure.stage == "done":
            self.round.folded = {d: Folded(n, metrics) for d, (n, metrics) in secure.contributions().items()}
            self.counters["accepted"] += len(self.round.folded)
            refused = secure.check_sum()
            if refused:
                log.warning("round %d: the secure sum is not released, the model stays as it was: %s",
                            self.round.number, refused)
            return out + self._close_round(now)
        if secure.stage == "failed":
            self.secagg_failures += 1
            self._new_session()
            self._deadline = max(self._deadline, now + self.config.round_timeout)
            self._reassembler.discard()
            return [*out, self._round_message()]
        return out

    # ------------------------------------------------------------ differential privacy (--dp-noise-multiplier)

    @staticmethod
    def _privacy(config: Config) -> _Privacy | None:
        """The run's DP state, a fresh secret (a resumed run replaces it with its own); None without DP."""
        z = config.dp_noise_multiplier
        if z is None:
            if config.dp_target_epsilon is not None or config.dp_adaptive_quantile is not None:
                raise ValueError("--dp-target-epsilon and --dp-adaptive-clipping need --dp-noise-multiplier")
            return None
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"--dp-noise-multiplier must be >= 0, got {z}")
        if config.clip_norm is None or not config.clip_norm > 0:
            raise ValueError("--dp-noise-multiplier needs --clip-norm > 0: the bound each update is clipped to")
        if config.aggregator != "mean":
            raise ValueError(f"--dp-noise-multiplier replaces the mean with DP-FedAvg; --aggregator "
                             f"{config.aggregator} cannot be combined with it")
        if config.dp_budget_action not in ("stop", "warn"):
            raise ValueError(f"--dp-budget-action must be stop or warn, got {config.dp_budget_action!r}")
        clipping = None
        if config.dp_adaptive_quantile is not None:
            clipping = AdaptiveClipping(config.clip_norm, target_quantile=config.dp_adaptive_quantile)
        accountant = PrivacyAccountant(config.dp_delta, sampling="fixed" if config.clients_per_round else "poisson")
        try:
            accountant.epsilon()  # imports dp-accounting now rather than at the first round's close
        except ImportError as e:
            raise ValueError(str(e)) from None
        dp = _Privacy(secrets.randbits(128), accountant, clipping=clipping)
        if not config.clients_per_round and budget_action(accountant.projected_epsilon(1.0, z),
                                                          config.dp_target_epsilon, "stop") == "stop":
            raise ValueError(f"--dp-target-epsilon {config.dp_target_epsilon}: one round with every device at "
                             f"noise multiplier {z} already spends more (epsilon "
                             f"{accountant.projected_epsilon(1.0, z):.4g} at delta {config.dp_delta})")
        return dp

    def _new_rule(self) -> Any:
        """The open round's aggregation rule: DP-FedAvg with this round's noise under DP, else --aggregator."""
        if self.dp is None:
            return AGGREGATORS[self.config.aggregator]()
        clip_norm = self.dp.clipping.clip_norm if self.dp.clipping else self.config.clip_norm
        return DPFedAvg(self.model, clip_norm=float(clip_norm or 0), expected_weight=1.0,
                        noise_multiplier=float(self.config.dp_noise_multiplier or 0),
                        rng=round_generator(self.dp.secret, self.round.number),
                        private_names=private_tensor_names(self.manifest))

    def _ready_to_release(self) -> None:
        """The closing round's denominator and adaptive clipping's split of z (fedper.privacy.prepare_release)."""
        assert self.dp is not None
        prepare_release(self._aggregator, float(self._expected_participants()),
                        self.config.dp_noise_multiplier or 0.0, self.dp.clipping)

    def _expected_participants(self) -> int:
        """DP-FedAvg's denominator m: the updates a round closes at (M with --clients-per-round, else every
        registered device), whoever actually answered: data-independent, so the noise z*C/m hides one device."""
        return max(1, self.config.clients_per_round or len(self.registered))

    def _sampling_rate(self, closed: _Round) -> float:
        """q for the accountant: with --clients-per-round, invited / the devices they were drawn from (eligible
        now or invited), sampled without replacement (docs/privacy.md); else 1."""
        if not self.selecting:
            return 1.0
        return min(1.0, max(len(closed.invited), 1) / max(len(self._eligible() | closed.invited), 1))

    def _account(self, closed: _Round, last: bool) -> dict[str, Any]:
        """Record the released round, then check the next one's projected epsilon against the budget; the
        closed round's DP figures for metrics.jsonl."""
        dp, config, rule = self.dp, self.config, self._aggregator
        assert dp is not None
        z, q = float(config.dp_noise_multiplier or 0), self._sampling_rate(closed)
        release = {"clip_norm": rule.clip_norm, "noise_std": rule.noise_std, "expected": rule.expected_weight,
                   "unclipped": rule.unclipped, "count": rule.count}
        if self._secure is not None:  # distributed noise: what the contributors' shares of it add up to
            secure = self._secure
            z = secure.noise_multiplier()
            m = float(secure.expected_weight or 1)
            release = {"clip_norm": secure.clip, "noise_std": z * secure.clip / m, "expected": m,
                       "unclipped": None, "count": len(closed.folded)}
        if config.dp_delta * len(self.registered) >= 1:
            log.warning("--dp-delta %g is not below 1/N for N = %d registered devices: epsilon means little",
                        config.dp_delta, len(self.registered))
        dp.accountant.record(q, z)
        dp.epsilon = dp.accountant.epsilon()
        if not last:
            projected = dp.accountant.projected_epsilon(q, float(config.dp_noise_multiplier or 0))
            action = budget_action(projected, config.dp_target_epsilon, config.dp_budget_action)
            if action != "continue":
                log.warning("privacy budget: round %d would bring epsilon to %.4g, above --dp-target-epsilon %g "
                            "(delta %g)%s", closed.number + 1, projected, config.dp_target_epsilon, config.dp_delta,
                            f": run stopped, the final model is round {closed.number}'s" if action == "stop"
                            else ": going on (--dp-budget-action warn)")
                dp.stopped = action == "stop"
        log.info("round %d: DP epsilon %.4g at delta %g (q %.4g, z %g, %s of %d update(s) within clip norm %g)",
                 closed.number, dp.epsilon, config.dp_delta, q, z,
                 "?" if release["unclipped"] is None else release["unclipped"], release["count"], release["clip_norm"])
        figures = {"epsilon": _json_epsilon(dp.epsilon), "delta": config.dp_delta, "sampling_rate": q,
                   "noise_multiplier": z, "clip_norm": release["clip_norm"], "noise_std": release["noise_std"],
                   "expected_participants": release["expected"], "unclipped": release["unclipped"],
                   "stopped": dp.stopped}
        if dp.clipping is not None:  # the count's noise comes from the round's generator, after the model's
            figures["next_clip_norm"] = dp.clipping.step(rule.unclipped, rule.count, rule.expected_weight, rule.rng)
        return figures

    def _privacy_summary(self) -> dict[str, Any]:
        dp, config = self.dp, self.config
        assert dp is not None
        return {"epsilon": _json_epsilon(dp.epsilon), "delta": config.dp_delta,
                "target_epsilon": config.dp_target_epsilon,
                "noise_multiplier": config.dp_noise_multiplier,
                "clip_norm": dp.clipping.clip_norm if dp.clipping else config.clip_norm,
                "rounds_accounted": dp.accountant.rounds, "budget_stopped": dp.stopped}

    @property
    def dp_epsilon(self) -> float | None:
        """Epsilon spent by the rounds released so far (at --dp-delta); None without DP."""
        return None if self.dp is None else self.dp.epsilon

    def _commit(self, registry: bool = False) -> None:
        """Make the open round current in state.json; with `registry`, first write the registry file if a
        registration changed. Only then is the commit O(fleet), so an accepted update asks for it only when
        its own device's registration is not in the file yet (a restart then knows every folded device):
        otherwise its commit is O(round + model) whatever the fleet's size."""
        if registry and self._registry_dirty:
            self._registry_file = self.store.write_registry(
                {device: asdict(entry) for device, entry in self.registered.items()})
            self._written_registry = dict(self.registered)
            self._registry_dirty = False
        r = self.round
        selection = {"selection": {"seed": self._seed, "invite_cap": r.invite_cap,
                                   "invited": sorted(r.invited)}} if r.selected else {}
        self.store.commit({
            "round": {"number": r.number, "folded": {d: asdict(f) for d, f in r.folded.items()},
                      "bytes_received": r.bytes_received,
                      "extensions": r.extensions, "rejected": dict(r.rejected), **selection},
            "model": self._files.model,
            "partial": self._files.partial,
            "updates": self._files.updates,
            "registry": self._registry_file,
            "counters": dict(self.counters),
            "finished": self.finished,
            "base_digest": self.digest,
            **({"dp": {"secret": f"{self.dp.secret:x}", "accountant": self.dp.accountant.to_json(),
                       "stopped": self.dp.stopped,
                       "clipping": self.dp.clipping.to_json() if self.dp.clipping else None,
                       "partial_meta": self._dp_partial_meta if self._files.partial else None}}
               if self.dp is not None else {}),
        })
        self._state_dirty = True

    # ------------------------------------------------------------ outgoing

    @property
    def blob_id(self) -> str:
        return "final" if self.finished else f"r{self.round.number}"

    def _model_messages(self) -> list[Outgoing]:
        blob_id = self.blob_id
        if self._model_blob is None or self._model_blob[0] != blob_id:
            blob = encode_shared(self.manifest, self.model)
            frames = chunk(blob, self.config.chunk_size, blob_id, {"round": self.round.number})
            # the digest its frames carry: the model is hashed once per round (by chunk), not per announcement
            self._model_blob = (blob_id, blob, frames, decode_chunk(frames[0]).sha256)
        out = []
        if self._published_blob and self._published_blob[0] != blob_id:  # clear the old round's retained chunks
            old_id, old_count = self._published_blob
            out += [Outgoing(self.topics.model(old_id, i), b"", retain=True) for i in range(old_count)]
        frames = self._model_blob[2]
        self._published_blob = (blob_id, len(frames))
        out += [Outgoing(self.topics.model(blob_id, i), f, retain=True, broadcast=True) for i, f in enumerate(frames)]
        return out

    def _round_message(self) -> Outgoing:
        blob_id, blob, frames, digest = self._model_blob or (None, b"", [], hashlib.sha256(b"").hexdigest())
        info = RoundInfo(
            round=self.round.number, rounds=self.config.rounds, state="finished" if self.finished else "open",
            deadline=self._deadline, blob_id=str(blob_id), size=len(blob), sha256=digest,
            count=len(frames), base_digest=self.digest,
            **({"selection": "invited", "next_selection_at": self._deadline} if self.round.selected else {}),
            **({"secagg_session": self._secure.session} if self._secure is not None else {}),
        )
        return Outgoing(self.topics.round, info.encode(), retain=True)

    def _invitation(self, device: str) -> Outgoing:
        return Outgoing(self.topics.invite(device), Invitation(self.round.number).encode(), retain=True)

    @property
    def invited_count(self) -> int:
        """The devices the open round takes updates from: its invitations, or every registered device."""
        return len(self.round.invited) if self.selecting else len(self.registered)

    def state(self, now: float) -> dict[str, Any]:
        return {
            "v": 1, "status": "finished" if self.finished else "online", "round": self.round.number,
            "rounds": self.config.rounds, "deadline": self._deadline, "registered": len(self.registered),
            "online": len(self.online), "accepted_this_round": len(self.round.folded),
            "min_clients": self.config.min_clients, "counters": dict(self.counters), "time": now,
            **({"invited": len(self.round.invited), "clients_per_round": self.config.clients_per_round}
               if self.selecting else {}),
            **({"dp": self._privacy_summary()} if self.dp is not None else {}),
            **({"secagg": {"session": self._secure.session, "stage": self._secure.stage,
                           "devices": len(self._secure.roster) or len(self._secure.adverts),
                           "failed_sessions": self.secagg_failures}}
               if self._secure is not None else {}),
        }

    def state_message(self, now: float) -> Outgoing:
        self._state_dirty, self._last_state = False, now
        return Outgoing(self.topics.state, json.dumps(self.state(now), separators=(",", ":")).encode(), retain=True)
