"""The paper's figures as named grids of runs, drawn to PNG with matplotlib.

Each curve is one run directory under OUT/NAME/; a finished run is reused and an interrupted one
resumed, so re-running a figure command continues where it stopped. --scale shrinks rounds and
data; the other overrides (width, epochs, input size, ...) make smoke runs fit on a small CPU.
"""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedper.algorithms import get_algorithm
from fedper.data import DataError
from fedper.data.sources import DATASET_NAMES
from fedper.emulate.data import PAPER_BATCH, PAPER_CLIENTS, DataConfig, client_split, read_source
from fedper.emulate.drawing import chance_legend, draw_chance, integer_rounds, pyplot, save
from fedper.emulate.experiment import RunConfig, run_experiment, run_stacked
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
from fedper.emulate.fleet import FleetConfig, resolve_device
from fedper.emulate.variants import LINEAR_PREFIX
from fedper.manifest import BN_POLICIES

MODELS = ("mobilenet_v1", "resnet34")


@dataclass(frozen=True)
class Curve:
    panel: str
    label: str
    data: DataConfig
    fleet: FleetConfig
    fraction: float | None = None  # FedBABU's f: max(1, round(f * N)) clients train per round; None: all


@dataclass(frozen=True)
class Spec:
    title: str
    dataset: str  # the paper's dataset for this figure
    curves: tuple[Curve, ...]
    band: bool = False  # shade the per-client spread (min..max) around the mean
    also_on: tuple[str, ...] = ()  # the paper's other datasets for this figure: --dataset picks them, not substitutes
    plot: str = "rounds"  # "rounds": accuracy per round in each panel; "epsilon": accuracy against DP's epsilon
    step_decay: bool = False  # FedBABU's schedule: lr x0.1 after half and after three quarters of the rounds
    seeds: int = 1  # runs per curve (seeds --seed, --seed + 1, ...): drawn as their mean, the band their min..max


def _alg(fleet: FleetConfig, algorithm: str, kp: int | None = None) -> FleetConfig:
    """`kp` None: the head of the algorithm's paper (registry default_kp); FedAvg is always K_P=0."""
    chosen = get_algorithm(algorithm)
    return replace(fleet, algorithm=algorithm, kp=0 if chosen.requires_kp0 else (kp or chosen.default_kp))


NOISE_MULTIPLIERS = (0.0, 0.5, 1.0, 2.0)  # figure dp's DP-FedAvg runs, beside a non-private one


def _private(fleet: FleetConfig, z: float | None) -> FleetConfig:
    """`fleet` under DP-FedAvg with noise multiplier `z` (clip norm and the other DP options as given), or with
    every privacy option off for `z` None."""
    if z is None:
        return replace(fleet, clip_norm=None, dp_noise_multiplier=None, dp_target_epsilon=None,
                       dp_adaptive_quantile=None)
    return replace(fleet, dp_noise_multiplier=z)


