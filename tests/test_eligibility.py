"""`fedper-agent --only-when`: the conditions read real files, laid out in a temporary directory
as Linux lays out /sys/class/power_supply and /proc/stat, and run real shell commands."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedper.edge.eligibility import Conditions, cpu_times, idle_fraction, idle_problem, power_supplies

STAT_LINE = "cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\n"


def supply(sys_root: Path, name: str, **attributes: object) -> None:
    """One power supply directory with its attribute files (one value a file, newline-terminated)."""
    directory = sys_root / "class" / "power_supply" / name
    directory.mkdir(parents=True)
    for attribute, value in attributes.items():
        (directory / attribute).write_text(f"{value}\n")


def write_stat(proc_root: Path, user: int, system: int, idle: int, iowait: int) -> None:
    proc_root.mkdir(exist_ok=True)
    (proc_root / "stat").write_text(STAT_LINE.format(user=user, system=system, idle=idle, iowait=iowait)
                                    + "cpu0 1 2 3 4 5 6 7 8 0 0\nintr 12345\nctxt 678\n")


def conditions(tmp_path: Path, *specs: str, **options: object) -> Conditions:
    return Conditions(specs, sys_root=tmp_path / "sys", proc_root=tmp_path / "proc", **options)


# ------------------------------------------------------------ power and battery


def test_a_laptop_on_battery_is_not_on_power_and_plugged_in_it_is(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    supply(sys_root, "AC", type="Mains", online=0)
    supply(sys_root, "BAT0", type="Battery", status="Discharging", capacity=64, scope="System")
    problem = conditions(tmp_path, "power").problem()
    assert problem == "power: on battery (BAT0 Discharging)"

    (sys_root / "class/power_supply/AC/online").write_text("1\n")
    assert conditions(tmp_path, "power").problem() is None


@pytest.mark.parametrize("status", ["Charging", "Full"])
def test_a_charging_or_full_battery_means_external_power_without_a_mains_entry(tmp_path: Path, status: str) -> None:
    supply(tmp_path / "sys", "battery", type="Battery", status=status, capacity=90)  # a phone-style tree
    assert conditions(tmp_path, "power").problem() is None


def test_usb_power_counts_as_external(tmp_path: Path) -> None:
    supply(tmp_path / "sys", "BAT0", type="Battery", status="Not charging", capacity=80)
    supply(tmp_path / "sys", "usb", type="USB", online=1)
    assert conditions(tmp_path, "power").problem() is None


@pytest.mark.parametrize("tree", ["no power_supply class", "mains only", "a peripheral's battery only"])
def test_a_device_without_a_system_battery_counts_as_on_power(tmp_path: Path, tree: str) -> None:
    sys_root = tmp_path / "sys"
    sys_root.mkdir()
    if tree == "mains only":
        supply(sys_root, "ACAD", type="Mains", online=0)
    if tree == "a peripheral's battery only":
        supply(sys_root, "hidpp_battery_0", type="Battery", status="Discharging", capacity=5, scope="Device")
    assert conditions(tmp_path, "power", "battery>=50").problem() is None


def test_battery_level_is_the_mean_of_the_system_batteries(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    supply(sys_root, "BAT0", type="Battery", status="Discharging", capacity=30)
    supply(sys_root, "BAT1", type="Battery", status="Discharging", capacity=60)
    supply(sys_root, "mouse", type="Battery", status="Discharging", capacity=1, scope="Device")
    assert [s.name for s in power_supplies(sys_root)] == ["BAT0", "BAT1", "mouse"]
    assert conditions(tmp_path, "battery>=45").problem() is None
    assert conditions(tmp_path, "battery>=46").problem() == "battery>=46: battery at 45 %, below 46 %"


def test_conditions_are_checked_in_order_and_the_first_failure_is_reported(tmp_path: Path) -> None:
    supply(tmp_path / "sys", "BAT0", type="Battery", status="Discharging", capacity=20)
    assert conditions(tmp_path, "battery>=50", "power").problem().startswith("battery>=50: battery at 20 %")
    assert conditions(tmp_path, "power", "battery>=50").problem().startswith("power: on battery")
    assert conditions(tmp_path).problem() is None  # no condition: always eligible


# ------------------------------------------------------------ idle CPU


def test_cpu_times_and_idle_fraction_from_proc_stat(tmp_path: Path) -> None:
    proc_root = tmp_path / "proc"
    write_stat(proc_root, user=100, system=50, idle=800, iowait=50)
    before = cpu_times(proc_root)
    assert (before.idle, before.total) == (850, 1000)
    write_stat(proc_root, user=160, system=70, idle=900, iowait=70)  # 200 ticks later, 120 of them idle
    assert idle_fraction(before, cpu_times(proc_root)) == pytest.approx(0.6)
    assert idle_fraction(before, before) == 1.0  # no tick passed: nothing ran


@pytest.mark.parametrize(("busy_ticks", "eligible"), [(10, True), (60, False)])
def test_idle_is_measured_over_a_window(tmp_path: Path, busy_ticks: int, eligible: bool) -> None:
    """The check samples /proc/stat, waits the window, samples again; the second sample is written
    while it waits, as the kernel would update it."""
    proc_root = tmp_path / "proc"
    write_stat(proc_root, user=1000, system=0, idle=5000, iowait=0)
    waited: list[float] = []

    def window(seconds: float) -> None:
        waited.append(seconds)
        write_stat(proc_root, user=1000 + busy_ticks, system=0, idle=5000 + 100 - busy_ticks, iowait=0)

    problem = idle_problem(proc_root, 0.5, window_s=0.25, sleep=window)
    assert waited == [0.25]
    assert (problem is None) == eligible
    if not eligible:
        assert problem == "CPU 40% idle, below 50%"


def test_idle_on_this_machines_proc() -> None:
    """The real /proc/stat parses, and a zero threshold always holds."""
    assert Conditions(("idle>=0",), idle_window_s=0.05).problem() is None
    times = cpu_times(Path("/proc"))
    assert 0 <= times.idle <= times.total


# ------------------------------------------------------------ commands


def test_a_command_decides_by_its_exit_status(tmp_path: Path) -> None:
    assert conditions(tmp_path, "command:true").problem() is None
    assert conditions(tmp_path, "command:false").problem() == "command:false: `false` exited 1"
    assert conditions(tmp_path, "command:exit 3").problem() == "command:exit 3: `exit 3` exited 3"
    marker = tmp_path / "on-wifi"
    check = conditions(tmp_path, f"command:test -e {marker}")
    assert check.problem() is not None
    marker.touch()
    assert check.problem() is None


def test_a_command_that_hangs_times_out_and_leaves_nothing_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    check = conditions(tmp_path, f"command:sleep 30 & echo $! > {pid_file}; wait", command_timeout_s=0.5)
    started = time.monotonic()
    problem = check.problem()
    assert time.monotonic() - started < 5
    assert problem is not None and "did not finish in 0.5 s" in problem
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while is_running(child) and time.monotonic() < deadline:  # killed with its process group
        time.sleep(0.05)
    assert not is_running(child)


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------ parsing


@pytest.mark.parametrize("spec", ["charging", "battery>=101", "battery>=x", "idle>=1.5", "idle>0.5", "command:",
                                  "command:  "])
def test_a_condition_that_does_not_parse_is_refused_at_start(spec: str) -> None:
    with pytest.raises(ValueError, match="--only-when"):
        Conditions((spec,))
