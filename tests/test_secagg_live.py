"""Secure aggregation (SecAgg+) wired: real ORT agents and the coordinator through a real Mosquitto.

The coordinator (a subprocess, --secure-aggregation) must release base + the n_j-weighted mean of the
devices' clipped deltas, which the test computes from the updates the agents saved on their disks,
within the quantization's documented bound; only masked inputs may cross the update topic. A device
that sends hand-built hostile frames on its secagg topic is answered and costs nobody the round; a device
whose shares do not authenticate is reported and left out, and the round closes; 30 % of the devices
vanishing after the keys were shared (one before its masked input, two after it) still give the right sum
of those whose input arrived. A coordinator scripted by hand that lies about the survivors to unmask one
device is refused by the real agents (the consistency check).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.frames import chunks, frame, to_json
from helpers.identities import write_identity, write_root
from helpers.processes import Processes, coordinator_args, finish, kill9, write_device_data
from helpers.recording import Recorder
from safetensors.numpy import load_file

from fedper.artifacts import BASE_FILE
from fedper.edge.agent import Agent, AgentConfig
from fedper.edge.service import run_agent
from fedper.manifest import Manifest
from fedper.payload import decode_shared
from fedper.secagg import DeviceKeys, Identity, NotEnoughShares, SecAggClient, SecAggConfig, reconstruct
from fedper.wire import SecAggNeighbours

pytestmark = pytest.mark.mosquitto
CLIP = 20.0  # --clip-norm: the L2 bound of a delta, and the quantization range [-C, C] of each value
STAGE_S = 3.0
ROOT = Ed25519PrivateKey.generate()  # the fleets' identity root (the operator's; the coordinator gets its public key)


def root_file(tmp_path: Path) -> str:
    return str(write_root(tmp_path / "fleet-root.pub", ROOT))


def start_coordinator(processes: Processes, artifacts: Path, url: str, state_dir: Path, fleet: str,
                      min_clients: int, tmp_path: Path) -> object:
    return processes.start("coordinator", *coordinator_args(
        artifacts, url, state_dir, fleet, 1, min_clients, 60, "--secure-aggregation", "--clip-norm", str(CLIP),
        "--secagg-stage-timeout", str(STAGE_S), "--secagg-identity-root", root_file(tmp_path)))


def make_agents(tmp_path: Path, artifacts: Path, url: str, fleet: str, count: int,
                logs: dict[str, list[str]], plain: tuple[str, ...] = ()) -> list[Agent]:
    """`count` ORT agents on real digits, two classes each, 16 to 24 images (different n_j), each with its
    identity; those named in `plain` run without --secure-aggregation (they follow RoundInfo's session all the
    same)."""
    agents = []
    for j in range(count):
        name = f"dev{j}"
        data = write_device_data(tmp_path / f"{name}.npz", (j % 4, (j + 1) % 4), 20 + 5 * (j % 3))
        config = AgentConfig(artifacts=artifacts, data=data, broker=url, fleet=fleet, client_id=name,
                             state_dir=tmp_path / f"state-{name}", batch_size=16, lr=0.05, seed=3,
                             secure_aggregation=name not in plain,
                             identity=write_identity(tmp_path / f"id-{name}", ROOT, fleet, name))
        logs[name] = []
        agents.append(Agent(config, log=logs[name].append))
    return agents


def expected_model(artifacts: Path, agents: list[Agent]) -> dict[str, np.ndarray]:
    """base + sum_j n_j clip(delta_j) / sum_j n_j, from the updates the agents saved, in float64."""
    manifest = Manifest.load(artifacts)
    base = decode_shared(manifest, (artifacts / BASE_FILE).read_bytes())
    names = manifest.names(shared=True)
    total, weight = {n: np.zeros(base[n].shape) for n in names}, 0.0
    for agent in agents:
        saved = agent.state.load(agent.manifest)
        deltas = {n: saved.update[n].astype(np.float64) - base[n] for n in names}
        norm = np.sqrt(sum(float((d**2).sum()) for d in deltas.values()))
        scale = min(1.0, CLIP / norm)
        for n in names:
            total[n] += saved.n_samples * scale * deltas[n]
        weight += saved.n_samples
    return {n: base[n] + total[n] / weight for n in names}


def quantization_bound(devices: int, contributors: int, weight_share: float) -> float:
    """Nearest rounding errs by half a step per value and device; the sum is divided by sum(n_j / max n_j)."""
    value_bits = 32 - int(np.ceil(np.log2(devices)))
    step = 2 * CLIP / (2**value_bits - 1)
    return contributors * step / 2 / weight_share


def run_agents(agents: list[Agent], stops: dict[str, threading.Event]) -> list[threading.Thread]:
    threads = [threading.Thread(target=run_agent, args=(a, stops[a.config.client_id]), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    return threads


def check_sum(coordinator_dir: Path, artifacts: Path, contributors: list[Agent], devices: int) -> None:
    final = load_file(str(coordinator_dir / "final.safetensors"))
    expected = expected_model(artifacts, contributors)
    n = [a.state.load(a.manifest).n_samples for a in contributors]
    bound = quantization_bound(devices, len(contributors), sum(n) / max(n)) + 1e-6  # + float32 rounding
    gaps = {name: float(np.abs(final[name].astype(np.float64) - expected[name]).max()) for name in expected}
    assert max(gaps.values()) <= bound, (bound, sorted(gaps.items(), key=lambda kv: -kv[1])[:3])
    base = decode_shared(Manifest.load(artifacts), (artifacts / BASE_FILE).read_bytes())
    assert max(float(np.abs(final[name] - base[name]).max()) for name in final) > 1e-3  # the round did train
    record = json.loads((coordinator_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(record["devices"]) == sorted(a.config.client_id for a in contributors)


class Mallory:
    """A registered device that sends hand-built hostile frames on its own topics and records the answers."""

    def __init__(self, url_port: int, fleet: str, digest: str) -> None:
        self.base, self.errors = f"fedper/v1/{fleet}", []
        self.round_open = threading.Event()  # the coordinator is up (and subscribed): RoundInfo is out
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="mallory")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", url_port)
        self.client.loop_start()
        self.client.subscribe([(f"{self.base}/error/mallory", 1), (f"{self.base}/round", 1)])
        register = to_json({"v": 1, "n_samples": 20, "base_digest": digest, "software": "mallory/1"}).encode()
        self.client.publish(f"{self.base}/register/mallory", register, qos=1, retain=True).wait_for_publish(5)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if msg.topic.endswith("/round"):
            self.round_open.set()
        else:
            self.errors.append(json.loads(msg.payload))

    def send(self, kind: str, payload: bytes) -> None:
        self.client.publish(f"{self.base}/{kind}/mallory", payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def hostile_frames(digest: str, length: int) -> list[tuple[str, bytes]]:
    """(topic kind, payload) pairs a valid device may write and the protocol refuses, built by hand."""
    key = "QUFB" * 11  # 33 bytes of base64: not a 32-byte key
    advert = {"v": 1, "stage": "advertise", "round": 1, "session": 1, "c_public": key, "s_public": key,
              "identity": key, "certificate": "QUFB" * 22, "signature": "QUFB" * 22}
    key, signature = "QUFB" * 10 + "QUE=", "QUFB" * 21 + "QQ=="  # 32 and 64 bytes
    stranger = {**advert, "c_public": key, "s_public": key, "identity": key, "certificate": signature,
                "signature": signature}
    huge = {"v": 1, "stage": "shares", "round": 1, "session": 1, "shares": {str(i): "AAAA" for i in range(1001)}}
    masked = np.zeros(length, "<u4").tobytes()
    header = to_json({"masked": {"dtype": "U32", "shape": [length], "data_offsets": [0, len(masked)]},
                      "__metadata__": {"round": "1", "device": "0"}}).encode()
    header += b" " * (-len(header) % 8)
    blob = len(header).to_bytes(8, "little") + header + masked
    meta = {"round": 1, "n_samples": 20, "base_digest": digest, "codec": "secagg"}
    return [
        ("secagg", b"\x00\xffnot json"),
        ("secagg", to_json({"v": 1, "stage": "unmask-everyone", "round": 1, "session": 1}).encode()),
        ("secagg", to_json(advert).encode()),  # wrong key length (bad_message, whatever its session)
        ("secagg", to_json(stranger).encode()),  # well-formed, (likely) the wrong session: secagg
        ("secagg", to_json(huge).encode()),  # more entries than any neighbourhood
        ("secagg", to_json({**advert, "round": 2**60}).encode()),
        ("secagg", frame({"v": 1, "blob_id": "x"}, b"a chunk on the wrong topic")),
        *(("update", c) for c in chunks(blob, meta, blob_id="m1", chunk_size=60_000)),  # not in any session
    ]


def test_a_secure_round_releases_the_weighted_mean_and_hostile_frames_cost_nobody_the_round(
        tmp_path: Path, tiny_artifacts: Path, mosquitto, processes: Processes) -> None:
    """Four agents with different n_j (dev3 without the --secure-aggregation flag): the released model is
    base + the n_j-weighted mean of their clipped deltas within the quantization bound; the update topic
    carries only masked inputs (codec secagg); a registered device's hostile frames on its secagg and update
    topics are each answered with an error."""
    fleet = "secagg"
    manifest = Manifest.load(tiny_artifacts)
    recorder = Recorder(mosquitto.host, mosquitto.port, f"fedper/v1/{fleet}/update/#")
    mallory = Mallory(mosquitto.port, fleet, manifest.base_digest)
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(processes, tiny_artifacts, mosquitto.url, coordinator_dir, fleet, 4, tmp_path)
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 4, logs, plain=("dev3",))
    length = sum(int(np.prod(t.shape)) for t in manifest.shared_tensors)
    try:
        assert mallory.round_open.wait(30), processes.log("coordinator")
        for kind, payload in hostile_frames(manifest.base_digest, length):
            mallory.send(kind, payload)
        for _ in range(100):  # every frame answered (the update's chunks: once per blob)
            if len(mallory.errors) >= 8:
                break
            threading.Event().wait(0.1)
        mallory.send("register", b"")  # mallory leaves: the round need not wait for its keys
        stops = {a.config.client_id: threading.Event() for a in agents}
        threads = run_agents(agents, stops)
        assert finish(coordinator, 50, "the coordinator", processes.log("coordinator")) == 0, \
            processes.log("coordinator")
        for thread in threads:
            thread.join(20)
    finally:
        mallory.close()
        recorder.close()
    codes = [e["code"] for e in mallory.errors]
    assert codes.count("bad_message") >= 4 and codes.count("secagg") >= 2, codes
    check_sum(coordinator_dir, tiny_artifacts, agents, devices=4)
    updates = [payload for topic, payload in recorder.snapshot() if not topic.endswith("/mallory")]
    assert updates and all(b'"codec":"secagg"' in u[: 8 + int.from_bytes(u[:4], "big")] for u in updates)
    assert all(any("masked input sent" in line for line in logs[a.config.client_id]) for a in agents), logs


def test_thirty_percent_vanishing_after_sharing_keys_still_give_the_right_sum(
        tmp_path: Path, tiny_artifacts: Path, mosquitto, processes: Processes) -> None:
    """Ten agents; after the keys are shared dev7 leaves before sending its masked input (its pairwise masks
    are rebuilt from its key shares) and dev8, dev9 leave right after sending theirs (their self masks are
    rebuilt from their seed shares): the round closes with the weighted mean of the nine inputs."""
    fleet = "dropout"
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(processes, tiny_artifacts, mosquitto.url, coordinator_dir, fleet, 5, tmp_path)
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 10, logs)
    stops = {a.config.client_id: threading.Event() for a in agents}
    leave_after = {"dev7": "shares sent", "dev8": "masked input sent", "dev9": "masked input sent"}
    for name, trigger in leave_after.items():
        def log(line: str, name: str = name, trigger: str = trigger) -> None:
            logs[name].append(line)
            if trigger in line:
                stops[name].set()  # the agent publishes this stage's answer, then disconnects for good
        agents[int(name[3:])].log = log
    threads = run_agents(agents, stops)
    assert finish(coordinator, 55, "the coordinator", processes.log("coordinator")) == 0, processes.log("coordinator")
    for thread in threads:
        thread.join(20)
    assert all(any("masked input sent" in line for line in logs[name]) for name in ("dev8", "dev9"))
    assert not any("masked input sent" in line for line in logs["dev7"])
    check_sum(coordinator_dir, tiny_artifacts, [a for a in agents if a.config.client_id != "dev7"], devices=10)


class Impostor:
    """A coordinator that follows the protocol by hand (json, base64, hand-built chunk frames) up to the
    masked inputs, then lies about the survivors to unmask one device: what honest devices must refuse."""

    def __init__(self, port: int, fleet: str) -> None:
        self.base = f"fedper/v1/{fleet}"
        self.inbox: dict[str, list[dict]] = {}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="impostor")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(f"{self.base}/secagg/+", qos=1)

    @classmethod
    def open_round(cls, port: int, fleet: str, artifacts: Path, session: int) -> tuple[Impostor, dict[str, Any]]:
        """An impostor that has retained round 1's model (hand-built chunks) and its RoundInfo naming `session`."""
        manifest = Manifest.load(artifacts)
        model = (artifacts / BASE_FILE).read_bytes()
        impostor = cls(port, fleet)
        model_frames = chunks(model, {"round": 1}, blob_id="r1", chunk_size=60_000)
        for i, f in enumerate(model_frames):
            impostor.publish(f"model/r1/{i}", f, retain=True)
        info = {"v": 1, "round": 1, "rounds": 1, "state": "open", "deadline": time.time() + 600, "blob_id": "r1",
                "size": len(model), "sha256": hashlib.sha256(model).hexdigest(), "count": len(model_frames),
                "base_digest": manifest.base_digest, "secagg_session": session}
        impostor.publish("round", to_json(info).encode(), retain=True)
        return impostor, info

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.inbox.setdefault(msg.topic.rsplit("/", 1)[1], []).append(json.loads(msg.payload))

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(f"{self.base}/{topic}", payload, qos=1, retain=retain).wait_for_publish(5)

    def wait_for(self, stage: str, devices: list[str], count: int = 1, timeout: float = 30) -> dict[str, dict]:
        for _ in range(int(timeout * 10)):
            with self.lock:
                got = {d: [m for m in self.inbox.get(d, []) if m["stage"] == stage] for d in devices}
            if all(len(v) >= count for v in got.values()):
                return {d: v[-1] for d, v in got.items()}
            threading.Event().wait(0.1)
        raise AssertionError(f"no {stage} message from each of {devices}: {self.inbox}")

    def relay(self, name: str, session: int, body: dict[str, Any]) -> None:
        """A relayed secure-aggregation message of round 1's `session` to device `name`."""
        self.publish(f"relay/{name}", to_json({"v": 1, "round": 1, "session": session, **body}).encode())

    def exchange_keys(self, names: list[str], session: int, manifest: Manifest,
                      weight_scale: int) -> tuple[dict[str, dict], dict[str, dict]]:
        """Run `session` honestly up to the devices' "received" reports (adverts relayed as neighbours, shares
        passed on); returns the adverts and the reports."""
        adverts = self.wait_for("advertise", names)
        pack = {name: base64.b64encode(b"".join(base64.b64decode(adverts[name][k]) for k in (
            "c_public", "s_public", "identity", "certificate", "signature"))).decode() for name in names}
        length = sum(int(np.prod(t.shape)) for t in manifest.shared_tensors)
        for i, name in enumerate(names):
            self.relay(name, session, {
                "stage": "neighbours", "roster": names, "groups": [3], "index": i, "length": length, "clip": CLIP,
                "degree": 2, "threshold": 2, "value_bits": 30, "graph_seed": 0, "weight_scale": weight_scale,
                "adverts": {str(j): pack[other] for j, other in enumerate(names) if other != name}})
        shares = self.wait_for("shares", names)
        for i, name in enumerate(names):
            self.relay(name, session, {"stage": "shares", "shares": {
                str(j): shares[other]["shares"][str(i)] for j, other in enumerate(names) if other != name}})
        return adverts, self.wait_for("received", names)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_real_agents_refuse_a_coordinator_that_lies_about_the_survivors_to_unmask_one_device(
        tmp_path: Path, tiny_artifacts: Path, mosquitto) -> None:
    """The attack of issue 26 against three real agents, run by a coordinator scripted by hand: it holds all
    masked inputs, then tells dev1 the survivors are {dev0, dev1} and dev2 that they are {dev0, dev2}, so that
    dev1 would reveal dev0's self-mask share and dev2's key share and dev2 dev0's self-mask share and dev1's key
    share: with both of dev0's seed shares and both neighbours' keys, dev0's update is in the clear (on the kernel
    before the check it is, to 2e-9). Each device signs the set it is told and answers only with signatures of
    more than half of the session (2 of 3) on it: dev0 signs one of the two sets, so dev2 refuses, and dev1's
    answer alone rebuilds no secret. A new session of the same round then gets keys from dev0 and dev2 but not
    from dev1, which revealed shares in this round."""
    fleet, session = "impostor", 77
    manifest = Manifest.load(tiny_artifacts)
    impostor, info = Impostor.open_round(mosquitto.port, fleet, tiny_artifacts, session)
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 3, logs)
    names = [a.config.client_id for a in agents]
    stops = {name: threading.Event() for name in names}
    threads = run_agents(agents, stops)

    def relay(name: str, body: dict) -> None:
        impostor.publish(f"relay/{name}", to_json({"v": 1, "round": 1, "session": session, **body}).encode())

    def signer(name: str, signature: str) -> str:  # base64(identity || certificate || signature)
        return base64.b64encode(b"".join(base64.b64decode(x) for x in (
            adverts[name]["identity"], adverts[name]["certificate"], signature))).decode()

    try:
        adverts, reports = impostor.exchange_keys(names, session, manifest, max(a.n_samples for a in agents))
        assert all(r["skipped"] == [] for r in reports.values())
        for name in names:
            relay(name, {"stage": "mask", "excluded": []})
        for _ in range(300):
            if all(any("masked input sent" in line for line in logs[name]) for name in names):
                break
            threading.Event().wait(0.1)
        told = {"dev0": [0, 1], "dev1": [0, 1], "dev2": [0, 2]}
        for name, survivors in told.items():
            relay(name, {"stage": "consistency", "survivors": survivors})
        signed = {name: m["signature"] for name, m in impostor.wait_for("consistency", names).items()}
        relay("dev1", {"stage": "unmask", "signatures": {"0": signer("dev0", signed["dev0"]),
                                                         "1": signer("dev1", signed["dev1"])}})
        relay("dev2", {"stage": "unmask", "signatures": {"0": signer("dev0", signed["dev0"]),
                                                         "2": signer("dev2", signed["dev2"])}})
        answered = impostor.wait_for("unmask", ["dev1"])["dev1"]
        for _ in range(100):
            if any("UnmaskRefused" in line for line in logs["dev2"]):
                break
            threading.Event().wait(0.1)
        impostor.publish("round", to_json({**info, "secagg_session": session + 1}).encode(), retain=True)
        again = impostor.wait_for("advertise", ["dev0", "dev2"], count=2)
        threading.Event().wait(1.0)
    finally:
        for stop in stops.values():
            stop.set()
        for thread in threads:
            thread.join(20)
        impostor.close()
    assert sorted(answered["seed_shares"]) == ["0"] and sorted(answered["key_shares"]) == ["2"]
    assert not [m for m in impostor.inbox["dev2"] if m["stage"] == "unmask"]
    assert any("UnmaskRefused" in line and "1 valid signatures" in line for line in logs["dev2"]), logs["dev2"]
    with pytest.raises(NotEnoughShares):  # dev0's seed from the one share the attack got (t = 2)
        reconstruct({2: int.from_bytes(base64.b64decode(answered["seed_shares"]["0"]), "big")}, 2, 0, "self-mask")
    assert all(m["session"] == session + 1 for m in again.values())
    assert len([m for m in impostor.inbox["dev1"] if m["stage"] == "advertise"]) == 1
    assert any("not taking part" in line and "revealed shares in round 1" in line for line in logs["dev1"])


