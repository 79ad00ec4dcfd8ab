"""One durable-state path: the checkpoint format, its atomic writer on a really full disk, and the
explicit migrations of the agent's and the emulator's older files."""

from __future__ import annotations

import errno
import json
import logging
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.disk import fill
from safetensors.numpy import load_file, save_file

from fedper import checkpoint
from fedper.checkpoint import CorruptCheckpoint, read_checkpoint, write_checkpoint
from fedper.coordinator.store import CheckpointError, Store
from fedper.edge.state import TENSORS_FILE, DeviceState, Saved, StateError
from fedper.emulate.data import DataConfig
from fedper.emulate.experiment import LEGACY_STATE, STATE, RunConfig, run_experiment
from fedper.emulate.fleet import FleetConfig, FleetState, load_state, save_state
from fedper.manifest import Manifest, ModelInfo, TensorSpec


def tiny_manifest() -> Manifest:
    """A shared base tensor and a device-local head tensor."""
    info = ModelInfo("tiny", kp=1, num_classes=3, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper", tensors=(
        TensorSpec("stem.weight", (2, 3), "float32", "base", True, shared=True),
        TensorSpec("classifier.weight", (3, 2), "float32", "head", True, shared=False),
    ))


def varied() -> dict[str, np.ndarray]:
    """Every dtype the format maps, a scalar, an empty array, a big-endian and a strided one."""
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal(7).astype(np.float32),
        "f16": rng.standard_normal(4).astype(np.float16),
        "i64": np.arange(-3, 3, dtype=np.int64),
        "i8": np.array([-128, 0, 127], np.int8),
        "u8": np.arange(5, dtype=np.uint8),
        "flags": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "big_endian": np.arange(6, dtype=">f4").reshape(2, 3),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
    }


def test_a_checkpoint_is_a_safetensors_file_with_its_json_metadata(tmp_path: Path) -> None:
    tensors = varied()
    meta = {"round": 3, "names": ["a", "b"], "metrics": {"accuracy": 0.25}, "digest": "sha256:ab"}
    path = tmp_path / "c.safetensors"
    write_checkpoint(path, tensors, meta)
    got, got_meta = read_checkpoint(path)
    assert got_meta == meta and list(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype.newbyteorder("=") and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want)
    # any safetensors reader reads it: the header, by hand, and the reference library
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    assert length % 8 == 0 and header["__metadata__"] == {"json": json.dumps(meta)}
    assert all(np.array_equal(v, tensors[k]) for k, v in load_file(str(path)).items())
    assert not list(tmp_path.glob(".*.tmp"))


def test_without_metadata_the_file_is_plain_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    write_checkpoint(path, {"w": np.ones(3)})
    assert b"__metadata__" not in path.read_bytes()
    tensors, meta = read_checkpoint(path)
    assert meta == {} and np.array_equal(tensors["w"], np.ones(3))


def test_a_large_sum_is_written_from_its_own_memory() -> None:
    """The coordinator's float64 partial sum goes to the file without a joined copy."""
    total = np.zeros(1 << 16)
    parts = checkpoint.safetensors_parts({"sum": total, "bias": np.ones(4)})
    assert len(parts) == 4 and np.shares_memory(np.frombuffer(parts[2], np.float64), total)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "metadata not json"])
def test_a_damaged_checkpoint_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "c.safetensors"
    write_checkpoint(path, {"w": np.arange(100.0)}, {"round": 1})
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-9])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        save_file({"w": np.arange(3.0)}, str(path), metadata={"json": "{not json"})
    with pytest.raises(CorruptCheckpoint, match=str(path)):
        read_checkpoint(path)


def test_a_full_disk_keeps_every_previous_file_and_says_so_in_each_roles_terms(small_fs: Path) -> None:
    """A real 4 MiB tmpfs filled to the brim: each role's write raises its own error type, the
    previous file is byte for byte what it was, and no temporary file is left."""
    store, device = Store(small_fs / "coordinator"), DeviceState(small_fs / "device")
    store.commit({"round": 1, "model": store.write_tensors("model-r1.safetensors", {"w": np.ones(8)})})
    manifest = tiny_manifest()
    device.save(_saved(manifest, 1))
    fleet_path = small_fs / STATE
    save_state(FleetState(1, {"w": torch.ones(8)}, [{"h": torch.zeros(2)}], seed=0), fleet_path)
    before = {p: p.read_bytes() for p in small_fs.rglob("*") if p.is_file()}
    big = {"w": np.ones(1 << 17)}  # 1 MiB: more than is left

    fill(small_fs)
    with pytest.raises(CheckpointError, match="No space left"):
        store.write_tensors("model-r2.safetensors", big)
    with pytest.raises(CheckpointError, match="No space left"):
        store.commit({"round": 2, "model": "model-r1.safetensors", "pad": "x" * (1 << 16)})
    with pytest.raises(StateError, match=r"\(disk full\).*previous state is kept"):
        device.save(Saved(2, manifest.base_digest, 12, {"classifier.weight": np.ones((3, 2), np.float32)}, big, {}))
    with pytest.raises(OSError) as raised:
        save_state(FleetState(2, {"w": torch.ones(1 << 17)}, [{"h": torch.zeros(2)}], seed=0), fleet_path)
    assert raised.value.errno == errno.ENOSPC
    assert {p: p.read_bytes() for p in before} == before
    assert not [p for p in small_fs.rglob(".*.tmp")]
    assert store.load_state()["round"] == 1 and device.load(manifest).round == 1 and load_state(fleet_path).round == 1


