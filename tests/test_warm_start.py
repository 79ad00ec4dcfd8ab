"""Warm start (fedper-export --init, fedper-emulate run --init): torchvision's ResNet-34 file, this project's own
state_dict and an emulator run's weights start a model; every file the test builds that does not fit (another
architecture, truncated, another shape, a pickle that would run code) is one line, and nothing is written."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torchvision
from onnx import numpy_helper
from safetensors.torch import save_file
from typer.testing import CliRunner

from fedper.emulate.cli import app as emulate_app
from fedper.export.cli import app as export_app
from fedper.manifest import Manifest
from fedper.models import build_model, exported_state
from fedper.models.warm_start import CheckpointError, warm_start

TINY = ["--model", "mobilenet_v1", "--width", "0.25", "--kp", "1"]


def scrambled(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every float tensor drawn anew (BatchNorm's ones, zeros and running statistics too), so a tensor mapped
    to the wrong place shows; num_batches_tracked as it was."""
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.rand(v.shape, generator=g) + 0.5 if k.endswith("running_var") else
                0.1 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v for k, v in state.items()}


def torchvision_file(tmp_path: Path) -> tuple[Path, torchvision.models.ResNet]:
    net = torchvision.models.resnet34(weights=None)
    net.load_state_dict(scrambled(net.state_dict(), 1))
    path = tmp_path / "resnet34-imagenet.pth"
    torch.save(net.state_dict(), path)
    return path, net.eval()


