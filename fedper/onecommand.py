"""Plain --help for a role's one command (fedper-agent, fedper-coordinator): option names whole at 80 columns,
a section per panel of options, and no "COMMAND [ARGS]" for subcommands the role does not have.

A role is a typer app whose callback is its command, so that the umbrella `fedper` mounts it as `fedper agent`;
typer makes such an app a group, whose usage line offers subcommands and whose rich panels cut long option names;
click's plain help, in turn, breaks lines at hyphens (`--no-fine-tune-` / `head`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from typer import _click as click
from typer.core import TyperGroup

_KEEP = "\ue000"  # stands for "-" while a help text is wrapped: a private-use character that is never a break


class _Formatter(click.HelpFormatter):
    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        """click's, without a line break at a hyphen."""
        start = len(self.buffer)
        super().write_dl([(term, text.replace("-", _KEEP)) for term, text in rows], col_max, col_spacing)
        self.buffer[start:] = [part.replace(_KEEP, "-") for part in self.buffer[start:]]


class _Context(click.Context):
    formatter_class = _Formatter


class OneCommand(TyperGroup):
    context_class = _Context

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None  # plain under the umbrella `fedper` too, whose own help is rich

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return click.Command.collect_usage_pieces(self, ctx)  # [OPTIONS], without the group's COMMAND [ARGS]...

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, rows in panels.items():
            with formatter.section(title):
                formatter.write_dl(rows)
