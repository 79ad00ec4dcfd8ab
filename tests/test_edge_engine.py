"""The agent's protocol logic without a broker: hand-built frames in, the messages it would publish out.

A real agent (the tiny export, real digit scans, onnxruntime-training) is fed RoundInfo messages
and model chunks written here with json, struct, zlib and hashlib as docs/protocol.md describes
them (not with fedper.wire's encoder), and its answers are read back the same way: a restart
resends the saved update (and so does every RoundInfo of that round), `unknown_device` makes it
register and resend, a stale RoundInfo and a blob that is not the round's sha256 are ignored,
missed rounds are caught up, a finished run writes the final accuracy. Forged or corrupt input
(another export's RoundInfo, odd JSON, NaN, wrong shapes, oversized declarations, corrupt chunks)
is refused with one log line, never touches the model, the head or the saved state, and the right
round that follows is trained as usual.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedper.checkpoint import read_checkpoint
from fedper.data import load_digits
from fedper.edge.eligibility import Conditions
from fedper.edge.engine import FINAL_FILE, SERVED_FILE, Agent, AgentConfig, AgentError
from fedper.wire import Outgoing

FLEET, DEVICE = "lab", "dev0"
BASE = f"fedper/v1/{FLEET}"
ROUND_TOPIC, UPDATE_TOPIC = f"{BASE}/round", f"{BASE}/update/{DEVICE}"
CHUNK = 64 * 1024
Message = tuple[str, bytes]


# ------------------------------------------------------------ frames by hand (docs/protocol.md, sections 5 and 6)


def frame(header: dict, data: bytes) -> bytes:
    head = json.dumps({"v": 1, **header}).encode()
    return struct.pack(">II", len(head), zlib.crc32(head + data)) + head + data


def chunk_frames(blob: bytes, blob_id: str, round_: int, chunk_size: int = CHUNK) -> list[Message]:
    """A model blob as the coordinator publishes it: (topic, frame) per chunk."""
    count = max(1, -(-len(blob) // chunk_size))
    sha = hashlib.sha256(blob).hexdigest()
    return [(f"{BASE}/model/{blob_id}/{i}",
             frame({"blob_id": blob_id, "index": i, "count": count, "size": len(blob), "chunk_size": chunk_size,
                    "sha256": sha, "meta": {"round": round_}}, blob[i * chunk_size : (i + 1) * chunk_size]))
            for i in range(count)]


def round_info(blob: bytes, round_: int, digest: str, *, rounds: int = 3, state: str = "open",
               blob_id: str | None = None, **fields: object) -> Message:
    body = {"v": 1, "round": round_, "rounds": rounds, "state": state, "deadline": 1.9e9,
            "blob_id": blob_id or f"r{round_}", "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            "count": max(1, -(-len(blob) // CHUNK)), "base_digest": digest, **fields}
    return ROUND_TOPIC, json.dumps(body).encode()


def read_frame(payload: bytes) -> tuple[dict, bytes]:
    n, crc = struct.unpack_from(">II", payload)
    assert zlib.crc32(payload[8:]) == crc
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def sent_update(out: list[Outgoing]) -> tuple[str, dict, dict[str, np.ndarray]]:
    """(blob_id, meta, tensors) of the one update among `out`, reassembled and checked by hand."""
    frames = [read_frame(m.payload) for m in out if m.topic == UPDATE_TOPIC]
    assert frames and all(m.qos == 1 and not m.retain for m in out if m.topic == UPDATE_TOPIC)
    headers = [h for h, _ in frames]
    assert len({h["blob_id"] for h in headers}) == 1 and len(frames) == headers[0]["count"]
    blob = b"".join(data for _, data in sorted(frames, key=lambda f: f[0]["index"]))
    assert hashlib.sha256(blob).hexdigest() == headers[0]["sha256"] and len(blob) == headers[0]["size"]
    return headers[0]["blob_id"], headers[0]["meta"], st_load(blob)


# ------------------------------------------------------------ a real agent


class Device:
    """An agent and everything it logged."""

    def __init__(self, config: AgentConfig, **options: object) -> None:
        self.logs: list[str] = []
        self.agent = Agent(config, log=self.logs.append, **options)

    def feed(self, messages: list[Message]) -> list[Outgoing]:
        out: list[Outgoing] = []
        for topic, payload in messages:
            out += self.agent.handle(topic, payload)
        return out

    def open_round(self, round_: int, tensors: dict[str, np.ndarray], **fields: object) -> list[Outgoing]:
        """RoundInfo and then the model's chunks, as they usually arrive."""
        blob = st_save(tensors)
        return self.feed([round_info(blob, round_, self.agent.manifest.base_digest, **fields),
                          *chunk_frames(blob, str(fields.get("blob_id", f"r{round_}")), round_)])

    def tensors(self) -> dict[str, np.ndarray]:
        """Every tensor of the model as it is now: the shared ones and the head."""
        return self.agent.backend.read(self.agent.manifest.names())


