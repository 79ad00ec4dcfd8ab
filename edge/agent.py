"""The device agent: one FedPer participant, talking protocol v1 (docs/protocol.md) over MQTT.

Per round k (RoundInfo `open` for a round this device has not answered):

1. collect the base model's chunks, check them, load the shared tensors by name (the head stays);
2. evaluate on the local test split: the model the device would serve now, i.e. the new
   aggregated base of round k-1 with the device's own head (for k = 1: the initial base). This is
   the accuracy reported with the round-k update. The emulator evaluates the same model (the
   aggregate after round k-1 with each head) at the end of round k-1: the agent reports it one
   round later, because it only sees that aggregate when round k opens;
3. train the algorithm's phases (fedper.algorithms), e.g. FedPer: base + head for E epochs;
4. save the state atomically (head, BatchNorm statistics, the update, the round);
5. publish the update: the shared tensors only (fedper.wire.update_frames -> pack_shared), n_j =
   the training-sample count, and the metrics.

A kill at any point is survived: after a restart the head comes back from the state dir; if the
open round is the one last saved, the saved update is sent again (the coordinator answers a
duplicate with `duplicate_update`, harmless); otherwise the device trains on the open round,
which also catches up after missed rounds. paho reconnects with backoff on broker loss; QoS 1
messages published meanwhile wait in its queue (and the persistent session keeps ours).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import queue
import resource
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedper.algorithms import Phase, get_algorithm
from fedper.compression import DELTA_CODECS
from fedper.data import DataError, load_image_folder, load_npz, to_float_nchw
from fedper.edge.backend import check_artifacts, open_backend
from fedper.edge.state import DeviceState, Saved, atomic_write
from fedper.manifest import Manifest
from fedper.mqtt import connect_async, make_client, parse_broker_url
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    ErrorMessage,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    WireError,
    decode_tensors,
    max_shared_blob_size,
    update_frames,
)

SOFTWARE = "fedper-agent/0.1.0"
FINAL_FILE = "final.json"  # the served model's accuracy after the last round, for people and scripts
_CONNECTED = "<connected>"


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
    backend: str = "ort"
    seed: int = 0
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    mqtt_version: str = "5"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compression: str = "fp32"  # update codec (fedper.compression): fp32, fp16, int8 or int8-delta


@dataclass(frozen=True)
class LocalData:
    x_train: np.ndarray  # float32 NCHW, normalized with the manifest's mean/std
    y_train: np.ndarray  # int64, indices into the manifest's classes
    x_test: np.ndarray
    y_test: np.ndarray


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
    def __init__(self, config: AgentConfig, log: Callable[[str], None] = print) -> None:
        self.config, self.log = config, log
        self.manifest = check_artifacts(config.artifacts)
        self.phases = schedule(self.manifest, config.fine_tune_head)
        if config.backend == "ort":
            missing = sorted({p.trained for p in self.phases} - set(self.manifest.artifact_sets))
            if missing:
                raise AgentError(
                    f"the algorithm's phases train {missing} but {config.artifacts} has no such artifact set "
                    f"(it has {sorted(self.manifest.artifact_sets)}); export with an algorithm that needs them"
                )
        self.topics = Topics(config.fleet)
        self.broker = parse_broker_url(config.broker)
        self.state = DeviceState(config.state_dir)
        self.data = load_local_data(config.data, self.manifest, self.state, config.seed)
        self.backend = open_backend(config.backend, config.artifacts, self.manifest)
        self.saved = self.state.load(self.manifest)
        if self.saved is not None:
            self.backend.load(self.saved.local)
            log(f"restored the head of round {self.saved.round} from {config.state_dir}")
        self.final_accuracy: float | None = None
        self._inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._models = Reassembler(max_shared_blob_size(self.manifest), max_open_blobs=4)
        self._blobs: dict[str, bytes] = {}
        self._round: RoundInfo | None = None
        self._sent_round: int | None = None

    @property
    def n_samples(self) -> int:
        return len(self.data.y_train)

    # ------------------------------------------------------------ MQTT

    def run(self, stop: threading.Event | None = None) -> None:
        """Take part in rounds until the coordinator announces the final model (or `stop` is set)."""
        stop = stop or threading.Event()
        self._closing = False
        c = self.config
        client = make_client(c.client_id, protocol=c.mqtt_version, username=c.username, password=c.password,
                             tls=self.broker.tls, tls_ca=c.tls_ca, will=(self.topics.presence(c.client_id), b"offline"))
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = lambda client, userdata, msg: self._inbox.put((msg.topic, bytes(msg.payload)))
        self._client = client
        connect_async(client, self.broker)
        self.log(f"{c.client_id}: {self.n_samples} training / {len(self.data.y_test)} test samples, "
                 f"{self.manifest.algorithm} with {c.backend}, connecting to {c.broker}")
        try:
            while not stop.is_set() and self.final_accuracy is None:
                try:
                    topic, payload = self._inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._handle(topic, payload)
        finally:
            self._closing = True
            with contextlib.suppress(RuntimeError, ValueError):  # not connected: the last will says it
                client.publish(self.topics.presence(c.client_id), b"offline", qos=1, retain=True).wait_for_publish(5)
            client.disconnect()
            client.loop_stop()

    def _on_disconnect(self, client, userdata, flags, reason, props) -> None:
        if not self._closing:
            self.log(f"lost the broker ({reason}): reconnecting")

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        if getattr(reason, "is_failure", False):
            self.log(f"broker refused the connection: {reason}")
            return
        self._announce(client)
        self._inbox.put((_CONNECTED, b""))

    def _announce(self, client) -> None:
        """Subscribe, say we are online, (re-)register: on every connect, as docs/protocol.md asks."""
        t, me = self.topics, self.config.client_id
        client.subscribe([(t.round, 1), (f"{t.base}/model/#", 1), (t.error(me), 1)])
        client.publish(t.presence(me), b"online", qos=1, retain=True)
        register = Register(n_samples=self.n_samples, base_digest=self.manifest.base_digest, software=SOFTWARE)
        client.publish(t.register(me), register.encode(), qos=1, retain=True)

    def _handle(self, topic: str, payload: bytes) -> None:
        t = self.topics
        try:
            if topic == _CONNECTED:
                self.log("connected")
                # No update is acknowledged in v1: one sent just before a broker outage may be lost with
                # the broker's state, so the saved update is sent again when the open round is seen again
                # (the coordinator answers duplicate_update if it had it).
                self._sent_round = None
            elif topic == t.round:
                self._round = RoundInfo.decode(payload)
                if self._round.base_digest != self.manifest.base_digest:
                    raise AgentError(f"the coordinator runs another export (base_digest {self._round.base_digest}, "
                                     f"ours {self.manifest.base_digest})")
            elif topic.startswith(f"{t.base}/model/"):
                if payload:  # an empty retained payload clears an old round's chunk
                    blob = self._models.add("coordinator", payload)
                    if blob is not None:
                        self._blobs = {blob.blob_id: blob.data}  # only the newest model is worth keeping
            elif topic == t.error(self.config.client_id):
                self._on_error(ErrorMessage.decode(payload))
                return
        except WireError as e:
            self.log(f"ignored a bad message on {topic}: {e}")
            return
        self._maybe_run_round()

    def _on_error(self, error: ErrorMessage) -> None:
        self.log(f"coordinator: {error.code}: {error.message}")
        if error.code == "digest_mismatch":
            raise AgentError(f"the coordinator refused this export: {error.message}")
        if error.code in ("unknown_device", "bad_chunk") and self.saved and error.round == self.saved.round:
            self._announce(self._client)  # register again,
            self._sent_round = None  # then send the update again (a fresh blob id) once the round's model is here
            self._maybe_run_round()

    def _maybe_run_round(self) -> None:
        info = self._round
        if info is None or info.blob_id not in self._blobs:
            return
        blob = self._blobs[info.blob_id]
        if hashlib.sha256(blob).hexdigest() != info.sha256:
            self.log(f"model {info.blob_id} does not match the round's sha256: waiting for the right one")
            del self._blobs[info.blob_id]
            return
        if info.state == "finished":
            self._load_base(blob)
            self.final_accuracy, final_loss = self.backend.evaluate(self.data.x_test, self.data.y_test)
            self.log(f"finished after {info.rounds} rounds: personalized accuracy {self.final_accuracy:.4f}")
            record = {"rounds": info.rounds, "accuracy": self.final_accuracy, "loss": final_loss}
            atomic_write(self.state.dir / FINAL_FILE, json.dumps(record).encode())
            return
        if self.saved is not None and info.round < self.saved.round:
            return  # a stale RoundInfo
        if self.saved is not None and info.round == self.saved.round:
            if self._sent_round != info.round:
                self.log(f"round {info.round}: already trained (before a restart or a reconnect), sending the saved "
                         "update again")
                self._publish_update(self.saved, blob)
            return
        self._load_base(blob)
        self.saved = self.train_round(info.round)
        self._publish_update(self.saved, blob)

    def _load_base(self, blob: bytes) -> None:
        self.backend.load(decode_tensors(self.manifest, blob))

    def _publish_update(self, saved: Saved, model_blob: bytes) -> None:
        """Send `saved`, the update that answers the round whose model is `model_blob` (a delta codec
        encodes the difference from that model)."""
        meta = UpdateMeta(round=saved.round, n_samples=saved.n_samples, base_digest=saved.base_digest,
                          metrics=saved.metrics, codec=self.config.compression)
        blob_id = f"r{saved.round}-{secrets.token_hex(4)}"
        topic = self.topics.update(self.config.client_id)
        base = decode_tensors(self.manifest, model_blob) if self.config.compression in DELTA_CODECS else None
        for frame in update_frames(self.manifest, saved.update, meta, blob_id, self.config.chunk_size, base):
            self._client.publish(topic, frame, qos=1)
        self._sent_round = saved.round

    # ------------------------------------------------------------ one round, no MQTT

    def train_round(self, round_: int) -> Saved:
        """Evaluate the served model, train every phase, save the state; the base is already loaded."""
        c, d = self.config, self.data
        accuracy, test_loss = self.backend.evaluate(d.x_test, d.y_test)
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
