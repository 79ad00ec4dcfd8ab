"""Devices on a simulated clock: how long each one takes to train and upload, and when it is online.

A fleet's devices come from a trace in FedScale's format (Lai et al., "FedScale", ICML 2022; the format of its
device traces, docs/reproducing.md "Figure async"): two maps keyed by client id,

    client_device_capacity  {id: {"computation": ms per sample, one inference; "communication": kbit/s}}
    client_behave_trace     {id: {"active": [s], "inactive": [s], "finish_time": s, "duration": s, "model": str}}

held here in one JSON object under those two names. FedScale ships each map as a pickle; this module reads
JSON only (loading a pickle runs whatever it holds). The semantics are FedScale's:

- training one sample for one epoch costs 3 x "computation" ms (a forward pass and a backward pass of about
  twice its cost: FedScale's augmentation factor), so a device with n samples and E epochs trains for
  3 * computation / 1000 * n * E seconds;
- moving b bytes costs 8 * b / 1000 / "communication" seconds (download and upload alike);
- a device is online at time t when active[i] <= t mod finish_time < inactive[i] for some i: its spells
  repeat with period finish_time (FedScale includes the end too; excluding it means a device is never
  invited at the instant it leaves).

A device whose job (download, training, upload) would run past the end of its online spell drops out when
the spell ends: its work is lost and nothing is uploaded.

The synthetic trace shipped as emulate/traces/synthetic.json was drawn by `synthetic_trace` (its generator:
`python -m fedper.emulate.traces.generate`) from this distribution, per device and independently:

    computation    log-normal, median 10 ms per sample, sigma 1.0 (a factor of e between the median device and
                   one sigma away; Papaya and FedScale model device speed as log-normal)
    communication  log-normal, median 5,000 kbit/s, sigma 0.5
    availability   alternating online and offline spells of exponential length, means 20 and 5 minutes, the
                   first one online with probability 20/25 (the long-run share), over 8 hours (finish_time);
                   spell ends rounded to whole seconds as FedScale's are
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

CAPACITY, BEHAVIOUR = "client_device_capacity", "client_behave_trace"  # FedScale's names for its two maps
TRAINING_FACTOR = 3.0  # FedScale: training a sample costs 3 inferences (forward + backward)
SHIPPED = "synthetic.json"  # package data of fedper.emulate.traces


@dataclass(frozen=True)
class Device:
    """One device's speeds and its online spells [start, end] within one period (sorted, disjoint)."""

    seconds_per_sample: float  # training one sample for one epoch
    kbps: float
    spells: tuple[tuple[float, float], ...]
    period: float

    def job_seconds(self, samples: int, epochs: int, download_bytes: int, upload_bytes: int) -> float:
        """Download, local training and upload, back to back."""
        transfer = 8.0 * (download_bytes + upload_bytes) / 1000.0 / self.kbps
        return transfer + self.seconds_per_sample * samples * epochs

    def _spell(self, t: float) -> tuple[float, int]:
        """(the start of t's period, the index of the last spell starting at or before t in it; -1 if none)."""
        base = math.floor(t / self.period) * self.period
        return base, bisect.bisect_right([start for start, _ in self.spells], t - base) - 1

    def online(self, t: float) -> bool:
        base, i = self._spell(t)
        return i >= 0 and t - base < self.spells[i][1]

    def next_online(self, t: float) -> float:
        """The first time >= t at which the device is online (inf if it never is)."""
        if not self.spells:
            return math.inf
        if self.online(t):
            return t
        base, i = self._spell(t)
        return base + self.spells[i + 1][0] if i + 1 < len(self.spells) else base + self.period + self.spells[0][0]

    def longest_online(self) -> float:
        """The longest time the device stays online (inf if it never leaves; 0 if it never comes)."""
        return max((self.online_until(start) - start for start, _ in self.spells), default=0.0)

    def online_until(self, t: float) -> float:
        """The end of the online spell that holds t (inf if the device never goes offline); t must be online."""
        base, i = self._spell(t)
        end = base + self.spells[i][1]
        if self.spells[i][1] >= self.period and self.spells[0][0] <= 0:  # the spell runs on into the next period
            if len(self.spells) == 1:
                return math.inf
            end = base + self.period + self.spells[0][1]
        return end