@pytest.fixture
def device_data(tmp_path: Path) -> Path:
    """20 real digit scans of classes 0..3 (16 train, 4 test)."""
    ds = load_digits(32).train
    idx = np.flatnonzero(ds.y < 4)[:20]
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
    return path


@pytest.fixture
def make_device(tiny_artifacts: Path, device_data: Path, tmp_path: Path) -> Callable[..., Device]:
    """make_device(state="state", options={...}, **config) -> a Device (options: the Agent's conditions and
    clock); the same state name is the same device restarted."""

    def make(state: str = "state", options: dict | None = None, **config: object) -> Device:
        return Device(AgentConfig(artifacts=tiny_artifacts, data=device_data, broker="mqtt://127.0.0.1:1",
                                  fleet=FLEET, client_id=DEVICE, state_dir=tmp_path / state, batch_size=8, lr=0.05,
                                  backend="ort", **config), **(options or {}))

    return make


@pytest.fixture
def models(make_device: Callable[..., Device]) -> Callable[[int], dict[str, np.ndarray]]:
    """models(k) -> the coordinator's model of round k: the export's shared tensors, scaled by 1 + k/100."""
    agent = make_device("models").agent
    initial = agent.backend.read(agent.manifest.names(shared=True))
    return lambda k: {n: (x * np.float32(1 + k / 100)).astype(x.dtype) for n, x in initial.items()}


# ------------------------------------------------------------ the protocol


def test_a_round_trains_from_the_rounds_model_and_sends_only_the_shared_tensors(make_device, models) -> None:
    device = make_device()
    agent = device.agent
    announced = agent.connected()
    assert [(m.topic, m.retain) for m in announced] == [(f"{BASE}/presence/{DEVICE}", True),
                                                       (f"{BASE}/register/{DEVICE}", True)]
    register = json.loads(announced[1].payload)
    assert register["n_samples"] == 16 and register["base_digest"] == agent.manifest.base_digest

    blob = st_save(models(1))
    assert device.feed([round_info(blob, 1, agent.manifest.base_digest)]) == []  # the model is not here yet
    chunks = chunk_frames(blob, "r1", 1)
    assert len(chunks) > 1 and device.feed(chunks[:-1]) == []
    _, meta, update = sent_update(device.feed(chunks[-1:]))
    assert meta["round"] == 1 and meta["n_samples"] == 16 and meta["base_digest"] == agent.manifest.base_digest
    assert meta["codec"] == "fp32" and 0 <= meta["metrics"]["accuracy"] <= 1
    assert sorted(update) == sorted(agent.manifest.names(shared=True))  # no head tensor on the wire

    by_hand = make_device("by-hand").agent  # the same device's data and seeds, the round's model loaded by hand
    by_hand.backend.load(models(1))
    expected = by_hand.train_round(1).update
    assert all(np.array_equal(update[n], expected[n]) for n in expected)
    assert agent.state.load(agent.manifest).round == 1


