"""Broker -> phone: seconds to deliver a 600 KB model (retained QoS 1 chunks of 64 KB) to an MQTT client, by path.

The phone's transport is MQTT over WebSockets. Each path is timed with a paho client that connects, subscribes to
the model's chunks and waits for the last one (median of the runs): Mosquitto over TCP (what the Python agents
use), Mosquitto's own WebSocket listener, websockify in front of Mosquitto's TCP listener, deploy/'s path for
phones (nginx with TLS -> websockify -> Mosquitto: deploy/nginx/fedper-web.conf), and the embedded amqtt broker's
WebSocket listener (`fedper-coordinator --embedded-broker --web-port`). Needs Debian's mosquitto, websockify, nginx
and openssl; a path whose program is missing is left out of the table.

    python benchmarks/websocket_path.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from common import main, median, table, write_json
from paho.mqtt.enums import CallbackAPIVersion

from fedper.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import MOSQUITTO, Broker  # the test suite's launchers
from helpers.websocket import NGINX, WEBSOCKIFY, Nginx, Websockify, deploy_site, ws_client

MODEL_BYTES, CHUNK, TOPIC = 600_000, 64_000, "bench/model"


def _publish(port: int, data: bytes) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"pub-{os.urandom(3).hex()}", protocol=mqtt.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    for i in range(0, len(data), CHUNK):
        client.publish(f"{TOPIC}/{i // CHUNK:04d}", data[i:i + CHUNK], qos=1, retain=True).wait_for_publish(30)
    client.loop_stop()
    client.disconnect()


def _download(transport: str, port: int, ca: Path | None, path: str, data: bytes) -> float:
    """Seconds from connect to the last chunk; the bytes are checked."""
    chunks = -(-len(data) // CHUNK)
    if transport == "tcp":
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sub-{os.urandom(3).hex()}",
                             protocol=mqtt.MQTTv311)
    else:
        client = ws_client(f"sub-{os.urandom(3).hex()}", tls_ca=ca, path=path)
    received: dict[str, bytes] = {}
    done = threading.Event()

    def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        if message.topic.startswith(f"{TOPIC}/"):
            received[message.topic] = message.payload
        if len(received) == chunks:
            done.set()

    client.on_message = on_message
    client.on_connect = lambda c, *_: c.subscribe(f"{TOPIC}/#", qos=1)
    started = time.perf_counter()
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        if not done.wait(120):
            raise RuntimeError(f"{len(received)} of {chunks} chunks in 120 s")
        seconds = time.perf_counter() - started
    finally:
        client.loop_stop()
        client.disconnect()
    if b"".join(received[k] for k in sorted(received)) != data:
        raise RuntimeError("the model arrived corrupted")
    return seconds


@contextmanager
def _mosquitto_paths(folder: Path) -> Iterator[dict[str, tuple[int, str, int, Path | None, str]]]:
    """{path: (publish port, transport, port, CA, URL path)} for every Mosquitto-backed path available."""
    with ExitStack() as stack:
        ws_port = free_port()
        broker = Broker(folder, f"listener {ws_port} 127.0.0.1\nprotocol websockets\nsocket_domain ipv4\n")
        broker.start()
        stack.callback(broker.stop)
        paths = {"Mosquitto, TCP": (broker.port, "tcp", broker.port, None, "/"),
                 "Mosquitto's WebSocket listener": (broker.port, "websockets", ws_port, None, "/")}
        if WEBSOCKIFY:
            bridge = Websockify(folder, broker.port)
            stack.callback(bridge.stop)
            bridge.wait_ready()
            paths["websockify -> Mosquitto"] = (broker.port, "websockets", bridge.port, None, "/")
            if NGINX:
                from test_deploy import make_tls

                make_tls(folder)
                port = free_port()
                site = deploy_site(port, folder / "server.crt", folder / "server.key", bridge.port, free_port())
                nginx = Nginx(folder, site, port)
                stack.callback(nginx.stop)
                paths["deploy: nginx (TLS) -> websockify -> Mosquitto"] = (broker.port, "websockets", port,
                                                                          folder / "ca.crt", "/mqtt")
        yield paths


def run(out: Path, quick: bool) -> str:
    runs = 1 if quick else 3
    data = os.urandom(MODEL_BYTES)
    results: dict[str, list[float]] = {}

    def measure(name: str, publish_port: int, transport: str, port: int, ca: Path | None, path: str) -> None:
        _publish(publish_port, data)
        results[name] = [_download(transport, port, ca, path, data) for _ in range(runs)]
        print(f"  {name}: {median(results[name]) * 1000:.0f} ms", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if MOSQUITTO:
            with _mosquitto_paths(Path(tmp)) as paths:
                for name, endpoint in paths.items():
                    measure(name, *endpoint)
        from fedper.coordinator.broker import EmbeddedBroker

        tcp_port, ws_port = free_port(), free_port()
        with EmbeddedBroker("127.0.0.1", tcp_port, ws_port=ws_port):
            measure("embedded amqtt, WebSocket listener", tcp_port, "websockets", ws_port, None, "/")
    rows: list[list[Any]] = [[name, median(s) * 1000, min(s) * 1000, max(s) * 1000, len(s)]
                             for name, s in results.items()]
    write_json(out, "websocket_path", {"model_bytes": MODEL_BYTES, "chunk_bytes": CHUNK, "runs": runs,
                                       "seconds": results})
    header = ("path (600 KB model, 64 KB chunks, broker -> client)", "median ms", "min ms", "max ms", "runs")
    return table(header, rows)


if __name__ == "__main__":
    main(run, __doc__, quick="one run per path instead of three")
