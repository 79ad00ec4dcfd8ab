"""When a device may take part in a round: `fedper-agent --only-when COND` (repeatable).

A phone trains only on power, idle and on an unmetered network (docs/devices.md); a Linux device
says the same with these conditions, checked in the order given, before the agent accepts a round:

- `power`: on external power: a Mains or USB power supply reports `online` 1, or a system battery
  reports `status` Charging or Full (Linux /sys/class/power_supply). A device with no system
  battery (a Jetson on its barrel jack, a desktop) counts as on power.
- `battery>=N`: the mean `capacity` (percent) of the system batteries is at least N; with no
  system battery there is nothing to drain, so it holds.
- `idle>=F`: the fraction of CPU time spent idle (idle + iowait in /proc/stat) over a short window
  (IDLE_WINDOW_S) is at least F. Not the load average: it lags a minute behind and counts tasks
  waiting on disk, so a device that just started a game would still look idle.
- `command:CMD`: `sh -c CMD` exits 0 within COMMAND_TIMEOUT_S (e.g. a check that the network is
  unmetered); any other status, or the timeout, says no. Its output is discarded.

Batteries of peripherals (a mouse's, a headset's: `scope` Device) are not the device's and are
ignored. Each condition reads files under a root (`/sys`, `/proc`) given to it, so tests build
those trees in a temporary directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IDLE_WINDOW_S = 0.5
COMMAND_TIMEOUT_S = 10.0
EXTERNAL_TYPES = ("Mains", "USB")  # and USB_* (USB_C, USB_PD, ... on older kernels)
ON_POWER_STATUSES = ("Charging", "Full")


@dataclass(frozen=True)
class PowerSupply:
    """One entry of /sys/class/power_supply, with the attributes the conditions read."""

    name: str
    type: str
    online: bool | None  # Mains/USB: plugged in
    status: str | None  # Battery: Charging, Discharging, Full, Not charging, Unknown
    capacity: float | None  # Battery: percent
    scope: str | None  # "Device" for a peripheral's battery

    @property
    def external(self) -> bool:
        return self.type in EXTERNAL_TYPES or self.type.startswith("USB_")

    @property
    def system_battery(self) -> bool:
        return self.type == "Battery" and self.scope != "Device"


def _attribute(directory: Path, name: str) -> str | None:
    try:
        return (directory / name).read_text().strip()
    except OSError:  # absent, or a driver that fails to read it: the attribute is unknown
        return None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def power_supplies(sys_root: Path) -> list[PowerSupply]:
    """Every power supply under <sys_root>/class/power_supply, by name."""
    base = sys_root / "class" / "power_supply"
    if not base.is_dir():
        return []
    supplies = []
    for directory in sorted(base.iterdir()):
        kind = _attribute(directory, "type")
        if kind is None:
            continue
        online = _number(_attribute(directory, "online"))
        supplies.append(PowerSupply(
            name=directory.name, type=kind, online=None if online is None else online > 0,
            status=_attribute(directory, "status"), capacity=_number(_attribute(directory, "capacity")),
            scope=_attribute(directory, "scope"),
        ))
    return supplies


def power_problem(sys_root: Path) -> str | None:
    """None on external power (or without a system battery); otherwise why not."""
    supplies = power_supplies(sys_root)
    batteries = [s for s in supplies if s.system_battery]
    if any(s.external and s.online for s in supplies) or not batteries:
        return None
    if any(s.status in ON_POWER_STATUSES for s in batteries):
        return None
    statuses = ", ".join(f"{s.name} {s.status or 'status unknown'}" for s in batteries)
    return f"on battery ({statuses})"


def battery_problem(sys_root: Path, minimum: float) -> str | None:
    """None when the system batteries' mean capacity is at least `minimum` percent (or there is none)."""
    capacities = [s.capacity for s in power_supplies(sys_root) if s.system_battery and s.capacity is not None]
    if not capacities:
        return None
    level = sum(capacities) / len(capacities)
    return None if level >= minimum else f"battery at {level:.0f} %, below {minimum:g} %"


@dataclass(frozen=True)
class CpuTimes:
    """The aggregate `cpu` line of /proc/stat, in clock ticks."""

    idle: int  # idle + iowait
    total: int


def cpu_times(proc_root: Path) -> CpuTimes:
    """Read /proc/stat's first line: user nice system idle iowait irq softirq steal (guest time is
    already inside user and nice, so it is not added again)."""
    for line in (proc_root / "stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(x) for x in fields[1:9]]
            return CpuTimes(idle=ticks[3] + (ticks[4] if len(ticks) > 4 else 0), total=sum(ticks))
    raise ValueError(f"{proc_root / 'stat'} has no aggregate cpu line")


def idle_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """Share of the CPU time between two samples spent idle; 1.0 when no tick passed."""
    spent = after.total - before.total
    return 1.0 if spent <= 0 else (after.idle - before.idle) / spent


def idle_problem(proc_root: Path, minimum: float, window_s: float = IDLE_WINDOW_S,
                 sleep: Callable[[float], None] = time.sleep) -> str | None:
    """None when the CPUs were idle at least `minimum` of the next `window_s` seconds."""
    before = cpu_times(proc_root)
    sleep(window_s)
    idle = idle_fraction(before, cpu_times(proc_root))
    return None if idle >= minimum else f"CPU {idle:.0%} idle, below {minimum:.0%}"


def command_problem(command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str | None:
    """None when `sh -c command` exits 0 within `timeout_s`; on a timeout its whole process group
    is killed (it runs in a session of its own, so nothing it started outlives the check)."""
    process = subprocess.Popen(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        status = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"`{command}` did not finish in {timeout_s:g} s"
    return None if status == 0 else f"`{command}` exited {status}"


@dataclass(frozen=True)
class Conditions:
    """The parsed `--only-when` conditions and where to read them; `problem()` checks them in order."""

    specs: tuple[str, ...] = ()
    sys_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    command_timeout_s: float = COMMAND_TIMEOUT_S
    idle_window_s: float = IDLE_WINDOW_S

    def __post_init__(self) -> None:
        for spec in self.specs:
            self._checker(spec)  # a typo fails at start, not at the first round

    def problem(self) -> str | None:
        """None when every condition holds; else the first that does not, and why."""
        for spec in self.specs:
            problem = self._checker(spec)()
            if problem is not None:
                return f"{spec}: {problem}"
        return None

    def _checker(self, spec: str) -> Callable[[], str | None]:
        if spec == "power":
            return lambda: power_problem(self.sys_root)
        if spec.startswith("battery>="):
            level = _bounded(spec, spec.removeprefix("battery>="), 0, 100)
            return lambda: battery_problem(self.sys_root, level)
        if spec.startswith("idle>="):
            share = _bounded(spec, spec.removeprefix("idle>="), 0, 1)
            return lambda: idle_problem(self.proc_root, share, self.idle_window_s)
        if spec.startswith("command:") and spec.removeprefix("command:").strip():
            return lambda: command_problem(spec.removeprefix("command:"), self.command_timeout_s)
        raise ValueError(f"--only-when {spec!r}: expected power, battery>=N (percent), idle>=F (0..1) "
                         "or command:CMD")


def _bounded(spec: str, text: str, low: float, high: float) -> float:
    value = _number(text)
    if value is None or not low <= value <= high:
        raise ValueError(f"--only-when {spec!r}: {text!r} is not a number in [{low:g}, {high:g}]")
    return value