def _saved(manifest, round_: int) -> Saved:
    local = {n: np.full(manifest.spec(n).shape, 0.5, np.float32) for n in manifest.names(shared=False)}
    update = {n: np.full(manifest.spec(n).shape, -1.5, np.float32) for n in manifest.names(shared=True)}
    return Saved(round_, manifest.base_digest, 12, local, update, {"accuracy": 0.75, "loss": 1.5})


def test_an_agent_state_in_the_older_format_is_read_once_and_rewritten(tmp_path: Path, caplog) -> None:
    """device.safetensors as agents in the field wrote it: each field its own safetensors metadata
    string (written here with the reference library, as that agent did)."""
    manifest, want = tiny_manifest(), _saved(tiny_manifest(), 4)
    old = {"round": "4", "base_digest": manifest.base_digest, "n_samples": "12",
           "metrics": json.dumps(want.metrics), "local": json.dumps(sorted(want.local))}
    save_file({**want.update, **want.local}, str(tmp_path / TENSORS_FILE), metadata=old)

    with caplog.at_level(logging.WARNING, logger="fedper.edge"):
        got = DeviceState(tmp_path).load(manifest)
    assert (got.round, got.base_digest, got.n_samples, got.metrics) == (4, want.base_digest, 12, want.metrics)
    assert {n: v.tolist() for n, v in got.local.items()} == {n: v.tolist() for n, v in want.local.items()}
    assert {n: v.tolist() for n, v in got.update.items()} == {n: v.tolist() for n, v in want.update.items()}
    assert [r.getMessage() for r in caplog.records if r.name == "fedper.edge"] == [
        f"{tmp_path / TENSORS_FILE}: rewritten in the checkpoint format (its round 4 kept)"]
    _, meta = read_checkpoint(tmp_path / TENSORS_FILE)
    assert meta == {"round": 4, "base_digest": manifest.base_digest, "n_samples": 12, "metrics": want.metrics,
                    "local": sorted(want.local)}

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedper.edge"):
        assert DeviceState(tmp_path).load(manifest).round == 4
    assert [r for r in caplog.records if r.name == "fedper.edge"] == []


def test_an_agent_state_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / TENSORS_FILE), metadata={"round": "x"})
    with pytest.raises(StateError, match="unreadable"):
        DeviceState(tmp_path).load(tiny_manifest())


def _config(rounds: int) -> RunConfig:
    return RunConfig(DataConfig("digits", clients=3, classes_per_client=3, input_size=16, scale=0.1, seed=2),
                     FleetConfig(width=0.25, kp=2, local_epochs=1, batch_size=16, lr=0.05, seed=2),
                     rounds=rounds, device="cpu")


def test_an_emulator_run_saved_as_state_pt_is_converted_once_on_resume(tmp_path: Path, caplog) -> None:
    """A run directory as the emulator wrote it with torch.save: --resume converts state.pt to the
    same tensors, bit for bit, logs it and removes state.pt; the run then goes on from there."""
    run_experiment(_config(1), tmp_path, show_progress=False)
    saved = load_state(tmp_path / STATE)
    torch.save({"round": saved.round, "seed": saved.seed, "shared": saved.shared, "local": saved.local},
               tmp_path / LEGACY_STATE)
    (tmp_path / STATE).unlink()
    with pytest.raises(ValueError, match="already holds a run"):
        run_experiment(_config(1), tmp_path, show_progress=False)

    with caplog.at_level(logging.WARNING, logger="fedper.emulate"):
        summary = run_experiment(_config(1), tmp_path, resume=True, show_progress=False)
    converted = [r.getMessage() for r in caplog.records if r.name == "fedper.emulate"]
    assert converted == [f"{tmp_path / LEGACY_STATE}: converted to {STATE} (round 1)"]
    assert not (tmp_path / LEGACY_STATE).exists() and summary["rounds"] == 1
    got = load_state(tmp_path / STATE)
    assert (got.round, got.seed, list(got.shared)) == (saved.round, saved.seed, list(saved.shared))
    assert all(torch.equal(got.shared[n], saved.shared[n]) for n in saved.shared)
    assert len(got.local) == len(saved.local) == 3
    assert all(torch.equal(x[n], y[n]) for x, y in zip(got.local, saved.local, strict=True) for n in y)


def test_metrics_of_rounds_the_state_does_not_close_are_trimmed(tmp_path: Path) -> None:
    """A round's metrics line is appended before the commit that closes it (a kill in between lost it once:
    test_async_live found version 10 missing); the restart keeps only the closed rounds' lines."""
    store = Store(tmp_path)
    for round_ in (1, 2, 3):
        store.append_metrics({"round": round_, "participants": 1})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "parti')  # torn by a kill mid-write
    store.trim_metrics(2)
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
