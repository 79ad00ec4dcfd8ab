"""Shared fixtures: a real Mosquitto broker on a free loopback port (per test), tiny real exports
(each exported once per session), subprocess groups and a small file system to fill.

Helpers that tests call live in tests/helpers/ (processes, MQTT recording, scripted devices, MQTT over
WebSockets: websockify in front of Mosquitto, whose fixtures are imported here).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.processes import Processes
from helpers.websocket import websockify_factory, ws_broker  # noqa: F401  (fixtures: MQTT over WebSockets)

from fedper.ports import free_port

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
SKIP_REASON = "mosquitto not installed (apt-get install mosquitto)"


class Broker:
    """A Mosquitto process with a generated config; `restart()` keeps the port (and its persistence file)."""

    def __init__(self, directory: Path, extra_conf: str = "") -> None:
        self.host, self.port = "127.0.0.1", free_port()
        self.dir = directory
        self.conf = directory / "mosquitto.conf"
        self.log = directory / "mosquitto.log"
        # As root, mosquitto drops to the `mosquitto` user, which cannot read the test's private tmp dir.
        user = "user root\n" if os.geteuid() == 0 else ""
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n{user}"
            f"log_dest file {self.log}\n{extra_conf}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        assert MOSQUITTO is not None
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not accept connections on port {self.port} in {timeout} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """mosquitto_factory(extra_conf="") -> a started Broker; all are stopped at teardown."""
    if MOSQUITTO is None:
        pytest.skip(SKIP_REASON)
    brokers: list[Broker] = []

    def make(extra_conf: str = "") -> Broker:
        directory = tmp_path / f"mosquitto{len(brokers)}"
        directory.mkdir()
        broker = Broker(directory, extra_conf)
        brokers.append(broker)
        broker.start()
        return broker

    yield make
    for broker in brokers:
        broker.stop()


@pytest.fixture
def mosquitto(mosquitto_factory: Callable[..., Broker]) -> Broker:
    """A plain anonymous Mosquitto on a free 127.0.0.1 port."""
    return mosquitto_factory()


RESOLVE_TESTS = "test_install_resolve.py"  # the pip resolves' tests: their resolves start with the session


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The resolves' tests last (a stable sort: the rest keep their order): they read the pip resolves that
    install_resolves_under_way starts with the session, which take minutes; earlier, a worker waits for them."""
    items.sort(key=lambda item: item.path.name == RESOLVE_TESTS)


@pytest.fixture(scope="session", autouse=True)
def install_resolves_under_way(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """test_install_resolve's pip resolves, started as the session starts when its tests are selected: they take
    minutes, mostly waiting on the index, and so run beside the other tests instead of holding a worker."""
    if any(item.path.name == RESOLVE_TESTS for item in request.session.items):
        from test_install_resolve import start_resolving

        start_resolving(tmp_path_factory)


TinyExport = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> TinyExport:
    """tiny_export(kp=1, algorithm="fedper", ...) -> a real export directory (classes "0".."n-1"), MobileNet-v1
    x0.25 at 32x32 with 4 classes unless told otherwise. Each distinct set of parameters is exported once per
    session and shared by every test that asks for it: treat the directory as read-only."""
    exports: dict[tuple[object, ...], Path] = {}

    def export(*, model: str = "mobilenet_v1", kp: int = 1, algorithm: str = "fedper", num_classes: int = 4,
               input_size: int = 32, width: float = 0.25, ort_format: bool = False) -> Path:
        key = (model, kp, algorithm, num_classes, input_size, width, ort_format)
        if key not in exports:
            from fedper.export.exporter import export_artifacts

            out = tmp_path_factory.mktemp("tiny-export") / "export"
            export_artifacts(out, model=model, kp=kp, algorithm=algorithm, num_classes=num_classes,
                             input_size=input_size, width=width, ort_format=ort_format,
                             classes=tuple(str(c) for c in range(num_classes)))
            exports[key] = out
        return exports[key]

    return export


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_export: TinyExport) -> Path:
    """The fleet tests' export: MobileNet-v1 x0.25, 32x32, classes "0".."3", FedPer K_P=1."""
    return tiny_export()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Subprocesses started by the test, logging into tmp_path; all SIGKILLed at teardown."""
    group = Processes(tmp_path)
    yield group
    group.kill_all()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (root only): a disk that can really be filled."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module's in-process emulator runs, as figure --jobs gives each run: on a 2-core
    machine that other work shares, two threads that wait for each other made these runs 8x slower. A module
    asks for it with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch  # not every test session needs it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
