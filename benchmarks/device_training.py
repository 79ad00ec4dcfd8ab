"""On-device training speed: onnxruntime-training (the agent's OrtBackend) vs PyTorch eager.

Same CPU, same model, same batches (edge.backend.batch_order over the same random 32x32 data),
plain SGD. Every number is a ratio measured in this run: ORT samples/s / PyTorch samples/s, the
median over `repeats` alternating measurements. Then the experiments: ORT's own profile (time per
op type, depthwise and dense convolutions apart), thread settings, graph optimization level,
PyTorch channels-last, and how much of a step the input pipeline takes. Last, the agent's start: CPU seconds
and peak memory of a fresh process that chooses the ORT backend and opens the artifacts, as shipped
(edge/ort_import.py keeps torch out) and with torch imported first (what onnxruntime-training's own imports did).

    python benchmarks/device_training.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import main, median, table, timed, write_json

from fedper.edge.backend import batch_order, run_epochs
from fedper.edge.ort_backend import OrtBackend
from fedper.export.exporter import export_artifacts
from fedper.manifest import Manifest

INPUT_SIZE = 32
NUM_CLASSES = 10
LR = 0.01
MODELS = (("mobilenet_v1", 1.0), ("mobilenet_v1", 0.5), ("resnet34", 1.0))
BATCHES = (32, 128)
SAMPLES_PER_MEASUREMENT = 384  # 12 steps at B=32, 3 at B=128: a few seconds per measurement here


def export(cache: Path, arch: str, width: float) -> tuple[Path, Manifest]:
    """FedAvg-style artifacts (one set training everything): what a device runs in a round."""
    out = cache / f"{arch}-w{width}"
    manifest = export_artifacts(out, model=arch, kp=0, num_classes=NUM_CLASSES, input_size=INPUT_SIZE,
                                width=width, algorithm="fedavg", force=True)
    return out, manifest


def make_data(batch: int, samples: int = SAMPLES_PER_MEASUREMENT) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = max(samples, batch)
    x = rng.standard_normal((n, 3, INPUT_SIZE, INPUT_SIZE), dtype=np.float32)
    return x, rng.integers(0, NUM_CLASSES, n).astype(np.int64)


# ---------------------------------------------------------------- the two runtimes


def ort_agent_rate(backend: OrtBackend, x: np.ndarray, y: np.ndarray, batch: int) -> float:
    """samples/s of the agent's own training loop (one warm-up step first)."""
    backend.train("all", x[:batch], y[:batch], epochs=1, batch_size=batch, lr=LR, seed=0)
    return backend.train("all", x, y, epochs=1, batch_size=batch, lr=LR, seed=0).samples_per_second


