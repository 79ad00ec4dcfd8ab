"""The distribution installs everything under the one `fedper` namespace, and every command has help."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_puts_every_module_under_fedper(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "runs", "build", "*.egg-info"))
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*pip_wheel, str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("fedper_edge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    stray = [n for n in names if n.endswith(".py") and not n.startswith("fedper/")]
    assert not stray
    for package in ("models", "export", "edge", "coordinator", "emulate", "data", "cli"):
        assert f"fedper/{package}/__init__.py" in names
    assert not any(n.startswith("tests/") for n in names)
    assert "fedper/emulate/traces/synthetic.json" in names  # package data: the emulator's default device trace


@pytest.mark.parametrize(
    "command", ["fedper", "fedper-export", "fedper-agent", "fedper-coordinator", "fedper-emulate"]
)
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run([Path(sys.executable).parent / command, "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


@pytest.mark.parametrize("module", ["fedper.export.cli", "fedper.edge.cli", "fedper.coordinator.cli",
                                    "fedper.emulate.cli"])
def test_every_role_runs_as_a_module(module: str) -> None:
    """`python -m fedper.<role>.cli` is what a board without the console scripts on its PATH runs."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "Usage" in result.stdout, result.stderr
