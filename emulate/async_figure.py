"""`fedper-emulate figure async`: mean personalized accuracy against simulated wall-clock time and against
uploads, for synchronous FedPer, asynchronous FedPer (FedBuff) and synchronous FedAvg on one device trace
(emulate/async_fleet.py; docs/reproducing.md "Figure async").

Every curve spends the same budget, R x N uploads (N devices, R = --rounds after --scale: each device's share
of R synchronous rounds), so the two panels compare what the uploads bought and how long they took. Each
curve is a run directory under OUT/async/, reused when finished and resumed when interrupted, as the other
figures' runs are.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fedper.algorithms import get_algorithm
from fedper.data.sources import DATASET_NAMES
from fedper.emulate.async_fleet import ClockConfig, ClockRunConfig, run_clocked
from fedper.emulate.data import PAPER_BATCH, PAPER_CLIENTS, DataConfig
from fedper.emulate.drawing import chance_legend, draw_chance, integer_rounds, pyplot, save
from fedper.emulate.figure_runs import (
    Pending,
    finished_run,
    needs_data,
    read_history,
    resumable_run,
    run_all,
    run_data_info,
    start_over,
)
from fedper.emulate.fleet import FleetConfig

CURVES = (("sync", "fedper", "FedPer, synchronous"), ("async", "fedper", "FedPer, asynchronous (FedBuff)"),
          ("sync", "fedavg", "FedAvg, synchronous"))
DATASET = "cifar10"


def make_async_figure(*, out: str | Path, scale: float, data: str | Path | None, dataset: str | None, device: str,
                      rounds: int | None, fleet_overrides: dict, data_overrides: dict, clock_overrides: dict,
                      models: tuple[str, ...], show_progress: bool, jobs: int) -> Path:
    """Run (or reuse) the three curves and write OUT/async.png; `rounds` None: 100 (before --scale)."""
    chosen = dataset or DATASET
    needs_data("async", chosen, data)
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
    pending: list[Pending] = []
    run_dirs = []
    for i, (mode, algorithm, _) in enumerate(CURVES):
        chosen_alg = get_algorithm(algorithm)
        fleet = replace(base_fleet, algorithm=algorithm, kp=0 if chosen_alg.requires_kp0 else chosen_alg.default_kp)
        config = ClockRunConfig(base_data, fleet, replace(clock, mode=mode), device)
        run_dir = out / "async" / f"{i:02d}-{mode}-{algorithm}"
        run_dirs.append(run_dir)
        if not finished_run(run_dir, config):
            pending.append((config, run_dir, resumable_run(run_dir, config), None))
    start_over(pending)
    run_all(pending, jobs, show_progress, run_clocked)
    png = out / "async.png"
    runs = [(label, read_history(run_dir), run_data_info(run_dir)) for (_, _, label), run_dir in zip(CURVES, run_dirs,
                                                                                            strict=True)]
    named = next((info["name"] for _, _, info in runs if info.get("name")), DATASET_NAMES.get(chosen, chosen))
    _draw(runs, png, named, replace(clock, mode="async"))
    return png


def _draw(runs: list[tuple[str, list[dict], dict]], png: Path, dataset: str, clock: ClockConfig) -> None:
    fig, (by_time, by_uploads) = pyplot().subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for label, metrics, info in runs:
        accuracy = [m["mean_accuracy"] for m in metrics]
        (line,) = by_time.plot([m["time_s"] / 60 for m in metrics], accuracy, label=label)
        by_uploads.plot([m["uploads"] for m in metrics], accuracy, color=line.get_color(), label=label)
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
    save(fig, png)
