"""`make check-aarch64`: install the agent from aarch64 wheels into an aarch64 Python and run one round with it.

The Python is Debian's arm64 python3.11, run by qemu's user-mode emulator (Debian's qemu-user-static) on this
x86-64 machine; nothing of the host changes but that package. The aarch64 root is made without installing
anything: apt with a private state resolves the packages' closure for arm64 and downloads it, `dpkg -x` unpacks
each .deb into the root. qemu runs the root's python directly (`-L ROOT`, no binfmt_misc registration), so
nothing may start the emulated python as a subprocess (pip installs wheels only, --only-binary).

Two files in the root fix torch's CPU detection, which crashes on the host's x86 /proc/cpuinfo that qemu passes
through: an aarch64 /proc/cpuinfo and each CPU's midr_el1 (a Neoverse-N1's), which qemu's -L serves instead.

Then, natively on this machine, a tiny export, a coordinator with its embedded broker; the emulated agent joins it
over loopback with the default --backend auto, which must pick torch (no onnxruntime-training wheel for aarch64).
The root is kept in --cache (default: .aarch64/ in the repository, gitignored); the venv is made afresh each run
unless --keep-venv. Wall times of every step go to stdout and to CACHE/last-run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("python3.11", "python3.11-venv", "python3-pip-whl", "python3-setuptools-whl", "libstdc++6", "libgcc-s1",
            "libc6")
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# A Neoverse-N1 (Graviton 2, Ampere Altra): MIDR_EL1 = implementer 0x41, variant 3, part 0xd0c, revision 1.
MIDR = "0x00000000413fd0c1\n"
CPUINFO = """processor\t: {n}
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

