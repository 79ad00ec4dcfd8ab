"""A device that attacks its own fleet, through Mosquitto with deploy/'s ACL and per-device passwords.

test_deploy.py already shows that a device cannot publish an update as another, cannot read
another's topics, that an unauthenticated client is refused and that TLS without the CA fails.
Here a logged-in device forges everything else: another device's registration and presence, and
the coordinator's own topics (round, model, state, error). None of it may reach anyone, and the
run must end with the honest model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers.recording import Recorder
from test_coordinator_live import TOPICS, Device, assert_model, expected_model, wait_for
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.service import run_service
from fedper.coordinator.store import Store
from fedper.mqtt import parse_broker_url
from fedper.payload import encode_shared
from fedper.wire import ErrorMessage, Register, RoundInfo, chunk

pytestmark = pytest.mark.mosquitto
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@pytest.fixture
def acl_broker(mosquitto_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Mosquitto with deploy/mosquitto/acl as shipped, and the passwords and ACL blocks made by
    deploy/provision-device.sh."""
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto_passwd not installed")
    passwords = {}
    shutil.copy(DEPLOY / "mosquitto" / "acl", tmp_path / "acl")
    for *role, user in (("--coordinator", "coordinator"), ("dev-a",), ("dev-b",)):
        out = subprocess.run([str(DEPLOY / "provision-device.sh"), *role, user, TOPICS.fleet, str(tmp_path / "passwd"),
                              str(tmp_path / "acl")], check=True, capture_output=True, text=True).stdout
        passwords[user] = dict(line.split("=", 1) for line in out.split())["FEDPER_PASSWORD"]
    broker = mosquitto_factory(f"allow_anonymous false\npassword_file {tmp_path / 'passwd'}\n"
                               f"acl_file {tmp_path / 'acl'}")
    return broker, passwords


def test_a_device_cannot_forge_registrations_presence_or_coordinator_messages(acl_broker, tmp_path: Path) -> None:
    broker, passwords = acl_broker
    manifest, initial = tiny_manifest(), tiny_tensors()
    observer = Recorder(broker.host, broker.port, f"{TOPICS.base}/#", username="coordinator",
                        password=passwords["coordinator"])
    coordinator = Coordinator(manifest, initial, TOPICS, Config.of(rounds=1, min_clients=2, round_timeout=20.0),
                              Store(tmp_path / "state"))
    thread = threading.Thread(target=run_service, args=(coordinator, parse_broker_url(broker.url)),
                              kwargs={"username": "coordinator", "password": passwords["coordinator"]}, daemon=True)
    thread.start()
    victim = Device(broker.url, "dev-b", 30, -1.0, manifest, delay=1.5, username="dev-b",
                    password=passwords["dev-b"])
    attacker = Device(broker.url, "dev-a", 10, 1.0, manifest, delay=1.5, username="dev-a",
                      password=passwords["dev-a"])
    wait_for(lambda: attacker.latest is not None and victim.latest is not None, 10, "round 1 at both devices")

    forged_round = RoundInfo(1, 1, "finished", time.time(), "evil", 10, "0" * 64, 1, manifest.base_digest)
    evil_frames = chunk(encode_shared(manifest, {k: v * 0 + 1e6 for k, v in initial.items()}), blob_id="r1",
                        meta={"round": 1})
    forgeries = [
        (TOPICS.register("dev-b"), Register(999, manifest.base_digest, "forged").encode()),
        (TOPICS.register("dev-c"), Register(5, manifest.base_digest, "forged").encode()),
        (TOPICS.presence("dev-b"), b"offline"),
        (TOPICS.round, forged_round.encode()),
        (TOPICS.model("r1", 0), evil_frames[0]),
        (TOPICS.model("evil", 0), evil_frames[0]),
        (TOPICS.state, json.dumps({"v": 1, "status": "finished"}).encode()),
        (TOPICS.error("dev-b"), ErrorMessage("digest_mismatch", "forged: stop").encode()),
    ]
    for topic, payload in forgeries:
        attacker.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)
    thread.join(30)
    time.sleep(0.3)  # anything forged would have been delivered by now
    observer.close()
    for d in (victim, attacker):
        d.close()

    assert not thread.is_alive()
    seen = observer.snapshot()
    leaked = [(t, p[:40]) for t, p in seen for ft, fp in forgeries if (t, p) == (ft, fp)]
    assert leaked == [], leaked
    assert not any("dev-c" in t for t, _ in seen)
    assert set(coordinator.registered) == {"dev-a", "dev-b"} and coordinator.registered["dev-b"].n_samples == 30
    assert coordinator.online == {"dev-a", "dev-b"}  # the forged "offline" never arrived
    assert sorted(victim.rounds) == sorted(attacker.rounds) == ["final", "r1"]  # no "evil" round reached anyone
    assert victim.errors == [] and attacker.errors == []
    assert sum(1 for t, _ in seen if t.startswith(f"{TOPICS.base}/model/")) > 0  # the observer did see the model
    assert_model(tmp_path / "state" / "final.safetensors", expected_model(initial, [victim, attacker], 1))