def _specs(data: DataConfig, fleet: FleetConfig) -> dict[str, Spec]:
    """Every figure from a base data and fleet config (the paper's settings unless overridden)."""
    def vs(models, ks, algorithms, kp=None, d=data, model_in_label=False):
        return tuple(
            Curve(f"{m}, k={k}" if len(ks) > 1 else m, a if not model_in_label else f"{a} ({m})",
                  replace(d, classes_per_client=k), _alg(replace(fleet, model=m), a, kp))
            for m in models for k in ks for a in algorithms
        )

    def linear_vs(models, d=data):
        """Figs. 5-6 and 9-10: FedPer on each model, and on the same model with its base replaced by a
        linear one (emulate/variants.py), the head blocks kept."""
        return tuple(
            Curve(m, label, d, _alg(replace(fleet, model=variant), "fedper"))
            for m in models for variant, label in ((m, "FedPer"), (f"{LINEAR_PREFIX}{m}", "FedPer, linear base"))
        )

    k = data.classes_per_client
    babu = ("fedavg", "fedper", "fedbabu", "fedrep", "lg-fedavg")
    return {
        "fig2": Spec("FedAvg vs FedPer (CIFAR-10)", "cifar10", vs(MODELS, (4, 8, 10), ("fedavg", "fedper"))),
        "fig3": Spec("Per-client accuracy spread", "cifar10", vs(MODELS[:1], (k,), ("fedavg", "fedper")), band=True),
        "fig4": Spec("FedPer with K_P = 1..4 (CIFAR-10)", "cifar10", tuple(
            Curve(m, f"K_P={kp}", data, replace(fleet, model=m, algorithm="fedper", kp=kp))
            for m in MODELS for kp in (1, 2, 3, 4)
        )),
        "fig5-6": Spec("FedPer, base replaced by a linear one (CIFAR-100)", "cifar100", linear_vs(MODELS)),
        "fig7-8": Spec("FLICKR-AES", "flickr-aes", vs(MODELS, (k,), ("fedavg", "fedper"))),
        "fig9-10": Spec("FedPer, base replaced by a linear one (FLICKR-AES)", "flickr-aes", linear_vs(MODELS)),
        "fig11-12": Spec("FedAvg vs FedPer (CIFAR-100)", "cifar100", vs(MODELS, (40, 80, 100), ("fedavg", "fedper"))),
        "a3": Spec("Head fine-tuning (appendix A.3)", "cifar100", vs(MODELS, (k,), ("fedper", "fedper-ft")),
                   also_on=("flickr-aes",)),
        "dp": Spec("Personalized accuracy against privacy spent (DP-FedAvg)", "cifar10", tuple(
            Curve("", f"{a}, " + ("non-private" if z is None else f"z = {z:g}"), data, _private(_alg(fleet, a), z))
            for a in ("fedavg", "fedper") for z in (None, *NOISE_MULTIPLIERS)
        ), plot="epsilon"),
        "bn": Spec("BatchNorm policy: shared, local (FedBN), batch statistics at test (FedBABU)", "cifar10", tuple(
            Curve(a, f"--bn {bn}", data, replace(_alg(fleet, a), bn=bn)) for a in ("fedper", "fedavg")
            for bn in BN_POLICIES
        ), band=True, seeds=3),
        "babu": Spec("FedBABU setting (CIFAR-100, shards, client fraction f)", "cifar100", step_decay=True,
                     curves=(
            *(Curve(f"f = {f}", a, data, _alg(replace(fleet, model=MODELS[0]), a, 1), fraction=f)
              for f in (0.1, 1.0) for a in babu),
            # local-only at f = 1.0 alone: each client trains in every round, alone, for the whole run
            Curve("f = 1.0", "local", data, _alg(replace(fleet, model=MODELS[0]), "local"), fraction=1.0),
        )),
    }


FIGURES = ("fig2", "fig3", "fig4", "fig5-6", "fig7-8", "fig9-10", "fig11-12", "a3", "babu", "dp", "bn")
CLOCKED_FIGURE = "async"  # on a simulated clock, not a grid of rounds: emulate/async_figure.py
# A figure's own data settings, under the command's overrides: FedBABU's 100 clients x 10 shards.
DATA_DEFAULTS = {"babu": {"clients": 100, "partition": "shards", "shards": 10}}
# A figure's own fleet settings, under the command's overrides: dp's clip norm (tune it to the update norms) and
# evaluation with batch statistics (DP releases no BatchNorm statistics, docs/privacy.md: with running ones every
# served model would normalize with the initial model's, a loss that no noise explains);
# babu's are FedBABU's (their scripts/run_*.sh: lr 0.1, momentum 0.9, batch 50; 5 fine-tuning epochs), every
# algorithm fine-tuned before its evaluation (their Algorithm 2), and tau = 4 local epochs of their 1 / 4 / 10.
FLEET_DEFAULTS = {
    "dp": {"clip_norm": 1.0, "bn": "batch"},
    "babu": {"lr": 0.1, "momentum": 0.9, "batch_size": 50, "local_epochs": 4, "eval_finetune_epochs": 5,
             "eval_finetune_every_algorithm": True},
}
BABU_BUDGET = 320  # FedBABU's rounds x local epochs (320 x 1, 80 x 4, 32 x 10)
FINETUNED_EVALUATIONS = 8  # babu fine-tunes every client at about this many evaluations, the last round's included


