"""fedper-coordinator: the MQTT service that runs FedPer rounds for a fleet of devices."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from fedper.coordinator.engine import Coordinator
    from fedper.coordinator.metrics import CoordinatorMetrics
    from fedper.mqtt import BrokerUrl

app = typer.Typer(help="Run federated rounds over MQTT: register devices, aggregate base updates.",
                  no_args_is_help=True)


@app.callback(invoke_without_command=True)
def run(
    artifacts: Path = typer.Option(..., help="Export directory: manifest.json and base.safetensors."),
    fleet: str = typer.Option(..., help="Fleet name: topics live under fedper/v1/<fleet>/."),
    rounds: int = typer.Option(..., min=1, help="Number of rounds to run."),
    min_clients: int = typer.Option(1, min=1, help="Updates a round needs before its deadline may close it."),
    round_timeout: float = typer.Option(60.0, min=0.1, help="Seconds a round waits for its devices."),
    clients_per_round: int = typer.Option(
        None, min=1, help="M: a round closes at M accepted updates (or at its deadline with --min-clients) and "
                          "takes updates only from the devices it invited (default: every registered device)."),
    over_select: float = typer.Option(
        1.0, min=1.0, help="F: invite ceil(F * M) online devices per round, to absorb dropouts (with "
                           "--clients-per-round)."),
    selection_seed: int = typer.Option(None, min=0, help="Seed of the invitations' ranking (fedper/selection.py); "
                                       "default: a secret drawn at start (a chosen one is public, refused under DP)."),
    state_dir: Path = typer.Option(..., help="Checkpoints, metrics.jsonl and final.safetensors; resumed from."),
    broker: str = typer.Option("", help="External broker URL, mqtt://host:1883 or mqtts://host:8883."),
    embedded_broker: bool = typer.Option(False, help="Run amqtt's broker in this process on 127.0.0.1:--port."),
    port: int = typer.Option(1883, help="Port of the embedded broker."),
    mqtt_version: str = typer.Option("5", help="MQTT protocol: 5 or 3.1.1 (the embedded broker speaks 3.1.1)."),
    username: str = typer.Option(None, help="Broker user name."),
    password: str = typer.Option(None, help="Broker password.", envvar="FEDPER_MQTT_PASSWORD"),
    tls_ca: Path = typer.Option(None, help="CA certificate (PEM) to verify the broker with; implies TLS."),
    chunk_size: int = typer.Option(63 * 1024, min=1, help="Bytes of tensor data per MQTT message."),
    aggregator: str = typer.Option("mean", help="mean (n_j-weighted, streaming), median or trimmed-mean."),
    clip_norm: float = typer.Option(None, min=0.0, help="Clip each update's L2 distance to the model to this "
                                    "(with --dp-noise-multiplier: DP's clip norm C, required)."),
    dp_noise_multiplier: float = typer.Option(
        None, min=0.0, help="Differential privacy (docs/privacy.md): DP-FedAvg with Gaussian noise of std z * "
                            "--clip-norm on the sum of the clipped updates (default: off)."),
    dp_delta: float = typer.Option(1e-5, min=0.0, max=1.0, help="The delta epsilon is reported at (with "
                                   "--dp-noise-multiplier); keep it below 1 / (registered devices)."),
    dp_target_epsilon: float = typer.Option(
        None, min=0.0, help="Privacy budget: before each round, the epsilon it would bring is checked against "
                            "this (default: no budget, epsilon only reported)."),
    dp_budget_action: str = typer.Option("stop", help="stop (finish the run with the last model released "
                                         "within budget) or warn (log and go on) at --dp-target-epsilon."),
    dp_adaptive_clipping: float = typer.Option(
        None, min=0.0, max=1.0, help="Adaptive clipping (Andrew et al. 2021): move the clip norm, starting at "
                                     "--clip-norm, toward this quantile of the update norms (e.g. 0.5; default: "
                                     "a fixed clip norm)."),
    secure_aggregation: bool = typer.Option(
        False, help="Secure aggregation (SecAgg+, docs/privacy.md): the coordinator learns only the n_j-weighted "
                    "sum of the devices' deltas, each clipped on its device to --clip-norm (required). The agents "
                    "take part when RoundInfo asks; run them with --secure-aggregation to refuse clear updates. "
                    "With --dp-noise-multiplier the devices add the noise (distributed DP)."),
    secagg_stage_timeout: float = typer.Option(
        30.0, min=0.1, help="Seconds each secure-aggregation stage after the keys waits for the devices; those "
                            "that miss it have dropped out (the protocol recovers them)."),
    secagg_degree: int = typer.Option(
        None, min=2, help="Neighbours k (even) per device in secure aggregation (default 2*ceil(1.5*log2 n)): raise "
                          "it for heavy dropout (docs/privacy.md, 'Choosing k and t')."),
    max_samples_per_device: int = typer.Option(
        1_000_000, min=1, help="Largest n_samples a device may register (its weight in the mean); a registration "
                               "above is refused (too_many_samples)."),
    max_uploads_per_device: int = typer.Option(
        2, min=1, help="Partial uploads a device may have in flight; its newer one displaces its oldest."),
    max_upload_bytes_per_device: int = typer.Option(
        None, min=1, help="Bytes a device's partial uploads may hold (default: two updates of the model)."),
    max_reassembly_bytes: int = typer.Option(
        None, min=1, help="Bytes all partial uploads may hold; a newcomer beyond is refused (over_quota) "
                          "(default: 1 GiB, or 4 devices' quotas if more)."),
    max_messages_per_second: float = typer.Option(
        1000.0, min=0.001, help="Messages per device per second (bursts: 2 s' worth, or two updates' chunks); "
                                "more are dropped unread and counted (rate_limited)."),
    metrics_port: int = typer.Option(
        None, min=0, max=65535, help="Serve Prometheus metrics on this port (/metrics; default: off). Needs the "
                                     "coordinator extra (prometheus_client)."),
    metrics_host: str = typer.Option("127.0.0.1", help="Address the metrics endpoint listens on."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every accepted update."),
) -> None:
    """Serve rounds until --rounds are done; resumes from --state-dir after a restart."""
    from fedper.artifacts import BASE_FILE
    from fedper.coordinator.engine import AGGREGATORS, Config, Coordinator
    from fedper.coordinator.store import CheckpointError, Store
    from fedper.manifest import Manifest, ManifestError
    from fedper.mqtt import PROTOCOLS, BrokerRefused, BrokerUrl, parse_broker_url
    from fedper.payload import decode_shared
    from fedper.wire import Topics, WireError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("fedper.coordinator").setLevel(logging.DEBUG if verbose else logging.INFO)
    try:
        if embedded_broker == bool(broker):
            raise ValueError("give exactly one of --broker URL or --embedded-broker")
        if aggregator not in AGGREGATORS:
            raise ValueError(f"--aggregator {aggregator!r}: choose one of {', '.join(AGGREGATORS)}")
        if mqtt_version not in PROTOCOLS:
            raise ValueError(f"--mqtt-version {mqtt_version!r}: choose one of {', '.join(PROTOCOLS)}")
        manifest = Manifest.load(artifacts)
        base_path = artifacts / BASE_FILE
        if not base_path.exists():
            raise ValueError(f"no {BASE_FILE} in {artifacts}: is it an export directory?")
        initial = decode_shared(manifest, base_path.read_bytes())
        url = BrokerUrl("127.0.0.1", port, False) if embedded_broker else parse_broker_url(broker)
        config = Config(rounds, min_clients, round_timeout, chunk_size, aggregator, clip_norm,
                        max_samples_per_device=max_samples_per_device,
                        max_uploads_per_device=max_uploads_per_device,
                        max_upload_bytes_per_device=max_upload_bytes_per_device,
                        max_reassembly_bytes=max_reassembly_bytes, max_messages_per_second=max_messages_per_second,
                        clients_per_round=clients_per_round, over_select=over_select, selection_seed=selection_seed,
                        dp_noise_multiplier=dp_noise_multiplier, dp_delta=dp_delta,
                        dp_target_epsilon=dp_target_epsilon, dp_budget_action=dp_budget_action,
                        dp_adaptive_quantile=dp_adaptive_clipping, secure_aggregation=secure_aggregation,
                        secagg_stage_timeout=secagg_stage_timeout, secagg_degree=secagg_degree)
        coordinator = Coordinator(manifest, initial, Topics(fleet), config, Store(state_dir))
    except (ValueError, KeyError, OSError, ManifestError, WireError, CheckpointError) as e:
        typer.echo(f"fedper-coordinator: {e}", err=True)
        raise typer.Exit(2) from None

    metrics = _metrics(coordinator, metrics_host, metrics_port) if metrics_port is not None else None
    embedded = None
    if embedded_broker:
        from fedper.coordinator.broker import EmbeddedBroker

        try:
            embedded = EmbeddedBroker("127.0.0.1", port).start()
        except RuntimeError as e:
            typer.echo(f"fedper-coordinator: {e}", err=True)
            raise typer.Exit(2) from None
        mqtt_version = "3.1.1"
    try:
        _serve(coordinator, url, mqtt_version, username, password, str(tls_ca) if tls_ca else None, metrics)
    except CheckpointError as e:
        typer.echo(f"fedper-coordinator: {e}; stopped with the last checkpoint intact, rerun to resume", err=True)
        raise typer.Exit(1) from None
    except BrokerRefused as e:
        typer.echo(f"fedper-coordinator: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: state is checkpointed, run the same command to resume", err=True)
        raise typer.Exit(130) from None
    finally:
        if embedded:
            embedded.stop()
        if metrics:
            metrics.close()
    typer.echo(f"done: {coordinator.config.rounds} round(s); final model in {state_dir / 'final.safetensors'}")


def _metrics(coordinator: Coordinator, host: str, port: int) -> CoordinatorMetrics:
    """The Prometheus endpoint, serving from now on (coordinator/metrics.py)."""
    try:
        from fedper.coordinator.metrics import CoordinatorMetrics
    except ImportError as e:
        typer.echo(f"fedper-coordinator: --metrics-port needs prometheus_client ({e}): "
                   "pip install 'fedper-edge[coordinator]'", err=True)
        raise typer.Exit(2) from None
    metrics = CoordinatorMetrics()
    metrics.observe(coordinator)
    try:
        bound = metrics.serve(host, port)
    except OSError as e:
        typer.echo(f"fedper-coordinator: cannot serve metrics on {host}:{port}: {e}", err=True)
        raise typer.Exit(2) from None
    logging.getLogger("fedper.coordinator").info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return metrics


def _serve(coordinator: Coordinator, url: BrokerUrl, protocol: str, username: str | None, password: str | None,
           tls_ca: str | None, metrics: CoordinatorMetrics | None) -> None:
    """The service with a rich progress bar: rounds done, and updates accepted in the open round."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedper.coordinator.service import run_service

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        rounds = progress.add_task("rounds", total=coordinator.config.rounds, info="")
        updates = progress.add_task("updates", total=None, info="")

        def show(c: Coordinator) -> None:
            if metrics:
                metrics.observe(c)
            done = c.round.number - (0 if c.finished else 1)
            progress.update(rounds, completed=done, info=f"round {c.round.number}")
            rejected = sum(v for k, v in c.counters.items() if k != "accepted")
            progress.update(updates, completed=len(c.round.folded), total=max(c.invited_count, 1),
                            info=f"{len(c.registered)} registered, {len(c.online)} online, {rejected} rejected")

        run_service(coordinator, url, protocol=protocol, username=username, password=password, tls_ca=tls_ca,
                    on_tick=show)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
