"""The device agent's protocol logic (docs/protocol.md, v1): a state machine fed with MQTT messages.

No I/O but its state directory and its training backend: `connected()` and `handle(topic,
payload)` return the messages to publish, so tests drive it with hand-built frames and no broker,
and the paho loop (fedper.edge.service) stays thin, as the coordinator's does.

Per round k (RoundInfo `open` for a round this device has not answered):

1. collect the base model's chunks, check the blob's sha256 against RoundInfo, decode it once
   (the decoded round model serves both loading and, for a delta codec, encoding the update);
2. load the shared tensors by name (the head stays) and evaluate on the local test split: the
   model the device would serve now, i.e. the new aggregated base of round k-1 with the device's
   own head (for k = 1: the initial base). This is the accuracy reported with the round-k update.
   FedBABU (its Algorithm 2) serves a fine-tuned copy: the loaded model is fine-tuned on the local
   training data (--eval-finetune, --eval-finetune-epochs: the emulator's defaults and batch keys),
   evaluated, and the untuned tensors are loaded back, so training starts from the frozen head.
   The emulator evaluates the same model (the aggregate after round k-1 with each head) at the end
   of round k-1: the agent reports it one round later, because it only sees that aggregate when
   round k opens;
3. train the algorithm's phases (fedper.algorithms), e.g. FedPer: base + head for E epochs;
4. save the state atomically (head, BatchNorm statistics, the update, the round);
5. publish the update: the shared tensors only (fedper.payload.encode_shared, chunked by fedper.wire.chunk), n_j =
   the training-sample count, and the metrics.

A kill at any point is survived: after a restart the head comes back from the state dir; if the
open round is the one last saved, the saved update is sent again (the coordinator answers a
duplicate with `duplicate_update`, harmless), as it is whenever that round's RoundInfo is
re-published (v1 acknowledges no update); otherwise the device trains on the open round, which
also catches up after missed rounds.

Selection (docs/protocol.md, section 8.1): when RoundInfo says `selection: invited`, the device
takes part in a round only once invited to it on its own `invite/<device>` topic; until then it
downloads, trains and publishes nothing, and waits for messages (no polling: the next RoundInfo
and any invitation are pushed to it). It subscribes to the model's chunks only while invited and
without the model, so the broker never pushes a round's model to the whole fleet
(`subscriptions()` says what to be subscribed to now; the service keeps the broker in step). With
`selection: all` (the default) every round is the device's, as before selection existed.

Eligibility (`--only-when`, fedper.edge.eligibility): before it takes part in a round (trains, or
sends the saved update again) the device checks its conditions once per round; while they do not
hold it says why once per round, publishes presence `offline` (so a coordinator that selects
invites someone else), and checks again after `recheck_s` (`tick()`), at the next RoundInfo or
invitation; once they hold it publishes `online` again and takes part.

Secure aggregation (fedper.edge.secure_round): when RoundInfo names a `secagg_session`, the device sends
no clear update: with its --identity it advertises fresh signed keys for that session, then answers the
coordinator's relayed stages on `relay/<device>` (shares, share report, masked input as the update's chunks,
survivor signature, unmask), once per session; a new session in the same round (the coordinator restarted, or
the last one failed before revealing anything) gets fresh keys and the saved update again, unless the device
answered an unmask request in the round. With --secure-aggregation the device never sends its update in the
clear, whatever RoundInfo says.

What reaches the device is checked as the coordinator checks what reaches it: a RoundInfo for
another export, an impossible round, an oversized model or a round this device already passed,
and a model blob that is corrupt, not the round's sha256, or not exactly the manifest's finite
shared tensors, are each refused with one log line; nothing is loaded until a blob passes, so
the model and the head stay as they were and the right blob, when it comes, is used.
"""

from __future__ import annotations

import json
import math
import resource
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedper import checkpoint
from fedper.algorithms import Phase, check_trained, get_algorithm
from fedper.batches import PURPOSE_FINETUNE
from fedper.compression import DELTA_CODECS
from fedper.data import DataError, load_image_folder, load_npz, to_float_nchw
from fedper.edge.backend import check_artifacts, open_backend
from fedper.edge.eligibility import Conditions
from fedper.edge.state import DeviceState, Saved, StateError, atomic_write
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    SECAGG_CODEC,
    SECAGG_DOWN,
    Blob,
    ErrorMessage,
    Invitation,
    Outgoing,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    WireError,
    chunk,
    decode_chunk,
    decode_secagg,
)

