"""MQTT over WebSockets for the tests: Debian's `websockify` in front of a real Mosquitto's TCP listener, the fast
path phones use (Mosquitto's own WebSocket listener takes seconds per model: docs/operations.md).

Fixtures (registered by tests/conftest.py): `websockify_factory(target_port, cert=None, key=None)` starts a
websockify on a free loopback port (TLS with a cert and key: wss); `ws_broker` is a Mosquitto with one in front.
A client must offer the `binary` WebSocket subprotocol (websockify refuses a handshake without it):
`ws_client()` builds such a paho client.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedper.ports import free_port

WEBSOCKIFY = shutil.which("websockify")
SKIP_REASON = "websockify not installed (apt-get install websockify)"
# Offered by the web agent too: websockify picks `binary`, amqtt and Mosquitto pick `mqtt`.
SUBPROTOCOLS = "binary, mqtt"


class Websockify:
    """A websockify process: WebSocket on 127.0.0.1:port -> TCP on 127.0.0.1:target_port."""

    def __init__(self, directory: Path, target_port: int, cert: Path | None = None, key: Path | None = None) -> None:
        self.port, self.target_port = free_port(), target_port
        self.log = directory / f"websockify-{self.port}.log"
        tls = ["--cert", str(cert), "--key", str(key), "--ssl-only"] if cert and key else []
        assert WEBSOCKIFY is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([WEBSOCKIFY, *tls, f"127.0.0.1:{self.port}", f"127.0.0.1:{target_port}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        self.scheme = "wss" if tls else "ws"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/"

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"websockify exited: {self.log.read_text(errors='replace')}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"websockify did not listen on port {self.port} in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class WsBroker:
    """A Mosquitto (`broker`, TCP) and the websockify in front of it (`bridge`)."""

    broker: object
    bridge: Websockify

    @property
    def url(self) -> str:
        return self.bridge.url


@pytest.fixture
def websockify_factory(tmp_path: Path) -> Iterator[Callable[..., Websockify]]:
    """websockify_factory(target_port, cert=None, key=None) -> a started Websockify; all stopped at teardown."""
    if WEBSOCKIFY is None:
        pytest.skip(SKIP_REASON)
    bridges: list[Websockify] = []

    def make(target_port: int, cert: Path | None = None, key: Path | None = None) -> Websockify:
        bridge = Websockify(tmp_path, target_port, cert, key)
        bridges.append(bridge)
        bridge.wait_ready()
        return bridge

    yield make
    for bridge in bridges:
        bridge.stop()


@pytest.fixture
def ws_broker(mosquitto_factory: Callable[..., object], websockify_factory: Callable[..., Websockify]) -> WsBroker:
    """A real anonymous Mosquitto on a free loopback port with websockify in front of its TCP listener."""
    broker = mosquitto_factory()
    return WsBroker(broker, websockify_factory(broker.port))  # type: ignore[attr-defined]


def ws_client(client_id: str = "", *, subprotocols: str = SUBPROTOCOLS, tls_ca: Path | None = None,
              username: str | None = None, password: str | None = None, path: str = "/") -> mqtt.Client:
    """A paho MQTT 3.1.1 client over WebSockets offering `subprotocols` (connect it with connect(host, port))."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                         transport="websockets")
    client.ws_set_options(path=path, headers={"Sec-Websocket-Protocol": subprotocols})
    if tls_ca:
        client.tls_set(ca_certs=str(tls_ca))
    if username:
        client.username_pw_set(username, password)
    return client
