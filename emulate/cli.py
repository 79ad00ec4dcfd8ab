"""fedper-emulate: the paper's algorithms on an emulated fleet in one process (GPU when present)."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from fedper.emulate.experiment import RunConfig

app = typer.Typer(help="Emulate a FedPer fleet in one process: runs, and the paper's figures.", no_args_is_help=True,
                  rich_markup_mode=None)  # plain help: option names whole at 80 columns


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def given_options(ctx: typer.Context) -> set[str]:
    """The options the user set (on the command line or through the environment), not left at their default."""
    return {name for name in ctx.params
            if (source := ctx.get_parameter_source(name)) is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")}


# run's options named otherwise in RunConfig
CONFIG_FIELDS = {"dp_adaptive_clipping": "dp_adaptive_quantile"}
# what --resume takes from the command line; every other setting is the saved run's
RESUME_APPLIES = {"rounds", "out", "resume", "progress", "world_size"}


def _flat(config: RunConfig) -> dict[str, Any]:
    return ({f"data.{k}": v for k, v in asdict(config.data).items()}
            | {f"fleet.{k}": v for k, v in asdict(config.fleet).items()} | {"device": config.device})


def resume_notes(saved: RunConfig, asked: RunConfig, given: set[str]) -> list[str]:
    """A line for each option given with --resume whose value differs from the saved run's: that one applies."""
    new, old = _flat(asked), _flat(saved)
    notes = []
    for option in sorted(given - RESUME_APPLIES):
        field = CONFIG_FIELDS.get(option, option)
        path = next((p for p in (f"data.{field}", f"fleet.{field}", field) if p in new and new[p] != old[p]), None)
        if path is not None:
            notes.append(f"--{option.replace('_', '-')} {new[path]} does not apply: the resumed run keeps its saved "
                         f"{field} {old[path]} (config.json); only --rounds changes on --resume")
    return notes


def run_config(options: dict[str, Any]) -> RunConfig:
    """The RunConfig of `run`'s options (their values by parameter name): run's and sweep's."""
    from fedper.algorithms import get_algorithm
    from fedper.emulate.data import PAPER_BATCH, PAPER_CLIENTS, DataConfig
    from fedper.emulate.experiment import RunConfig
    from fedper.emulate.fleet import FleetConfig
    from fedper.schedule import parse_milestones

    o = SimpleNamespace(**options)
    kp = o.kp
    if kp is None:
        kp = get_algorithm(o.algorithm).default_kp
    return RunConfig(
        data=DataConfig(
            dataset=o.dataset, data=str(o.data) if o.data else None,
            clients=o.clients if o.clients is not None else PAPER_CLIENTS.get(o.dataset, 10),
            classes_per_client=o.classes_per_client, partition=o.partition, shards=o.shards, alpha=o.alpha,
            input_size=o.input_size, scale=o.scale, seed=o.seed,
        ),
        fleet=FleetConfig(
            model=o.model, width=o.width, algorithm=o.algorithm, kp=kp, local_epochs=o.local_epochs,
            batch_size=o.batch_size or PAPER_BATCH.get(o.dataset, 128), lr=o.lr, momentum=o.momentum, seed=o.seed,
            eval_finetune_epochs=o.eval_finetune_epochs, eval_finetune=o.eval_finetune, engine=o.engine,
            channels_last=o.channels_last, precision=o.precision, cuda_channels_last=o.cuda_channels_last,
            eval_finetune_every_algorithm=o.eval_finetune_every_algorithm,
            eval_finetune_interval=o.eval_finetune_interval, lr_decay=o.lr_decay,
            lr_milestones=parse_milestones(o.lr_milestones),
            clients_per_round=o.clients_per_round, bn=o.bn, clip_norm=o.clip_norm,
            dp_noise_multiplier=o.dp_noise_multiplier, dp_delta=o.dp_delta, dp_target_epsilon=o.dp_target_epsilon,
            dp_budget_action=o.dp_budget_action, dp_adaptive_quantile=o.dp_adaptive_clipping,
        ),
        rounds=max(1, round(o.rounds * o.scale)),  # --scale shrinks the rounds too, never to none
        device=o.device, init=str(o.init) if getattr(o, "init", None) else None,
    )


