"""The web agent measured: training in the page (Debian's chromium, onnxruntime-web 1.19.2 on 1 and 2 wasm threads,
stock and `--graph fast` exports) against the Python agent's OrtBackend on the same machine and data, the page's
session start, each engine's (chromium, firefox-esr, WebKitGTK: web/test/browser/engines.mjs) wasm threads,
samples/s and tab memory (benchmarks/web_engines.py does so at three widths), a FedPer round with the page over
WebSockets (websockify in front of Mosquitto), and the accuracy a device reaches after several FedPer rounds as the
page (its modules in node) and as a Python agent, with the same data, seed and fleet.

Every speed is a ratio measured in this run (page samples/s / Python samples/s), the median of `repeats`
alternating measurements; the machine is shared, so only the ratios mean much.

    python benchmarks/web.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import main, median, table, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MOSQUITTO, Broker  # noqa: E402  (the test suite's Mosquitto launcher)
from helpers.page import write_images  # noqa: E402
from helpers.websocket import WEBSOCKIFY, Websockify  # noqa: E402

from fedper.coordinator.web import WebServer  # noqa: E402
from fedper.edge.ort_backend import OrtBackend  # noqa: E402
from fedper.export.exporter import export_artifacts  # noqa: E402
from fedper.manifest import Manifest  # noqa: E402
from fedper.ports import free_port  # noqa: E402

WEB = ROOT / "web"
BATCH = 32
LR = 0.01
ENGINES = {"chromium": "chromium", "firefox": "firefox-esr", "webkit": "WebKitWebDriver"}  # engine: what it needs
FLEET_TRAINING = {"lr": 0.05, "batch": 32, "epochs": 2, "images": 300}  # the accuracy fleets' devices, as the demo's


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def holds_a_page(engine: str, words: list[str]) -> bool:
    """Whether a process of `engine` renders web content, from its command line's words (chromium and firefox
    rewrite theirs into one space-separated string)."""
    if engine == "chromium":
        return "--type=renderer" in words
    if engine == "firefox":
        return "-contentproc" in words and words[-1] == "tab"
    return bool(words) and Path(words[0]).name == "WebKitWebProcess"


def tab_rss_mb(pid: int, engine: str) -> float:
    """The largest resident set, in MB, of the processes below `pid` that render a page."""
    largest = 0.0
    for child in descendants(pid):
        try:
            words = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
            if holds_a_page(engine, words):
                status = Path(f"/proc/{child}/status").read_text()
                rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
                largest = max(largest, rss_kb / 1000)
        except (OSError, StopIteration):
            continue
    return largest


def page_speed(export: Path, threads: int, samples: int, repeats: int, engine: str = "chromium") -> dict[str, Any]:
    """The page's session start and samples/s (web/test/browser/bench.mjs) in `engine` for `export` on `threads`
    threads (one where the page has no shared memory), and the tab's peak memory while it runs."""
    with WebServer(WEB / "dist", export, "bench", "ws://127.0.0.1:9/", host="127.0.0.1") as server:
        command = ["node", str(WEB / "test" / "browser" / "bench.mjs"), server.url().rstrip("/"), str(threads),
                   str(samples), str(BATCH), str(repeats)]
        with subprocess.Popen(command, cwd=WEB, env={**os.environ, "ENGINE": engine}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as node:
            peak = 0.0
            while node.poll() is None:
                peak = max(peak, tab_rss_mb(node.pid, engine))
                time.sleep(0.2)
            out, err = node.communicate()
    if node.returncode:
        raise RuntimeError(f"the page's benchmark in {engine} failed: {err[-2000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "tabPeakMB": peak}


def engines_table(exports: dict[float, Path], samples: int, repeats: int) -> tuple[str, dict[str, Any]]:
    """Every installed engine on every export (width -> export), 2 threads asked for: a table and its results."""
    engines = [e for e, tool in ENGINES.items() if shutil.which(tool)]
    rows, results = [], {}
    for width, export in exports.items():
        for engine in engines:
            page = page_speed(export, 2, samples, repeats, engine)
            results[f"{engine}-{width}"] = page
            rows.append([engine, width, page["threads"], "yes" if page["isolated"] else "no",
                         median(page["samplesPerS"]), page["startS"], round(page["tabPeakMB"])])
    missing = ", ".join(sorted(set(ENGINES) - set(engines)))
    header = ["engine", "width", "threads", "isolated", "samples/s", "session start s", "tab peak MB"]
    asked = f"Every engine, 2 wasm threads asked for{f' ({missing} not installed)' if missing else ''}"
    return f"{asked}:\n\n{table(header, rows)}", results


def python_speed(export: Path, samples: int, repeats: int) -> list[float]:
    """The Python agent's OrtBackend on the same random data (one warm-up epoch)."""
    manifest = Manifest.load(export)
    backend = OrtBackend(export, manifest)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, *manifest.model.input_shape), dtype=np.float32)
    y = (np.arange(samples) % manifest.model.num_classes).astype(np.int64)
    kind = next(iter(manifest.artifact_sets))
    backend.train(kind, x, y, epochs=1, batch_size=BATCH, lr=LR, seed=0)
    return [backend.train(kind, x, y, epochs=1, batch_size=BATCH, lr=LR, seed=r + 1).samples_per_second
            for r in range(repeats)]


