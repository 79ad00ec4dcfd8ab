"""The defects the untrusted-devices review found, replayed against a live coordinator with third-party MQTT clients.

Every hostile frame is built here by hand (json text, struct, zlib, hashlib: docs/protocol.md
sections 4-5) and published with Debian's `mosquitto_pub -f`; the answers are read with
`mosquitto_sub`. Neither shares any code with fedper.wire. The hostile device holds a valid
registration and sends first in the round; afterwards two honest devices must be folded exactly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import Processes, coordinator_args, finish, saved_state
from safetensors.numpy import save
from test_coordinator_live import (
    FLEET,
    TOPICS,
    Device,
    assert_model,
    metrics,
    wait_for,
    write_artifacts,
)
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.payload import decode_shared

MOSQUITTO_PUB, MOSQUITTO_SUB = shutil.which("mosquitto_pub"), shutil.which("mosquitto_sub")
pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(not (MOSQUITTO_PUB and MOSQUITTO_SUB),
                       reason="mosquitto_pub/mosquitto_sub not installed (apt-get install mosquitto-clients)"),
]
EVIL, EVIL_SAMPLES = "evil", 5


def frame(header_json: str, body: bytes) -> bytes:
    """u32 header length, u32 crc32 of header + body (big-endian), the JSON header as given, the body."""
    head = header_json.encode()
    return struct.pack(">II", len(head), zlib.crc32(head + body)) + head + body


def update_frame(blob: bytes, blob_id: str, meta_json: str) -> bytes:
    """One chunk holding a whole blob; `meta_json` is written into the header as text, so it can hold
    numbers no JSON encoder writes (an integer of 400 digits, 1e400)."""
    header = (f'{{"v":1,"blob_id":"{blob_id}","index":0,"count":1,"size":{len(blob)},"chunk_size":{max(1, len(blob))},'
              f'"sha256":"{hashlib.sha256(blob).hexdigest()}","meta":{meta_json}}}')
    return frame(header, blob)


def list_header_blob() -> bytes:
    """A safetensors file whose JSON header is a list, not an object."""
    head = b"[1,2]"
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def publish(host: str, port: int, topic: str, payload: bytes, path: Path, *, retain: bool = False) -> None:
    path.write_bytes(payload)
    command = [MOSQUITTO_PUB, "-h", host, "-p", str(port), "-i", f"{EVIL}-pub", "-q", "1", "-t", topic, "-f", str(path)]
    subprocess.run([*command, *(["-r"] if retain else [])], check=True, timeout=10)


def test_the_five_defects_through_mosquitto_clients_cost_honest_devices_nothing(
        mosquitto, tmp_path: Path, processes: Processes) -> None:
    manifest, initial = tiny_manifest(), tiny_tensors()
    digest = manifest.base_digest
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    state = tmp_path / "state"
    coordinator = processes.start("coordinator", *coordinator_args(artifacts, mosquitto.url, state, FLEET, 1, 2, 60))
    answers_file = tmp_path / "answers.txt"
    with open(answers_file, "wb") as out:
        listener = subprocess.Popen([MOSQUITTO_SUB, "-h", mosquitto.host, "-p", str(mosquitto.port),
                                     "-i", f"{EVIL}-sub", "-q", "1", "-t", TOPICS.error(EVIL)],
                                    stdout=out, stderr=subprocess.STDOUT)
    try:
        scratch = tmp_path / "frame.bin"
        while b"probe" not in answers_file.read_bytes():  # the listener is subscribed once it hears its probe
            publish(mosquitto.host, mosquitto.port, TOPICS.error(EVIL), b"probe", scratch)
            time.sleep(0.2)
            assert listener.poll() is None, answers_file.read_text()
        register = f'{{"v":1,"n_samples":{EVIL_SAMPLES},"base_digest":"{digest}","software":"mosquitto_pub"}}'
        publish(mosquitto.host, mosquitto.port, TOPICS.register(EVIL), register.encode(), scratch, retain=True)
        honest = [Device(mosquitto.url, "a", 10, 1.0, manifest, respond=False),
                  Device(mosquitto.url, "b", 30, -2.0, manifest, respond=False)]
        wait_for(lambda: len((saved_state(state) or {}).get("registered", {})) == 3
                 and all("r1" in d.blobs for d in honest), 30, "three registrations and round 1's model")
        base = decode_shared(manifest, honest[0].blobs["r1"])
        good_blob = save({k: v + 100.0 for k, v in base.items()})

        def meta(n_samples: str = str(EVIL_SAMPLES), metrics_json: str = '{"accuracy":0.5}') -> str:
            return f'{{"round":1,"n_samples":{n_samples},"base_digest":"{digest}","metrics":{metrics_json}}}'

        attacks = [  # (what, topic, payload, the code it must be answered with)
            ("n_samples beyond any float, first in the round", TOPICS.update(EVIL),
             update_frame(good_blob, "e1", meta(n_samples="1" + "0" * 400)), "bad_message"),
            ("a claimed 10**12 samples outweighing the fleet", TOPICS.update(EVIL),
             update_frame(good_blob, "e2", meta(n_samples=str(10**12))), "too_many_samples"),
            ("a plausible lie: 6 samples where it registered 5", TOPICS.update(EVIL),
             update_frame(good_blob, "e5", meta(n_samples="6")), "n_samples_mismatch"),
            ("a list-shaped safetensors header", TOPICS.update(EVIL),
             update_frame(list_header_blob(), "e3", meta()), "bad_tensors"),
            ("a metrics value too large for a float", TOPICS.update(EVIL),
             update_frame(good_blob, "e4", meta(metrics_json='{"accuracy":1e400}')), "bad_message"),
            ("a registration above --max-samples-per-device", TOPICS.register(EVIL),
             f'{{"v":1,"n_samples":{10**9},"base_digest":"{digest}","software":"x"}}'.encode(), "too_many_samples"),
        ]
        for _, topic, payload, _ in attacks:
            publish(mosquitto.host, mosquitto.port, topic, payload, scratch)

        def codes() -> list[str]:
            lines = [line for line in answers_file.read_text().splitlines() if line.startswith("{")]
            return [json.loads(line)["code"] for line in lines]

        wait_for(lambda: len(codes()) >= len(attacks), 30, f"{len(attacks)} answers on the hostile device's topic")
        assert codes() == [code for *_, code in attacks]
        assert coordinator.poll() is None, processes.log("coordinator")
        saved = saved_state(state)
        assert saved["round"]["folded"] == {}  # nothing of the attacker's was folded, half or whole
        assert saved["registered"][EVIL]["n_samples"] == EVIL_SAMPLES  # the refused claim changed nothing

        publish(mosquitto.host, mosquitto.port, TOPICS.register(EVIL), b"", scratch, retain=True)  # it leaves
        wait_for(lambda: EVIL not in saved_state(state)["registered"], 10, "the hostile device to leave")
        for device in honest:
            device.send(1, base)
        assert finish(coordinator, 60, "coordinator", processes.log("coordinator")) == 0
        [record] = metrics(state)
        assert record["devices"] == ["a", "b"]
        assert record["rejected"] == {"bad_message": 2, "too_many_samples": 2, "n_samples_mismatch": 1,
                                      "bad_tensors": 1}
        total = sum(d.n for d in honest)
        expected = {k: (sum(d.n * d.update(initial)[k].astype(np.float64) for d in honest) / total).astype(v.dtype)
                    for k, v in initial.items()}
        assert_model(state / "final.safetensors", expected)
        for device in honest:
            assert device.errors == []
            device.close()
    finally:
        listener.terminate()
        listener.wait(10)
