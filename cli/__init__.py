"""The umbrella `fedper` command: every role's commands under one name.

It sits above the roles (the shared kernel imports none of them). Each role's own console script
(fedper-export, fedper-agent, fedper-coordinator, fedper-emulate) runs the same typer app.
"""

from __future__ import annotations

import importlib

import typer

from fedper.cli.demo import demo

app = typer.Typer(
    help="FedPer edge toolkit: federated learning with personalization layers, from the paper to devices.",
    no_args_is_help=True,
)

ROLES = {
    "export": "Build ONNX Runtime on-device training artifacts and their manifest.",
    "agent": "Run a device: train locally with onnxruntime-training, send base parameters only.",
    "coordinator": "Run the MQTT coordinator: rounds, aggregation of base updates, checkpoints.",
    "emulate": "Run an emulated fleet for the paper's experiments and figures.",
}
MODULES = {"export": "export", "agent": "edge", "coordinator": "coordinator", "emulate": "emulate"}


def _not_built(name: str, what: str) -> None:
    @app.command(name, help=f"{what} [not built yet]", context_settings={"ignore_unknown_options": True})
    def placeholder(args: list[str] = typer.Argument(None, hidden=True)) -> None:
        typer.echo(f"fedper {name}: not built yet in this version of the toolkit.", err=True)
        raise typer.Exit(2)


for _name, _what in ROLES.items():
    try:
        _role = importlib.import_module(f"fedper.{MODULES[_name]}.cli")
    except ModuleNotFoundError as _e:
        if _e.name != f"fedper.{MODULES[_name]}.cli":
            raise
        _not_built(_name, _what)
    else:
        app.add_typer(_role.app, name=_name, help=_what)

app.command("demo", help="Run the whole system on one machine: export, broker, coordinator, agents.")(demo)
