"""Small MQTT helpers shared by the coordinator and the agent: broker URLs and paho clients.

Clients keep a persistent session (clean_session=False / clean_start=False with a session
expiry), so QoS 1 messages sent while a peer is briefly away wait for it at the broker, and
paho reconnects on its own with exponential backoff.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
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
