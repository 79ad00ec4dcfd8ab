"""The learning-rate schedule, once: the emulator (emulate/fleet.py) and the coordinator (coordinator/config.py
Training, which sends each round's lr to the devices) follow the same rule under the same option names
(--lr, --lr-milestones, --lr-decay)."""

from __future__ import annotations


def lr_at(lr: float, round_: int, milestones: tuple[int, ...] = (), decay: float = 0.1) -> float:
    """The learning rate of round `round_` (1-based): lr, times `decay` for each milestone it comes after
    (FedBABU's step decay: milestones R/2 and 3R/4). A function of the round alone, so a resumed run follows it."""
    return lr * decay ** sum(round_ > m for m in milestones)


def parse_milestones(text: str) -> tuple[int, ...]:
    """--lr-milestones "50,75" (commas or spaces) as rounds; ValueError naming what is not a round."""
    parts = text.replace(",", " ").split()
    bad = [p for p in parts if not p.isdigit() or int(p) < 1]
    if bad:
        raise ValueError(f"--lr-milestones takes round numbers >= 1 separated by commas, got {bad[0]!r}")
    return tuple(int(p) for p in parts)
