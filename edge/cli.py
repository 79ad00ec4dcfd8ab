"""fedper-agent: take part in a FedPer fleet from this device."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import typer

from fedper.onecommand import OneCommand

app = typer.Typer(help="FedPer device agent: trains locally, sends the base, keeps the head on this device.",
                  rich_markup_mode=None, no_args_is_help=True, cls=OneCommand)


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    artifacts: Path = typer.Option(None, help="Export directory from fedper-export (checked against its manifest)."),
    data: Path = typer.Option(None, help="Local data: an image folder (train/<class>/*, optional test/) or an .npz."),
    broker: str = typer.Option(None, help="Broker URL, mqtt://host:1883 or mqtts://host:8883."),
    fleet: str = typer.Option(None, help="Fleet name: topics live under fedper/v1/<fleet>/."),
    client_id: str = typer.Option(None, help="This device's id, stable across restarts."),
    state_dir: Path = typer.Option(None, help="Where the head, the data split and the last round survive restarts."),
    local_epochs: int = typer.Option(1, min=1, help="Local epochs per round (E)."),
    batch_size: int = typer.Option(32, min=1, help="Local batch size (B)."),
    lr: float = typer.Option(0.01, min=0.0, help="SGD learning rate (eta)."),
    fine_tune_head: bool = typer.Option(False, help="Train the head alone for one epoch before the base + head."),
    eval_finetune_epochs: int = typer.Option(
        1, min=0, help="FedBABU: fine-tune a copy for this many epochs before each evaluation and serve it "
        "(their Algorithm 2; fedper-emulate's default); the next round trains the untuned model. 0: serve the "
        "frozen head."),
    eval_finetune: str = typer.Option("all", help="FedBABU: what that fine-tune trains: all (their paper) or head."),
    backend: str = typer.Option("auto", help="Local training runtime: ort (onnxruntime-training), torch, or auto: "
                                "ort where onnxruntime-training is installed, else torch (the first line says which)."),
    device: str = typer.Option("auto", help="Where the torch backend trains: cuda (a Jetson's GPU), cpu, or auto: "
                               "cuda where torch sees a GPU, else cpu (the first line says which). The ort backend "
                               "trains on the CPU."),
    seed: int = typer.Option(
        0,
        help="Seed of the train/test split and of the batch order "
        "(fedper.batches; emulated client j uses client_seed(run_seed, j)).",
    ),
    username: str = typer.Option(None, help="Broker user name."),
    password: str = typer.Option(None, help="Broker password.", envvar="FEDPER_MQTT_PASSWORD"),
    tls_ca: Path = typer.Option(None, help="CA certificate (PEM) to verify the broker with; implies TLS."),
    mqtt_version: str = typer.Option("5", help="MQTT protocol: 5 or 3.1.1."),
    chunk_size: int = typer.Option(63 * 1024, min=1, help="Bytes of tensor data per MQTT message."),
    compression: str = typer.Option("fp32", help="Update codec: fp32, fp16 (half the bytes), int8 (a quarter), "
                                    "int8-delta (a quarter, quantizing the change from the round's model: "
                                    "far less error than int8 late in training) or int8-delta-pc (int8-delta "
                                    "with a grid per output channel: less error still, 8 bytes more a channel) or "
                                    "int8-delta-rot (int8-delta-pc's bytes, each channel rotated and on a curved "
                                    "grid: the least error, twice its CPU)."),
    only_when: list[str] = typer.Option(
        [], help="Take part in a round only when this holds (repeatable, all must hold): power (on external "
        "power; no battery counts as on power), battery>=N (percent), idle>=F (CPU idle share over half a second, "
        "0..1) or command:CMD (sh -c CMD exits 0 within 10 s). Checked once per round; while not eligible the "
        "device says offline and checks again after --recheck-seconds."),
    recheck_seconds: float = typer.Option(60.0, min=1.0, help="While not eligible, check --only-when again "
                                          "after this long (and at every RoundInfo or invitation)."),
    secure_aggregation: bool = typer.Option(
        False, help="Never send the update in the clear: take part only in secure aggregation (SecAgg+, "
                    "docs/privacy.md), which the coordinator's --secure-aggregation runs. Without this flag the "
                    "device still takes part in it whenever the coordinator asks."),
    identity: Path = typer.Option(
        None, help="Secure aggregation: the directory holding this device's identity (identity.pem, identity.cert, "
                   "fleet-root.pub; deploy/provision-identity.sh writes it). Without it the device takes no part in "
                   "secure aggregation."),
    reconnect_spread: float = typer.Option(30.0, min=0.0, help="After losing the broker, reconnect at a random "
                                           "moment within this many seconds, so a fleet does not come back at "
                                           "once; then full-jitter backoff up to 60 s."),
    keep_updates: bool = typer.Option(
        False, help="Also keep a copy of every round's update (the shared tensors this device trained and sent, "
                    "before any clipping, masking or compression) as STATE_DIR/updates/r<round>.safetensors, for an "
                    "audit of what the coordinator released (benchmarks/chaos_check.py reads them). They stay on "
                    "the device, private as its head; without the flag only the last round's is kept."),
    skip_unreadable_images: bool = typer.Option(
        False, help="Leave out the image files in --data that cannot be decoded (counted and named at start) "
                    "instead of stopping at the first one."),
) -> None:
    """Train rounds until the coordinator announces the final model; resumes from --state-dir.
    `fedper-agent predict IMAGE... --state-dir DIR` classifies images with the device's personal model."""
    if ctx.invoked_subcommand is not None:
        return
    missing = [f"--{name.replace('_', '-')}" for name, value in (
        ("artifacts", artifacts), ("data", data), ("broker", broker), ("fleet", fleet), ("client_id", client_id),
        ("state_dir", state_dir)) if value is None]
    if missing:
        typer.echo(f"fedper-agent: missing option(s) {', '.join(missing)}", err=True)
        raise typer.Exit(2)
    from fedper.compression import check_codec
    from fedper.data import DataError, UnreadableImage, skipping_unreadable_images
    from fedper.edge.agent import Agent, AgentConfig
    from fedper.edge.backend import choose_backend
    from fedper.edge.engine import AgentError
    from fedper.edge.service import run_agent
    from fedper.edge.state import StateError
    from fedper.manifest import ManifestError
    from fedper.mqtt import BrokerRefused
    from fedper.wire import WireError

    config = AgentConfig(
        artifacts=artifacts, data=data, broker=broker, fleet=fleet, client_id=client_id, state_dir=state_dir,
        local_epochs=local_epochs, batch_size=batch_size, lr=lr, fine_tune_head=fine_tune_head, backend=backend,
        eval_finetune_epochs=eval_finetune_epochs, eval_finetune=eval_finetune,
        seed=seed, username=username, password=password, tls_ca=str(tls_ca) if tls_ca else None,
        mqtt_version=mqtt_version, chunk_size=chunk_size, compression=compression, only_when=tuple(only_when),
        recheck_s=recheck_seconds, reconnect_spread_s=reconnect_spread, secure_aggregation=secure_aggregation,
        identity=identity, keep_updates=keep_updates,
    )
    try:
        _check_data(data)  # before the backend's line: a wrong path is answered in one line
        from fedper.edge.torch_backend import DEVICES, torch_device

        if device not in DEVICES:
            raise ValueError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
        runtime, line = choose_backend(backend)
        where = "cpu"
        if runtime == "torch":
            where, place = torch_device(device)
            line = f"{line} {place}"
        elif device == "cuda":
            raise ValueError(f"--device cuda trains with the torch backend; this is {runtime} (--backend {backend}): "
                             "add --backend torch")
        typer.echo(f"fedper-agent: {line}", err=True)
        config = replace(config, backend=runtime, device=where)
        check_codec(compression)
        with skipping_unreadable_images() if skip_unreadable_images else nullcontext([]) as skipped:
            agent = Agent(config, log=lambda line: typer.echo(line, err=True))
        if skipped:
            names = ", ".join(str(p.relative_to(data)) for p in skipped[:5])
            typer.echo(f"fedper-agent: left out {len(skipped)} unreadable image(s) under {data}: {names}"
                       f"{' ...' if len(skipped) > 5 else ''}", err=True)
        run_agent(agent)
    except UnreadableImage as e:
        typer.echo(f"fedper-agent: {e}; --skip-unreadable-images leaves such files out (and counts them)", err=True)
        raise typer.Exit(2) from None
    except (AgentError, BrokerRefused, DataError, ManifestError, StateError, WireError, ValueError, OSError) as e:
        typer.echo(f"fedper-agent: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: the state is saved, run the same command to rejoin", err=True)
        raise typer.Exit(130) from None