if TYPE_CHECKING:
    from fedper.edge.secure_round import SecureParticipant

SOFTWARE = "fedper-agent/0.1.0"
FINAL_FILE = "final.json"  # the served model's accuracy after the last round, for people and scripts
SERVED_FILE = "served.safetensors"  # the model final.json measured: the final base, the head (FedBABU: fine-tuned)
COORDINATOR = "coordinator"  # the one source of model chunks
MAX_NOTED_BLOBS = 64  # blob ids whose refusal was logged (one line per blob, not per chunk)


class AgentError(RuntimeError):
    """The agent cannot go on (bad input, another export's coordinator); the message says why."""


@dataclass(frozen=True)
class AgentConfig:
    artifacts: Path
    data: Path
    broker: str
    fleet: str
    client_id: str
    state_dir: Path
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    fine_tune_head: bool = False
    eval_finetune_epochs: int = 1  # FedBABU: fine-tuning epochs before each evaluation (0: serve the frozen head)
    eval_finetune: str = "all"  # FedBABU: what that fine-tune trains, "all" (their Algorithm 2) or "head"
    backend: str = "ort"
    seed: int = 0
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    mqtt_version: str = "5"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compression: str = "fp32"  # update codec: one of fedper.compression.CODECS
    only_when: tuple[str, ...] = ()  # eligibility conditions (fedper.edge.eligibility), all must hold
    recheck_s: float = 60.0  # while not eligible, check the conditions again after this long
    reconnect_spread_s: float = 30.0  # after losing the broker, reconnect within this window (fedper.mqtt.Backoff)
    secure_aggregation: bool = False  # never send the update in the clear: only under a SecAgg+ session
    identity: Path | None = None  # secure aggregation: the device's identity directory (deploy/provision-identity.sh)


@dataclass(frozen=True)
class LocalData:
    x_train: np.ndarray  # float32 NCHW, normalized with the manifest's mean/std
    y_train: np.ndarray  # int64, indices into the manifest's classes
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class RoundModel:
    """A round's base model, decoded and checked once; keyed by what RoundInfo names it by."""

    blob_id: str
    sha256: str
    tensors: Mapping[str, np.ndarray]


def manifest_classes(manifest: Manifest) -> list[str]:
    """The label names the model was exported for; "0".."C-1" when the export named none."""
    return list(manifest.model.classes) or [str(i) for i in range(manifest.model.num_classes)]


def load_local_data(path: Path, manifest: Manifest, state: DeviceState, seed: int) -> LocalData:
    """An image-folder tree or an .npz, labels mapped onto the manifest's classes; without a test
    split of its own, the state dir's fixed split (chosen once) divides it."""
    _, height, width = manifest.model.input_shape
    splits = load_npz(path) if path.suffix == ".npz" else load_image_folder(path, image_size=height)
    classes = manifest_classes(manifest)
    unknown = [c for c in splits.train.classes if c not in classes]
    if unknown:
        raise DataError(f"{path}: class(es) {unknown} are not among the model's classes {classes}")
    if splits.train.x.shape[1:3] != (height, width):
        raise DataError(f"{path}: images are {splits.train.x.shape[1:3]}, the model takes {height}x{width}")
    if len(splits.train) == 0:
        raise DataError(f"{path}: no training images")
    to_manifest = np.array([classes.index(c) for c in splits.train.classes], np.int64)
    x, y = splits.train.x, to_manifest[splits.train.y]
    if splits.test is None:
        train, test = state.split(x, y, seed)
        x_test, y_test, x, y = x[test], y[test], x[train], y[train]
    else:
        x_test, y_test = splits.test.x, to_manifest[splits.test.y]
    mean, std = manifest.model.mean, manifest.model.std
    return LocalData(to_float_nchw(x, mean, std), y, to_float_nchw(x_test, mean, std), y_test)


