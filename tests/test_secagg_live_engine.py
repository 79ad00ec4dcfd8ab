"""Secure aggregation wired through the engines without a broker: the coordinator's engine and the devices'
SecureParticipant exchange the exact payloads MQTT would carry, so selection, hostile messages, hostile devices
and failed sessions are checked in a second each (tests/test_secagg_live.py runs the same through Mosquitto).
"""

from __future__ import annotations

import base64
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.frames import chunks, to_json
from helpers.identities import write_identity, write_root
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Store
from fedper.edge.secure_round import SecureParticipant
from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.secagg import SecAggError
from fedper.wire import ERROR_CODES, SECAGG_DOWN, Outgoing, Register, RoundInfo, Topics, UpdateMeta, decode_secagg

TOPICS = Topics("lab")
CLIP = 4.0
MANIFEST = tiny_manifest()


class Fleet:
    """A coordinator engine and devices that answer its relayed stages; `silent` devices stop answering at a
    stage ("mask": they send no masked input; "unmask": no unmask answer); `liars` mask a vector of their own;
    `bad_sharers` send shares that do not authenticate."""

    def __init__(self, tmp_path: Path, devices: int, manifest: Manifest = MANIFEST,
                 tensors: Callable[[int], dict[str, np.ndarray]] | None = None, chunk_size: int = 40,
                 **config: object) -> None:
        """tensors(j): device j's update (j = -1: the round's model); default: the test vectors' tiny model."""
        tensors = tensors or (lambda j: tiny_tensors(0.0 if j < 0 else 0.1 * (j + 1) * (-1) ** j))
        self.manifest, self.model, self.chunk_size, self.tmp = manifest, tensors(-1), chunk_size, tmp_path
        root = Ed25519PrivateKey.generate()
        tmp_path.mkdir(parents=True, exist_ok=True)
        settings = {"rounds": 1, "min_clients": 2, "round_timeout": 100.0, "secure_aggregation": True,
                    "clip_norm": CLIP, "secagg_stage_timeout": 5.0,
                    "secagg_identity_root": str(write_root(tmp_path / "fleet-root.pub", root)), **config}
        self.coordinator = Coordinator(manifest, self.model, TOPICS, Config.of(**settings), Store(tmp_path / "state"))
        self.clip = float(settings["clip_norm"])  # type: ignore[arg-type]
        self.now = 1000.0
        self.names = [f"d{j}" for j in range(devices)]
        self.identities = {name: write_identity(tmp_path / f"id-{name}", root, TOPICS.fleet, name)
                           for name in self.names}
        self.n = {name: 10 * (j + 1) for j, name in enumerate(self.names)}
        self.updates = {name: tensors(j) for j, name in enumerate(self.names)}
        self.errors: list[tuple[str, dict]] = []
        self.silent: dict[str, str] = {}
        self.liars: dict[str, np.ndarray] = {}  # device -> the vector it masks instead of its clipped delta
        self.bad_sharers: set[str] = set()
        self.participants: dict[str, SecureParticipant] = {}
        self.latest: RoundInfo
        self.pending = self.coordinator.start(self.now)
        for name in self.names:
            self.send(TOPICS.presence(name), b"online")
            register = Register(self.n[name], manifest.base_digest, "test")
            self.send(TOPICS.register(name), register.encode())

    def send(self, topic: str, payload: bytes) -> list[Outgoing]:
        out = self.coordinator.handle(topic, payload, self.now)
        for message in out:
            parts = message.topic.split("/")
            if parts[3] == "error":
                self.errors.append((parts[4], json.loads(message.payload)))
            else:
                self.pending.append(message)
        return out

    def session(self) -> int:
        """The session of the newest RoundInfo the coordinator published."""
        self.pump(ticks=0)
        return int(self.latest.secagg_session or 0)

    def advertise(self, names: list[str]) -> None:
        session = self.session()
        for name in names:
            meta = UpdateMeta(round=self.latest.round, n_samples=self.n[name], base_digest=self.manifest.base_digest,
                              codec="secagg")
            self.participants[name] = SecureParticipant(
                TOPICS, name, self.latest.round, session, self.manifest, self.updates[name], self.model, self.n[name],
                meta, self.chunk_size, self.identities[name], self.tmp / f"state-{name}", self.latest.sha256)
            (self.tmp / f"state-{name}").mkdir(exist_ok=True)
            advert = self.participants[name].advertise()
            self.send(advert.topic, advert.payload)

    def pump(self, ticks: int = 1, step: float = 0.5) -> None:
        """Deliver what the coordinator published to the devices and their answers back, ticking between."""
        for _ in range(max(ticks, 1)):
            if ticks:
                self.pending += self.coordinator.tick(self.now)
            while self.pending:
                message = self.pending.pop(0)
                if message.topic == TOPICS.round:
                    self.latest = RoundInfo.decode(message.payload)
                parts = message.topic.split("/")
                if parts[3] != "relay" or parts[4] not in self.participants:
                    continue
                decoded = decode_secagg(message.payload, SECAGG_DOWN)
                if parts[4] in self.liars and decoded.stage == "mask":
                    self.lie(parts[4], decoded)
                    continue
                replies = self.participants[parts[4]].handle(decoded)
                if self.silent.get(parts[4]) == decoded.stage:
                    continue
                for reply in replies:
                    self.send(reply.topic, spoiled(reply.payload) if parts[4] in self.bad_sharers and
                              decoded.stage == "neighbours" else reply.payload)
            self.now += step if ticks else 0.0

    def lie(self, name: str, request) -> None:  # type: ignore[no-untyped-def]
        """A device with valid keys and shares that masks a vector of its choice (within the quantization
        range, beyond its clip norm) with the kernel, framed by hand."""
        participant = self.participants[name]
        client = participant.client
        assert client is not None
        masked = client.masked_input(request, self.liars[name])
        meta = {"round": participant.round, "n_samples": self.n[name], "base_digest": self.manifest.base_digest,
                "codec": "secagg"}
        for frame in chunks(masked.to_safetensors(), meta, blob_id="lie", chunk_size=self.chunk_size):
            self.send(TOPICS.update(name), frame)

    def record(self) -> dict:
        return json.loads((self.coordinator.store.dir / "metrics.jsonl").read_text().splitlines()[-1])

    def expected(self, names: list[str]) -> dict[str, np.ndarray]:
        deltas = {d: {k: self.updates[d][k].astype(np.float64) - self.model[k] for k in self.model} for d in names}
        total = sum(self.n[d] for d in names)
        out = {}
        for k in self.model:
            scaled = []
            for d in names:
                norm = np.sqrt(sum(float((v**2).sum()) for v in deltas[d].values()))
                scaled.append(self.n[d] * min(1.0, self.clip / norm) * deltas[d][k])
            out[k] = self.model[k] + sum(scaled) / total
        return out

    def assert_released(self, names: list[str]) -> None:
        assert self.coordinator.finished
        assert sorted(self.record()["devices"]) == sorted(names)
        for k, v in self.expected(names).items():
            np.testing.assert_allclose(self.coordinator.model[k], v, atol=1e-6)


