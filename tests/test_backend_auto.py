"""Where onnxruntime-training is not installed (Linux aarch64, Python 3.13): the agent trains with torch and says so,
`--backend ort` and `fedper-export` say in one line why not, and the coordinator and the emulator run as usual.

Every command runs as its console script in a subprocess whose sitecustomize makes `import onnxruntime` fail as on
a machine without the package (its sys.modules entry is None), torch too where a test says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import agent_args, coordinator_args, finish, write_device_data
from safetensors.numpy import load_file

BIN = Path(sys.executable).parent
TORCH_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")


def blocking(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which importing any of `modules` raises ModuleNotFoundError."""
    folder = tmp_path / f"without-{'-'.join(modules)}"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        f"import sys\n\nfor name in {modules!r}:\n    sys.modules[name] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def run(env: dict[str, str], command: str, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / command), *args], env=env, capture_output=True, text=True, timeout=timeout)


def unreadable_data(tmp_path: Path) -> Path:
    """An .npz that exists (so --data passes its path check) but holds no data set: the run ends at loading it."""
    path = tmp_path / "data.npz"
    np.savez(path, nothing=np.zeros(1))
    return path


def stderr_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What the command printed on stderr, torch's own log lines ("W1127 02:51:40.115000 25811 torch/...") left out."""
    return [line for line in result.stderr.splitlines() if line.strip() and not TORCH_LOG.match(line)]


def test_the_block_works(tmp_path: Path) -> None:
    """The environment the other tests use really hides onnxruntime (and only what it names)."""
    env = blocking(tmp_path, "onnxruntime")
    probe = "import torch\ntry:\n    import onnxruntime.training\nexcept ImportError:\n    print('no')"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout == "no\n"


@pytest.mark.parametrize("command", ["fedper", "fedper-coordinator", "fedper-emulate", "fedper-agent",
                                     "fedper-export"])
