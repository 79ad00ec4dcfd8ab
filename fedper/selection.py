"""Which devices a round invites: a seeded, stateless rule shared by the coordinator and the emulator.

Each candidate gets a key, SHA-256 of (run seed, round, device id); a round invites the candidates
with the smallest keys. Why a keyed hash rather than a random generator seeded per round:

- a device's key depends on nothing but itself, so the rule is stable when the fleet changes: a
  device joining or leaving moves others only if it ranks among the invited;
- topping up a round (devices that come online after it opened) takes the next keys in the same
  ranking, so "select k, then top up j" invites exactly what "select k + j" would have;
- it needs no per-device randomness drawn in a fixed order (a generator's draw for a device would
  depend on its position in the list), so any implementation, in any language, reproduces it from
  the ids alone. `heapq.nsmallest` keeps it O(N log k).

The seed is a secret of the coordinator (`new_seed`, kept in its state, never sent): whoever knows it
and the ids knows every device's future rounds. A device must not learn when it will be asked (it could
be ready with a crafted update, or be away on purpose), and under DP the accountant's subsampling
discount holds only for a selection nobody can predict: with the rounds of a device known, its epsilon is
that of its own rounds, unsampled (docs/privacy.md). With a secret seed the keys are a uniformly random
ranking, so a round's M invitations among N candidates are a uniformly random M-subset: sampling without
replacement, which `fedper.privacy.PrivacyAccountant(sampling="fixed")` accounts. `check_seed` refuses a
seed too small to be secret; the emulator, which has no device to hide from, uses its run's seed.

Liveness is what a device does, not what it says: a retained presence `online` stays online after the
device died if it set no last will. An invitation the device leaves unanswered (the coordinator gives
it --answer-timeout) is a miss; `Backoff` keeps the misses in a row, and a device with k of them sits
out the next `sit_out_rounds(k)` = 2^(k-1) rounds (at most MAX_SIT_OUT_ROUNDS): invited less and less,
never dropped for good, and back to normal as soon as it answers once.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

DOMAIN = b"fedper-selection-v1"  # keys of this rule never collide with another use of SHA-256 on the same ids
SEED_BITS = 128  # a secret seed's size: out of reach of guessing, as the DP noise secret
MIN_SECRET_SEED = 1 << 64  # below it a seed is a small number someone chose, not a secret drawn at random
MAX_SIT_OUT_ROUNDS = 64  # a device that never answers is still asked about once every 64 rounds


def new_seed() -> int:
    """A fresh secret selection seed, from the operating system's CSPRNG (keep it in the coordinator's state)."""
    return secrets.randbits(SEED_BITS) | MIN_SECRET_SEED  # at least MIN_SECRET_SEED: check_seed accepts it


def check_seed(seed: int) -> int:
    """`seed` if it can be a secret (an int of at least 65 bits, at most SEED_BITS), else ValueError: a seed
    such as 0 or 42 lets anyone who knows the device ids compute who is invited to every round."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not MIN_SECRET_SEED <= seed < 1 << SEED_BITS:
        raise ValueError("a selection seed must be secret: use fedper.selection.new_seed(), not a chosen number "
                         "(anyone who knows it and the device ids knows every device's future rounds)")
    return seed


def invitations(clients_per_round: int, over_select: float) -> int:
    """ceil(F * M), computed on the decimal F as written (1.1 * 100 is 110, not float's 110.00000000000001)."""
    if clients_per_round < 1 or over_select < 1.0:
        raise ValueError(f"clients per round must be >= 1 and over-selection >= 1.0, got {clients_per_round} "
                         f"and {over_select}")
    return math.ceil(Fraction(repr(float(over_select))) * clients_per_round)


def selection_key(seed: int, round_: int, device: str) -> bytes:
    """The device's rank in a round: smaller is invited first."""
    return hashlib.sha256(b"\0".join((DOMAIN, str(seed).encode(), str(round_).encode(), device.encode()))).digest()


def select(candidates: Iterable[str], k: int, *, seed: int, round_: int) -> list[str]:
    """The k candidates (all, if fewer) with the smallest keys, in key order; ids are compared only to
    break a tie between equal keys, which SHA-256 makes as good as impossible."""
    return heapq.nsmallest(max(k, 0), set(candidates), key=lambda d: (selection_key(seed, round_, d), d))


class Ranking:
    """`select`'s ranking kept between calls and told of the fleet's changes, so that neither a top-up nor a
    new version costs a pass over the online fleet (at 100,000 online devices `select` took 0.16 s, and a
    selecting coordinator tops up twice a second). `offer` ranks the devices that became candidates (came
    online, registered, finished an invitation, ended a sit-out) with the key of the round current then;
    `take` pops the ranking in key order and drops the devices it finds no longer candidates, which `offer`
    brings back once they are. So with `clear` and an `offer` of every candidate at a round's opening, `take`
    returns exactly what `select` would; without them (asynchronous rounds, whose versions are rounds) a
    device keeps its key until it is invited, then draws a fresh one when it is offered again: every
    version's choice is still a seeded random order, and costs O(k log N) plus the devices offered."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._heap: list[tuple[bytes, str]] = []
        self._ranked: set[str] = set()

    def clear(self) -> None:
        self._heap, self._ranked = [], set()

    def offer(self, devices: Iterable[str], round_: int) -> None:
        """Rank the devices not ranked yet with `round_`'s key (a device already ranked keeps its own)."""
        for device in devices:
            if device not in self._ranked:
                heapq.heappush(self._heap, (selection_key(self.seed, round_, device), device))
                self._ranked.add(device)

    def take(self, k: int, is_candidate: Callable[[str], bool]) -> list[str]:
        """The k candidates (all, if fewer) first in the ranking; every device popped leaves it."""
        chosen: list[str] = []
        while self._heap and len(chosen) < k:
            _, device = heapq.heappop(self._heap)
            self._ranked.discard(device)
            if is_candidate(device):
                chosen.append(device)
        return chosen


def sit_out_rounds(misses: int) -> int:
    """Rounds a device sits out after `misses` unanswered invitations in a row: 1, 2, 4, ... at most
    MAX_SIT_OUT_ROUNDS (0 without a miss)."""
    return 0 if misses < 1 else min(1 << min(misses - 1, 62), MAX_SIT_OUT_ROUNDS)


@dataclass
class Backoff:
    """Per device: unanswered invitations in a row and the round of the last one (JSON: `to_json`)."""

    misses: dict[str, tuple[int, int]] = field(default_factory=dict)  # device -> (misses in a row, last round)

    def missed(self, device: str, round_: int) -> bool:
        """Count the device's invitation to `round_` unanswered (once per round); whether that is new."""
        count, last = self.misses.get(device, (0, 0))
        if last == round_:
            return False
        self.misses[device] = (count + 1, round_)
        return True

    def answered(self, device: str) -> bool:
        """The device answered: its misses are forgotten; whether it had any."""
        return self.misses.pop(device, None) is not None

    def sits_out(self, device: str, round_: int) -> bool:
        """Whether the device is not eligible in `round_`: missed in round r with k misses, it sits out
        r+1 .. r+2^(k-1)."""
        count, last = self.misses.get(device, (0, 0))
        return last < round_ <= last + sit_out_rounds(count)

    def sitting_out(self, round_: int) -> set[str]:
        """The devices that sit `round_` out (O(devices with misses))."""
        return {device for device in self.misses if self.sits_out(device, round_)}

    def to_json(self) -> dict[str, list[int]]:
        return {device: [count, last] for device, (count, last) in sorted(self.misses.items())}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Backoff:
        return cls({device: (int(count), int(last)) for device, (count, last) in body.items()})
