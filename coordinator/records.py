"""What the coordinator reports: a closed round's record for metrics.jsonl, and its log lines about rounds
and resumes (docs/reliability.md says what a restart keeps)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedper.coordinator.logs import log
from fedper.coordinator.store import CoordinatorState, RoundRecord


@dataclass(frozen=True)
class Saved:
    """A state directory's checkpoint as the shell read it: state.json and the files it names."""

    state: CoordinatorState
    model: Mapping[str, np.ndarray]
    registry: Mapping[str, Any]
    backoff: Mapping[str, Any] | None


def round_record(closed: RoundRecord, registered: int, selecting: bool, now: float, *, collect_s: float,
                 broadcast_s: float, aggregate_s: float) -> dict[str, Any]:
    """The closed round's line of metrics.jsonl (the strategy adds its own figures)."""
    accuracies = [f.metrics["accuracy"] for f in closed.folded.values() if "accuracy" in f.metrics]
    return {
        "round": closed.number,
        "participants": len(closed.folded),
        "devices": sorted(closed.folded),
        "registered": registered,
        "n_samples": sum(f.n_samples for f in closed.folded.values()),
        "accuracy_mean": float(np.mean(accuracies)) if accuracies else None,
        "accuracy_std": float(np.std(accuracies)) if accuracies else None,
        "bytes_received": closed.bytes_received,
        "broadcast_s": round(broadcast_s, 4),
        "collect_s": round(collect_s, 4),
        "aggregate_s": round(aggregate_s, 4),
        "deadline_extensions": closed.extensions,
        "rejected": dict(closed.rejected),
        "time": now,
        **({"invited": len(closed.invited)} if selecting else {}),
    }


def log_closed(record: Mapping[str, Any]) -> None:
    mean, std = record["accuracy_mean"], record["accuracy_std"]
    log.info("round %d closed: %d participant(s), %d samples, %.1f KiB received; the devices' accuracy of round "
             "%d's model (its base with each one's head, on its test split): %s", record["round"],
             record["participants"], record["n_samples"], record["bytes_received"] / 1024, record["round"],
             "none reported" if mean is None else f"{mean:.4f} ± {std:.4f}")


def check_resumable(saved: CoordinatorState, digest: str, fleet: str, where: object) -> None:
    """ValueError unless the checkpoint in `where` is of this export and this fleet."""
    if saved.base_digest != digest:
        raise ValueError(f"{where} holds the state of a run with another export (base_digest "
                         f"{saved.base_digest or None}): use a fresh --state-dir")
    if saved.fleet is not None and saved.fleet != fleet:
        raise ValueError(f"{where} holds the state of fleet {saved.fleet!r}, not {fleet!r}: "
                         f"resume it with --fleet {saved.fleet}, or use a fresh --state-dir")


def log_resumed(where: object, saved: RoundRecord, rounds: int, finished: bool, stopped: bool, reopened: bool,
                registered: int) -> None:
    """What a resume picked up: the open round, or a finished run (and whether --rounds runs more of it)."""
    number = saved.number
    if reopened:
        log.info("resumed from %s, finished after round %d: --rounds %d runs rounds %d to %d", where, number, rounds,
                 number + 1, rounds)
    elif finished:
        log.info("resumed from %s: the run finished after round %d%s; nothing to do", where, number,
                 " (stopped by its privacy budget)" if stopped else
                 f": --rounds {rounds + 1} or more would run more" if rounds == number else f", past --rounds {rounds}")
    else:
        log.info("resumed from %s: round %d of %d, %d update(s) already accepted, %d device(s) registered%s", where,
                 number, rounds, len(saved.folded), registered,
                 f"; --rounds {rounds} is below it: the run finishes with this round" if number > rounds else "")
