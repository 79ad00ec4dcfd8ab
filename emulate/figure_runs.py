"""A figure's runs on disk and how they run, for every figure (emulate/figures.py: runs of rounds,
emulate/async_figure.py: runs on a simulated clock). Each curve is a run directory: a finished one is reused,
an interrupted one resumed, one whose settings differ started over. The runs go one after another, stacked
in one process, or `jobs` at a time in single-threaded processes, every run's progress on one board."""

from __future__ import annotations

import json
import multiprocessing
import queue
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fedper.data import DataError
from fedper.emulate.experiment import CONFIG, DATA, METRICS, STATE, SUMMARY
from fedper.emulate.progress import Board, Event


class Settings(Protocol):
    """A run's config (experiment.RunConfig, async_fleet.ClockRunConfig): saved as config.json, its budget
    (rounds, uploads) the one thing a run may change when it is extended or reused."""

    def to_json(self) -> str: ...

    @classmethod
    def from_json(cls, text: str) -> Any: ...

    def with_budget_of(self, other: Any) -> Any: ...

    def budget_spent(self, summary: dict) -> bool: ...


C = TypeVar("C", bound=Settings)
Pending = tuple[Any, Path, bool, str | None]  # a run's config, directory, whether to resume it, its label
Runner = Callable[..., dict]  # run_experiment, run_clocked: (config, out, *, resume, show_progress, report, label)


def needs_data(figure: str, dataset: str, data: str | Path | None) -> None:
    """A figure on a real data set stops at once when no --data is given."""
    if dataset != "digits" and data is None:
        raise DataError(f"figure {figure} runs on {dataset}, which needs --data PATH (absent here); "
                        f"pass --data, or --dataset digits for a zero-download smoke run")


def saved_config(run_dir: Path, config: C) -> C | None:
    """The config.json of `run_dir`, read as `config`'s type (None: none there)."""
    path = run_dir / CONFIG
    return type(config).from_json(path.read_text()) if path.exists() else None


def resumable_run(run_dir: Path, config: Settings) -> bool:
    """A saved run continues only if it is the same run; another budget extends or reuses it."""
    saved = saved_config(run_dir, config)
    return (run_dir / STATE).exists() and saved is not None and saved.with_budget_of(config) == config


def finished_run(run_dir: Path, config: Settings) -> bool:
    if not (run_dir / SUMMARY).exists() or saved_config(run_dir, config) != config:
        return False
    return config.budget_spent(json.loads((run_dir / SUMMARY).read_text()))


def start_over(pending: Sequence[Pending]) -> None:
    """Delete the directory of every pending run that cannot resume, saying so."""
    for _, run_dir, resume, _ in pending:
        if not resume and run_dir.exists():
            print(f"{run_dir}: its settings differ from this command's, so it starts over", file=sys.stderr)
            shutil.rmtree(run_dir)


def read_history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]


def run_data_info(run_dir: Path) -> dict:
    """The run's data.json ({} for a run written before it existed: no chance line then)."""
    path = run_dir / DATA
    return json.loads(path.read_text()) if path.is_file() else {}


def run_all(pending: Sequence[Pending], jobs: int, show_progress: bool, run: Runner,
            stacked: Callable[..., Any] | None = None) -> None:
    """The runs stacked in this process (`stacked`: experiment.run_stacked), or one after another, or `jobs` at
    a time in single-threaded processes: on a CPU shared with other work, one process per core is faster than
    one process whose threads wait for each other. Every run's progress goes to one board, from the other
    processes through a queue."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    with Board(show_progress) as board:
        if stacked is not None and pending:
            stacked(pending, report=board.report)
            return
        if jobs == 1 or len(pending) <= 1:
            for config, run_dir, resume, label in pending:
                run(config, run_dir, resume=resume, report=board.report, label=label)
            return
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch thread pool inherited by fork
        workers = min(jobs, len(pending))
        if not show_progress:
            _in_processes(spawn, workers, pending, run, None)
            return
        print(f"{len(pending)} runs, {workers} at a time", file=sys.stderr)
        with spawn.Manager() as manager:
            events = manager.Queue()
            pump = threading.Thread(target=_pump, args=(events, board), daemon=True)
            pump.start()
            try:
                _in_processes(spawn, workers, pending, run, partial(_put, events))
            finally:
                events.put(None)
                pump.join()


def _single_threaded() -> None:
    import torch

    torch.set_num_threads(1)


def _in_processes(context: Any, workers: int, pending: Sequence[Pending], run: Runner, report: Any) -> None:
    """The runs in `workers` single-threaded processes, their progress to `report` (None: none shown)."""
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_single_threaded) as pool:
        futures = [pool.submit(run, c, d, resume=r, show_progress=report is not None, report=report, label=label)
                   for c, d, r, label in pending]
        for future in futures:
            future.result()


def _put(events: queue.Queue, event: Event) -> None:
    events.put(event)


def _pump(events: queue.Queue, board: Board) -> None:
    """Hand the runs' progress events to the board until None comes."""
    while (event := events.get()) is not None:
        board.report(event)