def spoiled(payload: bytes) -> bytes:
    """A device's stage-2 shares with every ciphertext replaced by random bytes of the same size (hand-built JSON):
    well-formed, and authenticating at no neighbour."""
    body = json.loads(payload)
    body["shares"] = {k: base64.b64encode(random.randbytes(len(base64.b64decode(v)))).decode()
                      for k, v in body["shares"].items()}
    return to_json(body).encode()


def test_selection_refuses_the_uninvited_and_a_bad_masked_input_counts_as_a_dropout(tmp_path: Path) -> None:
    """Six devices, four invited: an uninvited one's keys are refused (not_invited). One invited device sends
    a masked input of the wrong length (hand-built frames): refused (secagg), it has dropped out at the
    stage's deadline, its pairwise masks are rebuilt and the sum is the other three's."""
    fleet = Fleet(tmp_path, 6, clients_per_round=4)
    fleet.pump()
    invited = sorted(fleet.coordinator.round.invited)
    outsider = next(name for name in fleet.names if name not in invited)
    fleet.advertise([outsider])
    assert fleet.errors[-1] == (outsider, {**fleet.errors[-1][1], "code": "not_invited"})
    cheat = invited[0]
    fleet.advertise(invited)
    fleet.silent[cheat] = "mask"  # its real masked input is not sent ...
    fleet.pump()
    masked = np.zeros(3, "<u4").tobytes()  # ... this one is: 3 values, the session sums 8
    header = to_json({"masked": {"dtype": "U32", "shape": [3], "data_offsets": [0, 12]},
                      "__metadata__": {"round": str(fleet.session()), "device": "0"}}).encode()
    header += b" " * (-len(header) % 8)
    meta = {"round": 1, "n_samples": fleet.n[cheat], "base_digest": MANIFEST.base_digest, "codec": "secagg"}
    for frame in chunks(len(header).to_bytes(8, "little") + header + masked, meta, blob_id="bad"):
        fleet.send(TOPICS.update(cheat), frame)
    assert fleet.errors[-1][0] == cheat and fleet.errors[-1][1]["code"] == "secagg", fleet.errors
    fleet.pump(ticks=30)
    fleet.assert_released([d for d in invited if d != cheat])


