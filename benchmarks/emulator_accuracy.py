"""Accuracy not traded for speed (issue 35, item 4): a reduced Fig. 2 grid's final-round mean accuracy, separate
runs against stacked ones and bf16 against float32, set beside the spread across seeds.

    python benchmarks/emulator_accuracy.py --data cifar10.npz --out runs/bench/accuracy [--seeds 0,1] [--ks 4]

Each curve (FedAvg and FedPer at each k of --ks; MobileNet-v1 under the smoke preset: width x0.25, 5 % of the
data, 10 clients, one local epoch of batch 32, lr 0.05 with momentum 0.9, 20 rounds) runs at every seed under
three conditions: separate runs on the device's own engine (a CPU's sequential one, a GPU's vmap one), the same
runs stacked (emulate/stacked.py) in float32, and stacked under --precision bf16. Runs are the emulator's own run
directories (OUT/seedS/CONDITION/ALGORITHM-kK), so a finished run is reused and an interrupted one resumed:
several invocations with other --seeds may run side by side and a last one over every seed writes the table.

A comparison agrees for a curve when its difference (of the means over seeds) is no larger than the spread
across seeds (the largest max - min over seeds of the curve's conditions). Writes OUT/emulator_accuracy.md and
.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from common import machine, table

from fedper.algorithms import get_algorithm
from fedper.emulate.data import DataConfig
from fedper.emulate.experiment import SUMMARY, RunConfig, run_experiment, run_stacked
from fedper.emulate.figure_runs import Pending, finished_run, resumable_run, run_all, start_over
from fedper.emulate.figures import PRESETS
from fedper.emulate.fleet import FleetConfig

SMOKE = PRESETS["smoke"]
CONDITIONS = {"separate": ("float32", False), "stacked": ("float32", True), "stacked-bf16": ("bf16", True)}
COMPARISONS = (("stacked - separate", "stacked", "separate"), ("bf16 - float32", "stacked-bf16", "stacked"))
ALGORITHMS = ("fedavg", "fedper")


def configs(data: str, dataset: str, seed: int, k: int, precision: str, device: str,
            rounds: int) -> dict[str, RunConfig]:
    """Fig. 2's two curves at `k` under the smoke preset, by algorithm."""
    scale = float(SMOKE["scale"])  # type: ignore[arg-type]
    base_data = DataConfig(dataset=dataset, data=data, clients=10, classes_per_client=k, scale=scale, seed=seed)
    fleet = FleetConfig(model="mobilenet_v1", width=SMOKE["width"], local_epochs=SMOKE["local_epochs"],  # type: ignore[arg-type]
                        batch_size=SMOKE["batch_size"], lr=SMOKE["lr"], momentum=SMOKE["momentum"],  # type: ignore[arg-type]
                        seed=seed, precision=precision)
    return {a: RunConfig(base_data, replace(fleet, algorithm=a, kp=0 if get_algorithm(a).requires_kp0 else 2),
                         rounds=rounds, device=device) for a in ALGORITHMS}


def run_condition(out: Path, data: str, dataset: str, seed: int, ks: list[int], condition: str, device: str,
                  rounds: int) -> dict[str, Path]:
    """Every curve of one seed under `condition` (the finished ones reused); their directories by curve name."""
    precision, stack = CONDITIONS[condition]
    dirs: dict[str, Path] = {}
    pending: list[Pending] = []
    for k in ks:
        for algorithm, config in configs(data, dataset, seed, k, precision, device, rounds).items():
            run_dir = out / f"seed{seed}" / condition / f"{algorithm}-k{k}"
            dirs[f"{algorithm}, k = {k}"] = run_dir
            if not finished_run(run_dir, config):
                pending.append((config, run_dir, resumable_run(run_dir, config), f"{condition} {run_dir.name}"))
    start_over(pending)
    run_all(pending, 1, False, run_experiment, run_stacked if stack else None)
    return dirs


def final_accuracy(run_dir: Path) -> float:
    return float(json.loads((run_dir / SUMMARY).read_text())["final_mean_accuracy"])


def report(results: dict[str, dict[str, dict[int, float]]], seeds: list[int]) -> tuple[list[dict[str, Any]], str]:
    """Per curve: each condition's mean over seeds (and each seed's), the spread across seeds, each comparison."""
    rows = []
    for curve, by_condition in results.items():
        means = {c: statistics.fmean(by_condition[c].values()) for c in CONDITIONS}
        spread = max(max(v.values()) - min(v.values()) for v in by_condition.values())
        row: dict[str, Any] = {"curve": curve, "spread": spread}
        for c in CONDITIONS:
            row[c] = means[c]
            row[f"{c} by seed"] = [by_condition[c][s] for s in seeds]
        for name, a, b in COMPARISONS:
            row[name] = means[a] - means[b]
            row[f"{name} agrees"] = abs(means[a] - means[b]) <= spread
        rows.append(row)
    header = ["curve", *(f"{c} (seeds {' / '.join(map(str, seeds))})" for c in CONDITIONS), "seed spread",
              *(name for name, _, _ in COMPARISONS), "within spread"]
    cells = []
    for row in rows:
        cells.append([row["curve"],
                      *(f"{row[c]:.3f} ({' / '.join(f'{v:.3f}' for v in row[f'{c} by seed'])})" for c in CONDITIONS),
                      f"{row['spread']:.3f}", *(f"{row[name]:+.3f}" for name, _, _ in COMPARISONS),
                      " / ".join("yes" if row[f"{name} agrees"] else "no" for name, _, _ in COMPARISONS)])
    return rows, table(header, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="CIFAR-10 as an .npz of decoded arrays (or a CIFAR root with "
                                                      "--dataset cifar10)")
    parser.add_argument("--dataset", default="npz", help="the emulator's --dataset for --data (default npz)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/emulator_accuracy"),
                        help="folder of the runs and of emulator_accuracy.md / .json")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (two at least for a spread)")
    parser.add_argument("--ks", default="4,8,10", help="comma-separated classes per client, Fig. 2's 4,8,10 by default")
    parser.add_argument("--rounds", type=int, default=round(int(SMOKE["rounds"]) * float(SMOKE["scale"])),  # type: ignore[call-overload]
                        help="rounds per run (default: the smoke preset's 20)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared CPU run one invocation per seed side by side)")
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        parser.error("--seeds and --ks take comma-separated integers, e.g. --seeds 0,1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results: dict[str, dict[str, dict[int, float]]] = {}
    for seed in seeds:
        for condition in CONDITIONS:
            for curve, run_dir in run_condition(args.out, args.data, args.dataset, seed, ks, condition, args.device,
                                                args.rounds).items():
                results.setdefault(curve, {}).setdefault(condition, {})[seed] = final_accuracy(run_dir)
    rows, text = report(results, seeds)
    info = machine() | {"torch": torch.__version__, "seconds": round(time.perf_counter() - started),
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (args.out / "emulator_accuracy.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    text = f"round {args.rounds} mean accuracy, {info['device']}, torch {info['torch']}\n\n{text}"
    (args.out / "emulator_accuracy.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
