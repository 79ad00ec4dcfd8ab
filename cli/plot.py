"""`fedper plot RUN...`: accuracy and loss per round of emulated runs and real fleets, on one figure.

A RUN is a folder with a metrics.jsonl: an emulator run (`fedper-emulate run --out`: each client's test
accuracy and loss per round, and data.json's chance line) or a coordinator's --state-dir (the devices'
mean and standard deviation of accuracy per round). The two count rounds differently, and the plot puts
both on one axis, the number of aggregations behind the evaluated model: the emulator evaluates each
round's new aggregate (round r: r aggregations), a device evaluates the model it was served before
training in round r (r - 1 aggregations).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import typer

METRICS = "metrics.jsonl"


class PlotError(ValueError):
    """A RUN that cannot be drawn; the message names it."""


@dataclass
class Series:
    label: str
    x: list[int]
    accuracy: list[float]
    low: list[float]  # the spread over devices: min (emulator) or mean - std (coordinator)
    high: list[float]
    fleet: bool  # a coordinator's (mean ± std, no loss) rather than an emulator's (min..max, loss)
    loss: list[float] = field(default_factory=list)
    chance: float | None = None
    data: str | None = None  # the data set's name, when the run records it


def read_run(path: Path, label: str | None = None) -> Series:
    """The series of one emulator run or coordinator state dir."""
    metrics = path / METRICS
    if not path.is_dir():
        raise PlotError(f"{path} is not a folder; give an emulator run (fedper-emulate run --out) or a "
                        f"coordinator's --state-dir")
    if not metrics.is_file():
        raise PlotError(f"{path} holds no {METRICS}: give an emulator run (fedper-emulate run --out) or a "
                        f"coordinator's --state-dir")
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise PlotError(f"cannot read {metrics}: {e}") from e
    if not rows:
        raise PlotError(f"{metrics} holds no finished round yet")
    if "mean_accuracy" in rows[0]:
        return _emulated(path, rows, label)
    if "accuracy_mean" in rows[0]:
        return _coordinated(path, rows, label)
    raise PlotError(f"{metrics} is neither an emulator's nor a coordinator's (no mean_accuracy or accuracy_mean)")


def _emulated(path: Path, rows: list[dict], label: str | None) -> Series:
    info_path = path / "data.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    config = json.loads((path / "config.json").read_text()).get("fleet", {}) if (path / "config.json").is_file() else {}
    name = label or (f"{path.name} ({config['algorithm']}, K_P={config['kp']})" if config else path.name)
    return Series(name, [m["round"] for m in rows], [m["mean_accuracy"] for m in rows],
                  [min(m["accuracy"]) for m in rows], [max(m["accuracy"]) for m in rows], False,
                  [m["mean_loss"] for m in rows if "mean_loss" in m], info.get("chance_accuracy"), info.get("name"))


def _coordinated(path: Path, rows: list[dict], label: str | None) -> Series:
    rows = [m for m in rows if m.get("accuracy_mean") is not None]  # a round whose devices sent no accuracy
    if not rows:
        raise PlotError(f"{path / METRICS}: no round has the devices' accuracy")
    mean = [m["accuracy_mean"] for m in rows]
    std = [m.get("accuracy_std") or 0.0 for m in rows]
    return Series(label or str(path), [m["round"] - 1 for m in rows], mean,
                  [max(0.0, a - s) for a, s in zip(mean, std, strict=True)],
                  [min(1.0, a + s) for a, s in zip(mean, std, strict=True)], True)


def draw(series: list[Series], png: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedper.emulate.drawing import chance_legend, draw_chance, integer_rounds

    with_loss = any(s.loss for s in series)
    fig, axes = plt.subplots(1, 2 if with_loss else 1, figsize=(11 if with_loss else 6, 4), squeeze=False)
    accuracy = axes[0, 0]
    for i, s in enumerate(series):
        colour = f"C{i % 10}"
        accuracy.plot(s.x, s.accuracy, marker="o", ms=3, color=colour, label=s.label)
        accuracy.fill_between(s.x, s.low, s.high, color=colour, alpha=0.15)
        draw_chance(accuracy, s.chance, colour)
        if s.loss:
            axes[0, 1].plot(s.x[: len(s.loss)], s.loss, marker="o", ms=3, color=colour, label=s.label)
    kinds = {s.fleet for s in series}
    band = {frozenset({False}): "the devices' min..max", frozenset({True}): "± std over the devices",
            frozenset({False, True}): "the devices' min..max (emulated), ± std (fleet)"}[frozenset(kinds)]
    accuracy.set(xlabel="aggregated rounds (of the model evaluated)", ylabel="test accuracy, mean over devices",
                 ylim=(0, 1), title=f"accuracy; band: {band}")
    chance_legend(accuracy, any(s.chance is not None for s in series))
    if with_loss:
        axes[0, 1].set(xlabel="aggregated rounds (of the model evaluated)", ylabel="test loss, mean over devices",
                       title="test loss" + (" (a fleet's metrics.jsonl holds none)" if True in kinds else ""))
        axes[0, 1].legend(fontsize=8)
    for ax in axes.flat:
        integer_rounds(ax)
        ax.grid(alpha=0.3)
    names = sorted({s.data for s in series if s.data})
    if title or names:
        fig.suptitle(title or ", ".join(names), fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot(
    runs: list[Path] = typer.Argument(..., metavar="RUN", help="Emulator run folders (fedper-emulate run --out) "
                                      "and coordinator state dirs (--state-dir), drawn on one figure"),
    out: Path = typer.Option(Path("plot.png"), help="The PNG to write"),
    label: list[str] = typer.Option([], metavar="NAME", help="A curve's name in the legend, in the order of RUN "
                                    "(repeatable; default: the folder's name)"),
    title: str | None = typer.Option(None, help="The figure's title (default: the data sets' names)"),
) -> None:
    """Draw accuracy and loss per round of runs and fleets on one figure."""
    if len(label) > len(runs):
        typer.echo(f"fedper plot: {len(label)} --label for {len(runs)} RUN(s)", err=True)
        raise typer.Exit(2)
    try:
        series = [read_run(path, label[i] if i < len(label) else None) for i, path in enumerate(runs)]
        draw(series, out, title)
    except (PlotError, OSError) as e:
        typer.echo(f"fedper plot: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}")
