"""`python -m fedper.cli ...`: the umbrella command without relying on console scripts on PATH."""

from fedper.cli import app

app()
