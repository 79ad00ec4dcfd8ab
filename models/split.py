"""The one place that decides which tensors are base (shared) and which are head (device-local)."""

from __future__ import annotations

from dataclasses import dataclass

from fedper.models.blocknet import BlockNet

MAX_KP = 4


@dataclass(frozen=True)
class Split:
    """Names of the model's state_dict entries (parameters and buffers), in state_dict order."""

    base: tuple[str, ...]
    head: tuple[str, ...]

    def role(self, name: str) -> str:
        return "head" if name in self.head else "base"


def head_prefixes(model: BlockNet, kp: int) -> tuple[str, ...]:
    """K_P counts basic blocks from the output: 1 = classifier, 2 = classifier + last block, ...; 0 = FedAvg."""
    if not isinstance(kp, int) or not 0 <= kp <= MAX_KP:
        raise ValueError(f"K_P must be an integer in 0..{MAX_KP} (0 is FedAvg), got {kp!r}")
    if kp == 0:
        return ()
    n = len(model.blocks)
    return ("classifier.", *(f"blocks.{i}." for i in range(n - (kp - 1), n)))


def split(model: BlockNet, kp: int) -> Split:
    """Base and head state_dict names for K_P = `kp`. BatchNorm buffers follow their layer."""
    prefixes = head_prefixes(model, kp)
    names = list(model.state_dict().keys())
    head = tuple(n for n in names if n.startswith(prefixes)) if prefixes else ()
    base = tuple(n for n in names if n not in head)
    return Split(base=base, head=head)