@app.command()
def run(
    ctx: typer.Context,
    dataset: str = typer.Option("digits", help="digits | cifar10 | cifar100 | npz | imagefolder | flickr-aes"),
    data: Path | None = typer.Option(None, help="Data path: CIFAR root, .npz file, image folder or FLICKR-AES root"),
    model: str = typer.Option(
        "mobilenet_v1", help="mobilenet_v1 | resnet34 | linear-mobilenet_v1 | linear-resnet34 (base replaced by one "
        "linear map under the original head blocks: figs 5-6, 9-10)"),
    width: float = typer.Option(1.0, help="Width multiplier of the model"),
    algorithm: str = typer.Option("fedper", help="fedavg | fedper | fedper-ft | fedbabu | fedrep | lg-fedavg | local "
                                   "(each client alone, the papers' local-only baseline)"),
    kp: int | None = typer.Option(None, help="K_P: head blocks counted from the output (default: the algorithm's "
                                              "paper: fedper, fedper-ft, lg-fedavg 2; fedbabu, fedrep 1; fedavg 0)"),
    clients: int | None = typer.Option(None, min=1, help="Number of clients N (default: 10, FLICKR-AES 30)"),
    classes_per_client: int = typer.Option(4, min=1, help="k: classes each client may sample (partition 'classes')"),
    partition: str = typer.Option("classes", help="classes (the paper's k-class split) | shards | dirichlet"),
    shards: int = typer.Option(2, min=1, help="Shards per client (partition 'shards')"),
    alpha: float = typer.Option(0.5, help="Dirichlet concentration (partition 'dirichlet')"),
    rounds: int = typer.Option(100, min=1, help="Communication rounds (with --resume: the saved run's unless given)"),
    local_epochs: int = typer.Option(4, min=1, help="Local epochs per round"),
    batch_size: int | None = typer.Option(None, min=1, help="Batch size (default: 128, FLICKR-AES 4)"),
    lr: float = typer.Option(0.01, help="SGD learning rate"),
    momentum: float = typer.Option(0.0, help="SGD momentum (the paper: none)"),
    eval_finetune_epochs: int = typer.Option(1, min=0, help="FedBABU: fine-tuning epochs before each evaluation"),
    eval_finetune: str = typer.Option("all", help="FedBABU: what evaluation fine-tunes, all (their paper) | head"),
    eval_finetune_every_algorithm: bool = typer.Option(
        False, help="Fine-tune every algorithm before its evaluation, as FedBABU's Algorithm 2 evaluates all of them "
                    "(metrics.jsonl keeps the accuracy before it as initial_accuracy)"),
    eval_finetune_interval: int = typer.Option(
        1, min=1, help="Fine-tune at evaluation only in the rounds that are multiples of this (the others report "
                       "the untuned model)"),
    lr_milestones: str = typer.Option("", help="Comma-separated rounds after which the lr is multiplied by --lr-decay "
                                               "(FedBABU: R/2,3R/4); default: a constant lr"),
    lr_decay: float = typer.Option(0.1, help="The lr factor at each of --lr-milestones"),
    seed: int = typer.Option(0, help="Seed of the partition, the initial model, every batch order and the "
                                     "client selection"),
    clients_per_round: int | None = typer.Option(
        None, min=1, help="M clients train per round (default: every client), chosen by the coordinator's rule "
                          "(fedper/selection.py; client j's id is \"j\", its --selection-seed is --seed); every "
                          "client is still evaluated each round. No --over-select: emulated clients never drop out"),
    bn: str = typer.Option("shared", help="BatchNorm policy: shared (averaged with their layer) | local (FedBN: every "
                                          "BatchNorm tensor stays on its client) | batch (FedBABU: evaluate with the "
                                          "test batch's statistics)"),
    clip_norm: float | None = typer.Option(
        None, min=0.0, help="Clip each update's L2 distance to the round model to this (with "
                            "--dp-noise-multiplier: DP's clip norm C, required), as the coordinator's."),
    dp_noise_multiplier: float | None = typer.Option(
        None, min=0.0, help="Differential privacy (docs/privacy.md): the coordinator's DP-FedAvg, Gaussian noise of "
                            "std z * --clip-norm on the sum of the clipped updates, epsilon in metrics.jsonl "
                            "(default: off). One process only."),
    dp_delta: float = typer.Option(1e-5, min=0.0, max=1.0, help="The delta epsilon is reported at (with "
                                   "--dp-noise-multiplier); keep it below 1 / --clients."),
    dp_target_epsilon: float | None = typer.Option(
        None, min=0.0, help="Privacy budget: before each round, the epsilon it would bring is checked against "
                            "this (default: no budget, epsilon only reported)."),
    dp_budget_action: str = typer.Option("stop", help="stop (end the run with the last round within budget) or "
                                         "warn (log and go on) at --dp-target-epsilon."),
    dp_adaptive_clipping: float | None = typer.Option(
        None, min=0.0, max=1.0, help="Adaptive clipping (Andrew et al. 2021): move the clip norm, starting at "
                                     "--clip-norm, toward this quantile of the update norms (e.g. 0.5)."),
    device: str = typer.Option("auto", help="auto (cuda when present, else cpu) | cpu | cuda | cuda:N"),
    engine: str = typer.Option("auto", help="auto (vmap on GPU, sequential on CPU) | sequential | vmap"),
    channels_last: bool = typer.Option(True, help="On CPU, train on batches in NHWC memory order (faster; the "
                                                  "same values to float32 rounding; not the vmap engine)"),
    precision: str = typer.Option("float32", help="float32 | bf16: forward and backward under bfloat16 autocast, "
                                                  "weights, SGD and BatchNorm statistics in float32 (for GPUs)"),
    cuda_channels_last: bool = typer.Option(False, help="On CUDA, train on batches in NHWC memory order too (both "
                                                        "engines; opt-in: not yet measured on a GPU)"),
    input_size: int | None = typer.Option(None, min=1, help="Image side in pixels (default: the data's; digits 32)"),
    scale: float = typer.Option(1.0, help="Fraction (<= 1) of the samples and rounds kept, for smoke runs"),
    out: Path = typer.Option(Path("runs/emulate"), help="Run directory: config.json, metrics.jsonl, "
                             "state.safetensors, and model.safetensors (the shared tensors) when it ends"),
    init: Path | None = typer.Option(None, help="Start from these weights (every client alike): a fedper-emulate "
                                     "run directory, torchvision's ResNet-34 file or this project's state_dict, as "
                                     "fedper-export --init takes them"),
    resume: bool = typer.Option(False, help="Continue the run in --out from its state.safetensors, with its saved "
                                            "settings (an option given that differs is named, not applied)"),
    progress: bool = typer.Option(True, help="Show progress: a bar in a terminal, else a line a round"),
    world_size: int = typer.Option(1, min=1, help="Spread the clients over this many local processes (gloo on CPU, "
                                                  "NCCL on GPUs); under torchrun leave it at 1"),
) -> None:
    """Run one experiment on an emulated fleet.

    Writes DIR/config.json, data.json, metrics.jsonl, summary.json and state.safetensors (DIR is --out).
    Under torchrun (WORLD_SIZE > 1) each process trains its share of the clients and rank 0 writes."""
    from fedper.data import DataError
    from fedper.emulate.experiment import (
        CONFIG,
        RunConfig,
        RunError,
        holds_run,
        run_experiment,
        run_launched,
        run_spawned,
    )

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    try:
        if not 0 < scale <= 1:
            raise ValueError(f"--scale must lie in (0, 1], got {scale}")
        if world_size < 1 or (launched and world_size > 1):
            raise ValueError("--world-size must be >= 1, and 1 under torchrun (which starts the processes itself)")
        if clients_per_round is not None and (launched or world_size > 1):
            raise ValueError("--clients-per-round runs in one process: drop --world-size (or torchrun) or it")
        if dp_noise_multiplier is not None and (launched or world_size > 1):
            raise ValueError("--dp-noise-multiplier runs in one process: drop --world-size (or torchrun) or it")
        config = run_config(ctx.params)
        if resume and holds_run(out) and (out / CONFIG).is_file():
            saved = RunConfig.from_json((out / CONFIG).read_text())
            given = given_options(ctx)
            if rank == 0:
                for note in resume_notes(saved, config, given):
                    typer.echo(f"note: {note}", err=True)
            if "rounds" in given:  # before the saved run's --scale, as when it started
                saved = replace(saved, rounds=max(1, round(rounds * saved.data.scale)))
            config = saved
            if rank == 0:
                typer.echo(f"resuming {out} to round {config.rounds}", err=True)
        options = {"resume": resume, "show_progress": progress}
        if launched:
            summary = run_launched(config, out, **options)
        elif world_size > 1:
            summary = run_spawned(world_size, config, out, **options)
        else:
            summary = run_experiment(config, out, **options)
    except KeyboardInterrupt:
        _fail(f"interrupted; the last finished round is saved in {out}, continue with --resume", 130)
    except (ValueError, DataError, RunError, OSError) as e:
        if rank:  # every rank meets the same error; rank 0 reports it
            raise typer.Exit(2) from None
        _fail(str(e))
    if rank:
        return
    weights = summary.get("weights")
    if weights is not None:
        typer.echo(f"weights from {weights['name']} (sha256 {weights['sha256'][:16]}..., {weights['format']})"
                   + "".join(f"; {note}" for note in weights["notes"]), err=True)
    dp = summary.get("dp")
    spent = ""
    if dp is not None:
        spent = (f", epsilon {dp['epsilon']:.4g} at delta {dp['delta']:g}" if dp["epsilon"] is not None
                 else ", epsilon unbounded (noise multiplier 0)")
    typer.echo(
        f"{summary['algorithm']} K_P={summary['kp']}: mean accuracy {summary['final_mean_accuracy']:.4f} "
        f"(std {summary['final_std_accuracy']:.4f}) after {summary['rounds']} rounds{spent}"
        f"{' (stopped at the privacy budget)' if dp and dp['budget_stopped'] else ''}, {summary['wall_s']:.1f} s; "
        f"results in {out}"
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sweep(
    ctx: typer.Context,
    seeds: str = typer.Option("0", help="Comma-separated seeds (each run's --seed)"),
    k: str = typer.Option("", help="Comma-separated k (--classes-per-client); default: run's"),
    lr: str = typer.Option("", help="Comma-separated learning rates (--lr); default: run's"),
    algorithms: str = typer.Option("", help="Comma-separated algorithms (--algorithm); default: run's"),
    out: Path = typer.Option(Path("runs/sweep"), help="Folder of the runs: OUT/ALGORITHM-kK-lrLR-seedS"),
    memory_gib: float | None = typer.Option(None, min=0.0, help="Memory a stacked step may take, in GiB (default: "
                                            "70 % of the GPU's free memory, or of the host's); more is cut in chunks"),
    progress: bool = typer.Option(True, help="Show each run's progress: bars in a terminal, else a line a round"),
) -> None:
    """Run every combination of --seeds, --k, --lr and --algorithms, stacked in one process.

    Any other option is run's, for every run: fedper-emulate sweep --seeds 0,1,2 --k 4,8 --rounds 20 --width 0.25.
    Runs that share an architecture train as rows of one batched step (fedper/emulate/stacked.py), each with its
    own partition, seed, lr, algorithm and aggregation; each run's directory is as `run` writes it. A finished
    run is reused and an interrupted one resumed."""
    import itertools

    from fedper.data import DataError
    from fedper.emulate.experiment import RunError, run_stacked
    from fedper.emulate.figure_runs import finished_run, resumable_run
    from fedper.emulate.progress import Board

    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    axes = {"--seed": seeds, "--classes-per-client": k, "--lr": lr, "--algorithm": algorithms}
    values = {option: [v.strip() for v in given.split(",") if v.strip()] or [None] for option, given in axes.items()}
    try:
        pending = []
        for combination in itertools.product(*values.values()):
            chosen = {o: v for o, v in zip(values, combination, strict=True) if v is not None}
            args = [*ctx.args, *(a for o, v in chosen.items() for a in (o, v))]
            config = run_config(command.make_context("run", args).params)
            f = config.fleet
            run_dir = out / f"{f.algorithm}-k{config.data.classes_per_client}-lr{f.lr:g}-seed{f.seed}"
            if not finished_run(run_dir, config):
                pending.append((config, run_dir, resumable_run(run_dir, config), run_dir.name))
        budget = None if memory_gib is None else int(memory_gib * 2**30)
        with Board(progress) as board:
            summaries = run_stacked(pending, report=board.report, budget=budget)
    except KeyboardInterrupt:
        _fail(f"interrupted; finished rounds are kept under {out}, run the same command to continue", 130)
    except typer.TyperException as e:  # run's parser refused one of the options
        _fail(e.format_message() if hasattr(e, "format_message") else str(e))
    except (ValueError, DataError, RunError, OSError) as e:
        _fail(str(e))
    for (_, run_dir, _, _), summary in zip(pending, summaries, strict=True):
        typer.echo(f"{run_dir}: mean accuracy {summary['final_mean_accuracy']:.4f} after {summary['rounds']} rounds")
    typer.echo(f"{len(pending)} runs stacked ({len(values['--seed'])} seeds); results in {out}")


@app.command()
def figure(
    name: str = typer.Argument(
        ..., help="fig2 | fig3 | fig4 | fig5-6 | fig7-8 | fig9-10 | fig11-12 | a3 | babu | dp | bn | async "
                  "(synchronous and asynchronous FedPer on a simulated clock)"),
    preset: str | None = typer.Option(None, help="smoke: MobileNet-v1 x0.25 on 5% of CIFAR-10 for 20 rounds; "
                                                 "digits: the same training on digits, 15 rounds, a few minutes "
                                                 "(fedper.emulate.figures.PRESETS); options given here win"),
    scale: float | None = typer.Option(None, help="Fraction (<= 1) of the samples and rounds kept, for smoke runs "
                                                  "(default 1)"),
    data: Path | None = typer.Option(None, help="Data for the figure: a CIFAR root, an .npz, an image folder or a "
                                                "FLICKR-AES root"),
    dataset: str | None = typer.Option(None, help="Override the figure's dataset (e.g. digits, npz)"),
    rounds: int | None = typer.Option(None, min=1, help="Rounds before --scale (default: the paper's 100; babu "
                                      "FedBABU's 320 / local epochs, lr x0.1 after half and three quarters of them)"),
    width: float | None = typer.Option(None, help="Width multiplier (default 1.0)"),
    local_epochs: int | None = typer.Option(None, min=1, help="Local epochs (default 4)"),
    batch_size: int | None = typer.Option(None, min=1, help="Batch size (default 128; FLICKR-AES 4; babu 50)"),
    lr: float | None = typer.Option(None, help="SGD learning rate (default 0.01; babu 0.1)"),
    momentum: float | None = typer.Option(None, help="SGD momentum (default 0; babu 0.9)"),
    eval_finetune_epochs: int | None = typer.Option(None, min=0, help="Fine-tuning epochs before an evaluation "
                                                    "(FedBABU, and babu's every algorithm; default 1, babu 5)"),
    clients: int | None = typer.Option(None, min=1, help="Clients (default 10; FLICKR-AES 30; babu 100)"),
    classes_per_client: int | None = typer.Option(None, min=1, help="k for the figures with one k (default 4)"),
    shards: int | None = typer.Option(None, min=1, help="Shards per client of babu's shard split (default: "
                                                        "FedBABU's 10)"),
    clients_per_round: int | None = typer.Option(None, min=1, help="M clients trained per round (default: every "
                                                 "client; babu sets its own)"),
    clip_norm: float | None = typer.Option(None, min=0.0, help="dp: the clip norm C of its DP runs (default 1.0; "
                                           "about the median update norm)"),
    dp_delta: float | None = typer.Option(None, min=0.0, max=1.0, help="dp: the delta epsilon is reported at "
                                          "(default 1e-5)"),
    input_size: int | None = typer.Option(None, min=1, help="Image side in pixels (default: the data's)"),
    seed: int = typer.Option(0, help="Seed of every run"),
    model: list[str] | None = typer.Option(None, metavar="MODEL", help="Only the curves of this model (repeatable)"),
    device: str = typer.Option("auto", help="auto (cuda when present, else cpu) | cpu | cuda"),
    precision: str | None = typer.Option(None, help="float32 (default) | bf16: every run under bfloat16 autocast, "
                                                    "weights, SGD and BatchNorm statistics in float32"),
    out: Path = typer.Option(Path("runs/figures"), help="Folder for the runs; the PNG is OUT/NAME.png"),
    progress: bool = typer.Option(True, help="Show each run's progress: bars in a terminal, else a line a round"),
    jobs: int = typer.Option(1, min=1, help="Runs at a time, each in its own single-threaded process (CPU: up to "
                                            "one per core)"),
    stack: bool | None = typer.Option(None, "--stack/--no-stack", help="Train the figure's runs stacked, as rows "
                                      "of one batched step in one process (default: on a GPU; --jobs then unused)"),
    trace: Path | None = typer.Option(None, help="async: device trace, FedScale's format as JSON (default: the "
                                                 "shipped synthetic one)"),
    concurrency: int | None = typer.Option(None, min=1, help="async: devices training at once (default: every "
                                                             "device)"),
    buffer_size: int | None = typer.Option(None, min=1, help="async: K, deltas per released version (default 5)"),
    max_staleness: int | None = typer.Option(None, min=0, help="async: refuse deltas more versions old than this "
                                                               "(default 20)"),
    over_select: float | None = typer.Option(None, min=1.0, help="async, synchronous curves: invite ceil(F * M) "
                                                                 "devices a round, close at M (default 1)"),
    deadline: float | None = typer.Option(None, min=0.0, help="async, synchronous curves: close a round after this "
                                                              "many simulated seconds once it has an update"),
) -> None:
    """Draw one of the papers' figures from a grid of runs.

    Finished runs are reused and interrupted ones resumed; the PNG is OUT/NAME.png."""
    from fedper.data import DataError
    from fedper.emulate.experiment import RunError
    from fedper.emulate.figures import make_figure, with_preset

    fleet = {"width": width, "local_epochs": local_epochs, "batch_size": batch_size, "lr": lr, "momentum": momentum,
             "eval_finetune_epochs": eval_finetune_epochs,
             "clients_per_round": clients_per_round, "clip_norm": clip_norm, "dp_delta": dp_delta,
             "precision": precision}
    data_opts = {"clients": clients, "classes_per_client": classes_per_client, "shards": shards,
                 "input_size": input_size}
    clock = {"trace": str(trace) if trace else None, "concurrency": concurrency, "buffer_size": buffer_size,
             "max_staleness": max_staleness, "over_select": over_select, "deadline_s": deadline}
    try:
        chosen = with_preset(preset, {"scale": scale, "rounds": rounds, "model": model or None, "dataset": dataset}
                             | fleet | data_opts)
        scale = 1.0 if chosen["scale"] is None else chosen["scale"]
        if not 0 < scale <= 1:
            raise ValueError(f"--scale must lie in (0, 1], got {scale}")
        png = make_figure(
            name, out=out, scale=scale, data=data, dataset=chosen["dataset"], device=device, rounds=chosen["rounds"],
            fleet_overrides={k: chosen[k] for k in fleet if chosen[k] is not None} | {"seed": seed},
            data_overrides={k: chosen[k] for k in data_opts if chosen[k] is not None} | {"seed": seed},
            models=tuple(chosen["model"] or ()), show_progress=progress, jobs=jobs,
            clock_overrides={k: v for k, v in clock.items() if v is not None}, stack=stack,
        )
    except KeyboardInterrupt:
        _fail(f"interrupted; finished rounds are kept under {out}, run the same command to continue", 130)
    except (ValueError, DataError, RunError, OSError) as e:
        _fail(str(e))
    typer.echo(f"wrote {png}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
