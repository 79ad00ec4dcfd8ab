"""The Python agent's side of web/test/parity.test.mjs: for each case, a real export and one round of fedper-agent's
own code (edge/agent.py Agent.train_round on the ORT backend) from the export's base, on the digits the page gets.

The export's weights are first trained for a few hundred steps on other digits (PyTorch): at its random
initialization this narrow network is so ill-conditioned that a rounding-level change of the start (1e-7) moves
the next step by 2 % and the second by 90 % in Python onnxruntime itself, so no two runtimes could agree there.
Each case's round is also run from the start moved by 1e-6 (relative, two draws): how far Python's own round
moves under a change the size of the stock wasm BatchNorm kernel's rounding (docs/onnxruntime-training.md), kept as
`self_gap_shared` and `self_gap_local`: the largest |tensors - tensors from a moved start| / |tensors - start| over
the shared and the device-local tensors.

    python web/test/reference.py OUT_DIR CASES_JSON

CASES_JSON: [{"name", "algorithm", "graph", "classes", "count", "seed", "lr", "batch_size", "epochs"}]. Writes
OUT_DIR/<name>/export (the export) and OUT_DIR/<name>/round.safetensors (every tensor after the round, with the
round's metrics in its metadata).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from fedper.algorithms import get_algorithm
from fedper.data import load_digits, to_float_nchw
from fedper.edge.agent import Agent, AgentConfig
from fedper.export.exporter import export_artifacts
from fedper.models import IMAGENET_MEAN, IMAGENET_STD, build_model
from fedper.payload import decode_shared


def pretrained(seed: int = 0) -> dict[str, torch.Tensor]:
    """MobileNet-v1 x0.25 (4 classes, 32 px) after 3 epochs of SGD on 300 digits 0-3 the cases do not use."""
    torch.manual_seed(seed)
    net = build_model("mobilenet_v1", 4, 0.25, 32).train()
    ds = load_digits(32).train
    idx = np.flatnonzero(ds.y < 4)[200:500]
    x = torch.from_numpy(to_float_nchw(ds.x[idx], IMAGENET_MEAN, IMAGENET_STD))
    y = torch.from_numpy(ds.y[idx])
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(3):
        for batch in torch.randperm(len(y)).split(32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
            opt.step()
    return net.state_dict()


def digits_in_page_order(classes: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
    """web/test/helpers.mjs digits(): the first `count` digits of `classes`, ordered as the page orders its images
    (class name, then file name digit-NNNN.png: a stable sort by the label's text)."""
    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[:count]
    order = sorted(range(len(idx)), key=lambda k: str(ds.y[idx[k]]))
    return ds.x[idx[order]], ds.y[idx[order]]


def one_round(work: Path, case: dict, state: str, noise: float = 0.0, draw: int = 0):
    """(start, Saved): Agent.train_round(1) from the export's base, each value moved by `noise` relative."""
    config = AgentConfig(artifacts=work / "export", data=work / "data.npz", broker="mqtt://127.0.0.1:1", fleet="f",
                         client_id="python", state_dir=work / state, local_epochs=case["epochs"],
                         batch_size=case["batch_size"], lr=case["lr"], seed=case["seed"])
    agent = Agent(config, log=lambda line: None)
    rng = np.random.default_rng(draw)
    start = {**agent.backend.read(agent.manifest.names()),  # the head as the export's checkpoint holds it
             **decode_shared(agent.manifest, (work / "export" / "base.safetensors").read_bytes())}
    start = {name: (value * (1 + noise * rng.standard_normal(value.shape))).astype(np.float32)
             for name, value in start.items()}
    agent.backend.load(start)
    return start, agent.train_round(1), agent.manifest


def run(out: Path, case: dict, weights: dict[str, torch.Tensor]) -> None:
    work = out / case["name"]
    export = work / "export"
    export_artifacts(export, model="mobilenet_v1", kp=get_algorithm(case["algorithm"]).default_kp, num_classes=4,
                     input_size=32, width=0.25, algorithm=case["algorithm"], graph=case["graph"],
                     classes=("0", "1", "2", "3"), state_dict=weights)
    x, y = digits_in_page_order(case["classes"], case["count"])
    np.savez(work / "data.npz", x_train=x, y_train=y, classes=np.array(["0", "1", "2", "3"]))
    start, saved, manifest = one_round(work, case, "state")
    moved = [one_round(work, case, f"state-moved-{draw}", 1e-6, draw)[1] for draw in (1, 2)]
    gaps = {}
    for part, names in (("shared", manifest.names(shared=True)), ("local", manifest.names(shared=False))):
        def flat(tensors: dict[str, np.ndarray], names: list[str] = names) -> np.ndarray:
            return np.concatenate([tensors[n].ravel() for n in names] or [np.zeros(0)]).astype(np.float64)

        field = "update" if part == "shared" else "local"
        change = np.linalg.norm(flat(getattr(saved, field)) - flat(start))
        moves = [np.linalg.norm(flat(getattr(m, field)) - flat(getattr(saved, field))) for m in moved]
        gaps[f"self_gap_{part}"] = repr(float(max(moves) / change if change else 0.0))
    tensors = {**saved.update, **saved.local}
    save_file({name: np.ascontiguousarray(v) for name, v in tensors.items()}, work / "round.safetensors",
              metadata={"metrics": json.dumps(saved.metrics), **gaps})


if __name__ == "__main__":
    start = pretrained()
    for case in json.loads(Path(sys.argv[2]).read_text()):
        run(Path(sys.argv[1]), case, start)