@app.command()
def predict(
    images: list[Path] = typer.Argument(..., help="Image files to classify (resized as training images are)."),
    state_dir: Path = typer.Option(..., help="The agent's --state-dir: it holds personal.onnx and personal.json."),
    top: int = typer.Option(3, min=1, help="How many classes to print per image, most probable first."),
) -> None:
    """Classify images with this device's personal model (its last served base and head) under onnxruntime."""
    from fedper.data import DataError
    from fedper.edge.personal import predict as classify
    from fedper.edge.personal import top_classes

    try:
        info, logits = classify(state_dir, images)
    except (DataError, ValueError, OSError) as e:
        typer.echo(f"fedper-agent predict: {e}", err=True)
        raise typer.Exit(2) from None
    accuracy = info.get("accuracy")
    typer.echo(f"personal model of round {info['round']}{' (final)' if info.get('final') else ''}: accuracy "
               f"{'unmeasured' if accuracy is None else f'{100 * accuracy:.0f} %'} on its test images "
               f"({info['chance']})")
    for path, best in zip(images, top_classes(logits, info["classes"], top), strict=True):
        typer.echo(f"{path}: " + ", ".join(f"{name} {100 * p:.1f} %" for name, p in best))


def _check_data(data: Path) -> None:
    """--data names a folder or an .npz that exists (said before the artifacts and the runtime are loaded)."""
    if not data.exists():
        raise ValueError(f"--data {data} does not exist")
    if data.is_file() and data.suffix != ".npz":
        raise ValueError(f"--data {data} is a file, and not an .npz: give an image folder (<class>/* images, or "
                         "train/ and test/ holding them) or an .npz with x_train and y_train")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