# `--preset smoke`: fig2/fig3/... on real CIFAR-10 at 32x32, reduced so that a 2-core CPU runs a figure in
# about an hour; docs/reproducing.md states how far its final accuracies move across seeds. The keys are the
# figure command's options (scale 0.05: 250 training images per client of N = 10, and 400 x 0.05 = 20 rounds);
# an option given on the command line wins over the preset's. `--preset digits`: the same training on
# scikit-learn's digits (no download), 15 rounds: a figure in a few minutes on 2 cores (docs/quickstart.md), a
# check of the pipeline rather than of the paper.
PRESETS: dict[str, dict[str, object]] = {
    "smoke": {"model": ["mobilenet_v1"], "scale": 0.05, "rounds": 400, "width": 0.25, "local_epochs": 1,
              "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "digits": {"dataset": "digits", "model": ["mobilenet_v1"], "rounds": 15, "width": 0.25, "local_epochs": 1,
               "batch_size": 32, "lr": 0.05, "momentum": 0.9},
}


def with_preset(preset: str | None, options: dict[str, object]) -> dict[str, object]:
    """The command's options, each one it left unset (None) taken from `preset` when the preset names it."""
    if preset is None:
        return dict(options)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    unknown = set(PRESETS[preset]) - set(options)
    if unknown:
        raise ValueError(f"preset {preset} sets options this command lacks: {', '.join(sorted(unknown))}")
    return {k: PRESETS[preset].get(k) if v is None else v for k, v in options.items()}


