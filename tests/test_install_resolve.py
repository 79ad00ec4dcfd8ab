"""`pip install fedper-edge` resolves wherever a device has Python: pip's own resolver, asked for the package's
dependency closure on each platform tag and Python version, from binary wheels on PyPI only.

pip evaluates environment markers against the interpreter that runs it, whatever --platform and --python-version
say (a dry run for aarch64 from an x86-64 host would pull x86-64-only dependencies), so each resolve runs pip with
its marker environment replaced by the target's. The expectations come from the index, not from the markers:
onnxruntime-training and torch must be in a closure exactly where PyPI lists a wheel of them that the target
accepts (`packaging.tags`, the tag rules pip vendors).

All the resolves run at once: each one waits mostly on the network (one resolve made about 1,200 HTTP requests,
most of them range requests for 89 wheels' metadata; 80 s of wall time for 12 s of CPU, alone), so the slowest
one sets the time. `make check-install` asks for twice as many. They run once per test run, in the background
from the session's start (tests/conftest.py) and at the lowest CPU priority, in whichever pytest-xdist worker
takes them first; the tests read that worker's answer.

Skipped when PyPI is not reachable, or when pip is older than 25.3 (older ones download every wheel of a
--dry-run: gigabytes of torch and CUDA libraries).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging import tags
from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
# The Pythons on each side of onnxruntime-training's last wheel (3.12); FEDPER_RESOLVE_ALL=1 (make check-install)
# asks for 3.10-3.13 and both Pi Pythons, which takes twice as long.
ALL = os.environ.get("FEDPER_RESOLVE_ALL") == "1"
PYTHONS = ("3.10", "3.11", "3.12", "3.13") if ALL else ("3.12", "3.13")
EXTRAS = "coordinator,emulate,privacy"  # the device install plus every extra a user installs (not dev)
PI_TORCH = "torch<2.11"  # deploy/README.md's advice for a Raspberry Pi: 2.10 is PyPI's last CPU-only aarch64 torch
PI_PYTHONS = ("3.11", "3.13") if ALL else ("3.11",)  # Raspberry Pi OS bookworm's and trixie's

# pip runs at the lowest CPU priority: the resolves run beside the rest of the suite (conftest starts them first).
LOW_PRIORITY = ["nice", "-n", "19"] if shutil.which("nice") else []
# Runs pip with the target's marker environment: `python -c PIP_AS_TARGET '{"platform_machine": ...}' install ...`.
PIP_AS_TARGET = """
import json, runpy, sys
from pip._vendor.packaging import markers
target = json.loads(sys.argv.pop(1))
host = markers.default_environment
markers.default_environment = lambda: {**host(), **target}
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def manylinux(arch: str) -> tuple[str, ...]:
    """A glibc 2.28 system (Debian 10, RHEL 8; torch's aarch64 wheels need 2.28): every tag it accepts."""
    return (*(f"manylinux_2_{minor}_{arch}" for minor in range(28, 16, -1)), f"manylinux2014_{arch}")


@dataclass(frozen=True)
class Platform:
    tags: tuple[str, ...]  # pip --platform values (pip widens a macOS tag to older versions and universal2 itself)
    markers: dict[str, str]

    def accepts(self, wheel: str, python: str) -> bool:
        """Whether a CPython `python` on this platform installs the wheel file `wheel` (tags only)."""
        version = tuple(int(part) for part in python.split("."))
        if self.markers["sys_platform"] == "darwin":
            major, minor, arch = self.tags[0].split("_", 3)[1:]
            platforms = list(tags.mac_platforms((int(major), int(minor)), arch))
        else:
            platforms = list(self.tags)
        accepted = {*tags.cpython_tags(version, platforms=platforms),
                    *tags.compatible_tags(version, platforms=platforms)}
        return not accepted.isdisjoint(parse_wheel_filename(wheel)[3])