"""


class Failed(Exception):
    """A step failed: one line for the user."""


@contextmanager
def step(timings: dict[str, float], name: str) -> Iterator[None]:
    """Say what runs, and record its wall time."""
    print(f"[aarch64] {name} ...", flush=True)
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 1)
    print(f"[aarch64] {name}: {timings[name]} s", flush=True)


def run(*command: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise Failed(f"{' '.join(str(c) for c in command[:4])} ... exited {done.returncode}: {' | '.join(tail)}")
    return done


def qemu() -> str:
    """qemu-aarch64-static, installed from Debian when missing and we may (root with apt-get)."""
    found = shutil.which("qemu-aarch64-static")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Failed("qemu-aarch64-static is missing: apt-get install qemu-user-static (as root)")
    print("[aarch64] installing qemu-user-static (Debian package)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", env=env)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "qemu-user-static", env=env)
    return shutil.which("qemu-aarch64-static") or "/usr/bin/qemu-aarch64-static"


def make_root(cache: Path, mirror: str) -> Path:
    """The arm64 root (cached: kept once complete): python3.11 and its shared libraries, unpacked, never installed."""
    root, apt = cache / "root", cache / "apt"
    if (root / ".complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(apt, ignore_errors=True)
    for folder in ("state/lists/partial", "cache/archives/partial", "parts"):
        (apt / folder).mkdir(parents=True)
    (apt / "state/status").write_text("")  # nothing installed: apt resolves the whole closure
    (apt / "sources.list").write_text(f"deb [arch=arm64 signed-by={KEYRING}] {mirror} bookworm main\n")
    options = [f"-o{key}={value}" for key, value in {
        "APT::Architecture": "arm64", "APT::Architectures": "arm64", "Dir::State": apt / "state",
        "Dir::State::status": apt / "state/status", "Dir::Cache": apt / "cache",
        "Dir::Etc::SourceList": apt / "sources.list", "Dir::Etc::SourceParts": apt / "parts",
        "Dir::Etc::Preferences": "/dev/null", "Dir::Etc::PreferencesParts": apt / "parts",
        "Debug::NoLocking": "1",
    }.items()]
    if os.geteuid() == 0:
        options.append("-oAPT::Sandbox::User=root")  # the private folders are root's, not _apt's
    run("apt-get", *options, "-qq", "update")
    run("apt-get", *options, "-qq", "-y", "--download-only", "--no-install-recommends", "install", *PACKAGES)
    debs = sorted((apt / "cache/archives").glob("*.deb"))
    for deb in debs:
        run("dpkg-deb", "-x", deb, root)
    cpus = os.cpu_count() or 1
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc/cpuinfo").write_text("".join(CPUINFO.format(n=n) for n in range(cpus)))
    for n in range(cpus):
        regs = root / f"sys/devices/system/cpu/cpu{n}/regs/identification"
        regs.mkdir(parents=True, exist_ok=True)
        (regs / "midr_el1").write_text(MIDR)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"[aarch64] root: {len(debs)} arm64 packages, {size / 2**20:.0f} MB unpacked", flush=True)
    (root / ".complete").write_text(json.dumps({"packages": [d.name for d in debs]}))
    return root


def agent_wheel(work: Path) -> Path:
    """This checkout as a wheel (pure Python: the same on every platform), built from a copy of the tree."""
    source = work / "src"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "runs", "build", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", source)
    return max((work / "dist").glob("fedper_edge-*.whl"), key=lambda p: p.stat().st_mtime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=REPO / ".aarch64", help="Root, venv and run files.")
    parser.add_argument("--torch", default="torch<2.11",
                        help="The torch requirement (2.10: the last CPU-only aarch64 torch on PyPI; newer ones are "
                        "CUDA builds with ~5 GB of NVIDIA libraries).")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for the arm64 root.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds the round may take (agent start to end).")
    parser.add_argument("--keep-venv", action="store_true",
                        help="Reuse the last run's venv and its packages (only this checkout's wheel is reinstalled).")
    args = parser.parse_args()
    if platform.machine() != "x86_64" or sys.platform != "linux":
        print("check-aarch64: runs on Linux x86-64 (it emulates aarch64 with qemu-user-static)", file=sys.stderr)
        return 2
    cache = args.cache.resolve()
    timings: dict[str, float] = {}
    result: dict[str, object] = {"timings_s": timings, "load_average_at_start": os.getloadavg(),
                                 "cpus": os.cpu_count()}
    start = time.perf_counter()
    host: list[subprocess.Popen[bytes]] = []
    try:
        with step(timings, "qemu-user-static"):
            emulator = qemu()
        with step(timings, "aarch64 root (cached after the first run)"):
            root = make_root(cache, args.mirror)
        aarch64 = [emulator, "-L", str(root)]
        venv, work = cache / "venv", cache / "run"
        fresh = not (args.keep_venv and (venv / "bin/fedper-agent").exists())
        result["torch_requirement"] = args.torch if fresh else "the kept venv's"
        if fresh:
            shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        if fresh:
            with step(timings, "venv and pip (emulated)"):
                run(*aarch64, root / "usr/bin/python3.11", "-m", "venv", "--without-pip", venv)
                (pip_wheel,) = (root / "usr/share/python-wheels").glob("pip-*.whl")
                run(*aarch64, venv / "bin/python", pip_wheel / "pip", "install", "-q", "--no-index", "--find-links",
                    root / "usr/share/python-wheels", "pip", "setuptools")
        with step(timings, "agent wheel (host)"):
            wheel = agent_wheel(work)
        pip = [*aarch64, venv / "bin/python", "-m", "pip"]
        with step(timings, "pip install the agent from aarch64 wheels (emulated)"):
            if fresh:
                run(*pip, "install", "-q", "--only-binary=:all:", wheel, args.torch)
            else:
                run(*pip, "install", "-q", "--no-deps", "--force-reinstall", wheel)
        result["machine"] = run(*aarch64, venv / "bin/python", "-c",
                                "import platform; print(platform.machine(), platform.python_version())").stdout.strip()
        versions = {p["name"].lower(): p["version"] for p in json.loads(run(*pip, "list", "--format=json").stdout)}
        result["installed"] = {n: versions.get(n) for n in ("fedper-edge", "torch", "torchvision", "numpy", "onnx",
                                                             "onnxruntime-training-cpu")}
        with step(timings, "export, data, coordinator (host)"):
            host, command = start_host_side(work)
            coordinator = host[1]
        with step(timings, "one round: emulated agent start to exit"):
            agent = subprocess.run([*aarch64, str(venv / "bin/python"), str(venv / "bin/fedper-agent"), *command],
                                   capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in agent.stderr.splitlines() if line.strip()]
            result["agent_log"] = lines
            if agent.returncode != 0:
                raise Failed(f"the agent exited {agent.returncode}: {' | '.join(lines[-5:])}")
            first = next(line for line in lines if line.startswith("fedper-agent:"))
            if "training with torch" not in first:
                raise Failed(f"--backend auto did not pick torch: {first}")
        if coordinator.wait(120) != 0:
            raise Failed(f"the coordinator exited {coordinator.returncode}: see {work / 'coordinator.log'}")
        metrics = [json.loads(line) for line in (work / "coordinator/metrics.jsonl").read_text().splitlines()]
        result["round"] = metrics[-1]
        result["ok"] = True
    except (Failed, OSError, subprocess.TimeoutExpired) as e:
        result["ok"], result["error"] = False, str(e)
        print(f"check-aarch64: {e}", file=sys.stderr)
    finally:
        for process in host:
            if process.poll() is None:
                process.kill()
        timings["total"] = round(time.perf_counter() - start, 1)
        result["load_average_at_end"] = os.getloadavg()
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "last-run.json").write_text(json.dumps(result, indent=2))
    for name, seconds in timings.items():
        print(f"{seconds:8.1f} s  {name}")
    if result["ok"]:
        print(f"OK: {result['machine']}; {result['agent_log'][0]}; {result['agent_log'][-1]}")
    return 0 if result["ok"] else 1


def start_host_side(work: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """A tiny export, 48 real digits for the device, the embedded amqtt broker in a process of its own (it must
    outlive the coordinator: the slow emulated agent takes the final model after the coordinator is done) and a
    coordinator waiting for one device and one round; returns both processes and the agent's arguments."""
    import numpy as np

    from fedper.data import load_digits
    from fedper.ports import free_port

    bin_dir = Path(sys.executable).parent
    artifacts = work / "artifacts"
    run(bin_dir / "fedper-export", "--model", "mobilenet_v1", "--kp", "1", "--num-classes", "4", "--classes",
        "0,1,2,3", "--input-size", "32", "--width", "0.25", "--out", artifacts)
    digits = load_digits(32).train
    keep = np.flatnonzero(digits.y < 4)[:48]
    data = work / "device.npz"
    np.savez(data, x_train=digits.x[keep], y_train=digits.y[keep], classes=np.array(["0", "1", "2", "3"]))
    port = free_port()
    serve = ("import sys, threading; from fedper.coordinator.broker import EmbeddedBroker; "
             "EmbeddedBroker(port=int(sys.argv[1])).start(); threading.Event().wait()")
    with open(work / "broker.log", "wb") as log:
        broker = subprocess.Popen([sys.executable, "-c", serve, str(port)], stdout=log, stderr=subprocess.STDOUT)
    wait_for_port(port, broker)
    url = f"mqtt://127.0.0.1:{port}"
    with open(work / "coordinator.log", "wb") as log:
        coordinator = subprocess.Popen(
            [bin_dir / "fedper-coordinator", "--artifacts", artifacts, "--fleet", "aarch64", "--rounds", "1",
             "--min-clients", "1", "--round-timeout", "1800", "--state-dir", work / "coordinator", "--broker", url,
             "--mqtt-version", "3.1.1"], stdout=log, stderr=subprocess.STDOUT)
    agent = ["--artifacts", str(artifacts), "--data", str(data), "--broker", url, "--mqtt-version", "3.1.1",
             "--fleet", "aarch64", "--client-id", "emulated-pi", "--state-dir", str(work / "agent"),
             "--batch-size", "16"]
    return [broker, coordinator], agent


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Failed(f"the broker exited {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise Failed(f"the broker did not listen on port {port} in {timeout} s")


if __name__ == "__main__":
    sys.exit(main())