def ort_session(directory: Path, options: Any = None) -> Callable[[np.ndarray], float]:
    """A bare onnxruntime-training Module + Optimizer with SessionOptions: a step function."""
    from onnxruntime.training import api

    d = directory / "train" / "all"
    state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
    module = api.Module(str(d / "training_model.onnx"), state, str(d / "eval_model.onnx"), device="cpu",
                        session_options=options)
    optimizer = api.Optimizer(str(d / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()

    def step(xb: np.ndarray, yb: np.ndarray) -> float:
        loss, _ = module(xb, yb)
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    return step


def torch_step(arch: str, width: float, *, channels_last: bool = False) -> Callable[[np.ndarray, np.ndarray], float]:
    import torch

    from fedper.models import build_model

    torch.manual_seed(0)
    net = build_model(arch, NUM_CLASSES, width, INPUT_SIZE)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(xb: np.ndarray, yb: np.ndarray) -> float:
        inputs = torch.from_numpy(xb)
        if channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        loss = loss_fn(net(inputs), torch.from_numpy(yb))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def rate(step: Callable[[np.ndarray, np.ndarray], float], x: np.ndarray, y: np.ndarray, batch: int) -> float:
    """samples/s over the same batches the agent cuts, after one warm-up step."""
    step(x[:batch], y[:batch])
    return run_epochs(lambda idx: step(x[idx], y[idx]), len(y), epochs=1, batch_size=batch, seed=0).samples_per_second


def torch_rate(threads: int | None, step: Callable[[np.ndarray, np.ndarray], float], x: np.ndarray, y: np.ndarray,
               batch: int) -> float:
    """`rate` with torch.set_num_threads(threads) for the measurement (None: the default)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return rate(step, x, y, batch)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- headline: ORT / PyTorch


def compare(cache: Path, models, batches, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for arch, width in models:
        directory, manifest = export(cache, arch, width)
        backend = OrtBackend(directory, manifest)
        for batch in batches:
            x, y = make_data(batch)
            ort_rates, torch_rates = [], []
            step = torch_step(arch, width)
            for _ in range(repeats):  # alternate so both see the same background load
                ort_rates.append(ort_agent_rate(backend, x, y, batch))
                torch_rates.append(rate(step, x, y, batch))
            ratios = [o / t for o, t in zip(ort_rates, torch_rates, strict=True)]
            rows.append({"model": arch, "width": width, "batch": batch, "ort_samples_s": median(ort_rates),
                         "torch_samples_s": median(torch_rates), "ratio": median(ratios),
                         "ratios": ratios})
    return rows


# ---------------------------------------------------------------- experiments


def profile(directory: Path, batch: int, steps: int = 2) -> dict[str, float]:
    """Share of ORT kernel time per op type (Conv/ConvGrad split into depthwise and dense)."""
    import onnx
    import onnxruntime as ort

    train_file = directory / "train" / "all" / "training_model.onnx"
    groups = {node.name: next((a.i for a in node.attribute if a.name == "group"), 1)
              for node in onnx.load(str(train_file)).graph.node if node.op_type in ("Conv", "ConvGrad")}
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = f"{tmp}/ort"
        step = ort_session(directory, options)
        x, y = make_data(batch, batch * steps)
        for i in range(steps):
            step(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch])
        del step  # the profile file is written when the session goes away
        events = json.loads(next(Path(tmp).glob("ort*.json")).read_text())
    per_op: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]
            if op in ("Conv", "ConvGrad"):
                op += " depthwise" if groups.get(e["name"].removesuffix("_kernel_time"), 1) > 1 else " dense"
            per_op[op] += e["dur"]
    total = sum(per_op.values())
    return {op: us / total for op, us in per_op.most_common()}


def experiments(cache: Path, repeats: int) -> list[dict[str, Any]]:
    """Each variant's ORT/PyTorch ratio next to the default's, measured back to back."""
    import onnxruntime as ort

    def options(**settings: Any) -> Any:
        o = ort.SessionOptions()
        for key, value in settings.items():
            setattr(o, key, value)
        return o

    level = ort.GraphOptimizationLevel
    ort_variants = {
        "default": {},
        "intra_op_num_threads=1": {"intra_op_num_threads": 1},
        "intra_op_num_threads=2": {"intra_op_num_threads": 2},
        "graph optimization off": {"graph_optimization_level": level.ORT_DISABLE_ALL},
        "graph optimization all (NCHWc)": {"graph_optimization_level": level.ORT_ENABLE_ALL},
    }
    rows = []
    batch = 128
    for arch, width in (("mobilenet_v1", 1.0), ("resnet34", 1.0)):
        directory, _ = export(cache, arch, width)
        x, y = make_data(batch)
        torch_default = torch_step(arch, width)
        torch_variants = {
            "default": (None, torch_default),
            "torch threads=1": (1, torch_default),
            "torch channels_last": (None, torch_step(arch, width, channels_last=True)),
        }
        runs: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        sessions = {name: ort_session(directory, options(**s)) for name, s in ort_variants.items()}
        for _ in range(repeats):
            for name, step in sessions.items():
                runs[("ort", name)].append(rate(step, x, y, batch))
            for name, (threads, step) in torch_variants.items():
                runs[("torch", name)].append(torch_rate(threads, step, x, y, batch))
        torch_ref, ort_ref = median(runs[("torch", "default")]), median(runs[("ort", "default")])
        for (runtime, name), rates in runs.items():
            value = median(rates)
            vs = value / torch_ref if runtime == "ort" else ort_ref / value
            rows.append({"model": arch, "width": width, "batch": batch, "runtime": runtime, "variant": name,
                         "samples_s": value, "ort_over_torch": vs})
        rows.append(input_pipeline(arch, width, directory, x, y, batch, median(runs[("ort", "default")])))
    return rows


def input_pipeline(arch: str, width: float, directory: Path, x: np.ndarray, y: np.ndarray, batch: int,
                   ort_rate: float) -> dict[str, Any]:
    """The most overlapping data preparation with compute could save: the gather's share of an epoch."""
    orders = batch_order(len(y), batch, 0, 0)
    gather_s = median([timed(lambda: [(x[i], y[i]) for i in orders]) for _ in range(5)])
    epoch_s = sum(len(i) for i in orders) / ort_rate
    return {"model": arch, "width": width, "batch": batch, "runtime": "ort", "variant": "input gather share",
            "samples_s": ort_rate, "ort_over_torch": float("nan"), "gather_share": gather_s / epoch_s}


# ---------------------------------------------------------------- the agent's start

AGENT_START = """
import json, sys, time
started = time.process_time()
if sys.argv[2] == "torch first":
    import torch
from fedper.edge.agent import peak_rss_mb
from fedper.edge.backend import check_artifacts, choose_backend, open_backend
kind, _ = choose_backend("ort")
open_backend(kind, sys.argv[1], check_artifacts(sys.argv[1]))
print(json.dumps({"cpu_s": time.process_time() - started, "peak_rss_mib": peak_rss_mb(),
                  "torch": "torch" in sys.modules}))
"""


def agent_start(directory: Path, repeats: int) -> list[dict[str, Any]]:
    """Per way of starting: the median CPU seconds to an open ORT backend and the peak RSS (the agent's own
    figure), each start a fresh process, the two ways alternating."""
    runs: dict[str, list[dict[str, Any]]] = {"as shipped": [], "torch first": []}
    for _ in range(repeats):
        for way, seen in runs.items():
            done = subprocess.run([sys.executable, "-c", AGENT_START, str(directory), way], capture_output=True,
                                  text=True, check=True)
            seen.append(json.loads(done.stdout.splitlines()[-1]))
    return [{"start": way, "cpu_s": round(median([r["cpu_s"] for r in seen]), 2),
             "peak_rss_mib": round(median([r["peak_rss_mib"] for r in seen])), "torch_loaded": seen[0]["torch"]}
            for way, seen in runs.items()]


# ---------------------------------------------------------------- entry points


def run(out: Path, quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        if quick:
            rows = compare(cache, (("mobilenet_v1", 0.5),), (32,), repeats=1)
            extra, profiles = [], {}
        else:
            rows = compare(cache, MODELS, BATCHES, repeats=3)
            profiles = {f"{arch} w{width} B=128": profile(export(cache, arch, width)[0], 128)
                        for arch, width in (("mobilenet_v1", 1.0), ("resnet34", 1.0))}
            extra = experiments(cache, repeats=2)
        starts = agent_start(export(cache, "mobilenet_v1", 1.0 if not quick else 0.5)[0], repeats=1 if quick else 3)
    write_json(out, "device_training", {"compare": rows, "profiles": profiles, "experiments": extra,
                                        "agent_start": starts})
    text = table(["model", "width", "B", "ORT samples/s", "PyTorch samples/s", "ORT / PyTorch (median)"],
                 [[r["model"], r["width"], r["batch"], r["ort_samples_s"], r["torch_samples_s"], r["ratio"]]
                  for r in rows])
    for name, shares in profiles.items():
        text += f"\n\nORT kernel time by op, {name}:\n" + table(
            ["op", "share"], [[op, f"{s:.1%}"] for op, s in list(shares.items())[:8]])
    if extra:
        text += "\n\nexperiments (B=128; ratio = ORT variant / PyTorch default, or ORT default / PyTorch variant):\n"
        text += table(["model", "runtime", "variant", "samples/s", "ORT / PyTorch", "input gather share"],
                      [[r["model"], r["runtime"], r["variant"], r["samples_s"], r["ort_over_torch"],
                        f"{r['gather_share']:.2%}" if "gather_share" in r else ""]
                       for r in extra])
    text += "\n\nthe agent's start (a fresh process: ORT backend chosen, artifacts opened):\n"
    text += table(["start", "CPU s", "peak RSS MiB", "torch loaded"],
                  [[r["start"], r["cpu_s"], r["peak_rss_mib"], r["torch_loaded"]] for r in starts])
    return text


if __name__ == "__main__":
    main(run, __doc__, quick="one small model, one batch size, one repeat")
