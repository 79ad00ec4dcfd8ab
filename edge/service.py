"""The paho I/O around the agent's engine (fedper.edge.engine): connect, feed, publish. Nothing else.

The receive loop is the kernel's (fedper.mqtt.Session), the coordinator's too. paho reconnects with
backoff on broker loss; QoS 1 messages published meanwhile wait in its queue (and the persistent
session keeps ours). On a clean exit the agent says `offline` itself (the broker sends the last
will only when a client vanishes).
"""

from __future__ import annotations

import threading

from fedper.edge.engine import Agent
from fedper.mqtt import Connected, Session, make_client, parse_broker_url


def run_agent(agent: Agent, stop: threading.Event | None = None) -> None:
    """Take part in rounds until the coordinator announces the final model (or `stop` is set);
    BrokerRefused when the broker turns the device away, AgentError when it cannot go on."""
    c = agent.config
    broker = parse_broker_url(c.broker)
    stop = stop or threading.Event()
    offline = (agent.topics.presence(c.client_id), b"offline")
    client = make_client(c.client_id, protocol=c.mqtt_version, username=c.username, password=c.password,
                         tls=broker.tls, tls_ca=c.tls_ca, will=offline)
    with Session(client, broker, agent.subscriptions(), log=agent.log, farewell=offline) as session:
        agent.log(f"{c.client_id}: {agent.n_samples} training / {len(agent.data.y_test)} test samples, "
                  f"{agent.manifest.algorithm} with {c.backend}, connecting to {c.broker}")
        while not stop.is_set() and agent.final_accuracy is None:
            event = session.receive(timeout=0.2)
            if event is None:
                continue
            out = agent.connected() if isinstance(event, Connected) else agent.handle(event.topic, event.payload)
            for message in out:
                session.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
