"""`fedper demo`: the whole system on one machine, FedPer against FedAvg, as real processes.

It exports artifacts, starts the embedded broker (in this process, so it outlives the
coordinator and every agent hears the final model), then for each algorithm a coordinator and N
agents as separate processes on a non-IID split, and finally prints a per-device table and
writes a plot. Child processes are killed on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from fedper.algorithms import get_algorithm
from fedper.emulate.progress import Board
from fedper.ports import free_port

console = Console(stderr=True)


@dataclass
class Device:
    name: str
    data: Path
    classes: list[str]
    n_train: int
    y_test: np.ndarray


def load_dataset(dataset: str, data: Path | None):
    """The zero-download default is scikit-learn's digits; CIFAR-10 from an .npz, an image folder or a
    torchvision root, by what --data is."""
    from fedper.data import load_digits, load_images

    if dataset == "digits":
        return load_digits(image_size=32).train
    if dataset == "cifar10":
        if data is None:
            raise typer.BadParameter("--dataset cifar10 needs --data (an .npz, an image folder or a CIFAR-10 root)")
        return load_images(data, cifar="cifar10", image_size=32).train
    raise typer.BadParameter(f"unknown dataset {dataset!r}: digits or cifar10")


def at_most(train, count: int, seed: int):
    """A random `count` of the images (all of them when fewer), in their original order."""
    if len(train) <= count:
        return train
    return train.subset(np.sort(np.random.default_rng(seed).choice(len(train), count, replace=False)))


def split_classes(train, base_classes: int):
    """The first `base_classes` classes for pretraining the base, the others (labels from 0) for the fleet,
    so the fleet meets classes its warm start never saw."""
    from fedper.data import ArrayDataset

    if not 0 < base_classes < len(train.classes) - 1:
        raise typer.BadParameter(f"--pretrain-classes must leave the fleet two classes or more: give 1.."
                                 f"{len(train.classes) - 2} for {len(train.classes)} classes")
    held = train.y < base_classes
    return (ArrayDataset(train.x[held], train.y[held], train.classes[:base_classes]),
            ArrayDataset(train.x[~held], train.y[~held] - base_classes, train.classes[base_classes:]))


def pretrain(base, out: Path, opts: dict, procs: Processes, board: Board) -> Path:
    """Train the whole model on `base` in the emulator as a fleet of one (FedAvg over one client is plain
    training), 10 % held out for its accuracy; returns the run folder, which `--init` takes."""
    from fedper.emulate.experiment import METRICS

    folder = out / "pretrain"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    test = np.random.default_rng(opts["seed"]).random(len(base)) < 0.1
    data = folder / "base.npz"
    np.savez(data, x_train=base.x[~test], y_train=base.y[~test], x_test=base.x[test], y_test=base.y[test],
             classes=np.array(base.classes))
    epochs = opts["pretrain_epochs"]
    run = folder / "run"
    proc = procs.start("pretraining", [
        "emulate", "run", "--dataset", "npz", "--data", str(data), "--model", "mobilenet_v1", "--width",
        str(opts["width"]), "--algorithm", "fedavg", "--clients", "1", "--classes-per-client", str(len(base.classes)),
        "--rounds", str(epochs), "--local-epochs", "1", "--batch-size", "64", "--lr", str(opts["pretrain_lr"]),
        "--momentum", "0.9", "--seed", str(opts["seed"]), "--device", "cpu", "--no-progress", "--out", str(run)],
        folder / "pretrain.log")
    key = f"pretraining on {len(base.classes)} classes"
    follow(proc, run / METRICS, "mean_accuracy", key, epochs, procs, board)
    return run


def follow(proc: subprocess.Popen, metrics_file: Path, field: str, key: str, rounds: int, procs: Processes,
           board: Board, others: tuple[subprocess.Popen, ...] = ()) -> None:
    """Report each line `proc` appends to its metrics file until it and `others` have exited."""
    done, since = 0, time.monotonic()
    board.report({"event": "start", "run": key, "label": key, "rounds": rounds, "done": 0})
    while proc.poll() is None or any(p.poll() is None for p in others):
        procs.check()
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        for line in lines[done:]:
            record = json.loads(line)
            board.report({"event": "round", "run": key, "round": record["round"], "rounds": rounds,
                          "accuracy": record[field], "wall_s": time.monotonic() - since})
            done, since = done + 1, time.monotonic()
        time.sleep(0.5)
    procs.check()
    board.report({"event": "end", "run": key})


def write_devices(train, n: int, k: int, seed: int, folder: Path) -> list[Device]:
    """The paper's split: each device at most k classes, its own 80/20 train/test with the same classes."""
    from fedper.data import split_k_classes, split_train_test

    folder.mkdir(parents=True, exist_ok=True)
    parts = split_train_test(split_k_classes(train.y, n, k, seed), train.y, 0.2, seed)
    devices = []
    for i, (tr, te) in enumerate(parts):
        path = folder / f"dev-{i}.npz"
        np.savez(path, x_train=train.x[tr], y_train=train.y[tr], x_test=train.x[te], y_test=train.y[te],
                 classes=np.array(train.classes))
        held = [train.classes[c] for c in sorted(set(train.y[tr]))]
        devices.append(Device(f"dev-{i}", path, held, len(tr), train.y[te]))
    return devices