def round_over_websockets(export: Path, work: Path) -> dict[str, Any]:
    """Two FedPer rounds with the page (served by fedper-coordinator --web-port, its broker through websockify) and
    one Python agent (over TCP): the coordinator's metrics of round 2, and the page's training lines."""
    from helpers.processes import Processes, agent_args, coordinator_args, write_device_data

    if MOSQUITTO is None or WEBSOCKIFY is None:
        return {"skipped": "mosquitto or websockify is not installed"}
    work.mkdir(parents=True)
    broker = Broker(work, extra_conf="max_queued_messages 10000")
    broker.start()
    bridge = Websockify(work, broker.port)
    processes = Processes(work)
    try:
        bridge.wait_ready()
        state, web = work / "coordinator", free_port()
        processes.start("coordinator", *coordinator_args(export, broker.url, state, "bench", 2, 2, 600),
                        "--web-port", str(web), "--web-host", "127.0.0.1", "--web-broker", bridge.url)
        data = write_device_data(work / "agent.npz", (0, 1, 2, 3), 100)
        processes.start("agent", *agent_args(export, data, broker.url, "bench", "python-1", work / "agent"))
        write_images(work / "images", (0, 1, 2, 3), 100, offset=300)
        time.sleep(5)  # the coordinator's page server starts with it
        driver = WEB / "test" / "browser" / "drive.mjs"
        done = subprocess.run(["node", str(driver), f"http://127.0.0.1:{web}/?device=web-1&batch=16",
                               str(work / "images"), "0", "900"], cwd=WEB, capture_output=True, text=True,
                              timeout=1000, check=False)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if "error" in result:
            raise RuntimeError(f"the page's round failed: {result['error']}")
        rounds = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
        last = rounds[-1]
        return {"round": last, "page_log": [line for line in result["log"] if "trained" in line]}
    finally:
        processes.kill_all()
        bridge.stop()
        broker.stop()


def digits_npz(path: Path, classes: tuple[int, ...], count: int, offset: int) -> Path:
    """The digits web/test/helpers.mjs digits() gives the page, in the page's order (class name, then file)."""
    from fedper.data import load_digits

    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[offset:][:count]
    idx = idx[sorted(range(len(idx)), key=lambda k: str(ds.y[idx[k]]))]
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(["0", "1", "2", "3"]))
    return path


