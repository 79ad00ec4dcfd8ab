"""fedper-coordinator: the MQTT service that runs FedPer rounds for a fleet of devices (docs/operations.md).

Its options are declared once, as the fields of coordinator/config.py's groups and of `Service` below; each
group is one panel of --help.
"""

from __future__ import annotations

import inspect
import logging
import sys
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from fedper.coordinator.config import GROUPS, Config, Group, option
from fedper.coordinator.web import Web
from fedper.onecommand import OneCommand

if TYPE_CHECKING:
    from fedper.coordinator.durable import Coordinator
    from fedper.coordinator.metrics import CoordinatorMetrics
    from fedper.coordinator.web import WebServer
    from fedper.mqtt import BrokerUrl


app = typer.Typer(help="Run federated rounds over MQTT: register devices, aggregate base updates.",
                  rich_markup_mode=None, no_args_is_help=True, cls=OneCommand)


@dataclass(frozen=True)
class Service(Group):
    """Where the service reads, writes and connects: options of the command, not of the engine."""

    title = "Service"
    artifacts: Path = option(help="Export directory: manifest.json and base.safetensors.")
    fleet: str = option(help="Fleet name: topics live under fedper/v1/<fleet>/.")
    state_dir: Path = option(help="Checkpoints, metrics.jsonl and final.safetensors; resumed from.")
    broker: str = option("", "External broker URL, mqtt://host:1883 or mqtts://host:8883.")
    embedded_broker: bool = option(False, "Run amqtt's broker in this process on 127.0.0.1:--port.")
    port: int = option(1883, "Port of the embedded broker.", min=1, max=65535)
    mqtt_version: str = option("5", "MQTT protocol: 5 or 3.1.1 (the embedded broker speaks 3.1.1).")
    username: str | None = option(None, "Broker user name.")
    password: str | None = option(None, "Broker password.", envvar="FEDPER_MQTT_PASSWORD")
    tls_ca: Path | None = option(None, "CA certificate (PEM) to verify the broker with; implies TLS.")
    metrics_port: int | None = option(None, "Serve Prometheus metrics on this port (/metrics; default: off). Needs "
                                            "the coordinator extra (prometheus_client).", min=0, max=65535)
    metrics_host: str = option("127.0.0.1", "Address the metrics endpoint listens on.")
    verbose: bool = option(False, "Log every accepted update.", flag="--verbose", short="-v")


def _options(group: type[Group]) -> list[inspect.Parameter]:
    """The group's fields as typer options, named as `Config.of` takes them."""
    hints = typing.get_type_hints(group)
    params = []
    for f in fields(group):
        meta = f.metadata
        if not meta["cli"]:
            continue
        flags = [meta["flag"], meta["short"]] if meta["short"] else []  # else typer names it after the parameter
        kind = typing.get_args(hints[f.name])[0] if typing.get_args(hints[f.name]) else hints[f.name]  # X | None
        default = typer.Option(... if f.default is MISSING else f.default, *flags, help=meta["help"],
                               min=meta["min"], max=meta["max"], envvar=meta["envvar"], rich_help_panel=group.title)
        params.append(inspect.Parameter(group.flag(f.name), inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=kind))
    return params


def _command(**options: Any) -> None:
    """Serve rounds until --rounds are done; resumes from --state-dir after a restart."""
    service = Service(**{f.name: options.pop(f.name) for f in fields(Service) if f.name in options})
    web = Web(**{f.name: options.pop(Web.flag(f.name)) for f in fields(Web) if Web.flag(f.name) in options})
    run(service, options, web)


_command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [p for group in (Service, Web, *GROUPS.values()) for p in _options(group)])
app.callback(invoke_without_command=True)(_command)


