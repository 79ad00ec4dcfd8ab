"""The MQTT side shared by the coordinator's and the agent's services: broker URLs, paho clients
and the one receive loop both run.

Clients keep a persistent session (clean_session=False / clean_start=False with a session
expiry), so QoS 1 messages sent while a peer is briefly away wait for it at the broker. paho's
network thread reconnects; a `Session` draws each wait from its `Backoff` (docs/protocol.md,
section 1.1): full jitter, and for a device a spread window after a lost connection, so a fleet
that lost its broker at once does not come back at once (paho's own backoff has no jitter).

`Session` is the receive loop: paho's network thread only puts what arrives (each message, and a
`Connected` marker after every connect) on a queue, and the one thread that calls `receive` owns
the role's engine, so the engine needs no locks. The one exception is an `admit` filter, which runs
in the network thread: what it refuses is acknowledged there and never queued, so a flood costs
the receiving side microseconds a message instead of a place in the queue and a trip through the
engine (the filter must be thread-safe).

The broker password never needs the command line, where every user of the machine reads it in `ps`:
`broker_password` takes it from the file FEDPER_MQTT_PASSWORD_FILE names or from systemd's credential
(`LoadCredential=mqtt-password:...` puts it in $CREDENTIALS_DIRECTORY) when none is given, for every
role that connects through `make_client`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import ssl
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

PROTOCOLS = {"3.1.1": mqtt.MQTTv311, "5": mqtt.MQTTv5}
SESSION_EXPIRY_S = 24 * 3600
PASSWORD_FILE_ENV = "FEDPER_MQTT_PASSWORD_FILE"  # a file holding the broker password (one line)
CREDENTIAL = "mqtt-password"  # its name as a systemd credential (deploy/systemd/)


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


def broker_password(password: str | None) -> str | None:
    """`password` if given (--password or FEDPER_MQTT_PASSWORD), else the first line of the file
    $FEDPER_MQTT_PASSWORD_FILE, else of $CREDENTIALS_DIRECTORY/mqtt-password, else None. A named file that
    cannot be read, or is empty, is an error: falling back to no password would only hide the mistake."""
    if password is not None:
        return password
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path and os.environ.get("CREDENTIALS_DIRECTORY"):
        credential = Path(os.environ["CREDENTIALS_DIRECTORY"], CREDENTIAL)
        path = str(credential) if credential.exists() else None
    if not path:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the broker password from {path}: {e.strerror}") from None
    if not lines or not lines[0]:
        raise ValueError(f"the broker password file {path} is empty")
    return lines[0]


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
    broker redelivers what a killed process received but had not yet made durable. Without a password,
    one from a file or a systemd credential is used (broker_password).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"MQTT protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    v5 = protocol == "5"
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=PROTOCOLS[protocol], manual_ack=manual_ack,
        **({} if v5 else {"clean_session": False}),
    )
    if username is not None:
        client.username_pw_set(username, broker_password(password))
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


@dataclass
class Backoff:
    """Reconnect delays with full jitter (docs/protocol.md, section 1.1): every delay is drawn
    uniformly from [0, bound]. After an established connection is lost, the first attempt waits
    within [0, spread_s]; after the n-th failed attempt, within [0, min(cap_s, base_s * 2**n)].
    A successful connect starts over. `rng`: seeded per process by default; seeded in tests."""

    spread_s: float
    base_s: float = 1.0
    cap_s: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    @classmethod
    def device(cls, spread_s: float = 30.0) -> Backoff:
        """A fleet member: 10,000 devices spread over 30 s arrive at about 330 a second."""
        return cls(spread_s=spread_s)

    @classmethod
    def coordinator(cls) -> Backoff:
        """The one client a round waits for: it tries again at once, and at most 10 s apart."""
        return cls(spread_s=0.0, cap_s=10.0)

    def after_loss(self) -> float:
        self.failures = 0
        return self.rng.uniform(0.0, self.spread_s)

    def after_failure(self) -> float:
        self.failures += 1
        return self.rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 62)))

    def connected(self) -> None:
        self.failures = 0


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

    subscriptions: (topic filter, QoS) pairs, subscribed on every connect; `subscribe_only`
    changes them. forget: topic filters unsubscribed on every connect unless wanted then (a
    persistent session keeps what an earlier run of the same client subscribed to). farewell:
    (topic, payload) published retained at QoS 1, and waited for, before a clean disconnect (the
    broker sends the last will only when a client vanishes). log: where "lost the broker" goes.
    backoff: how long paho waits before each reconnect attempt (default: the coordinator's prompt one).
    admit: called with each message's topic in paho's network thread; a message it refuses is dropped
    there (a QoS 1 one acknowledged at once, for good) and never reaches `receive`.
    """

    def __init__(self, client: mqtt.Client, broker: BrokerUrl, subscriptions: Sequence[tuple[str, int]], *,
                 log: Callable[[str], None], farewell: tuple[str, bytes] | None = None,
                 backoff: Backoff | None = None, forget: Iterable[str] = (),
                 admit: Callable[[str], bool] | None = None) -> None:
        self.client, self.broker = client, broker
        self._subscriptions = dict(subscriptions)
        self._always_forget = frozenset(forget)
        self._forget = set(self._always_forget)  # and what was dropped while the broker was away
        self._subscribed = threading.Lock()  # the subscriptions, between the caller and paho's on_connect
        self._log, self._farewell = log, farewell
        self._backoff = backoff or Backoff.coordinator()
        self._established = False
        self._inbox: queue.Queue[Connected | Received | _Refused | Any] = queue.Queue()
        self._closing = False
        self._admit = admit
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = lambda client, userdata: self._wait_before_next(self._backoff.after_failure())
        client.on_message = self._on_message
        connect_async(client, broker)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic
        if self._admit is not None and not self._admit(topic):
            client.ack(msg.mid, msg.qos)  # a no-op unless manual_ack: the broker may forget a dropped message
            return
        self._inbox.put(Received(topic, bytes(msg.payload), msg.mid, msg.qos))

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        if getattr(reason, "is_failure", False):
            self._closing = True  # `receive` raises BrokerRefused: paho's disconnect that follows is no news
            self._inbox.put(_Refused(str(reason)))
            return
        self._backoff.connected()
        self._established = True
        with self._subscribed:
            stale = sorted(self._forget - self._subscriptions.keys())
            if stale:
                client.unsubscribe(stale)
            self._forget = set(self._always_forget)
            if self._subscriptions:
                client.subscribe(list(self._subscriptions.items()))
        self._inbox.put(Connected())

    def _on_disconnect(self, client: mqtt.Client, userdata: object, flags: object, reason: object,
                       props: object) -> None:
        if self._closing:
            return
        if self._established:  # a connection that worked is gone: come back within the spread window
            self._established = False
            delay = self._backoff.after_loss()
            self._log(f"lost the broker ({reason}): reconnecting in {delay:.1f} s")
        else:  # an attempt that got no CONNACK
            delay = self._backoff.after_failure()
        self._wait_before_next(delay)

    def _wait_before_next(self, delay: float) -> None:
        """paho's network thread waits its reconnect delay right after the callback that calls this:
        min = max makes that wait exactly `delay` (and resets paho's own doubling)."""
        self.client.reconnect_delay_set(min_delay=delay, max_delay=delay)

    def subscribe_only(self, wanted: Iterable[tuple[str, int]]) -> None:
        """Make `wanted` the subscriptions, now and on every reconnect: subscribe what is new,
        unsubscribe what is no longer wanted (e.g. a model's chunks once the device holds it)."""
        wanted = dict(wanted)
        with self._subscribed:
            gone = [topic for topic in self._subscriptions if topic not in wanted]
            new = [(topic, qos) for topic, qos in wanted.items() if self._subscriptions.get(topic) != qos]
            self._subscriptions = wanted
            if gone and self.client.unsubscribe(gone)[0] != mqtt.MQTT_ERR_SUCCESS:
                self._forget.update(gone)  # not connected: the broker's session still holds them
            if new:
                self.client.subscribe(new)

    def post(self, event: object) -> None:
        """Queue an event of the role's own (a job's result from another thread) behind what has arrived, so
        the thread that calls `receive` takes it in turn with the messages."""
        self._inbox.put(event)

    def receive(self, timeout: float) -> Connected | Received | Any | None:
        """The next message or connect (or posted event), None after `timeout` seconds of quiet; BrokerRefused
        when refused."""
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