def default_rounds(name: str, fleet: FleetConfig) -> int:
    """A figure's rounds before --scale: FedPer's 100, or for babu FedBABU's 320 / local epochs."""
    return max(1, BABU_BUDGET // fleet.local_epochs) if name == "babu" else 100


def fedbabu_schedule(fleet: FleetConfig, rounds: int) -> FleetConfig:
    """FedBABU's schedule over `rounds` (their main_fed.py: lr x0.1 once round R/2 and once round 3R/4 are
    done), unless the command set milestones, and fine-tuned evaluations every `interval` rounds, the
    interval the largest divisor of `rounds` up to rounds / FINETUNED_EVALUATIONS, so the last round has one."""
    milestones = fleet.lr_milestones or tuple(m for m in (rounds // 2, 3 * rounds // 4) if m >= 1)
    interval = max(d for d in range(1, max(1, rounds // FINETUNED_EVALUATIONS) + 1) if rounds % d == 0)
    return replace(fleet, lr_milestones=milestones, eval_finetune_interval=interval)


def make_figure(
    name: str,
    *,
    out: str | Path,
    scale: float = 1.0,
    data: str | Path | None = None,
    dataset: str | None = None,
    device: str = "auto",
    rounds: int | None = None,
    fleet_overrides: dict | None = None,
    data_overrides: dict | None = None,
    models: tuple[str, ...] = (),
    show_progress: bool = True,
    jobs: int = 1,
    clock_overrides: dict | None = None,
    stack: bool | None = None,
) -> Path:
    """Run (or reuse) every curve of figure `name` (only those of `models` when given) and write OUT/NAME.png
    (babu: OUT/babu-sS.png, S the shards per client); `rounds` None: the figure's (default_rounds).
    `jobs` > 1 runs that many curves at a time, each in its own single-threaded process. `clock_overrides`:
    figure async's ClockConfig fields (emulate/async_fleet.py). `stack`: train the runs stacked in one process
    (emulate/stacked.py); None: on a GPU (where the vmap engine runs), not on a CPU (where the sequential engine
    is faster, and `jobs` processes faster still)."""
    if name == CLOCKED_FIGURE and stack:
        raise ValueError("--stack: figure async runs on a simulated clock, one run at a time")
    if name == CLOCKED_FIGURE:
        from fedper.emulate.async_figure import make_async_figure

        return make_async_figure(out=out, scale=scale, data=data, dataset=dataset, device=device, rounds=rounds,
                                 fleet_overrides=fleet_overrides or {}, data_overrides=data_overrides or {},
                                 clock_overrides=clock_overrides or {}, models=models, show_progress=show_progress,
                                 jobs=jobs)
    if clock_overrides:
        options = ", ".join(f"--{k.removesuffix('_s').replace('_', '-')}" for k in clock_overrides)
        raise ValueError(f"{options}: for figure async only")
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}; choose one of {', '.join((*FIGURES, CLOCKED_FIGURE))}")
    base_data = DataConfig(scale=scale, **(DATA_DEFAULTS.get(name, {}) | (data_overrides or {})))
    base_fleet = FleetConfig(**(FLEET_DEFAULTS.get(name, {}) | (fleet_overrides or {})))
    spec = _specs(base_data, base_fleet)[name]
    rounds = max(1, round((default_rounds(name, base_fleet) if rounds is None else rounds) * scale))
    if models:
        kept = tuple(c for c in spec.curves if c.fleet.model.removeprefix(LINEAR_PREFIX) in models)
        spec = replace(spec, curves=kept)
        if not spec.curves:
            raise ValueError(f"figure {name} has no curve for model(s) {', '.join(models)}")
    chosen = dataset or spec.dataset
    needs_data(name, chosen, data)
    out = Path(out) / name
    run_dirs: list[Path] = []
    pending: list[Pending] = []
    curves = [(i, seeded) for i, curve in enumerate(spec.curves) for seeded in _seeded(curve, spec.seeds)]
    for i, curve in curves:
        # the paper's per-data-set settings, unless the command set them
        clients, batch = curve.data.clients, curve.fleet.batch_size
        if "clients" not in (data_overrides or {}):
            clients = PAPER_CLIENTS.get(chosen, clients)
        if "batch_size" not in (fleet_overrides or {}):
            batch = PAPER_BATCH.get(chosen, batch)
        cdata = replace(curve.data, dataset=chosen, data=str(data) if data else None, clients=clients)
        per_round = curve.fleet.clients_per_round if curve.fraction is None else max(1, round(curve.fraction * clients))
        fleet = replace(curve.fleet, batch_size=batch, clients_per_round=per_round)
        config = RunConfig(data=cdata, fleet=fedbabu_schedule(fleet, rounds) if spec.step_decay else fleet,
                           rounds=rounds, device=device)
        f = curve.fleet
        run_dir = out / f"{i:02d}-{f.model}-{f.algorithm}-k{cdata.classes_per_client}-kp{f.kp}"
        if cdata.partition == "shards":  # runs at other shards per client keep their own directories
            run_dir = run_dir.with_name(f"{run_dir.name}-s{cdata.shards}")
        if curve.fraction is not None:
            run_dir = run_dir.with_name(f"{run_dir.name}-f{curve.fraction}")
        if f.dp_noise_multiplier is not None:
            run_dir = run_dir.with_name(f"{run_dir.name}-z{f.dp_noise_multiplier:g}")
        if f.bn != "shared":
            run_dir = run_dir.with_name(f"{run_dir.name}-bn{f.bn}")
        if f.precision != "float32":  # beside the float32 runs, not over them
            run_dir = run_dir.with_name(f"{run_dir.name}-{f.precision}")
        if spec.seeds > 1:
            run_dir = run_dir.with_name(f"{run_dir.name}-seed{f.seed}")
        if not finished_run(run_dir, config):
            pending.append((config, run_dir, resumable_run(run_dir, config), _curve_label(curve, spec.seeds)))
        run_dirs.append(run_dir)
    _check_data(name, pending)  # every curve's split, before any of them trains
    start_over(pending)
    if stack is None:
        stack = resolve_device(device).type == "cuda"
    run_all(pending, jobs, show_progress, run_experiment, run_stacked if stack else None)
    runs = _over_seeds([(curve, read_history(run_dir), run_data_info(run_dir))
                        for (_, curve), run_dir in zip(curves, run_dirs, strict=True)], spec.seeds)
    png = out.parent / (f"{name}-s{base_data.shards}.png" if base_data.partition == "shards" else f"{name}.png")
    named = next((info["name"] for _, _, info in runs if info.get("name")), DATASET_NAMES.get(chosen, chosen))
    (_draw_epsilon if spec.plot == "epsilon" else _draw)(spec, runs, png, named)
    return png


def _curve_label(curve: Curve, seeds: int) -> str:
    label = f"{curve.panel}: {curve.label}" if curve.panel else curve.label
    return f"{label}, seed {curve.fleet.seed}" if seeds > 1 else label


def _check_data(name: str, pending: list[Pending]) -> None:
    """Split the data of every curve still to run, so that a setting that leaves a client without samples
    stops the command at once, naming the curve, instead of after the curves before it have trained."""
    sources: dict[tuple, Any] = {}
    for config, _, _, label in pending:
        d = config.data
        key = (d.dataset, d.data, d.input_size, d.clients, d.seed)  # what read_source depends on
        if key not in sources:
            sources[key] = read_source(d)
        try:
            client_split(d, sources[key])
        except DataError as e:
            raise DataError(f"figure {name}, curve {label}: {e}") from None


def _seeded(curve: Curve, seeds: int) -> list[Curve]:
    """`curve` once, or with `seeds` > 1 once per seed from its own on (the partition's and the fleet's)."""
    if seeds == 1:
        return [curve]
    return [replace(curve, data=replace(curve.data, seed=curve.data.seed + s),
                    fleet=replace(curve.fleet, seed=curve.fleet.seed + s)) for s in range(seeds)]


Run = tuple[Curve, list[dict], dict]  # a curve, its metrics per round, its data.json


def _over_seeds(runs: list[Run], seeds: int) -> list[Run]:
    """Each curve's `seeds` consecutive runs as one history: per round, the mean over seeds of the mean
    accuracy, and as `accuracy` each seed's mean accuracy (so the band is the spread over seeds); the chance
    line is the mean of the seeds' (each seed splits the data its own way)."""
    if seeds == 1:
        return runs
    merged = []
    for start in range(0, len(runs), seeds):
        group = runs[start : start + seeds]
        histories = [history for _, history, _ in group]
        chances = [info["chance_accuracy"] for _, _, info in group if "chance_accuracy" in info]
        info = group[0][2] | ({"chance_accuracy": statistics.fmean(chances)} if chances else {})
        merged.append((group[0][0], [
            {"round": rows[0]["round"], "mean_accuracy": statistics.fmean(m["mean_accuracy"] for m in rows),
             "accuracy": [m["mean_accuracy"] for m in rows]}
            for rows in zip(*histories, strict=False)
        ], info))
    return merged


def dataset_tag(spec: Spec, name: str) -> str:
    """The data a figure was drawn from (its real name: an .npz of CIFAR-10 is CIFAR-10), for its title:
    named a substitute when the paper has no such figure on it."""
    papers = [DATASET_NAMES.get(d, d) for d in (spec.dataset, *spec.also_on)]
    return name if name in papers else f"{name}, a substitute for {papers[0]}"


def _draw(spec: Spec, runs: list[Run], png: Path, dataset: str) -> None:
    panels = list(dict.fromkeys(curve.panel for curve, _, _ in runs))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, panel in zip(axes.flat, panels, strict=False):
        chances = False
        for curve, history, info in runs:
            if curve.panel != panel:
                continue
            x = [m["round"] for m in history]
            if any("mean_initial_accuracy" in m for m in history):  # fine-tuned at evaluation (FedBABU's Algorithm 2)
                (line,) = ax.plot(x, [m["mean_initial_accuracy"] for m in history], ls="--", lw=1)
                tuned = [m for m in history if m["finetuned"]]
                ax.plot([m["round"] for m in tuned], [m["mean_accuracy"] for m in tuned], "o-", ms=3,
                        color=line.get_color(), label=curve.label)
            else:
                (line,) = ax.plot(x, [m["mean_accuracy"] for m in history], label=curve.label)
            if spec.band:
                ax.fill_between(x, [min(m["accuracy"]) for m in history], [max(m["accuracy"]) for m in history],
                                color=line.get_color(), alpha=0.2)
            draw_chance(ax, info.get("chance_accuracy"), line.get_color())
            chances = chances or "chance_accuracy" in info
        finetuned = any("mean_initial_accuracy" in m for c, history, _ in runs if c.panel == panel for m in history)
        ax.set_title(f"{panel}; dashed: before fine-tuning" if finetuned else panel, fontsize=10)
        ax.set_xlabel("round")
        integer_rounds(ax)
        ax.grid(alpha=0.3)
        chance_legend(ax, chances)
    for ax in axes[:, 0]:
        ax.set_ylabel("mean test accuracy")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    title = f"{spec.title} [{dataset_tag(spec, dataset)}]"
    fig.suptitle("\n".join(textwrap.wrap(title, 45 * cols)), fontsize=11)  # one panel is too narrow for one line
    save(fig, png)


def _draw_epsilon(spec: Spec, runs: list[Run], png: Path, dataset: str) -> None:
    """Left: each algorithm's last-round mean accuracy against the epsilon its run spent (log scale), one point
    per noise multiplier; runs without a finite epsilon (non-private, z = 0) as horizontal lines. Right: the
    accuracy per round of every run, one colour per algorithm."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 3.8))
    algorithms = list(dict.fromkeys(curve.fleet.algorithm for curve, _, _ in runs))
    styles = ["-", "--", "-.", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (5, 5))]  # dotted is the chance line's
    noises = list(dict.fromkeys(curve.fleet.dp_noise_multiplier for curve, _, _ in runs))
    delta = next((c.fleet.dp_delta for c, _, _ in runs if c.fleet.dp_noise_multiplier is not None), None)
    chances = False
    for i, algorithm in enumerate(algorithms):
        colour = f"C{i}"
        points = []
        chance = next((info["chance_accuracy"] for c, _, info in runs
                       if c.fleet.algorithm == algorithm and "chance_accuracy" in info), None)
        for ax in (left, right):
            draw_chance(ax, chance, colour)
        chances = chances or chance is not None
        for curve, history, _ in runs:
            if curve.fleet.algorithm != algorithm or not history:
                continue
            z, accuracy = curve.fleet.dp_noise_multiplier, history[-1]["mean_accuracy"]
            epsilon = history[-1].get("dp", {}).get("epsilon")
            if epsilon is not None:
                points.append((epsilon, accuracy, z))
            else:
                left.axhline(accuracy, color=colour, ls="--" if z is None else "-.", lw=1,
                             label=curve.label + ("" if z is None else " (clipped, epsilon unbounded)"))
            right.plot([m["round"] for m in history], [m["mean_accuracy"] for m in history], color=colour,
                       ls=styles[noises.index(z) % len(styles)], label=curve.label)
        points.sort()
        if points:
            left.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colour, label=f"{algorithm}, DP")
            for epsilon, accuracy, z in points:
                left.annotate(f"z={z:g}", (epsilon, accuracy), xytext=(3, 3), textcoords="offset points", fontsize=7)
    left.set_xscale("log")
    private = next((c for c, _, _ in runs if c.fleet.dp_noise_multiplier is not None), None)
    setting = "" if private is None else (f"clip norm {private.fleet.clip_norm:g}, "
                                          f"{private.fleet.clients_per_round or private.data.clients} of "
                                          f"{private.data.clients} clients a round, ")
    left.set_xlabel(setting + "epsilon spent" + (f" (delta {delta:g})" if delta is not None else ""))
    left.set_ylabel("mean personalized accuracy (last round)")
    right.set_xlabel("round")
    right.set_ylabel("mean test accuracy")
    integer_rounds(right)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        chance_legend(ax, chances)
    fig.suptitle(f"{spec.title} [{dataset_tag(spec, dataset)}]", fontsize=11)
    save(fig, png)
