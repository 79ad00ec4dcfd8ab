"""The page's "what is this?" panel, for real: Debian's chromium (web/test/browser/ask.mjs) opens the page where the
real fedper-coordinator serves it, takes part in a short FedPer fleet with a fedper-agent through a real Mosquitto
(over websockify), and once the fleet has finished picks a photo in the panel: its answer is the personalized model's,
the final served tensors of the page (base + its own head) in onnxruntime-web. The reference is independent of the
page's code: the same tensors in the export's inference model under plain onnxruntime (edge/personal.py), the photo
read by Pillow, the softmax in float64 here. The panel answers the same with the tab offline, and after a reload with
the coordinator gone (the test serves the page itself, on the same origin) and the broker out of reach."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.page import write_images
from helpers.processes import agent_args, coordinator_args, write_device_data
from helpers.websocket import wait_listening
from PIL import Image

from fedper.coordinator.web import Web, serve_page
from fedper.data import load_digits
from fedper.edge.agent import manifest_classes
from fedper.edge.personal import PersonalModel, predict
from fedper.manifest import Manifest
from fedper.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "web" / "test" / "browser" / "ask.mjs"
FLEET = "asking"
ROUNDS = 2

pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (make chromium)"),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not (ROOT / "web" / "dist" / "index.html").is_file(), reason="the page is not built (make web)"),
]


def write_photo(path: Path) -> Path:
    """A digit the page never trained on, as a phone hands over a photo: a PNG neither square nor at the model's
    input size (PNG: the browser and Pillow decode it to the same bytes, so the resize is what is compared)."""
    ds = load_digits(32).train
    i = int(np.flatnonzero(ds.y == 2)[-1])  # the page's images are the 300th to 345th of classes 1-3: not this one
    Image.fromarray(ds.x[i]).resize((45, 37), Image.Resampling.NEAREST).save(path)
    return path


def reference(served: dict[str, str], artifacts: Path, photo: Path, directory: Path) -> np.ndarray:
    """The photo's logits under the page's served tensors, by plain onnxruntime on the export's inference model."""
    manifest = Manifest.load(artifacts)
    tensors = {name: np.frombuffer(base64.b64decode(data), np.float32).reshape(manifest.spec(name).shape)
               for name, data in served.items()}
    assert set(tensors) == set(manifest.names())  # base and head: the whole served model
    directory.mkdir()
    PersonalModel(artifacts, manifest, manifest_classes(manifest)).write(directory, tensors, {})
    _, logits = predict(directory, [photo])
    return logits[0].astype(np.float64)


def check_answer(answer: dict, logits: np.ndarray, classes: list[str]) -> None:
    """The page's logits, its top classes and what it shows, against the reference logits."""
    np.testing.assert_allclose(answer["logits"], logits, rtol=1e-4, atol=1e-4)
    probabilities = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    best = np.argsort(-probabilities, kind="stable")[:3]
    assert [c["name"] for c in answer["top"]] == [classes[j] for j in best], (answer, probabilities)
    for shown, c, j in zip(answer["shown"], answer["top"], best, strict=True):
        assert abs(c["probability"] - probabilities[j]) <= 1e-5, (c, probabilities)
        name, percent = re.fullmatch(r"(.+): (\d+\.\d) %", shown).groups()
        assert name == classes[j] and abs(float(percent) - 100 * probabilities[j]) <= 0.051, (shown, probabilities)


@pytest.mark.timeout(600)
def test_the_page_answers_what_is_this_with_its_personalized_model(ws_broker, tiny_artifacts, processes, tmp_path):
    mosquitto = ws_broker.broker
    classes = manifest_classes(Manifest.load(tiny_artifacts))
    state, web = tmp_path / "coordinator", free_port()
    coordinator = processes.start(
        "coordinator", *coordinator_args(tiny_artifacts, mosquitto.url, state, FLEET, ROUNDS, 2, 300),
        "--web-port", str(web), "--web-host", "127.0.0.1", "--web-broker", ws_broker.url)
    data = write_device_data(tmp_path / "agent.npz", (0, 1), 40)
    processes.start("agent", *agent_args(tiny_artifacts, data, mosquitto.url, FLEET, "python-0", tmp_path / "agent"))
    images = tmp_path / "images"
    write_images(images, (1, 2, 3), 45, offset=300)
    photo = write_photo(tmp_path / "photo.png")
    wait_listening(web, coordinator, tmp_path / "coordinator.log", timeout=120)
    url = f"http://127.0.0.1:{web}/?device=web-1&seed=3&batch=16&lr=0.02"
    with (tmp_path / "driver.err").open("w") as err:
        driver = subprocess.Popen(["node", str(DRIVER), url, str(images), str(photo), "420"], cwd=ROOT / "web",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        finished = json.loads(driver.stdout.readline() or '{"stage": "none"}')
        assert finished["stage"] == "finished", (finished, (tmp_path / "driver.err").read_text()[-2000:],
                                                 processes.log("coordinator")[-2000:])
        assert coordinator.wait(60) == 0, processes.log("coordinator")[-2000:]  # the fleet is over, its page server too
        ws_broker.bridge.stop()  # and the broker out of the page's reach
        server = serve_page(Web(port=web, host="127.0.0.1", broker=ws_broker.url), tiny_artifacts, FLEET, None)
        try:
            driver.stdin.write("reload\n")
            driver.stdin.flush()
            reloaded = json.loads(driver.stdout.readline() or '{"stage": "none"}')
        finally:
            server.close()
    finally:
        driver.kill()
        driver.wait()
    assert reloaded["stage"] == "reloaded", reloaded

    assert finished["disabledBefore"] and "Once the fleet has finished" in finished["before"]
    assert f"after round {ROUNDS}" in finished["finished"]["model"]
    logits = reference(finished["served"], tiny_artifacts, photo, tmp_path / "reference")
    for answer in (finished["finished"], finished["offline"], reloaded["answer"]):
        check_answer(answer, logits, classes)
    gap = max(float(np.abs(np.asarray(a["logits"]) - logits).max())
              for a in (finished["finished"], finished["offline"], reloaded["answer"]))
    print(f"the page's answer for {photo.name}: {finished['finished']['shown']}; reference logits {logits.round(4)}, "
          f"the page's within {gap:.1e}")
    # after the reload the page could not reach the broker: the answer came from the store, not from a new run
    assert reloaded["status"] == "connecting…", reloaded["status"]
    assert not [m for m in finished["console"] if m.startswith("pageerror:")], finished["console"]