def fleet_accuracy(export: Path, work: Path, device: str, seed: int, rounds: int) -> dict[str, Any]:
    """FedPer rounds of two devices, a Python agent (digits 1-3) and the device measured (digits 0-2), `device`
    "python" or "page", both trained as FLEET_TRAINING says: that device's final personalized accuracy and the
    coordinator's per-round mean."""
    from helpers.processes import Processes, coordinator_args

    t = FLEET_TRAINING
    work.mkdir(parents=True)
    broker = Broker(work)
    broker.start()
    processes = Processes(work)

    def agent(name: str, data: Path, agent_seed: int) -> list[str]:
        return ["-m", "fedper.edge.cli", "--artifacts", str(export), "--data", str(data), "--broker", broker.url,
                "--fleet", "acc", "--client-id", name, "--state-dir", str(work / name), "--batch-size", str(t["batch"]),
                "--lr", str(t["lr"]), "--local-epochs", str(t["epochs"]), "--seed", str(agent_seed)]

    try:
        state = work / "coordinator"
        processes.start("coordinator", *coordinator_args(export, broker.url, state, "acc", rounds, 2, 600))
        processes.start("other", *agent("other", digits_npz(work / "other.npz", (1, 2, 3), t["images"], 0), 9))
        if device == "python":
            processes.start("measured", *agent("measured", digits_npz(work / "mine.npz", (0, 1, 2), t["images"], 0),
                                               seed)).wait(timeout=1800)
            final = json.loads((work / "measured" / "final.json").read_text())["accuracy"]
        else:
            done = subprocess.run(["node", str(WEB / "test" / "device.mjs"), broker.url, "acc", "measured", str(export),
                                   "[0,1,2]", str(t["images"]), "0", str(seed), str(t["lr"]), str(t["batch"]),
                                   str(t["epochs"])], cwd=WEB, capture_output=True, text=True, timeout=1800,
                                  check=False)
            final = json.loads(done.stdout.strip().splitlines()[-1])["final"]
        lines = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
        return {"final": final, "accuracy_mean": [r["accuracy_mean"] for r in lines]}
    finally:
        processes.kill_all()
        broker.stop()


def run(out: Path, quick: bool = False) -> str:
    if not (WEB / "dist" / "index.html").is_file() or shutil.which("chromium") is None:
        return "web: skipped (build the page with `make web` and install chromium: `make chromium`)"
    width, samples, repeats = (0.25, 128, 2) if quick else (1.0, 256, 3)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for graph in ("stock", "fast"):
            export = Path(tmp) / graph
            export_artifacts(export, model="mobilenet_v1", kp=0, num_classes=10, input_size=32, width=width,
                             algorithm="fedavg", graph=graph)
            python = python_speed(export, samples, repeats)
            for threads in (1, 2):
                page = page_speed(export, threads, samples, repeats)
                ratio = median(page["samplesPerS"]) / median(python)
                results[f"{graph}-{threads}"] = {"page": page, "python": python, "ratio": ratio}
                rows.append([graph, threads, median(page["samplesPerS"]), median(python), ratio, page["startS"],
                             "yes" if page["isolated"] else "no"])
        engines_text, results["engines"] = engines_table({width: Path(tmp) / "stock"}, samples, repeats)
        fleet = round_over_websockets(Path(tmp) / "stock", Path(tmp) / "round")
        accuracy_export = Path(tmp) / "fedper"
        export_artifacts(accuracy_export, model="mobilenet_v1", kp=2, num_classes=4, input_size=32, width=0.25,
                         classes=("0", "1", "2", "3"))
        rounds = 3 if quick else 10
        accuracy = {f"{device}-seed{seed}": fleet_accuracy(accuracy_export, Path(tmp) / f"acc-{device}-{seed}",
                                                           device, seed, rounds)
                    for device, seed in (("python", 3), ("page", 3), ("python", 4), ("page", 4))}
    results["round"] = fleet
    results["accuracy"] = accuracy
    write_json(out, "web", {"width": width, "batch": BATCH, "samples": samples, "results": results})
    text = table(["graph", "wasm threads", "page samples/s", "Python ORT samples/s", "page / Python",
                  "session start s", "isolated"], rows)
    text += f"\n\n{engines_text}"
    if "round" in fleet:
        r = fleet["round"]
        text += (f"\n\nround 2 with the page over WebSockets and a Python agent over TCP: {r['bytes_received']} bytes "
                 f"received, broadcast {r['broadcast_s']:.2f} s, collect {r['collect_s']:.2f} s, aggregate "
                 f"{r['aggregate_s']:.2f} s; the page: {fleet['page_log'][-1] if fleet['page_log'] else '?'}")
    acc_rows = [[name, r["final"], " ".join(f"{a:.3f}" for a in r["accuracy_mean"])] for name, r in accuracy.items()]
    text += (f"\n\nFedPer, {rounds} rounds, two devices (MobileNet-v1 x0.25 K_P=2, {FLEET_TRAINING['images']} digits "
             "of three classes each); the measured device as a Python agent or as the page (node), same data and "
             "seed:\n\n"
             + table(["measured device", "its final accuracy", "fleet's mean accuracy by round"], acc_rows))
    return f"MobileNet-v1 width {width}, 32x32, batch {BATCH}:\n\n{text}"


if __name__ == "__main__":
    main(run, __doc__, quick="width 0.25, 128 samples, 2 repeats")
