"""The zero-setup broker: amqtt (pure Python, MQTT 3.1.1) in a thread with its own asyncio loop.

amqtt's own log (a traceback when its port is taken, a client's dropped connection) is not shown: `start` says
in one line why the broker cannot run, and a client's trouble is the client's to say. One thing in it is the
fleet's business, and said: two connections with one client id (two agents started with one --client-id).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import threading
import time
from typing import Any

from fedper.coordinator.logs import log

TAKEOVER = re.compile(r"Client (.+) is (already connected, performing take-over|reconnecting too quickly)")
TAKEOVER_SAID_EVERY_S = 60.0
MAX_MQTT_PACKET = 268_435_460  # MQTT's largest packet: 256 MiB of remaining length and its 5-byte fixed header


class _Takeovers(logging.Handler):
    """Reads amqtt's log for a client id that a second connection uses, and says so (once a minute per id)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = TAKEOVER.match(record.getMessage())
        if match is None:
            return
        client, now = match.group(1), time.monotonic()
        if now - self.said.get(client, -TAKEOVER_SAID_EVERY_S) < TAKEOVER_SAID_EVERY_S:
            return
        self.said[client] = now
        log.warning("the embedded broker: a second connection uses the client id %s: are two agents running with "
                    "--client-id %s (or two coordinators of one fleet)? They take the connection from each other, "
                    "or one waits; give each device its own id", client, client)


_amqtt = logging.getLogger("amqtt")
_amqtt.setLevel(logging.WARNING)
_amqtt.propagate = False  # the rest of its log is not shown
_amqtt.addHandler(_Takeovers())


class EmbeddedBroker:
    """amqtt's broker on host:port, anonymous, for one-machine use (no TLS, no ACLs: not for a real fleet); with
    `ws_port`, also MQTT over WebSockets on ws_host:ws_port for the web agent's page (fast: docs/operations.md)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883, ws_port: int | None = None,
                 ws_host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port
        self.ws_host, self.ws_port = ws_host, ws_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        self._thread = threading.Thread(target=self._run, name="amqtt-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the embedded broker did not start on {self.host}:{self.port} in {timeout} s")
        if self._error is not None:
            raise RuntimeError(_start_problem(self._error, self.host, self.port))
        log.info("embedded amqtt broker listening on %s:%d", self.host, self.port)
        if self.ws_port is not None:
            log.info("embedded amqtt broker's WebSocket listener on %s:%d", self.ws_host, self.ws_port)
        return self

    def _run(self) -> None:
        from amqtt.broker import Broker

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(lambda loop, context: log.debug(
            "embedded broker: %s", context.get("message"), exc_info=context.get("exception")))
        listeners = {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}}
        if self.ws_port is not None:
            listeners["ws"] = {"type": "ws", "bind": f"{self.ws_host}:{self.ws_port}"}
        config = {
            "listeners": listeners,
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        try:
            self._broker = _own_retained(Broker)(config, loop=self._loop)
            self._loop.run_until_complete(self._broker.start())
        except BaseException as e:  # reported to start()'s caller
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._loop is None or self._broker is None:
            return
        asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(timeout=10)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start_problem(error: BaseException, host: str, port: int) -> str:
    """One line on why the broker did not start: a port in use says which, and what to do."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
        return (f"the embedded broker cannot listen on {host}:{port}: the port is in use (another broker, or a "
                "coordinator already running?); choose another --port, or stop what listens there")
    return f"the embedded broker did not start on {host}:{port}: {cause or error}"


def _own_retained(broker: type) -> type:
    """amqtt's `broker` (imported only when one runs), fixed: amqtt 0.12 sends a client that connects the retained
    messages matching every client's subscriptions (meant for a resumed session's own), so a device got the other
    devices' registrations, and the open round's RoundInfo and model twice, and sent its update twice. Here a
    retained message goes only to a session subscribed to it. And its WebSocket listener took messages of at most
    1 MiB (websockets' default) and closed the connection on a larger one; mqtt.js joins the packets it has queued
    into one message, so the page's update of a MobileNet-v1 at width 0.5 (a few MB in 63 KiB chunks) cut its
    connection at every send. Here a message may be as large as one MQTT packet."""

    class OwnRetained(broker):  # type: ignore[misc, valid-type]
        async def ws_connected(self, websocket: Any, listener_name: str) -> None:
            websocket.protocol.max_size = MAX_MQTT_PACKET
            await super().ws_connected(websocket, listener_name)
        async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int],
                                                              session: Any) -> None:
            holders = self._subscriptions.get(subscription[0], ())
            if any(holder.client_id == session.client_id for holder, _ in holders):
                await super()._publish_retained_messages_for_subscription(subscription, session)

    return OwnRetained
