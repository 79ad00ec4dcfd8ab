"""deploy/'s path for phones, run for real: nginx (deploy/nginx/fedper-web.conf, TLS with a certificate made here) ->
websockify (deploy/systemd/fedper-websockify.service) -> Mosquitto's loopback listener (deploy/mosquitto/
fedper_web.conf) beside the TLS listener of fedper.conf, with the passwords and ACL of provision-device.sh.

Only ports and file paths are changed from the shipped files. The phone is a raw paho client over wss://.../mqtt.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest
from conftest import MOSQUITTO
from helpers.websocket import (
    NGINX,
    NGINX_SKIP_REASON,
    WEBSOCKIFY,
    Nginx,
    Websockify,
    deploy_site,
    wait_listening,
    ws_client,
)
from paho.mqtt.enums import CallbackAPIVersion
from test_deploy import make_tls

from fedper.coordinator.web import WebServer
from fedper.ports import free_port

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed (apt-get install mosquitto)"),
    pytest.mark.skipif(WEBSOCKIFY is None, reason="websockify not installed (apt-get install websockify)"),
    pytest.mark.skipif(NGINX is None, reason=NGINX_SKIP_REASON),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed"),
]
LAB, FARM = "fedper/v1/lab", "fedper/v1/farm"
MODEL_BYTES, CHUNK = 600_000, 64_000


def _unit_websockify_args() -> list[str]:
    """The websockify unit's ExecStart arguments: [listen, target]."""
    unit = (DEPLOY / "systemd" / "fedper-websockify.service").read_text()
    command = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))  # type: ignore[union-attr]
    assert command[0] == "/usr/bin/websockify"
    return command[1:]


