"""The emulator on a GPU: the reduced Fig. 2 grid (the smoke preset) with the vmap and the sequential engine,
and timed rounds of the paper-scale grid (width 1.0, all of CIFAR-10, 4 local epochs, B = 128) for both models
and both engines, with the peak GPU memory of each, and the full grid's time extrapolated from them.

    python benchmarks/emulator_gpu.py --data cifar10.npz --out runs/bench [--budget 270]

--data is CIFAR-10 as an .npz of decoded arrays (x_train, y_train, x_test, y_test, classes). Steps run in
order of importance and none starts once --budget seconds have passed, so a lease of fixed length ends with
a table of what ran; a step that fails is recorded with its error and the next one runs.

Each paper-scale row also reports samples/s, the training FLOPs per sample (one forward and backward
pass, counted by torch.utils.flop_counter.FlopCounterMode on the model, not a formula), the TFLOP/s that
makes and its share of the GPU's dense peak (PEAK_TFLOPS; an unknown GPU or a CPU prints TFLOP/s alone).
The "stacked" row trains Fig. 2's six curves of one model as one stack (emulate/stacked.py).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from common import machine, table

from fedper.emulate.data import DataConfig
from fedper.emulate.experiment import METRICS, SUMMARY, RunConfig, run_experiment, run_stacked
from fedper.emulate.figures import PRESETS, make_figure
from fedper.emulate.fleet import FleetConfig
from fedper.emulate.progress import Board
from fedper.models import build_model

SMOKE = PRESETS["smoke"]
ENGINES = ("vmap", "sequential")
PAPER_ROUNDS = 100
GRID_RUNS = 6  # Fig. 2 per model: FedAvg and FedPer at k = 4, 8, 10
# Dense (no sparsity) peak TFLOP/s by device name, float32 / bfloat16, from the vendors' data sheets (H100 and
# H200 SXM: TF32 tensor cores for float32; A100 SXM; L4; RTX 4090). The first name that the device's holds wins.
PEAK_TFLOPS = {"H200": (494.7, 989.4), "H100": (494.7, 989.4), "A100": (156.0, 312.0), "L4": (60.0, 121.0),
               "RTX 4090": (82.6, 165.2)}


def peak_tflops(device_name: str, precision: str = "float32") -> float | None:
    """The device's dense peak for `precision` from PEAK_TFLOPS, None when unknown (any CPU among them)."""
    for name, (fp32, bf16) in PEAK_TFLOPS.items():
        if name in device_name:
            return bf16 if precision == "bfloat16" else fp32
    return None