def test_torchvision_resnet34_file_maps_onto_the_blocknet(tmp_path):
    path, reference = torchvision_file(tmp_path)
    x = torch.randn(2, 3, 224, 224)
    same = build_model("resnet34", 1000, input_size=224)
    start = warm_start(path, same, "resnet34")
    same.load_state_dict(start.state, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(same.eval()(x), reference(x), rtol=1e-4, atol=1e-4)  # torchvision's forward
    assert start.record["classifier"] == "from the checkpoint" and start.notes == ()
    assert start.record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    torch.manual_seed(5)
    ten = build_model("resnet34", 10, input_size=224)
    seeded = {k: v.clone() for k, v in exported_state(ten).items()}
    start = warm_start(path, ten, "resnet34")
    ten.load_state_dict(start.state, strict=False)
    reference.fc = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(ten.eval().features(x), reference(x), rtol=1e-4, atol=1e-4)
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(start.state[name], seeded[name])
    assert start.notes == ("classifier re-initialized: the checkpoint has 1000 classes, the model 10",)


def test_export_from_a_state_dict_of_the_users_own(tmp_path):
    own = build_model("mobilenet_v1", 5, width=0.25)
    own.load_state_dict(scrambled(own.state_dict(), 2))
    path = tmp_path / "mine.pt"
    torch.save(own.state_dict(), path)
    out = tmp_path / "art"
    result = CliRunner().invoke(export_app, [*TINY, "--num-classes", "3", "--init", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "classifier re-initialized: the checkpoint has 5 classes, the model 3" in result.output
    weights = Manifest.load(out).weights
    assert weights["name"] == "mine.pt" and weights["format"] == "fedper"
    assert weights["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    graph = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out / "inference.onnx")).graph.initializer}
    expected = exported_state(own)
    for name, value in graph.items():
        if not name.startswith("classifier."):
            np.testing.assert_array_equal(value, expected[name].numpy(), err_msg=name)
    assert graph["classifier.weight"].shape == (3, expected["classifier.weight"].shape[1])
    assert CliRunner().invoke(export_app, ["verify", str(out)]).exit_code == 0


def test_an_emulator_run_starts_an_export_and_another_run(tmp_path):
    pretrain = tmp_path / "pretrain"
    common = ["run", "--dataset", "digits", "--width", "0.25", "--clients", "2", "--classes-per-client", "5",
              "--batch-size", "32", "--local-epochs", "1", "--scale", "0.05", "--no-progress"]
    result = CliRunner().invoke(emulate_app, [*common, "--algorithm", "fedavg", "--rounds", "2", "--out",
                                              str(pretrain)])
    assert result.exit_code == 0, result.output
    saved = pretrain / "model.safetensors"
    assert saved.is_file()
    from fedper.emulate.fleet import load_state

    shared = load_state(pretrain / "state.safetensors").shared

    out = tmp_path / "art"
    result = CliRunner().invoke(export_app, [*TINY, "--algorithm", "fedper", "--num-classes", "4", "--init",
                                             str(pretrain), "--out", str(out)])
    assert result.exit_code == 0, result.output
    weights = Manifest.load(out).weights
    assert weights["name"] == "pretrain/model.safetensors" and weights["format"] == "fedper-emulate"
    graph = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out / "inference.onnx")).graph.initializer}
    for name, value in shared.items():
        if not name.startswith("classifier."):  # digits has 10 classes, the export 4
            np.testing.assert_array_equal(graph[name], value.numpy(), err_msg=name)

    warm = tmp_path / "warm"
    result = CliRunner().invoke(emulate_app, [*common, "--algorithm", "fedper", "--kp", "1", "--rounds", "1",
                                              "--init", str(pretrain), "--out", str(warm)])
    assert result.exit_code == 0, result.output
    assert "weights from pretrain/model.safetensors" in result.output
    import json

    assert json.loads((warm / "summary.json").read_text())["weights"]["sha256"] == \
        hashlib.sha256(saved.read_bytes()).hexdigest()


class _RunsCode:
    """Unpickling this would create a file: a checkpoint must never get that far."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    """(a file, what its one line must name) for each way a checkpoint can fail to fit MobileNet-v1 x0.25."""
    files = []
    resnet, _ = torchvision_file(tmp_path)
    files.append((resnet, "is a torchvision ResNet state_dict; the model is mobilenet_v1"))
    other = tmp_path / "resnet-own.safetensors"
    save_file({k: v.contiguous() for k, v in exported_state(build_model("resnet34", 3, width=0.25)).items()}, other)
    files.append((other, "holds 175 tensor(s) the model has not, e.g. blocks.0.bn1.bias"))
    wider = tmp_path / "wider.pt"
    torch.save(build_model("mobilenet_v1", 3, width=0.5).state_dict(), wider)
    files.append((wider, "stem.0.weight is [16, 3, 3, 3] in the file, [8, 3, 3, 3] in the model"))
    full = build_model("mobilenet_v1", 3, width=0.25).state_dict()
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in full.items() if not k.startswith("blocks.12.")}, partial)
    files.append((partial, "lacks 10 of the mobilenet_v1's tensors, e.g. blocks.12.0.weight"))
    for name, source in (("cut.pt", wider), ("cut.safetensors", partial)):
        cut = tmp_path / name
        cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
        files.append((cut, "truncated"))
    nan = tmp_path / "nan.safetensors"
    save_file({**{k: v.float() if v.is_floating_point() else v for k, v in full.items()},
               "stem.0.weight": torch.full_like(full["stem.0.weight"], float("nan"))}, nan)
    files.append((nan, "stem.0.weight holds NaN or Inf"))
    code = tmp_path / "code.pt"
    with open(code, "wb") as f:
        pickle.dump({"stem.0.weight": _RunsCode(tmp_path / "ran")}, f)
    files.append((code, "loads without unpickling code"))
    module = tmp_path / "module.pt"
    torch.save(build_model("mobilenet_v1", 3, width=0.25), module)
    files.append((module, "loads without unpickling code"))
    return files


def test_a_checkpoint_that_does_not_fit_is_one_line_and_nothing_is_written(tmp_path):
    data = tmp_path / "files"
    data.mkdir()
    for path, message in bad_files(data):
        with pytest.raises(CheckpointError, match="^" + str(path)):
            warm_start(path, build_model("mobilenet_v1", 3, width=0.25), "mobilenet_v1")
        work = tmp_path / "work"
        work.mkdir()
        result = CliRunner().invoke(export_app, [*TINY, "--num-classes", "3", "--init", str(path), "--out",
                                                 str(work / "art")])
        assert result.exit_code == 1, (path, result.output)
        assert message in result.output, (path, result.output)
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert list(work.iterdir()) == [], path
        work.rmdir()
    assert not (data / "ran").exists()

    run = tmp_path / "run"
    result = CliRunner().invoke(emulate_app, ["run", "--dataset", "digits", "--width", "0.25", "--clients", "2",
                                              "--scale", "0.05", "--no-progress", "--init", str(data / "wider.pt"),
                                              "--out", str(run)])
    assert result.exit_code == 2 and "in the model (another width multiplier?)" in result.output, result.output
    assert not run.exists()
