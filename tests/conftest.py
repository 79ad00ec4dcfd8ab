"""Shared fixtures: a real Mosquitto broker on a free loopback port, started per test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
SKIP_REASON = "mosquitto not installed (apt-get install mosquitto)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