class Processes:
    """Children in their own sessions, so Ctrl-C reaches only us and we decide how they end."""

    def __init__(self) -> None:
        self.running: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fedper.cli", *args], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append((name, proc, log))
        return proc

    def check(self) -> None:
        for name, proc, log in self.running:
            if proc.poll() not in (None, 0):
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{name} exited with {proc.returncode}; the end of {log}:\n{tail}")

    def stop_all(self) -> None:
        for _, proc, _ in self.running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, proc, _ in self.running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.running.clear()


def run_fleet(name: str, algorithm: str, kp: int, devices: list[Device], classes: list[str], out: Path, port: int,
              opts: dict, procs: Processes, board: Board, init: Path | None = None) -> dict:
    """One federated run through real processes, from `init`'s weights or the seeded random ones; returns
    per-round means and per-device final accuracy."""
    from fedper.export.exporter import export_artifacts

    folder = out / name
    artifacts = folder / "artifacts"
    export_artifacts(artifacts, model="mobilenet_v1", kp=kp, num_classes=len(classes), input_size=32,
                     width=opts["width"], algorithm=algorithm, seed=opts["seed"], classes=classes, force=True,
                     init=init)
    key = f"{NAMES[name]} (K_P={kp})"
    state = folder / "coordinator"
    for previous in (state, folder / "agents"):  # a demo starts afresh: an earlier run's state would resume
        shutil.rmtree(previous, ignore_errors=True)
    broker = f"mqtt://127.0.0.1:{port}"
    fleet = f"demo-{name}-{os.getpid()}"
    coordinator = procs.start("coordinator", [
        "coordinator", "--artifacts", str(artifacts), "--fleet", fleet, "--rounds", str(opts["rounds"]),
        "--min-clients", str(len(devices)), "--round-timeout", "600", "--state-dir", str(state),
        "--broker", broker, "--mqtt-version", "3.1.1"], folder / "coordinator.log")
    agents = [procs.start(d.name, [
        "agent", "--artifacts", str(artifacts), "--data", str(d.data), "--broker", broker, "--fleet", fleet,
        "--client-id", d.name, "--state-dir", str(folder / "agents" / d.name), "--local-epochs",
        str(opts["local_epochs"]), "--batch-size", str(opts["batch_size"]), "--lr", str(opts["lr"]),
        "--seed", str(opts["seed"]), "--mqtt-version", "3.1.1"], folder / f"{d.name}.log") for d in devices]
    metrics_file = state / "metrics.jsonl"  # a closed round: the devices measured the model served at its start
    follow(coordinator, metrics_file, "accuracy_mean", key, opts["rounds"], procs, board, tuple(agents))
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    final = {d.name: json.loads((folder / "agents" / d.name / "final.json").read_text())["accuracy"] for d in devices}
    return {"round_mean": [r["accuracy_mean"] for r in rounds], "final": final}