def test_a_restarted_device_resends_its_saved_update_whenever_its_round_is_announced(make_device, models) -> None:
    first = make_device()
    first_id, _, first_update = sent_update(first.open_round(1, models(1)))

    restarted = make_device()  # the same state dir: killed after saving, before the coordinator had the update
    assert any("restored the head of round 1" in line for line in restarted.logs)
    assert [m.topic for m in restarted.agent.connected()] == [f"{BASE}/presence/{DEVICE}",
                                                              f"{BASE}/register/{DEVICE}"]
    blob_id, meta, update = sent_update(restarted.open_round(1, models(1)))
    assert meta["round"] == 1 and blob_id != first_id  # a fresh blob id per attempt
    assert all(np.array_equal(update[n], first_update[n]) for n in first_update)  # the saved one, not retrained
    assert any("round 1: already trained" in line for line in restarted.logs)
    assert not any("served accuracy" in line for line in restarted.logs)

    assert restarted.feed(chunk_frames(st_save(models(1)), "r1", 1)) == []  # the same chunks again: sent already
    assert [m.topic for m in restarted.agent.connected()] == [f"{BASE}/presence/{DEVICE}",
                                                              f"{BASE}/register/{DEVICE}"]
    # The round's RoundInfo again (after a reconnect, the coordinator's restart or an extension): the
    # update may have been lost on the way, and v1 acknowledges none, so it goes again, not retrained.
    extended = round_info(st_save(models(1)), 1, restarted.agent.manifest.base_digest, deadline=2.0e9)
    again_id, meta, again = sent_update(restarted.feed([extended]))
    assert meta["round"] == 1 and again_id != blob_id and all(np.array_equal(again[n], update[n]) for n in update)
    assert not any("served accuracy" in line for line in restarted.logs)


def test_unknown_device_makes_it_register_again_and_resend(make_device, models) -> None:
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    error_topic = f"{BASE}/error/{DEVICE}"

    def error(code: str, round_: int) -> Message:
        return error_topic, json.dumps({"v": 1, "code": code, "message": "m", "round": round_}).encode()

    out = device.feed([error("unknown_device", 1)])
    register = [m for m in out if m.topic == f"{BASE}/register/{DEVICE}"]
    assert len(register) == 1 and register[0].retain and json.loads(register[0].payload)["n_samples"] == 16
    assert sent_update(out)[1]["round"] == 1
    assert device.feed([error("unknown_device", 2), error("late_update", 1), error("duplicate_update", 1)]) == []
    with pytest.raises(AgentError, match="refused this export"):
        device.feed([error("digest_mismatch", 1)])


def test_a_stale_round_info_is_ignored(make_device, models) -> None:
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    sent_update(device.open_round(2, models(2)))
    before = device.tensors()
    assert device.open_round(1, models(1)) == []
    assert any("stale" in line for line in device.logs)
    after = device.tensors()
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert device.agent.state.load(device.agent.manifest).round == 2
    trained = sum("served accuracy" in line for line in device.logs)
    resent = device.feed([round_info(st_save(models(2)), 2, device.agent.manifest.base_digest)])
    assert sent_update(resent)[1]["round"] == 2  # round 2 is still the one it answered: resent, not retrained
    assert sum("served accuracy" in line for line in device.logs) == trained


@pytest.mark.parametrize("order", ["round info first", "blob first"])
def test_a_blob_that_is_not_the_rounds_sha256_is_ignored_until_the_right_one_comes(make_device, models,
                                                                                   order: str) -> None:
    device = make_device()
    digest = device.agent.manifest.base_digest
    right = st_save(models(1))
    forged_tensors = models(1)
    name = next(iter(forged_tensors))
    forged_tensors[name] = forged_tensors[name] + np.float32(0.5)
    forged = st_save(forged_tensors)
    info = round_info(right, 1, digest)
    before = device.tensors()
    messages = [info, *chunk_frames(forged, "r1", 1)]
    assert device.feed(messages if order == "round info first" else messages[::-1]) == []
    assert sum("does not match the round's sha256" in line for line in device.logs) == 1
    after = device.tensors()
    assert all(np.array_equal(before[n], after[n]) for n in before) and device.agent.saved is None
    _, meta, _ = sent_update(device.feed(chunk_frames(right, "r1", 1)))
    assert meta["round"] == 1


def test_a_device_that_missed_rounds_joins_the_open_one(make_device, models) -> None:
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    _, meta, _ = sent_update(device.open_round(4, models(4), rounds=5))
    assert meta["round"] == 4 and device.agent.state.load(device.agent.manifest).round == 4


