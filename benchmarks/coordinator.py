"""Coordinator cost per update and memory as the fleet grows (MobileNet-v1, width 1.0, FedPer K_P=1).

Times per update, as ratios within the same run against a raw numpy `acc += update` over the same
float32 tensors and against a raw float64 `acc64 += update64` over the same tensors (what any
float64 sum must stream through memory: the floor for the rule): WeightedMean.add (the rule the
coordinator runs: a flat float64 sum, fed the update as decode_shared hands it over, one float32
array of views into the blob), the wire decode (chunk
checks + reassembly + sha256 + safetensors + validation), and the engine's whole path per update
(decode + validate + fold + the checkpoint it writes so a restart loses nothing: the blob, or every
PARTIAL_EVERY updates the float64 running sum), averaged over 2 x PARTIAL_EVERY updates that follow
PARTIAL_EVERY first ones (a running coordinator reuses its slot files; the first updates create them). Every
path is timed several times, interleaved; the table shows the fastest (background load only ever
adds time) and the median of each repeat's ratio to the float64 add timed next to it (load that
comes and goes hits both alike), in wall time and in CPU time; the JSON keeps the medians too.
Memory: tracemalloc peak while WeightedMean folds N emulated updates, as a multiple of one
update's size, and the same for the engine's whole path.

    python benchmarks/coordinator.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import tempfile
import time
import tracemalloc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from common import main, median, table, write_json

from fedper.aggregation import WeightedMean
from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Store
from fedper.coordinator.strategies.mean import PARTIAL_EVERY
from fedper.manifest import Manifest
from fedper.models import build_model, describe, exported_state
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    Reassembler,
    Register,
    Topics,
    UpdateMeta,
    chunk,
    decode_chunk,
)

TOPICS = Topics("bench")

def mobilenet() -> tuple[Manifest, dict[str, np.ndarray]]:
    net = build_model("mobilenet_v1", 10, 1.0, 32)
    manifest = describe(net, architecture="mobilenet_v1", kp=1, algorithm="fedper", input_size=32, width=1.0)
    state = exported_state(net)
    return manifest, {name: state[name].detach().numpy().copy() for name in manifest.names(shared=True)}

def nbytes(tensors: Mapping[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in tensors.values())

def timed_both(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall, CPU) seconds of one call: CPU time leaves out the time other jobs hold the core."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def fold_times(manifest: Manifest, base: dict[str, np.ndarray], repeats: int,
               engine_repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per update of each path, `repeats` samples each (the first add, which allocates, is left
    out), and `engine_repeats` of the engine's: each a fresh engine's mean over 2 x PARTIAL_EVERY updates
    after PARTIAL_EVERY that create its slot files;
    then the CPU seconds of the same samples (not the engine's, whose fsyncs wait off the CPU).
    All interleaved, so that background load hits every path alike."""
    blob = encode_shared(manifest, {n: v + np.float32(1e-3) for n, v in base.items()})
    update = decode_shared(manifest, blob)  # what the engine folds: views into the blob (a PackedTensors)
    raw = {n: v.copy() for n, v in base.items()}
    raw64, update64 = ({n: v.astype(np.float64) for n, v in t.items()} for t in (base, update))
    frames = chunk(blob, blob_id="u", meta=UpdateMeta(1, 10, manifest.base_digest).to_dict())

    def raw_add() -> None:
        for name, acc in raw.items():
            acc += update[name]

    def raw_add64() -> None:
        for name, acc in raw64.items():
            acc += update64[name]

    def decode() -> None:
        reassembler = Reassembler(max_blob_size(manifest))
        for frame in frames:
            blob = reassembler.add("d", decode_chunk(frame))
        decode_shared(manifest, blob.data)

    mean = WeightedMean()
    mean.add(update, 10)
    paths = {"raw numpy add (float32)": raw_add, "WeightedMean.add": lambda: mean.add(update, 10),
             "raw numpy add (float64, the floor of a float64 sum)": raw_add64, "wire decode + validate": decode}
    runs: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    engine: list[float] = []
    for i in range(repeats):
        for name, fn in paths.items():
            wall, used = timed_both(fn)
            runs[name].append(wall)
            cpu[name].append(used)
        if i % (repeats // engine_repeats) == 0 and len(engine) < engine_repeats:
            per_update = feed_engine(manifest, base, frames, 3 * PARTIAL_EVERY)[0][PARTIAL_EVERY:]
            engine.append(sum(per_update) / len(per_update))
    return {**runs, "engine: decode + validate + fold + checkpoint": engine}, cpu

def feed_engine(manifest: Manifest, base: dict[str, np.ndarray], frames: list[bytes], devices: int,
                trace_memory: bool = False) -> tuple[list[float], int]:
    """Feed one update per device, one device at a time, to a live engine (no broker): seconds from
    each update's first chunk to its fold being checkpointed, and the tracemalloc peak (bytes) of
    the whole path when `trace_memory`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Config.of(rounds=1, min_clients=devices + 1, round_timeout=1e6)
        coordinator = Coordinator(manifest, base, TOPICS, config, Store(tmp))
        coordinator.start(0.0)
        if trace_memory:
            tracemalloc.start()
            tracemalloc.reset_peak()
        times = []
        for i in range(devices):
            device = f"d{i}"
            coordinator.handle(TOPICS.register(device), Register(10, manifest.base_digest, "bench").encode(), 0.0)
            start = time.perf_counter()
            for frame in frames:
                coordinator.handle(TOPICS.update(device), frame, 0.0)
            times.append(time.perf_counter() - start)
        peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
        tracemalloc.stop()
        assert coordinator.counters["accepted"] == devices, coordinator.counters
    return times, peak


def peak_memory(base: dict[str, np.ndarray], updates: int) -> int:
    """tracemalloc peak (bytes) while WeightedMean folds `updates` emulated updates and takes the result."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    mean = WeightedMean()
    for i in range(updates):
        mean.add({n: v + np.float32(i * 1e-4) for n, v in base.items()}, 1 + i % 7)
    mean.result()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def run(out: Path, quick: bool = False) -> str:
    manifest, base = mobilenet()
    size = nbytes(base)
    samples, cpu = fold_times(manifest, base, repeats=15 if quick else 31, engine_repeats=3 if quick else 5)
    times = {name: min(t) for name, t in samples.items()}  # the fastest: background load only ever adds time
    floor = "raw numpy add (float64, the floor of a float64 sum)"
    raw, raw64 = times["raw numpy add (float32)"], times[floor]
    paired = {name: median([a / b for a, b in zip(t, samples[floor], strict=True)]) if len(t) == len(samples[floor])
              else median(t) / median(samples[floor]) for name, t in samples.items()}  # the engine: medians' ratio
    paired_cpu = {name: median([a / b for a, b in zip(t, cpu[floor], strict=True)]) for name, t in cpu.items()}
    counts = (10, 100) if quick else (10, 100, 1000)
    memory = {n: peak_memory(base, n) for n in counts}
    frames = chunk(encode_shared(manifest, base), blob_id="u", meta=UpdateMeta(1, 10, manifest.base_digest).to_dict())
    chunks = len(frames)
    engine_memory = {n: feed_engine(manifest, base, frames, n, trace_memory=True)[1] for n in counts[:2]}
    write_json(out, "coordinator", {
        "model": "mobilenet_v1 w1.0 K_P=1", "update_bytes": size, "chunks_per_update": chunks,
        "chunk_size": DEFAULT_CHUNK_SIZE, "seconds_per_update": times,
        "seconds_per_update_median": {name: median(t) for name, t in samples.items()},
        "x_raw": {k: v / raw for k, v in times.items()},
        "x_raw_float64": {k: v / raw64 for k, v in times.items()},
        "x_raw_float64_median_of_paired_repeats": paired, "x_raw_float64_cpu_median_of_paired_repeats": paired_cpu,
        "peak_bytes": memory, "peak_over_update": {n: m / size for n, m in memory.items()},
        "engine_peak_bytes": engine_memory, "engine_peak_over_update": {n: m / size for n, m in engine_memory.items()},
    })
    text = f"one MobileNet-v1 update: {size / 1e6:.1f} MB in {chunks} chunks\n\n"
    text += table(["path (per update, fastest of the repeats)", "ms", "x raw numpy add", "x raw float64 add",
                   "x raw float64 add (median of paired repeats)", "the same in CPU time"],
                  [[name, t * 1e3, t / raw, t / raw64, paired[name], paired_cpu.get(name, "")]
                   for name, t in times.items()])
    text += "\n\n" + table(["updates folded", "WeightedMean peak MB (tracemalloc)", "x one update's size"],
                           [[n, m / 1e6, m / size] for n, m in memory.items()])
    text += "\n\n" + table(["updates through the engine", "engine peak MB (tracemalloc)", "x one update's size"],
                           [[n, m / 1e6, m / size] for n, m in engine_memory.items()])
    return text


if __name__ == "__main__":
    main(run, __doc__, quick="fewer repeats, up to 100 updates")