NAMES = {"fedper": "FedPer", "fedavg": "FedAvg", "warm": "FedPer, warm start", "cold": "FedPer, random start"}


def device_label(device: Device, dataset: str) -> str:
    """A bar's label: the device and the classes it holds, one class name a line (digits on one line)."""
    if dataset == "digits":
        return f"{device.name}\ndigits {', '.join(device.classes)}"
    return "\n".join([device.name, *device.classes])


def plot(results: dict[str, dict], devices: list[Device], classes: list[str], dataset: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedper.data import chance_accuracy
    from fedper.emulate.drawing import chance_legend, draw_chance, integer_rounds

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(11, 4.4))
    x = np.arange(len(devices))
    tests = [d.y_test for d in devices]
    for i, (offset, (name, result)) in enumerate(zip((-0.2, 0.2), results.items(), strict=True)):
        colour = f"C{i}"
        bars.bar(x + offset, [result["final"][d.name] for d in devices], 0.4, label=NAMES[name], color=colour)
        # Round k reports the model served after k-1 aggregations; the final evaluation closes the curve.
        means = [*result["round_mean"], float(np.mean(list(result["final"].values())))]
        curve.plot(range(len(means)), means, marker="o", label=NAMES[name], color=colour)
        # FedPer's head can learn each device's most frequent class; FedAvg's one model one class for all
        draw_chance(curve, chance_accuracy(tests, len(classes), personal=name != "fedavg"), colour)
    for i, d in enumerate(devices):  # what a head that learned only the device's label frequencies scores
        prior = chance_accuracy([d.y_test], len(classes), personal=True)
        bars.hlines(prior, i - 0.4, i + 0.4, colors="black", linestyles=":", lw=1.5)
    bars.set_xticks(x, [device_label(d, dataset) for d in devices], fontsize=9)
    bars.set(ylabel="personalized test accuracy", ylim=(0, 1), title="each device after the last round")
    curve.set(xlabel="aggregated rounds", ylabel="mean accuracy over devices", ylim=(0, 1),
              title="the model each device serves")
    integer_rounds(curve)
    chance_legend(bars, True, "black")
    chance_legend(curve, True)
    for ax in (bars, curve):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo(
    dataset: str = typer.Option("digits", help="digits (bundled with scikit-learn, no download) or cifar10."),
    data: Path = typer.Option(None, help="CIFAR-10 as an .npz (x_train, y_train, ...), an image folder or a root."),
    devices: int = typer.Option(4, min=2, help="Number of agents (separate processes)."),
    classes_per_device: int = typer.Option(3, min=1, help="Non-IID: at most this many classes per device."),
    rounds: int = typer.Option(10, min=1, help="Federated rounds for each algorithm."),
    local_epochs: int = typer.Option(1, min=1, help="Local epochs per round."),
    batch_size: int = typer.Option(32, min=2, help="Local batch size."),
    lr: float = typer.Option(0.05, min=0.0, help="SGD learning rate."),
    width: float = typer.Option(0.5, min=0.05, help="MobileNet-v1 width multiplier."),
    kp: int = typer.Option(get_algorithm("fedper").default_kp, min=1, max=4,
                           help="FedPer's head blocks K_P (FedAvg is K_P=0)."),
    max_samples: int = typer.Option(2000, min=10, help="Use at most this many images in all."),
    seed: int = typer.Option(0, help="Seed of the split, the weights and the batch order."),
    out: Path = typer.Option(Path("runs/demo"), help="Where logs, artifacts, results.json and demo.png go."),
    warm_start: bool = typer.Option(
        False, "--warm-start", help="Compare FedPer from a pretrained base with FedPer from random weights, "
        "instead of FedPer with FedAvg: the base is first trained in the emulator on the first "
        "--pretrain-classes classes, and the fleet gets only the other classes (--max-samples of them)."),
    pretrain_classes: int = typer.Option(6, min=1, help="--warm-start: classes, in label order, the base is "
                                                        "pretrained on; the fleet gets the rest."),
    pretrain_samples: int = typer.Option(6000, min=10, help="--warm-start: pretrain on at most this many images."),
    pretrain_epochs: int = typer.Option(3, min=1, help="--warm-start: pretraining epochs."),
    pretrain_lr: float = typer.Option(0.05, min=0.0, help="--warm-start: pretraining learning rate "
                                                           "(SGD, momentum 0.9, batch 64)."),
) -> None:
    """Run FedPer and then FedAvg (or, with --warm-start, FedPer from a pretrained base and from random weights)
    through a broker, a coordinator and real agents; compare per device."""
    from fedper.coordinator.broker import EmbeddedBroker
    from fedper.data import DataError

    opts = {"rounds": rounds, "local_epochs": local_epochs, "batch_size": batch_size, "lr": lr, "width": width,
            "seed": seed, "pretrain_epochs": pretrain_epochs, "pretrain_lr": pretrain_lr}
    try:
        train = load_dataset(dataset, data)
        if warm_start:
            base, train = split_classes(train, pretrain_classes)
            base = at_most(base, pretrain_samples, seed)
        train = at_most(train, max_samples, seed)
        fleet = write_devices(train, devices, classes_per_device, seed, out / "data")
    except DataError as e:
        console.print(f"[red]fedper demo:[/] {e}")
        raise typer.Exit(2) from None
    port = free_port()
    broker = EmbeddedBroker("127.0.0.1", port).start()
    procs = Processes()
    results: dict[str, dict] = {}
    started = time.monotonic()
    try:
        with Board() as board:
            runs: tuple[tuple[str, str, int, Path | None], ...] = (
                ("fedper", "fedper", kp, None), ("fedavg", "fedavg", 0, None))
            if warm_start:
                init = pretrain(base, out, opts, procs, board)
                procs.stop_all()
                runs = (("warm", "fedper", kp, init), ("cold", "fedper", kp, None))
            for name, algorithm, cut, start in runs:
                results[name] = run_fleet(name, algorithm, cut, fleet, train.classes, out, port, opts, procs, board,
                                          start)
                procs.stop_all()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        raise typer.Exit(130) from None
    except RuntimeError as e:
        console.print(f"[red]fedper demo failed:[/] {e}")
        raise typer.Exit(1) from None
    finally:
        procs.stop_all()
        broker.stop()

    from fedper.data import chance_accuracy, chance_words

    table = Table(title=f"personalized accuracy after {rounds} rounds ({dataset}, {devices} devices)")
    for column in ("device", "classes", "train images", *(NAMES[name] for name in results), "chance"):
        table.add_column(column, justify="left" if column in ("device", "classes") else "right")
    chances = [chance_accuracy([d.y_test], len(train.classes), personal=True) for d in fleet]
    for d, chance in zip(fleet, chances, strict=True):
        table.add_row(d.name, ",".join(d.classes), str(d.n_train),
                      *(f"{results[a]['final'][d.name]:.3f}" for a in results), f"{chance:.3f}")
    table.add_row("mean", "", "", *(f"{np.mean(list(results[a]['final'].values())):.3f}" for a in results),
                  f"{np.mean(chances):.3f}")
    Console().print(table)
    if warm_start:
        summary = json.loads((out / "pretrain" / "run" / "summary.json").read_text())
        Console().print(f"warm start: MobileNet-v1 pretrained on {', '.join(base.classes)} ({len(base)} images, "
                        f"{pretrain_epochs} epochs; {summary['final_mean_accuracy']:.3f} on its held-out 10 %); "
                        f"the fleet holds only {', '.join(train.classes)}")
    Console().print("chance: what guessing scores on each device's test images, by always answering its most "
                    "frequent class (1/k for k balanced classes):")
    for d in fleet:
        Console().print(f"  {d.name}: {chance_words(d.y_test)}")
    plot(results, fleet, train.classes, dataset, out / "demo.png")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out / 'demo.png'} and {out / 'results.json'} in {time.monotonic() - started:.0f} s")
