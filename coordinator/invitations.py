"""Which devices a round invites (--clients-per-round): the opening selection, top-ups, lapses and backoff.

A round invites ceil(F * M) devices ranked by the run's seeded rule (fedper/selection.py) among those
registered, online and not sitting out; an invitation not answered within --answer-timeout lapses (a miss:
the device sits out its next rounds) and the next device in the ranking is invited in its place, as for a
device that says offline before delivering (no miss). Liveness is of this process: a restart begins afresh.
Invitations carried from an earlier round (asynchronous rounds) keep their round (RoundRecord.carried).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any, Protocol

from fedper.coordinator.config import Config
from fedper.coordinator.logs import DeviceLog, log
from fedper.coordinator.store import RoundRecord
from fedper.coordinator.strategies.base import Terms
from fedper.selection import Backoff, Ranking, check_seed, invitations, new_seed, sit_out_rounds


class Places(Protocol):
    """What the run's strategy says about invitations (coordinator/strategies/base.py)."""

    terms: Terms

    def answered(self, folded: Set[str]) -> Set[str]: ...


class Invitations:
    """The open round's invitations and how they fare; `backoff` is checkpointed (its own file)."""

    def __init__(self, config: Config, available: Set[str], strategy: Places, device_log: DeviceLog) -> None:
        selection = config.selection
        self.selecting = selection.clients_per_round is not None  # else every registered device takes part
        # secret by default: no device learns its future rounds, and fixed-size sampling under DP assumes it
        self._seed = new_seed() if selection.selection_seed is None else selection.selection_seed
        if config.privacy.noise_multiplier is not None and selection.selection_seed is not None:
            check_seed(selection.selection_seed)
        self._cap = invitations(selection.clients_per_round, selection.over_select) if self.selecting else 0
        self.answer_timeout = selection.answer_timeout or config.rounds.round_timeout / 2
        self._ranking = Ranking(self._seed)  # select()'s ranking, kept between top-ups (fedper/selection.py)
        self._available, self._strategy, self._log = available, strategy, device_log
        self.backoff = Backoff()  # devices that left invitations unanswered (fedper/selection.py)
        self.backoff_file: str | None = None
        self.backoff_dirty = False
        self._invited_at: dict[str, float] = {}  # device -> when this process invited it (or resumed)
        self._unsent: set[str] = set()  # invited by the engine's latest call, their invitations not yet out
        self._answered: set[str] = set()  # invited devices that sent something for the open round
        self.lapsed: set[str] = set()  # invitations given up: their places went to the next devices

    def resume(self, backoff: Mapping[str, Any] | None, file: str | None) -> None:
        if backoff is not None:
            self.backoff, self.backoff_file = Backoff.from_json(backoff), file

    def restart(self, r: RoundRecord, now: float) -> None:
        """This process starts the open round (or resumes it): its invitations are answered from now on."""
        self._invited_at = dict.fromkeys(r.invited, now)

    def select(self, r: RoundRecord, now: float, carried: Mapping[str, int] | None = None,
               released: Iterable[str] = ()) -> None:
        """The opening selection of the (new) open round `r`, among the eligible devices, beside the invitations
        `carried` from earlier rounds; `released`: the earlier round's invitations that end with it. The caller
        checkpoints it. Fewer than ceil(F * M) of them: `top_up` invites more as they come online or lapse."""
        r.selected, r.invite_cap, r.seed, r.carried = True, self._cap, self._seed, dict(carried or {})
        room = max(0, r.invite_cap - len(self._strategy.terms.places(r.carried.keys(), set())))
        r.invited = set(r.carried)
        if self._strategy.terms.rerank_each_round:  # every device is ranked with this round's key: select()'s rule
            self._ranking.clear()
            self._ranking.offer(self._available, r.number)
        else:  # the ranking knows the rest: candidates again are those released and those whose sit-out may end
            self._ranking.offer(itertools.chain(released, self.backoff.misses), r.number)
        r.invited |= set(self._ranking.take(room, self._eligible(r)))
        self._invited_at = dict.fromkeys(r.invited, now)
        self._unsent = set(r.invited)

    def sent(self, now: float) -> None:
        """The invitations made since the last call went out at `now`: their answer timeouts start then, not at
        the `now` of the call that made them, which may have run long (a round's close: DP accounting took 1.5 s
        on a loaded machine, and every invitation it made lapsed before its device could answer)."""
        self._invited_at.update(dict.fromkeys(self._unsent & self._invited_at.keys(), now))
        self._unsent = set()

    def new_round(self) -> None:
        """A round closed: what its invitations did is over."""
        self._answered, self.lapsed = set(), set()

    def offer(self, device: str, number: int) -> None:
        """The device became available (registered and online): the ranking takes it."""
        if self.selecting:
            self._ranking.offer((device,), number)

    def drawn_from(self, invited: Set[str], number: int) -> int:
        """How many devices `invited` was drawn from: eligible now (registered, online, not sitting out) or
        invited; counted in O(invited + devices backed off), not O(fleet)."""
        sitting = self.backoff.sitting_out(number)
        eligible = len(self._available) - sum(1 for device in sitting if device in self._available)
        return eligible + sum(1 for device in invited if device not in self._available or device in sitting)

    def answer(self, device: str) -> None:
        """The device sent something valid for the open round: it is alive, and its backoff is over."""
        if self.selecting:
            self._answered.add(device)
            self.forget(device)

    def forget(self, device: str) -> None:
        """The device's misses are forgotten (it answered, or left the fleet)."""
        self.backoff_dirty |= self.backoff.answered(device)

    def lapse(self, r: RoundRecord, now: float) -> None:
        """Give up the invitations not answered within --answer-timeout (a miss: the device sits out its next
        rounds), so that `top_up` invites the next devices in their place. A lapsed device stays invited: its
        update is still accepted if it comes. Not after a restart's empty online set: only what is seen."""
        waiting = r.invited - self.lapsed - self._answered - self._strategy.answered(r.folded.keys())
        for device in waiting:
            if now - self._invited_at.setdefault(device, now) >= self.answer_timeout:
                self.lapsed.add(device)
                if self.backoff.missed(device, r.number):
                    self.backoff_dirty = True
                    misses = self.backoff.misses[device][0]
                    self._log.log(now, device, "missed", logging.INFO, "round %d: %s did not answer its invitation "
                                  "within %.1f s (%d in a row): inviting another, it sits out %d round(s)", r.number,
                                  device, self.answer_timeout, misses, sit_out_rounds(misses))

    def top_up(self, r: RoundRecord, now: float) -> list[str]:
        """Invite eligible devices not invited yet, next in the seeded ranking, while fewer than ceil(F * M)
        invitations are live (not lapsed); the caller checkpoints them before the invitations go out, so a
        restart re-sends the same ones."""
        room = r.invite_cap - len(self._strategy.terms.places(r.invited - self.lapsed, r.folded.keys()))
        chosen = self._ranking.take(room, self._eligible(r)) if room > 0 else []
        if chosen:
            r.invited.update(chosen)
            self._invited_at.update(dict.fromkeys(chosen, now))
            self._unsent.update(chosen)
            log.info("round %d: invited %d more device(s) [%d live of %d, %d lapsed]", r.number, len(chosen),
                     len(r.invited - self.lapsed), r.invite_cap, len(self.lapsed))
        return chosen

    def declined(self, device: str, r: RoundRecord) -> None:
        """The invited device said offline before it answered: its place goes to the next (no miss)."""
        if device in r.invited and device not in self._strategy.answered(r.folded.keys()):
            self.lapsed.add(device)

    def replace_dropouts(self, r: RoundRecord) -> None:
        """At an extension (the deadline passed below --min-clients): every invitation not delivered yet lapses
        (without a miss: it may have started), so the round invites ceil(F * M) more that may answer."""
        self.lapsed |= r.invited - self._strategy.answered(r.folded.keys())

    def write(self, writer: Callable[[Mapping[str, Any]], str]) -> None:
        """The backoff file, if it changed: as the registry, O(devices backed off), not in every commit."""
        if self.backoff_dirty:
            misses = self.backoff.to_json()
            self.backoff_file = writer(misses) if misses else None
            self.backoff_dirty = False

    def _eligible(self, r: RoundRecord) -> Callable[[str], bool]:
        """Whether round `r` may invite a device: registered, online, not invited, not sitting out."""
        return lambda device: device in self._available and device not in r.invited and \
            not self.backoff.sits_out(device, r.number)