def training_flops_per_sample(model: str, width: float, input_size: int, classes: int = 10, batch: int = 8) -> float:
    """FLOPs of one training step's forward and backward pass per sample, counted by FlopCounterMode on a batch."""
    from torch.utils.flop_counter import FlopCounterMode

    net = build_model(model, classes, width, input_size)
    x, y = torch.randn(batch, 3, input_size, input_size), torch.randint(0, classes, (batch,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / batch


def rates(samples: float, seconds: float, flops: float, device_name: str) -> dict[str, Any]:
    """samples/s, TFLOP/s and the share of the device's float32 peak (None when unknown)."""
    tflops = samples * flops / seconds / 1e12
    peak = peak_tflops(device_name)
    return {"samples_s": samples / seconds, "gflop_sample": flops / 1e9, "tflop_s": tflops,
            "peak_share": None if peak is None else tflops / peak}


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reduced_grid(out: Path, data: str | None, engine: str, device: str, quick: bool) -> list[dict[str, Any]]:
    """Fig. 2 under the smoke preset (MobileNet-v1 x0.25, 5 % of CIFAR-10, 20 rounds): one row per curve."""
    fleet = {k: SMOKE[k] for k in ("width", "local_epochs", "batch_size", "lr", "momentum")} | {"engine": engine}
    kwargs: dict[str, Any] = {"scale": SMOKE["scale"], "data": data, "dataset": "npz", "rounds": SMOKE["rounds"]}
    if quick:  # digits, a few rounds: only proves the path
        fleet |= {"width": 0.25}
        kwargs = {"scale": 1.0, "data": None, "dataset": "digits", "rounds": 2}
    _peak_reset()
    start = time.perf_counter()
    png = make_figure("fig2", out=out / f"fig2-{engine}", device=device, fleet_overrides=fleet,
                      data_overrides={"clients": 10, "input_size": 16} if quick else {"clients": 10},
                      models=("mobilenet_v1",), show_progress=False, **kwargs)
    wall, peak = time.perf_counter() - start, _peak_gib()
    rows = []
    for run in sorted((out / f"fig2-{engine}" / "fig2").iterdir()):
        summary = json.loads((run / SUMMARY).read_text())
        rows.append({"step": "reduced", "engine": summary["engine"], "run": run.name, "rounds": summary["rounds"],
                     "run_s": summary["wall_s"], "round_s": summary["mean_round_s"],
                     "final_mean_accuracy": summary["final_mean_accuracy"], "peak_gib": peak})
    rows.append({"step": "reduced", "engine": engine, "run": f"grid ({png.name})", "rounds": None,
                 "run_s": wall, "round_s": None, "final_mean_accuracy": None, "peak_gib": peak})
    return rows


def paper_rounds(out: Path, data: str | None, model: str, engine: str, device: str, quick: bool) -> dict[str, Any]:
    """Two rounds of Fig. 2's FedPer k = 4 curve at the paper's scale; the second (warm) round is the one timed."""
    dcfg = DataConfig(dataset="npz", data=data, clients=10, classes_per_client=4)
    fcfg = FleetConfig(model=model, algorithm="fedper", kp=2, engine=engine)  # paper defaults: x1.0, E=4, B=128
    if quick:
        dcfg = DataConfig(dataset="digits", clients=4, classes_per_client=4, input_size=16)
        fcfg = FleetConfig(model=model, width=0.25, algorithm="fedper", kp=2, engine=engine, local_epochs=1)
    run_dir = out / f"paper-{model}-{engine}"
    _peak_reset()
    summary = run_experiment(RunConfig(dcfg, fcfg, rounds=2, device=device), run_dir, show_progress=False)
    rounds = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    warm = rounds[-1]["wall_s"]
    samples = sum(summary["n_train"]) * fcfg.local_epochs
    flops = training_flops_per_sample(model, fcfg.width, dcfg.input_size or 32)
    return {"step": "paper", "engine": summary["engine"], "run": f"{model} fedper k=4", "rounds": len(rounds),
            "run_s": summary["wall_s"], "round_s": warm, "final_mean_accuracy": summary["final_mean_accuracy"],
            "peak_gib": _peak_gib(), "grid_hours": warm * PAPER_ROUNDS * GRID_RUNS / 3600,
            **rates(samples, warm, flops, _device_name())}


def stacked_rounds(out: Path, data: str | None, model: str, device: str, quick: bool) -> dict[str, Any]:
    """Two rounds of Fig. 2's six curves of `model` at the paper's scale, stacked; the second round is timed (its
    runs' wall_s summed: each run's share of the stacked step plus its own aggregation and evaluation)."""
    runs = []
    for k in (4, 8, 10):
        for algorithm, kp in (("fedavg", 0), ("fedper", 2)):
            dcfg = DataConfig(dataset="npz", data=data, clients=10, classes_per_client=k)
            fcfg = FleetConfig(model=model, algorithm=algorithm, kp=kp, engine="vmap")
            if quick:
                dcfg = DataConfig(dataset="digits", clients=4, classes_per_client=min(k, 4), input_size=16)
                fcfg = FleetConfig(model=model, width=0.25, algorithm=algorithm, kp=kp, engine="vmap", local_epochs=1)
            runs.append((RunConfig(dcfg, fcfg, rounds=2, device=device), out / f"stacked-{model}-{algorithm}-k{k}",
                         False, f"{algorithm} k={k}"))
    _peak_reset()
    with Board(False) as board:
        summaries = run_stacked(runs, report=board.report)
    warm = sum(json.loads((d / METRICS).read_text().splitlines()[-1])["wall_s"] for _, d, _, _ in runs)
    samples = sum(sum(s["n_train"]) for s in summaries) * runs[0][0].fleet.local_epochs
    flops = training_flops_per_sample(model, runs[0][0].fleet.width, runs[0][0].data.input_size or 32)
    return {"step": "paper", "engine": "stacked", "run": f"{model} fig2 x{len(runs)}", "rounds": 2,
            "run_s": sum(s["wall_s"] for s in summaries), "round_s": warm,
            "final_mean_accuracy": None, "peak_gib": _peak_gib(), "grid_hours": warm * PAPER_ROUNDS / 3600,
            **rates(samples, warm, flops, _device_name())}


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run(out: Path, data: str | None, budget: float, quick: bool, only: str = "") -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    steps = [(f"reduced grid, {e}", lambda e=e: reduced_grid(out, data, e, device, quick)) for e in ENGINES[:1]]
    steps += [(f"paper {m}, {e}", lambda m=m, e=e: [paper_rounds(out, data, m, e, device, quick)])
              for m in ("mobilenet_v1", "resnet34") for e in ENGINES]
    steps += [(f"paper {m}, stacked", lambda m=m: [stacked_rounds(out, data, m, device, quick)])
              for m in ("mobilenet_v1", "resnet34")]
    steps += [(f"reduced grid, {e}", lambda e=e: reduced_grid(out, data, e, device, quick)) for e in ENGINES[1:]]
    rows: list[dict[str, Any]] = []
    info = machine() | {"device": _device_name(),
                        "torch": torch.__version__, "budget_s": budget}
    for name, step in steps:
        if only not in name:
            continue
        elapsed = time.perf_counter() - started
        if elapsed > budget:
            rows.append({"step": name, "error": f"skipped: {elapsed:.0f} s of the {budget:.0f} s budget spent"})
            continue
        print(f"[{elapsed:6.1f} s] {name}", flush=True)
        try:
            rows += step()
        except Exception as e:  # a failed step is a result; the next one still runs
            rows.append({"step": name, "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
        (out / "emulator_gpu.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    header = ("step", "engine", "run", "rounds", "run_s", "round_s", "samples_s", "gflop_sample", "tflop_s",
              "peak_share", "final_mean_accuracy", "peak_gib", "grid_hours")
    ok = [r for r in rows if "error" not in r]
    lines = [f"{info['device']}, torch {info['torch']}, {time.perf_counter() - started:.0f} s",
             table(header, [[r.get(h) for h in header] for r in ok])]
    lines += [f"- {r['step']}: {r['error']}" for r in rows if "error" in r]
    (out / "emulator_gpu.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="CIFAR-10 as an .npz of decoded arrays (not needed with --quick)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/emulator_gpu"))
    parser.add_argument("--budget", type=float, default=270.0, help="no step starts after this many seconds")
    parser.add_argument("--quick", action="store_true", help="digits, tiny model, 2 rounds: proves the path")
    parser.add_argument("--only", default="", help="run only the steps whose name holds this text")
    args = parser.parse_args()
    if args.data is None and not args.quick:
        parser.error("--data is required (CIFAR-10 as an .npz), or --quick")
    print(run(args.out, args.data, args.budget, args.quick, args.only))


if __name__ == "__main__":
    main()
