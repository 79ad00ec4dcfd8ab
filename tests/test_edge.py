"""The edge agent without a broker: both training backends, the device state dir, bad input.

One real export (MobileNet-v1 width 0.25, 32x32, 4 classes, FedPer + head fine-tune, so it has
both the "all" and the "head" artifact sets) serves the module; data are scikit-learn's real
digit scans.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TinyExport
from PIL import Image

from fedper.batches import epoch_batches
from fedper.data import DataError, load_digits, to_float_nchw
from fedper.edge.agent import Agent, AgentConfig, load_local_data
from fedper.edge.backend import batch_order, check_artifacts, open_backend
from fedper.edge.state import DeviceState, Saved, StateError
from fedper.manifest import ManifestError

CLASSES = ("0", "1", "2", "3")


@pytest.fixture(scope="module")
def artifacts(tiny_export: TinyExport) -> Path:
    return tiny_export(kp=2, algorithm="fedper-ft")


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC 32x32 digit images of classes 0..3, and their labels."""
    ds = load_digits(32).train
    keep = ds.y < 4
    return ds.x[keep][:80], ds.y[keep][:80]


@pytest.fixture(scope="module")
def backends(artifacts: Path):
    manifest = check_artifacts(artifacts)
    return manifest, open_backend("ort", artifacts, manifest), open_backend("torch", artifacts, manifest)


def write_image_folder(root: Path, x: np.ndarray, y: np.ndarray, names=CLASSES) -> Path:
    for i, (image, label) in enumerate(zip(x, y, strict=True)):
        folder = root / names[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i}.png")
    return root


def test_batch_order_is_the_kernels_keyed_by_seed_and_epoch() -> None:
    batches = batch_order(10, 4, epoch=0, seed=(1, 2))
    assert [len(b) for b in batches] == [4, 4, 2]  # no sample dropped
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    assert all(np.array_equal(a, b) for a, b in zip(batches, epoch_batches(10, 4, (1, 2, 0)), strict=True))
    assert not np.array_equal(np.concatenate(batches), np.concatenate(batch_order(10, 4, 1, (1, 2))))
    assert [len(b) for b in batch_order(9, 4, 0, 0)] == [4, 5]  # a lone last sample joins the batch before
    assert [len(b) for b in batch_order(3, 4, 0, 0)] == [3]


def relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def test_ort_and_torch_backends_make_the_same_update(backends, digits) -> None:
    """From the same state and data, both backends make the same update.

    Head phase (two steps, base frozen): every tensor within 1e-4, BatchNorm statistics included.
    Then one step of everything from one state: within 1e-4 (relative) for the head and the last
    blocks, but not for the early layers. MobileNet-v1 is a deep plain BatchNorm network whose
    backward pass amplifies relative round-off about 1.5x per layer at initialization; onnxruntime's
    BatchNorm gradient kernel rounds differently from PyTorch's, so the whole update differs by ~2% (norm-wise)
    (two PyTorch runs with other thread counts agree to 4e-6). That gap is asserted, measured, and
    reported; it is a property of the network and float32, not of the agent: against the same
    step in float64 (MobileNet-v1 x0.25, kp 1, lr 0.01, batch 32), PyTorch float32 is itself
    1.1e-2 of the update off on real CIFAR-10 images and 3.9e-3 on digits, ORT 1.1e-2 and 2.4e-3,
    while ORT and PyTorch differ by 5.2e-4 and 1.9e-3. Natural images thus do not bring a
    whole-network step to 1e-4 either; see test_agent_fleet for what it means after a few rounds."""
    manifest, ort, torch_backend = backends
    names = manifest.names()
    x = to_float_nchw(digits[0][:32], manifest.model.mean, manifest.model.std)
    y = digits[1][:32]

    def step_both(trained: str, batch_size: int, lr: float) -> tuple[dict, dict, dict]:
        start = ort.read(names)
        torch_backend.load(start)
        for backend in (ort, torch_backend):
            backend.train(trained, x, y, epochs=1, batch_size=batch_size, lr=lr, seed=(0, 1))
        return start, ort.read(names), torch_backend.read(names)

    start, a, b = step_both("head", 16, 0.05)
    assert max(float(np.abs(a[n] - start[n]).max()) for n in manifest.names("head")) > 1e-3
    assert max(float(np.abs(a[n] - b[n]).max()) for n in names) < 1e-4

    start, a, b = step_both("all", 32, 0.01)
    late = [n for n in names if manifest.spec(n).trainable and n.startswith(("classifier", "blocks.11", "blocks.12"))]
    assert all(relative_gap(a[n] - start[n], b[n] - start[n]) < 1e-3 for n in late)
    assert max(float(np.abs(a[n] - b[n]).max()) for n in late) < 1e-4
    trainable = [n for n in names if manifest.spec(n).trainable]
    whole = [np.concatenate([(m[n] - start[n]).ravel() for n in trainable]) for m in (a, b)]
    assert relative_gap(*whole) < 0.05
    acc_ort, loss_ort = ort.evaluate(x, y)
    acc_torch, loss_torch = torch_backend.evaluate(x, y)
    assert abs(acc_ort - acc_torch) <= 1 / 32 and abs(loss_ort - loss_torch) < 1e-2


