"""The paho I/O around the agent's engine (fedper.edge.engine): connect, feed, publish, run its jobs.

The receive loop is the kernel's (fedper.mqtt.Session), the coordinator's too. After losing the
broker the agent reconnects within a spread window and then with full-jitter backoff
(fedper.mqtt.Backoff.device), so a fleet does not come back all at once; QoS 1 messages published
meanwhile wait in paho's queue (and the persistent session keeps ours). The subscriptions follow
the engine's (a model's chunks only while it needs them). On a clean exit the agent says `offline`
itself (the broker sends the last will only when a client vanishes). A job the engine asks for (check
--only-when, train, evaluate) runs in a thread of its own and its result comes back through the session's
queue, behind the messages that arrived meanwhile: the loop never waits on training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedper.edge.agent import Agent
from fedper.edge.engine import Connected, Input, Job, Message, Tick
from fedper.mqtt import Backoff, Received, Session, make_client, parse_broker_url
from fedper.mqtt import Connected as Reconnected
from fedper.wire import Outgoing


@dataclass(frozen=True)
class _Failed:
    """A job that raised: the loop raises it in turn."""

    error: Exception


def run_agent(agent: Agent, stop: threading.Event | None = None) -> None:
    """Take part in rounds until the coordinator announces the final model (or `stop` is set);
    BrokerRefused when the broker turns the device away, AgentError when it cannot go on."""
    c = agent.config
    engine = agent.engine
    broker = parse_broker_url(c.broker)
    stop = stop or threading.Event()
    offline = (agent.topics.presence(c.client_id), b"offline")
    client = make_client(c.client_id, protocol=c.mqtt_version, username=c.username, password=c.password,
                         tls=broker.tls, tls_ca=c.tls_ca, will=offline)
    subscribed = engine.subscriptions()
    worker: threading.Thread | None = None
    agent.log(f"{c.client_id}: {agent.n_samples} training / {len(agent.data.y_test)} test samples, "
              f"{agent.manifest.algorithm} with {c.backend}, connecting to {c.broker} (MQTT {c.mqtt_version})")
    # Every model (model/#) is dropped at each connect unless wanted: a persistent session would keep
    # an earlier run's subscription, and with selection the broker would push each round's model here.
    with Session(client, broker, subscribed, log=agent.log, farewell=offline, forget=[engine.all_models_topic],
                 backoff=Backoff.device(c.reconnect_spread_s)) as session:
        while not stop.is_set() and not engine.done:
            for action in engine.handle(_input(session.receive(timeout=0.2)), agent.clock()):
                if isinstance(action, Outgoing):
                    session.publish(action.topic, action.payload, qos=action.qos, retain=action.retain)
                else:
                    worker = _start(agent, action, session.post)
            wanted = engine.subscriptions()
            if wanted != subscribed:
                subscribed = wanted
                session.subscribe_only(subscribed)
        if worker is not None:
            worker.join()  # a job under way finishes (and saves) before the agent returns


def _input(received: Any) -> Input:
    """What the session gave (a connect, a message, a job's result, or nothing for a while) as the engine's input."""
    if received is None:
        return Tick()
    if isinstance(received, Reconnected):
        return Connected()
    if isinstance(received, Received):
        return Message(received.topic, received.payload)
    if isinstance(received, _Failed):
        raise received.error
    return received


def _start(agent: Agent, job: Job, post: Callable[[object], None]) -> threading.Thread:
    """Run `job` in a thread (the engine has at most one out) and post its result, or its failure, to the loop."""

    def work() -> None:
        try:
            result: object = agent.run(job)
        except Exception as e:  # raised again in the loop: the CLI reports it in one line
            result = _Failed(e)
        post(result)

    thread = threading.Thread(target=work, name=f"{agent.config.client_id}: {type(job).__name__}", daemon=True)
    thread.start()
    return thread
