"""The load test's scripted devices: paho clients that answer each round with base + a per-device
delta, and the closed-form weighted mean that many rounds of them must end at."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt


def device_plan(index: int) -> tuple[int, float]:
    """(n_samples, delta) of scripted device `index`: its update is base + delta, weighted n_samples."""
    return 1 + index % 5, (index % 7 - 3) / 100


def expected_mean(initial: dict[str, np.ndarray], count: int, rounds: int) -> dict[str, np.ndarray]:
    """The model after `rounds` rounds of devices 0..count-1 (device_plan), computed in closed form."""
    plans = [device_plan(i) for i in range(count)]
    total = sum(n for n, _ in plans)
    model = initial
    for _ in range(rounds):
        model = {k: (sum(n * (v + np.float32(d)).astype(np.float64) for n, d in plans) / total).astype(v.dtype)
                 for k, v in model.items()}
    return model


def scripted_devices(url: str, fleet: str, indices: list[int], timeout: float, results: Any) -> None:
    """Run devices `indices` (paho clients, one process) until the run is finished; put
    {device: rounds answered} on `results`. The target of the load test's worker processes."""
    from vectors.make_vectors import tiny_manifest

    from fedper.mqtt import connect_async, make_client, parse_broker_url
    from fedper.payload import decode_shared, encode_shared, max_blob_size
    from fedper.wire import Reassembler, Register, RoundInfo, Topics, UpdateMeta, WireError, chunk

    manifest, topics, broker = tiny_manifest(), Topics(fleet), parse_broker_url(url)
    answered: dict[str, set[int]] = {}
    finished: set[str] = set()
    lock = threading.Lock()

    def device(index: int) -> mqtt.Client:
        name = f"load-{index}"
        n, delta = device_plan(index)
        answered[name] = set()
        reassembler = Reassembler(max_blob_size(manifest))
        seen: dict[str, Any] = {"blobs": {}, "info": None}

        def on_connect(client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
            client.subscribe([(topics.round, 1), (f"{topics.base}/model/#", 1)])
            client.publish(topics.register(name), Register(n, manifest.base_digest, "load/1").encode(), qos=1,
                           retain=True)

        def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
            if msg.topic == topics.round:
                seen["info"] = RoundInfo.decode(msg.payload)
            elif msg.payload:
                try:
                    blob = reassembler.add("coordinator", bytes(msg.payload))
                except WireError:
                    return
                if blob is not None:
                    seen["blobs"][blob.blob_id] = blob.data
            info = seen["info"]
            if info is None or info.blob_id not in seen["blobs"]:
                return
            if info.state == "finished":
                with lock:
                    finished.add(name)
                return
            if info.round in answered[name]:
                return
            answered[name].add(info.round)
            base = decode_shared(manifest, seen["blobs"][info.blob_id])
            update = {k: (v + np.float32(delta)).astype(v.dtype) for k, v in base.items()}
            meta = UpdateMeta(info.round, n, manifest.base_digest)
            for frame in chunk(encode_shared(manifest, update, meta.codec), blob_id=f"r{info.round}-{name}",
                               meta=meta.to_dict()):
                client.publish(topics.update(name), frame, qos=1)

        client = make_client(f"{fleet}-{name}", protocol="5")
        client.on_connect = on_connect
        client.on_message = on_message
        connect_async(client, broker)
        return client

    clients = [device(i) for i in indices]
    deadline = time.monotonic() + timeout
    while len(finished) < len(clients) and time.monotonic() < deadline:
        time.sleep(0.05)
    for client in clients:
        client.disconnect()
        client.loop_stop()
    results.put({name: sorted(rounds) for name, rounds in answered.items()})