class Sybil:
    """A registered device with a valid identity that takes part by the kernel and sends shares that
    authenticate nowhere: each stage-2 ciphertext replaced by random bytes of its size, framed by hand."""

    def __init__(self, port: int, fleet: str, digest: str, identity_dir: Path) -> None:
        self.base, self.name = f"fedper/v1/{fleet}", "sybil"
        self.identity = Identity.load(identity_dir)
        self.keys, self.sent_shares = DeviceKeys.generate(), threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.name)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe([(f"{self.base}/round", 1), (f"{self.base}/relay/{self.name}", 1)])
        register = to_json({"v": 1, "n_samples": 20, "base_digest": digest, "software": "sybil/1"}).encode()
        self.client.publish(f"{self.base}/register/{self.name}", register, qos=1, retain=True).wait_for_publish(5)
        self.session = 0

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        body = json.loads(msg.payload)
        if msg.topic.endswith("/round") and body.get("secagg_session") and body["secagg_session"] != self.session:
            self.session = body["secagg_session"]
            advert = self.keys.advert(self.identity, body["round"], self.session)
            client.publish(f"{self.base}/secagg/{self.name}", to_json({
                "v": 1, "stage": "advertise", "round": body["round"], "session": self.session,
                **{k: base64.b64encode(getattr(advert, k)).decode() for k in (
                    "c_public", "s_public", "identity", "certificate", "signature")}}).encode(), qos=1)
        elif body.get("stage") == "neighbours":
            setup = SecAggNeighbours.decode(msg.payload)
            kernel = SecAggClient(SecAggConfig.of(setup), setup.index, self.identity, self.keys)
            kernel.advertise()
            shares = kernel.share_keys(setup).shares
            garbage = {str(v): base64.b64encode(secrets.token_bytes(len(sealed))).decode()
                       for v, sealed in shares.items()}
            client.publish(f"{self.base}/secagg/{self.name}", to_json({
                "v": 1, "stage": "shares", "round": body["round"], "session": self.session,
                "shares": garbage}).encode(), qos=1)
            self.sent_shares.set()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_device_whose_shares_do_not_authenticate_is_left_out_and_the_round_closes_through_mosquitto(
        tmp_path: Path, tiny_artifacts: Path, mosquitto, processes: Processes) -> None:
    """Three real agents and a hostile device (raw paho, the kernel with corrupted ciphertexts, frames built by
    hand): before issue 26 every session failed at its shares. Now the agents report it, the coordinator leaves it
    out of the session, and the round closes with the agents' exact weighted mean; metrics.jsonl names it."""
    fleet = "sybil"
    manifest = Manifest.load(tiny_artifacts)
    sybil = Sybil(mosquitto.port, fleet, manifest.base_digest, write_identity(tmp_path / "id-sybil", ROOT, fleet,
                                                                                   "sybil"))
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(processes, tiny_artifacts, mosquitto.url, coordinator_dir, fleet, 3, tmp_path)
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 3, logs)
    stops = {a.config.client_id: threading.Event() for a in agents}
    threads = run_agents(agents, stops)
    try:
        assert finish(coordinator, 50, "the coordinator", processes.log("coordinator")) == 0, \
            processes.log("coordinator")
    finally:
        for thread in threads:
            thread.join(20)
        sybil.close()
    assert sybil.sent_shares.is_set()
    record = json.loads((coordinator_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["secagg"]["reported"] == ["sybil"], record
    check_sum(coordinator_dir, tiny_artifacts, agents, devices=4)
    assert "failed" not in processes.log("coordinator")


def test_a_coordinator_killed_mid_session_opens_a_new_one_and_the_round_still_closes(
        tmp_path: Path, tiny_artifacts: Path, mosquitto, processes: Processes) -> None:
    """dev3 leaves after sharing its keys, so the coordinator waits for its share report; it is killed there
    (kill -9) and restarted: the session is gone, RoundInfo names a new one, the three devices left advertise
    fresh keys for it (they revealed no share), and the round closes at its deadline with their weighted mean."""
    fleet = "restart"
    logs: dict[str, list[str]] = {}
    agents = make_agents(tmp_path, tiny_artifacts, mosquitto.url, fleet, 4, logs)
    stops = {a.config.client_id: threading.Event() for a in agents}

    def leave(line: str) -> None:
        logs["dev3"].append(line)
        if "shares sent" in line:
            stops["dev3"].set()
    agents[3].log = leave
    coordinator_dir = tmp_path / "coordinator"
    args = coordinator_args(tiny_artifacts, mosquitto.url, coordinator_dir, fleet, 1, 2, 10, "--secure-aggregation",
                            "--clip-norm", str(CLIP), "--secagg-stage-timeout", "20", "--secagg-identity-root",
                            root_file(tmp_path))
    coordinator = processes.start("coordinator", *args)
    threads = run_agents(agents, stops)
    first = [a for a in agents if a.config.client_id != "dev3"]
    for _ in range(400):
        if stops["dev3"].is_set() and all(any("shares received" in line for line in logs[a.config.client_id])
                                          for a in first):
            break
        threading.Event().wait(0.05)
    else:
        raise AssertionError(f"the session did not reach its share reports: {logs}")
    kill9(coordinator)  # waiting up to 20 s for dev3's share report
    coordinator = processes.start("coordinator", *args)
    assert finish(coordinator, 50, "the restarted coordinator", processes.log("coordinator")) == 0, \
        processes.log("coordinator")
    for thread in threads:
        thread.join(20)
    for agent in first:
        sessions = {line.split("session ")[1].split(":")[0] for line in logs[agent.config.client_id]
                    if "keys advertised" in line}
        assert len(sessions) == 2, logs[agent.config.client_id]
    check_sum(coordinator_dir, tiny_artifacts, first, devices=3)