def test_mutated_stage_messages_are_answered_never_raised_and_the_round_still_closes(tmp_path: Path) -> None:
    """Every stage message of a real session, malformed (truncated, retyped, out of range, unknown stage, fields
    dropped, not base64, a share of the wrong size, a stranger's index, not UTF-8) and sent by a device of the
    session before the real one, is answered with a protocol error code, never `internal_error`, and changes
    nothing: the real messages that follow still close the round with the right sum. (Well-formed lies, such
    as shares that do not authenticate, are the tests below.)"""
    fleet = Fleet(tmp_path, 4)
    rng = random.Random(7)
    sent: list[tuple[str, bytes]] = []
    original = fleet.send

    def send_with_mutants(topic: str, payload: bytes) -> list[Outgoing]:
        if "/secagg/" in topic:
            sent.append((topic, payload))
            for mutant in mutants(payload, rng):
                errors = len(fleet.errors)
                original(topic, mutant)
                assert len(fleet.errors) == errors + 1, mutant  # answered
                assert fleet.coordinator.counters["internal_error"] == 0, (mutant, fleet.coordinator.counters)
        return original(topic, payload)

    fleet.send = send_with_mutants  # type: ignore[method-assign]
    fleet.advertise(fleet.names)
    fleet.pump(ticks=4)
    fleet.assert_released(fleet.names)
    stages = {json.loads(p)["stage"] for _, p in sent}
    assert stages == {"advertise", "shares", "received", "consistency", "unmask"}
    codes = {e["code"] for _, e in fleet.errors}
    assert codes and codes <= set(ERROR_CODES) - {"internal_error"}, codes


