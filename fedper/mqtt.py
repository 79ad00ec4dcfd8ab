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

A broker that cannot be reached is said, with where and what to try, at each failed attempt (at most one
line every few seconds); a broker that does not speak MQTT 5 (the embedded amqtt broker speaks 3.1.1 only) is
spoken to in 3.1.1 instead; a connection the broker drops again and again right after each connect (another
client with the same client id taking it over) is said too.

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
import socket
import ssl
import threading
import time
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
CONNACK_WAIT_S = 5.0  # connected, no CONNACK: amqtt (3.1.1 only) reading an MQTT 5 CONNECT waits for bytes forever
REPORT_EVERY_S = 5.0  # at most one line this often about a broker that cannot be reached
SHORT_LIVED_S = 60.0  # a connection the broker drops sooner than this after the CONNACK counts towards a takeover
TAKEOVERS = 3  # that many in a row: said (two clients with one client id knock each other off)
UNSUPPORTED_PROTOCOL = 132  # CONNACK reason "Unsupported protocol version" (3.1.1's return code 1 maps to it)


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


class Client(mqtt.Client):
    """paho's client as make_client builds it: with its settings (to build it again for MQTT 3.1.1) and the error
    of its last failed connect, which paho's on_connect_fail does not pass on."""

    settings: dict[str, Any]  # make_client's arguments
    connect_error: OSError | None = None
    attempt_at = 0.0  # time.monotonic() of the last connect attempt

    def reconnect(self) -> mqtt.MQTTErrorCode:
        self.attempt_at, self.connect_error = time.monotonic(), None
        try:
            return super().reconnect()
        except OSError as e:
            self.connect_error = e
            raise


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
) -> Client:
    """A paho client with a persistent session, auth, TLS, a retained last will and reconnect backoff.

    manual_ack: QoS 1 messages are acknowledged by the caller (client.ack) once handled, so the
    broker redelivers what a killed process received but had not yet made durable. Without a password,
    one from a file or a systemd credential is used (broker_password).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"MQTT protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    v5 = protocol == "5"
    client = Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=PROTOCOLS[protocol], manual_ack=manual_ack,
        **({} if v5 else {"clean_session": False}),
    )
    client.settings = {"client_id": client_id, "protocol": protocol, "username": username, "password": password,
                       "tls": tls, "tls_ca": tls_ca, "will": will, "manual_ack": manual_ack}
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


@dataclass(frozen=True)
class _Unsupported:
    """The broker answered an MQTT 5 CONNECT with "unsupported protocol version"."""


def connect_problem(error: OSError | None, broker: BrokerUrl, reason: object = None) -> str:
    """Why a connect to `broker` failed and what to try, from the error of its TCP/TLS connect (None: the
    connection was made, and lost for `reason` before the broker's CONNACK)."""
    if isinstance(error, socket.gaierror):
        return f"the host name {broker.host!r} does not resolve ({error.strerror}): check the broker URL's host"
    if isinstance(error, ConnectionRefusedError):
        return (f"connection refused: nothing listens on port {broker.port} there; is the broker running, and is "
                f"{broker.port} its port (the coordinator's --embedded-broker listens on its --port)?")
    if isinstance(error, TimeoutError):
        return "no answer (timed out): is the host right, and the port open in its firewall?"
    if isinstance(error, ssl.SSLError):
        return (f"the TLS handshake failed ({error.reason or error}): mqtts:// needs the broker's TLS port, and "
                "--tls-ca the CA that signed its certificate")
    if error is None:
        return (f"the connection ended before the broker answered the MQTT CONNECT ({reason}): is this port a "
                "TLS one (then use mqtts://)?")
    return error.strerror or str(error)


class Session:
    """A started paho client and its inbox, from connect to a clean disconnect (use it with `with`).

    subscriptions: (topic filter, QoS) pairs, subscribed on every connect; `subscribe_only`
    changes them. forget: topic filters unsubscribed on every connect unless wanted then (a
    persistent session keeps what an earlier run of the same client subscribed to). farewell:
    (topic, payload) published retained at QoS 1, and waited for, before a clean disconnect (the
    broker sends the last will only when a client vanishes). log: where "lost the broker", why a connect
    failed and the switch to MQTT 3.1.1 go. backoff: how long paho waits before each reconnect attempt
    (default: the coordinator's prompt one). admit: called with each message's topic in paho's network
    thread; a message it refuses is dropped there (a QoS 1 one acknowledged at once, for good) and never
    reaches `receive`. `client` (make_client's) is replaced by an MQTT 3.1.1 one when the broker does not
    speak MQTT 5: publish through the session, or through `session.client`.
    """

    def __init__(self, client: Client, broker: BrokerUrl, subscriptions: Sequence[tuple[str, int]], *,
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
        self._inbox: queue.Queue[Connected | Received | _Refused | _Unsupported | Any] = queue.Queue()
        self._closing = False
        self._admit = admit
        self._down_since = time.monotonic()  # trying to connect since: the start, or the last loss
        self._last_report = -float("inf")
        self._connected_at = 0.0  # time.monotonic() of the last CONNACK; 0: none yet
        self._short_lived = 0  # connections in a row that the broker dropped within SHORT_LIVED_S
        self._attach(client)

    @property
    def where(self) -> str:
        return f"{self.broker.host}:{self.broker.port}"

    def _attach(self, client: Client) -> None:
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = lambda client, userdata: self._failed(connect_problem(client.connect_error,
                                                                                       self.broker))
        client.on_message = self._on_message
        connect_async(client, self.broker)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic
        if self._admit is not None and not self._admit(topic):
            client.ack(msg.mid, msg.qos)  # a no-op unless manual_ack: the broker may forget a dropped message
            return
        self._inbox.put(Received(topic, bytes(msg.payload), msg.mid, msg.qos))

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        if getattr(reason, "is_failure", False):
            self._closing = True  # `receive` acts on it: paho's disconnect that follows is no news
            unsupported = getattr(reason, "value", None) == UNSUPPORTED_PROTOCOL and self._may_fall_back()
            self._inbox.put(_Unsupported() if unsupported else _Refused(str(reason)))
            return
        self._backoff.connected()
        self._established, self._connected_at = True, time.monotonic()
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
        if not self._established:  # an attempt that got no CONNACK
            self._failed(connect_problem(None, self.broker, reason))
            return
        self._established = False  # a connection that worked is gone: come back within the spread window
        self._down_since = time.monotonic()
        delay = self._backoff.after_loss()
        why = "the connection closed" if str(reason) == "Unspecified error" else reason  # paho's word for a lost socket
        self._log(f"lost the broker ({why}): reconnecting in {delay:.1f} s")
        self._wait_before_next(delay)
        lived = self._down_since - self._connected_at
        self._short_lived = self._short_lived + 1 if lived < SHORT_LIVED_S else 0
        if self._short_lived % TAKEOVERS == 0 and self._short_lived:
            self._log(f"the broker dropped this connection {self._short_lived} times in a row, each within "
                      f"{SHORT_LIVED_S:g} s of connecting: is another client connected with the client id "
                      f"{self.client.settings['client_id']!r} (two agents started with one --client-id, or two "
                      "coordinators of one fleet)? Each takes the connection over from the other when it connects: "
                      "give each its own id")

    def _failed(self, problem: str) -> None:
        """A connect attempt failed (in paho's network thread): wait the backoff's next delay, and say why."""
        delay = self._backoff.after_failure()
        self._wait_before_next(delay)
        self._report(problem, f"trying again in {delay:.1f} s")

    def _report(self, problem: str, then: str) -> None:
        """One line on why the broker cannot be reached, at most every REPORT_EVERY_S."""
        now = time.monotonic()
        if now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        self._log(f"cannot connect to the broker at {self.where} (for {now - self._down_since:.0f} s): "
                  f"{problem} ({then})")

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
        self._watch()
        try:
            event = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, _Unsupported):
            self._use_mqtt311("it answered that it does not support that protocol version")
            return None
        if isinstance(event, _Refused):
            raise BrokerRefused(f"the broker at {self.where} refused the connection: {event.reason}")
        return event

    def _watch(self) -> None:
        """Connected, and no CONNACK CONNACK_WAIT_S later: MQTT 5 that never got through goes 3.1.1, else said."""
        client = self.client
        if self._established or self._closing or client.socket() is None \
                or time.monotonic() - client.attempt_at < CONNACK_WAIT_S:
            return
        if self._may_fall_back():
            self._use_mqtt311(f"no answer to its CONNECT in {CONNACK_WAIT_S:g} s")
        else:
            self._report(f"connected, but no answer to the MQTT CONNECT in {CONNACK_WAIT_S:g} s: is this an MQTT "
                         "broker's port (mqtts:// for a TLS one)? The embedded broker is silent too while another "
                         f"connection holds the client id {self.client.settings['client_id']!r} (two agents with one "
                         "--client-id?)", "still waiting")

    def _may_fall_back(self) -> bool:
        """MQTT 5 that never got through: a broker that once took MQTT 5 speaks it (a slow CONNACK is said)."""
        return self.client.protocol == mqtt.MQTTv5 and not self._connected_at

    def _use_mqtt311(self, why: str) -> None:
        """Drop the MQTT 5 client for an MQTT 3.1.1 one with the same settings (before any connect succeeded)."""
        old = self.client
        self._closing = True  # the old client's disconnect is no news
        old.disconnect()
        old.loop_stop()
        self._log(f"the broker at {self.where} does not speak MQTT 5 ({why}): connecting with MQTT 3.1.1 (the "
                  "embedded amqtt broker speaks only 3.1.1; --mqtt-version 3.1.1 goes straight to it)")
        self.client = make_client(**{**old.settings, "protocol": "3.1.1"})
        self._closing = False
        self._attach(self.client)

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