def run(service: Service, options: dict[str, Any], web: Web | None = None) -> None:
    """Build the engine from the options, then serve until --rounds are done."""
    from fedper.coordinator.store import CheckpointError
    from fedper.mqtt import BrokerRefused

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("fedper.coordinator").setLevel(logging.DEBUG if service.verbose else logging.INFO)
    coordinator, url = _build(service, options)
    mqtt_version, state_dir = service.mqtt_version, service.state_dir
    metrics = (_metrics(coordinator, service.metrics_host, service.metrics_port)
               if service.metrics_port is not None else None)
    web = web or Web()
    ws_port = None  # the embedded broker's WebSocket listener, for the page (--web-port)
    if web.port is not None and service.embedded_broker and not web.broker:
        from fedper.ports import free_port

        ws_port = web.ws_port or free_port()
    embedded = None
    if service.embedded_broker:
        from fedper.coordinator.broker import EmbeddedBroker

        try:
            embedded = EmbeddedBroker("127.0.0.1", service.port, ws_port=ws_port, ws_host=web.host).start()
        except RuntimeError as e:
            typer.echo(f"fedper-coordinator: {e}", err=True)
            raise typer.Exit(2) from None
        mqtt_version = "3.1.1"
    page = _page(web, service, ws_port) if web.port is not None else None  # its URL printed once all is up
    try:
        _serve(coordinator, url, mqtt_version, service.username, service.password,
               str(service.tls_ca) if service.tls_ca else None, metrics,
               linger_s=coordinator.config.rounds.round_timeout if embedded else 0.0)
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
        if page:
            page.close()
    typer.echo(f"done: {coordinator.round.number} round(s); final model in {state_dir / 'final.safetensors'}")


def _build(service: Service, options: dict[str, Any]) -> tuple[Coordinator, BrokerUrl]:
    """The engine and the broker's URL; a bad option, export or state directory exits 2 with one line."""
    from fedper.artifacts import BASE_FILE
    from fedper.coordinator.durable import Coordinator
    from fedper.coordinator.store import CheckpointError, Store
    from fedper.manifest import Manifest, ManifestError
    from fedper.mqtt import PROTOCOLS, BrokerUrl, parse_broker_url
    from fedper.payload import decode_shared
    from fedper.wire import Topics, WireError

    try:
        if service.embedded_broker == bool(service.broker):
            raise ValueError("give exactly one of --broker URL or --embedded-broker")
        if service.mqtt_version not in PROTOCOLS:
            raise ValueError(f"--mqtt-version {service.mqtt_version!r}: choose one of {', '.join(PROTOCOLS)}")
        config = Config.of(**options)
        url = (BrokerUrl("127.0.0.1", service.port, False) if service.embedded_broker
               else parse_broker_url(service.broker))
        manifest = Manifest.load(service.artifacts)
        _check_export(service.artifacts)
        initial = decode_shared(manifest, (service.artifacts / BASE_FILE).read_bytes())
        return Coordinator(manifest, initial, Topics(service.fleet), config, Store(service.state_dir)), url
    except (ValueError, KeyError, OSError, ManifestError, WireError, CheckpointError) as e:
        typer.echo(f"fedper-coordinator: {e}", err=True)
        raise typer.Exit(2) from None


def _check_export(directory: Path) -> None:
    """Serve only an export that matches its manifest (operations.md: a tampered or incomplete copy is refused)."""
    from fedper.verify import verify

    problems = verify(directory)
    if problems:
        more = f"; and {len(problems) - 3} more (fedper-export verify {directory})" if len(problems) > 3 else ""
        raise ValueError(f"{directory} does not match its manifest: {'; '.join(problems[:3])}{more}")


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


def _page(web: Web, service: Service, ws_port: int | None) -> WebServer:
    """The web agent's page, serving from now on, its URL and a QR code printed (coordinator/web.py)."""
    from fedper.coordinator.web import announce, serve_page

    try:
        page = serve_page(web, service.artifacts, service.fleet, ws_port)
    except (ValueError, OSError) as e:
        typer.echo(f"fedper-coordinator: {e}", err=True)
        raise typer.Exit(2) from None
    announce(page, service.fleet, typer.echo)
    return page


def _serve(coordinator: Coordinator, url: BrokerUrl, protocol: str, username: str | None, password: str | None,
           tls_ca: str | None, metrics: CoordinatorMetrics | None, linger_s: float) -> None:
    """The service with a rich progress bar: rounds done, and updates accepted in the open round."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedper.coordinator.service import run_service

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        rounds = progress.add_task("rounds", total=coordinator.config.rounds.rounds, info="")
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
                    on_tick=show, linger_s=linger_s)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
