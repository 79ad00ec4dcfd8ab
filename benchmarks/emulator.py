"""Emulator samples/s against a plain sequential PyTorch FedPer loop doing the same work, same run.

Same data (scikit-learn digits, partitioned by the emulator), same model, same rounds: each round
every client trains its local epochs on its training samples, the base is averaged with n_j
weights and every client is evaluated on its own test split. The plain loop is what one writes
without the emulator: a model copy per client, a DataLoader over a TensorDataset, a dict average.

    python benchmarks/emulator.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import main, table, write_json
from torch.utils.data import DataLoader, TensorDataset

from fedper.emulate.data import DataConfig, load_fleet_data
from fedper.emulate.fleet import Fleet, FleetConfig, resolve_device
from fedper.models import build_model


def plain_fedper(fleet: Fleet, rounds: int) -> float:
    """Seconds for `rounds` of FedPer written the ordinary way (no emulator code on the hot path)."""
    cfg, data = fleet.config, fleet.data
    shared_names = set(fleet.shared_names)
    global_model = build_model(cfg.model, len(data.classes), cfg.width, data.input_size).to(data.x.device)
    clients = [copy.deepcopy(global_model) for _ in data.clients]
    start = time.perf_counter()
    for _ in range(rounds):
        states, sizes = [], []
        for model, (train_idx, _) in zip(clients, data.clients, strict=True):
            model.load_state_dict({n: global_model.state_dict()[n] for n in shared_names}, strict=False)
            loader = DataLoader(TensorDataset(data.x[train_idx], data.y[train_idx]), batch_size=cfg.batch_size,
                                shuffle=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
            model.train()
            for _ in range(cfg.local_epochs):
                for xb, yb in loader:
                    loss = F.cross_entropy(model(xb), yb)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            states.append(model.state_dict())
            sizes.append(len(train_idx))
        average = {n: sum(s[n].double() * k for s, k in zip(states, sizes, strict=True)) / sum(sizes)
                   for n in shared_names}
        global_model.load_state_dict({n: v.float() for n, v in average.items()}, strict=False)
        with torch.no_grad():
            for model, (_, test_idx) in zip(clients, data.clients, strict=True):
                model.load_state_dict({n: global_model.state_dict()[n] for n in shared_names}, strict=False)
                model.eval()
                (model(data.x[test_idx]).argmax(1) == data.y[test_idx]).float().mean()
    return time.perf_counter() - start


def emulator(fleet: Fleet, rounds: int) -> float:
    state = fleet.init()
    start = time.perf_counter()
    for _ in range(rounds):
        state, _ = fleet.run_round(state)
    return time.perf_counter() - start


def run(out: Path, quick: bool = False) -> str:
    clients, rounds, repeats, input_size, scale = (5, 1, 1, 16, 0.2) if quick else (5, 3, 3, 32, 1.0)
    local_epochs, batch_size, width = 1, 32, 0.25
    device = resolve_device("auto")
    data = load_fleet_data(DataConfig(clients=clients, input_size=input_size, scale=scale), device)
    samples = sum(data.n_train) * local_epochs * rounds
    config = FleetConfig(width=width, kp=2, local_epochs=local_epochs, batch_size=batch_size, lr=0.01)
    engines = ["sequential", "vmap"]
    fleets = {e: Fleet(dataclasses.replace(config, engine=e), data) for e in engines}
    best: dict[str, float] = {}
    for _ in range(repeats):  # alternate, so load from other processes hits every contender alike
        plain = plain_fedper(fleets["sequential"], rounds)
        best["plain PyTorch loop"] = min(best.get("plain PyTorch loop", plain), plain)
        for e in engines:
            seconds = emulator(fleets[e], rounds)
            best[f"emulator ({e})"] = min(best.get(f"emulator ({e})", seconds), seconds)
    baseline = samples / best["plain PyTorch loop"]
    rows = [{"name": n, "seconds": s, "samples_per_s": samples / s, "ratio_vs_plain": samples / s / baseline}
            for n, s in best.items()]
    setup = (f"{samples} training samples ({clients} clients, rounds: {rounds}, MobileNet-v1 x{width}, "
             f"{input_size}px, B={batch_size}) on {device}, best of {repeats} alternating repeats")
    write_json(out, "emulator", {"setup": setup, "device": str(device), "threads": torch.get_num_threads(),
                                 "torch": torch.__version__, "training_samples": samples, "rows": rows})
    return setup + "\n\n" + table(["contender", "seconds", "samples/s", "vs plain"],
                                   [[r["name"], r["seconds"], r["samples_per_s"], r["ratio_vs_plain"]] for r in rows])


if __name__ == "__main__":
    main(run, __doc__, quick="a fifth of the samples at 16x16, one round, one repeat")
