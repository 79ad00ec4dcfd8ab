"""Emulator samples/s against a plain sequential PyTorch FedPer loop doing the same work, same run.

Same data (scikit-learn digits, partitioned by the emulator), same model, same rounds: each round
every client trains its local epochs on its training samples, the base is averaged with n_j
weights and every client is evaluated on its own test split. The plain loop is what one writes
without the emulator: a model copy per client, a DataLoader over a TensorDataset, a dict average.

    python benchmarks/emulator.py --out benchmarks/emulator.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time

import torch
import torch.nn.functional as F
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="alternating repeats; the best time of each is kept")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    device = resolve_device(a.device)
    data = load_fleet_data(DataConfig(clients=a.clients, input_size=a.input_size), device)
    samples = sum(data.n_train) * a.local_epochs * a.rounds
    config = FleetConfig(width=a.width, kp=2, local_epochs=a.local_epochs, batch_size=a.batch_size, lr=0.01)
    engines = ["sequential", "vmap"]
    fleets = {e: Fleet(FleetConfig(**{**config.__dict__, "engine": e}), data) for e in engines}
    best: dict[str, float] = {}
    for _ in range(a.repeats):  # alternate, so load from other processes hits every contender alike
        plain = plain_fedper(fleets["sequential"], a.rounds)
        best["plain PyTorch loop"] = min(best.get("plain PyTorch loop", plain), plain)
        for e in engines:
            seconds = emulator(fleets[e], a.rounds)
            best[f"emulator ({e})"] = min(best.get(f"emulator ({e})", seconds), seconds)
    baseline = samples / best["plain PyTorch loop"]
    rows = [{"name": n, "seconds": s, "samples_per_s": samples / s, "ratio_vs_plain": samples / s / baseline}
            for n, s in best.items()]
    print(f"{samples} training samples ({a.clients} clients, {a.rounds} rounds, MobileNet-v1 x{a.width}, "
          f"{a.input_size}px) on {device}")
    print(f"{'contender':<24}{'seconds':>10}{'samples/s':>12}{'vs plain':>10}")
    for r in rows:
        print(f"{r['name']:<24}{r['seconds']:>10.2f}{r['samples_per_s']:>12.1f}{r['ratio_vs_plain']:>9.2f}x")
    if a.out:
        result = {"device": str(device), "threads": torch.get_num_threads(), "machine": platform.processor(),
                  "torch": torch.__version__, "args": vars(a), "training_samples": samples, "rows": rows}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