def mutants(payload: bytes, rng: random.Random) -> list[bytes]:
    body = json.loads(payload)
    out = [payload[: len(payload) // 2], payload + b"}", b"[]", b'{"v":1}',
           to_json({**body, "stage": "unmask-all"}).encode(), to_json({**body, "session": -1}).encode(),
           to_json({**body, "round": 2**63}).encode(), to_json({**body, "session": body["session"] + 1}).encode()]
    for key, value in body.items():
        if key in ("v", "stage"):
            continue
        out.append(to_json({k: v for k, v in body.items() if k != key}).encode())
        out.append(to_json({**body, key: "x" if not isinstance(value, str) else 7}).encode())
        if isinstance(value, dict) and value:
            first = next(iter(value))
            out.append(to_json({**body, key: {**value, first: value[first][:-4]}}).encode())  # a short share
            out.append(to_json({**body, key: {"99999": value[first], **value}}).encode())  # a stranger's index
            out.append(to_json({**body, key: {**value, first: value[first] + "!"}}).encode())  # not base64
        if isinstance(value, str):
            out.append(to_json({**body, key: value + "AAAA"}).encode())  # a key of 35 bytes
            out.append(to_json({**body, key: base64.b64encode(bytes(32)).decode()}).encode())  # a low-order point
    raw = bytearray(payload)
    for _ in range(3):
        raw[rng.randrange(len(raw))] = rng.randrange(0x80, 0x100)  # not UTF-8
        out.append(bytes(raw))
    return out


def test_too_many_devices_silent_in_the_unmask_stage_close_the_round_unchanged(tmp_path: Path) -> None:
    """Four devices (k 3, t 2): three of them go silent in the unmask stage, so one device's seed has a single
    share. Shares were revealed, so no new session opens in the round (a device answers one unmask request a
    round): the round closes at the stage's deadline with the model unchanged and says why."""
    fleet = Fleet(tmp_path, 4)
    fleet.advertise(fleet.names)
    for name in fleet.names[1:]:
        fleet.silent[name] = "unmask"
    fleet.pump(ticks=30)
    assert fleet.coordinator.finished and fleet.coordinator.strategy.failures == 0  # no second session
    assert "self-mask shares, 2 needed" in fleet.record()["secagg"]["sum_refused"]
    assert fleet.record()["devices"] == []
    for k, v in fleet.model.items():
        np.testing.assert_array_equal(fleet.coordinator.model[k], v)


def test_a_device_that_answered_an_unmask_request_takes_part_in_no_other_session_of_the_round(
        tmp_path: Path) -> None:
    """After a session in which they revealed shares, the devices refuse to advertise for another session of the
    same round (the mark is in their state directories, so a restart keeps it); the next round they take part."""
    fleet = Fleet(tmp_path, 3)
    fleet.advertise(fleet.names)
    fleet.pump(ticks=4)
    fleet.assert_released(fleet.names)
    for name, participant in fleet.participants.items():
        again = SecureParticipant(TOPICS, name, participant.round, participant.session + 1, fleet.manifest,
                                  fleet.updates[name], fleet.model, fleet.n[name], participant.meta, 40,
                                  fleet.identities[name], participant.state_dir, participant.model_sha256)
        with pytest.raises(SecAggError, match="revealed shares in round 1"):
            again.advertise()
        later = SecureParticipant(TOPICS, name, 2, 7, fleet.manifest, fleet.updates[name], fleet.model,
                                  fleet.n[name], participant.meta, 40, fleet.identities[name],
                                  participant.state_dir, "0" * 64)
        assert later.advertise().topic == TOPICS.secagg(name)


def test_a_coordinator_killed_once_it_asked_for_the_unmask_shares_releases_the_round_without_updates_at_start(
        tmp_path: Path) -> None:
    """The chaos soak's secure mode: the coordinator was killed after it asked for the unmask shares; the devices
    had revealed theirs, so they take part in no other session of the round, and the restarted coordinator ran
    new sessions of it for good (1 round in 1.5 minutes of faults, against 68 without). Now the round is on disk as
    unmasking before the requests go out, and a coordinator resumed in it releases it at start, the model
    unchanged and no device listed, and opens the next round, in which the same devices take part."""
    fleet = Fleet(tmp_path, 4, rounds=2)
    fleet.advertise(fleet.names)
    for name in fleet.names:
        fleet.silent[name] = "unmask"  # each reveals its shares (and marks its state directory); none arrives
    for _ in range(20):
        fleet.pump()
        if fleet.coordinator.strategy.session.stage == "unmask":
            break
    assert fleet.coordinator.strategy.session.stage == "unmask" and fleet.coordinator.round.number == 1
    settings = {"rounds": 2, "min_clients": 2, "round_timeout": 100.0, "secure_aggregation": True, "clip_norm": CLIP,
                "secagg_stage_timeout": 5.0, "secagg_identity_root": str(tmp_path / "fleet-root.pub")}
    fleet.coordinator = Coordinator(MANIFEST, fleet.model, TOPICS, Config.of(**settings), Store(tmp_path / "state"))
    fleet.pending = fleet.coordinator.start(fleet.now)  # the SIGKILLed process, restarted on its state directory
    assert fleet.coordinator.round.number == 2
    assert fleet.record()["round"] == 1 and fleet.record()["devices"] == [] and fleet.record()["secagg"]["abandoned"]
    for k, v in fleet.model.items():
        np.testing.assert_array_equal(fleet.coordinator.model[k], v)
    fleet.silent.clear()
    fleet.participants.clear()
    fleet.advertise(fleet.names)  # round 2: the devices advertise again, and the round closes with all four
    fleet.pump(ticks=30)
    assert fleet.coordinator.finished and sorted(fleet.record()["devices"]) == fleet.names


def test_a_device_whose_shares_do_not_authenticate_is_left_out_and_the_round_closes(tmp_path: Path) -> None:
    """d2 sends well-formed shares that authenticate nowhere (every round, as a hostile device would): its
    neighbours report it, it is left out of the session, and the round closes with the others' exact weighted
    mean; metrics.jsonl names it."""
    fleet = Fleet(tmp_path, 5)
    fleet.bad_sharers.add("d2")
    fleet.advertise(fleet.names)
    fleet.pump(ticks=4)
    fleet.assert_released(["d0", "d1", "d3", "d4"])
    assert fleet.record()["secagg"]["reported"] == ["d2"] and fleet.coordinator.strategy.failures == 0


def test_a_device_whose_input_spoils_the_sum_is_narrowed_down_and_excluded_while_training_goes_on(
        tmp_path: Path) -> None:
    """Ten devices, d7 masks the clip norm C in every value (beyond its L2 clip norm) every round. Round 1's sum
    fails its check; from round 2 the suspects are summed in halves with others up to --secagg-min-group 3, each
    passing group is released, and within ceil(log2 10) + 1 = 5 rounds d7 is the lone suspect and is excluded
    (its advertisements refused); the rounds after it release the other nine's exact weighted mean."""
    length = 64
    rng = np.random.default_rng(3)
    base = rng.normal(0, 1, length).astype(np.float32)

    def tensors(j: int) -> dict[str, np.ndarray]:
        shift = 0.0 if j < 0 else 0.4 / math.sqrt(length) * (j + 1)
        return {"w": (base + shift).astype(np.float32), "bn.running_mean": np.zeros(4, np.float32)}

    fleet = Fleet(tmp_path, 10, flat_manifest(length), tensors, 4096, clip_norm=1.0, rounds=8, secagg_min_group=3)
    fleet.liars["d7"] = np.full(length + 4, 1.0)
    records = []
    for _ in range(8):
        number = fleet.coordinator.round.number
        fleet.model = {k: v.copy() for k, v in fleet.coordinator.model.items()}
        fleet.updates = {name: {k: v + (fleet.model[k] - base if k == "w" else 0) for k, v in tensors(j).items()}
                         for j, name in enumerate(fleet.names)}
        fleet.participants.clear()
        fleet.advertise([n for n in fleet.names if n not in fleet.coordinator.strategy.excluded])
        if "d7" in fleet.coordinator.strategy.excluded:
            fleet.advertise(["d7"])  # refused: excluded
            assert fleet.errors[-1][0] == "d7" and "excluded" in fleet.errors[-1][1]["message"]
            fleet.participants.pop("d7")
        fleet.pump(ticks=4)
        assert fleet.coordinator.round.number == number + 1 or fleet.coordinator.finished
        records.append(fleet.record())
    excluded_at = next(i for i, r in enumerate(records) if r["secagg"]["excluded"] == ["d7"])
    assert excluded_at <= 4, [r["secagg"] for r in records]
    assert records[0]["secagg"]["sum_refused"] and not records[0]["devices"]
    assert all(len(r["secagg"]["groups"]) >= 2 and r["devices"] for r in records[1 : excluded_at + 1])
    assert all(min(g["devices"] for g in r["secagg"]["groups"]) >= 3 for r in records)
    for r in records[1:]:
        assert "d7" not in r["devices"]
    assert sorted(records[-1]["devices"]) == sorted(n for n in fleet.names if n != "d7")
    honest = [n for n in fleet.names if n != "d7"]  # the last round: its model + the honest nine's weighted mean
    for k, v in fleet.expected(honest).items():
        np.testing.assert_allclose(fleet.coordinator.model[k], v, atol=1e-5)


def flat_manifest(length: int) -> Manifest:
    """One trainable shared tensor of `length` values, one BatchNorm statistic (shared, not trainable), a head."""
    info = ModelInfo("flat", kp=1, num_classes=1, input_shape=(1, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper", tensors=(
        TensorSpec("w", (length,), "float32", "base", True, shared=True),
        TensorSpec("bn.running_mean", (4,), "float32", "base", False, shared=True),
        TensorSpec("head", (1,), "float32", "head", True, shared=False)))


def test_distributed_dp_noise_sums_to_z_c_over_m_and_the_accountant_counts_the_contributors(tmp_path: Path) -> None:
    """--dp-noise-multiplier 1 with --secure-aggregation, five devices (m = 5): each adds noise of std
    z*C/sqrt(5) to its clipped delta of the trainable tensor, so the released mean is the clipped deltas' sum
    over m plus noise of std z*C/m (measured over 20,000 values); the BatchNorm statistic stays the round
    model's; the accountant records z. With one device gone after sharing its keys, the noise of the four
    left has std z*C*sqrt(4/5) on the sum, and the accountant records that multiplier, not z."""
    length, clip, z = 20_000, 1.0, 1.0
    rng = np.random.default_rng(5)
    base = rng.normal(0, 1, length).astype(np.float32)
    deltas = [rng.normal(0, s / math.sqrt(length), length) for s in (0.3, 0.6, 2.0, 3.0, 0.8)]

    def tensors(j: int) -> dict[str, np.ndarray]:
        w = base if j < 0 else (base + deltas[j]).astype(np.float32)
        return {"w": w, "bn.running_mean": np.full(4, 0.5 if j < 0 else float(j), np.float32)}

    for silent, expected_z in ((None, z), ("d4", z * math.sqrt(4 / 5))):
        fleet = Fleet(tmp_path / f"silent-{silent}", 5, flat_manifest(length), tensors, 16_384, clip_norm=clip,
                      dp_noise_multiplier=z, dp_delta=1e-3)
        fleet.advertise(fleet.names)
        if silent:
            fleet.silent[silent] = "mask"
        fleet.pump(ticks=30)
        assert fleet.coordinator.finished
        contributors = [j for j, name in enumerate(fleet.names) if name != silent]
        clipped = sum((tensors(j)["w"].astype(np.float64) - base) * min(1.0, clip / float(np.linalg.norm(
            tensors(j)["w"].astype(np.float64) - base))) for j in contributors)
        noise = fleet.coordinator.model["w"].astype(np.float64) - (base + clipped / 5)
        target = expected_z * clip / 5
        assert abs(float(noise.std()) / target - 1) < 0.03, (float(noise.std()), target)
        assert abs(float(noise.mean())) < 4 * target / math.sqrt(length)
        assert np.array_equal(fleet.coordinator.model["bn.running_mean"], tensors(-1)["bn.running_mean"])
        record = json.loads((fleet.coordinator.store.dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert math.isclose(record["dp"]["noise_multiplier"], expected_z, rel_tol=1e-9), record["dp"]
        assert record["dp"]["expected_participants"] == 5 and record["dp"]["epsilon"] > 0


def test_a_device_sending_values_beyond_its_clip_norm_is_caught_by_the_check_on_the_sum(tmp_path: Path) -> None:
    """The coordinator cannot check one masked input's norm, but it checks the sum's: d1 masks C in every value
    (inside the quantization range, an L2 norm of C * sqrt(1000)), so the weighted mean's norm passes what
    devices clipped to C can give; the round closes with the model unchanged and says why."""
    length = 1000
    rng = np.random.default_rng(3)
    base = rng.normal(0, 1, length).astype(np.float32)

    def tensors(j: int) -> dict[str, np.ndarray]:
        shift = 0.0 if j < 0 else 0.5 / math.sqrt(length) * (j + 1)
        return {"w": (base + shift).astype(np.float32), "bn.running_mean": np.zeros(4, np.float32)}

    fleet = Fleet(tmp_path, 4, flat_manifest(length), tensors, 4096, clip_norm=1.0)
    fleet.liars["d1"] = np.full(length + 4, 1.0)
    fleet.advertise(fleet.names)
    fleet.pump(ticks=4)
    assert fleet.coordinator.finished
    record = fleet.record()
    assert "beyond its clip norm" in record["secagg"]["sum_refused"], record
    assert np.array_equal(fleet.coordinator.model["w"], base)


@pytest.mark.parametrize("degree", [1, 3, 7])
def test_an_odd_or_too_small_degree_is_refused_at_start(tmp_path: Path, degree: int) -> None:
    """A k-regular neighbour graph needs an even k: an odd one would fail when the first session closes."""
    with pytest.raises(ValueError, match="must be an even number"):
        Fleet(tmp_path, 4, secagg_degree=degree)