PLATFORMS = {
    "linux-x86_64": Platform(manylinux("x86_64"), {"sys_platform": "linux", "platform_system": "Linux",
                                                   "platform_machine": "x86_64"}),
    "linux-aarch64": Platform(manylinux("aarch64"), {"sys_platform": "linux", "platform_system": "Linux",
                                                     "platform_machine": "aarch64"}),
    "macos-arm64": Platform(("macosx_12_0_arm64",), {"sys_platform": "darwin", "platform_system": "Darwin",
                                                     "platform_machine": "arm64"}),  # macOS 12: onnx 1.17's floor
    "macos-x86_64": Platform(("macosx_12_0_x86_64",), {"sys_platform": "darwin", "platform_system": "Darwin",
                                                       "platform_machine": "x86_64"}),
}
TARGETS = [(name, python) for name in PLATFORMS for python in PYTHONS]
pytestmark = [pytest.mark.network, pytest.mark.long, pytest.mark.timeout(1200)]


def resolve(platform: str, python: str, requirements: list[str], workdir: Path) -> dict:
    """{"ok": True, "install": {name: version}} from pip's --dry-run report, or {"ok": False, "error": pip's words}."""
    target = PLATFORMS[platform]
    env = {**target.markers, "python_version": python, "python_full_version": f"{python}.0",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
    report = workdir / f"{platform}-{python}-{len(list(workdir.iterdir()))}.json"
    # --isolated: PyPI alone, no local index, find-links or constraint file from this machine's pip config.
    # fast-deps: metadata by HTTP range requests where the index does not serve it apart (PEP 658).
    command = [
        *LOW_PRIORITY, sys.executable, "-c", PIP_AS_TARGET, json.dumps(env), "install", "--isolated", "--dry-run",
        "--quiet", "--ignore-installed", "--only-binary=:all:", "--index-url", INDEX, "--use-feature=fast-deps",
        "--python-version", python, "--target", str(workdir / "never-written"), "--report", str(report),
        *(f"--platform={tag}" for tag in target.tags), *requirements,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        return {"ok": False, "error": " | ".join(errors) or done.stderr[-500:]}
    items = json.loads(report.read_text())["install"]
    return {"ok": True, "install": {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                                    for i in items}}


def wheels(project: str, version: str | None = None) -> list[dict]:
    """The index's wheel files of a project (PEP 691 JSON), of one version or all, yanked ones left out."""
    request = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    return [f for f in files if f["filename"].endswith(".whl") and not f.get("yanked")
            and (version is None or str(parse_wheel_filename(f["filename"])[1]) == version)]


def has_wheel(files: list[dict], platform: str, python: str) -> bool:
    """Whether one of `files` installs on the target (its tags and its Requires-Python)."""
    return any(PLATFORMS[platform].accepts(f["filename"], python)
               and SpecifierSet(f.get("requires-python") or "").contains(f"{python}.0") for f in files)


def pip_too_old() -> str | None:
    """Read from pip's metadata: importing pip turns off setuptools' distutils shim for the whole process, and a
    later import of setuptools (onnxruntime's start imports it through torch) then fails."""
    version = importlib.metadata.version("pip")
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < (25, 3):
        return f"pip {version} downloads every wheel of a --dry-run (pip >= 25.3 does not): pip install -U pip"
    return None


def resolve_all(work: Path) -> dict:
    """Every resolve this module asserts on, run at once (pip mostly waits on the network), and whether the index
    has a wheel of each runtime for each target. Raises OSError when the index cannot be read."""
    runtimes = {"onnxruntime-training-cpu": wheels("onnxruntime-training-cpu", "1.19.2"), "torch": wheels("torch")}
    source = work / "src"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "runs", "build", "*.egg-info"))
    subprocess.run([*LOW_PRIORITY, sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work), str(source)], check=True, capture_output=True)
    (wheel,) = work.glob("fedper_edge-*.whl")
    jobs = {("package", name, py): [f"fedper-edge[{EXTRAS}] @ {wheel.as_uri()}"] for name, py in TARGETS}
    jobs |= {("pi", "linux-aarch64", py): [f"fedper-edge @ {wheel.as_uri()}", PI_TORCH] for py in PI_PYTHONS}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {key: pool.submit(resolve, key[1], key[2], requirements, work) for key, requirements in jobs.items()}
        found = {key: future.result() for key, future in futures.items()}
    return {**found, **{(name, platform, py): has_wheel(files, platform, py)
                        for name, files in runtimes.items() for platform, py in TARGETS}}


