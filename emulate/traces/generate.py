"""Write a synthetic device trace in FedScale's format (fedper.emulate.clock.synthetic_trace's distribution).

The shipped emulate/traces/synthetic.json is `python -m fedper.emulate.traces.generate emulate/traces/synthetic.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from fedper.emulate.clock import synthetic_trace


def main(
    out: Path = typer.Argument(..., help="The JSON file to write"),
    devices: int = typer.Option(100, min=1, help="Clients in the trace (ids 0..N-1)"),
    seed: int = typer.Option(0, help="Seed of the draw"),
    hours: float = typer.Option(8.0, min=0.01, help="Length of the availability trace (it then repeats)"),
) -> None:
    """Draw `devices` clients' speeds and online spells and write them as one JSON trace."""
    trace = synthetic_trace(devices, seed, horizon_s=round(hours * 3600))
    out.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    typer.echo(f"wrote {out}: {devices} devices, {hours:g} hours")


if __name__ == "__main__":
    typer.run(main)