def test_head_phase_leaves_base_weights_and_switching_sets_carries_tensors(backends, digits) -> None:
    manifest, ort, _ = backends
    base_weights = [t.name for t in manifest.tensors if t.role == "base" and t.trainable]
    head = manifest.names("head")
    rng = np.random.default_rng(0)
    written = {n: (0.1 * rng.standard_normal(manifest.spec(n).shape)).astype(np.float32) for n in head}
    ort.load(written)
    assert all(np.array_equal(v, ort.read([n])[n]) for n, v in written.items())
    before = ort.read(base_weights + head)
    x = to_float_nchw(digits[0][:16], manifest.model.mean, manifest.model.std)
    ort.train("head", x, digits[1][:16], epochs=1, batch_size=16, lr=0.1, seed=0)
    after = ort.read(base_weights + head)
    assert all(np.array_equal(before[n], after[n]) for n in base_weights)
    assert any(not np.array_equal(before[n], after[n]) for n in head if manifest.spec(n).trainable)
    ort.train("all", x, digits[1][:16], epochs=1, batch_size=16, lr=0.0, seed=0)  # lr 0: weights unchanged
    carried = ort.read(head)
    assert all(np.array_equal(after[n], carried[n]) for n in head if manifest.spec(n).trainable)


def test_split_is_fixed_once_and_guards_against_changed_data(tmp_path: Path, digits) -> None:
    x, y = digits
    train, test = DeviceState(tmp_path).split(x, y, seed=3)
    assert not set(train.tolist()) & set(test.tolist()) and len(train) + len(test) == len(y)
    again_train, again_test = DeviceState(tmp_path).split(x, y, seed=99)  # a restart with another seed
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    changed = x.copy()
    changed[0, 0, 0, 0] ^= 1
    with pytest.raises(StateError, match="changed"):
        DeviceState(tmp_path).split(changed, y, seed=3)


def saved(manifest, round_: int, value: float) -> Saved:
    local = {n: np.full(manifest.spec(n).shape, value, np.float32) for n in manifest.names(shared=False)}
    update = {n: np.full(manifest.spec(n).shape, value, np.float32) for n in manifest.names(shared=True)}
    return Saved(round_, manifest.base_digest, 12, local, update, {"accuracy": 0.5})


def test_state_round_trips_and_a_full_disk_keeps_the_previous_state(tmp_path: Path, backends, monkeypatch) -> None:
    manifest = backends[0]
    state = DeviceState(tmp_path)
    assert state.load(manifest) is None
    state.save(saved(manifest, 1, 1.0))

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(StateError, match="disk full"):
        state.save(saved(manifest, 2, 2.0))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.safetensors"]  # no temporary file left
    kept = state.load(manifest)
    assert kept.round == 1 and kept.n_samples == 12 and kept.metrics == {"accuracy": 0.5}
    assert all(float(v.max()) == 1.0 for v in [*kept.local.values(), *kept.update.values()])
    assert set(kept.update) == set(manifest.names(shared=True))


def test_corrupt_or_missing_artifacts_are_refused(tmp_path: Path, artifacts: Path) -> None:
    import shutil

    copy = tmp_path / "export"
    shutil.copytree(artifacts, copy)
    checkpoint = copy / "train" / "all" / "checkpoint"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256"):
        check_artifacts(copy)
    checkpoint.unlink()
    with pytest.raises(ManifestError, match="missing"):
        check_artifacts(copy)
    with pytest.raises(ManifestError, match=r"manifest\.json"):
        check_artifacts(tmp_path)


def test_local_data_is_checked_against_the_manifest(tmp_path: Path, artifacts: Path, digits) -> None:
    manifest = check_artifacts(artifacts)
    x, y = digits
    state = DeviceState(tmp_path / "state")
    data = load_local_data(write_image_folder(tmp_path / "good", x[:20], y[:20]), manifest, state, seed=0)
    assert len(data.y_train) + len(data.y_test) == 20 and data.x_train.shape[1:] == (3, 32, 32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        load_local_data(tmp_path / "empty", manifest, state, seed=0)
    stranger = write_image_folder(tmp_path / "stranger", x[:4], y[:4], names=("0", "1", "2", "cat"))
    with pytest.raises(DataError, match="not among the model's classes"):
        load_local_data(stranger, manifest, state, seed=0)


def test_cli_reports_bad_input_in_one_line(tmp_path: Path, artifacts: Path, digits) -> None:
    stranger = write_image_folder(tmp_path / "data", digits[0][:4], digits[1][:4], names=("0", "1", "2", "cat"))
    result = subprocess.run(
        [sys.executable, "-m", "fedper.edge.cli", "--artifacts", str(artifacts), "--data", str(stranger),
         "--broker", "mqtt://127.0.0.1:1", "--fleet", "f", "--client-id", "d0", "--state-dir", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "cat" in result.stderr and "Traceback" not in result.stderr
    assert "fedper-agent:" in result.stderr.strip().splitlines()[-1]


def test_a_restarted_agent_restores_its_head(tmp_path: Path, artifacts: Path, digits) -> None:
    data = tmp_path / "d.npz"
    np.savez(data, x_train=digits[0][:20], y_train=digits[1][:20], classes=np.array(CLASSES))
    config = AgentConfig(artifacts=artifacts, data=data, broker="mqtt://127.0.0.1:1", fleet="f", client_id="d0",
                         state_dir=tmp_path / "state", batch_size=8, lr=0.05, backend="torch")
    first = Agent(config, log=lambda line: None)
    trained = first.train_round(1)
    assert trained.metrics["samples_per_s"] > 0 and 0 <= trained.metrics["accuracy"] <= 1
    second = Agent(config, log=lambda line: None)
    assert second.saved.round == 1
    head = second.backend.read(second.manifest.names(shared=False))
    assert all(np.array_equal(head[n], trained.local[n]) for n in head)
    assert np.array_equal(second.data.y_test, first.data.y_test)  # the same test split after a restart