def test_every_command_starts_without_onnxruntime(tmp_path: Path, command: str) -> None:
    result = run(blocking(tmp_path, "onnxruntime"), command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_agent_backend_ort_without_onnxruntime_says_why_in_one_line(tmp_path: Path, tiny_artifacts: Path) -> None:
    result = run(blocking(tmp_path, "onnxruntime"), "fedper-agent", *agent_args(
        tiny_artifacts, unreadable_data(tmp_path), "mqtt://127.0.0.1:9", "f", "dev0", tmp_path / "state",
        "--backend", "ort")[2:])
    assert result.returncode == 2, result.stderr
    (line,) = stderr_lines(result)
    assert "--backend ort: onnxruntime-training is not installed" in line
    assert "Linux x86-64 and macOS" in line and "--backend torch" in line


def test_agent_without_any_runtime_says_so(tmp_path: Path, tiny_artifacts: Path) -> None:
    """An Intel Mac with Python 3.13 has neither: one line, exit 2, nothing imported on the way fails first."""
    result = run(blocking(tmp_path, "onnxruntime", "torch"), "fedper-agent", *agent_args(
        tiny_artifacts, unreadable_data(tmp_path), "mqtt://127.0.0.1:9", "f", "dev0", tmp_path / "state")[2:])
    assert result.returncode == 2, result.stderr
    (line,) = stderr_lines(result)
    assert "--backend auto: neither onnxruntime-training nor torch is installed" in line


def test_agent_auto_picks_onnxruntime_where_it_is_installed(tmp_path: Path, tiny_artifacts: Path) -> None:
    """Here it is: the first line says so (data that holds no data set then ends the run, after it)."""
    result = run(dict(os.environ), "fedper-agent", *agent_args(
        tiny_artifacts, unreadable_data(tmp_path), "mqtt://127.0.0.1:9", "f", "dev0", tmp_path / "state")[2:])
    assert result.returncode == 2, result.stderr
    lines = stderr_lines(result)
    assert lines[0].startswith("fedper-agent: training with onnxruntime-training 1.19"), lines
    assert lines[0].endswith("(--backend auto)")
    assert "data.npz" in lines[-1]


def test_export_without_onnxruntime_says_why_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "artifacts"
    result = run(blocking(tmp_path, "onnxruntime"), "fedper-export", "--model", "mobilenet_v1", "--num-classes", "3",
                 "--width", "0.25", "--out", str(out))
    assert result.returncode == 2, result.stderr
    (line,) = stderr_lines(result)
    assert "fedper-export needs onnxruntime-training, which is not installed" in line
    assert "torch backend" in line
    assert not out.exists()


@pytest.mark.timeout(600)
def test_export_on_torch_older_than_2_4_says_why_in_one_line(tmp_path: Path) -> None:
    """An Intel Mac's torch (2.2.2, the last build there) has no torch.onnx.export(dynamo=...): one line, exit 2.
    The version is the only thing changed here (a sitecustomize sets it), the rest is this machine's torch."""
    folder = tmp_path / "old-torch"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import torch\n\ntorch.__version__ = '2.2.2'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "artifacts"
    result = run(env, "fedper-export", "--model", "mobilenet_v1", "--num-classes", "3", "--width", "0.25",
                 "--out", str(out))
    assert result.returncode == 2, result.stderr
    (line,) = stderr_lines(result)
    assert "fedper-export needs torch >= 2.4" in line and "this is torch 2.2.2" in line
    assert not out.exists()


@pytest.mark.timeout(600)
def test_the_emulator_runs_without_onnxruntime(tmp_path: Path) -> None:
    """Its manifest records the libraries it ran with; onnxruntime is not one of them here."""
    out = tmp_path / "run"
    result = run(blocking(tmp_path, "onnxruntime"), "fedper-emulate", "run", "--dataset", "digits", "--clients", "2",
                 "--classes-per-client", "2", "--input-size", "16", "--width", "0.25", "--batch-size", "16",
                 "--rounds", "1", "--scale", "0.2", "--device", "cpu", "--out", str(out), "--no-progress",
                 timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "config.json").is_file()


@pytest.mark.mosquitto
@pytest.mark.timeout(600)
def test_an_agent_without_onnxruntime_trains_a_round_with_torch(tmp_path: Path, tiny_artifacts: Path, mosquitto,
                                                                processes) -> None:
    """--backend auto (the default) on a device without onnxruntime-training: the torch backend, a real round
    through Mosquitto against a coordinator that has neither onnxruntime nor torch (an Intel Mac, Python 3.13)."""
    env = blocking(tmp_path, "onnxruntime")
    data = write_device_data(tmp_path / "device.npz", (0, 1, 2, 3), 40)
    state = tmp_path / "coordinator"
    command = [sys.executable, *coordinator_args(tiny_artifacts, mosquitto.url, state, "noort", 1, 1, 120)]
    with open(tmp_path / "coordinator.log", "wb") as log:
        coordinator = subprocess.Popen(command, env=blocking(tmp_path, "onnxruntime", "torch", "torchvision"),
                                       stdout=log, stderr=subprocess.STDOUT)
    processes.procs.append(coordinator)
    agent = subprocess.run(
        [str(BIN / "fedper-agent"), *agent_args(tiny_artifacts, data, mosquitto.url, "noort", "dev0",
                                                tmp_path / "agent")[2:]],
        env=env, capture_output=True, text=True, timeout=580)
    coordinator_log = (tmp_path / "coordinator.log").read_text()
    assert agent.returncode == 0, agent.stderr[-3000:] + coordinator_log[-2000:]
    assert finish(coordinator, 60, "the coordinator", coordinator_log) == 0
    lines = stderr_lines(agent)
    assert lines[0].startswith("fedper-agent: training with torch ")
    assert "(--backend auto: onnxruntime-training is not installed) on " in lines[0]
    assert lines[0].endswith("(--device auto)")  # and where it trains: the CPU here, CUDA where torch sees a GPU
    assert any("finished after 1 rounds" in line for line in lines), lines
    final = load_file(str(state / "final.safetensors"))
    initial = load_file(str(tiny_artifacts / "base.safetensors"))
    assert set(final) == set(initial)
    assert max(float(np.abs(final[n] - initial[n]).max()) for n in final) > 1e-4  # the round trained the base
