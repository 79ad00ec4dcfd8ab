"""The emulator at the paper's scale as a share of the hardware: Fig. 2's setting (32x32 CIFAR-10, 10 clients,
B = 128, 4 local epochs, width 1.0) for MobileNet-v1 and ResNet-34, float32 and bf16, one run (the vmap engine)
and Fig. 2's six runs of a model stacked (emulate/stacked.py), then the sequential engine, then the reduced Fig. 2
grid (the smoke preset) in float32 and bf16 for the accuracy.

    python benchmarks/emulator_gpu.py --data cifar10.npz --out runs/bench [--budget 540]
    python benchmarks/emulator_gpu.py --quick --out runs/bench   # the same code on a CPU, tiny, ~2 minutes

--data is CIFAR-10 as an .npz of decoded arrays (x_train, y_train, x_test, y_test, classes). The whole command
keeps within --budget seconds by measuring fewer rounds: each step gets an equal share of the budget left, runs
one warm-up round (cuDNN's autotuning, the allocator's first growth) and then timed rounds while the next one still
fits its share (--quick: one); a step whose warm-up alone spends its share is reported from that round
(timed_rounds 0). A step that fails is recorded with its error and the next one runs; none starts once the
budget is spent.

Each row reports the seconds the warm-up round took beyond a timed one (warmup_extra_s: cuDNN's autotuning, the
allocator's growth; a captured step's compilation, once there is one), samples/s, the training FLOPs per sample
(one forward and backward pass, counted by torch.utils.flop_counter.FlopCounterMode on the model, not a formula),
the TFLOP/s that makes and its share of the GPU's dense peak in that precision (PEAK_TFLOPS; an unknown GPU or a
CPU prints TFLOP/s alone), the peak
memory (CUDA: torch's peak allocation during the step; CPU: the process's peak resident memory so far), and
Fig. 2's time extrapolated from the timed rounds: 100 rounds of the model's six runs (one run's round six times
over, or the stacked round, which holds all six), and per engine and precision the grid of both models.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from common import machine, table

from fedper.emulate.data import DataConfig, FleetData, load_fleet_data
from fedper.emulate.experiment import SUMMARY
from fedper.emulate.figures import PRESETS, make_figure
from fedper.emulate.fleet import Fleet, FleetConfig
from fedper.emulate.stacked import stacked_round
from fedper.models import build_model

SMOKE = PRESETS["smoke"]
MODELS = ("mobilenet_v1", "resnet34")
PRECISIONS = ("float32", "bf16")
PAPER_ROUNDS = 100
BUDGET_S, QUICK_BUDGET_S = 540.0, 90.0  # a 9-minute GPU lease; --quick: about 2 minutes with its fixed costs
GRID = [(algorithm, kp, k) for k in (4, 8, 10) for algorithm, kp in (("fedavg", 0), ("fedper", 2))]  # one model's
# Dense (no sparsity) peak TFLOP/s by device name, float32 / bfloat16, from the vendors' data sheets (H100 and
# H200 SXM: TF32 tensor cores for float32; A100 SXM; L4; RTX 4090). The first name that the device's holds wins.
PEAK_TFLOPS = {"H200": (494.7, 989.4), "H100": (494.7, 989.4), "A100": (156.0, 312.0), "L4": (60.0, 121.0),
               "RTX 4090": (82.6, 165.2)}
HEADER = ("step", "engine", "precision", "model", "runs", "timed_rounds", "round_s", "warmup_extra_s",
          "samples_s", "gflop_sample", "tflop_s", "peak_share", "peak_gib", "grid_min", "final_mean_accuracy")


def peak_tflops(device_name: str, precision: str = "float32") -> float | None:
    """The device's dense peak for `precision` from PEAK_TFLOPS, None when unknown (any CPU among them)."""
    for name, (fp32, bf16) in PEAK_TFLOPS.items():
        if name in device_name:
            return bf16 if precision == "bf16" else fp32
    return None


