"""The personal model: after a round the agent's state directory holds personal.onnx (the base it served + its
own head) that plain onnxruntime.InferenceSession runs, and personal.json beside it; its logits equal the
export's eval model's and torch's on the same tensors and images; `fedper-agent predict` prints its top classes;
every accuracy line carries the device's chance line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from PIL import Image
from test_edge_agent import device_data, make_device, models, sent_update  # noqa: F401  (fixtures)
from typer.testing import CliRunner

from fedper.data import to_float_nchw
from fedper.edge.backend import open_backend
from fedper.edge.cli import app
from fedper.edge.personal import PERSONAL_INFO, PERSONAL_MODEL
from fedper.edge.torch_backend import TorchBackend


def test_a_round_leaves_a_personal_model_that_plain_onnxruntime_runs(make_device, models, tmp_path) -> None:  # noqa: F811
    device = make_device()
    agent = device.agent
    sent_update(device.open_round(1, models(1)))
    head = agent.saved.local
    # round 2's base: drawn at random, running variances positive, so that the logits vary with the image (the
    # tiny export's own weights give the same logits for every image)
    rng = np.random.default_rng(0)
    trained = {n: (rng.uniform(0.5, 1.5, v.shape) if n.endswith("running_var") else
                   rng.normal(0, 0.3, v.shape) + (n.endswith(".weight") and v.ndim == 1)).astype(np.float32)
               for n, v in models(2).items()}
    sent_update(device.open_round(2, trained))
    state = tmp_path / "state"
    info = json.loads((state / PERSONAL_INFO).read_text())
    assert info["round"] == 2 and info["classes"] == ["0", "1", "2", "3"] and info["input_shape"] == [3, 32, 32]
    assert info["accuracy"] == agent.saved.metrics["accuracy"]

    # the device's test images as files, and as the model's input by the training loader's own conversion
    images = np.load(tmp_path / "digits.npz")["x_train"][:6]
    files = []
    for i, image in enumerate(images):
        files.append(tmp_path / f"photo-{i}.png")
        Image.fromarray(image).save(files[-1])
    x = to_float_nchw(images, agent.manifest.model.mean, agent.manifest.model.std)

    session = onnxruntime.InferenceSession(str(state / PERSONAL_MODEL), providers=["CPUExecutionProvider"])
    (personal,) = session.run(None, {"input": x})

    served = {**trained, **head}
    reference = open_backend("ort", agent.config.artifacts, agent.manifest)  # the export's eval graph
    reference.load(served)
    evaluation = reference._sets[reference._current].module
    evaluation.eval()
    _, eval_logits = evaluation(x, np.zeros(len(x), np.int64))
    np.testing.assert_allclose(personal, eval_logits, rtol=1e-5, atol=1e-5)

    net = TorchBackend(agent.config.artifacts, agent.manifest)  # and, independently, PyTorch
    net.load(served)
    with torch.no_grad():
        torch_logits = net.model.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(personal, torch_logits, rtol=1e-5, atol=1e-5)
    assert np.ptp(personal, axis=0).min() > 1e-3  # logits that vary with the image
    print(f"personal model vs eval model: max |diff| {np.abs(personal - eval_logits).max():.2e}; "
          f"vs torch {np.abs(personal - torch_logits).max():.2e}")

    result = CliRunner().invoke(app, ["predict", *map(str, files), "--state-dir", str(state), "--top", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("personal model of round 2: accuracy ") and "guessing the most frequent" in lines[0]
    wide = torch_logits.astype(np.float64)
    probabilities = np.exp(wide - wide.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    for line, path, p in zip(lines[1:], files, probabilities, strict=True):
        best = int(np.argmax(p))
        assert line.startswith(f"{path}: {best} {100 * p[best]:.1f} %, "), line

    missing = CliRunner().invoke(app, ["predict", str(files[0]), "--state-dir", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "holds no personal model yet" in missing.output


def test_every_accuracy_line_stands_beside_its_chance_line(make_device, models, tmp_path: Path) -> None:  # noqa: F811
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    device.open_round(2, models(2), state="finished", blob_id="final")
    test_labels = device.agent.data.y_test
    counts = np.bincount(test_labels)
    words = (f"{np.count_nonzero(counts)} classes: guessing the most frequent gives "
             f"{round(100 * counts.max() / len(test_labels))} %")
    accuracy_lines = [line for line in device.logs if "accuracy" in line]
    assert len(accuracy_lines) == 2 and all(words in line for line in accuracy_lines), device.logs
    final = json.loads((tmp_path / "state" / PERSONAL_INFO).read_text())
    assert final["final"] and final["chance"] == words
