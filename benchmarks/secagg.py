"""Secure aggregation (fedper.secagg, SecAgg+) against the plain protocol: bytes and seconds per device
and for the server at 10 / 50 / 100 devices, in one run.

A round of the pure kernel, every message serialized as it would cross the coordinator (compact JSON;
the masked vector as safetensors). Per device: bytes up and down over the four stages, and the seconds of
its own stage work (key generation, agreements, Shamir, AES-GCM, quantization and mask expansion). The
server: its seconds over the stages (relaying, summing, reconstructing seeds and keys, removing masks).
The plain protocol's update is the fp32 safetensors blob of the same vector, up only (the model coming
down is the same in both modes and not counted). 10 % of the devices drop after sharing their keys and
before their masked input, the costly case for the server (their pairwise masks must be rebuilt). The
neighbour degree and threshold are fedper.secagg's defaults.

    python benchmarks/secagg.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import main, table, write_json
from safetensors.numpy import save as st_save

from fedper.secagg import MaskedInput, SecAggClient, SecAggConfig, SecAggServer, wire_size

DEVICES = (10, 50, 100)
LENGTH = 1_000_000  # --quick: 20,000
DROPPED = 0.10


def through_wire(message: Any) -> Any:
    if isinstance(message, MaskedInput):
        return MaskedInput.from_safetensors(message.to_safetensors())
    return type(message).from_dict(json.loads(json.dumps(message.to_dict())))


def measure(devices: int, length: int, seed: int = 0) -> dict[str, Any]:
    config = SecAggConfig.create(round=1, devices=devices, length=length, clip=0.05, graph_seed=seed)
    rng = np.random.default_rng(seed)
    vectors = rng.normal(0, 0.01, (devices, length)).astype(np.float32)
    dropped = set(rng.choice(devices, max(1, round(DROPPED * devices)), replace=False).tolist())
    up = dict.fromkeys(range(devices), 0)
    down = dict.fromkeys(range(devices), 0)
    device_s = dict.fromkeys(range(devices), 0.0)
    server_s = 0.0

    def on_device(u: int, stage, message=None, *extra) -> Any:
        """The device's stage on the message as it arrives; its reply as the server decodes it."""
        if message is not None:
            down[u] += wire_size(message)
            message = through_wire(message)
        start = time.perf_counter()
        reply = stage(message, *extra) if message is not None else stage()
        device_s[u] += time.perf_counter() - start
        up[u] += wire_size(reply)
        return through_wire(reply)

    def on_server(stage, messages):
        nonlocal server_s
        start = time.perf_counter()
        result = stage(messages)
        server_s += time.perf_counter() - start
        return result

    clients = [SecAggClient(config, u) for u in range(devices)]
    server = SecAggServer(config)
    keys = on_server(server.neighbour_keys, [on_device(c.device, c.advertise) for c in clients])
    inbox = on_server(server.relay_shares, [on_device(u, clients[u].share_keys, m) for u, m in keys.items()])
    masked = [on_device(u, clients[u].masked_input, m, vectors[u]) for u, m in inbox.items() if u not in dropped]
    requests = on_server(server.unmask_requests, masked)
    result = on_server(server.aggregate, [on_device(u, clients[u].unmask, m) for u, m in requests.items()])
    survivors = list(result.survivors)
    clipped = np.clip(vectors[survivors].astype(np.float64), -config.clip, config.clip).sum(axis=0)
    error = float(np.abs(result.sum - clipped).max())  # the quantization's error, clipping aside
    plain = len(st_save({"update": vectors[0]}))
    contributors = [u for u in range(devices) if u not in dropped]
    return {"devices": devices, "length": length, "degree": config.degree, "threshold": config.threshold,
            "dropped": len(dropped), "plain_up_bytes": plain,
            "up_bytes": float(np.mean([up[u] for u in contributors])),
            "down_bytes": float(np.mean([down[u] for u in contributors])),
            "device_s": float(np.mean([device_s[u] for u in contributors])), "server_s": server_s,
            "max_abs_error": error,
            "error_bound": len(survivors) * 0.5 * 2 * config.clip / (2**config.value_bits - 1)}


def run(out: Path, quick: bool = False) -> str:
    devices, length = ((10, 20), 20_000) if quick else (DEVICES, LENGTH)
    rows = [measure(n, length) for n in devices]
    write_json(out, "secagg", {"rows": rows, "dropped_fraction": DROPPED})
    return table(["devices", "values", "k", "t", "dropped", "plain up KB", "secagg up KB", "up vs plain",
                  "secagg down KB", "device s", "server s", "max error (bound)"],
                 [[r["devices"], f"{r['length']:,}", r["degree"], r["threshold"], r["dropped"],
                   r["plain_up_bytes"] / 1e3, r["up_bytes"] / 1e3, r["up_bytes"] / r["plain_up_bytes"],
                   r["down_bytes"] / 1e3, r["device_s"], r["server_s"],
                   f"{r['max_abs_error']:.2g} ({r['error_bound']:.2g})"] for r in rows])


if __name__ == "__main__":
    main(run, __doc__, quick="10 and 20 devices, 20,000 values")