def training_flops_per_sample(model: str, width: float, input_size: int, classes: int = 10, batch: int = 8) -> float:
    """FLOPs of one training step's forward and backward pass per sample, counted by FlopCounterMode on a batch."""
    from torch.utils.flop_counter import FlopCounterMode

    net = build_model(model, classes, width, input_size)
    x, y = torch.randn(batch, 3, input_size, input_size), torch.randint(0, classes, (batch,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / batch


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def settings(data: str | None, quick: bool) -> tuple[DataConfig, dict[str, Any]]:
    """Fig. 2's data (k set per run) and training settings: the paper's, or with --quick tiny ones on digits."""
    if quick:
        return (DataConfig(dataset="digits", clients=2, input_size=16, scale=0.1),
                {"width": 0.125, "local_epochs": 1, "batch_size": 32})
    return DataConfig(dataset="npz", data=data, clients=10), {}  # FleetConfig's defaults: x1.0, E=4, B=128, lr 0.01


def timed_rounds(round_once: Callable[[], None], share: float, most: int | None = None) -> tuple[float, int, float]:
    """One warm-up round, then timed rounds (`most` at most) while another fits in `share` seconds from the start;
    returns the mean seconds of a timed round (the warm-up's when none fitted), how many were timed, and the
    warm-up round's seconds."""
    start = time.perf_counter()
    round_once()
    _sync()
    warm_up = time.perf_counter() - start
    timed: list[float] = []
    while (most is None or len(timed) < most) and (
            time.perf_counter() - start + (timed[-1] if timed else warm_up) <= share):
        begun = time.perf_counter()
        round_once()
        _sync()
        timed.append(time.perf_counter() - begun)
    return (sum(timed) / len(timed) if timed else warm_up), len(timed), warm_up


def measure(model: str, precision: str, engine: str, data: str | None, device: str, quick: bool,
            share: float, loaded: dict[int, FleetData]) -> dict[str, Any]:
    """Rounds of Fig. 2's runs of `model`: the FedPer k = 4 run alone (engine vmap or sequential), or all six stacked
    (engine "stacked"), in `precision`, within `share` seconds."""
    base, train = settings(data, quick)
    chosen = GRID if engine == "stacked" else [("fedper", 2, 4)]
    fleets = []
    for algorithm, kp, k in chosen:
        if k not in loaded:  # the images depend on the source alone, not on k: one resident copy for every k
            fresh = load_fleet_data(replace(base, classes_per_client=k), device)
            first = next(iter(loaded.values()), fresh)
            loaded[k] = replace(fresh, x=first.x, y=first.y)
        config = FleetConfig(model=model, algorithm=algorithm, kp=kp, precision=precision, seed=0,
                             engine="vmap" if engine == "stacked" else engine, **train)
        fleets.append(Fleet(config, loaded[k]))
    states = [fleet.init() for fleet in fleets]

    def round_once() -> None:
        if engine == "stacked":
            states[:] = [state for state, _ in stacked_round(fleets, states)]
        else:
            states[0] = fleets[0].run_round(states[0])[0]

    _peak_reset()
    round_s, timed, warm_up = timed_rounds(round_once, share, 1 if quick else None)  # --quick proves the path
    cfg = fleets[0].config
    samples = sum(sum(fleet.data.n_train) for fleet in fleets) * cfg.local_epochs
    flops = training_flops_per_sample(model, cfg.width, fleets[0].data.input_size)
    tflops = samples * flops / round_s / 1e12
    peak = peak_tflops(_device_name(), precision)
    return {"step": "paper", "engine": engine, "precision": precision, "model": model,
            "runs": len(fleets), "timed_rounds": timed, "round_s": round_s,
            "warmup_extra_s": warm_up - round_s if timed else None,  # cuDNN's autotuning, allocator growth
            "samples_s": samples / round_s, "gflop_sample": flops / 1e9,
            "tflop_s": tflops, "peak_share": None if peak is None else tflops / peak, "peak_gib": _peak_gib(),
            "grid_min": round_s * PAPER_ROUNDS * len(GRID) / len(fleets) / 60}


def reduced_grid(out: Path, data: str | None, precision: str, device: str, quick: bool) -> list[dict[str, Any]]:
    """Fig. 2 under the smoke preset (MobileNet-v1 x0.25, 5 % of CIFAR-10, 20 rounds), stacked: one row per curve,
    for the accuracy at this precision (--quick: digits, one round)."""
    fleet = {k: SMOKE[k] for k in ("width", "local_epochs", "batch_size", "lr", "momentum")} | {"precision": precision}
    kwargs: dict[str, Any] = {"scale": SMOKE["scale"], "data": data, "dataset": "npz", "rounds": SMOKE["rounds"]}
    if quick:
        fleet |= {"width": 0.125, "batch_size": 32}
        kwargs = {"scale": 0.1, "data": None, "dataset": "digits", "rounds": 1}
    _peak_reset()
    folder = out / f"fig2-{precision}"
    make_figure("fig2", out=folder, device=device, fleet_overrides=fleet, models=("mobilenet_v1",),
                data_overrides={"clients": 2, "input_size": 16} if quick else {"clients": 10},
                show_progress=False, stack=True, **kwargs)
    rows = []
    for run in sorted((folder / "fig2").iterdir()):
        summary = json.loads((run / SUMMARY).read_text())
        rows.append({"step": f"reduced {run.name}", "engine": "stacked", "precision": precision,
                     "model": "mobilenet_v1", "runs": 1, "timed_rounds": summary["rounds"],
                     "round_s": summary["mean_round_s"], "peak_gib": _peak_gib(),
                     "final_mean_accuracy": summary["final_mean_accuracy"]})
    return rows


def grid_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine and precision measured for both models: Fig. 2's whole grid (12 runs x 100 rounds), extrapolated."""
    totals = []
    for engine in ("vmap", "stacked", "sequential"):
        for precision in PRECISIONS:
            parts = [r for r in rows if r["step"] == "paper" and (r["engine"], r["precision"]) == (engine, precision)]
            if {r["model"] for r in parts} == set(MODELS):
                totals.append({"step": "fig2 grid", "engine": engine, "precision": precision, "model": "both",
                               "runs": 2 * len(GRID), "grid_min": sum(r["grid_min"] for r in parts)})
    return totals


def run(out: Path, data: str | None, budget: float, quick: bool, only: str = "") -> str:
    """Every step in order of importance within `budget` seconds; writes OUT/emulator_gpu.json and .md."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if quick:  # kernels this small gain nothing from a second thread, and lose much on a loaded machine
        torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    loaded: dict[int, FleetData] = {}
    Step = Callable[[float], list[dict[str, Any]]]
    steps: list[tuple[str, Step]] = [
        (f"paper {m}, {e}, {p}", lambda share, m=m, e=e, p=p: [measure(m, p, e, data, device, quick, share, loaded)])
        for m in MODELS for e in ("vmap", "stacked") for p in PRECISIONS]
    steps += [(f"paper {m}, sequential, float32",
               lambda share, m=m: [measure(m, "float32", "sequential", data, device, quick, share, loaded)])
              for m in MODELS]
    steps += [(f"reduced grid, {p}", lambda share, p=p: reduced_grid(out, data, p, device, quick)) for p in PRECISIONS]
    steps = [(name, step) for name, step in steps if only in name]
    info = machine() | {"device": _device_name(), "torch": torch.__version__, "budget_s": budget}
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i, (name, step) in enumerate(steps):
        left = budget - (time.perf_counter() - started)
        if left <= 0:
            rows.append({"step": name, "error": f"skipped: the {budget:.0f} s budget is spent"})
            continue
        print(f"[{budget - left:6.1f} s] {name}", flush=True)
        try:
            rows += step(left / (len(steps) - i))
        except Exception as e:  # a failed step is a result; the next one still runs
            rows.append({"step": name, "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
    ok = [r for r in rows if "error" not in r]
    ok += grid_rows(ok)
    (out / "emulator_gpu.json").write_text(json.dumps({"machine": info, "rows": ok,
                                                       "errors": [r for r in rows if "error" in r]}, indent=2) + "\n")
    lines = [f"{info['device']}, torch {info['torch']}, {time.perf_counter() - started:.0f} s of a "
             f"{budget:.0f} s budget, load {info['load_1min']}",
             table(HEADER, [[r.get(h) for h in HEADER] for r in ok])]
    lines += [f"- {r['step']}: {r['error']}" for r in rows if "error" in r]
    (out / "emulator_gpu.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="CIFAR-10 as an .npz of decoded arrays (not needed with --quick)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/emulator_gpu"),
                        help="folder for the table: emulator_gpu.md and emulator_gpu.json")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the whole command keeps within, by timing fewer rounds (default 540; "
                             "--quick 90)")
    parser.add_argument("--quick", action="store_true",
                        help="the same steps on digits, tiny models and few samples: about 2 minutes on a CPU")
    parser.add_argument("--only", default="", help="run only the steps whose name holds this text")
    args = parser.parse_args()
    if args.data is None and not args.quick:
        parser.error("--data is required (CIFAR-10 as an .npz), or --quick")
    budget = args.budget if args.budget is not None else QUICK_BUDGET_S if args.quick else BUDGET_S
    if budget <= 0:
        parser.error("--budget must be positive")
    print(run(args.out, args.data, budget, args.quick, args.only))


if __name__ == "__main__":
    main()
