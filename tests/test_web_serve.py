"""The web agent's page served by `fedper-coordinator --web-port` (coordinator/web.py), and MQTT over WebSockets
for it: websockify in front of a real Mosquitto, and the embedded amqtt broker's WebSocket listener.

HTTP is spoken with http.client and raw sockets (third-party to the server), MQTT with raw paho clients.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers.tls import self_signed
from helpers.websocket import WsBroker, ws_client
from paho.mqtt.enums import CallbackAPIVersion

from fedper.coordinator.web import WebServer, tls_context

ISOLATION = {"cross-origin-opener-policy": "same-origin", "cross-origin-embedder-policy": "require-corp",
             "cross-origin-resource-policy": "same-origin"}
MODEL_BYTES = 600_000
CHUNK = 64_000


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, Path]:
    """A page folder and an export-like folder, with a secret beside them and a symlink pointing at it."""
    root, export = tmp_path / "page", tmp_path / "export"
    (root / "dist").mkdir(parents=True)
    (export / "all").mkdir(parents=True)
    (root / "index.html").write_text("<!doctype html><title>fedper</title>")
    (root / "app.mjs").write_text("export const x = 1;")
    (root / "dist" / "ort.wasm").write_bytes(b"\0asm\1\0\0\0" + os.urandom(3000))
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("hidden")
    (export / "manifest.json").write_text('{"tensors": []}')
    (export / "all" / "training_model.onnx").write_bytes(os.urandom(5000))
    (tmp_path / "secret.txt").write_text("not for phones")
    (root / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (export / "leak").symlink_to(tmp_path)
    return root, export


def _get(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def _raw(port: int, path: str) -> bytes:
    """A request line sent as is (http.client would not send `..` unencoded past some proxies): the status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        return s.recv(4096).split(b"\r\n", 1)[0]