def _number(value: Any, what: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
    return float(value)


def _field(body: Any, key: str, where: str) -> float:
    return _number(body.get(key) if isinstance(body, Mapping) else None, f"{where}: {key!r}")


def device_from_trace(capacity: Mapping[str, Any], behaviour: Mapping[str, Any], where: str) -> Device:
    """One client's entries of the two maps as a Device; ValueError naming `where` if they are malformed."""
    period = _field(behaviour, "finish_time", where)
    active, inactive = behaviour.get("active"), behaviour.get("inactive")
    if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
        raise ValueError(f"{where}: 'active' and 'inactive' must be lists of the same length")
    spells = []
    for i, (start, end) in enumerate(zip(active, inactive, strict=True)):
        start, end = _number(start, f"{where}: active[{i}]", False), _number(end, f"{where}: inactive[{i}]", False)
        if end < start:
            raise ValueError(f"{where}: spell {i} ends at {end} before it starts at {start}")
        if start < period:
            spells.append((start, min(end, period)))
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spells):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return Device(TRAINING_FACTOR * _field(capacity, "computation", where) / 1000.0,
                  _field(capacity, "communication", where), tuple(merged), period)


def fleet_from_trace(trace: Mapping[str, Any], n_devices: int) -> list[Device]:
    """The first `n_devices` clients of the trace in order of their ids (numerically when they are numbers)."""
    if not isinstance(trace, Mapping) or not all(isinstance(trace.get(k), Mapping) for k in (CAPACITY, BEHAVIOUR)):
        raise ValueError(f"a trace is a JSON object with the maps {CAPACITY!r} and {BEHAVIOUR!r} (FedScale's)")
    ids = sorted(set(trace[CAPACITY]) & set(trace[BEHAVIOUR]), key=lambda k: (not k.isdigit(), int(k) if k.isdigit()
                                                                              else 0, k))
    if len(ids) < n_devices:
        raise ValueError(f"the trace describes {len(ids)} client(s) in both maps, fewer than the {n_devices} devices")
    return [device_from_trace(trace[CAPACITY][k], trace[BEHAVIOUR][k], f"trace client {k}") for k in ids[:n_devices]]


def load_trace(path: str | Path | None) -> dict[str, Any]:
    """A trace file (JSON), or the shipped synthetic trace for None; OSError or ValueError (one line) otherwise."""
    if path is None:
        return json.loads(resources.files("fedper.emulate.traces").joinpath(SHIPPED).read_text())
    try:
        return json.loads(Path(path).read_bytes())
    except ValueError as e:  # not JSON, or not text at all
        raise ValueError(f"{path} is not a JSON trace ({e}); convert a FedScale pickle first "
                         f"(docs/reproducing.md)") from None


def synthetic_trace(n_devices: int, seed: int, *, median_ms: float = 10.0, sigma: float = 1.0,
                    median_kbps: float = 5000.0, kbps_sigma: float = 0.5, mean_online_s: float = 1200.0,
                    mean_offline_s: float = 300.0, horizon_s: int = 8 * 3600) -> dict[str, Any]:
    """A trace in FedScale's format drawn from the distribution of the module's docstring (ids "0", "1", ...)."""
    rng = np.random.default_rng(seed)
    capacity, behaviour = {}, {}
    for j in range(n_devices):
        computation = median_ms * math.exp(sigma * rng.standard_normal())
        communication = median_kbps * math.exp(kbps_sigma * rng.standard_normal())
        capacity[str(j)] = {"computation": round(computation, 3), "communication": round(communication, 1)}
        active, inactive = [], []
        online = rng.random() < mean_online_s / (mean_online_s + mean_offline_s)
        t = 0.0
        while t < horizon_s:
            end = min(t + rng.exponential(mean_online_s if online else mean_offline_s), horizon_s)
            if online and round(end) > round(t):
                active.append(round(t))
                inactive.append(round(end))
            t, online = end, not online
        behaviour[str(j)] = {"duration": horizon_s, "inactive": inactive, "finish_time": horizon_s, "active": active,
                             "model": "synthetic"}
    return {CAPACITY: capacity, BEHAVIOUR: behaviour}
