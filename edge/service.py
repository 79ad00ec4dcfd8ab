"""The paho I/O around the agent's engine (fedper.edge.engine): connect, feed, publish. Nothing else.

The receive loop is the kernel's (fedper.mqtt.Session), the coordinator's too. After losing the
broker the agent reconnects within a spread window and then with full-jitter backoff
(fedper.mqtt.Backoff.device), so a fleet does not come back all at once; QoS 1 messages published
meanwhile wait in paho's queue (and the persistent session keeps ours). The subscriptions follow
the engine's (a model's chunks only while it needs them). On a clean exit the agent says `offline`
itself (the broker sends the last will only when a client vanishes).
"""

from __future__ import annotations

import threading

from fedper.edge.engine import Agent
from fedper.mqtt import Backoff, Connected, Session, make_client, parse_broker_url


def run_agent(agent: Agent, stop: threading.Event | None = None) -> None:
    """Take part in rounds until the coordinator announces the final model (or `stop` is set);
    BrokerRefused when the broker turns the device away, AgentError when it cannot go on."""
    c = agent.config
    broker = parse_broker_url(c.broker)
    stop = stop or threading.Event()
    offline = (agent.topics.presence(c.client_id), b"offline")
    client = make_client(c.client_id, protocol=c.mqtt_version, username=c.username, password=c.password,
                         tls=broker.tls, tls_ca=c.tls_ca, will=offline)
    subscribed = agent.subscriptions()
    agent.log(f"{c.client_id}: {agent.n_samples} training / {len(agent.data.y_test)} test samples, "
              f"{agent.manifest.algorithm} with {c.backend}, connecting to {c.broker} (MQTT {c.mqtt_version})")
    # Every model (model/#) is dropped at each connect unless wanted: a persistent session would keep
    # an earlier run's subscription, and with selection the broker would push each round's model here.
    with Session(client, broker, subscribed, log=agent.log, farewell=offline, forget=[agent.all_models_topic],
                 backoff=Backoff.device(c.reconnect_spread_s)) as session:
        while not stop.is_set() and agent.final_accuracy is None:
            event = session.receive(timeout=0.2)
            if event is None:
                out = agent.tick()
            elif isinstance(event, Connected):
                out = agent.connected()
            else:
                out = agent.handle(event.topic, event.payload)
            for message in out:
                session.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
            wanted = agent.subscriptions()
            if wanted != subscribed:
                subscribed = wanted
                session.subscribe_only(subscribed)
