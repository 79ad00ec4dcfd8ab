"""What every figure of the emulator draws the same way (emulate/figures.py, emulate/async_figure.py, and the
umbrella CLI's plot and demo): the chance line and its legend entry, integer round ticks, a PNG written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHANCE_STYLE = {"ls": ":", "lw": 1.2}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: figures are written to files, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, png: Path) -> None:
    """Lay `fig` out, write it to `png` (its folder made) and close it."""
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    pyplot().close(fig)


def draw_chance(ax: Any, chance: float | None, colour: str) -> None:
    """A curve's label prior as a dotted line in its colour: the accuracy of a guess that learned nothing."""
    if chance is not None:
        ax.axhline(chance, color=colour, **CHANCE_STYLE)


def chance_legend(ax: Any, drawn: bool, colour: str = "grey", **placement: Any) -> None:
    """The legend, with one entry that explains the dotted chance lines when any was drawn; `placement` goes to
    matplotlib's legend (loc, ncol) where "best" would cover a bar."""
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    if drawn:
        handles.append(Line2D([], [], color=colour, label="chance (label prior)", **CHANCE_STYLE))
    ax.legend(handles=handles, fontsize=8, **placement)


def integer_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
