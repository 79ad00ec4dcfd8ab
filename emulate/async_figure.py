"""`fedper-emulate figure async`: mean personalized accuracy against simulated wall-clock time and against
uploads, for synchronous FedPer, asynchronous FedPer (FedBuff) and synchronous FedAvg on one device trace
(emulate/async_fleet.py; docs/reproducing.md "Figure async").

Every curve spends the same budget, R x N uploads (N devices, R = --rounds after --scale: each device's share
of R synchronous rounds), so the two panels compare what the uploads bought and how long they took. Each
curve is a run directory under OUT/async/, reused when finished and resumed when interrupted, as the other
figures' runs are.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from fedper.algorithms import get_algorithm
from fedper.data import DataError
from fedper.emulate.async_fleet import ClockConfig, ClockRunConfig, run_clocked
from fedper.emulate.data import PAPER_BATCH, PAPER_CLIENTS, DataConfig
from fedper.emulate.experiment import CONFIG, METRICS, STATE, SUMMARY
from fedper.emulate.figures import DATASET_NAMES, chance_legend, draw_chance, integer_rounds, run_data_info
from fedper.emulate.fleet import FleetConfig

CURVES = (("sync", "fedper", "FedPer, synchronous"), ("async", "fedper", "FedPer, asynchronous (FedBuff)"),
          ("sync", "fedavg", "FedAvg, synchronous"))
DATASET = "cifar10"


def make_async_figure(*, out: str | Path, scale: float, data: str | Path | None, dataset: str | None, device: str,
                      rounds: int | None, fleet_overrides: dict, data_overrides: dict, clock_overrides: dict,
                      models: tuple[str, ...], show_progress: bool, jobs: int) -> Path:
    """Run (or reuse) the three curves and write OUT/async.png; `rounds` None: 100 (before --scale)."""
    chosen = dataset or DATASET
    if chosen != "digits" and data is None:
        raise DataError(f"figure async runs on {chosen}, which needs --data PATH (absent here); pass --data, or "
                        f"--dataset digits for a zero-download smoke run")
    if len(models) > 1:
        raise ValueError(f"figure async draws one model, got {', '.join(models)}")
    fleet_options = dict(fleet_overrides)
    clients = data_overrides.get("clients", PAPER_CLIENTS.get(chosen, 10))
    base_data = DataConfig(**{"scale": scale, **data_overrides, "dataset": chosen,
                              "data": str(data) if data else None, "clients": clients})
    base_fleet = FleetConfig(**{"batch_size": PAPER_BATCH.get(chosen, 128), **fleet_options,
                                "clients_per_round": None, **({"model": models[0]} if models else {})})
    budget = max(1, round((100 if rounds is None else rounds) * scale)) * clients
    clock = ClockConfig(**{"uploads": budget, "clients_per_round": fleet_options.get("clients_per_round"),
                           **clock_overrides})
    out = Path(out)
    pending, run_dirs = [], []
    for i, (mode, algorithm, _) in enumerate(CURVES):
        chosen_alg = get_algorithm(algorithm)
        fleet = replace(base_fleet, algorithm=algorithm, kp=0 if chosen_alg.requires_kp0 else chosen_alg.default_kp)
        config = ClockRunConfig(base_data, fleet, replace(clock, mode=mode), device)
        run_dir = out / "async" / f"{i:02d}-{mode}-{algorithm}"
        run_dirs.append(run_dir)
        if _finished(run_dir, config):
            continue
        resume = _resumable(run_dir, config)
        if not resume and run_dir.exists():
            print(f"{run_dir}: its settings differ from this command's, so it starts over", file=sys.stderr)
            shutil.rmtree(run_dir)
        pending.append((config, run_dir, resume))
    if jobs == 1 or len(pending) <= 1:
        for config, run_dir, resume in pending:
            run_clocked(config, run_dir, resume=resume, show_progress=show_progress)
    else:
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch thread pool inherited by fork
        with ProcessPoolExecutor(min(jobs, len(pending)), mp_context=spawn, initializer=_single_threaded) as pool:
            for future in [pool.submit(run_clocked, c, d, resume=r, show_progress=False) for c, d, r in pending]:
                future.result()
    png = out / "async.png"
    runs = [(label, _history(run_dir), run_data_info(run_dir)) for (_, _, label), run_dir in zip(CURVES, run_dirs,
                                                                                             strict=True)]
    named = next((info["name"] for _, _, info in runs if info.get("name")), DATASET_NAMES.get(chosen, chosen))
    _draw(runs, png, named, replace(clock, mode="async"))
    return png


def _single_threaded() -> None:
    import torch

    torch.set_num_threads(1)


def _saved(run_dir: Path) -> ClockRunConfig | None:
    return ClockRunConfig.from_json((run_dir / CONFIG).read_text()) if (run_dir / CONFIG).exists() else None


def _resumable(run_dir: Path, config: ClockRunConfig) -> bool:
    """A saved run continues only if it is the same run; another budget extends it or reuses it."""
    saved = _saved(run_dir)
    return (run_dir / STATE).exists() and saved is not None and replace(
        saved, clock=replace(saved.clock, uploads=config.clock.uploads)) == config


def _finished(run_dir: Path, config: ClockRunConfig) -> bool:
    if not (run_dir / SUMMARY).exists() or _saved(run_dir) != config:
        return False
    return json.loads((run_dir / SUMMARY).read_text())["uploads"] >= config.clock.uploads


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]


def _draw(runs: list[tuple[str, list[dict], dict]], png: Path, dataset: str, clock: ClockConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_uploads) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for label, history, info in runs:
        accuracy = [m["mean_accuracy"] for m in history]
        (line,) = by_time.plot([m["time_s"] / 60 for m in history], accuracy, label=label)
        by_uploads.plot([m["uploads"] for m in history], accuracy, color=line.get_color(), label=label)
        for ax in (by_time, by_uploads):
            draw_chance(ax, info.get("chance_accuracy"), line.get_color())
    integer_rounds(by_uploads)  # uploads are counted, not measured
    by_time.set_xlabel("simulated time (minutes)")
    by_uploads.set_xlabel(f"uploads (async: K = {clock.buffer_size}, concurrency {clock.concurrency or 'all'}, "
                          f"max staleness {clock.max_staleness})")
    by_time.set_ylabel("mean personalized accuracy")
    for ax in (by_time, by_uploads):
        ax.grid(alpha=0.3)
        chance_legend(ax, any("chance_accuracy" in info for _, _, info in runs))
    trace = Path(clock.trace).name if clock.trace else "the synthetic trace"
    fig.suptitle(f"Synchronous and asynchronous FedPer on {trace} [{dataset}]", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)
