"""Head parameters and training images never leave a device: a listener on `#` proves it.

Two real ORT agents (processes) and the coordinator run two FedPer rounds through Mosquitto while a
client subscribed to every topic records every byte. The recording (raw payloads, plus every
chunked blob reassembled, so nothing hides across a chunk boundary) is searched for 16-byte
windows of each head tensor as the agents saved it, and for pixel rows of their training images,
raw uint8 and normalized float32. The base tensors must be found the same way, so the search works.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import Processes, agent_args, coordinator_args, finish, write_device_data
from helpers.recording import Recorder
from safetensors.numpy import load_file

from fedper.data import load_npz, to_float_nchw
from fedper.edge.state import DeviceState
from fedper.manifest import Manifest
from fedper.wire import WireError, decode_chunk

pytestmark = pytest.mark.mosquitto
WINDOW = 16


def corpus(messages: list[tuple[str, bytes]]) -> bytes:
    """Every payload, then every chunked blob reassembled from its frames."""
    blobs: dict[tuple[str, str], dict[int, bytes]] = defaultdict(dict)
    for topic, payload in messages:
        try:
            c = decode_chunk(payload)
        except WireError:
            continue
        blobs[(topic.rsplit("/", 2)[0] if "/model/" in topic else topic, c.blob_id)][c.index] = c.data
    joined = [b"".join(parts[i] for i in sorted(parts)) for parts in blobs.values()]
    return b"\x00".join([p for _, p in messages] + joined)


def windows(tensor: np.ndarray) -> list[bytes]:
    """16-byte windows at the start, middle and end of a tensor's little-endian bytes."""
    raw = np.ascontiguousarray(tensor, dtype=tensor.dtype.newbyteorder("<")).tobytes()
    if len(raw) <= WINDOW:
        return [raw]
    return [raw[at : at + WINDOW] for at in (0, (len(raw) // 2) & ~3, len(raw) - WINDOW)]


def image_rows(data: Path, manifest: Manifest, count: int = 4) -> list[bytes]:
    """The most varied pixel row of `count` training images: uint8 HWC bytes and normalized float32."""
    x = load_npz(data).train.x[:count]
    normalized = to_float_nchw(x, manifest.model.mean, manifest.model.std)
    rows = []
    for i in range(count):
        r = int(np.argmax([len(set(x[i, r].ravel())) for r in range(x.shape[1])]))
        rows += [x[i, r].tobytes(), normalized[i, 0, r].tobytes()]
    return rows


@pytest.mark.long
def test_a_listener_on_every_topic_sees_no_head_and_no_image(mosquitto, tmp_path: Path, tiny_artifacts: Path,
                                                             processes: Processes) -> None:
    manifest = Manifest.load(tiny_artifacts)
    recorder = Recorder(mosquitto.host, mosquitto.port, "#")
    coordinator_dir = tmp_path / "coordinator"
    coordinator = processes.start("coordinator", *coordinator_args(tiny_artifacts, mosquitto.url, coordinator_dir,
                                                                   "privacy", 2, 2, 60))
    data = [write_device_data(tmp_path / "d0.npz", (0, 1), 20), write_device_data(tmp_path / "d1.npz", (2, 3), 20)]
    states = [tmp_path / "dev0", tmp_path / "dev1"]
    for j in range(2):
        processes.start(f"dev{j}", *agent_args(tiny_artifacts, data[j], mosquitto.url, "privacy", f"dev{j}",
                                               states[j]))
    assert finish(coordinator, 90, "the coordinator", processes.log("coordinator")) == 0, processes.log("coordinator")
    recorder.close()

    messages = recorder.snapshot()
    recorded = corpus(messages)
    saved = [DeviceState(s).load(manifest) for s in states]
    assert [s.round for s in saved] == [2, 2]
    heads = {f"dev{j}/{name}": value for j, s in enumerate(saved) for name, value in s.local.items()}
    assert set(manifest.names(shared=False)) == {n.split("/")[1] for n in heads} and heads
    leaked_heads = [name for name, value in heads.items() for w in windows(value) if w in recorded]
    assert leaked_heads == []
    leaked_images = [str(path) for path in data for row in image_rows(path, manifest) if row in recorded]
    assert leaked_images == []

    final = load_file(str(coordinator_dir / "final.safetensors"))
    missing_base = [name for name, value in final.items() for w in windows(value) if w not in recorded]
    assert missing_base == []  # the search finds what does travel: the aggregated base ...
    sent = [name for s in saved for name, value in s.update.items() for w in windows(value) if w not in recorded]
    assert sent == []  # ... and each device's last update
    print(f"privacy: {len(messages)} messages, {sum(len(p) for _, p in messages)} bytes recorded; "
          f"{sum(len(windows(v)) for v in heads.values())} head windows and "
          f"{sum(len(image_rows(p, manifest)) for p in data)} image rows searched, none found")
