"""The coordinator's Prometheus metrics: scraped over HTTP after a round driven with protocol messages,
and scraped by a real Prometheus server during a live round over Mosquitto."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import Processes, coordinator_args
from prometheus_client.parser import text_string_to_metric_families
from test_coordinator_live import FLEET, Device, wait_for, write_artifacts
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.metrics import CoordinatorMetrics
from fedper.coordinator.store import Store
from fedper.payload import encode_shared
from fedper.ports import free_port
from fedper.wire import Register, Topics, UpdateMeta, chunk

MANIFEST = tiny_manifest()
TOPICS = Topics("lab")
PROMETHEUS = shutil.which("prometheus")
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def dashboard_queries() -> list[str]:
    """The PromQL of every panel of deploy/grafana/fedper-dashboard.json, for all coordinators."""
    dashboard = json.loads((DEPLOY / "grafana" / "fedper-dashboard.json").read_text())
    return [t["expr"].replace("$instance", ".*") for p in dashboard["panels"] for t in p["targets"]]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def send_update(c: Coordinator, device: str, delta: float, n: int, accuracy: float, now: float) -> int:
    """Device's update (base + delta) for the open round, in 40-byte chunks; the bytes sent."""
    tensors = {k: (v + np.float32(delta)).astype(np.float32) for k, v in c.model.items()}
    meta = UpdateMeta(c.round.number, n, MANIFEST.base_digest, {"accuracy": accuracy})
    frames = chunk(encode_shared(MANIFEST, tensors), 40, f"r{c.round.number}-{device}", meta.to_dict())
    for frame in frames:
        assert c.handle(TOPICS.update(device), frame, now) == []
    return sum(len(f) for f in frames)


def test_scrape_after_a_round_reports_devices_rounds_refusals_bytes_and_accuracy(tmp_path: Path) -> None:
    c = Coordinator(MANIFEST, tiny_tensors(), TOPICS, Config.of(rounds=3, min_clients=2, round_timeout=10.0),
                    Store(tmp_path))
    metrics = CoordinatorMetrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        c.start(0.0)
        metrics.observe(c)
        for device, n in (("a", 10), ("b", 30), ("c", 5)):
            c.handle(TOPICS.register(device), Register(n, MANIFEST.base_digest, "test/1").encode(), 0.1)
        for device in ("a", "b"):
            c.handle(TOPICS.presence(device), b"online", 0.2)
        sent = send_update(c, "a", 1.0, 10, 0.5, 1.0)
        c.handle(TOPICS.presence("ghost"), b"maybe", 1.1)  # refused: bad_message
        c.handle(TOPICS.update("stranger"), chunk(b"x" * 8, 40, "s", {"round": 1})[0], 1.2)  # unknown_device
        c.tick(1.3)
        metrics.observe(c)
        mid = scrape(port)
        assert mid[("fedper_round_accepted_devices", ())] == 1 and mid[("fedper_updates_accepted_total", ())] == 1
        assert mid[("fedper_round", ())] == 1 and mid[("fedper_rounds_closed_total", ())] == 0
        assert ("fedper_round_accuracy", ()) not in mid  # no round closed yet
        sent += send_update(c, "b", 3.0, 30, 0.9, 2.0)
        sent += send_update(c, "c", 2.0, 5, 0.7, 2.5)
        c.tick(10.5)  # the round's deadline: closed with a, b and c
        metrics.observe(c)
        got = scrape(port)
    finally:
        metrics.close()
    assert c.round.number == 2
    assert got[("fedper_devices_registered", ())] == 3 and got[("fedper_devices_online", ())] == 2
    assert got[("fedper_devices_invited", ())] == 3  # no --clients-per-round: every registered device
    assert got[("fedper_round", ())] == 2 and got[("fedper_rounds_planned", ())] == 3
    assert got[("fedper_rounds_closed_total", ())] == 1 and got[("fedper_run_finished", ())] == 0
    assert got[("fedper_round_accepted_devices", ())] == 0 and got[("fedper_updates_accepted_total", ())] == 3
    assert got[("fedper_refusals_total", (("code", "bad_message"),))] == 1
    assert got[("fedper_refusals_total", (("code", "unknown_device"),))] == 1
    stranger = len(chunk(b"x" * 8, 40, "s", {"round": 1})[0])
    assert got[("fedper_received_bytes_total", ())] == sent + stranger
    assert got[("fedper_round_accuracy", ())] == pytest.approx((0.5 + 0.9 + 0.7) / 3)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert got[("fedper_round_seconds_count", ())] == 1 and got[("fedper_round_seconds_sum", ())] == record["collect_s"]
    assert got[("fedper_round_seconds_bucket", (("le", "15.0"),))] == 1  # 10.5 s
    assert got[("fedper_round_seconds_bucket", (("le", "5.0"),))] == 0
    assert got[("fedper_aggregate_seconds_count", ())] == 1
    assert got[("fedper_fold_seconds_count", ())] == 3  # one per accepted update
    assert 0 < got[("fedper_fold_seconds_sum", ())] == pytest.approx(c.fold_seconds)
    dashboard_names = {n for q in dashboard_queries() for n in re.findall(r"fedper_\w+", q)}
    assert dashboard_names and dashboard_names <= {name for name, _ in got}  # the dashboard shows what is served


