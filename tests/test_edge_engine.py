"""The agent's engine alone: hand-built frames and fake job results in, what it publishes and asks for out.

No backend, no broker, no file. RoundInfo messages, model chunks, errors and invitations are written here
with json, struct, zlib and hashlib as docs/protocol.md describes them (not with fedper.wire's encoder),
for the toy model of tests/vectors; a "trained" result is an update made up here, and what the engine
publishes is read back by hand. A restart resends the saved update (and so does every RoundInfo of that
round), `unknown_device` makes it register and resend, stale RoundInfo and a blob that is not the round's
sha256 are ignored, missed rounds are caught up, a finished run asks for the final evaluation; forged or
corrupt input is refused in one log line and asks for no work; selection, --only-when and secure
aggregation ride on the same machine; while a job is out the engine keeps taking messages and never asks
for a second job. The device with a real backend: tests/test_edge_agent.py.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers.frames import frame
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.edge.engine import (
    BUSY,
    TRANSITIONS,
    Action,
    AgentEngine,
    AgentError,
    CheckConditions,
    ConditionsChecked,
    Connected,
    EngineSettings,
    EvaluateFinal,
    Event,
    FinalEvaluated,
    Message,
    Phase,
    RoundTrained,
    Saved,
    Step,
    Tick,
    TrainRound,
)
from fedper.wire import Outgoing, Topics

MANIFEST = tiny_manifest()
DIGEST = MANIFEST.base_digest
SHARED, HEAD = MANIFEST.names(shared=True), MANIFEST.names(shared=False)
FLEET, DEVICE = "lab", "dev0"
BASE = f"fedper/v1/{FLEET}"
ROUND_TOPIC, UPDATE_TOPIC, SECAGG_TOPIC = f"{BASE}/round", f"{BASE}/update/{DEVICE}", f"{BASE}/secagg/{DEVICE}"
PRESENCE_TOPIC, REGISTER_TOPIC = f"{BASE}/presence/{DEVICE}", f"{BASE}/register/{DEVICE}"
INVITE_TOPIC, ERROR_TOPIC, RELAY_TOPIC = f"{BASE}/invite/{DEVICE}", f"{BASE}/error/{DEVICE}", f"{BASE}/relay/{DEVICE}"
CHUNK = 40  # bytes of model per chunk: the toy model's blob spans several
Frame = tuple[str, bytes]


# ------------------------------------------------------------ frames by hand (docs/protocol.md, sections 5 and 6)


def model(k: int) -> dict[str, np.ndarray]:
    """The coordinator's model of round k."""
    return tiny_tensors(offset=k / 10)


