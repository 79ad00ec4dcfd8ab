"""Writes tests/vectors/scenarios/: the device agent's behaviour as scenario vectors, recorded from edge/engine.py.

A scenario is a device's engine fed events one at a time (a connect, a tick, an MQTT message, the result of a job
it asked for) and what it answered to each: the messages it published and the jobs it asked for, its phase and
its subscriptions after the event. docs/protocol.md (section 9.1) describes the format and what is normalized;
web/test/scenarios.test.mjs replays every file against the web agent's engine (web/src/agent.js), and
tests/test_agent_scenarios.py checks that this script reproduces them and what each one shows.

    python tests/vectors/make_scenarios.py [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedper.edge.engine import (
    Action,
    AgentEngine,
    AgentError,
    CheckConditions,
    ConditionsChecked,
    Connected,
    EngineSettings,
    EvaluateFinal,
    FinalEvaluated,
    Message,
    RoundTrained,
    Saved,
    Tick,
    TrainRound,
)
from fedper.payload import decode_shared, encode_shared
from fedper.wire import ErrorMessage, Invitation, Outgoing, Reassembler, RoundInfo, Topics, chunk, decode_chunk

sys.path.insert(0, str(Path(__file__).parent))
from make_vectors import tiny_manifest, tiny_tensors  # the wire vectors' toy model

MANIFEST = tiny_manifest()
DIGEST = MANIFEST.base_digest
FLEET, DEVICE = "lab", "dev0"
TOPICS = Topics(FLEET)
CHUNK = 64  # bytes of model per chunk: the toy model's blob spans several
START = 1_800_000_000.0  # the clock of every scenario's first event (unix seconds)
METRICS = {"accuracy": 0.75, "loss": 0.5, "train_loss": 0.25}
TRAINING_FIELDS = ("lr", "local_epochs", "batch_size")  # RoundInfo: the round's training, as the coordinator decides it


def values(tensors: dict[str, np.ndarray]) -> dict[str, list[float]]:
    return {name: np.asarray(x, np.float32).ravel().tolist() for name, x in tensors.items()}


def model(k: int) -> dict[str, np.ndarray]:
    """The coordinator's model of round k."""
    return tiny_tensors(offset=k / 10)


def blob_of(k: int) -> bytes:
    return encode_shared(MANIFEST, model(k))


