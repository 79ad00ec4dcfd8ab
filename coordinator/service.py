"""The paho I/O around the Coordinator state machine: subscribe, feed, publish. Nothing else.

One thread owns the engine, so it needs no locks; only the per-device rate limit (Coordinator.admit)
runs in paho's network thread, so a flood is dropped before it is queued. A QoS 1 message is
acknowledged after it was handled (an accepted update after its checkpoint), so a kill before that
makes the broker redeliver it (docs/reliability.md). The engine's thread never waits for the broker
but at the very end: under a flood the broker's acknowledgement of a model broadcast came 30-76 s late,
and a thread waiting for it let the round's deadline pass unhandled. With `linger_s` (the embedded broker,
which stops with this process) the service stays after the last round until no device is online or linger_s
has passed, so that every device hears the final model and goes offline itself rather than losing its broker.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt

from fedper.coordinator.durable import Coordinator
from fedper.coordinator.logs import log
from fedper.mqtt import BrokerUrl, Connected, Session, make_client
from fedper.wire import Outgoing

PUBLISH_WAIT_S = 60.0


def steady_clock() -> Callable[[], float]:
    """The engine's clock: wall time at this call, advancing with the monotonic clock, so that a step of the
    system clock (NTP, an operator) moves no deadline or answer timeout (the chaos soak's clock jump: a
    +44 s step passed a round's deadline at once and lapsed its 8 invitations)."""
    start_wall, start = time.time(), time.monotonic()
    return lambda: start_wall + time.monotonic() - start


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
    linger_s: float = 0.0,
) -> None:
    """Serve until the last round is closed and announced (then up to `linger_s` more while devices are online),
    or `stop` is set; BrokerRefused when the broker turns the coordinator away."""
    topics = coordinator.topics
    stop = stop or threading.Event()
    clock = steady_clock()
    offline = json.dumps({"v": 1, "status": "offline"}).encode()
    client = make_client(f"fedper-coordinator-{topics.fleet}", protocol=protocol, username=username,
                         password=password, tls=broker.tls, tls_ca=tls_ca, will=(topics.state, offline),
                         manual_ack=True)
    subscriptions = [(f"{topics.base}/{kind}/+", 1) for kind in coordinator.strategy.terms.kinds]
    started = False
    broadcast = _Broadcast()
    linger_until = None  # once finished: when to stop waiting for the devices online to go
    log.info("connecting to %s:%d (MQTT %s), fleet %s", broker.host, broker.port, protocol, topics.fleet)
    try:
        with Session(client, broker, subscriptions, log=log.warning,
                     admit=lambda topic: coordinator.admit(topic, clock())) as session:
            while not stop.is_set():
                event = session.receive(timeout=0.1)
                now = clock()
                out: list[Outgoing] = []
                if isinstance(event, Connected):
                    log.info("connected to the broker")
                    out = coordinator.announce(now) if started else coordinator.start(now)
                    started = True
                elif event is not None:
                    out = coordinator.handle(event.topic, event.payload, now, admitted=True)
                    session.ack(event)  # only now: an accepted update is checkpointed before the broker forgets it
                if started:
                    out += coordinator.tick(now)
                    _publish(session.client, coordinator, out, broadcast, wait_all=coordinator.finished, clock=clock)
                    if on_tick:
                        on_tick(coordinator)
                    if coordinator.finished:  # the final model and state are out and acknowledged
                        if linger_until is None and linger_s > 0 and coordinator.online:
                            linger_until = now + linger_s
                            log.info("final model published; waiting up to %.0f s for the %d device(s) online to "
                                     "fetch it before the embedded broker stops", linger_s, len(coordinator.online))
                        if linger_until is None or not coordinator.online or now >= linger_until:
                            break
    finally:
        stop.set()


@dataclass
class _Broadcast:
    """The model broadcast in flight: when it was published, and its messages the broker has not acknowledged."""

    started: float = 0.0
    pending: deque[mqtt.MQTTMessageInfo] = field(default_factory=deque)


def _publish(client: mqtt.Client, coordinator: Coordinator, messages: list[Outgoing], broadcast: _Broadcast,
             wait_all: bool = False, clock: Callable[[], float] = time.time) -> None:
    """Publish in order without waiting (but for everything with `wait_all`: the run is over); the round's
    model broadcast is timed until the broker acknowledged it, as seen at this call or a later one."""
    coordinator.note_sent(sum(len(m.payload) for m in messages))
    sent = [(m, client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)) for m in messages]
    coordinator.note_published(clock())
    chunks = [info for m, info in sent if m.broadcast]
    if chunks and not broadcast.pending:
        broadcast.started = time.perf_counter()
    broadcast.pending.extend(chunks)
    if wait_all:
        for _, info in sent:
            try:
                info.wait_for_publish(PUBLISH_WAIT_S)
            except (RuntimeError, ValueError) as e:  # not connected: paho resends after reconnecting
                log.warning("final messages not acknowledged yet: %s", e)
                break
    was_pending = bool(broadcast.pending)
    try:
        while broadcast.pending and broadcast.pending[0].is_published():  # acknowledged in order, or nearly
            broadcast.pending.popleft()
    except (RuntimeError, ValueError):  # published while the broker was away: paho resends it; no timing then
        broadcast.pending.clear()
        return
    if was_pending and not broadcast.pending:
        coordinator.note_broadcast(time.perf_counter() - broadcast.started)
