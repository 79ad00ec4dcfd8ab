"""fedper-export: build ONNX Runtime training artifacts with the head marked device-local, and check them."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Export MobileNet-v1 / ResNet-34 cut at K_P head blocks as onnxruntime-training artifacts "
    "with a manifest marking every tensor base (shared) or head (device-local).",
    no_args_is_help=True,
)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _require_export_runtime() -> None:
    """The gradient graphs come from onnxruntime-training and the graph from torch.onnx.export(dynamo=False),
    which torch >= 2.4 has: where either is missing, say so in one line (exit 2) rather than in a traceback."""
    try:
        import onnxruntime.training  # noqa: F401
    except ImportError:
        from fedper.artifacts import ORT_WHEELS

        typer.echo(f"error: fedper-export needs onnxruntime-training, which is not installed ({ORT_WHEELS}): "
                   "export there; devices without it train the artifacts with fedper-agent's torch backend", err=True)
        raise typer.Exit(2) from None
    import torch

    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 4):
        typer.echo(f"error: fedper-export needs torch >= 2.4 (torch.onnx.export's dynamo option); this is torch "
                   f"{torch.__version__} (2.2.2 is the last build for Intel Macs): export on another machine", err=True)
        raise typer.Exit(2)


@app.callback(invoke_without_command=True)
def export(
    ctx: typer.Context,
    model: str = typer.Option(None, "--model", help="Architecture: mobilenet_v1 or resnet34."),
    kp: int = typer.Option(
        None, "--kp", help="Head blocks counted from the output (1 = classifier only; 0 = FedAvg). Default: the "
        "algorithm's paper: fedper, fedper-ft, lg-fedavg 2; fedbabu, fedrep 1; fedavg 0."),
    num_classes: int = typer.Option(None, "--num-classes", min=1, help="Number of output classes."),
    input_size: int = typer.Option(32, "--input-size", min=32, help="Input size in pixels: 32 (CIFAR) or 224."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier (MobileNet-v1's alpha)."),
    algorithm: str = typer.Option(
        "fedper", "--algorithm",
        help="fedavg, fedper, fedper-ft, fedbabu, fedrep or lg-fedavg: decides what is shared "
        "(local, which shares nothing, runs in fedper-emulate only)."
    ),
    classes: str = typer.Option("", "--classes", help="Comma-separated class names, in label order (optional)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights (every device must start from the same)."),
    ort_format: bool = typer.Option(False, "--ort-format", help="Also write .ort files for ORT mobile builds."),
    graph: str = typer.Option(
        "stock", "--graph", help="stock: torch.onnx's ops. fast: small depthwise convolutions as MatMul and ReLU as "
        "Clip, same weights; ORT trains MobileNet-v1 ~1.6-1.9x faster on CPU (docs/performance.md)."),
    bn: str = typer.Option(
        "shared", "--bn", help="BatchNorm policy: shared (BatchNorm tensors follow their layer's role), local (FedBN: "
        "every BatchNorm tensor stays on the device, never sent), batch (FedBABU: evaluate and serve with the "
        "batch's own statistics; the eval graphs carry no running statistics)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    init: Path = typer.Option(
        None, "--init", help="Start from these weights instead of --seed's: torchvision's ResNet-34 file as "
        "published, a state_dict of this project's model (torch.save or safetensors), or a fedper-emulate run "
        "directory. Read as tensors only; the classifier is re-initialized for another class count."),
    out: Path = typer.Option(None, "--out", help="Output directory (created; written atomically)."),
) -> None:
    """Export training artifacts (the default command): see the options below."""
    if ctx.invoked_subcommand is not None:
        return
    missing = [flag for flag, value in (("--model", model), ("--num-classes", num_classes), ("--out", out))
               if value is None]
    if missing:
        _fail(f"missing option(s) {', '.join(missing)}")
    _require_export_runtime()
    from rich.progress import Progress

    from fedper.algorithms import federated_algorithm
    from fedper.export.exporter import export_artifacts

    names = tuple(name.strip() for name in classes.split(",") if name.strip())
    try:
        if kp is None:
            kp = federated_algorithm(algorithm).default_kp
        with Progress(transient=True) as bar:
            task = bar.add_task("exporting", total=None)
            manifest = export_artifacts(
                out, model=model, kp=kp, num_classes=num_classes, input_size=input_size, width=width,
                algorithm=algorithm, seed=seed, classes=names, ort_format=ort_format, graph=graph, bn=bn, force=force,
                init=init,
                progress=lambda what, done, total: bar.update(task, description=what, completed=done, total=total),
            )
    except (ValueError, OSError) as e:
        _fail(str(e))
    from fedper.verify import summary

    weights = manifest.weights
    if "sha256" in weights:
        typer.echo(f"weights from {weights['name']} (sha256 {weights['sha256'][:16]}..., {weights['format']})")
        for note in weights["notes"]:
            typer.echo(note)
    typer.echo(f"wrote {out}\n{summary(manifest, out)}")


@app.command()
def verify(directory: Path = typer.Argument(..., help="An export directory (holds manifest.json).")) -> None:
    """Check an export directory against its manifest: checksums, tensor names, shapes, roles, digest."""
    from fedper.manifest import Manifest, ManifestError
    from fedper.verify import summary
    from fedper.verify import verify as check

    try:
        Manifest.load(directory)
    except ManifestError as e:  # no export there at all (no folder, no manifest): one line, not a list of mismatches
        _fail(str(e))
    problems = check(directory)
    if problems:
        for line in problems:
            typer.echo(f"MISMATCH: {line}", err=True)
        _fail(f"{directory} does not match its manifest ({len(problems)} problem(s))")
    typer.echo(f"OK {directory}\n{summary(Manifest.load(directory), directory)}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