def schedule(manifest: Manifest, fine_tune_head: bool) -> tuple[Phase, ...]:
    """The algorithm's phases; --fine-tune-head puts one head-only epoch first (the paper's A.3)."""
    phases = get_algorithm(manifest.algorithm).phases
    if fine_tune_head and phases[0].trained != "head":
        phases = (Phase("head", 1), *phases)
    return phases


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


class Agent:
    """One FedPer participant: its artifacts, local data, training backend and state directory,
    and what it knows of the coordinator's open round.

    conditions: when it may take part (default: config.only_when on this machine's /sys and /proc);
    clock: unix time, for the eligibility back-off."""

    def __init__(self, config: AgentConfig, log: Callable[[str], None] = print, *,
                 conditions: Conditions | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config, self.log, self.clock = config, log, clock
        self.conditions = conditions if conditions is not None else Conditions(tuple(config.only_when))
        self.manifest = check_artifacts(config.artifacts)
        self.phases = schedule(self.manifest, config.fine_tune_head)
        fine_tunes = get_algorithm(self.manifest.algorithm).fine_tune_head_at_eval
        self.serve_tuned = fine_tunes and config.eval_finetune_epochs > 0  # FedBABU serves a fine-tuned copy
        if self.serve_tuned:
            check_trained(config.eval_finetune)
        if config.backend == "ort":
            needed = {p.trained for p in self.phases} | ({config.eval_finetune} if self.serve_tuned else set())
            missing = sorted(needed - set(self.manifest.artifact_sets))
            if missing:
                raise AgentError(
                    f"the algorithm's phases train {missing} but {config.artifacts} has no such artifact set "
                    f"(it has {sorted(self.manifest.artifact_sets)}); export with an algorithm that needs them"
                )
        self.topics = Topics(config.fleet)
        self.state = DeviceState(config.state_dir)
        self.data = load_local_data(config.data, self.manifest, self.state, config.seed)
        self.backend = open_backend(config.backend, config.artifacts, self.manifest)
        self.saved = self.state.load(self.manifest)
        if self.saved is not None:
            self.backend.load(self.saved.local)
            log(f"restored the head of round {self.saved.round} from {config.state_dir}")
        self.final_accuracy: float | None = None
        self._models = Reassembler(max_blob_size(self.manifest), max_open_blobs=4)
        self._blob: Blob | None = None  # the newest complete model blob, until a RoundInfo names it
        self._model: RoundModel | None = None  # the open round's model, decoded
        self._round: RoundInfo | None = None
        self._sent_round: int | None = None
        self._noted: set[str] = set()  # blob ids refused and logged once
        self._invited: int | None = None  # the round of this device's newest invitation
        self._quiet: int | None = None  # the round whose "not invited" was logged
        self._eligible = True  # the conditions' last verdict (no condition: always)
        self._accepted: int | None = None  # the round the conditions were found to hold for: not checked again
        self._recheck_at: float | None = None  # while not eligible: when to check again
        self._declined: int | None = None  # the round whose "not eligible" was logged
        self._secure: SecureParticipant | None = None  # the secure-aggregation session this device is in
        self._clear_refused: int | None = None  # the round whose clear update --secure-aggregation held back

    @property
    def n_samples(self) -> int:
        return len(self.data.y_train)

    # ------------------------------------------------------------ messages in, messages out

    def subscriptions(self) -> list[tuple[str, int]]:
        """What to be subscribed to now: RoundInfo, its errors and its invitations always; the relay of secure
        aggregation when it is on; the model's chunks once RoundInfo says which (with selection: only while
        invited and without the model)."""
        t, me = self.topics, self.config.client_id
        wanted = [(t.round, 1), (t.error(me), 1), (t.invite(me), 1)]
        info = self._round
        if self.config.secure_aggregation or (info is not None and info.secagg_session is not None):
            wanted.append((t.relay(me), 1))  # the coordinator's secure-aggregation stages
        if info is not None and info.selection == "all":
            wanted.append((self.all_models_topic, 1))
        elif info is not None and self._wants_model(info):
            wanted.append((f"{t.base}/model/{info.blob_id}/#", 1))
        return wanted

    @property
    def all_models_topic(self) -> str:
        return f"{self.topics.base}/model/#"

    def connected(self) -> list[Outgoing]:
        """Say whether we are online (willing to train) and (re-)register, on every connect, as
        docs/protocol.md asks. The subscription then delivers the retained RoundInfo, which resends
        an unacknowledged update."""
        self.log("connected")
        self._recheck_at = None
        self._check_conditions(self._round.round if self._round else 0)  # presence goes with the announcement
        return self._announce()

    def tick(self) -> list[Outgoing]:
        """Called every so often by the service: once the back-off has passed, check the conditions
        again; take part in the round if one waits for this device, else only say whether it is online."""
        if self._eligible or (self._recheck_at is not None and self.clock() < self._recheck_at):
            return []
        self._recheck_at = None
        out = self._progress()
        if self._recheck_at is None and not self._eligible:  # no round checked them: the presence alone
            out += self._check_conditions(self._round.round if self._round else 0)
        return out

    def handle(self, topic: str, payload: bytes) -> list[Outgoing]:
        """One message from the broker; what to publish in answer. AgentError when the agent cannot go on."""
        t = self.topics
        try:
            if topic == t.round:
                return self._on_round_info(RoundInfo.decode(payload))
            if topic.startswith(f"{t.base}/model/"):
                return self._on_model_chunk(topic, payload)
            if topic == t.error(self.config.client_id):
                return self._on_error(ErrorMessage.decode(payload))
            if topic == t.invite(self.config.client_id):
                return self._on_invitation(payload)
            if topic == t.relay(self.config.client_id):
                return self._on_relay(payload)
        except WireError as e:
            self.log(f"ignored a bad message on {topic}: {e}")
        return []

    def _announce(self) -> list[Outgoing]:
        t, me = self.topics, self.config.client_id
        register = Register(n_samples=self.n_samples, base_digest=self.manifest.base_digest, software=SOFTWARE)
        return [self._presence(), Outgoing(t.register(me), register.encode(), retain=True)]

    def _presence(self) -> Outgoing:
        """`online` while the device is willing to train (a selecting coordinator invites only those)."""
        return Outgoing(self.topics.presence(self.config.client_id), b"online" if self._eligible else b"offline",
                        retain=True)

    def _on_round_info(self, info: RoundInfo) -> list[Outgoing]:
        problem = self._round_info_problem(info)
        if problem:
            self.log(f"ignored RoundInfo of round {info.round} ({info.state}): {problem}")
            return []
        self._round = info
        self._recheck_at = None  # a RoundInfo is a reason to look at the conditions again
        if info.state == "open" and not self._invited_to(info) and self._quiet != info.round:
            self._quiet = info.round
            wait = (info.next_selection_at or info.deadline) - self.clock()
            self.log(f"round {info.round}: not invited; quiet until an invitation or the next selection "
                     f"(due within {max(wait, 0):.0f} s)")
        # No update is acknowledged in v1: one sent while the coordinator or the broker was away may be
        # lost, so the saved update goes again whenever its round's RoundInfo is (re)published (after a
        # reconnect, a restart or an extension); the coordinator answers duplicate_update if it had it.
        self._sent_round = None
        return self._progress()

    def _round_info_problem(self, info: RoundInfo) -> str | None:
        if info.base_digest != self.manifest.base_digest:
            return f"it is for another export (base_digest {info.base_digest}, ours {self.manifest.base_digest})"
        if info.round > info.rounds:
            return f"round {info.round} of a run of {info.rounds} rounds"
        if info.size > self._models.max_blob_size:
            return (f"its model declares {info.size} bytes, more than this model's shared tensors take "
                    f"({self._models.max_blob_size})")
        if info.state == "open" and self.saved is not None and info.round < self.saved.round:
            return f"stale: this device already answered round {self.saved.round}"
        return None

    def _on_invitation(self, payload: bytes) -> list[Outgoing]:
        if not payload:  # cleared: its round closed
            self._invited = None
            return []
        invitation = Invitation.decode(payload)
        self._invited = invitation.round
        info = self._round
        if info is not None and info.round == invitation.round:
            self.log(f"round {info.round}: invited")
            self._recheck_at = None
            return self._progress()
        return []  # for another round: acted on once RoundInfo opens it

    def _invited_to(self, info: RoundInfo) -> bool:
        return info.selection == "all" or self._invited == info.round

    def _wants_model(self, info: RoundInfo) -> bool:
        """Whether the model RoundInfo names is still needed: the final one until evaluated; an open
        round's while this device takes part in it and has not yet sent its update."""
        if self.final_accuracy is not None or self._holds_model(info):
            return False
        if info.state == "finished":
            return True
        answered = self.saved is not None and info.round == self.saved.round
        return (self._invited_to(info) and self._eligible and self._accepted == info.round
                and not (answered and self._sent_round == info.round))

    def _holds_model(self, info: RoundInfo) -> bool:
        """Decoded and checked: a blob that came under the round's id but failed is no reason to stop listening."""
        return self._model is not None and (self._model.blob_id, self._model.sha256) == (info.blob_id, info.sha256)

    def _check_conditions(self, round_: int) -> list[Outgoing]:
        """Check --only-when (unless the device took part in this round already or is backing off): sets
        whether it is eligible, logs why not once per round, and returns the presence to publish if it changed."""
        if not self.conditions.specs or self._accepted == round_:
            return []
        if self._recheck_at is not None and self.clock() < self._recheck_at:
            return []
        was, where = self._eligible, f"round {round_}: " if round_ else ""
        problem = self.conditions.problem()
        self._eligible = problem is None
        if problem is None:
            self._recheck_at = None
            if self._declined is not None:
                self.log(f"{where}eligible again")
                self._declined = None
        else:
            self._recheck_at = self.clock() + self.config.recheck_s
            if self._declined != round_:
                self._declined = round_
                self.log(f"{where}not eligible ({problem}): not taking part; checking again in "
                         f"{self.config.recheck_s:g} s")
        return [self._presence()] if self._eligible != was else []

    def _on_model_chunk(self, topic: str, payload: bytes) -> list[Outgoing]:
        if not payload:  # an empty retained payload clears an old round's chunk
            return []
        where = topic[len(f"{self.topics.base}/model/"):].split("/")
        try:
            chunk = decode_chunk(payload, max_blob_size=self._models.max_blob_size)
            if where != [chunk.blob_id, str(chunk.index)]:
                raise WireError("bad_chunk", f"chunk {chunk.index} of blob {chunk.blob_id} on another blob's topic")
            blob = self._models.add(COORDINATOR, chunk)
        except WireError as e:
            self._refuse_blob(where[0], f"ignored a bad model chunk on {topic}: {e}")
            return []
        if blob is None:
            return []
        self._noted.discard(blob.blob_id)
        info = self._round
        if info is not None and blob.blob_id == info.blob_id and blob.sha256 != info.sha256:
            self._refuse_blob(blob.blob_id, f"model {blob.blob_id} does not match the round's sha256: "
                              "waiting for the right one")
            return []
        self._blob = blob  # only the newest model is worth keeping
        return self._progress()

    def _refuse_blob(self, blob_id: str, line: str) -> None:
        """Log a refused model blob once, however many of its chunks arrive."""
        if blob_id in self._noted:
            return
        if len(self._noted) >= MAX_NOTED_BLOBS:
            self._noted.clear()
        self._noted.add(blob_id)
        self.log(line)

    def _on_error(self, error: ErrorMessage) -> list[Outgoing]:
        self.log(f"coordinator: {error.code}: {error.message}")
        if error.code == "digest_mismatch":
            raise AgentError(f"the coordinator refused this export: {error.message}")
        if error.code in ("unknown_device", "bad_chunk") and self.saved and error.round == self.saved.round:
            self._sent_round = None  # register again, then send the update again (a fresh blob id)
            return self._announce() + self._progress()
        return []

    def _progress(self) -> list[Outgoing]:
        """Act on the open round once its model is here: train and send, send the saved update
        again, or, for the finished run, evaluate the final model."""
        info = self._round
        if info is None or self.final_accuracy is not None:
            return []
        if info.state == "open" and not self._invited_to(info):
            return []  # an uninvited device never trains nor uploads
        answered = self.saved is not None and info.state == "open" and info.round == self.saved.round
        if answered and self._sent_round == info.round:
            return []
        out: list[Outgoing] = []
        if info.state == "open":
            out = self._check_conditions(info.round)
            if not self._eligible:
                return out
            self._accepted = info.round  # checked once per round: a round under way is not dropped midway
        model = self._round_model(info)
        if model is None:
            return out
        if info.state == "finished":
            self._finish(info, model)
            return out
        if answered:
            self.log(f"round {info.round}: already trained (before a restart, a reconnect or the round's "
                     "re-publication), sending the saved update again")
        else:
            self.backend.load(model)
            self.saved = self.train_round(info.round)
        if info.secagg_session is not None:
            return out + self._secure_advert(info, self.saved, model)
        if self.config.secure_aggregation:
            if self._clear_refused != info.round:
                self._clear_refused = info.round
                self.log(f"round {info.round}: the coordinator asks for a clear update; --secure-aggregation "
                         "holds it back")
            return out
        return out + self._update(self.saved, model)

    def _round_model(self, info: RoundInfo) -> Mapping[str, np.ndarray] | None:
        """The model RoundInfo names, decoded once and checked; None while it is not here (or refused)."""
        if self._holds_model(info):
            return self._model.tensors
        blob = self._blob
        if blob is None or blob.blob_id != info.blob_id:
            return None
        if blob.sha256 != info.sha256:  # kept: the RoundInfo may be the forged one
            self.log(f"model {info.blob_id} does not match the round's sha256: waiting for the right one")
            return None
        self._blob = None
        self._model = None  # the last round's model is done with: never hold two decoded models
        try:
            tensors = decode_shared(self.manifest, blob.data, codec="fp32")  # a round's model is always fp32
        except Exception as e:  # an untrusted blob: whatever fails in decoding it is a refusal, not a crash
            self.log(f"refused model {info.blob_id} of round {info.round}: {type(e).__name__}: {e}")
            return None
        self._model = RoundModel(info.blob_id, info.sha256, tensors)
        return tensors

    def _update(self, saved: Saved, model: Mapping[str, np.ndarray]) -> list[Outgoing]:
        """The frames of `saved`, the update that answers the round whose model is `model` (a delta
        codec encodes the difference from it)."""
        c = self.config
        meta = UpdateMeta(round=saved.round, n_samples=saved.n_samples, base_digest=saved.base_digest,
                          metrics=saved.metrics, codec=c.compression)
        blob_id = f"r{saved.round}-{secrets.token_hex(4)}"
        base = model if c.compression in DELTA_CODECS else None
        blob = encode_shared(self.manifest, saved.update, c.compression, base)
        frames = chunk(blob, c.chunk_size, blob_id, meta.to_dict())
        self._sent_round = saved.round
        return [Outgoing(self.topics.update(c.client_id), frame) for frame in frames]

    def _secure_advert(self, info: RoundInfo, saved: Saved, model: Mapping[str, np.ndarray]) -> list[Outgoing]:
        """Stage 1 of the session RoundInfo names: fresh keys, once per session (a republished RoundInfo of the
        same session is no reason to start again: the coordinator may be past this stage); none once this device
        revealed shares in the round, or without an identity (the participant says why)."""
        from fedper.edge.secure_round import SecureParticipant  # cryptography: the privacy extra
        from fedper.secagg import SecAggError

        self._sent_round = saved.round
        current = self._secure
        if current is not None and (current.round, current.session) == (saved.round, info.secagg_session):
            return []
        c = self.config
        meta = UpdateMeta(round=saved.round, n_samples=saved.n_samples, base_digest=saved.base_digest,
                          metrics=saved.metrics, codec=SECAGG_CODEC)
        participant = SecureParticipant(self.topics, c.client_id, saved.round, int(info.secagg_session or 0),
                                        self.manifest, saved.update, model, saved.n_samples, meta, c.chunk_size,
                                        c.identity, c.state_dir, info.sha256)
        self._secure = participant  # also when it refuses: once per session
        try:
            advert = participant.advertise()
        except SecAggError as e:
            self.log(f"round {saved.round}: secure aggregation session {info.secagg_session}: not taking part: {e}")
            return []
        self.log(f"round {saved.round}: secure aggregation session {info.secagg_session}: keys advertised")
        return [advert]

    def _on_relay(self, payload: bytes) -> list[Outgoing]:
        """A secure-aggregation stage message from the coordinator, for the session this device is in."""
        from fedper.edge.secure_round import SENT

        message = decode_secagg(payload, SECAGG_DOWN)
        secure = self._secure
        if secure is None:
            self.log(f"ignored a secure-aggregation {message.stage} message: this device is in no session")
            return []
        try:
            out = secure.handle(message)
        except Exception as e:  # untrusted input (SecAggError, or the kernel's and numpy's ValueError): a refusal
            self.log(f"round {secure.round}: refused the coordinator's secure-aggregation {message.stage} message "
                     f"({type(e).__name__}: {e}); nothing sent for it")
            return []
        self.log(f"round {secure.round}: secure aggregation session {secure.session}: {SENT[message.stage]}")
        return out

    def _finish(self, info: RoundInfo, model: Mapping[str, np.ndarray]) -> None:
        """Evaluate the model the device serves from now on and save it (served.safetensors) with its
        accuracy (final.json). The device state keeps the untuned head: a restart derives the same."""
        self.backend.load(model)
        self._tune_for_serving(info.rounds + 1)  # the emulator's evaluation after round R keys it R + 1
        accuracy, loss = self.backend.evaluate(self.data.x_test, self.data.y_test)
        self.log(f"finished after {info.rounds} rounds: personalized accuracy {accuracy:.4f}")
        record = {"rounds": info.rounds, "accuracy": accuracy, "loss": loss}
        served = self.state.dir / SERVED_FILE
        try:
            checkpoint.write_checkpoint(served, self.backend.read(self.manifest.names()), record)
        except OSError as e:
            raise StateError(f"cannot save {served}: {e.strerror or e}") from e
        atomic_write(self.state.dir / FINAL_FILE, json.dumps(record).encode())
        self.final_accuracy = accuracy

    def _tune_for_serving(self, round_: int) -> dict[str, np.ndarray] | None:
        """FedBABU: fine-tune the loaded model in place, as the device serves it (their Algorithm 2), with
        the batch key the emulator gives client_seed = --seed in the same round; returns the untuned
        tensors for the caller to load back. Other algorithms serve the model as it is: None."""
        if not self.serve_tuned:
            return None
        c, d = self.config, self.data
        untuned = self.backend.read(self.manifest.names())
        self.backend.train(c.eval_finetune, d.x_train, d.y_train, epochs=c.eval_finetune_epochs,
                           batch_size=c.batch_size, lr=c.lr, seed=(c.seed, round_, PURPOSE_FINETUNE))
        return untuned

    # ------------------------------------------------------------ one round, no messages

    def train_round(self, round_: int) -> Saved:
        """Evaluate the served model, train every phase, save the state; the base is already loaded."""
        c, d = self.config, self.data
        untuned = self._tune_for_serving(round_) if len(d.y_test) else None
        accuracy, test_loss = self.backend.evaluate(d.x_test, d.y_test)
        if untuned is not None:
            self.backend.load(untuned)  # training goes on from the untuned model, as the emulator's state does
        samples, seconds, losses = 0, 0.0, []
        for index, phase in enumerate(self.phases):
            stats = self.backend.train(
                phase.trained, d.x_train, d.y_train, epochs=phase.epochs or c.local_epochs,
                batch_size=c.batch_size, lr=c.lr, seed=(c.seed, round_, index),
            )
            samples, seconds = samples + stats.samples, seconds + stats.seconds
            losses.append(stats.loss)
        metrics = {"accuracy": accuracy, "loss": test_loss, "train_loss": losses[-1],
                   "samples_per_s": samples / seconds if seconds else 0.0}
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}  # no test split: no accuracy
        saved = Saved(
            round=round_, base_digest=self.manifest.base_digest, n_samples=self.n_samples,
            local=self.backend.read(self.manifest.names(shared=False)),
            update=self.backend.read(self.manifest.names(shared=True)), metrics=metrics,
        )
        self.state.save(saved)
        self.log(f"round {round_}: served accuracy {accuracy:.4f} (test loss {test_loss:.4f}); trained "
                 f"{samples} samples in {seconds:.1f} s ({samples / max(seconds, 1e-9):.0f} samples/s), "
                 f"train loss {losses[-1]:.4f}; peak RSS {peak_rss_mb():.0f} MB")
        return saved
