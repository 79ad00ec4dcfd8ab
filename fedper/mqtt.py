"""The MQTT side shared by the coordinator's and the agent's services: broker URLs, paho clients
and the one receive loop both run.

Clients keep a persistent session (clean_session=False / clean_start=False with a session
expiry), so QoS 1 messages sent while a peer is briefly away wait for it at the broker, and
paho reconnects on its own with exponential backoff.

`Session` is the receive loop: paho's network thread only puts what arrives (each message, and a
`Connected` marker after every connect) on a queue, and the one thread that calls `receive` owns
the role's engine, so the engine needs no locks.
"""

from __future__ import annotations

import contextlib
import queue
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

PROTOCOLS = {"3.1.1": mqtt.MQTTv311, "5": mqtt.MQTTv5}
SESSION_EXPIRY_S = 24 * 3600


@dataclass(frozen=True)
class BrokerUrl:
    host: str
    port: int
    tls: bool


def parse_broker_url(url: str) -> BrokerUrl:
    """mqtt://host[:1883] or mqtts://host[:8883]."""
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parsed.hostname:
        raise ValueError(f"broker URL {url!r} must look like mqtt://host:1883 or mqtts://host:8883")
    tls = parsed.scheme in ("mqtts", "ssl")
    try:
        port = parsed.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"broker URL {url!r} has a bad port") from None
    return BrokerUrl(parsed.hostname, port, tls)


def make_client(
    client_id: str,
    *,
    protocol: str = "5",
    username: str | None = None,
    password: str | None = None,
    tls: bool = False,
    tls_ca: str | None = None,
    will: tuple[str, bytes] | None = None,
    manual_ack: bool = False,
) -> mqtt.Client:
    """A paho client with a persistent session, auth, TLS, a retained last will and reconnect backoff.

    manual_ack: QoS 1 messages are acknowledged by the caller (client.ack) once handled, so the
    broker redelivers what a killed process received but had not yet made durable.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"MQTT protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    v5 = protocol == "5"
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=PROTOCOLS[protocol], manual_ack=manual_ack,
        **({} if v5 else {"clean_session": False}),
    )
    if username is not None:
        client.username_pw_set(username, password)
    if tls or tls_ca:
        client.tls_set(ca_certs=tls_ca, cert_reqs=ssl.CERT_REQUIRED)
    if will is not None:
        client.will_set(will[0], will[1], qos=1, retain=True)
    client.reconnect_delay_set(min_delay=1, max_delay=30)
    return client


def connect_async(client: mqtt.Client, broker: BrokerUrl, keepalive: int = 30) -> None:
    """Start connecting in paho's network thread; it keeps retrying until it gets through."""
    if client.protocol == mqtt.MQTTv5:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = SESSION_EXPIRY_S
        client.connect_async(broker.host, broker.port, keepalive, clean_start=False, properties=props)
    else:
        client.connect_async(broker.host, broker.port, keepalive)
    client.loop_start()


class BrokerRefused(RuntimeError):
    """The broker turned the client away (bad credentials, not authorized): retrying cannot help."""


@dataclass(frozen=True)
class Connected:
    """(Re)connected and subscribed: the role announces itself again (a broker may have lost its state)."""


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    mid: int
    qos: int


@dataclass(frozen=True)
class _Refused:
    reason: str


class Session:
    """A started paho client and its inbox, from connect to a clean disconnect (use it with `with`).

    subscriptions: (topic filter, QoS) pairs, subscribed on every connect. farewell: (topic,
    payload) published retained at QoS 1, and waited for, before a clean disconnect (the broker
    sends the last will only when a client vanishes). log: where "lost the broker" goes.
    """

    def __init__(self, client: mqtt.Client, broker: BrokerUrl, subscriptions: Sequence[tuple[str, int]], *,
                 log: Callable[[str], None], farewell: tuple[str, bytes] | None = None) -> None:
        self.client, self.broker = client, broker
        self._subscriptions = list(subscriptions)
        self._log, self._farewell = log, farewell
        self._inbox: queue.Queue[Connected | Received | _Refused] = queue.Queue()
        self._closing = False
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = lambda client, userdata, msg: self._inbox.put(
            Received(msg.topic, bytes(msg.payload), msg.mid, msg.qos))
        connect_async(client, broker)

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        if getattr(reason, "is_failure", False):
            self._closing = True  # `receive` raises BrokerRefused: paho's disconnect that follows is no news
            self._inbox.put(_Refused(str(reason)))
            return
        client.subscribe(self._subscriptions)
        self._inbox.put(Connected())

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason: object,
                       props: object) -> None:
        if not self._closing:
            self._log(f"lost the broker ({reason}): reconnecting")

    def receive(self, timeout: float) -> Connected | Received | None:
        """The next message or connect, None after `timeout` seconds of quiet; BrokerRefused when refused."""
        try:
            event = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, _Refused):
            raise BrokerRefused(f"the broker at {self.broker.host}:{self.broker.port} refused the connection: "
                                f"{event.reason}")
        return event

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic, payload, qos=qos, retain=retain)

    def ack(self, message: Received) -> None:
        """Acknowledge a QoS 1 message of a manual_ack client, once it is handled (and made durable)."""
        self.client.ack(message.mid, message.qos)

    def close(self, wait_s: float = 5.0) -> None:
        """Publish the farewell (if connected: otherwise the last will says it), then disconnect."""
        self._closing = True
        if self._farewell is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # not connected
                self.publish(*self._farewell, qos=1, retain=True).wait_for_publish(wait_s)
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
