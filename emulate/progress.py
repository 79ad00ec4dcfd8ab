"""Progress of long work (an emulated run, a figure's curves, the demo's fleets).

In a terminal: a bar per run that moves within a round, so the time left is estimated from the first
training steps rather than after a whole round. Without a terminal (a log file, CI, nohup): a line per
finished round, and within a long round a line at most every HEARTBEAT_S, so a log shows that the work
is alive and how far it is. Runs report plain dicts (`Event`), so a run in another process reports
through a queue just as well (figures --jobs).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

# {"event": "start", "run": key, "label": text, "rounds": R, "done": rounds already done, "unit": "round" (optional:
#  what R counts, e.g. "upload" for a clocked run, which releases a version every few uploads)}
# {"event": "step", "run": key, "steps": done in the round, "of": steps in the round}
# {"event": "round", "run": key, "round": r, "rounds": R, "accuracy": mean or None, "wall_s": seconds}
# {"event": "end", "run": key}
Event = dict[str, Any]
HEARTBEAT_S = 60.0


def duration(seconds: float) -> str:
    """A duration as people say it: 45 s, 12 min, 3 h 20 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


@dataclass
class _Run:
    label: str
    rounds: int
    done: int
    unit: str = "round"
    task: TaskID | None = None
    round_started: float = field(default_factory=time.monotonic)
    walls: list[float] = field(default_factory=list)
    last_line: float = field(default_factory=time.monotonic)


class Board:
    """The progress of one or more runs, drawn as bars in a terminal and as lines elsewhere; `enabled`
    False draws nothing."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.runs: dict[str, _Run] = {}
        self.bars = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[where]}"),
            TextColumn("{task.fields[acc]}"), TimeRemainingColumn(), console=Console(file=self.stream),
            disable=not self.tty, speed_estimate_period=300,
        )

    def __enter__(self) -> Board:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def report(self, event: Event) -> None:
        if not self.enabled:
            return
        kind, key = event["event"], event["run"]
        if kind == "start":
            run = self.runs[key] = _Run(event["label"], event["rounds"], event["done"], event.get("unit", "round"))
            run.task = self.bars.add_task(run.label, total=run.rounds, completed=run.done,
                                          where=f"{run.unit} {run.done}/{run.rounds}", acc="")
            if not self.tty:
                self._line(run, f"started at {run.unit} {run.done}/{run.rounds}" if run.done else
                           f"started, {run.rounds} {run.unit}{'s' if run.rounds != 1 else ''}")
            return
        run = self.runs[key]
        assert run.task is not None
        if kind == "step":
            steps, of = event["steps"], max(1, event["of"])
            self.bars.update(run.task, completed=run.done + steps / of,
                             where=f"round {run.done + 1}/{run.rounds}, step {steps}/{of}")
            now = time.monotonic()
            if not self.tty and now - run.last_line >= HEARTBEAT_S:
                left = (now - run.round_started) * (of - steps) / max(steps, 1)
                self._line(run, f"round {run.done + 1}/{run.rounds}: step {steps}/{of}; "
                                f"about {duration(left)} left in this round")
        elif kind == "round":
            units = max(1, event["round"] - run.done)  # a clocked run's release covers several uploads
            run.done, run.rounds = event["round"], event.get("rounds", run.rounds)
            run.walls.append(event["wall_s"] / units)  # seconds per unit
            run.round_started = time.monotonic()
            accuracy = event.get("accuracy")
            acc = "" if accuracy is None else f"mean acc {accuracy:.3f}"
            self.bars.update(run.task, completed=run.done, total=run.rounds,
                             where=f"{run.unit} {run.done}/{run.rounds}", acc=acc)
            if not self.tty:
                left = statistics.fmean(run.walls[-5:]) * (run.rounds - run.done)  # the recent pace
                self._line(run, f"{run.unit} {run.done}/{run.rounds}{', ' + acc if acc else ''} "
                                f"({event['wall_s']:.1f} s){f'; about {duration(left)} left' if left else ''}")
        elif kind == "end":
            self.bars.update(run.task, completed=run.rounds)
            if not self.tty:
                self._line(run, "done")

    def _line(self, run: _Run, text: str) -> None:
        print(f"{run.label}: {text}", file=self.stream, flush=True)
        run.last_line = time.monotonic()
