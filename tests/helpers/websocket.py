"""MQTT over WebSockets for the tests: Debian's `websockify` in front of a real Mosquitto's TCP listener, the fast
path phones use (Mosquitto's own WebSocket listener takes seconds per model: docs/operations.md), and Debian's nginx
with deploy/nginx/fedper-web.conf in front of it (the deploy path: TLS, wss://HOST/mqtt).

Fixtures (registered by tests/conftest.py): `websockify_factory(target_port, cert=None, key=None)` starts a
websockify on a free loopback port (TLS with a cert and key: wss); `ws_broker` is a Mosquitto with one in front.
A client must offer the `binary` WebSocket subprotocol (websockify refuses a handshake without it):
`ws_client()` builds such a paho client. `Nginx` runs nginx on a site's text; `deploy_site()` is deploy's site
with its ports and certificate pointed at the test's.
"""

from __future__ import annotations

import os
import re
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
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
NGINX_SKIP_REASON = "nginx not installed (apt-get install nginx-light)"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
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

    def wait_ready(self) -> None:
        wait_listening(self.port, self.proc, self.log)

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


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 10.0) -> None:
    """Until something accepts connections on 127.0.0.1:port; RuntimeError with the log if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {log.read_text(errors='replace') if log.exists() else ''}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on port {port} in {timeout} s")


class Nginx:
    """nginx in the foreground on `site` (one or more server blocks), with every path it writes in `directory`."""

    def __init__(self, directory: Path, site: str, port: int) -> None:
        assert NGINX is not None
        self.dir, self.port = directory, port
        self.log = directory / "nginx-error.log"
        temp = directory / "nginx-temp"
        temp.mkdir(parents=True, exist_ok=True)
        user = "user root root;\n" if os.geteuid() == 0 else ""  # as root its workers would drop to nobody
        temps = "".join(f"    {kind}_temp_path {temp / kind};\n" for kind in ("client_body", "proxy", "fastcgi",
                                                                                "uwsgi", "scgi"))
        conf = directory / "nginx.conf"
        conf.write_text(f"{user}daemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\n"
                        f"error_log {self.log} warn;\nevents {{ worker_connections 256; }}\n"
                        f"http {{\n    access_log off;\n{temps}{site}\n}}\n")
        self.proc = subprocess.Popen([NGINX, "-p", str(directory), "-e", str(self.log), "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(port, self.proc, self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def deploy_site(port: int, cert: Path, key: Path, websockify_port: int, page_port: int) -> str:
    """deploy/nginx/fedper-web.conf as shipped, on 127.0.0.1:port with this certificate, proxying to these ports."""
    text = (DEPLOY / "nginx" / "fedper-web.conf").read_text()
    text = re.sub(r"^\s*listen \[::\]:443 ssl;\n", "", text, flags=re.M)
    text = re.sub(r"listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;", text)
    text = re.sub(r"ssl_certificate .*;", f"ssl_certificate {cert};", text)
    text = re.sub(r"ssl_certificate_key .*;", f"ssl_certificate_key {key};", text)
    text = text.replace("127.0.0.1:8884", f"127.0.0.1:{websockify_port}").replace("127.0.0.1:8080",
                                                                                f"127.0.0.1:{page_port}")
    assert f"127.0.0.1:{websockify_port}" in text and f"127.0.0.1:{page_port}" in text, "deploy's site changed"
    return text
