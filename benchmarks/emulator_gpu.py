"""The emulator on a GPU: the reduced Fig. 2 grid (the smoke preset) with the vmap and the sequential engine,
and timed rounds of the paper-scale grid (width 1.0, all of CIFAR-10, 4 local epochs, B = 128) for both models
and both engines, with the peak GPU memory of each, and the full grid's time extrapolated from them.

    python benchmarks/emulator_gpu.py --data cifar10.npz --out runs/bench [--budget 270]

--data is CIFAR-10 as an .npz of decoded arrays (x_train, y_train, x_test, y_test, classes). Steps run in
order of importance and none starts once --budget seconds have passed, so a lease of fixed length ends with
a table of what ran; a step that fails is recorded with its error and the next one runs.
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
from fedper.emulate.experiment import METRICS, SUMMARY, RunConfig, run_experiment
from fedper.emulate.figures import PRESETS, make_figure
from fedper.emulate.fleet import FleetConfig

SMOKE = PRESETS["smoke"]
ENGINES = ("vmap", "sequential")
PAPER_ROUNDS = 100
GRID_RUNS = 6  # Fig. 2 per model: FedAvg and FedPer at k = 4, 8, 10


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
    return {"step": "paper", "engine": summary["engine"], "run": f"{model} fedper k=4", "rounds": len(rounds),
            "run_s": summary["wall_s"], "round_s": warm, "final_mean_accuracy": summary["final_mean_accuracy"],
            "peak_gib": _peak_gib(), "grid_hours": warm * PAPER_ROUNDS * GRID_RUNS / 3600}


def run(out: Path, data: str | None, budget: float, quick: bool, only: str = "") -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    steps = [(f"reduced grid, {e}", lambda e=e: reduced_grid(out, data, e, device, quick)) for e in ENGINES[:1]]
    steps += [(f"paper {m}, {e}", lambda m=m, e=e: [paper_rounds(out, data, m, e, device, quick)])
              for m in ("mobilenet_v1", "resnet34") for e in ENGINES]
    steps += [(f"reduced grid, {e}", lambda e=e: reduced_grid(out, data, e, device, quick)) for e in ENGINES[1:]]
    rows: list[dict[str, Any]] = []
    info = machine() | {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
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
    header = ("step", "engine", "run", "rounds", "run_s", "round_s", "final_mean_accuracy", "peak_gib", "grid_hours")
    ok = [r for r in rows if "error" not in r]
    lines = [f"{info['device']}, torch {info['torch']}, {time.perf_counter() - started:.0f} s",
             table(header, [[r.get(h) for h in header] for r in ok])]
    lines += [f"- {r['step']}: {r['error']}" for r in rows if "error" in r]
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