def test_the_finished_run_writes_the_final_models_accuracy(make_device, models, tmp_path: Path) -> None:
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    head = device.agent.backend.read(device.agent.manifest.names(shared=False))
    assert device.open_round(3, models(3), state="finished", blob_id="final") == []
    agent = device.agent
    assert agent.final_accuracy is not None and 0 <= agent.final_accuracy <= 1
    record = json.loads((tmp_path / "state" / FINAL_FILE).read_text())
    assert record["rounds"] == 3 and record["accuracy"] == agent.final_accuracy
    now = device.tensors()
    assert all(np.array_equal(now[n], x) for n, x in models(3).items())  # the final base, served with
    assert all(np.array_equal(now[n], x) for n, x in head.items())  # the device's own head
    served, meta = read_checkpoint(tmp_path / "state" / SERVED_FILE)  # saved as served, with what it measured
    assert meta == record and set(served) == set(now) and all(np.array_equal(served[n], now[n]) for n in now)


# ------------------------------------------------------------ forged or corrupt input (issue: untrusted peers)


def _safetensors_with_header(header: object) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head


def _forged_pair(blob: bytes, digest: str) -> list[Message]:
    """A well-formed RoundInfo of round 2 naming `blob`, and its chunks."""
    return [round_info(blob, 2, digest), *chunk_frames(blob, "r2", 2)]


