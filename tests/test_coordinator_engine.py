"""The coordinator's round state machine, driven directly with protocol messages and a fake clock."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.frames import chunks, safetensors
from helpers.legacy_state import earlier_layout, rewrite_as_earlier
from helpers.toy_export import write_toy_export
from safetensors.numpy import load_file
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Registration, Store
from fedper.payload import encode_shared
from fedper.wire import ErrorMessage, Register, RoundInfo, Topics, UpdateMeta, chunk

MANIFEST = tiny_manifest()
TOPICS = Topics("lab")


def make(tmp_path: Path, **config) -> Coordinator:  # type: ignore[no-untyped-def]
    settings = {"rounds": 2, "min_clients": 2, "round_timeout": 10.0, "chunk_size": 50, **config}
    return Coordinator(MANIFEST, tiny_tensors(), TOPICS, Config.of(**settings), Store(tmp_path))


def register(c: Coordinator, device: str, n: int, digest: str = MANIFEST.base_digest) -> list:
    return c.handle(TOPICS.register(device), Register(n, digest, "test/1").encode(), 0.0)


def send(c: Coordinator, device: str, tensors: dict, n: int, round_: int | None = None, blob_id: str = "u",
         digest: str = MANIFEST.base_digest, now: float = 1.0, codec: str = "fp32") -> list:
    meta = UpdateMeta(c.round.number if round_ is None else round_, n, digest, {"accuracy": n / 100}, codec)
    out = []
    for frame in chunk(encode_shared(MANIFEST, tensors, codec, base=c.model), 40, blob_id, meta.to_dict()):
        out += c.handle(TOPICS.update(device), frame, now)
    return out


def errors(out: list) -> list[str]:
    return [ErrorMessage.decode(m.payload).code for m in out if "/error/" in m.topic]


def shifted(delta: float) -> dict[str, np.ndarray]:
    return {k: (v + np.float32(delta)).astype(np.float32) for k, v in tiny_tensors().items()}


def test_round_aggregates_n_weighted_and_checkpoints(tmp_path: Path) -> None:
    c = make(tmp_path)
    out = c.start(0.0)
    info = RoundInfo.decode(next(m.payload for m in out if m.topic == TOPICS.round))
    assert (info.round, info.state, info.blob_id) == (1, "open", "r1")
    model_chunks = [m for m in out if "/model/r1/" in m.topic]
    assert len(model_chunks) == info.count > 1 and all(m.retain for m in model_chunks)
    register(c, "a", 10)
    register(c, "b", 30)
    assert send(c, "a", shifted(1.0), 10) == [] and c.tick(2.0)[0].topic == TOPICS.state  # still waiting for b
    send(c, "b", shifted(3.0), 30)
    out = c.tick(3.0)
    assert c.round.number == 2
    expected = {k: (v * 10 + shifted(3.0)[k] * 30) / 40 for k, v in shifted(1.0).items()}
    for name, value in expected.items():
        np.testing.assert_allclose(c.model[name], value, rtol=1e-6)
    assert any("/model/r1/" in m.topic and m.payload == b"" for m in out)  # old retained chunks cleared
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["round"] == 1 and record["participants"] == 2 and record["n_samples"] == 40
    assert record["accuracy_mean"] == pytest.approx(0.2) and record["accuracy_std"] == pytest.approx(0.1)
    assert record["bytes_received"] > 0 and "aggregate_s" in record
    send(c, "a", shifted(1.0), 10)
    send(c, "b", shifted(1.0), 30)
    c.tick(4.0)
    assert c.finished and (tmp_path / "final.safetensors").exists()
    final = RoundInfo.decode(next(m.payload for m in c.announce(5.0) if m.topic == TOPICS.round))
    assert (final.state, final.blob_id) == ("finished", "final")


@pytest.mark.parametrize("case", ["unknown", "late", "future", "duplicate", "digest", "nan", "shape", "dtype",
                                  "corrupt", "oversized", "garbage", "zero_n", "other_n", "bad_meta"])
def test_bad_updates_are_counted_answered_and_never_aggregated(tmp_path: Path, case: str) -> None:
    c = make(tmp_path, min_clients=1)
    c.start(0.0)
    register(c, "a", 10)
    if case == "duplicate":
        send(c, "a", shifted(1.0), 10)
    tensors, device = shifted(1.0), "a"
    code = {"unknown": "unknown_device", "late": "late_update", "future": "late_update", "duplicate":
            "duplicate_update", "digest": "digest_mismatch", "nan": "bad_tensors", "shape": "bad_tensors",
            "dtype": "bad_tensors", "corrupt": "bad_chunk", "oversized": "bad_chunk", "garbage": "bad_chunk",
            "zero_n": "bad_message", "other_n": "n_samples_mismatch", "bad_meta": "bad_message"}[case]
    # The hostile frames are written by hand (tests/helpers/frames.py), not with fedper.wire's encoder.
    honest_meta = {"round": 1, "n_samples": 10, "base_digest": MANIFEST.base_digest, "metrics": {"accuracy": 0.1}}
    blob = safetensors(tensors)
    if case in ("nan", "shape", "dtype", "oversized", "bad_meta"):
        from safetensors.numpy import save

        bad = {"nan": {**tensors, "stem.bias": np.array([np.inf, 0], np.float32)},
               "shape": {**tensors, "stem.bias": np.zeros(3, np.float32)},
               "dtype": {**tensors, "stem.bias": np.zeros(2, np.float16)},
               "oversized": {**tensors, "extra": np.zeros(10_000, np.float32)}}.get(case, tensors)
        frames = chunks(save(bad), {**honest_meta, "n_samples": "ten"} if case == "bad_meta" else honest_meta, "u", 40)
    elif case in ("corrupt", "garbage"):
        frames = chunks(blob, honest_meta, "u", 40)
        frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 1]) if case == "corrupt" else b"\x00garbage"
    else:
        if case == "unknown":
            device = "stranger"
        changes = {"late": {"round": 0}, "future": {"round": 7}, "digest": {"base_digest": "sha256:other"},
                   "zero_n": {"n_samples": 0}, "other_n": {"n_samples": 11}}.get(case, {})
        frames = chunks(blob, {**honest_meta, **changes}, "u2", 40)
    out = [m for f in frames for m in c.handle(TOPICS.update(device), f, 1.0)]
    before = {k: v.copy() for k, v in c.model.items()}
    assert errors(out) == [code]  # answered once per blob, not once per chunk
    assert c.counters[code] == 1 and c.counters["accepted"] == (1 if case == "duplicate" else 0)
    c.tick(100.0)
    if case != "duplicate":
        assert c.round.number == 1  # nothing accepted: the round cannot close
        for k in before:
            np.testing.assert_array_equal(c.model[k], before[k])
    state = json.loads(c.state_message(101.0).payload)
    assert state["counters"][code] == 1


def test_int8_delta_updates_are_decoded_against_the_rounds_model_also_after_a_restart(tmp_path: Path) -> None:
    """The coordinator decodes an int8-delta update against the model of the open round, the one
    the device trained from; a restart re-reads the checkpointed blob against the same model."""
    c = make(tmp_path)
    c.start(0.0)
    register(c, "a", 10)
    register(c, "b", 30)
    assert send(c, "a", shifted(1e-3), 10, codec="int8-delta") == []
    del c  # killed with a's update checkpointed as its blob
    c = make(tmp_path)
    c.start(5.0)
    send(c, "b", shifted(3e-3), 30, now=6.0, codec="int8-delta")
    c.tick(7.0)
    assert c.round.number == 2 and c.counters["accepted"] == 2
    for name, value in tiny_tensors().items():
        expected = value + np.float32((10 * 1e-3 + 30 * 3e-3) / 40)
        np.testing.assert_allclose(c.model[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)


def test_registration_digest_mismatch_is_answered(tmp_path: Path) -> None:
    c = make(tmp_path)
    c.start(0.0)
    assert errors(register(c, "a", 5, digest="sha256:other")) == ["digest_mismatch"]
    assert "a" not in c.registered
    assert c.handle("fedper/v1/lab/register/a", b"not json", 0.0)[0].topic == TOPICS.error("a")
    assert c.handle("fedper/v1/other/register/a", b"{}", 0.0) == []  # another fleet's topic: counted only
    assert c.counters["bad_message"] == 2


def test_restart_keeps_accepted_updates_exactly_once(tmp_path: Path) -> None:
    c = make(tmp_path)
    c.start(0.0)
    register(c, "a", 10)
    register(c, "b", 30)
    send(c, "a", shifted(1.0), 10)
    del c  # killed: only the state directory survives
    c = make(tmp_path)
    c.start(50.0)
    assert c.round.number == 1 and set(c.round.folded) == {"a"} and set(c.registered) == {"a", "b"}
    assert errors(send(c, "a", shifted(5.0), 10, now=51.0)) == ["duplicate_update"]
    send(c, "b", shifted(3.0), 30, now=51.0)
    c.tick(52.0)
    expected = {k: (v * 10 + shifted(3.0)[k] * 30) / 40 for k, v in shifted(1.0).items()}
    for name, value in expected.items():
        np.testing.assert_allclose(c.model[name], value, rtol=1e-6)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model-r2.safetensors"]


@pytest.mark.parametrize("earlier", [False, True])
def test_restart_between_partial_checkpoints_folds_the_partial_and_the_blobs_after_it(tmp_path: Path,
                                                                                    earlier: bool) -> None:
    """Updates are checkpointed as their blobs, and every PARTIAL_EVERY as the float64 running sum that
    replaces the blobs it covers: a kill between two partials loses and doubles nothing, and the
    model is bit for bit what a run without the kill computes; also from state.json as the release before
    the versioned record wrote it (`earlier`)."""
    from fedper.coordinator.strategies.mean import PARTIAL_EVERY

    devices = [f"d{i}" for i in range(PARTIAL_EVERY + 3)]
    unbroken = make(tmp_path / "unbroken")
    c = make(tmp_path)
    for coordinator in (c, unbroken):
        coordinator.start(0.0)
        for i, d in enumerate(devices):
            register(coordinator, d, 10 + i)
        for i, d in enumerate(devices[:-1]):
            send(coordinator, d, shifted(float(i)), 10 + i)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model-r1.safetensors", f"partial-r1-{PARTIAL_EVERY}.safetensors"]
    kept = json.loads((tmp_path / "state.json").read_text())["strategy"]["updates"]  # after the partial, in slots
    assert {d: slot["file"] for d, slot in kept.items()} == {d: f"slot-{i}.bin"
                                                             for i, d in enumerate(devices[PARTIAL_EVERY:-1])}
    del c  # killed: only the state directory survives
    if earlier:
        rewrite_as_earlier(tmp_path)
    c = make(tmp_path)
    c.start(50.0)
    assert set(c.round.folded) == set(devices[:-1])
    assert errors(send(c, devices[0], shifted(9.0), 10, now=51.0)) == ["duplicate_update"]
    send(c, devices[-1], shifted(float(len(devices) - 1)), 10 + len(devices) - 1, now=51.0)
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 2  # migrated by its first commit
    c.tick(52.0)
    send(unbroken, devices[-1], shifted(float(len(devices) - 1)), 10 + len(devices) - 1, now=51.0)
    unbroken.tick(52.0)
    assert c.round.number == unbroken.round.number == 2
    weights = [10 + i for i in range(len(devices))]
    for name, value in tiny_tensors().items():
        expected = sum(w * (value + np.float32(i)) for i, w in enumerate(weights)) / sum(weights)
        np.testing.assert_allclose(c.model[name], expected, rtol=1e-6)
        assert np.array_equal(c.model[name], unbroken.model[name]), name
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model-r2.safetensors"]


def test_tensor_files_are_safetensors_written_without_a_joined_copy(tmp_path: Path) -> None:
    """The store writes safetensors itself (header, then each array's memory): safetensors must read
    back every shape, dtype and layout the coordinator can hand it, byte for byte."""
    rng = np.random.default_rng(0)
    tensors = {"f64": rng.standard_normal((3, 4)), "transposed": rng.standard_normal((5, 2)).astype(np.float32).T,
               "scalar": np.array(7, np.int64), "empty": np.zeros((0, 3), np.float32),
               "big_endian": np.arange(4, dtype=">f4"), "half": np.arange(3, dtype=np.float16),
               "count": np.array([3], np.uint8)}
    name = Store(tmp_path).write_tensors("t.safetensors", tensors)
    back = load_file(str(tmp_path / name))
    assert set(back) == set(tensors)
    for key, value in tensors.items():
        assert back[key].shape == value.shape and back[key].dtype == value.dtype.newbyteorder("<"), key
        assert np.array_equal(back[key], value), key


def test_deadline_closes_with_quorum_and_extends_without(tmp_path: Path) -> None:
    c = make(tmp_path, min_clients=2, round_timeout=5.0)
    c.start(0.0)
    for d, n in (("a", 10), ("b", 10), ("silent", 10)):
        register(c, d, n)
    send(c, "a", shifted(1.0), 10)
    out = c.tick(6.0)  # deadline passed with 1 < 2 updates: extended, announced
    assert c.round.number == 1 and c.round.extensions == 1
    assert RoundInfo.decode(next(m.payload for m in out if m.topic == TOPICS.round)).deadline == 11.0
    send(c, "b", shifted(3.0), 10)
    assert c.tick(7.0) == [] or c.round.number == 1  # quorum, but the extended deadline is not yet over
    c.tick(11.5)
    assert c.round.number == 2
    c.handle(TOPICS.register("silent"), b"", 12.0)  # it cleared its retained registration: it left
    assert set(c.registered) == {"a", "b"}
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["participants"] == 2 and record["deadline_extensions"] == 1 and record["registered"] == 3


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean"])
def test_robust_aggregators_resist_an_outlier_and_survive_restart(tmp_path: Path, aggregator: str) -> None:
    c = make(tmp_path, aggregator=aggregator, min_clients=5, rounds=1)
    c.start(0.0)
    for i, delta in enumerate([1.0, 1.1, 0.9, 1.05, 1e6]):
        register(c, f"d{i}", 10)
        send(c, f"d{i}", shifted(delta), 10)
        if i == 2:
            c = make(tmp_path, aggregator=aggregator, min_clients=5, rounds=1)
            c.start(0.0)
    c.tick(1.0)
    assert c.finished
    assert np.abs(c.model["stem.bias"] - shifted(1.0)["stem.bias"]).max() < 0.2


@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_clip_norm_bounds_each_update_also_across_a_restart(tmp_path: Path, aggregator: str) -> None:
    c = make(tmp_path, min_clients=1, rounds=1, clip_norm=1.0, aggregator=aggregator)
    c.start(0.0)
    register(c, "a", 10)
    send(c, "a", shifted(100.0), 10)
    c = make(tmp_path, min_clients=1, rounds=1, clip_norm=1.0, aggregator=aggregator)
    c.start(0.5)
    c.tick(1.0)
    delta = np.concatenate([(c.model[k] - v).ravel() for k, v in tiny_tensors().items()])
    assert np.linalg.norm(delta) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("args, message", [
    ([], "no manifest.json"),
    (["--embedded-broker", "--broker", "mqtt://x"], "exactly one of"),
    (["--aggregator", "mode", "--broker", "mqtt://x"], "--aggregator"),
    (["--broker", "http://x"], "broker URL"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from fedper.coordinator.cli import app

    artifacts = tmp_path / "export"
    artifacts.mkdir()
    if args:
        write_toy_export(artifacts, MANIFEST, tiny_tensors())
    result = CliRunner().invoke(app, ["--artifacts", str(artifacts), "--fleet", "lab", "--rounds", "1",
                                      "--state-dir", str(tmp_path / "s"), *(args or ["--broker", "mqtt://x"])])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_restart_after_the_last_round_only_reannounces_and_other_exports_are_refused(tmp_path: Path) -> None:
    c = make(tmp_path, min_clients=1, rounds=1)
    c.start(0.0)
    register(c, "a", 10)
    send(c, "a", shifted(1.0), 10)
    c.tick(1.0)
    again = make(tmp_path, min_clients=1, rounds=1)
    assert again.finished
    info = RoundInfo.decode(next(m.payload for m in again.start(2.0) if m.topic == TOPICS.round))
    assert (info.state, info.blob_id) == ("finished", "final")
    from dataclasses import replace

    other = replace(MANIFEST, tensors=MANIFEST.tensors[1:])
    with pytest.raises(ValueError, match="another export"):
        Coordinator(other, {"stem.bias": tiny_tensors()["stem.bias"]}, TOPICS, Config.of(rounds=1), Store(tmp_path))


def test_arbitrary_messages_never_raise_or_change_the_model(tmp_path: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    c = make(tmp_path, min_clients=1)
    c.start(0.0)
    register(c, "a", 10)
    frames = chunk(encode_shared(MANIFEST, shifted(1.0)), 40, "u", UpdateMeta(1, 10, MANIFEST.base_digest).to_dict())
    before = {k: v.copy() for k, v in c.model.items()}
    kinds = st.sampled_from(["register", "update", "presence", "round", "error"])
    devices = st.sampled_from(["a", "b", "+", ""])
    payloads = st.one_of(st.binary(max_size=300), st.sampled_from(frames).flatmap(
        lambda f: st.integers(0, len(f)).map(lambda i: f[:i] + f[i + 1 :])))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(kind=kinds, device=devices, payload=payloads)
    def fuzz(kind: str, device: str, payload: bytes) -> None:
        c.handle(f"fedper/v1/lab/{kind}/{device}", payload, 1.0)

    fuzz()
    c.tick(1.0)
    assert c.round.number == 1 and c.counters["accepted"] == 0 and c.counters["internal_error"] == 0
    for k in before:
        np.testing.assert_array_equal(c.model[k], before[k])


# ---------------------------------------------------------------- selection (--clients-per-round, issue 17)
# Update frames, registrations and presence are built by hand (tests/test_untrusted_engine.py's helpers).


def fleet(c: Coordinator, devices: list[str], online: bool = True, now: float = 0.0) -> None:
    """Register each device by hand (section 6.1) and publish its presence (section 6.2)."""
    from test_untrusted_engine import registration

    for device in devices:
        c.handle(f"fedper/v1/lab/register/{device}", registration(10), now)
        if online:
            c.handle(f"fedper/v1/lab/presence/{device}", b"online", now)


def upload(c: Coordinator, device: str, frames: int | None = None, now: float = 1.0, blob_id: str = "u1") -> list:
    """The device's hand-built update for the open round, all of its chunk frames or the first `frames`."""
    from test_untrusted_engine import meta

    payloads = chunks(safetensors(shifted(1.0)), meta(10, c.round.number), blob_id, chunk_size=16)
    assert len(payloads) > 2
    out = []
    for payload in payloads[:frames]:
        out += c.handle(f"fedper/v1/lab/update/{device}", payload, now)
    return out


def invited_in(out: list) -> dict[str, dict]:
    """device -> its invitation (parsed by hand) among published messages; b"" for a cleared one."""
    prefix = "fedper/v1/lab/invite/"
    return {m.topic[len(prefix):]: json.loads(m.payload) if m.payload else b""
            for m in out if m.topic.startswith(prefix)}


def round_info(out: list) -> dict:
    return json.loads(next(m.payload for m in out if m.topic == TOPICS.round))


DEVICES = [f"d{i:02d}" for i in range(20)]


def test_selection_invites_ceil_f_m_online_registered_devices_by_the_seeded_rule(tmp_path: Path) -> None:
    from fedper.selection import select

    c = make(tmp_path / "a", clients_per_round=4, over_select=1.3, min_clients=1, selection_seed=5)
    fleet(c, DEVICES[:15])
    fleet(c, DEVICES[15:], online=False)  # registered, not online: never invited
    c.handle("fedper/v1/lab/presence/stranger", b"online", 0.0)  # online, not registered: never invited
    out = c.start(0.0)
    invitations = invited_in(out)
    assert sorted(invitations) == sorted(select(DEVICES[:15], 6, seed=5, round_=1))  # ceil(1.3 * 4) = 6
    assert all(body == {"v": 1, "round": 1} for body in invitations.values())
    assert all(m.retain and m.qos == 1 for m in out if "/invite/" in m.topic)
    info = round_info(out)
    assert info["selection"] == "invited" and info["next_selection_at"] == info["deadline"] == 10.0
    state = json.loads((tmp_path / "a" / "state.json").read_text())
    assert state["round"]["selection"] == {"seed": 5, "invite_cap": 6, "invited": sorted(invitations)}
    again = make(tmp_path / "b", clients_per_round=4, over_select=1.3, min_clients=1, selection_seed=5)
    fleet(again, DEVICES[15:], online=False)
    fleet(again, list(reversed(DEVICES[:15])))  # in another order
    assert invited_in(again.start(0.0)) == invitations  # same seed, same online fleet: same invitations
    other = make(tmp_path / "c", clients_per_round=4, over_select=1.3, min_clients=1, selection_seed=6)
    fleet(other, DEVICES[:15])
    assert invited_in(other.start(0.0)).keys() != invitations.keys()


def test_a_restarted_coordinator_keeps_the_rounds_invitations(tmp_path: Path) -> None:
    c = make(tmp_path, clients_per_round=3, min_clients=1)
    fleet(c, DEVICES)
    invitations = invited_in(c.start(0.0))
    assert len(invitations) == 3
    assert upload(c, sorted(invitations)[0]) == []
    del c  # killed
    c = make(tmp_path, clients_per_round=3, min_clients=1, selection_seed=99)  # another seed: the open round keeps
    out = c.start(50.0)  # its invitations (the devices' retained presence has not come back yet)
    assert invited_in(out) == invitations and c.round.invited == set(invitations)  # re-published, same ones
    fleet(c, DEVICES, now=51.0)
    assert invited_in(c.tick(51.0)) == {}  # the round is full: nobody else invited
    assert errors(upload(c, sorted(invitations)[0], now=52.0)) == ["duplicate_update"]
    outsider = next(d for d in DEVICES if d not in invitations)
    assert errors(upload(c, outsider, now=52.0)) == ["not_invited"]


def test_an_update_from_a_device_not_invited_is_refused_at_its_first_chunk_without_reassembly(tmp_path: Path) -> None:
    c = make(tmp_path, clients_per_round=2, min_clients=1)
    fleet(c, DEVICES[:6])
    invitations = invited_in(c.start(0.0))
    outsider = next(d for d in DEVICES[:6] if d not in invitations)
    out = upload(c, outsider, frames=1)
    assert errors(out) == ["not_invited"] and out[0].topic == TOPICS.error(outsider)
    assert len(c._intake.reassembler) == 0 and c._intake.reassembler.bytes == 0  # nothing held for it
    assert upload(c, outsider) == []  # the rest of the refused blob: dropped unanswered, one answer per blob
    assert c.counters["not_invited"] == 1 and c.round.rejected["not_invited"] == 1 and not c.round.folded
    upload(c, sorted(invitations)[0], frames=1)
    assert len(c._intake.reassembler) == 1  # an invited device's first chunk is reassembled: the check above can fail
    assert "`not_invited`" in (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()


def test_the_round_closes_at_m_accepted_updates_and_clears_its_invitations(tmp_path: Path) -> None:
    c = make(tmp_path, clients_per_round=2, over_select=1.5, min_clients=1, round_timeout=100.0)
    fleet(c, DEVICES[:10])
    first = invited_in(c.start(0.0))
    assert len(first) == 3  # over-selected: ceil(1.5 * 2)
    answering = sorted(first)[:2]
    upload(c, answering[0])
    assert all(m.topic == TOPICS.state for m in c.tick(2.0)) and c.round.number == 1  # 1 < M
    upload(c, answering[1])
    out = c.tick(3.0)  # M accepted, long before the deadline: closed
    assert c.round.number == 2
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["participants"] == 2 and record["invited"] == 3 and record["devices"] == answering
    second = {d: body for d, body in invited_in(out).items() if body}
    cleared = {d for d, body in invited_in(out).items() if body == b""}
    assert len(second) == 3 and all(body == {"v": 1, "round": 2} for body in second.values())
    assert cleared == set(first) - set(second)  # the closed round's retained invitations, where not renewed
    assert round_info(out)["round"] == 2 and round_info(out)["next_selection_at"] == 103.0
    assert json.loads(c.state_message(3.0).payload)["invited"] == 3


def test_without_a_seed_the_ranking_is_a_fresh_secret_and_dp_refuses_a_chosen_one(tmp_path: Path) -> None:
    """Issue 26: the default seed was a public 0, so the ids alone told every device its future rounds."""
    from fedper.selection import check_seed, select

    seeds = []
    for name in ("a", "b"):
        c = make(tmp_path / name, clients_per_round=3, min_clients=1)
        fleet(c, DEVICES)
        invited = sorted(invited_in(c.start(0.0)))
        seeds.append(json.loads((tmp_path / name / "state.json").read_text())["round"]["selection"]["seed"])
        assert check_seed(seeds[-1]) and invited == sorted(select(DEVICES, 3, seed=seeds[-1], round_=1))
    assert seeds[0] != seeds[1]  # drawn per coordinator with `secrets`, in its state only
    with pytest.raises(ValueError, match="secret"):
        make(tmp_path / "dp", clients_per_round=3, min_clients=1, selection_seed=5, dp_noise_multiplier=1.0,
             clip_norm=1.0)


def test_devices_that_come_online_top_the_round_up_to_its_invitations(tmp_path: Path) -> None:
    from fedper.selection import select

    c = make(tmp_path, clients_per_round=3, min_clients=1, selection_seed=11)
    fleet(c, DEVICES[:1])
    assert sorted(invited_in(c.start(0.0))) == DEVICES[:1]  # fewer online than invitations: those there are
    fleet(c, DEVICES[1:8], now=1.0)  # come online within one interval: ranked together
    topped = invited_in(c.tick(1.0))
    assert sorted(topped) == sorted(select(DEVICES[1:8], 2, seed=11, round_=1))
    fleet(c, DEVICES[8:], now=2.0)
    assert invited_in(c.tick(2.0)) == {} and len(c.round.invited) == 3  # full
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["round"]["selection"]["invited"] == sorted(c.round.invited)  # checkpointed before sent


def test_dropouts_are_replaced_at_once_and_an_extension_replaces_every_invitation_not_delivered(tmp_path: Path) -> None:
    """An invited device that goes offline (it declined, or dropped out) is replaced at the next top-up; when
    the deadline passes below --min-clients, every invitation not delivered lapses and as many new devices are
    invited. A lapsed device stays invited: its update is accepted if it comes."""
    from fedper.selection import select

    c = make(tmp_path, clients_per_round=3, min_clients=2, round_timeout=5.0, selection_seed=11)
    fleet(c, DEVICES[:3])
    invitations = sorted(invited_in(c.start(0.0)))
    assert invitations == DEVICES[:3]
    upload(c, invitations[0])
    for dropout in invitations[1:]:
        c.handle(f"fedper/v1/lab/presence/{dropout}", b"offline", 2.0)
    fleet(c, DEVICES[3:5], now=2.0)
    assert sorted(invited_in(c.tick(2.0))) == DEVICES[3:5]  # in place of the two dropouts, at once
    fleet(c, DEVICES[5:9], now=3.0)
    assert invited_in(c.tick(3.0)) == {}  # 3 live invitations: no room
    out = c.tick(6.0)  # 1 < --min-clients 2: extended; d03 and d04 sent nothing: two more in their place
    assert c.round.extensions == 1 and round_info(out)["deadline"] == 11.0
    assert sorted(invited_in(out)) == sorted(select(DEVICES[5:9], 2, seed=11, round_=1))
    upload(c, DEVICES[3], now=7.0)  # lapsed, still invited: accepted
    assert "d03" in c.round.folded
    c.tick(11.5)
    assert c.round.number == 2
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["participants"] == 2 and record["invited"] == 7 and record["deadline_extensions"] == 1


def test_without_clients_per_round_every_registered_device_takes_part_as_before(tmp_path: Path) -> None:
    c = make(tmp_path, min_clients=1)
    fleet(c, DEVICES[:3], online=False)  # presence plays no part
    out = c.start(0.0)
    assert invited_in(out) == {} and set(round_info(out)) == {"v", "round", "rounds", "state", "deadline", "blob_id",
                                                              "size", "sha256", "count", "base_digest"}
    for device in DEVICES[:3]:
        assert upload(c, device, blob_id=f"u-{device}") == []
    assert "invited" not in json.loads(c.state_message(1.0).payload) and c.invited_count == 3
    c.tick(2.0)  # every registered device answered: closed
    assert c.round.number == 2 and "invited" not in json.loads((tmp_path / "metrics.jsonl").read_text())
    assert "selection" not in json.loads((tmp_path / "state.json").read_text())["round"]


def test_round_info_and_invitations_stay_small_at_10000_devices(tmp_path: Path) -> None:
    """The messages a round publishes grow with M, never with the fleet: one RoundInfo, one small message
    per invited device, nothing per device not invited."""
    sizes = {}
    for n in (1_000, 10_000):
        c = make(tmp_path / str(n), clients_per_round=100, over_select=1.3, min_clients=1)
        devices = [f"device-{i:05d}" for i in range(n)]
        for device in devices:
            c.registered[device] = Registration(10, "test/1")  # 10,000 JSON registrations: a few seconds more
        for device in devices:  # each says online on its presence topic
            assert c.handle(TOPICS.presence(device), b"online", 0.0) == []
        out = c.start(0.0)
        invitations = [m for m in out if "/invite/" in m.topic]
        assert len(invitations) == 130 and len(out) == len(invitations) + model_chunks(out) + 2  # + RoundInfo, state
        sizes[n] = (len(next(m.payload for m in out if m.topic == TOPICS.round)),
                    max(len(m.payload) for m in invitations), len(c.state_message(0.0).payload))
    assert sizes[10_000][:2] == sizes[1_000][:2]  # RoundInfo and an invitation: the same bytes at 1,000 and 10,000
    round_bytes, invitation_bytes, state_bytes = sizes[10_000]
    assert round_bytes < 1024 and invitation_bytes < 64 and state_bytes < 1024


def model_chunks(out: list) -> int:
    """The model's chunk frames among published messages."""
    return sum("/model/" in m.topic for m in out)


def test_cli_refuses_inconsistent_selection_options(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedper.coordinator.cli import app

    artifacts = write_toy_export(tmp_path / "export", MANIFEST, tiny_tensors())
    result = CliRunner().invoke(app, ["--artifacts", str(artifacts), "--fleet", "lab", "--rounds", "1",
                                      "--state-dir", str(tmp_path / "s"), "--broker", "mqtt://x",
                                      "--clients-per-round", "2", "--min-clients", "3"])
    assert result.exit_code == 2 and "--min-clients 3 is above --clients-per-round 2" in result.output
    result = CliRunner().invoke(app, ["--artifacts", str(artifacts), "--fleet", "lab", "--rounds", "1",
                                      "--state-dir", str(tmp_path / "s"), "--broker", "mqtt://x", "--over-select", "2"])
    assert result.exit_code == 2 and "--over-select needs --clients-per-round" in result.output
    result = CliRunner().invoke(app, ["--artifacts", str(artifacts), "--fleet", "lab", "--rounds", "1",
                                      "--state-dir", str(tmp_path / "s"), "--embedded-broker", "--port", "0"])
    assert result.exit_code == 2 and "--port" in result.output  # not a broker on port 0 that nobody reaches


# ------------------------------------------------------------ the registry's own checkpoint file


def registry_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("registry-*.json"))


def test_an_accepted_update_commits_the_round_not_the_fleet(tmp_path: Path) -> None:
    """With 3,000 registered devices, state.json names the registry file instead of holding it, and an
    accepted update's commit neither grows with the fleet nor rewrites the registry file."""
    c = make(tmp_path, clients_per_round=2, over_select=1.0, min_clients=2)
    devices = [f"d{i}" for i in range(3000)]
    fleet(c, devices)
    c.start(0.0)
    c.tick(0.0)
    [registry] = registry_files(tmp_path)
    written = registry.stat().st_mtime_ns, registry.stat().st_ino
    invited = sorted(c.round.invited)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["registry"] == registry.name and "registered" not in state
    assert len(json.loads(registry.read_text())) == 3000
    assert send(c, invited[0], shifted(1.0), 10, now=1.0) == [] and invited[0] in c.round.folded
    assert (tmp_path / "state.json").stat().st_size < 2_000  # a few hundred bytes: the round, not 3,000 devices
    assert registry_files(tmp_path) == [registry] and (registry.stat().st_mtime_ns, registry.stat().st_ino) == written
    register(c, "late", 7)  # a change: written at the tick's pace, the old file deleted by that commit
    c.tick(1.0)
    [newer] = registry_files(tmp_path)
    assert newer != registry and json.loads(newer.read_text())["late"]["n_samples"] == 7
    resumed = make(tmp_path, clients_per_round=2, over_select=1.0, min_clients=2)
    assert len(resumed.registered) == 3001 and set(resumed.round.folded) == {invited[0]}


def test_a_folded_devices_registration_is_checkpointed_with_its_update(tmp_path: Path) -> None:
    """A device that registered and answered between two ticks: its update's commit also writes the
    registry, so a restart never holds an update from a device it does not know."""
    c = make(tmp_path)
    c.start(0.0)
    register(c, "a", 10)
    send(c, "a", shifted(1.0), 10)
    resumed = make(tmp_path)
    assert resumed.registered == {"a": Registration(10, "test/1")} and set(resumed.round.folded) == {"a"}


def test_a_state_json_with_the_registry_inline_is_migrated_at_start(tmp_path: Path) -> None:
    """A state directory written before the registry had its own file (state.json's `registered`):
    the restart resumes it whole, and its first commit moves the registry into a file."""
    c = make(tmp_path)
    c.start(0.0)
    register(c, "a", 10)
    register(c, "b", 30)
    c.tick(0.0)
    send(c, "a", shifted(1.0), 10)
    state_path = tmp_path / "state.json"
    [registry] = registry_files(tmp_path)
    old = earlier_layout(json.loads(state_path.read_text()), json.loads(registry.read_text()), tmp_path)  # by hand
    registry.unlink()
    state_path.write_text(json.dumps(old))

    c = make(tmp_path)
    assert set(c.registered) == {"a", "b"} and set(c.round.folded) == {"a"}
    c.start(5.0)
    migrated = json.loads(state_path.read_text())
    assert "registered" not in migrated
    assert json.loads((tmp_path / migrated["registry"]).read_text()) == {
        "a": {"n_samples": 10, "software": "test/1"}, "b": {"n_samples": 30, "software": "test/1"}}
    send(c, "b", shifted(3.0), 30, now=6.0)
    c.tick(7.0)
    expected = {k: (v * 10 + shifted(3.0)[k] * 30) / 40 for k, v in shifted(1.0).items()}
    for name, value in expected.items():
        np.testing.assert_allclose(c.model[name], value, rtol=1e-6)
    assert set(make(tmp_path).registered) == {"a", "b"}


def test_a_state_json_of_a_newer_version_is_refused_with_the_reason(tmp_path: Path) -> None:
    c = make(tmp_path)
    c.start(0.0)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "version": 3}))
    with pytest.raises(ValueError, match="version 3, newer than this coordinator's 2"):
        make(tmp_path)


