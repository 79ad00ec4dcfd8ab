"""Every benchmark, one table each; JSON under --out. What `make bench` runs.

    python benchmarks/run_all.py [--quick] [--out runs/bench] [--only wire coordinator ...]

Each module's `run(out, quick)` is the one its own command line calls (common.main). Timings are
only ever compared as ratios within one run (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from common import machine

MODULES = ("device_training", "device_contention", "depthwise_graph", "coordinator", "wire", "round_latency",
           "emulator", "export_table", "secagg", "secagg_hostile", "fleet_scale", "upload_flood", "async_fleet",
           "websocket_path", "web", "web_engines")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for the JSON results")
    parser.add_argument("--quick", action="store_true", help="a fast smoke subset of every benchmark")
    parser.add_argument("--only", nargs="+", choices=MODULES, help="run just these")
    args = parser.parse_args()
    names = args.only or MODULES
    print(f"machine: {machine()}; {'quick' if args.quick else 'full'} run; JSON in {args.out}/")
    failed = []
    for name in names:
        print(f"\n## {name}\n", flush=True)
        start = time.perf_counter()
        try:
            text = importlib.import_module(name).run(args.out, args.quick)
        except Exception:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            failed.append(name)
            continue
        print(text)
        print(f"\n({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
