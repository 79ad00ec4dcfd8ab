"""The umbrella `fedper` command: every role's commands under one name.

It sits above the roles (the shared kernel imports none of them) and is the only module that
imports them all. Each role's own console script (fedper-export, fedper-agent, fedper-coordinator,
fedper-emulate) runs the same typer app that is registered here.
"""

from __future__ import annotations

import typer

from fedper.cli.demo import demo
from fedper.cli.plot import plot
from fedper.coordinator.cli import app as coordinator_app
from fedper.edge.cli import app as agent_app
from fedper.emulate.cli import app as emulate_app
from fedper.export.cli import app as export_app

app = typer.Typer(
    help="FedPer edge toolkit: federated learning with personalization layers, from the paper to devices.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help, as each role's own command: option names whole at 80 columns
)
# Each line short enough to stand whole in `fedper --help` at 80 columns.
app.add_typer(export_app, name="export", help="Build on-device training artifacts and their manifest.")
app.add_typer(agent_app, name="agent", help="Run a device: train locally, send base parameters only.")
app.add_typer(coordinator_app, name="coordinator", help="Run the MQTT coordinator: rounds, aggregation.")
app.add_typer(emulate_app, name="emulate", help="Emulate a fleet: the paper's experiments and figures.")
app.command("demo", help="Run broker, coordinator and agents on one machine.")(demo)
app.command("plot", help="Draw accuracy and loss per round of runs and fleets.")(plot)