def test_the_settings_name_exactly_the_aggregation_rules_there_are() -> None:
    from fedper.coordinator.config import AGGREGATOR_NAMES
    from fedper.coordinator.strategies.mean import AGGREGATORS

    assert tuple(AGGREGATORS) == AGGREGATOR_NAMES


def test_the_engine_writes_nothing_itself_and_returns_its_writes_before_its_messages(tmp_path: Path) -> None:
    """The pure engine: every write is an effect, in the order decided, ahead of the messages; a clock it reads
    only through `timer`. The shell (Coordinator) carrying them out gives the same files as before."""
    from fedper.coordinator.effects import AppendMetrics, Commit, Outbox, WriteFile, WriteSlot, WriteTensors
    from fedper.coordinator.engine import RoundEngine
    from fedper.wire import Outgoing

    config = Config.of(rounds=2, min_clients=2, round_timeout=10.0, chunk_size=50)
    engine = RoundEngine(MANIFEST, tiny_tensors(), TOPICS, config, Outbox(Store(tmp_path)), None, lambda: 0.0)
    effects = engine.start(0.0)
    kinds = [type(e).__name__ for e in effects]
    assert kinds[:2] == ["WriteTensors", "Commit"] and set(kinds[2:]) == {"Outgoing"}
    for device, n in (("a", 10), ("b", 30)):
        registration = Register(n, MANIFEST.base_digest, "t/1").encode()
        assert all(isinstance(e, Outgoing) for e in engine.handle(TOPICS.register(device), registration, 0.0))
    folded = []
    for device, n in (("a", 10), ("b", 30)):
        meta = UpdateMeta(1, n, MANIFEST.base_digest, {"accuracy": 0.5}, "fp32")
        for frame in chunk(encode_shared(MANIFEST, shifted(1.0)), 40, "u", meta.to_dict()):
            folded += engine.handle(TOPICS.update(device), frame, 1.0)
    # a's commit first writes the registry (both registrations), which it names; b's needs none
    assert [type(e) for e in folded] == [WriteSlot, WriteFile, Commit, WriteSlot, Commit]
    assert folded[2].state["registry"] == folded[1].name and b'"b"' in folded[1].data
    assert folded[2].state["round"]["folded"].keys() == {"a"}  # a snapshot: b came after it
    closing = engine.tick(2.0)
    writes = [e for e in closing if not isinstance(e, Outgoing)]
    assert [type(e) for e in writes] == [WriteTensors, AppendMetrics, Commit]
    assert writes[0].name == writes[2].state["model"] == "model-r2.safetensors"
    assert writes[1].record["round"] == 1 and writes[1].record["aggregate_s"] == 0.0  # the timer given
    assert closing.index(writes[-1]) < min(closing.index(m) for m in closing if isinstance(m, Outgoing))
    assert list(tmp_path.iterdir()) == []  # the engine wrote nothing


def test_the_round_table_reaches_every_phase_and_runs_every_step(tmp_path: Path) -> None:
    """coordinator/rounds.py's table is the machine: every step is some row's, every phase some row's target;
    a round driven to its end passes COLLECTING -> FINISHED, and a pair the table lacks changes nothing."""
    from fedper.coordinator.rounds import TRANSITIONS, Event, Phase, Step

    assert {step for _, steps in TRANSITIONS.values() for step in steps} == set(Step)
    assert {phase for phase, _ in TRANSITIONS.values()} == set(Phase)
    c = make(tmp_path, rounds=1, min_clients=1)
    c.start(0.0)
    register(c, "a", 10)
    assert c.phase is Phase.COLLECTING
    assert c._step(Event.NEXT, 1.0) == [] and c.phase is Phase.COLLECTING  # not a row: nothing moves
    send(c, "a", shifted(1.0), 10)
    c.tick(2.0)
    assert c.phase is Phase.FINISHED and c.finished and c.round.number == 1
    assert c._step(Event.COMPLETE, 3.0) == [] and c.phase is Phase.FINISHED
