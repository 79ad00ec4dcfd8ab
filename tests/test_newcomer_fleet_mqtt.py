"""Connecting speaks (issue 27): fedper.mqtt.Session, which the agent and the coordinator both run, against real
brokers (Mosquitto, the embedded amqtt one) and against hand-built ones that answer CONNECT as a 3.1.1-only broker
does or not at all: a refused port and an unknown host are said with where and what to try, MQTT 5 falls back to
3.1.1 by itself, two clients with one client id are told, by their own sessions and by a real coordinator process.
The embedded broker sends a retained message only to a client subscribed to it (amqtt replays every client's
subscriptions to a newcomer: a device got the open round twice and sent its update twice)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers.processes import Processes
from helpers.toy_export import write_toy_export
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.broker import EmbeddedBroker
from fedper.mqtt import Backoff, BrokerUrl, Connected, Received, Session, make_client
from fedper.ports import free_port


def pump(sessions: list[Session], until: Callable[[], bool], timeout: float,
         on_event: Callable[[int, Connected | Received], None] = lambda i, e: None) -> None:
    """Receive on every session until `until()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        for index, session in enumerate(sessions):
            event = session.receive(timeout=0.05)
            if event is not None:
                on_event(index, event)


@pytest.mark.parametrize(("host", "said"), [
    ("127.0.0.1", ["connection refused", "nothing listens on port {port}", "is the broker running"]),
    ("no-such-broker.invalid", ["'no-such-broker.invalid' does not resolve", "check the broker URL's host"]),
])
def test_a_refused_port_and_an_unknown_host_are_said_with_where_and_what_to_try(host: str, said: list[str]) -> None:
    port = free_port()
    lines: list[str] = []
    session = Session(make_client("probe"), BrokerUrl(host, port, False), [], log=lines.append)
    try:
        pump([session], lambda: bool(lines), timeout=15)
    finally:
        session.close()
    assert lines[0].startswith(f"cannot connect to the broker at {host}:{port} (for 0 s): "), lines
    assert all(part.format(port=port) in lines[0] for part in said), lines
    assert "(trying again in " in lines[0]


def test_mqtt5_against_the_embedded_broker_falls_back_to_3_1_1_and_works() -> None:
    """amqtt does not answer an MQTT 5 CONNECT at all (it reads the properties as a client id and waits)."""
    port = free_port()
    lines: list[str] = []
    events: list[Connected | Received] = []
    with EmbeddedBroker("127.0.0.1", port):
        publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "publisher", protocol=mqtt.MQTTv311)
        publisher.connect("127.0.0.1", port)
        publisher.loop_start()
        publisher.publish("t/x", b"hello", qos=1, retain=True).wait_for_publish(5)
        session = Session(make_client("five", protocol="5"), BrokerUrl("127.0.0.1", port, False), [("t/#", 1)],
                          log=lines.append)
        try:
            pump([session], lambda: any(isinstance(e, Received) for e in events), timeout=30,
                 on_event=lambda i, e: events.append(e))
        finally:
            session.close()
            publisher.loop_stop()
    assert isinstance(events[0], Connected) and events[1] == Received("t/x", b"hello", events[1].mid, 1)
    assert session.client.protocol == mqtt.MQTTv311
    assert len(lines) == 1 and lines[0].startswith(f"the broker at 127.0.0.1:{port} does not speak MQTT 5 (no answer "
                                                   "to its CONNECT in 5 s): connecting with MQTT 3.1.1"), lines


class HandBuiltBroker:
    """Answers each CONNECT by its protocol level: `answers[level]` is the CONNACK to send (None: say nothing);
    records the levels it saw."""

    def __init__(self, answers: dict[int, bytes | None]) -> None:
        self.answers, self.levels = answers, []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.open.append(conn)
            header = conn.recv(2)  # CONNECT's fixed header: type, and a remaining length below 128
            body = conn.recv(header[1])
            level = body[6]  # after the protocol name: 0x00 0x04 "MQTT"
            self.levels.append(level)
            answer = self.answers[level]
            if answer is not None:
                conn.sendall(answer)

    def close(self) -> None:
        self.server.close()
        for conn in self.open:
            conn.close()


def test_a_broker_that_refuses_mqtt5_as_unsupported_is_spoken_to_in_3_1_1() -> None:
    unsupported, accepted = b"\x20\x02\x00\x01", b"\x20\x02\x00\x00"  # CONNACK, 3.1.1 layout: return code 1, 0
    broker = HandBuiltBroker({5: unsupported, 4: accepted})
    lines: list[str] = []
    events: list[Connected | Received] = []
    session = Session(make_client("five", protocol="5"), BrokerUrl("127.0.0.1", broker.port, False), [],
                      log=lines.append)
    try:
        pump([session], lambda: bool(events), timeout=15, on_event=lambda i, e: events.append(e))
    finally:
        session.close()
        broker.close()
    assert broker.levels == [5, 4] and events == [Connected()]
    assert len(lines) == 1 and "does not speak MQTT 5 (it answered that it does not support that protocol version)" \
        in lines[0], lines


def test_a_port_that_never_answers_connect_is_said() -> None:
    broker = HandBuiltBroker({4: None})
    lines: list[str] = []
    session = Session(make_client("quiet", protocol="3.1.1"), BrokerUrl("127.0.0.1", broker.port, False), [],
                      log=lines.append)
    try:
        pump([session], lambda: bool(lines), timeout=15)
    finally:
        session.close()
        broker.close()
    assert len(lines) == 1 and lines[0].startswith(
        f"cannot connect to the broker at 127.0.0.1:{broker.port} (for 5 s): connected, but no answer to the MQTT "
        "CONNECT in 5 s: is this an MQTT broker's port (mqtts:// for a TLS one)? The embedded broker is silent too "
        "while another connection holds the client id 'quiet'"), lines


@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
def test_two_clients_with_one_id_are_told_by_their_sessions_and_by_the_coordinator(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path, processes: Processes) -> None:
    """Each connect takes the connection over from the other. Mosquitto drops the older one every time: with a
    short reconnect spread they knock each other off every second or so, which each session says, and the
    coordinator sees `online` again and again. amqtt (the coordinator's embedded broker) takes over a few times,
    or keeps one waiting unanswered, or ends up holding both: the coordinator reads it in amqtt's log."""
    export = write_toy_export(tmp_path / "export", tiny_manifest(), tiny_tensors())
    if kind == "mosquitto":
        url = BrokerUrl("127.0.0.1", request.getfixturevalue("mosquitto").port, False)
        where = ["--broker", f"mqtt://127.0.0.1:{url.port}"]
        said = "device twin came online 4 times in"
        told = "are two agents running with --client-id twin? Each connect takes the connection over"
    else:
        url = BrokerUrl("127.0.0.1", free_port(), False)
        where = ["--embedded-broker", "--port", str(url.port)]
        said = "the embedded broker: a second connection uses the client id twin"
        told = "are two agents running with --client-id twin (or two coordinators of one fleet)?"
    coordinator = processes.start("coordinator", "-m", "fedper.coordinator.cli", "--artifacts", str(export),
                                  "--fleet", "lab", "--rounds", "1", "--state-dir", str(tmp_path / "state"), *where)
    presence = "fedper/v1/lab/presence/twin"
    logs: list[list[str]] = [[], []]
    twins: list[Session] = []
    try:
        deadline = time.monotonic() + 60
        while "connected to the broker" not in processes.log("coordinator"):
            assert coordinator.poll() is None and time.monotonic() < deadline, processes.log("coordinator")
            time.sleep(0.2)
        connects = [0, 0]

        def announce(index: int, event: Connected | Received) -> None:
            if isinstance(event, Connected):
                connects[index] += 1
                twins[index].publish(presence, b"online", retain=True)

        for index in range(2):  # one after the other: amqtt keeps both when two connect in the same instant
            twins.append(Session(make_client("twin", protocol="3.1.1", will=(presence, b"offline")), url, [],
                                 log=logs[index].append, backoff=Backoff(spread_s=0.5)))
            pump(twins, lambda index=index: connects[index] > 0, timeout=10, on_event=announce)
        def sessions_said() -> bool:
            return kind == "embedded" or all(any("dropped this connection 3 times" in line for line in log)
                                             for log in logs)

        pump(twins, lambda: sessions_said() and said in processes.log("coordinator"), timeout=60, on_event=announce)
    finally:
        for twin in twins:
            twin.close()
    line = next(line for line in processes.log("coordinator").splitlines() if said in line)
    assert told in line and "give each device its own id" in line
    if kind == "mosquitto":
        for log in logs:
            line = next(line for line in log if "dropped this connection" in line)
            assert "another client connected with the client id 'twin'" in line and "give each its own id" in line


def test_the_embedded_broker_sends_a_retained_message_only_to_its_subscribers() -> None:
    port = free_port()

    def client(name: str, seen: list[str] | None = None) -> mqtt.Client:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, name, protocol=mqtt.MQTTv311)
        if seen is not None:
            c.on_message = lambda cl, userdata, message: seen.append(message.topic)
        c.connect("127.0.0.1", port)
        c.loop_start()
        return c

    with EmbeddedBroker("127.0.0.1", port):
        publisher = client("publisher")
        for topic in ("fedper/v1/lab/register/a", "fedper/v1/lab/round"):
            publisher.publish(topic, b"retained", qos=1, retain=True).wait_for_publish(5)
        earlier = client("coordinator")
        earlier.subscribe([("fedper/v1/lab/register/+", 1), ("fedper/v1/lab/round", 1)])
        time.sleep(0.5)
        seen: list[str] = []
        newcomer = client("device", seen)
        newcomer.subscribe("fedper/v1/lab/round", 1)
        time.sleep(1.5)
        for c in (publisher, earlier, newcomer):
            c.loop_stop()
            c.disconnect()
    assert seen == ["fedper/v1/lab/round"]  # once, and never another device's registration


def mqtt_packet(kind: int, body: bytes) -> bytes:
    """An MQTT 3.1.1 packet by hand: the fixed header's type byte, the remaining length (a varint), the body."""
    length, size = b"", len(body)
    while True:
        size, digit = size // 128, size % 128
        length += bytes([digit | (128 if size else 0)])
        if not size:
            return bytes([kind]) + length + body


def test_the_embedded_broker_takes_a_websocket_message_of_many_packets_over_one_mib() -> None:
    """mqtt.js (the page) joins the packets it has queued into one WebSocket message: the page's update of a
    MobileNet-v1 at width 0.5 came as one message of over 1 MiB, and amqtt's listener (websockets' 1 MiB default)
    closed the connection at every send. 24 PUBLISH packets of 63 KiB in one message reach a TCP subscriber."""
    from websockets.sync.client import connect

    port, ws_port, seen = free_port(), free_port(), []
    with EmbeddedBroker("127.0.0.1", port, ws_port=ws_port):
        subscriber = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "coordinator", protocol=mqtt.MQTTv311)
        subscriber.on_message = lambda c, userdata, message: seen.append(len(message.payload))
        subscriber.connect("127.0.0.1", port)
        subscriber.subscribe("fedper/v1/lab/update/page", 0)
        subscriber.loop_start()
        time.sleep(0.5)
        with connect(f"ws://127.0.0.1:{ws_port}/", subprotocols=["mqtt"]) as page:
            page.send(mqtt_packet(0x10, b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x04page"))  # CONNECT, clean session
            assert page.recv(timeout=5)[:4] == b"\x20\x02\x00\x00"  # CONNACK, accepted
            topic = b"fedper/v1/lab/update/page"
            packet = mqtt_packet(0x30, len(topic).to_bytes(2, "big") + topic + bytes(63 * 1024))  # PUBLISH, QoS 0
            message = packet * 24
            assert len(message) > 2**20
            page.send(message)
            deadline = time.monotonic() + 20
            while len(seen) < 24 and time.monotonic() < deadline:
                time.sleep(0.1)
        subscriber.loop_stop()
        subscriber.disconnect()
    assert seen == [63 * 1024] * 24