def _reshaped(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    name = next(n for n, x in tensors.items() if x.ndim > 1)
    return {**tensors, name: tensors[name].reshape(-1)}


def _with_nan(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    name = next(iter(tensors))
    poisoned = tensors[name].copy()
    poisoned.flat[0] = np.nan
    return {**tensors, name: poisoned}


def _flip_a_byte(message: Message) -> Message:
    topic, payload = message
    return topic, payload[:-1] + bytes([payload[-1] ^ 0xFF])


def _declaring(message: Message, **fields: object) -> Message:
    """A chunk whose header says something else (its CRC recomputed, so only the header is wrong)."""
    header, data = read_frame(message[1])
    return message[0], frame({**header, **fields}, data)


# Each case: (forged messages given the round-2 model blob, the agent and the head's names), the log's words.
FORGERIES: dict[str, tuple[Callable[[bytes, Agent, dict], list[Message]], str]] = {
    "another export's RoundInfo": (
        lambda blob, agent, t: [round_info(blob, 2, "sha256:" + "0" * 64)], "another export"),
    "a list-shaped RoundInfo": (lambda blob, agent, t: [(ROUND_TOPIC, b"[2, 3]")], "bad message"),
    "a RoundInfo with a string round": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest, round="2")], "bad message"),
    "a RoundInfo with a round beyond float range": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest, round=10**400)], "round"),
    "a RoundInfo with a NaN deadline": (
        lambda blob, agent, t: [(ROUND_TOPIC, round_info(blob, 2, agent.manifest.base_digest)[1].replace(
            b'"deadline": 1900000000.0', b'"deadline": NaN'))], "bad message"),
    "a round beyond the run's last": (
        lambda blob, agent, t: [round_info(blob, 5, agent.manifest.base_digest, rounds=3)], "of a run of 3"),
    "an oversized model declared": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest, size=10**9)], "declares"),
    "a model with NaN": (
        lambda blob, agent, t: _forged_pair(st_save(_with_nan(st_load(blob))), agent.manifest.base_digest),
        "refused model r2"),
    "a model with a wrong shape": (
        lambda blob, agent, t: _forged_pair(st_save(_reshaped(st_load(blob))), agent.manifest.base_digest),
        "refused model r2"),
    "a model with a list-shaped safetensors header": (
        lambda blob, agent, t: _forged_pair(_safetensors_with_header([1, 2]), agent.manifest.base_digest),
        "refused model r2"),
    "a model carrying the head": (
        lambda blob, agent, t: _forged_pair(st_save({**st_load(blob), **t}), agent.manifest.base_digest),
        "refused model r2"),
    "a compressed model": (
        lambda blob, agent, t: _forged_pair(
            st_save({n: x.astype(np.float16) for n, x in st_load(blob).items()}, {"fedper.codec": "fp16"}),
            agent.manifest.base_digest),
        "refused model r2"),
    "another blob under the round's blob id": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest),
                                *chunk_frames(st_save(_with_nan(st_load(blob))), "r2", 2)],
        "does not match the round's sha256"),
    "every chunk corrupt": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest),
                                *map(_flip_a_byte, chunk_frames(blob, "r2", 2))], "crc32"),
    "an oversized blob declared in a chunk": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest),
                                _declaring(chunk_frames(blob, "r2", 2)[0], size=10**9)], "oversized"),
    "chunks on another blob's topic": (
        lambda blob, agent, t: [round_info(blob, 2, agent.manifest.base_digest),
                                *[(topic.replace("/r2/", "/r9/"), payload)
                                  for topic, payload in chunk_frames(blob, "r2", 2)]], "another blob's topic"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_or_corrupt_input_is_refused_in_one_line_and_the_right_round_still_trains(
        make_device, models, case: str) -> None:
    device = make_device()
    agent = device.agent
    sent_update(device.open_round(1, models(1)))
    saved_before, before, logged = agent.state.load(agent.manifest), device.tensors(), len(device.logs)
    head = agent.backend.read(agent.manifest.names(shared=False))
    forge, words = FORGERIES[case]

    assert device.feed(forge(st_save(models(2)), agent, head)) == []
    new = device.logs[logged:]
    assert len(new) == 1 and words in new[0], new
    after, saved_after = device.tensors(), agent.state.load(agent.manifest)
    assert all(np.array_equal(before[n], after[n]) for n in before)  # neither the model nor the head changed
    assert saved_after.round == 1 and all(np.array_equal(saved_after.local[n], saved_before.local[n]) for n in head)

    _, meta, _ = sent_update(device.open_round(2, models(2)))  # the coordinator's real round 2
    assert meta["round"] == 2 and agent.state.load(agent.manifest).round == 2


def test_a_forged_round_info_does_not_cost_the_device_the_right_model(make_device, models) -> None:
    """The round's model is here before its RoundInfo; a RoundInfo naming it with another sha256
    comes first: refused, and the model is kept for the right RoundInfo (retained chunks are not sent twice)."""
    device = make_device()
    agent = device.agent
    sent_update(device.open_round(1, models(1)))
    right = st_save(models(2))
    assert device.feed(chunk_frames(right, "r2", 2)) == []
    logged = len(device.logs)
    forged = round_info(right, 2, agent.manifest.base_digest, sha256="ab" * 32)
    assert device.feed([forged]) == []
    assert len(device.logs) == logged + 1 and "does not match the round's sha256" in device.logs[-1]
    _, meta, _ = sent_update(device.feed([round_info(right, 2, agent.manifest.base_digest)]))
    assert meta["round"] == 2


# ------------------------------------------------------------ selection and eligibility (docs/protocol.md, 8.1)

INVITE_TOPIC, PRESENCE_TOPIC = f"{BASE}/invite/{DEVICE}", f"{BASE}/presence/{DEVICE}"


def invitation(round_: int) -> Message:
    """An Invitation as the coordinator publishes it on the device's own topic."""
    return INVITE_TOPIC, json.dumps({"v": 1, "round": round_}).encode()


def selecting(blob: bytes, round_: int, digest: str, **fields: object) -> Message:
    """RoundInfo of a coordinator run with --clients-per-round."""
    return round_info(blob, round_, digest, selection="invited", next_selection_at=1.9e9, **fields)


def model_subscriptions(agent: Agent) -> list[str]:
    return [topic for topic, _ in agent.subscriptions() if "/model/" in topic]


def presence(out: list[Outgoing]) -> list[bytes]:
    assert all(m.retain for m in out if m.topic == PRESENCE_TOPIC)
    return [m.payload for m in out if m.topic == PRESENCE_TOPIC]


@pytest.mark.parametrize("order", ["round info first", "invitation first"])
def test_an_invited_device_trains_and_subscribes_to_its_rounds_model_alone(make_device, models, order: str) -> None:
    device = make_device()
    agent = device.agent
    assert [t for t, _ in agent.subscriptions()] == [ROUND_TOPIC, f"{BASE}/error/{DEVICE}", INVITE_TOPIC]
    blob = st_save(models(1))
    first = [selecting(blob, 1, agent.manifest.base_digest), invitation(1)]
    assert device.feed(first if order == "round info first" else first[::-1]) == []
    assert model_subscriptions(agent) == [f"{BASE}/model/r1/#"]  # this round's chunks, not model/#
    _, meta, update = sent_update(device.feed(chunk_frames(blob, "r1", 1)))
    assert meta["round"] == 1 and sorted(update) == sorted(agent.manifest.names(shared=True))
    assert model_subscriptions(agent) == []  # it holds the model: no more chunks pushed to it
    assert sent_update(device.feed([selecting(blob, 1, agent.manifest.base_digest, deadline=2.0e9)]))[1]["round"] == 1


def test_a_device_not_invited_stays_quiet_and_never_uploads(make_device, models) -> None:
    device = make_device()
    agent = device.agent
    sent_update(device.open_round(1, models(1)))  # a round of the default mode first: it took part
    before, logged = device.tensors(), len(device.logs)
    blob = st_save(models(2))
    digest = agent.manifest.base_digest
    assert device.feed([invitation(1), (INVITE_TOPIC, b""), selecting(blob, 2, digest)]) == []
    assert model_subscriptions(agent) == []  # it asks for no model
    assert device.feed(chunk_frames(blob, "r2", 2)) == []  # chunks that reach it anyway change nothing
    assert device.feed([invitation(3), selecting(blob, 2, digest, deadline=2.0e9)]) == []  # not this round's
    error = (f"{BASE}/error/{DEVICE}", json.dumps({"v": 1, "code": "unknown_device", "message": "m",
                                                    "round": 1}).encode())  # about its saved round-1 update
    assert [m.topic for m in device.feed([error])] == [PRESENCE_TOPIC, f"{BASE}/register/{DEVICE}"]  # no update
    assert device.agent.tick() == []
    new = device.logs[logged:]
    assert sum("round 2: not invited" in line for line in new) == 1, new  # one line for the round
    after = device.tensors()
    assert all(np.array_equal(before[n], after[n]) for n in before) and agent.state.load(agent.manifest).round == 1

    _, meta, _ = sent_update(device.feed([invitation(2)]))  # a top-up invitation: it takes part at once
    assert meta["round"] == 2


def test_the_default_mode_subscribes_to_every_model_once_round_info_is_known(make_device, models) -> None:
    device = make_device()
    assert model_subscriptions(device.agent) == []
    device.open_round(1, models(1))
    assert model_subscriptions(device.agent) == [f"{BASE}/model/#"]  # as before selection existed
    assert device.feed([invitation(5)]) == []  # no invitation in this mode, and one changes nothing


def power_supply(sys_root: Path, name: str, **attributes: object) -> None:
    directory = sys_root / "class" / "power_supply" / name
    directory.mkdir(parents=True, exist_ok=True)
    for attribute, value in attributes.items():
        (directory / attribute).write_text(f"{value}\n")


class Clock:
    """Unix time that tests move forward by hand (the eligibility back-off reads it)."""

    def __init__(self) -> None:
        self.now = 1.8e9

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("selection", ["all", "invited"])
def test_a_device_that_is_not_eligible_does_not_train_and_says_why_once(make_device, models, tmp_path: Path,
                                                                       selection: str) -> None:
    sys_root = tmp_path / "sys"
    power_supply(sys_root, "AC", type="Mains", online=0)
    power_supply(sys_root, "BAT0", type="Battery", status="Discharging", capacity=80)
    clock = Clock()
    device = make_device(options={"conditions": Conditions(("power", "battery>=50"), sys_root=sys_root),
                                  "clock": clock}, recheck_s=60.0)
    agent = device.agent
    assert presence(agent.connected()) == [b"offline"]  # not willing to train: a selecting coordinator skips it
    blob = st_save(models(1))
    extra = {"selection": "invited", "next_selection_at": 1.9e9} if selection == "invited" else {}
    messages = [round_info(blob, 1, agent.manifest.base_digest, **extra),
                *([invitation(1)] if selection == "invited" else []), *chunk_frames(blob, "r1", 1)]
    assert device.feed(messages) == []
    assert agent.saved is None and model_subscriptions(agent) == ([f"{BASE}/model/#"] if selection == "all" else [])
    declined = [line for line in device.logs if "not eligible" in line]
    assert declined == [f"{where}not eligible (power: on battery (BAT0 Discharging)): not taking part; "
                        "checking again in 60 s" for where in ("", "round 1: ")]  # at connect, then for the round

    clock.now += 30
    assert agent.tick() == []  # backing off: not checked yet
    power_supply(sys_root, "AC", online=1)  # plugged in
    assert agent.tick() == []
    clock.now += 31
    out = agent.tick()
    assert presence(out) == [b"online"] and sent_update(out)[1]["round"] == 1
    assert any("round 1: eligible again" in line for line in device.logs)
    assert sum("not eligible" in line for line in device.logs) == 2


def test_unplugged_between_rounds_it_skips_the_next_round_until_a_new_round_info(make_device, models,
                                                                                   tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    power_supply(sys_root, "BAT0", type="Battery", status="Charging", capacity=80)
    clock = Clock()
    device = make_device(options={"conditions": Conditions(("power",), sys_root=sys_root), "clock": clock})
    agent = device.agent
    assert presence(agent.connected()) == [b"online"]
    sent_update(device.open_round(1, models(1)))
    power_supply(sys_root, "BAT0", status="Discharging")
    out = device.open_round(2, models(2))
    assert presence(out) == [b"offline"] and not [m for m in out if m.topic == UPDATE_TOPIC]
    assert agent.state.load(agent.manifest).round == 1
    power_supply(sys_root, "BAT0", status="Full")
    out = device.feed([round_info(st_save(models(2)), 2, agent.manifest.base_digest, deadline=2.0e9)])
    assert presence(out) == [b"online"] and sent_update(out)[1]["round"] == 2  # re-checked at RoundInfo


def test_a_command_condition_is_run_for_real(make_device, models, tmp_path: Path) -> None:
    allowed = tmp_path / "unmetered"
    device = make_device(options={"conditions": Conditions((f"command:test -e {allowed}",))})
    assert [m.payload for m in device.open_round(1, models(1))] == [b"offline"]  # no update
    assert device.agent.saved is None and any("not eligible (command:" in line for line in device.logs)
    allowed.touch()
    out = device.feed([round_info(st_save(models(1)), 1, device.agent.manifest.base_digest)])
    assert sent_update(out)[1]["round"] == 1


def test_the_engine_needs_no_mqtt_client() -> None:
    """The protocol logic runs without paho: MQTT is the service's business alone."""
    code = "import sys, fedper.edge.engine; print(sorted(m for m in sys.modules if m.split('.')[0] == 'paho'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------ FedBABU: a fine-tuned copy is evaluated and served


@pytest.fixture
def babu(tiny_export, device_data: Path, tmp_path: Path) -> Callable[..., Device]:
    """babu(state="babu", **config) -> a FedBABU device (MobileNet-v1 x0.25, K_P=1, the head frozen at its init)."""
    artifacts = tiny_export(algorithm="fedbabu", kp=1)

    def make(state: str = "babu", **config: object) -> Device:
        options = {"backend": "ort", "seed": 3, **config}
        return Device(AgentConfig(artifacts=artifacts, data=device_data, broker="mqtt://127.0.0.1:1", fleet=FLEET,
                                  client_id=DEVICE, state_dir=tmp_path / state, batch_size=8, lr=0.05, **options))

    return make


def by_hand(device: Device, model: dict[str, np.ndarray], trained: str | None = None, seed: tuple[int, ...] = ()):
    """A fresh ORT backend of the same export holding `model` (+ the export's head), with `trained`
    trained one epoch on the device's own data with the batch key `seed`."""
    from fedper.edge.backend import open_backend

    agent = device.agent
    backend = open_backend("ort", agent.config.artifacts, agent.manifest)
    backend.load(model)
    if trained is not None:
        backend.train(trained, agent.data.x_train, agent.data.y_train, epochs=1, batch_size=8, lr=0.05, seed=seed)
    return backend


def test_a_fedbabu_device_reports_a_fine_tuned_copy_and_trains_the_untuned_model(babu) -> None:
    device = babu()
    agent = device.agent
    initial = device.tensors()
    shared, head = agent.manifest.names(shared=True), agent.manifest.names(shared=False)
    model = {n: initial[n] for n in shared}
    _, meta, update = sent_update(device.open_round(1, model))

    tuned = by_hand(device, model, "all", (3, 1, 1000))  # (--seed, round, the emulator's fine-tune phase)
    accuracy, loss = tuned.evaluate(agent.data.x_test, agent.data.y_test)
    assert (meta["metrics"]["accuracy"], meta["metrics"]["loss"]) == pytest.approx((accuracy, loss), abs=1e-6)
    frozen = babu("frozen", eval_finetune_epochs=0)
    _, frozen_meta, frozen_update = sent_update(frozen.open_round(1, model))
    untuned = by_hand(device, model).evaluate(agent.data.x_test, agent.data.y_test)
    assert frozen_meta["metrics"]["loss"] == pytest.approx(untuned[1])
    assert abs(frozen_meta["metrics"]["loss"] - loss) > 1e-4  # the random head's evaluation is not what is reported

    # the training state is the untuned model's: the head is still its frozen init, the update is the
    # base trained from the untuned model (the same as the device that never fine-tunes sends)
    saved = agent.state.load(agent.manifest)
    assert all(np.array_equal(saved.local[n], initial[n]) for n in head)
    assert all(np.array_equal(device.tensors()[n], initial[n]) for n in head)
    trained = by_hand(device, model, "base", (3, 1, 0)).read(shared)
    assert all(np.allclose(update[n], trained[n], rtol=1e-6, atol=1e-7) for n in shared)
    assert all(np.array_equal(update[n], frozen_update[n]) for n in shared)


def test_a_finished_fedbabu_device_saves_the_fine_tuned_model_that_final_json_measured(babu, tmp_path) -> None:
    device = babu()
    agent = device.agent
    initial = device.tensors()
    model = {n: initial[n] for n in agent.manifest.names(shared=True)}
    assert device.open_round(2, model, rounds=2, state="finished", blob_id="final") == []
    record = json.loads((tmp_path / "babu" / FINAL_FILE).read_text())
    served, meta = read_checkpoint(tmp_path / "babu" / SERVED_FILE)
    assert meta == record and set(served) == set(agent.manifest.names())
    expected = by_hand(device, model, "all", (3, 3, 1000)).read(agent.manifest.names())  # the round after R = 2
    assert all(np.array_equal(served[n], expected[n]) for n in served)
    assert not all(np.array_equal(served[n], initial[n]) for n in agent.manifest.names(shared=False))
    # what the device serves, evaluated afresh, is what final.json says
    accuracy, loss = by_hand(device, served).evaluate(agent.data.x_test, agent.data.y_test)
    assert (record["accuracy"], record["loss"]) == pytest.approx((accuracy, loss), abs=1e-6)
    assert agent.state.load(agent.manifest) is None  # no round trained: nothing of the fine-tune was kept


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_the_agents_fine_tuned_evaluation_is_the_emulators(babu, backend: str) -> None:
    """The emulator's FedBABU evaluation (fedper.emulate.fleet.Fleet._evaluate: a copy trained by
    train_client on the client's batch key with PURPOSE_FINETUNE, then evaluated) of the same tensors
    and data, for emulated client j whose client_seed is the agent's --seed, equals what the agent reports."""
    import torch

    from fedper.algorithms import Phase
    from fedper.batches import PURPOSE_FINETUNE, client_seed
    from fedper.emulate.train import client_generator, train_client
    from fedper.models import build_model
    from fedper.training import evaluate, load_tensors

    run_seed, j = 7, 1
    device = babu(backend=backend, seed=client_seed(run_seed, j))
    agent = device.agent
    initial = device.tensors()
    # round 2 opens with the aggregate of round 1, which the emulator evaluates at the end of round 1
    _, meta, _ = sent_update(device.open_round(2, {n: initial[n] for n in agent.manifest.names(shared=True)}))

    m = agent.manifest.model
    net = build_model(m.architecture, m.num_classes, m.width, m.input_shape[1])
    load_tensors(net, {n: torch.from_numpy(x) for n, x in initial.items()})
    d = agent.data
    x, y = torch.from_numpy(np.concatenate([d.x_train, d.x_test])), torch.from_numpy(np.concatenate([d.y_train,
                                                                                                     d.y_test]))
    train_idx, test_idx = torch.arange(len(d.y_train)), torch.arange(len(d.y_train), len(y))
    # what Fleet._evaluate does for client j at the end of round 1 (its new state's round is 1)
    train_client(net, agent.manifest, (Phase("all", 1),), x, y, train_idx, local_epochs=1, batch_size=8, lr=0.05,
                 momentum=0.0, generator=client_generator(run_seed, 1, j, PURPOSE_FINETUNE))
    accuracy, loss = evaluate(net, x, y, test_idx)
    assert meta["metrics"]["accuracy"] == accuracy
    assert meta["metrics"]["loss"] == pytest.approx(loss, rel=1e-4)
