"""Who is in the fleet: registrations (n_j, software), presence, and the registry file a commit names.

The registry has a file of its own, written only when a registration changed (at a pace the engine sets),
so that a commit grows with the round, not the fleet (docs/reliability.md, "State directory"). Devices
registered and online (`available`) are kept from the messages themselves: no O(fleet) pass per round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from typing import Any, Protocol

import numpy as np

from fedper.coordinator.logs import log
from fedper.coordinator.store import Registration, RoundRecord
from fedper.wire import Register, WireError

ONLINE_BURST, ONLINE_WINDOW_S = 4, 120.0  # a device saying `online` this often this quickly is said: two with one id?


class RegistryWriter(Protocol):
    def write_registry(self, registry: Mapping[str, Any]) -> str: ...


class Registry:
    """The registered and online devices of the fleet."""

    def __init__(self) -> None:
        self.registered: dict[str, Registration] = {}
        self.online: set[str] = set()
        self.available: set[str] = set()  # online and registered
        self.file: str | None = None  # the registry file state.json names (None: nobody registered)
        self.dirty = False  # a registration changed since the file was last written
        self._written: dict[str, Registration] = {}  # what that file holds
        self._changes = 0  # changes to `registered` in this process: when _median is out of date
        self._median: tuple[int, float | None] = (-1, None)  # (changes it counts, median n_samples)
        self._onlines: dict[str, tuple[float, int]] = {}  # device -> (its window's first `online`, how many since)

    def resume(self, registry: Mapping[str, Mapping[str, Any]], file: str | None, inline: bool) -> None:
        """The registrations of a checkpoint; `inline`: a state.json of before the registry had a file (the next
        registry commit moves them into one)."""
        self.registered = {device: Registration(**entry) for device, entry in registry.items()}
        self.file, self._written = file, dict(self.registered) if file else {}
        self.dirty = inline

    def register(self, device: str, entry: Registration) -> bool:
        """Record the device's registration (it replaces an earlier one); whether it changed anything."""
        if device in self.online:
            self.available.add(device)
        if self.registered.get(device) == entry:
            return False
        self.registered[device] = entry
        self.dirty, self._changes = True, self._changes + 1
        return True

    def unregister(self, device: str) -> bool:
        """The device left the fleet; whether it was registered."""
        self.available.discard(device)
        if self.registered.pop(device, None) is None:
            return False
        self.dirty, self._changes = True, self._changes + 1
        return True

    def presence(self, device: str, online: bool, now: float) -> bool:
        """The device said online or offline; whether it is now available (registered and online)."""
        if not online:
            self.online.discard(device)
            self.available.discard(device)
            return False
        self.online.add(device)
        self._count_online(device, now)
        if device in self.registered:
            self.available.add(device)
            return True
        return False

    def median_samples(self) -> float | None:
        """The registered devices' median n_samples (None: nobody registered), recomputed only once a
        registration changed: a weight cap per asynchronous version must not cost a pass over the fleet."""
        if self._median[0] != self._changes:
            counts = [entry.n_samples for entry in self.registered.values()]
            self._median = (self._changes, float(np.median(counts)) if counts else None)
        return self._median[1]

    def in_file(self, device: str) -> bool:
        """Whether the registry file holds the device's registration as it is now."""
        return self._written.get(device) == self.registered.get(device)

    def write(self, writer: RegistryWriter) -> None:
        """The registry file, if a registration changed since it was written."""
        if self.dirty:
            self.file = writer.write_registry({device: entry.to_json() for device, entry in self.registered.items()})
            self._written, self.dirty = dict(self.registered), False

    def _count_online(self, device: str, now: float) -> None:
        """A device connects once and stays; one that says `online` ONLINE_BURST times within ONLINE_WINDOW_S is
        most likely two agents with one client id, each connect taking the connection over from the other: said
        once a window."""
        first, count = self._onlines.get(device, (now, 0))
        first, count = (first, count + 1) if now - first <= ONLINE_WINDOW_S else (now, 1)
        self._onlines[device] = (first, count)
        if count == ONLINE_BURST:
            log.warning("device %s came online %d times in %.0f s: are two agents running with --client-id %s? "
                        "Each connect takes the connection over from the other (or its network keeps dropping); "
                        "give each device its own id", device, count, now - first, device)


class FleetView:
    """What a strategy may know of the fleet (strategies.base.Fleet): who is registered, and how rounds are sized
    (`drawn_from(invited, round)`: how many devices a round's invitations were drawn from)."""

    def __init__(self, registry: Registry, clients_per_round: int | None,
                 drawn_from: Callable[[Set[str], int], int]) -> None:
        self._registry, self._m, self._drawn_from = registry, clients_per_round, drawn_from

    @property
    def registered(self) -> Mapping[str, Registration]:
        return self._registry.registered

    def round_size(self) -> int:
        """The updates a round closes at: M with --clients-per-round, else every registered device; DP-FedAvg's
        data-independent denominator m, whoever actually answered."""
        return max(1, self._m or len(self._registry.registered))

    def invited_fraction(self, closed: RoundRecord) -> float:
        """The accountant's q: with --clients-per-round, invited / the devices they were drawn from (eligible now
        or invited), sampled without replacement (docs/privacy.md); else 1."""
        if self._m is None:
            return 1.0
        return min(1.0, max(len(closed.invited), 1) / max(self._drawn_from(closed.invited, closed.number), 1))

    def median_samples(self) -> float | None:
        return self._registry.median_samples()


def registration(payload: bytes, digest: str, max_samples: int) -> Registration:
    """A Register message checked (every field; this export; n_j within --max-samples-per-device): WireError if not."""
    msg = Register.decode(payload)  # every field checked: n_samples an integer in 1..2**53-1
    if msg.base_digest != digest:
        raise WireError("digest_mismatch", f"manifest base_digest {msg.base_digest} is not the coordinator's "
                        f"{digest}: use the same export")
    if msg.n_samples > max_samples:
        raise WireError("too_many_samples", f"n_samples {msg.n_samples} is above the coordinator's "
                        f"--max-samples-per-device {max_samples}: not registered")
    return Registration(msg.n_samples, msg.software)


def says_online(payload: bytes) -> bool:
    """A presence message: online, or offline (b"": the retained presence cleared); WireError otherwise."""
    status = bytes(payload)
    if status not in (b"online", b"offline", b""):
        raise WireError("bad_message", f"presence must be online or offline, got {len(status)} other bytes")
    return status == b"online"
