"""On-device training under contention: ORT vs PyTorch eager while other processes keep the CPU busy.

Phones train in the background while other apps run. This measures how the ORT / PyTorch ratio of
benchmarks/device_training.py moves when 0, 1 or 2 other processes spin a busy loop, with the
training runtime on 1 or 2 threads (ORT: intra_op_num_threads; PyTorch: torch.set_num_threads).
Same model, same batches, plain SGD, the pieces of device_training.py. Each ORT + PyTorch pair of
measurements gets fresh load processes, which stop by themselves after a fixed time (and are killed
in a `finally`); a measurement that outlives its load is an error, not a row. Every number is a
ratio within this run: the median over repeats, each repeat a pass over every (load, threads).

    python benchmarks/device_contention.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from common import main, median, table, write_json
from device_training import export, make_data, ort_session, rate, torch_rate, torch_step

LOADS = (0, 1, 2)  # competing busy processes
THREADS = (1, 2)
BATCH = 32
# Runs until its deadline, whatever happens to the benchmark: a load can never outlive its bound.
BUSY_LOOP = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "print('ready', flush=True)\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextmanager
def busy_processes(count: int, seconds: float) -> Iterator[Callable[[], bool]]:
    """`count` processes spinning for at most `seconds`; yields a check that all of them still spin."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(seconds)], stdout=subprocess.PIPE,
                                    text=True)
            procs.append(proc)
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a load process failed to start")
        yield lambda: all(p.poll() is None for p in procs)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def ort_step(directory: Path, threads: int) -> Callable[[np.ndarray, np.ndarray], float]:
    """The artifacts' Module + Optimizer on `threads` intra-op threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort_session(directory, options)


def contend(cache: Path, width: float, samples: int, repeats: int, load_seconds: float) -> list[dict[str, Any]]:
    """Rows for every (load, threads): ORT then PyTorch under the same load processes, `repeats` times."""
    directory, _ = export(cache, "mobilenet_v1", width)
    x, y = make_data(BATCH, samples)
    torch_default = torch_step("mobilenet_v1", width)
    ort_steps = {threads: ort_step(directory, threads) for threads in THREADS}
    runs: dict[tuple[int, int], tuple[list[float], list[float]]] = {
        (load, threads): ([], []) for load in LOADS for threads in THREADS}
    for _ in range(repeats):
        for (load, threads), (ort_rates, torch_rates) in runs.items():
            with busy_processes(load, load_seconds) as still_loaded:
                ort_rates.append(rate(ort_steps[threads], x, y, BATCH))
                torch_rates.append(torch_rate(threads, torch_default, x, y, BATCH))
                if not still_loaded():
                    raise RuntimeError(f"a load process stopped before the measurement ended: raise load_seconds "
                                       f"({load_seconds} s)")
    rows = []
    for (load, threads), (ort_rates, torch_rates) in runs.items():
        ratios = [o / t for o, t in zip(ort_rates, torch_rates, strict=True)]
        rows.append({"model": "mobilenet_v1", "width": width, "batch": BATCH, "samples": samples,
                     "busy_processes": load, "threads": threads, "ort_samples_s": median(ort_rates),
                     "torch_samples_s": median(torch_rates), "ratio": median(ratios), "ratios": ratios})
    for row in rows:  # how the ratio moved from the idle run with the same threads
        idle = next(r for r in rows if r["threads"] == row["threads"] and r["busy_processes"] == 0)
        row["ratio_vs_no_load"] = row["ratio"] / idle["ratio"]
    return rows


def run(out: Path, quick: bool = False) -> str:
    # A load outlasts one ORT + PyTorch pair by far (seconds each on an idle machine).
    widths, samples, repeats, load_seconds = ((0.5,), 192, 2, 120.0) if quick else ((1.0, 0.5), 384, 3, 300.0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for width in widths for row in contend(Path(tmp), width, samples, repeats, load_seconds)]
    write_json(out, "device_contention", {"rows": rows})
    return table(["width", "B", "busy processes", "threads", "ORT samples/s", "PyTorch samples/s",
                  f"ORT / PyTorch (median of {repeats})", "ratio / ratio with no load"],
                 [[r["width"], r["batch"], r["busy_processes"], r["threads"], r["ort_samples_s"],
                   r["torch_samples_s"], r["ratio"], r["ratio_vs_no_load"]] for r in rows])


if __name__ == "__main__":
    main(run, __doc__, quick="MobileNet-v1 w0.5 only, 192 samples per measurement, two repeats")
