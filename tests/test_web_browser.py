"""A phone's browser as a device, for real: Debian's chromium (driven by puppeteer-core, web/test/browser/drive.mjs)
opens the web agent's page, picks digit images with its file picker, and takes part in FedPer rounds with two
fedper-agents under the real fedper-coordinator, through a real Mosquitto that the page reaches over WebSockets
(websockify in front of its TCP listener). The page reloads once its second update is out and rejoins with its
head from IndexedDB. Every update frame on the broker is captured: none carries a head tensor; every round folds
the page's update."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
from helpers.processes import agent_args, coordinator_args, write_device_data
from PIL import Image

from fedper.data import load_digits
from fedper.manifest import Manifest
from fedper.ports import free_port
from fedper.wire import Reassembler, Topics, decode_chunk

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "web" / "test" / "browser" / "drive.mjs"
FLEET = "browser"
ROUNDS = 4

pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (make chromium)"),
    pytest.mark.skipif(shutil.which("websockify") is None, reason="websockify is not installed (make chromium)"),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not (ROOT / "web" / "dist" / "index.html").is_file(), reason="the page is not built (make web)"),
]


class PageServer(ThreadingHTTPServer):
    """The page at /, the export at /artifacts/, /config.json, with the cross-origin isolation headers that
    wasm threads need. A stand-in until the coordinator serves the page itself (fedper-coordinator --web-port)."""

    def __init__(self, root: Path, artifacts: Path, config: dict) -> None:
        self.root, self.artifacts, self.config = root, artifacts, json.dumps(config).encode()
        super().__init__(("127.0.0.1", free_port()), partial(_Handler, server_root=root))


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args, server_root: Path, **kwargs) -> None:
        super().__init__(*args, directory=str(server_root), **kwargs)

    def translate_path(self, path: str) -> str:
        if path.startswith("/artifacts/"):
            return str(self.server.artifacts / path.removeprefix("/artifacts/").split("?")[0])
        return super().translate_path(path)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/config.json":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(self.server.config)
            return
        super().do_GET()

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


def write_images(folder: Path, classes: tuple[int, ...], count: int, offset: int) -> None:
    """Digits as PNG files in class folders, as a phone's photo library would hand them to the file picker."""
    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[offset : offset + count]
    for i in idx:
        (folder / str(ds.y[i])).mkdir(parents=True, exist_ok=True)
        Image.fromarray(ds.x[i]).save(folder / str(ds.y[i]) / f"digit-{i:04d}.png")


def test_a_browser_page_takes_part_in_fedper_rounds(mosquitto, tiny_artifacts, processes, tmp_path):
    websocket = free_port()
    processes.procs.append(subprocess.Popen(  # websockify: Debian Mosquitto's own WebSocket listener is slow to send
        ["websockify", f"127.0.0.1:{websocket}", f"127.0.0.1:{mosquitto.port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    server = PageServer(ROOT / "web" / "dist", tiny_artifacts,
                        {"broker": f"ws://127.0.0.1:{websocket}", "fleet": FLEET, "artifacts": "artifacts/"})
    threading.Thread(target=server.serve_forever, daemon=True).start()

    manifest = Manifest.load(tiny_artifacts)
    topics = Topics(FLEET)
    updates: list[tuple[str, list[str]]] = []
    parts = Reassembler(10_000_000)

    def on_message(client, userdata, message) -> None:  # the broker's view of every update
        device = message.topic.rsplit("/", 1)[-1]
        blob = parts.add(device, decode_chunk(message.payload))
        if blob is not None:
            header = json.loads(blob.data[8 : 8 + int.from_bytes(blob.data[:8], "little")])
            updates.append((device, sorted(k for k in header if k != "__metadata__")))

    spy = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="spy")
    spy.on_message = on_message
    spy.connect("127.0.0.1", mosquitto.port)
    spy.subscribe(f"{topics.base}/update/#", qos=1)
    spy.loop_start()

    state = tmp_path / "coordinator"
    processes.start("coordinator", *coordinator_args(tiny_artifacts, mosquitto.url, state, FLEET, ROUNDS, 3, 300))
    for j, classes in enumerate([(0, 1), (2, 3)]):
        data = write_device_data(tmp_path / f"agent{j}.npz", classes, 50)
        processes.start(f"agent{j}", *agent_args(tiny_artifacts, data, mosquitto.url, FLEET, f"python-{j}",
                                                 tmp_path / f"agent{j}"))
    images = tmp_path / "images"
    write_images(images, (0, 1, 2, 3), 60, offset=300)
    url = f"http://127.0.0.1:{server.server_address[1]}/?device=web-1&seed=3&batch=16&lr=0.02"
    started = time.monotonic()
    done = subprocess.run(["node", str(DRIVER), url, str(images), "2", "420"], cwd=ROOT / "web", capture_output=True,
                          text=True, timeout=480)
    seconds = time.monotonic() - started
    spy.loop_stop()
    server.shutdown()
    result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {"error": done.stderr}
    assert "error" not in result, (result, processes.log("coordinator")[-3000:])
    assert result["isolated"], "the page is not cross-origin isolated: no wasm threads"

    assert result["reloadedAfter"] >= 2
    assert any(f"restored the head of round {result['reloadedAfter']}" in line for line in result["log"]), result["log"]
    assert 0 <= result["final"] <= 1 and "finished" in result["status"]
    rounds = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert r["participants"] == 3, r  # the page's update is folded in every round, the reload's round too
        assert set(r["rejected"]) <= {"duplicate_update"}, r  # a resend after the reload is a harmless duplicate
    shared, heads = manifest.names(shared=True), set(manifest.names(shared=False))
    assert {device for device, _ in updates} == {"python-0", "python-1", "web-1"}
    assert sum(device == "web-1" for device, _ in updates) >= ROUNDS
    for device, names in updates:
        assert not heads & set(names), f"{device} sent head tensors"
        assert names == sorted(shared), device
    print(f"browser fleet: {ROUNDS} rounds in {seconds:.0f} s, the page's final accuracy {result['final']:.3f}")