def chunk_frames(blob: bytes, blob_id: str, round_: int, chunk_size: int = CHUNK, fleet: str = FLEET) -> list[Frame]:
    """A model blob as the coordinator publishes it: (topic, frame) per chunk."""
    count = max(1, -(-len(blob) // chunk_size))
    sha = hashlib.sha256(blob).hexdigest()
    return [(f"fedper/v1/{fleet}/model/{blob_id}/{i}",
             frame({"v": 1, "blob_id": blob_id, "index": i, "count": count, "size": len(blob),
                    "chunk_size": chunk_size, "sha256": sha, "meta": {"round": round_}},
                   blob[i * chunk_size : (i + 1) * chunk_size]))
            for i in range(count)]


def round_info(blob: bytes, round_: int, digest: str = DIGEST, *, rounds: int = 3, state: str = "open",
               blob_id: str | None = None, chunk_size: int = CHUNK, fleet: str = FLEET, **fields: object) -> Frame:
    body = {"v": 1, "round": round_, "rounds": rounds, "state": state, "deadline": 1.9e9,
            "blob_id": blob_id or f"r{round_}", "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            "count": max(1, -(-len(blob) // chunk_size)), "base_digest": digest, **fields}
    return f"fedper/v1/{fleet}/round", json.dumps(body).encode()


def selecting(blob: bytes, round_: int, **fields: object) -> Frame:
    """RoundInfo of a coordinator run with --clients-per-round."""
    return round_info(blob, round_, selection="invited", next_selection_at=1.9e9, **fields)


def invitation(round_: int) -> Frame:
    return INVITE_TOPIC, json.dumps({"v": 1, "round": round_}).encode()


def error(code: str, round_: int) -> Frame:
    return ERROR_TOPIC, json.dumps({"v": 1, "code": code, "message": "m", "round": round_}).encode()


def read_frame(payload: bytes) -> tuple[dict, bytes]:
    n, crc = struct.unpack_from(">II", payload)
    assert zlib.crc32(payload[8:]) == crc
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def sent_update(out: list[Action]) -> tuple[str, dict, dict[str, np.ndarray]]:
    """(blob_id, meta, tensors) of the one update among `out`, reassembled and checked by hand."""
    frames = [read_frame(m.payload) for m in published(out) if m.topic == UPDATE_TOPIC]
    assert frames and all(m.qos == 1 and not m.retain for m in published(out) if m.topic == UPDATE_TOPIC)
    headers = [h for h, _ in frames]
    assert len({h["blob_id"] for h in headers}) == 1 and len(frames) == headers[0]["count"]
    blob = b"".join(data for _, data in sorted(frames, key=lambda f: f[0]["index"]))
    assert hashlib.sha256(blob).hexdigest() == headers[0]["sha256"] and len(blob) == headers[0]["size"]
    return headers[0]["blob_id"], headers[0]["meta"], st_load(blob)


def published(out: list[Action]) -> list[Outgoing]:
    return [a for a in out if isinstance(a, Outgoing)]


def jobs(out: list[Action]) -> list[Action]:
    return [a for a in out if not isinstance(a, Outgoing)]


def presence(out: list[Action]) -> list[bytes]:
    assert all(m.retain for m in published(out) if m.topic == PRESENCE_TOPIC)
    return [m.payload for m in published(out) if m.topic == PRESENCE_TOPIC]


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def saved_round(round_: int, shift: float = 0.25) -> Saved:
    """A trained round as the train job would return it: the round's model moved by `shift`, a head of its own."""
    return Saved(round=round_, base_digest=DIGEST, n_samples=16,
                 local={n: np.full(MANIFEST.spec(n).shape, shift, np.float32) for n in HEAD},
                 update={n: x + np.float32(shift) for n, x in model(round_).items()},
                 metrics={"accuracy": 0.75, "loss": 0.5, "train_loss": 0.25})


# ------------------------------------------------------------ an engine, a clock and its log


class Device:
    def __init__(self, saved: Saved | None = None, secure: Callable | None = None, **settings: object) -> None:
        self.logs: list[str] = []
        self.now = 1.8e9
        options = {"client_id": DEVICE, "fleet": FLEET, "n_samples": 16, "chunk_size": 64, **settings}
        self.engine = AgentEngine(MANIFEST, EngineSettings(**options), saved, self.logs.append, secure)

    def feed(self, *frames: Frame) -> list[Action]:
        out: list[Action] = []
        for topic, payload in frames:
            out += self.engine.handle(Message(topic, payload), self.now)
        return out

    def connect(self) -> list[Action]:
        return self.engine.handle(Connected(), self.now)

    def tick(self) -> list[Action]:
        return self.engine.handle(Tick(), self.now)

    def open_round(self, round_: int, tensors: dict[str, np.ndarray] | None = None, **fields: object) -> list[Action]:
        """RoundInfo and then the model's chunks, as they usually arrive."""
        blob = st_save(model(round_) if tensors is None else tensors)
        blob_id = str(fields.get("blob_id", f"r{round_}"))
        return self.feed(round_info(blob, round_, **fields), *chunk_frames(blob, blob_id, round_))

    def trained(self, job: Action, shift: float = 0.25) -> list[Action]:
        """The train job's result: the job's model moved by `shift` (saved, as the real job saves it)."""
        assert isinstance(job, TrainRound)
        saved = saved_round(job.info.round, shift)
        saved.update = {n: np.asarray(x) + np.float32(shift) for n, x in job.model.items()}
        return self.engine.handle(RoundTrained(job, saved), self.now)

    def checked(self, job: Action, problem: str | None) -> list[Action]:
        assert isinstance(job, CheckConditions)
        return self.engine.handle(ConditionsChecked(job, problem), self.now)

    def take_part(self, round_: int, **fields: object) -> tuple[dict, dict[str, np.ndarray]]:
        """A whole round: its RoundInfo and model, training, the update: (meta, tensors) of what was sent."""
        (job,) = jobs(self.open_round(round_, **fields))
        _, meta, update = sent_update(self.trained(job))
        return meta, update


# ------------------------------------------------------------ the protocol


def test_a_round_is_trained_by_a_job_and_only_what_it_returned_is_sent() -> None:
    device = Device()
    announced = device.connect()
    assert [(m.topic, m.retain) for m in announced] == [(PRESENCE_TOPIC, True), (REGISTER_TOPIC, True)]
    assert presence(announced) == [b"online"]
    register = json.loads(announced[1].payload)
    assert register["n_samples"] == 16 and register["base_digest"] == DIGEST

    blob = st_save(model(1))
    assert device.feed(round_info(blob, 1)) == []  # the model is not here yet
    chunks = chunk_frames(blob, "r1", 1)
    assert len(chunks) > 1 and device.feed(*chunks[:-1]) == []
    (job,) = device.feed(chunks[-1])
    assert isinstance(job, TrainRound) and job.info.round == 1 and same(dict(job.model), model(1))
    assert device.engine.phase is Phase.TRAINING

    # while the job is out the engine takes messages: a re-published RoundInfo waits, a reconnect announces
    assert device.feed(round_info(blob, 1, deadline=2.0e9)) == []
    assert [m.topic for m in device.connect()] == [PRESENCE_TOPIC, REGISTER_TOPIC]

    out = device.trained(job, 0.5)
    assert jobs(out) == []
    _, meta, update = sent_update(out)
    assert meta == {"round": 1, "n_samples": 16, "base_digest": DIGEST, "codec": "fp32",
                    "metrics": {"accuracy": 0.75, "loss": 0.5, "train_loss": 0.25}}
    assert sorted(update) == sorted(SHARED)  # no head tensor on the wire
    assert same(update, {n: x + np.float32(0.5) for n, x in model(1).items()})
    assert device.engine.phase is Phase.ANSWERED and device.engine.saved.round == 1


def test_a_restarted_device_resends_its_saved_update_whenever_its_round_is_announced() -> None:
    saved = saved_round(1)
    device = Device(saved)  # killed after saving, before the coordinator had the update
    assert [m.topic for m in device.connect()] == [PRESENCE_TOPIC, REGISTER_TOPIC]
    out = device.open_round(1)
    assert jobs(out) == []  # not trained again
    blob_id, meta, update = sent_update(out)
    assert meta["round"] == 1 and same(update, saved.update)
    assert any("round 1: already trained" in line for line in device.logs)

    assert device.feed(*chunk_frames(st_save(model(1)), "r1", 1)) == []  # the same chunks again: sent already
    # The round's RoundInfo again (after a reconnect, the coordinator's restart or an extension): the
    # update may have been lost on the way, and v1 acknowledges none, so it goes again, not retrained.
    out = device.feed(round_info(st_save(model(1)), 1, deadline=2.0e9))
    again_id, meta, again = sent_update(out)
    assert jobs(out) == [] and meta["round"] == 1 and again_id != blob_id and same(again, saved.update)


def test_unknown_device_makes_it_register_again_and_resend() -> None:
    device = Device()
    device.take_part(1)
    out = device.feed(error("unknown_device", 1))
    register = [m for m in published(out) if m.topic == REGISTER_TOPIC]
    assert len(register) == 1 and register[0].retain and json.loads(register[0].payload)["n_samples"] == 16
    assert sent_update(out)[1]["round"] == 1 and jobs(out) == []
    assert device.feed(error("unknown_device", 2), error("late_update", 1), error("duplicate_update", 1)) == []
    with pytest.raises(AgentError, match="refused this export"):
        device.feed(error("digest_mismatch", 1))


def test_a_stale_round_info_is_ignored() -> None:
    device = Device()
    device.take_part(1)
    _, update = device.take_part(2)
    assert device.open_round(1) == [] and "stale" in device.logs[-1]
    out = device.feed(round_info(st_save(model(2)), 2))
    assert jobs(out) == [] and same(sent_update(out)[2], update)  # round 2 is still the one it answered: resent


@pytest.mark.parametrize("order", ["round info first", "blob first"])
def test_a_blob_that_is_not_the_rounds_sha256_is_ignored_until_the_right_one_comes(order: str) -> None:
    device = Device()
    right = st_save(model(1))
    forged = st_save({n: x + np.float32(0.5) for n, x in model(1).items()})
    messages = [round_info(right, 1), *chunk_frames(forged, "r1", 1)]
    assert device.feed(*(messages if order == "round info first" else messages[::-1])) == []
    assert sum("does not match the round's sha256" in line for line in device.logs) == 1
    (job,) = device.feed(*chunk_frames(right, "r1", 1))
    assert isinstance(job, TrainRound) and same(dict(job.model), model(1))


def test_a_device_that_missed_rounds_joins_the_open_one() -> None:
    device = Device(saved_round(1))
    (job,) = device.open_round(4, rounds=5)
    assert isinstance(job, TrainRound) and job.info.round == 4 and same(dict(job.model), model(4))
    assert sent_update(device.trained(job))[1]["round"] == 4


def test_the_finished_run_asks_for_the_final_evaluation_and_then_stops() -> None:
    device = Device()
    device.take_part(1)
    (job,) = device.open_round(3, state="finished", blob_id="final")
    assert isinstance(job, EvaluateFinal) and job.info.rounds == 3 and same(dict(job.model), model(3))
    assert not device.engine.done
    assert device.engine.handle(FinalEvaluated(job, 0.75), device.now) == []
    assert device.engine.done and device.engine.final_accuracy == 0.75
    assert device.open_round(4, rounds=5) == [] and device.connect() == []  # the run is over for it


# ------------------------------------------------------------ forged or corrupt input (issue: untrusted peers)


def _safetensors_with_header(header: object) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head


def _forged_pair(blob: bytes) -> list[Frame]:
    """A well-formed RoundInfo of round 2 naming `blob`, and its chunks."""
    return [round_info(blob, 2), *chunk_frames(blob, "r2", 2)]


def _reshaped(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    name = next(n for n, x in tensors.items() if x.ndim > 1)
    return {**tensors, name: tensors[name].reshape(-1)}


def _with_nan(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    name = next(iter(tensors))
    poisoned = tensors[name].copy()
    poisoned.flat[0] = np.nan
    return {**tensors, name: poisoned}


def _flip_a_byte(message: Frame) -> Frame:
    topic, payload = message
    return topic, payload[:-1] + bytes([payload[-1] ^ 0xFF])


def _declaring(message: Frame, **fields: object) -> Frame:
    """A chunk whose header says something else (its CRC recomputed, so only the header is wrong)."""
    header, data = read_frame(message[1])
    return message[0], frame({"v": 1, **header, **fields}, data)


HEAD_TENSORS = {n: np.zeros(MANIFEST.spec(n).shape, np.float32) for n in HEAD}
# Each case: the forged messages given the round-2 model blob, and the log's words.
FORGERIES: dict[str, tuple[Callable[[bytes], list[Frame]], str]] = {
    "another export's RoundInfo": (lambda blob: [round_info(blob, 2, "sha256:" + "0" * 64)], "another export"),
    "a list-shaped RoundInfo": (lambda blob: [(ROUND_TOPIC, b"[2, 3]")], "bad message"),
    "a RoundInfo with a string round": (lambda blob: [round_info(blob, 2, round="2")], "bad message"),
    "a RoundInfo with a round beyond float range": (lambda blob: [round_info(blob, 2, round=10**400)], "round"),
    "a RoundInfo with a NaN deadline": (
        lambda blob: [(ROUND_TOPIC, round_info(blob, 2)[1].replace(b'"deadline": 1900000000.0',
                                                                   b'"deadline": NaN'))], "bad message"),
    "a round beyond the run's last": (lambda blob: [round_info(blob, 5, rounds=3)], "of a run of 3"),
    "an oversized model declared": (lambda blob: [round_info(blob, 2, size=10**9)], "declares"),
    "a model with NaN": (lambda blob: _forged_pair(st_save(_with_nan(st_load(blob)))), "refused model r2"),
    "a model with a wrong shape": (lambda blob: _forged_pair(st_save(_reshaped(st_load(blob)))), "refused model r2"),
    "a model with a list-shaped safetensors header": (
        lambda blob: _forged_pair(_safetensors_with_header([1, 2])), "refused model r2"),
    "a model carrying the head": (
        lambda blob: _forged_pair(st_save({**st_load(blob), **HEAD_TENSORS})), "refused model r2"),
    "a compressed model": (
        lambda blob: _forged_pair(st_save({n: x.astype(np.float16) for n, x in st_load(blob).items()},
                                          {"fedper.codec": "fp16"})), "refused model r2"),
    "another blob under the round's blob id": (
        lambda blob: [round_info(blob, 2), *chunk_frames(st_save(_with_nan(st_load(blob))), "r2", 2)],
        "does not match the round's sha256"),
    "every chunk corrupt": (lambda blob: [round_info(blob, 2), *map(_flip_a_byte, chunk_frames(blob, "r2", 2))],
                            "crc32"),
    "an oversized blob declared in a chunk": (
        lambda blob: [round_info(blob, 2), _declaring(chunk_frames(blob, "r2", 2)[0], size=10**9)], "oversized"),
    "chunks on another blob's topic": (
        lambda blob: [round_info(blob, 2), *[(topic.replace("/r2/", "/r9/"), payload)
                                             for topic, payload in chunk_frames(blob, "r2", 2)]],
        "another blob's topic"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_or_corrupt_input_is_refused_in_one_line_asks_for_no_work_and_the_right_round_still_trains(
        case: str) -> None:
    device = Device()
    device.take_part(1)
    saved, logged = device.engine.saved, len(device.logs)
    forge, words = FORGERIES[case]
    assert device.feed(*forge(st_save(model(2)))) == []  # nothing published, no job: the model and head untouched
    new = device.logs[logged:]
    assert len(new) == 1 and words in new[0], new
    assert device.engine.saved is saved

    (job,) = device.open_round(2)  # the coordinator's real round 2
    assert isinstance(job, TrainRound) and job.info.round == 2 and same(dict(job.model), model(2))


def test_a_forged_round_info_does_not_cost_the_device_the_right_model() -> None:
    """The round's model is here before its RoundInfo; a RoundInfo naming it with another sha256
    comes first: refused, and the model is kept for the right RoundInfo (retained chunks are not sent twice)."""
    device = Device()
    device.take_part(1)
    right = st_save(model(2))
    assert device.feed(*chunk_frames(right, "r2", 2)) == []
    logged = len(device.logs)
    assert device.feed(round_info(right, 2, sha256="ab" * 32)) == []
    assert len(device.logs) == logged + 1 and "does not match the round's sha256" in device.logs[-1]
    (job,) = device.feed(round_info(right, 2))
    assert isinstance(job, TrainRound) and same(dict(job.model), model(2))


# ------------------------------------------------------------ while a job is out


def test_rounds_that_move_on_during_training_are_taken_up_after_it_one_job_at_a_time() -> None:
    device = Device()
    (first,) = device.open_round(1)
    assert device.open_round(2) == []  # round 1 closed without it, round 2 opened: no second job meanwhile
    out = device.trained(first)
    _, meta, _ = sent_update(out)  # the round-1 update goes all the same (the coordinator says late_update)
    (second,) = jobs(out)
    assert meta["round"] == 1 and isinstance(second, TrainRound) and same(dict(second.model), model(2))
    assert device.feed(round_info(st_save(model(1)), 1)) == [] and "stale" in device.logs[-1]  # older than round 2
    assert sent_update(device.trained(second))[1]["round"] == 2


def test_a_round_that_finishes_during_training_is_evaluated_after_the_update_is_sent() -> None:
    device = Device()
    (job,) = device.open_round(3)
    assert device.open_round(3, state="finished", blob_id="final") == []
    out = device.trained(job)
    assert sent_update(out)[1]["round"] == 3
    (final,) = jobs(out)
    assert isinstance(final, EvaluateFinal) and same(dict(final.model), model(3))


# ------------------------------------------------------------ selection and eligibility (docs/protocol.md, 8.1)


def model_subscriptions(device: Device) -> list[str]:
    return [topic for topic, _ in device.engine.subscriptions() if "/model/" in topic]


@pytest.mark.parametrize("order", ["round info first", "invitation first"])
def test_an_invited_device_trains_and_subscribes_to_its_rounds_model_alone(order: str) -> None:
    device = Device()
    assert [t for t, _ in device.engine.subscriptions()] == [ROUND_TOPIC, ERROR_TOPIC, INVITE_TOPIC]
    blob = st_save(model(1))
    first = [selecting(blob, 1), invitation(1)]
    assert device.feed(*(first if order == "round info first" else first[::-1])) == []
    assert model_subscriptions(device) == [f"{BASE}/model/r1/#"]  # this round's chunks, not model/#
    (job,) = device.feed(*chunk_frames(blob, "r1", 1))
    assert model_subscriptions(device) == []  # it holds the model: no more chunks pushed to it
    assert sent_update(device.trained(job))[1]["round"] == 1
    assert sent_update(device.feed(selecting(blob, 1, deadline=2.0e9)))[1]["round"] == 1  # re-published: resent


def test_a_device_not_invited_stays_quiet_and_never_uploads() -> None:
    device = Device()
    device.take_part(1)  # a round of the default mode first: it took part
    logged = len(device.logs)
    blob = st_save(model(2))
    assert device.feed(invitation(1), (INVITE_TOPIC, b""), selecting(blob, 2)) == []
    assert model_subscriptions(device) == []  # it asks for no model
    assert device.feed(*chunk_frames(blob, "r2", 2)) == []  # chunks that reach it anyway change nothing
    assert device.feed(invitation(3), selecting(blob, 2, deadline=2.0e9)) == []  # not this round's
    out = device.feed(error("unknown_device", 1))  # about its saved round-1 update
    assert [m.topic for m in out] == [PRESENCE_TOPIC, REGISTER_TOPIC]  # registers again, sends no update
    assert device.tick() == []
    new = device.logs[logged:]
    assert sum("round 2: not invited" in line for line in new) == 1, new  # one line for the round
    assert device.engine.saved.round == 1

    (job,) = device.feed(invitation(2))  # a top-up invitation: it takes part at once (the model is here)
    assert isinstance(job, TrainRound) and job.info.round == 2


def test_an_invitation_cleared_before_the_model_came_drops_the_model_subscription() -> None:
    device = Device()
    blob = st_save(model(1))
    assert device.feed(selecting(blob, 1), invitation(1)) == []
    assert model_subscriptions(device) == [f"{BASE}/model/r1/#"]
    assert device.feed((INVITE_TOPIC, b"")) == [] and model_subscriptions(device) == []
    assert device.feed(*chunk_frames(blob, "r1", 1)) == []  # no longer its round


def test_the_default_mode_subscribes_to_every_model_once_round_info_is_known() -> None:
    device = Device()
    assert model_subscriptions(device) == []
    device.open_round(1)
    assert model_subscriptions(device) == [f"{BASE}/model/#"]  # as before selection existed
    assert device.feed(invitation(5)) == []  # no invitation in this mode, and one changes nothing


@pytest.mark.parametrize("selection", ["all", "invited"])
def test_a_device_that_is_not_eligible_does_not_train_and_says_why_once(selection: str) -> None:
    device = Device(conditions=True, recheck_s=60.0)
    out = device.connect()
    assert presence(out) == [b"offline"]  # not known to be willing yet: a selecting coordinator skips it
    (check,) = jobs(out)
    assert isinstance(check, CheckConditions) and check.round == 0
    assert device.checked(check, "power: on battery") == []  # still offline: nothing to say

    blob = st_save(model(1))
    extra = {"selection": "invited", "next_selection_at": 1.9e9} if selection == "invited" else {}
    out = device.feed(round_info(blob, 1, **extra), *([invitation(1)] if selection == "invited" else []))
    (check,) = jobs(out)  # a RoundInfo (an invitation) is a reason to look again
    assert check.round == 1 and device.checked(check, "power: on battery") == []
    assert device.feed(*chunk_frames(blob, "r1", 1)) == []
    assert model_subscriptions(device) == ([f"{BASE}/model/#"] if selection == "all" else [])
    declined = [line for line in device.logs if "not eligible" in line]
    assert declined == [f"{where}not eligible (power: on battery): not taking part; checking again in 60 s"
                        for where in ("", "round 1: ")]  # at connect, then for the round

    device.now += 30
    assert device.tick() == []  # backing off: not checked yet
    device.now += 31
    (check,) = device.tick()
    out = device.checked(check, None)  # plugged in meanwhile
    assert presence(out) == [b"online"] and isinstance(jobs(out)[0], TrainRound)
    assert any("round 1: eligible again" in line for line in device.logs)
    assert sum("not eligible" in line for line in device.logs) == 2


def test_the_conditions_are_checked_once_per_round_and_again_for_the_next() -> None:
    device = Device(conditions=True)
    (check,) = jobs(device.connect())
    assert presence(device.checked(check, None)) == [b"online"]
    (check,) = device.open_round(1)
    (job,) = device.checked(check, None)  # the model is here: training at once
    sent_update(device.trained(job))
    assert jobs(device.feed(round_info(st_save(model(1)), 1, deadline=2.0e9))) == []  # round 1 was accepted

    (check,) = device.open_round(2)  # unplugged between rounds
    assert presence(device.checked(check, "power: on battery")) == [b"offline"]
    assert device.feed(round_info(st_save(model(2)), 2, deadline=2.0e9)) == [check]  # re-checked at RoundInfo
    out = device.checked(check, None)
    assert presence(out) == [b"online"] and jobs(out)[0].info.round == 2


def test_without_conditions_a_device_is_online_at_once_and_asks_for_no_check() -> None:
    device = Device()
    assert presence(device.connect()) == [b"online"]
    assert device.tick() == [] and not any(isinstance(a, CheckConditions) for a in device.open_round(1))


# ------------------------------------------------------------ secure aggregation rides on the same machine


def participants(tmp_path: Path) -> Callable:
    """The shell's factory of secure participants (edge/agent.py's), with an identity issued here: the files
    secure aggregation needs (the identity, the record of a revealing round) are the only ones."""
    pytest.importorskip("cryptography", reason="secure aggregation needs the privacy extra")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from helpers.identities import write_identity

    from fedper.edge.secure_round import SecureParticipant

    identity = write_identity(tmp_path / "identity", Ed25519PrivateKey.generate(), FLEET, DEVICE)

    def make(info, saved, model, meta):  # type: ignore[no-untyped-def]
        return SecureParticipant(Topics(FLEET), DEVICE, saved.round, info.secagg_session, MANIFEST, saved.update,
                                 model, saved.n_samples, meta, 64, identity, tmp_path, info.sha256)

    return make


def test_a_secure_round_sends_keys_once_per_session_and_never_the_update(tmp_path: Path) -> None:
    device = Device(secure=participants(tmp_path))
    (job,) = device.open_round(1, secagg_session=5)
    assert (RELAY_TOPIC, 1) in device.engine.subscriptions()
    out = device.trained(job)
    assert [m.topic for m in out] == [SECAGG_TOPIC]  # no update topic: the clear update never leaves
    advert = json.loads(out[0].payload)
    assert (advert["stage"], advert["round"], advert["session"]) == ("advertise", 1, 5)
    assert device.feed(round_info(st_save(model(1)), 1, secagg_session=5)) == []  # the same session: nothing
    again = device.feed(round_info(st_save(model(1)), 1, secagg_session=6))  # a new session: fresh keys
    assert [m.topic for m in again] == [SECAGG_TOPIC] and json.loads(again[0].payload)["session"] == 6
    assert json.loads(again[0].payload)["c_public"] != advert["c_public"]


def test_with_secure_aggregation_on_a_clear_round_gets_nothing(tmp_path: Path) -> None:
    device = Device(secure=participants(tmp_path), secure_aggregation=True)
    assert (RELAY_TOPIC, 1) in device.engine.subscriptions()
    (job,) = device.open_round(1)
    assert device.trained(job) == []
    assert device.feed(round_info(st_save(model(1)), 1, deadline=2.0e9)) == []
    assert sum("holds it back" in line for line in device.logs) == 1
    out = device.feed(round_info(st_save(model(1)), 1, secagg_session=2))
    assert [m.topic for m in out] == [SECAGG_TOPIC]


# ------------------------------------------------------------ the machine itself


def test_the_table_names_only_phases_events_and_steps_and_ends_rows_with_the_steps_that_go_on() -> None:
    goes_on = {Step.CHECK, Step.DECIDE, Step.FETCH}  # these may step the machine again
    for (phase, event), (to, steps) in TRANSITIONS.items():
        assert isinstance(phase, Phase) and isinstance(event, Event) and isinstance(to, Phase)
        assert all(isinstance(s, Step) for s in steps)
        assert not any(s in goes_on for s in steps[:-1]), (phase, event, steps)
    assert not any(phase is Phase.DONE for phase, _ in TRANSITIONS)  # the run over, nothing moves it


ALPHABET = ["connect", "tick", "later", "result ok", "result fails", "round 1", "round 2", "round 3 finished",
            "chunks 1", "chunks 2", "chunks final", "selecting 2", "invite 2", "uninvite", "unknown_device 1",
            "forged model 2", "secure 2"]


def _input(device: Device, symbol: str, job: Action | None, index: int) -> list[Action]:
    """What `symbol` does to the engine (`job`: the one it has out, if any)."""
    round_ = int(symbol[-1]) if symbol[-1].isdigit() else 0
    if symbol == "connect":
        return device.connect()
    if symbol in ("tick", "later"):
        device.now += 61 if symbol == "later" else 0.2
        return device.tick()
    if symbol.startswith("result"):
        ok = symbol == "result ok"
        if isinstance(job, CheckConditions):
            return device.checked(job, None if ok else "power: on battery")
        if isinstance(job, TrainRound):
            return device.trained(job, shift=index / 100)
        if isinstance(job, EvaluateFinal):
            return device.engine.handle(FinalEvaluated(job, 0.5), device.now)
        return []
    if symbol == "round 3 finished":
        return device.feed(round_info(st_save(model(3)), 3, state="finished", blob_id="final"))
    if symbol.startswith("round"):
        return device.feed(round_info(st_save(model(round_)), round_))
    if symbol == "chunks final":
        return device.feed(*chunk_frames(st_save(model(3)), "final", 3))
    if symbol.startswith("chunks"):
        return device.feed(*chunk_frames(st_save(model(round_)), f"r{round_}", round_))
    if symbol.startswith("selecting"):
        return device.feed(selecting(st_save(model(round_)), round_))
    if symbol.startswith("invite"):
        return device.feed(invitation(round_))
    if symbol == "uninvite":
        return device.feed((INVITE_TOPIC, b""))
    if symbol.startswith("unknown_device"):
        return device.feed(error("unknown_device", round_))
    if symbol.startswith("forged"):
        return device.feed(*_forged_pair(st_save(_with_nan(model(round_)))))
    return device.feed(round_info(st_save(model(round_)), round_, secagg_session=7))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=30), st.booleans(), st.booleans())
def test_any_sequence_keeps_one_job_out_and_sends_only_trained_updates(symbols: list[str], conditions: bool,
                                                                        secure: bool) -> None:
    """Whatever arrives in whatever order: nothing raises, at most one job is out, a phase is busy exactly while
    a job is out, and an update is only ever the saved one of the round it names."""
    if secure:
        pytest.importorskip("cryptography", reason="secure aggregation needs the privacy extra")
    device = Device(conditions=conditions, secure_aggregation=secure)
    job: Action | None = None
    for index, symbol in enumerate(symbols):
        out = _input(device, symbol, job, index)
        if symbol.startswith("result"):
            job = None
        new = jobs(out)
        assert len(new) <= 1 and not (new and job is not None), (symbol, new, job)
        job = new[0] if new else job
        assert (device.engine.phase in BUSY) == (job is not None), (symbol, device.engine.phase)
        if any(m.topic == UPDATE_TOPIC for m in published(out)):
            _, meta, update = sent_update(out)
            saved = device.engine.saved
            assert not secure and meta["round"] == saved.round and same(update, saved.update)