def _mosquitto_conf(folder: Path, tls_port: int, web_port: int) -> str:
    """fedper.conf then fedper_web.conf (the order conf.d loads them in), ports and paths pointed at `folder`."""
    lines = []
    for name, port in (("fedper.conf", tls_port), ("fedper_web.conf", web_port)):
        for line in (DEPLOY / "mosquitto" / name).read_text().splitlines():
            key = line.split(" ", 1)[0]
            if key in ("password_file", "acl_file", "cafile", "certfile", "keyfile"):
                line = f"{key} {folder / Path(line.split(' ', 1)[1]).name}"
            elif key == "listener":
                line = re.sub(r"^listener \d+", f"listener {port}", line)  # the web one keeps its address
                line += " 127.0.0.1" if name == "fedper.conf" else ""  # the TLS one: all interfaces, loopback here
            elif key in ("persistence", "persistence_location"):
                continue
            lines.append(line)
    if os.geteuid() == 0:
        lines.append("user root")  # as root Mosquitto would drop to `mosquitto` and lose the test's files
    lines.append(f"log_dest file {folder / 'mosquitto.log'}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Mosquitto (deploy config, two fleets), websockify and nginx as deploy/ ships them, and the page's server."""
    folder = tmp_path_factory.mktemp("deploy-web")
    make_tls(folder)
    shutil.copy(DEPLOY / "mosquitto" / "acl", folder / "acl")
    passwords, links = {}, {}
    nginx_port = free_port()
    web_url = f"https://127.0.0.1:{nginx_port}/"
    for *role, user, fleet in (("--coordinator", "coordinator", "lab"), ("phone-1", "lab"), ("dev-a", "lab"),
                               ("--coordinator", "coordinator-farm", "farm")):
        out = subprocess.run([str(DEPLOY / "provision-device.sh"), *role, user, fleet, str(folder / "passwd"),
                              str(folder / "acl")], check=True, capture_output=True, text=True,
                             env={**os.environ, "FEDPER_WEB_URL": web_url}).stdout
        printed = dict(line.split("=", 1) for line in out.split())
        passwords[user] = printed["FEDPER_PASSWORD"]
        links[user] = printed.get("FEDPER_WEB_LINK")
    # a device's link: the page's URL, its id and its password (the one the phone logs in with below) in the fragment
    link = urlsplit(links.pop("phone-1"))
    assert f"{link.scheme}://{link.netloc}{link.path}" == web_url
    assert dict(p.split("=", 1) for p in link.fragment.split("&")) == {"device": "phone-1",
                                                                       "password": passwords["phone-1"]}
    assert links == {"coordinator": None, "dev-a": f"{web_url}#device=dev-a&password={passwords['dev-a']}",
                     "coordinator-farm": None}
    tls_port, web_listener = free_port(), free_port()
    (folder / "mosquitto.conf").write_text(_mosquitto_conf(folder, tls_port, web_listener))
    broker = subprocess.Popen([MOSQUITTO, "-c", str(folder / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    started: list[Any] = []
    try:
        wait_listening(tls_port, broker, folder / "mosquitto.log")
        wait_listening(web_listener, broker, folder / "mosquitto.log")
        bridge = Websockify(folder, web_listener)  # the unit's command, on a free port
        started.append(bridge)
        bridge.wait_ready()
        page_root = folder / "page"
        page_root.mkdir()
        (page_root / "index.html").write_text("<!doctype html><title>fedper</title>")
        page = WebServer(page_root, folder, "lab", f"wss://127.0.0.1:{nginx_port}/mqtt", "127.0.0.1", 0).start()
        started.append(page)
        site = deploy_site(nginx_port, folder / "server.crt", folder / "server.key", bridge.port, page.port)
        started.append(Nginx(folder, site, nginx_port))
        yield {"tls_port": tls_port, "web_listener": web_listener, "nginx_port": nginx_port, "ca": folder / "ca.crt",
               "passwords": passwords, "broker": broker, "page": page}
    finally:
        for thing in reversed(started):
            thing.stop() if hasattr(thing, "stop") else thing.close()
        broker.kill()
        broker.wait()


class Inbox:
    """A connected client's received messages and its connection result."""

    def __init__(self, client: mqtt.Client) -> None:
        self.client, self.messages, self.result = client, [], threading.Event()
        self.reason: Any = None
        self.disconnected = threading.Event()
        client.on_message = lambda _c, _u, m: self.messages.append((m.topic, m.payload))
        client.on_connect = self._connected
        client.on_disconnect = lambda *_: self.disconnected.set()

    def _connected(self, _c: mqtt.Client, _u: object, _f: object, reason: Any, _p: object) -> None:
        self.reason = reason
        self.result.set()

    def topics(self) -> list[str]:
        return [t for t, _ in self.messages]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _connect(client: mqtt.Client, port: int) -> Inbox:
    inbox = Inbox(client)
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert inbox.result.wait(10), "no CONNACK"
    return inbox


def _tcp(stack: dict[str, Any], user: str) -> Inbox:
    """A client on the TLS listener, as the coordinator and the Python agents connect."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv311)
    client.username_pw_set(user, stack["passwords"][user])
    client.tls_set(ca_certs=str(stack["ca"]))
    inbox = _connect(client, stack["tls_port"])
    assert not inbox.reason.is_failure, inbox.reason
    return inbox


def _phone(stack: dict[str, Any], user: str, password: str | None = None, client_id: str = "") -> Inbox:
    """A page's connection: wss://127.0.0.1:<nginx>/mqtt with the fleet's CA, user name = device id."""
    client = ws_client(client_id or user, tls_ca=stack["ca"], username=user, path="/mqtt",
                       password=stack["passwords"][user] if password is None else password)
    return _connect(client, stack["nginx_port"])


def _settle(inbox: Inbox, count: int, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while len(inbox.messages) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_phone_over_wss_works_in_its_fleet_and_nowhere_else(stack: dict[str, Any]) -> None:
    coordinator, farm = _tcp(stack, "coordinator"), _tcp(stack, "coordinator-farm")
    model = os.urandom(MODEL_BYTES)
    chunks = -(-MODEL_BYTES // CHUNK)
    for i in range(chunks):
        coordinator.client.publish(f"{LAB}/model/{i:04d}", model[i * CHUNK:(i + 1) * CHUNK], qos=1,
                                   retain=True).wait_for_publish(10)
    coordinator.client.publish(f"{LAB}/round", b'{"round": 1}', qos=1, retain=True).wait_for_publish(10)
    farm.client.publish(f"{FARM}/round", b'{"round": 7}', qos=1, retain=True).wait_for_publish(10)
    coordinator.client.subscribe(f"{LAB}/register/#", qos=1)
    farm.client.subscribe(f"{FARM}/#", qos=1)
    time.sleep(0.3)

    started = time.perf_counter()
    phone = _phone(stack, "phone-1")
    assert not phone.reason.is_failure, phone.reason
    for topic in (f"{LAB}/model/#", f"{LAB}/round", f"{FARM}/round", f"{LAB}/register/#"):
        phone.client.subscribe(topic, qos=1)
    _settle(phone, chunks + 1, seconds=10)
    seconds = time.perf_counter() - started
    got = b"".join(p for t, p in sorted(phone.messages) if t.startswith(f"{LAB}/model/"))
    assert hashlib.sha256(got).digest() == hashlib.sha256(model).digest()
    assert seconds < 1.0, f"{seconds:.2f} s for {MODEL_BYTES} B through nginx and websockify (Mosquitto's WS: 12-15 s)"
    phone.client.publish(f"{LAB}/register/phone-1", b"mine", qos=1).wait_for_publish(5)
    phone.client.publish(f"{LAB}/register/dev-a", b"forged", qos=1).wait_for_publish(5)
    phone.client.publish(f"{FARM}/register/phone-1", b"elsewhere", qos=1).wait_for_publish(5)
    _settle(coordinator, 1)
    time.sleep(0.5)
    assert coordinator.messages == [(f"{LAB}/register/phone-1", b"mine")]
    assert farm.messages == [(f"{FARM}/round", b'{"round": 7}')]  # its own retained round only
    assert sorted(set(phone.topics())) == sorted({f"{LAB}/round", *(f"{LAB}/model/{i:04d}" for i in range(chunks))})
    for client in (phone, coordinator, farm):
        client.close()


def test_a_phone_needs_its_password_and_cannot_take_over_a_session(stack: dict[str, Any]) -> None:
    for password in ("wrong", ""):
        refused = _phone(stack, "phone-1", password=password)
        assert refused.reason.is_failure, password
        refused.close()
    coordinator = _tcp(stack, "coordinator")
    intruder = _phone(stack, "phone-1", client_id="coordinator")  # the session is bound to the user name instead
    assert not intruder.reason.is_failure
    time.sleep(1.0)
    assert not coordinator.disconnected.is_set() and coordinator.client.is_connected()
    for client in (intruder, coordinator):
        client.close()


def test_the_page_through_nginx_keeps_its_isolation_headers(stack: dict[str, Any]) -> None:
    context = ssl.create_default_context(cafile=str(stack["ca"]))
    for path in ("/", "/config.json", "/artifacts/acl"):
        conn = http.client.HTTPSConnection("127.0.0.1", stack["nginx_port"], context=context, timeout=10)
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        assert response.status == 200, path
        assert response.getheader("Cross-Origin-Opener-Policy") == "same-origin"
        assert response.getheader("Cross-Origin-Embedder-Policy") == "require-corp"
        assert response.getheader("Cross-Origin-Resource-Policy") == "same-origin"
        if path == "/config.json":
            assert json.loads(body)["broker"] == f"wss://127.0.0.1:{stack['nginx_port']}/mqtt"


def test_the_shipped_files_agree_and_the_web_listener_is_loopback_only(stack: dict[str, Any]) -> None:
    """The unit bridges nginx's upstream to Mosquitto's web listener; that listener binds 127.0.0.1 alone."""
    listen, target = _unit_websockify_args()
    web_conf = (DEPLOY / "mosquitto" / "fedper_web.conf").read_text()
    assert re.search(r"^listener (\d+)", web_conf, re.M).group(1) == target.split(":")[1]  # type: ignore[union-attr]
    assert f"proxy_pass http://{listen};" in (DEPLOY / "nginx" / "fedper-web.conf").read_text()
    listening = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            address, bound = local.split(":")
            listening.add((int(bound, 16), address))
    assert {a for p, a in listening if p == stack["web_listener"]} == {"0100007F"}  # 127.0.0.1 only
