"""The BatchNorm policy (--bn shared | local | batch) in the manifest, the emulator, the export and the agent.

local (FedBN): every BatchNorm tensor is marked not shared, so a real agent's update, reassembled from
the frames it would publish, carries none. batch (FedBABU's evaluation): the device evaluates and
serves with each batch's statistics and never moves its running statistics, in the ORT eval graph, in
inference.onnx and in PyTorch alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import load as st_load
from typer.testing import CliRunner

from fedper.artifacts import INFERENCE_FILE
from fedper.data import load_digits
from fedper.edge.agent import Agent, AgentConfig
from fedper.edge.backend import EVAL_BATCH, open_backend
from fedper.emulate.data import FleetData
from fedper.emulate.fleet import Fleet, FleetConfig
from fedper.export.cli import app as export_app
from fedper.export.exporter import export_artifacts
from fedper.manifest import BN_POLICIES, Manifest, ManifestError
from fedper.models import build_model, describe
from fedper.models.describe import batchnorm_names
from fedper.training import evaluate
from fedper.verify import verify

FLEET, DEVICE = "lab", "dev0"
BASE = f"fedper/v1/{FLEET}"
CHUNK = 64 * 1024
TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.05}


def mobilenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mobilenet_v1", 4, 0.25, 32)


# ------------------------------------------------------------ the manifest decides


@pytest.mark.parametrize(("algorithm", "kp"), [("fedper", 2), ("fedavg", 0), ("lg-fedavg", 2)])
def test_local_policy_shares_no_batchnorm_tensor_and_everything_else_as_before(algorithm, kp):
    model = mobilenet()
    norms = batchnorm_names(model)
    shared = describe(model, architecture="mobilenet_v1", kp=kp, algorithm=algorithm, input_size=32)
    local = describe(model, architecture="mobilenet_v1", kp=kp, algorithm=algorithm, input_size=32, bn="local")
    assert local.bn == "local" and norms and norms == {t.name for t in local.tensors if t.batchnorm}
    assert not set(local.names(shared=True)) & norms
    assert local.names(shared=True) == [n for n in shared.names(shared=True) if n not in norms]
    assert set(shared.names(shared=True)) & norms  # the default shares the BatchNorm of the shared role
    assert local.base_digest != shared.base_digest  # peers of different policies refuse each other


def test_batch_policy_shares_what_shared_does():
    model = mobilenet()
    shared, batch = (describe(model, architecture="mobilenet_v1", kp=2, algorithm="fedper", input_size=32, bn=bn)
                     for bn in ("shared", "batch"))
    assert batch.names(shared=True) == shared.names(shared=True) and batch.base_digest == shared.base_digest


def test_manifest_keeps_its_policy_and_refuses_an_unknown_one():
    manifest = describe(mobilenet(), architecture="mobilenet_v1", kp=1, algorithm="fedper", input_size=32, bn="local")
    body = json.loads(manifest.to_json())
    assert body["bn"] == "local" and Manifest.from_dict(body) == manifest
    with pytest.raises(ManifestError, match="unknown BatchNorm policy 'fedbn'"):
        Manifest.from_dict({**body, "bn": "fedbn"})
    with pytest.raises(ValueError, match="unknown BatchNorm policy"):
        describe(mobilenet(), architecture="mobilenet_v1", kp=1, algorithm="fedper", input_size=32, bn="none")


def test_batch_statistics_evaluation_moves_no_running_statistic():
    model = mobilenet()
    x, y = torch.randn(12, 3, 32, 32) * 2 + 1, torch.randint(0, 4, (12,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, loss = evaluate(model, x, y, batch_statistics=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # counters included
    assert not model.training and all(m.track_running_stats for m in model.modules()
                                      if isinstance(m, torch.nn.BatchNorm2d))
    with torch.no_grad():
        model.train()
        expected = torch.nn.functional.cross_entropy(model(x), y).item()  # train mode: batch statistics
    assert loss == pytest.approx(expected, rel=1e-5)
    assert evaluate(model, x, y)[1] != pytest.approx(loss, rel=1e-3)  # running statistics differ


# ------------------------------------------------------------ the emulator


def synthetic(sizes: list[int], classes: int = 4, side: int = 16) -> FleetData:
    """Client j: sizes[j] train and 8 test samples of learnable class patterns, each client's images
    shifted by its own offset (a feature shift: what FedBN's local statistics are for)."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(classes, 3, side, side, generator=g)
    xs, ys, clients, start = [], [], [], 0
    for j, size in enumerate(sizes):
        y = torch.randint(0, classes, (size + 8,), generator=g)
        xs.append(patterns[y] + 0.5 * torch.randn(size + 8, 3, side, side, generator=g) + j)
        ys.append(y)
        clients.append((torch.arange(start, start + size), torch.arange(start + size, start + size + 8)))
        start += size + 8
    return FleetData(x=torch.cat(xs), y=torch.cat(ys), clients=clients, classes=[str(c) for c in range(classes)])


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
@pytest.mark.parametrize("algorithm", ["fedper", "fedavg"])
def test_emulator_runs_each_policy(engine, algorithm):
    """local: every client keeps its own BatchNorm tensors, which followed its own data; batch: the same
    training as shared (same batches, same aggregate), evaluated with the test split's statistics."""
    data = synthetic([16, 24])
    kp = 0 if algorithm == "fedavg" else 2
    runs = {}
    for bn in BN_POLICIES:
        fleet = Fleet(FleetConfig(algorithm=algorithm, kp=kp, engine=engine, bn=bn, **TINY), data)
        assert fleet.manifest.bn == bn
        state, metrics = fleet.run_round(fleet.init())
        runs[bn] = fleet, state, metrics
    fleet, local, _ = runs["local"]
    norms = batchnorm_names(fleet.model)
    assert not set(local.shared) & norms
    running = "stem.1.running_mean"
    assert running in norms and all(running in own for own in local.local)
    assert not torch.equal(local.local[0][running], local.local[1][running])  # each client's own data
    _, shared, shared_metrics = runs["shared"]
    _, batch, batch_metrics = runs["batch"]
    assert running in shared.shared and all(torch.equal(shared.shared[n], batch.shared[n]) for n in shared.shared)
    assert batch_metrics["loss"] != shared_metrics["loss"]


def test_emulator_policies_are_engine_independent():
    data = synthetic([16, 24])
    data = dataclasses.replace(data, x=data.x.double())
    for bn in ("local", "batch"):
        results = []
        for engine in ("sequential", "vmap"):
            fleet = Fleet(FleetConfig(algorithm="fedper", kp=2, engine=engine, bn=bn, **TINY), data)
            fleet.model.double()
            fleet.initial = {n: t.double() for n, t in fleet.initial.items()}
            results.append(fleet.run_round(fleet.init()))
        (a, ma), (b, mb) = results
        assert all(torch.allclose(a.local[j][n], b.local[j][n], atol=1e-8) for j in range(2) for n in a.local[j])
        assert np.allclose(ma["loss"], mb["loss"], atol=1e-8), bn


# ------------------------------------------------------------ the export and the agent


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real export per policy: MobileNet-v1 x0.25, 32x32, 4 classes, FedPer K_P=1."""
    root = tmp_path_factory.mktemp("bn-exports")
    for bn in BN_POLICIES:
        export_artifacts(root / bn, model="mobilenet_v1", kp=1, algorithm="fedper", num_classes=4, input_size=32,
                         width=0.25, classes=("0", "1", "2", "3"), bn=bn)
    return {bn: root / bn for bn in BN_POLICIES}


@pytest.mark.parametrize("bn", BN_POLICIES)
def test_export_records_its_policy_and_verifies(exports, bn):
    path = exports[bn] / "manifest.json"
    body = json.loads(path.read_text())
    assert body["bn"] == bn and verify(exports[bn]) == []
    norms = [t for t in body["tensors"] if t["batchnorm"]]
    assert {t["name"] for t in norms} == batchnorm_names(build_model("mobilenet_v1", 4, 0.25, 32))
    assert all(t["shared"] == (bn != "local" and t["role"] == "base") for t in norms)
    if bn == "local":  # a BatchNorm tensor marked shared again is a manifest that lies about its policy
        norms[0]["shared"] = True  # and no stated base_digest, which would give the lie away first
        path.write_text(json.dumps({k: v for k, v in body.items() if k != "base_digest"}))
        try:
            assert any("BatchNorm policy local" in line for line in verify(exports[bn]))
        finally:
            norms[0]["shared"] = False
            path.write_text(json.dumps(body, indent=2) + "\n")
        assert verify(exports[bn]) == []


def test_export_refuses_an_unknown_policy_before_writing(tmp_path):
    result = CliRunner().invoke(export_app, ["--model", "mobilenet_v1", "--num-classes", "4", "--width", "0.25",
                                             "--bn", "fedbn", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "unknown BatchNorm policy 'fedbn'" in result.output
    assert not (tmp_path / "out").exists()


def read_frame(payload: bytes) -> tuple[dict, bytes]:
    """docs/protocol.md section 5, by hand: u32 header length, u32 crc32, JSON header, data."""
    n, crc = struct.unpack_from(">II", payload)
    assert zlib.crc32(payload[8:]) == crc
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def frame(header: dict, data: bytes) -> bytes:
    head = json.dumps({"v": 1, **header}).encode()
    return struct.pack(">II", len(head), zlib.crc32(head + data)) + head + data


def round_messages(blob: bytes, round_: int, digest: str) -> list[tuple[str, bytes]]:
    """RoundInfo and the model's chunks, as the coordinator publishes them (docs/protocol.md)."""
    count, sha = max(1, -(-len(blob) // CHUNK)), hashlib.sha256(blob).hexdigest()
    info = {"v": 1, "round": round_, "rounds": 3, "state": "open", "deadline": 1.9e9, "blob_id": f"r{round_}",
            "size": len(blob), "sha256": sha, "count": count, "base_digest": digest}
    return [(f"{BASE}/round", json.dumps(info).encode())] + [
        (f"{BASE}/model/r{round_}/{i}",
         frame({"blob_id": f"r{round_}", "index": i, "count": count, "size": len(blob), "chunk_size": CHUNK,
                "sha256": sha, "meta": {"round": round_}}, blob[i * CHUNK : (i + 1) * CHUNK]))
        for i in range(count)]


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_under_local_an_agents_update_carries_no_batchnorm_tensor(exports, tmp_path, backend):
    """A real agent trains two rounds; the bytes it would publish, reassembled by hand, hold exactly the
    manifest's shared tensors and no BatchNorm tensor, base or head, while its own BatchNorm statistics
    carry over from round to round (the coordinator's model never holds them)."""
    from safetensors.numpy import save as st_save

    ds = load_digits(32).train
    idx = np.flatnonzero(ds.y < 4)[:24]
    data = tmp_path / "digits.npz"
    np.savez(data, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
    agent = Agent(AgentConfig(artifacts=exports["local"], data=data, broker="mqtt://127.0.0.1:1", fleet=FLEET,
                              client_id=DEVICE, state_dir=tmp_path / "state", batch_size=8, lr=0.05, backend=backend),
                  log=lambda line: None)
    manifest = agent.manifest
    norms = {t.name for t in manifest.tensors if t.batchnorm}
    model = agent.backend.read(manifest.names(shared=True))
    statistics = []
    for round_ in (1, 2):
        out = []
        for topic, payload in round_messages(st_save(model), round_, manifest.base_digest):
            out += agent.handle(topic, payload)
        frames = [read_frame(m.payload) for m in out if m.topic == f"{BASE}/update/{DEVICE}"]
        blob = b"".join(data for _, data in sorted(frames, key=lambda f: f[0]["index"]))
        assert frames and hashlib.sha256(blob).hexdigest() == frames[0][0]["sha256"]
        update = st_load(blob)
        assert sorted(update) == sorted(manifest.names(shared=True)) and not set(update) & norms
        assert "blocks.0.1.running_mean" in norms and "blocks.0.1.weight" in norms  # a base layer's
        statistics.append(agent.backend.read(["blocks.0.1.running_mean"])["blocks.0.1.running_mean"])
        model = update
    assert not np.array_equal(statistics[0], statistics[1])


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_under_batch_the_device_evaluates_with_batch_statistics_and_keeps_its_running_ones(exports, backend):
    directory = exports["batch"]
    manifest = Manifest.load(directory)
    device = open_backend(backend, directory, manifest)
    g = np.random.default_rng(0)
    x = (g.normal(size=(EVAL_BATCH // 4, 3, 32, 32)) * 2 + 1).astype(np.float32)
    y = g.integers(0, 4, len(x)).astype(np.int64)
    device.train("all", x, y, epochs=1, batch_size=16, lr=0.05, seed=(0, 1, 0))  # running statistics move
    tensors = device.read(manifest.names())
    accuracy, loss = device.evaluate(x, y)
    assert all(np.array_equal(tensors[n], v) for n, v in device.read(manifest.names()).items())
    model = build_model("mobilenet_v1", 4, 0.25, 32)
    model.load_state_dict({n: torch.from_numpy(v) for n, v in tensors.items()}, strict=False)
    expected = evaluate(model, torch.from_numpy(x), torch.from_numpy(y), batch_statistics=True)
    assert loss == pytest.approx(expected[1], rel=1e-4) and accuracy == expected[0]
    assert evaluate(model, torch.from_numpy(x), torch.from_numpy(y))[1] != pytest.approx(loss, rel=1e-3)


def test_batch_inference_model_serves_batch_statistics_run_after_run(exports):
    """inference.onnx under ORT's full graph optimizations: the same logits as PyTorch with batch
    statistics, and the same on every run (nothing in the graph is written by a run)."""
    session = ort.InferenceSession(str(exports["batch"] / INFERENCE_FILE))
    x = (np.random.default_rng(1).normal(size=(8, 3, 32, 32)) * 3 + 1).astype(np.float32)
    first, second = (session.run(None, {"input": x})[0] for _ in range(2))
    torch.manual_seed(0)
    model = build_model("mobilenet_v1", 4, 0.25, 32).eval()
    from fedper.training import batchnorm_batch_statistics

    with torch.no_grad(), batchnorm_batch_statistics(model):
        expected = model(torch.from_numpy(x)).numpy()
    assert np.array_equal(first, second) and np.allclose(first, expected, atol=1e-4)


def test_figure_bn_draws_each_policy_of_fedper_and_fedavg_as_a_mean_over_three_seeds():
    from fedper.emulate.data import DataConfig
    from fedper.emulate.figures import _over_seeds, _seeded, _specs

    spec = _specs(DataConfig(seed=5), FleetConfig(seed=5))["bn"]
    assert spec.seeds == 3 and spec.band
    assert [(c.fleet.algorithm, c.fleet.kp, c.fleet.bn) for c in spec.curves] == [
        (a, kp, bn) for a, kp in (("fedper", 2), ("fedavg", 0)) for bn in BN_POLICIES]
    seeded = _seeded(spec.curves[1], spec.seeds)
    assert [(c.data.seed, c.fleet.seed, c.fleet.bn) for c in seeded] == [(5, 5, "local"), (6, 6, "local"),
                                                                        (7, 7, "local")]
    runs = [(c, [{"round": 1, "mean_accuracy": a}, {"round": 2, "mean_accuracy": a + 0.1}],
             {"chance_accuracy": chance})
            for c, a, chance in zip(seeded, (0.2, 0.3, 0.7), (0.25, 0.3, 0.35), strict=True)]
    [(curve, history, info)] = _over_seeds(runs, spec.seeds)
    assert curve == seeded[0] and [m["round"] for m in history] == [1, 2]
    assert info["chance_accuracy"] == pytest.approx(0.3)  # each seed splits its own way: the mean chance line
    assert history[1]["mean_accuracy"] == pytest.approx(0.5)
    assert history[1]["accuracy"] == pytest.approx([0.3, 0.4, 0.8])
