"""The paho I/O around the Coordinator state machine: subscribe, feed, publish. Nothing else.

paho's network thread only puts incoming messages on a queue; one loop thread owns the
Coordinator, so it needs no locks. QoS 1 messages are acknowledged after they were handled (and
an accepted update checkpointed): a kill before that makes the broker redeliver them.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt

from fedper.coordinator.engine import Coordinator, Outgoing
from fedper.mqtt import BrokerUrl, connect_async, make_client

log = logging.getLogger("fedper.coordinator")
_CONNECTED = "<connected>"
_REFUSED = "<refused>"


class BrokerRefused(RuntimeError):
    """The broker turned the coordinator away (bad credentials, not authorized): retrying cannot help."""
PUBLISH_WAIT_S = 60.0


def run_service(
    coordinator: Coordinator,
    broker: BrokerUrl,
    *,
    protocol: str = "5",
    username: str | None = None,
    password: str | None = None,
    tls_ca: str | None = None,
    stop: threading.Event | None = None,
    on_tick: Callable[[Coordinator], None] | None = None,
) -> None:
    """Serve until the last round is closed and announced (or `stop` is set)."""
    topics = coordinator.topics
    stop = stop or threading.Event()
    inbox: queue.Queue[tuple[str, bytes, int, int]] = queue.Queue()
    offline = json.dumps({"v": 1, "status": "offline"}).encode()
    client = make_client(f"fedper-coordinator-{topics.fleet}", protocol=protocol, username=username,
                         password=password, tls=broker.tls, tls_ca=tls_ca, will=(topics.state, offline),
                         manual_ack=True)

    def on_connect(client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        if getattr(reason, "is_failure", False):
            inbox.put((_REFUSED, str(reason).encode(), 0, 0))
            return
        client.subscribe([(f"{topics.base}/{kind}/+", 1) for kind in ("register", "presence", "update")])
        inbox.put((_CONNECTED, b"", 0, 0))

    def on_disconnect(client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        if not stop.is_set():
            log.warning("lost the broker (%s): reconnecting", reason)

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    client.on_message = lambda client, userdata, msg: inbox.put((msg.topic, bytes(msg.payload), msg.mid, msg.qos))
    connect_async(client, broker)
    log.info("connecting to %s:%d (MQTT %s), fleet %s", broker.host, broker.port, protocol, topics.fleet)

    started = False
    try:
        while not stop.is_set():
            try:
                topic, payload, mid, qos = inbox.get(timeout=0.1)
            except queue.Empty:
                topic, payload, mid, qos = "", b"", 0, 0
            now = time.time()
            out: list[Outgoing] = []
            if topic == _REFUSED:
                raise BrokerRefused(f"the broker at {broker.host}:{broker.port} refused the connection: "
                                    f"{payload.decode()}")
            if topic == _CONNECTED:
                log.info("connected to the broker")
                out = coordinator.announce(now) if started else coordinator.start(now)
                started = True
            elif topic:
                out = coordinator.handle(topic, payload, now)
                client.ack(mid, qos)  # only now: an accepted update is checkpointed before the broker forgets it
            if started:
                out += coordinator.tick(now)
                _publish(client, coordinator, out, wait_all=coordinator.finished)
                if on_tick:
                    on_tick(coordinator)
                if coordinator.finished:  # the final model and state are out and acknowledged
                    break
    finally:
        stop.set()
        client.disconnect()
        client.loop_stop()


def _publish(client: mqtt.Client, coordinator: Coordinator, messages: list[Outgoing], wait_all: bool = False) -> None:
    """Publish in order; time the round's model broadcast until the broker acknowledged it."""
    started = time.perf_counter()
    pending = []
    for m in messages:
        info = client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)
        if m.broadcast or wait_all:
            pending.append(info)
    for info in pending:
        try:
            info.wait_for_publish(PUBLISH_WAIT_S)
        except (RuntimeError, ValueError) as e:  # not connected: paho resends after reconnecting
            log.warning("model broadcast not acknowledged yet: %s", e)
            break
    if pending:
        coordinator.note_broadcast(time.perf_counter() - started)