def answer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the run's one answer lives: the folder every pytest-xdist worker of the run shares (their base temp's
    parent), or the session's base temp without xdist. Its lock is held while a resolve is under way."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "install-resolve.json"


def answer(work: Path) -> list | str:
    """resolve_all's answer as JSON, or why the module is skipped."""
    reason = pip_too_old()
    if reason:
        return reason
    try:
        found = resolve_all(work)
    except OSError as e:
        return f"{INDEX} is not reachable ({e})"
    return [[list(key), value] for key, value in found.items()]


def start_resolving(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Resolve in a background thread of this process unless another worker of the run does or did: conftest calls
    it as the session starts, so that pip's resolves (minutes, mostly waiting on the index, at the lowest CPU
    priority) use what the other tests leave idle, and no worker waits for them when this module's tests come."""
    path = answer_file(tmp_path_factory)
    lock = open(f"{path}.lock", "w")  # noqa: SIM115 (the thread closes it, which releases the lock)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return
    if path.exists():
        lock.close()
        return
    work = tmp_path_factory.mktemp("resolve")

    def resolve_and_release() -> None:
        with lock:
            path.write_text(json.dumps(answer(work)))

    threading.Thread(target=resolve_and_release, name="install-resolve", daemon=True).start()


@pytest.fixture(scope="session")
def closures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The answer of the run's resolve: it waits for the one under way (here or in another worker) or, when none
    ran (this module alone without conftest's start, or a worker that exited mid-resolve), resolves itself."""
    path = answer_file(tmp_path_factory)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(answer(tmp_path_factory.mktemp("resolve"))))
    found = json.loads(path.read_text())
    if isinstance(found, str):
        pytest.skip(found)
    return {tuple(key): value for key, value in found}


@pytest.mark.parametrize(("platform", "python"), TARGETS)
def test_the_install_resolves(closures: dict, platform: str, python: str) -> None:
    """The closure exists, and it has onnxruntime-training and torch exactly where their wheels exist."""
    found = closures[("package", platform, python)]
    assert found["ok"], f"pip cannot install fedper-edge[{EXTRAS}] on {platform}, Python {python}: {found.get('error')}"
    installed = found["install"]
    for name in ("onnxruntime-training-cpu", "torch"):
        exists = closures[(name, platform, python)]
        assert (name in installed) == exists, (
            f"{platform}, Python {python}: {name} {'has' if exists else 'has no'} wheel there, but the install "
            f"{'leaves it out' if exists else 'asks for it'}")
    if "onnxruntime-training-cpu" in installed:
        assert int(installed["onnx"].split(".")[1]) < 18, "onnxruntime 1.19 refuses the IR that onnx >= 1.18 writes"
    if "torch" in installed and installed["torch"].startswith("2.2."):
        assert installed["numpy"].startswith("1."), "torch 2.2 was compiled against numpy 1"


@pytest.mark.parametrize("python", PI_PYTHONS)
def test_a_pi_install_with_the_cpu_torch_pin_has_no_cuda(closures: dict, python: str) -> None:
    """deploy/README.md: `pip install fedper-edge "torch<2.11"` on a Pi gets a CPU torch, no CUDA libraries."""
    found = closures[("pi", "linux-aarch64", python)]
    assert found["ok"], f"Python {python}: {found.get('error')}"
    installed = found["install"]
    assert Version(installed["torch"]) < Version("2.11")
    assert not [n for n in installed if n.startswith(("nvidia-", "cuda-")) or n == "triton"], sorted(installed)
