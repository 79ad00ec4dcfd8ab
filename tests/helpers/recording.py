"""A listener on the broker: what every topic carried, in order, as a third party sees it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt


class Recorder:
    """A client subscribed to a filter (default `#`) recording every message it gets, in order."""

    def __init__(self, host: str, port: int, topic: str = "#",
                 on_message: Callable[[str, bytes], None] | None = None, **credentials: str) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._hook = on_message
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"recorder-{time.monotonic_ns()}")
        if credentials:
            self.client.username_pw_set(credentials["username"], credentials["password"])
        self.client.on_connect = lambda c, u, f, reason, p: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda c, u, mid, reasons, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise AssertionError(f"the recorder could not subscribe to {topic}")

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload)))
        if self._hook:
            self._hook(msg.topic, bytes(msg.payload))

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.messages)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
