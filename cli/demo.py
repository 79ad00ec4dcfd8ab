"""`fedper demo`: the whole system on one machine, FedPer against FedAvg, as real processes.

It exports artifacts, starts the embedded broker (in this process, so it outlives the
coordinator and every agent hears the final model), then for each algorithm a coordinator and N
agents as separate processes on a non-IID split, and finally prints a per-device table and
writes a plot. Child processes are killed on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
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
    page: bool = False  # the web agent's page in a headless chromium, not a fedper-agent


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


def write_devices(train, n: int, k: int, seed: int, folder: Path, page: bool = False) -> list[Device]:
    """The paper's split: each device at most k classes, its own 80/20 train/test with the same classes; with
    `page`, the last device is the web agent's page."""
    from fedper.data import split_k_classes, split_train_test

    folder.mkdir(parents=True, exist_ok=True)
    parts = split_train_test(split_k_classes(train.y, n, k, seed), train.y, 0.2, seed)
    devices = []
    for i, (tr, te) in enumerate(parts):
        if page and i == n - 1:
            devices.append(write_page_images(train, np.concatenate([tr, te]), seed, folder / f"page-{i}"))
            continue
        path = folder / f"dev-{i}.npz"
        np.savez(path, x_train=train.x[tr], y_train=train.y[tr], x_test=train.x[te], y_test=train.y[te],
                 classes=np.array(train.classes))
        held = [train.classes[c] for c in sorted(set(train.y[tr]))]
        devices.append(Device(f"dev-{i}", path, held, len(tr), train.y[te]))
    return devices