def round_info(k: int, *, rounds: int = 3, state: str = "open", digest: str = DIGEST, blob: bytes | None = None,
               blob_id: str | None = None, **fields: Any) -> tuple[str, bytes]:
    blob = blob_of(k) if blob is None else blob
    info = RoundInfo(round=k, rounds=rounds, state=state, deadline=START + 600, blob_id=blob_id or f"r{k}",
                     size=len(blob), sha256=hashlib.sha256(blob).hexdigest(), count=max(1, -(-len(blob) // CHUNK)),
                     base_digest=digest, **fields)
    return TOPICS.round, info.encode()


def chunks(k: int, blob: bytes | None = None, blob_id: str | None = None) -> list[tuple[str, bytes]]:
    blob, blob_id = blob_of(k) if blob is None else blob, blob_id or f"r{k}"
    return [(TOPICS.model(blob_id, i), frame) for i, frame in enumerate(chunk(blob, CHUNK, blob_id, {"round": k}))]


def invitation(k: int) -> tuple[str, bytes]:
    return TOPICS.invite(DEVICE), Invitation(round=k).encode()


def error(code: str, k: int) -> tuple[str, bytes]:
    return TOPICS.error(DEVICE), ErrorMessage(code, f"{code} for round {k}", k).encode()


def saved_round(k: int, shift: float = 0.25) -> Saved:
    """A round trained before the scenario starts (what the state directory or IndexedDB holds after a restart)."""
    update = {n: (x + np.float32(shift)).astype(np.float32) for n, x in model(k).items()}
    local = {n: np.full(MANIFEST.spec(n).shape, shift, np.float32) for n in MANIFEST.names(shared=False)}
    return Saved(round=k, base_digest=DIGEST, n_samples=16, local=local, update=update, metrics=METRICS)


class Recorder:
    """One scenario: an engine, a clock, and every event with what the engine answered."""

    def __init__(self, about: str, saved: Saved | None = None, **settings: Any) -> None:
        self.settings = {"client_id": DEVICE, "fleet": FLEET, "n_samples": 16, "chunk_size": CHUNK,
                         "compression": "fp32", "conditions": False, "recheck_s": 60.0, **settings}
        self.engine = AgentEngine(MANIFEST, EngineSettings(**self.settings), saved, log=lambda line: None)
        self.now = START
        self.out: list[Action] = []  # every action so far: a result answers the newest job of its kind
        saved_json = None if saved is None else {"round": saved.round, "n_samples": saved.n_samples,
                                                 "metrics": saved.metrics, "update": values(saved.update)}
        self.scenario = {"about": about, "settings": self.settings, "saved": saved_json, "steps": []}

    def _record(self, event: dict[str, Any], engine_event: Any) -> list[Action]:
        step: dict[str, Any] = {"at": self.now, "event": event}
        try:
            out = self.engine.handle(engine_event, self.now)
            step["out"] = normalize(out)
        except AgentError:
            out, step["raises"] = [], "AgentError"
        step["phase"] = self.engine.phase.value
        step["subscriptions"] = [topic for topic, _ in self.engine.subscriptions()]
        self.scenario["steps"].append(step)
        self.out += out
        return out

    def later(self, seconds: float) -> Recorder:
        self.now += seconds
        return self

    def connect(self) -> list[Action]:
        return self._record({"type": "connected"}, Connected())

    def tick(self) -> list[Action]:
        return self._record({"type": "tick"}, Tick())

    def feed(self, *messages: tuple[str, bytes]) -> list[Action]:
        out: list[Action] = []
        for topic, payload in messages:
            try:
                shown = {"text": payload.decode()} if not payload or payload.startswith(b"{") else None
            except UnicodeDecodeError:
                shown = None
            event = {"type": "message", "topic": topic, **(shown or {"hex": payload.hex()})}
            out += self._record(event, Message(topic, payload))
        return out

    def _job(self, kind: type) -> Any:
        return next(a for a in reversed(self.out) if isinstance(a, kind))

    def checked(self, problem: str | None) -> list[Action]:
        return self._record({"type": "checked", "problem": problem},
                            ConditionsChecked(self._job(CheckConditions), problem))

    def trained(self, shift: float = 0.25) -> list[Action]:
        """The train job's result: the job's model moved by `shift`."""
        job: TrainRound = self._job(TrainRound)
        update = {n: (np.asarray(x) + np.float32(shift)).astype(np.float32) for n, x in job.model.items()}
        local = {n: np.full(MANIFEST.spec(n).shape, shift, np.float32) for n in MANIFEST.names(shared=False)}
        saved = Saved(round=job.info.round, base_digest=DIGEST, n_samples=self.settings["n_samples"], local=local,
                      update=update, metrics=METRICS)
        return self._record({"type": "trained", "metrics": METRICS, "update": values(update)}, RoundTrained(job, saved))

    def evaluated(self, accuracy: float) -> list[Action]:
        return self._record({"type": "evaluated", "accuracy": accuracy},
                            FinalEvaluated(self._job(EvaluateFinal), accuracy))


def normalize(out: list[Action]) -> list[dict[str, Any]]:
    """What the engine answered, in order, in the scenario's terms: an update's frames as one entry (its blob id's
    random part, its chunking and its bytes left out: its meta and tensors are what count); Register's `software`
    as "*"."""
    entries: list[dict[str, Any]] = []
    frames: list[bytes] = []
    for i, action in enumerate(out):
        if isinstance(action, TrainRound | EvaluateFinal):
            sent = {name: getattr(action.info, name) for name in TRAINING_FIELDS
                    if getattr(action.info, name) is not None}
            entries.append({"job": "train" if isinstance(action, TrainRound) else "evaluate",
                            "round": action.info.round, "blob_id": action.info.blob_id,
                            **({"training": sent} if sent else {})})
        elif isinstance(action, CheckConditions):
            entries.append({"job": "check", "round": action.round})
        elif isinstance(action, Outgoing) and action.topic == TOPICS.update(DEVICE):
            frames.append(action.payload)
            assert not action.retain
            if i + 1 == len(out) or getattr(out[i + 1], "topic", None) != action.topic:
                entries.append(update_entry(frames))
                frames = []
        elif isinstance(action, Outgoing):
            shown = {"message": json.loads(action.payload)} if action.payload.startswith(b"{") else \
                {"text": action.payload.decode()}
            if action.topic == TOPICS.register(DEVICE):
                shown["message"]["software"] = "*"  # each agent names itself
            entries.append({"publish": action.topic, "retain": action.retain, **shown})
        else:
            raise TypeError(f"no scenario form for {action!r}")
    return entries


def update_entry(frames: list[bytes]) -> dict[str, Any]:
    parts = Reassembler(1 << 20)
    blob = [b for b in (parts.add(DEVICE, frame) for frame in frames) if b is not None]
    assert len(blob) == 1, "an update's frames make one blob"
    first = decode_chunk(frames[0])
    meta = first.meta
    return {"publish": TOPICS.update(DEVICE), "retain": False, "update": {
        "blob_id": f"r{meta['round']}-*", "meta": meta, "tensors": values(decode_shared(MANIFEST, blob[0].data))}}


# ------------------------------------------------------------ the scenarios


def join_and_rounds() -> Recorder:
    s = Recorder("A new device connects (presence online, Register), trains round 1 from its model's chunks and "
                 "sends the update; a re-published RoundInfo of round 1 sends the saved update again; round 2 is "
                 "trained on the next model.")
    s.connect()
    s.feed(round_info(1), *chunks(1))
    s.trained()
    s.later(30).feed(round_info(1))
    s.later(30).feed(round_info(2), *chunks(2))
    s.trained(0.5)
    return s


def restart_resends() -> Recorder:
    s = Recorder("After a restart (or a reload of the page) with round 1 trained and saved, the device registers "
                 "again and sends the saved update again once round 1's RoundInfo and model come: it trains "
                 "nothing twice.", saved=saved_round(1))
    s.connect()
    s.feed(round_info(1), *chunks(1))
    return s


def restart_mid_round() -> Recorder:
    s = Recorder("Restarted while round 2 was being trained (round 1 saved): the device takes round 2 up again "
                 "from its model and trains it.", saved=saved_round(1))
    s.connect()
    s.feed(round_info(2), *chunks(2))
    s.trained()
    return s


def stale_round_info() -> Recorder:
    s = Recorder("An open RoundInfo for a round before the one the device answered (a stale retained message) is "
                 "ignored; the round it answered is still answered.", saved=saved_round(2))
    s.connect()
    s.feed(round_info(1), *chunks(1))
    s.feed(round_info(2), *chunks(2))
    return s


def round_info_during_training() -> Recorder:
    s = Recorder("While round 2 trains, its RoundInfo comes again and so does a stale one of round 1 (the device "
                 "answered round 1 and is training round 2): neither asks for a second job nor moves the device "
                 "back to round 1; round 2's update goes once it is trained.", saved=saved_round(1))
    s.connect()
    s.feed(round_info(2), *chunks(2))
    s.feed(round_info(2), round_info(1))
    s.trained()
    s.feed(*chunks(1))
    return s


def round_moves_on_during_training() -> Recorder:
    s = Recorder("Round 2 opens while round 1 trains and its model arrives meanwhile: once round 1's update is sent, "
                 "round 2 is trained, one job at a time.")
    s.connect()
    s.feed(round_info(1), *chunks(1))
    s.feed(round_info(2), *chunks(2))
    s.trained()
    s.trained(0.5)
    return s


def finished_during_training() -> Recorder:
    s = Recorder("The run finishes while the last round trains: the update goes all the same, then the final model "
                 "is evaluated and the device stops; it ignores what comes after.")
    s.connect()
    s.feed(round_info(3), *chunks(3))
    final = {"state": "finished", "blob": blob_of(4), "blob_id": "final"}
    s.feed(round_info(3, **final))
    s.trained()
    s.feed(*chunks(3, blob=blob_of(4), blob_id="final"))
    s.evaluated(0.5)
    s.feed(round_info(3, **final), *chunks(3, blob=blob_of(4), blob_id="final"))
    return s


def selection() -> Recorder:
    s = Recorder("With selection, a device not invited stays quiet and subscribes to no model; a stale invitation "
                 "(for round 1, retained) changes nothing; the invitation for round 2 makes it fetch and train; an "
                 "invitation cleared before round 3's model came drops the model's subscription.",
                 saved=saved_round(1))
    s.connect()
    s.feed(round_info(2, selection="invited", next_selection_at=START + 300))
    s.feed(invitation(1))
    s.feed(invitation(2), *chunks(2))
    s.trained()
    s.feed(round_info(3, selection="invited", next_selection_at=START + 900), invitation(3))
    s.feed((TOPICS.invite(DEVICE), b""))
    return s


def async_versions() -> Recorder:
    s = Recorder("Asynchronous rounds (max_staleness): a RoundInfo of a newer version resends the saved update of "
                 "an earlier round it still takes, tagged with that round; a version out of the window resends "
                 "nothing; an update trained on a version that fell out of the window meanwhile is not sent.",
                 saved=saved_round(1))
    s.connect()
    s.feed(round_info(2, max_staleness=2))
    s.feed(round_info(2, max_staleness=2), *chunks(2))
    s.feed(round_info(5, rounds=9, max_staleness=2))
    s.trained()
    return s


def errors() -> Recorder:
    s = Recorder("Errors from the coordinator: unknown_device and bad_chunk for the saved round make the device "
                 "register and send its update again; another code, or one for another round, changes nothing; "
                 "digest_mismatch stops the agent.", saved=saved_round(1))
    s.connect()
    s.feed(round_info(1), *chunks(1))
    s.feed(error("unknown_device", 1), error("bad_chunk", 1), error("late_update", 1), error("unknown_device", 2))
    s.feed(error("digest_mismatch", 1))
    return s


def refusals() -> Recorder:
    forged = encode_shared(MANIFEST, model(9))
    corrupt = bytearray(chunks(1)[0][1])
    corrupt[-1] ^= 0xFF
    s = Recorder("Refused input asks for no work: a RoundInfo for another export, for a round beyond the run, with "
                 "an oversized model, or not JSON; a corrupt chunk; a complete blob under the round's id that is not "
                 "its sha256. The right model then trains and its update goes.")
    s.connect()
    s.feed(round_info(1, digest="0" * 64), round_info(4, rounds=3), round_info(1, blob=bytes(10**6)),
           (TOPICS.round, b"{not json"), (TOPICS.round, b'{"v":2}'))
    s.feed(round_info(1))
    s.feed((chunks(1)[0][0], bytes(corrupt)), *chunks(1, blob=forged))
    s.feed(*chunks(1))
    s.trained()
    return s


def coordinator_training() -> Recorder:
    s = Recorder("The coordinator sends round 1's training settings (lr, local epochs, batch size) with its RoundInfo: "
                 "the train job carries them; a RoundInfo whose lr is not > 0 is refused; round 2 comes without "
                 "settings, so its job carries none (the device's own flags).")
    s.connect()
    s.feed(round_info(1, lr=0.05, local_epochs=2, batch_size=16), *chunks(1))
    s.trained()
    s.feed(round_info(2, lr=-0.5), *chunks(2))
    s.feed(round_info(2, lr=0.0), *chunks(2))
    s.feed(round_info(2), *chunks(2))
    s.trained(0.5)
    return s


def presence() -> Recorder:
    s = Recorder("With conditions (fedper-agent's --only-when), presence follows the verdict: offline until first "
                 "checked, online once they hold; a round is checked for, a failed check publishes offline and backs "
                 "off (a tick before the back-off ends checks nothing), the check after it publishes online and the "
                 "round is trained; without conditions a device is online at once (the other scenarios).",
                 conditions=True)
    s.connect()
    s.checked(None)
    s.feed(round_info(1))
    s.checked("on battery")
    s.feed(*chunks(1))
    s.later(30).tick()
    s.later(31).tick()
    s.checked(None)
    s.trained()
    return s


SCENARIOS = {
    "join-and-rounds": join_and_rounds,
    "restart-resends": restart_resends,
    "restart-mid-round": restart_mid_round,
    "stale-round-info": stale_round_info,
    "round-info-during-training": round_info_during_training,
    "round-moves-on-during-training": round_moves_on_during_training,
    "finished-during-training": finished_during_training,
    "selection": selection,
    "async-versions": async_versions,
    "errors": errors,
    "refusals": refusals,
    "presence": presence,
    "coordinator-training": coordinator_training,
}


def write(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, make in SCENARIOS.items():
        (directory / f"{name}.json").write_text(json.dumps(make().scenario, indent=1) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "scenarios")