def test_invited_devices_is_the_rounds_invitation_when_selecting(tmp_path: Path) -> None:
    config = Config.of(rounds=2, min_clients=1, round_timeout=10.0, clients_per_round=2, over_select=1.5)
    c = Coordinator(MANIFEST, tiny_tensors(), TOPICS, config, Store(tmp_path))
    metrics = CoordinatorMetrics()
    c.start(0.0)
    for device in ("a", "b", "c", "d", "e"):
        c.handle(TOPICS.register(device), Register(10, MANIFEST.base_digest, "test/1").encode(), 0.1)
        c.handle(TOPICS.presence(device), b"online", 0.1)
    c.tick(1.0)  # tops the round up from the devices now online: ceil(1.5 * 2) = 3 of 5
    metrics.observe(c)
    assert metrics.registry.get_sample_value("fedper_devices_invited") == 3
    assert metrics.registry.get_sample_value("fedper_devices_registered") == 5


def test_a_resumed_run_keeps_totals_and_counts_only_its_own_rounds_in_histograms(tmp_path: Path) -> None:
    config = Config.of(rounds=3, min_clients=1, round_timeout=10.0)
    first = Coordinator(MANIFEST, tiny_tensors(), TOPICS, config, Store(tmp_path))
    first.start(0.0)
    first.handle(TOPICS.register("a"), Register(10, MANIFEST.base_digest, "test/1").encode(), 0.1)
    sent = send_update(first, "a", 1.0, 10, 0.25, 1.0)
    first.tick(1.5)
    assert first.round.number == 2
    resumed = Coordinator(MANIFEST, tiny_tensors(), TOPICS, config, Store(tmp_path))  # a restart: same state dir
    metrics = CoordinatorMetrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.observe(resumed)
        got = scrape(port)
    finally:
        metrics.close()
    assert got[("fedper_rounds_closed_total", ())] == 1 and got[("fedper_updates_accepted_total", ())] == 1
    assert got[("fedper_received_bytes_total", ())] == sent and got[("fedper_round_accuracy", ())] == 0.25
    assert got[("fedper_round_seconds_count", ())] == 0  # closed by the earlier process


def test_two_coordinators_in_one_process_have_their_own_registries(tmp_path: Path) -> None:
    coordinators = [Coordinator(MANIFEST, tiny_tensors(), TOPICS, Config.of(rounds=r, min_clients=1, round_timeout=5.0),
                                Store(tmp_path / str(r))) for r in (2, 7)]
    endpoints = [CoordinatorMetrics() for _ in coordinators]
    try:
        ports = [m.serve("127.0.0.1", 0) for m in endpoints]
        for m, c in zip(endpoints, coordinators, strict=True):
            m.observe(c)
        assert [scrape(p)[("fedper_rounds_planned", ())] for p in ports] == [2, 7]
    finally:
        for m in endpoints:
            m.close()


def test_cli_metrics_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    artifacts = write_artifacts(tmp_path / "export", MANIFEST, tiny_tensors())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = coordinator_args(artifacts, "mqtt://127.0.0.1:1", tmp_path / "state", FLEET, 1, 1, 5.0,
                                "--metrics-port", str(port))
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"fedper-coordinator: cannot serve metrics on 127.0.0.1:{port}" in done.stderr


def query(prometheus_port: int, expression: str) -> list[dict]:
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.mosquitto
def test_a_real_prometheus_scrapes_accepted_updates_of_a_live_round(mosquitto, tmp_path: Path,
                                                                    processes: Processes) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (apt-get install prometheus; `make test` does it as root)")
    artifacts = write_artifacts(tmp_path / "export", MANIFEST, tiny_tensors())
    metrics_port, prometheus_port = free_port(), free_port()
    # Round 1 waits for the silent device until its 60 s deadline: the coordinator is up, with one accepted update.
    coordinator = processes.start("coordinator", *coordinator_args(
        artifacts, mosquitto.url, tmp_path / "state", FLEET, 2, 1, 60.0, "--metrics-port", str(metrics_port)))
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: fedper-coordinator\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{metrics_port}']\n")
    with open(tmp_path / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/tsdb",
                                       f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                      stdout=log, stderr=subprocess.STDOUT)
    processes.procs.append(prometheus)
    devices = [Device(mosquitto.url, "a", 10, 1.0, MANIFEST), Device(mosquitto.url, "silent", 20, 2.0, MANIFEST,
                                                                      respond=False)]
    try:
        accepted: list[dict] = []

        def scraped_an_accepted_update() -> bool:
            assert coordinator.poll() is None, processes.log("coordinator")
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                accepted[:] = query(prometheus_port, "fedper_updates_accepted_total > 0")
            except OSError:  # Prometheus still starting
                return False
            return bool(accepted)

        wait_for(scraped_an_accepted_update, 45, "Prometheus to scrape an accepted update")
        (sample,) = accepted
        assert sample["metric"]["job"] == "fedper-coordinator" and float(sample["value"][1]) == 1
        registered = query(prometheus_port, "fedper_devices_registered")
        assert [float(r["value"][1]) for r in registered] == [2]
        assert query(prometheus_port, "up{job='fedper-coordinator'}")[0]["value"][1] == "1"
        (sent,) = query(prometheus_port, "fedper_sent_bytes_total")  # at least round 1's model went out
        assert float(sent["value"][1]) > len(encode_shared(MANIFEST, tiny_tensors()))
        for expression in dashboard_queries():  # every dashboard panel's query is valid PromQL for this Prometheus
            query(prometheus_port, expression)
    finally:  # the processes fixture kills the coordinator and Prometheus
        for d in devices:
            d.close()


def test_shipped_scrape_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (it comes with Debian's prometheus package)")
    done = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