def write_page_images(train, indices: np.ndarray, seed: int, folder: Path) -> Device:
    """The page's device: its images as PNG files in class folders, what a phone's file picker hands over. The page
    splits them itself (web/src/dataset.js: sorted by class name then file name, then fedper.data.split_train_test
    with its seed); the same split drawn here gives its test labels, hence its chance line."""
    from PIL import Image

    from fedper.data import split_train_test

    shutil.rmtree(folder, ignore_errors=True)
    order = sorted(indices, key=lambda i: (train.classes[train.y[i]], f"{i:05d}.png"))
    for i in order:
        (folder / train.classes[train.y[i]]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(train.x[i]).save(folder / train.classes[train.y[i]] / f"{i:05d}.png")
    labels = train.y[order]
    [(tr, te)] = split_train_test([np.arange(len(labels))], labels, 0.2, seed)
    held = [train.classes[c] for c in sorted(set(labels))]
    return Device(folder.name, folder, held, len(tr), labels[te], page=True)


def page_driver() -> tuple[Path | None, str]:
    """The browser tests' driver of the page (web/test/browser/drive.mjs: puppeteer-core and Debian's chromium), or
    None and why the page cannot take part here."""
    from fedper.web import web_root

    driver = web_root().parent / "test" / "browser" / "drive.mjs"
    chromium = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    if not chromium.is_file():
        return None, f"no chromium at {chromium} (make chromium, or CHROMIUM=PATH)"
    if shutil.which("node") is None:
        return None, "node is not installed"
    if not driver.is_file() or not (web_root().parent / "node_modules" / "puppeteer-core").is_dir():
        return None, "the page's driver (web/test/browser/drive.mjs, puppeteer-core) needs a checkout with make web"
    if not (web_root() / "index.html").is_file():
        return None, "the page is not built (make web)"
    return driver, ""


class Processes:
    """Children in their own sessions, so Ctrl-C reaches only us and we decide how they end."""

    def __init__(self) -> None:
        self.running: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], log: Path) -> subprocess.Popen:
        """A fedper command (`args` after `fedper`)."""
        return self.spawn(name, [sys.executable, "-m", "fedper.cli", *args], log)

    def spawn(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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


def wait_listening(port: int, proc: subprocess.Popen, procs: Processes, timeout: float = 120.0) -> None:
    """Until something accepts connections on 127.0.0.1:port (the coordinator's page server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator did not serve the page on port {port} in {timeout:.0f} s")


def page_accuracy(log: Path) -> float:
    """The page's final personalized accuracy, from the driver's JSON line (its last line)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": "the driver printed no result"}
    if "error" in result or result.get("final") is None:
        raise RuntimeError(f"the page did not finish: {result.get('error')}; its log: {result.get('log', [])[-5:]}")
    return float(result["final"])


def run_fleet(name: str, algorithm: str, kp: int, devices: list[Device], classes: list[str], out: Path, port: int,
              opts: dict, procs: Processes, board: Board, init: Path | None = None) -> dict:
    """One federated run through real processes, from `init`'s weights or the seeded random ones; returns
    per-round means and per-device final accuracy. The coordinator sends the training settings with each round
    (the page obeys them as the agents do); a page device joins through the coordinator's page server."""
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
    pages = [d for d in devices if d.page]
    web = ["--web-port", str(web_port := free_port()), "--web-host", "127.0.0.1", "--web-broker",
           f"ws://127.0.0.1:{opts['ws_port']}/"] if pages else []
    coordinator = procs.start("coordinator", [
        "coordinator", "--artifacts", str(artifacts), "--fleet", fleet, "--rounds", str(opts["rounds"]),
        "--min-clients", str(len(devices)), "--round-timeout", "600", "--state-dir", str(state),
        "--broker", broker, "--mqtt-version", "3.1.1", "--lr", str(opts["lr"]), "--local-epochs",
        str(opts["local_epochs"]), "--batch-size", str(opts["batch_size"]), *web], folder / "coordinator.log")
    agents = [procs.start(d.name, [
        "agent", "--artifacts", str(artifacts), "--data", str(d.data), "--broker", broker, "--fleet", fleet,
        "--client-id", d.name, "--state-dir", str(folder / "agents" / d.name), "--seed", str(opts["seed"]),
        "--mqtt-version", "3.1.1"], folder / f"{d.name}.log") for d in devices if not d.page]
    if pages:
        wait_listening(web_port, coordinator, procs)
        agents += [procs.spawn(d.name, [
            "node", str(opts["page_driver"]), f"http://127.0.0.1:{web_port}/?device={d.name}&seed={opts['seed']}",
            str(d.data), "0", str(PAGE_TIMEOUT_S)], folder / f"{d.name}.log") for d in pages]
    metrics_file = state / "metrics.jsonl"  # a closed round: the devices measured the model served at its start
    follow(coordinator, metrics_file, "accuracy_mean", key, opts["rounds"], procs, board, tuple(agents))
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    final = {d.name: page_accuracy(folder / f"{d.name}.log") if d.page else
             json.loads((folder / "agents" / d.name / "final.json").read_text())["accuracy"] for d in devices}
    return {"round_mean": [r["accuracy_mean"] for r in rounds], "final": final}


PAGE_TIMEOUT_S = 3600  # the driver's bound on the page's whole run
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
    # headroom above 1 for the legend in one row: "best" put it over the bar of the best device
    bars.set(ylabel="personalized test accuracy", ylim=(0, 1.18), yticks=np.linspace(0, 1, 6),
             title="each device after the last round")
    curve.set(xlabel="aggregated rounds", ylabel="mean accuracy over devices", ylim=(0, 1),
              title="the model each device serves")
    integer_rounds(curve)
    chance_legend(bars, True, "black", loc="upper center", ncol=3)
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
    pretrain_samples: int = typer.Option(12000, min=10, help="--warm-start: pretrain on at most this many images."),
    pretrain_epochs: int = typer.Option(4, min=1, help="--warm-start: pretraining epochs."),
    pretrain_lr: float = typer.Option(0.05, min=0.0, help="--warm-start: pretraining learning rate "
                                                           "(SGD, momentum 0.9, batch 64)."),
    base_model: Path = typer.Option(None, "--base", help="--warm-start: start the fleet from this base (an "
                                    "emulator run folder or a checkpoint: what fedper-export --init takes) instead "
                                    "of pretraining one; --pretrain-samples/-epochs/-lr then do nothing."),
    with_page: bool = typer.Option(
        False, "--with-page", help="The last device is the web agent's page, opened in a headless chromium (the "
        "browser tests' driver, web/test/browser/drive.mjs) and given its images through the file picker; "
        "without chromium, node or the built page it runs as a fedper-agent, and the demo says why."),
) -> None:
    """Run FedPer and then FedAvg (or, with --warm-start, FedPer from a pretrained base and from random weights)
    through a broker, a coordinator and real agents; compare per device."""
    from fedper.data import DataError

    for name, value in (("--lr", lr), ("--pretrain-lr", pretrain_lr)):
        if value <= 0:  # the coordinator refuses it too, but only after the demo has built and started everything
            raise typer.BadParameter(f"must be above 0, got {value}", param_hint=name)
    opts = {"rounds": rounds, "local_epochs": local_epochs, "batch_size": batch_size, "lr": lr, "width": width,
            "seed": seed, "pretrain_epochs": pretrain_epochs, "pretrain_lr": pretrain_lr, "ws_port": free_port()}
    if with_page:
        opts["page_driver"], missing = page_driver()
        if missing:
            console.print(f"[yellow]--with-page: {missing}; dev-{devices - 1} runs as a fedper-agent[/]")
            with_page = False
    try:
        train = load_dataset(dataset, data)
        if warm_start:
            base, train = split_classes(train, pretrain_classes)
            base = at_most(base, pretrain_samples, seed)
        train = at_most(train, max_samples, seed)
        fleet = write_devices(train, devices, classes_per_device, seed, out / "data", with_page)
    except DataError as e:
        console.print(f"[red]fedper demo:[/] {e}")
        raise typer.Exit(2) from None
    from fedper.coordinator.broker import EmbeddedBroker  # torch and the broker: after the input is checked
    from fedper.models.warm_start import CheckpointError

    port = free_port()
    broker = EmbeddedBroker("127.0.0.1", port, ws_port=opts["ws_port"] if with_page else None).start()
    procs = Processes()
    results: dict[str, dict] = {}
    started = time.monotonic()
    try:
        with Board() as board:
            runs: tuple[tuple[str, str, int, Path | None], ...] = (
                ("fedper", "fedper", kp, None), ("fedavg", "fedavg", 0, None))
            if warm_start:
                init = base_model or pretrain(base, out, opts, procs, board)
                procs.stop_all()
                runs = (("warm", "fedper", kp, init), ("cold", "fedper", kp, None))
            for name, algorithm, cut, start in runs:
                results[name] = run_fleet(name, algorithm, cut, fleet, train.classes, out, port, opts, procs, board,
                                          start)
                procs.stop_all()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        raise typer.Exit(130) from None
    except (RuntimeError, CheckpointError) as e:  # a --base that does not load: one line
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
    for d in fleet:
        if d.page:
            Console().print(f"{d.name} is the web agent's page in a headless chromium, its images from the file picker")
    if warm_start and base_model:
        Console().print(f"warm start: from {base_model}; the fleet holds only {', '.join(train.classes)}")
    elif warm_start:
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