def test_page_artifacts_and_config_with_isolation_headers_and_types(site: tuple[Path, Path]) -> None:
    root, export = site
    with WebServer(root, export, "lab", "wss://fleet.example/mqtt", "127.0.0.1", 0) as server:
        expected = {"/": ("text/html", (root / "index.html").read_bytes()),
                    "/app.mjs": ("text/javascript", (root / "app.mjs").read_bytes()),
                    "/dist/ort.wasm": ("application/wasm", (root / "dist" / "ort.wasm").read_bytes()),
                    "/artifacts/manifest.json": ("application/json", (export / "manifest.json").read_bytes()),
                    "/artifacts/all/training_model.onnx": ("application/octet-stream",
                                                           (export / "all" / "training_model.onnx").read_bytes())}
        for path, (mime, content) in expected.items():
            status, headers, body = _get(server.port, path)
            assert (status, body) == (200, content), path
            assert headers["content-type"].split(";")[0] == mime, path
            assert int(headers["content-length"]) == len(content)
            assert ISOLATION.items() <= headers.items(), path
        status, headers, body = _get(server.port, "/config.json")
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body) == {"broker": "wss://fleet.example/mqtt", "fleet": "lab", "artifacts": "artifacts/"}
        assert ISOLATION.items() <= headers.items()

        status, headers, body = _get(server.port, "/dist/ort.wasm", "HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) == 3008
        status, again, _ = _get(server.port, "/dist/ort.wasm", headers={"If-None-Match": headers["etag"]})
        assert status == 304 and ISOLATION.items() <= again.items()
    with pytest.raises(ConnectionRefusedError):  # closed with the service: nothing listens any more
        _get(server.port, "/")


def test_nothing_outside_the_two_folders_no_listing_and_get_head_only(site: tuple[Path, Path]) -> None:
    root, export = site
    with WebServer(root, export, "lab", "ws://h:1/", "127.0.0.1", 0) as server:
        for path in ("/artifacts/", "/artifacts/all/", "/artifacts/all", "/dist/", "/.git/config", "/leak.txt",
                     "/artifacts/leak/secret.txt", "/artifacts/..%2fsecret.txt", "/artifacts/%2e%2e/secret.txt",
                     "/%2e%2e/secret.txt", "/artifacts/../secret.txt", "/nothing.js", "/artifacts/manifest.json%00"):
            status, headers, body = _get(server.port, path)
            assert status == 404, path
            assert b"not for phones" not in body and b"training_model" not in body
            assert ISOLATION.items() <= headers.items(), path
        for path in ("/../secret.txt", "/artifacts/../../secret.txt", "//etc/passwd"):
            assert b" 404 " in _raw(server.port, path), path
        for method in ("POST", "PUT", "DELETE", "OPTIONS"):
            status, headers, _ = _get(server.port, "/artifacts/manifest.json", method)
            assert status == 405 and headers["allow"] == "GET, HEAD", method
            assert ISOLATION.items() <= headers.items()
        assert export.joinpath("manifest.json").read_text() == '{"tensors": []}'


def test_default_broker_url_follows_the_host_the_page_was_opened_at(site: tuple[Path, Path]) -> None:
    with WebServer(*site, "lab", lambda host: f"ws://{host}:9001", "127.0.0.1", 0) as server:
        for host, broker in (("192.0.2.7:8080", "ws://192.0.2.7:9001"), ("[::1]:80", "ws://[::1]:9001"),
                             ("evil/x\"y", "ws://127.0.0.1:9001")):
            _, _, body = _get(server.port, "/config.json", headers={"Host": host})
            assert json.loads(body)["broker"] == broker, host


def _request_threads() -> int:
    """The server's connection threads alive in this process (socketserver names them after their target)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_half_sent_requests_are_shed_and_timed_out_and_an_honest_one_is_served(site: tuple[Path, Path]) -> None:
    """Slowloris from raw sockets: 300 connections each send half a request and wait. The server holds at most its
    bound of them (one thread each), drops the oldest for each newcomer, closes the rest at the header deadline,
    and serves an honest request meanwhile."""
    root, export = site
    bound, deadline = 16, 2.0
    with WebServer(root, export, "lab", "ws://h:1/", "127.0.0.1", 0, max_connections=bound,
                   header_timeout_s=deadline) as server:
        held = []
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never the blank line
            held.append(s)
        time.sleep(0.3)
        assert _request_threads() <= bound + 1, _request_threads()
        started = time.monotonic()
        status, _, body = _get(server.port, "/")
        assert status == 200 and body == (root / "index.html").read_bytes()
        assert time.monotonic() - started < 1.0
        time.sleep(deadline + 1.0)  # past the deadline every connection has been closed: a read gives end of file
        for s in held:
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b"", "a half-sent request got an answer"
            s.close()
        assert _request_threads() == 0


def test_https_with_the_operators_certificate(site: tuple[Path, Path], tmp_path: Path) -> None:
    """--web-cert/--web-key: the page over TLS, verified against the certificate; a silent TCP connection (no
    handshake) does not stop others; plain http on the port gets nothing."""
    root, export = site
    cert, key = self_signed(tmp_path)
    with WebServer(root, export, "lab", "wss://h/mqtt", "127.0.0.1", 0, tls=tls_context(cert, key)) as server:
        assert server.url().startswith("https://")
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10,
                                           context=ssl.create_default_context(cafile=str(cert)))
        conn.request("GET", "/")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == (root / "index.html").read_bytes()
        assert ISOLATION.items() <= {k.lower(): v for k, v in response.getheaders()}.items()
        conn.close()
        silent.close()
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _get(server.port, "/")
    with pytest.raises(ValueError, match="cannot load them"):
        tls_context(key, cert)


def _publish_model(host: str, port: int, topic: str, data: bytes) -> None:
    """Retained QoS 1 chunks over TCP, as the coordinator publishes a model."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    client.connect(host, port)
    client.loop_start()
    for i in range(0, len(data), CHUNK):
        client.publish(f"{topic}/{i // CHUNK:04d}", data[i:i + CHUNK], qos=1, retain=True).wait_for_publish(10)
    client.loop_stop()
    client.disconnect()


def _download_over_ws(url: str, topic: str, chunks: int, subprotocols: str = "binary, mqtt") -> tuple[bytes, float]:
    """Subscribe over WebSockets and gather the retained chunks: the bytes and the seconds from connect to last."""
    host, port = re.match(r"wss?://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    received: dict[str, bytes] = {}
    done = threading.Event()
    client = ws_client(f"ws-{os.urandom(4).hex()}", subprotocols=subprotocols)

    def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == topic or message.topic.startswith(f"{topic}/"):  # amqtt 0.12 may also resend retained
            received[message.topic] = message.payload  # messages of an earlier client's subscription
        if len(received) == chunks:
            done.set()

    client.on_message = on_message
    client.on_connect = lambda c, *_: c.subscribe(f"{topic}/#", qos=1)
    started = time.perf_counter()
    client.connect(host, int(port))
    client.loop_start()
    try:
        assert done.wait(30), f"{len(received)} of {chunks} chunks over {url}"
        seconds = time.perf_counter() - started
    finally:
        client.loop_stop()
        client.disconnect()
    return b"".join(received[k] for k in sorted(received)), seconds


def test_websockify_delivers_a_600kb_chunked_model_in_well_under_a_second(ws_broker: WsBroker) -> None:
    data = os.urandom(MODEL_BYTES)
    _publish_model("127.0.0.1", ws_broker.broker.port, "fedper/v1/lab/model", data)  # type: ignore[attr-defined]
    got, seconds = _download_over_ws(ws_broker.url, "fedper/v1/lab/model", -(-MODEL_BYTES // CHUNK))
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert seconds < 1.0, f"{seconds:.2f} s for {MODEL_BYTES} B over websockify (Mosquitto's own WS: 12-15 s)"


def test_websockify_needs_the_binary_subprotocol(ws_broker: WsBroker) -> None:
    """Why the page offers `binary` beside `mqtt`: websockify refuses a handshake that offers only `mqtt`."""
    client = ws_client(subprotocols="mqtt")
    with pytest.raises((OSError, mqtt.WebsocketConnectionError)):
        client.connect("127.0.0.1", ws_broker.bridge.port)


def _start_coordinator(artifacts: Path, state: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts),
                             "--fleet", "lab", "--rounds", "1", "--state-dir", str(state), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _page_url(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[str, str]:
    """The URL the coordinator prints at start and the line that says it (its stdout, read until then)."""
    deadline, seen = time.monotonic() + timeout, ""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            seen += line
            match = re.search(r"open (https?://\S+)", line)
            if match:
                return match.group(1), line
        assert proc.poll() is None, f"coordinator exited {proc.returncode}: {seen}{proc.stderr.read()}"  # type: ignore[union-attr]
    raise AssertionError(f"no page URL printed in {timeout} s: {seen}")


def test_coordinator_serves_the_page_and_the_embedded_broker_over_websockets(
        tiny_artifacts: Path, site: tuple[Path, Path], tmp_path: Path) -> None:
    """One machine, nothing else: the page, its config and the export over HTTP, the model over the embedded
    amqtt broker's WebSocket listener, which config.json names."""
    root, _ = site
    mqtt_port = socket.socket()
    mqtt_port.bind(("127.0.0.1", 0))
    port = mqtt_port.getsockname()[1]
    mqtt_port.close()
    proc = _start_coordinator(tiny_artifacts, tmp_path / "state", "--embedded-broker", "--port", str(port),
                              "--web-port", "0", "--web-host", "127.0.0.1", "--web-root", str(root))
    try:
        url, line = _page_url(proc)
        assert "on this machine only" in line and "scan" not in line, line  # no QR code for a loopback address
        web_port = int(re.match(r"http://127\.0\.0\.1:(\d+)/$", url).group(1))  # type: ignore[union-attr]
        status, headers, body = _get(web_port, "/")
        assert status == 200 and body == (root / "index.html").read_bytes()
        assert ISOLATION.items() <= headers.items()
        config = json.loads(_get(web_port, "/config.json", headers={"Host": f"127.0.0.1:{web_port}"})[2])
        assert config["fleet"] == "lab" and config["artifacts"] == "artifacts/"
        assert re.fullmatch(r"ws://127\.0\.0\.1:\d+", config["broker"]), config
        status, _, manifest = _get(web_port, "/artifacts/manifest.json")
        assert status == 200 and manifest == (tiny_artifacts / "manifest.json").read_bytes()
        base = (tiny_artifacts / "base.safetensors").read_bytes()
        assert _get(web_port, "/artifacts/base.safetensors")[2] == base

        data = os.urandom(MODEL_BYTES)  # a 600 KB model, published over TCP, read by the page's transport
        _publish_model("127.0.0.1", port, "bench/model", data)
        got, seconds = _download_over_ws(config["broker"], "bench/model", -(-MODEL_BYTES // CHUNK))
        assert got == data
        assert seconds < 1.0, f"{seconds:.2f} s for {MODEL_BYTES} B over amqtt's WebSocket listener"
        # the coordinator's own retained state reaches a WebSocket client too
        state, _ = _download_over_ws(config["broker"], "fedper/v1/lab/state", 1)
        assert json.loads(state)["v"] == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_web_port_in_use_or_a_missing_broker_url_is_one_line_and_exit_2(
        tiny_artifacts: Path, site: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = site
    cert, key = self_signed(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        proc = _start_coordinator(tiny_artifacts, tmp_path / "s1", "--broker", "mqtt://127.0.0.1:1",
                                  "--web-port", str(busy), "--web-host", "127.0.0.1", "--web-root", str(root),
                                  "--web-broker", "ws://127.0.0.1:9/")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().count("\n") == 0 and f"cannot serve the page on 127.0.0.1:{busy}" in err, err
    for extra, message in ((["--web-root", str(root)], "--web-port needs --web-broker"),
                           (["--web-root", str(root), "--web-broker", "mqtt://h:1883"], "--web-broker 'mqtt://"),
                           (["--web-root", str(tmp_path), "--web-broker", "ws://h:1/"], "no index.html"),
                           (["--web-root", str(root), "--web-broker", "wss://h/", "--web-cert", str(cert)],
                            "--web-cert and --web-key go together"),
                           (["--web-root", str(root), "--web-broker", "ws://h:1/", "--web-cert", str(cert),
                             "--web-key", str(key)], "only over wss://"),
                           (["--web-root", str(root), "--web-broker", "wss://h/", "--web-cert", str(key),
                             "--web-key", str(cert)], "cannot load them")):
        proc = _start_coordinator(tiny_artifacts, tmp_path / "s2", "--broker", "mqtt://127.0.0.1:1",
                                  "--web-port", "0", *extra)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.strip().count("\n") == 0 and message in err, err
