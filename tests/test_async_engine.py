"""Asynchronous buffered rounds (--mode async) in the coordinator's engine, driven with protocol frames and a
fake clock: a version every K deltas, each weighted by n_j and w(staleness) as computed here by hand; stale,
future and repeated updates refused with their codes; invitations that outlive a release; uploads under way
across a release; a restart after any update releasing the same bits; DP per release."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.frames import chunks, safetensors
from safetensors.numpy import load_file
from scipy.stats import norm
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper import selection
from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.effects import Commit
from fedper.coordinator.invitations import Invitations
from fedper.coordinator.store import FINAL_FILE, METRICS_FILE, RoundRecord, Store
from fedper.coordinator.strategies.mean import PARTIAL_EVERY
from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.wire import ErrorMessage, Invitation, RoundInfo, Topics

MANIFEST = tiny_manifest()
TOPICS = Topics("lab")
FLOAT = np.float32


def make(state: Path, manifest: Manifest = MANIFEST, initial: dict[str, np.ndarray] | None = None,
         **config: Any) -> Coordinator:
    settings = {"rounds": 3, "min_clients": 1, "round_timeout": 1e6, "chunk_size": 64, "mode": "async",
                "buffer_size": 2, **config}
    c = Coordinator(manifest, tiny_tensors() if initial is None else initial, TOPICS, Config.of(**settings),
                    Store(state))
    c.start(0.0)
    return c


def register(c: Coordinator, devices: dict[str, int], now: float = 0.0) -> None:
    for device, n in devices.items():
        body = {"v": 1, "n_samples": n, "base_digest": c.manifest.base_digest, "software": "hand/1"}
        assert not c.handle(TOPICS.register(device), json.dumps(body).encode(), now)
        c.handle(TOPICS.presence(device), b"online", now)


def send(c: Coordinator, device: str, tensors: dict[str, np.ndarray], round_: int, n: int, blob_id: str = "",
         now: float = 1.0) -> list[str]:
    """An update blob written by hand (tests/helpers/frames.py): the error codes it was answered with."""
    meta = {"round": round_, "n_samples": n, "base_digest": c.manifest.base_digest, "metrics": {"accuracy": 0.5}}
    out = []
    for frame in chunks(safetensors(tensors), meta, blob_id or f"{device}-r{round_}", 4096):
        out += c.handle(TOPICS.update(device), frame, now)
    return [ErrorMessage.decode(m.payload).code for m in out if "/error/" in m.topic]


def plus(model: dict[str, np.ndarray], delta: float) -> dict[str, np.ndarray]:
    return {k: (v + FLOAT(delta)).astype(FLOAT) for k, v in model.items()}


def records(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / METRICS_FILE).read_text().splitlines()]


def copy(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in model.items()}


def test_a_version_every_k_deltas_weighted_by_samples_and_staleness(tmp_path: Path) -> None:
    """Hand computation of FedBuff's step: version 2 = v1 + (10*1 + 30*3)/40; then c's delta of 2 trained on
    version 1 is one version old, weight 1/sqrt(2), folded with a's -1 on version 2."""
    c = make(tmp_path)
    info = RoundInfo.decode(next(m.payload for m in c.announce(0.0) if m.topic == TOPICS.round))
    assert info.max_staleness == 20 and info.round == 1
    register(c, {"a": 10, "b": 30, "c": 60})
    v1 = copy(c.model)
    assert send(c, "a", plus(v1, 1.0), 1, 10) == [] and c.round.number == 1
    assert send(c, "b", plus(v1, 3.0), 1, 30) == [] and c.round.number == 2  # the 2nd delta releases version 2
    v2 = {k: (v.astype(np.float64) + (10 * 1.0 + 30 * 3.0) / 40).astype(FLOAT) for k, v in v1.items()}
    for k in v2:
        np.testing.assert_array_equal(c.model[k], v2[k])
    assert send(c, "c", plus(v1, 2.0), 1, 60) == []  # trained on version 1 while version 2 is open
    assert send(c, "a", plus(c.model, -1.0), 2, 10, blob_id="a-again") == []
    w = 1 / math.sqrt(2)
    for k in v2:
        d_c = plus(v1, 2.0)[k].astype(np.float64) - v1[k]  # float32 rounding of v1 + 2, as the device sent it
        d_a = plus(v2, -1.0)[k].astype(np.float64) - v2[k]
        expected = (v2[k].astype(np.float64) + (60 * w * d_c + 10 * d_a) / 70).astype(FLOAT)
        np.testing.assert_array_equal(c.model[k], expected)
    first, second = records(tmp_path)
    assert first["buffer"]["updates"] == ["a@1", "b@1"] and first["buffer"]["staleness"] == [0, 0]
    assert second["buffer"]["updates"] == ["c@1", "a@2"] and second["buffer"]["staleness"] == [1, 0]
    assert second["buffer"]["staleness_weight"] == pytest.approx([w, 1.0]) and second["devices"] == ["a", "c"]


def test_stale_future_and_repeated_updates_are_refused_with_their_codes(tmp_path: Path) -> None:
    c = make(tmp_path, rounds=6, buffer_size=1, max_staleness=2)
    register(c, {"a": 10, "b": 10, "c": 10})
    models = {1: copy(c.model)}
    for version in range(1, 5):  # versions 2..5 released by a alone
        assert send(c, "a", plus(c.model, 0.5), version, 10) == []
        models[version + 1] = copy(c.model)
    assert c.round.number == 5
    before = copy(c.model)
    assert send(c, "b", plus(models[2], 1.0), 2, 10) == ["stale_update"]  # 3 versions old, more than 2
    assert send(c, "b", plus(models[5], 1.0), 6, 10) == ["late_update"]  # a round that is not open yet
    assert send(c, "c", plus(models[4], 1.0), 4, 10, blob_id="c1") == []  # 1 old: folded, version 6 released
    assert c.round.number == 6
    assert send(c, "c", plus(models[4], 1.0), 4, 10, blob_id="c2") == ["duplicate_update"]  # folded already
    assert c.counters["stale_update"] == 1 and c.counters["duplicate_update"] == 1 and c.counters["accepted"] == 5
    assert not np.array_equal(c.model["stem.bias"], before["stem.bias"])


def test_updates_trained_on_many_earlier_versions_are_formed_against_each(tmp_path: Path) -> None:
    """More earlier versions in use than the strategy keeps decoded (CACHED_VERSIONS): each stale delta is still
    formed against its own version's model, read back from its checkpoint (hand computation as above)."""
    from fedper.coordinator.strategies.fedbuff import CACHED_VERSIONS

    n_old = CACHED_VERSIONS + 3
    c = make(tmp_path, rounds=2 * n_old + 2, buffer_size=1, max_staleness=2 * n_old)
    register(c, {f"{kind}{i}": 10 for kind in "ds" for i in range(n_old + 1)})
    models = {}
    for version in range(1, n_old + 1):  # versions 2 .. n_old + 1, one update each
        models[version] = copy(c.model)
        assert send(c, f"d{version}", plus(c.model, 0.5), version, 10) == []
    for i, version in enumerate([*range(n_old, 0, -1)]):  # then stale updates on each, newest to oldest
        before = copy(c.model)
        assert send(c, f"s{i}", plus(models[version], 1.0), version, 10) == [], version
        staleness = c.round.number - 1 - version
        for k in before:
            delta = plus(models[version], 1.0)[k].astype(np.float64) - models[version][k]
            expected = (before[k].astype(np.float64) + (1 + staleness) ** -0.5 * delta).astype(FLOAT)
            np.testing.assert_array_equal(c.model[k], expected)


def test_updates_after_the_last_version_are_refused(tmp_path: Path) -> None:
    c = make(tmp_path, rounds=1, buffer_size=1)
    register(c, {"a": 10, "b": 10})
    assert send(c, "a", plus(c.model, 1.0), 1, 10) == [] and c.finished
    final = load_file(str(tmp_path / FINAL_FILE))
    assert send(c, "b", plus(c.model, 1.0), 1, 10) == ["late_update"]
    c = make(tmp_path, rounds=1, buffer_size=1)  # also after a restart
    assert send(c, "b", plus(c.model, 1.0), 1, 10) == ["late_update"]
    assert len(records(tmp_path)) == 1 and load_file(str(tmp_path / FINAL_FILE))["stem.bias"].tobytes() == \
        final["stem.bias"].tobytes()


def test_a_device_adds_one_update_to_a_version(tmp_path: Path) -> None:
    c = make(tmp_path, buffer_size=3)
    register(c, {"a": 10, "b": 10})
    assert send(c, "a", plus(c.model, 1.0), 1, 10) == []
    assert send(c, "a", plus(c.model, 1.0), 1, 10, blob_id="again") == ["duplicate_update"]
    assert len(c.round.folded) == 1 and c.round.number == 1


def invitations(out: list) -> dict[str, int]:
    return {m.topic.rsplit("/", 1)[1]: Invitation.decode(m.payload).round for m in out
            if "/invite/" in m.topic and m.payload}


def test_m_devices_keep_training_across_releases_each_on_its_own_version(tmp_path: Path) -> None:
    """--clients-per-round 2: a folded device's place goes to the next online device at once; one still
    training when its version is superseded stays invited to that version (its invitation is not replaced)
    and its update is taken; an uninvited device's is not."""
    c = make(tmp_path, rounds=4, buffer_size=1, clients_per_round=2, selection_seed=5, round_timeout=100.0)
    register(c, {f"d{i}": 10 for i in range(5)})
    invited = invitations(c.tick(0.6))
    assert len(invited) == 2 and set(invited.values()) == {1}
    fast, slow = sorted(invited)
    assert send(c, fast, plus(c.model, 1.0), 1, 10) == [] and c.round.number == 2
    out = c.announce(1.0)
    now_invited = invitations(out)
    assert now_invited[slow] == 1  # still training on version 1: its invitation stays that of round 1
    assert len(now_invited) == 2 and [r for d, r in now_invited.items() if d != slow] == [2]
    stranger = next(d for d in c.registered if d not in now_invited and d != fast)
    assert send(c, fast, plus(c.model, 1.0), 1, 10) == ["late_update"]  # its version-1 update, sent again
    assert send(c, stranger, plus(c.model, 1.0), 1, 10) == ["not_invited"]
    version1 = load_file(str(tmp_path / "version-r1.safetensors"))
    trained_on_1 = {t.name: version1[f"model/{t.name}"] + FLOAT(2.0) for t in MANIFEST.shared_tensors}
    assert send(c, slow, trained_on_1, 1, 10) == [] and c.round.number == 3
    assert records(tmp_path)[-1]["buffer"]["staleness"] == [1]
    assert slow not in invitations(c.announce(2.0)) or invitations(c.announce(2.0))[slow] == 3
    assert len(c.round.invited) == 2  # two devices training at once, again


def test_a_version_costs_no_pass_over_the_online_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's work per folded update must not grow with the fleet: after the devices joined, a
    version draws selection keys for the devices it released only and asks about as few devices whether
    they may be invited, the same at 300 and at 3,000 online devices."""
    drawn, asked = [], []
    real_key, real_eligible = selection.selection_key, Invitations._eligible
    monkeypatch.setattr(selection, "selection_key", lambda *args: drawn.append(args) or real_key(*args))

    def eligible(invitations: Invitations, r: RoundRecord) -> Callable[[str], bool]:
        check = real_eligible(invitations, r)
        return lambda device: asked.append(device) or check(device)

    monkeypatch.setattr(Invitations, "_eligible", eligible)
    work = {}
    for n in (300, 3_000):
        c = make(tmp_path / str(n), rounds=10, buffer_size=5, clients_per_round=5, selection_seed=11)
        register(c, {f"d{i}": 10 for i in range(n)})
        c.tick(0.6)
        drawn.clear(), asked.clear()
        for version in range(1, 5):
            for device in sorted(c.round.invited - c.round.folded.keys())[:5]:
                assert send(c, device, plus(c.model, 0.1), c.round.carried.get(device, version), 10, now=version) == []
            assert c.round.number == version + 1
            c.tick(version + 0.6)
        work[n] = (len(drawn), len(asked))
    assert work[300] == work[3_000] == (20, 20)  # 5 released devices a version, each ranked again and taken


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_a_device_offline_or_sitting_out_when_its_turn_came_is_invited_once_it_may_be(tmp_path: Path,
                                                                                     seed: int) -> None:
    """The ranking forgets a device it found offline, invited or sitting out; coming online again, or its
    sit-out ending, puts it back: it is invited again, whatever the keys (four seeds)."""
    c = make(tmp_path, rounds=40, buffer_size=1, clients_per_round=1, selection_seed=seed, round_timeout=100.0,
             answer_timeout=2.0, max_staleness=1)
    register(c, {"p": 10, "q": 10})
    first = next(iter(invitations(c.tick(0.6))))
    other = "q" if first == "p" else "p"
    c.handle(TOPICS.presence(other), b"offline", 0.7)
    for version in range(1, 4):  # `other` is offline: `first` alone is invited, version after version
        assert send(c, first, plus(c.model, 0.1), version, 10, now=version) == []
        c.tick(version + 0.6)
        assert c.round.invited == {first}
    c.handle(TOPICS.presence(other), b"online", 4.0)
    c.handle(TOPICS.presence(first), b"offline", 4.1)  # it declines: its place goes to the one back online
    assert other in invitations(c.tick(4.7))
    c.handle(TOPICS.presence(first), b"online", 4.8)
    missed = c.round.number  # `other` never answers: a miss; `first`, still invited, delivers
    c.tick(4.7 + 2.1)
    assert c.backoff.misses[other][0] == 1
    assert send(c, first, plus(c.model, 0.1), missed, 10, now=7.0) == [] and c.round.number == missed + 1
    now = 7.0
    for version in range(missed + 1, missed + 13):  # its stale invitation and its sit-out over, it is invited again
        fresh = sorted(d for d in c.round.invited - c.round.folded.keys() if d not in c.round.carried)
        if other in fresh:
            break
        now += 2.1  # past --answer-timeout: a stale invitation no longer holds the one place
        fresh = fresh or sorted(invitations(c.tick(now)))
        assert fresh == [first] and send(c, first, plus(c.model, 0.1), version, 10, now=now) == []
        c.tick(now)
    else:
        raise AssertionError(f"{other} was never invited again after its miss")


def test_an_upload_under_way_survives_a_release(tmp_path: Path) -> None:
    c = make(tmp_path, buffer_size=1, chunk_size=64)
    register(c, {"slow": 10, "fast": 10})
    v1 = copy(c.model)
    meta = {"round": 1, "n_samples": 10, "base_digest": MANIFEST.base_digest}
    frames = chunks(safetensors(plus(v1, 1.0)), meta, "slow-1", 32)
    assert len(frames) > 2
    for frame in frames[:2]:
        assert not c.handle(TOPICS.update("slow"), frame, 1.0)
    assert send(c, "fast", plus(v1, 3.0), 1, 10) == [] and c.round.number == 2
    for frame in frames[2:]:
        assert not [m for m in c.handle(TOPICS.update("slow"), frame, 1.5) if "/error/" in m.topic]
    assert c.round.number == 3 and records(tmp_path)[-1]["buffer"]["updates"] == ["slow@1"]


def test_a_synchronous_round_still_drops_uploads_under_way_when_it_closes(tmp_path: Path) -> None:
    c = make(tmp_path, mode="sync", rounds=2, min_clients=1, clients_per_round=1, selection_seed=3)
    register(c, {"slow": 10, "fast": 10})
    c.tick(0.6)
    (device,) = c.round.invited
    frames = chunks(safetensors(plus(c.model, 1.0)), {"round": 1, "n_samples": 10,
                                                      "base_digest": MANIFEST.base_digest}, "part", 32)
    c.handle(TOPICS.update(device), frames[0], 1.0)
    assert len(c._intake.reassembler) == 1
    assert send(c, device, plus(c.model, 1.0), 1, 10, blob_id="whole") == []
    c.tick(2.0)
    assert c.round.number == 2 and len(c._intake.reassembler) == 0


@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_a_restart_after_any_update_releases_the_same_bits(tmp_path: Path, aggregator: str) -> None:
    """One run unbroken; copies of its state directory restarted after each update (past the buffer's partial
    checkpoint at PARTIAL_EVERY folds, at a release, between) and carried to the end the same way."""
    k = PARTIAL_EVERY + 2
    samples = {f"d{i:02d}": 10 + 7 * i for i in range(3 * k)}
    devices = list(samples)
    settings = {"rounds": 3, "buffer_size": k, "aggregator": aggregator, "max_staleness": 2}
    rng = np.random.default_rng(0)
    shifts = [(i % 3, float(rng.normal())) for i in range(3 * k)]  # (staleness, shift) per update

    def run(state: Path, restart_after: int | None) -> None:
        c = make(state, **settings)
        register(c, samples)
        models = {1: copy(c.model)}
        sent, used = 0, set()
        while not c.finished:
            version = c.round.number
            models.setdefault(version, copy(c.model))
            stale, shift = shifts[sent]
            trained_on = max(1, version - stale)
            device = next(d for d in devices[sent % 3:] + devices[:sent % 3]
                          if d not in c.round.folded and (d, trained_on) not in used)
            used.add((device, trained_on))
            assert send(c, device, plus(models[trained_on], shift), trained_on, samples[device]) == [], sent
            sent += 1
            if sent == restart_after:
                c = make(state, **settings)
                register(c, samples)
                c.tick(2.0)  # a restart that holds a full buffer releases it at its first tick
        assert sent == 3 * k

    run(tmp_path / "unbroken", None)
    final = load_file(str(tmp_path / "unbroken" / FINAL_FILE))
    for restart_after in (1, PARTIAL_EVERY - 1, PARTIAL_EVERY, PARTIAL_EVERY + 1, k, k + 1, 2 * k + 3):
        shutil.rmtree(tmp_path / "restarted", ignore_errors=True)
        run(tmp_path / "restarted", restart_after)
        got = load_file(str(tmp_path / "restarted" / FINAL_FILE))
        assert all(got[n].tobytes() == final[n].tobytes() for n in final), restart_after
        assert [r["buffer"] for r in records(tmp_path / "restarted")] == [
            r["buffer"] for r in records(tmp_path / "unbroken")]


class Killed(Exception):
    """The process died (SIGKILL) after the store's first commit of a message's writes."""


class KilledAtItsNextCommit(Coordinator):
    """The durable coordinator, killed once `armed` right after the first commit a message leads to: the commit of
    the K-th fold made, the release's writes and commit not (the chaos soak's SIGKILL found that window)."""

    armed = False

    def _carry_out(self, effects: list) -> list:
        commits = [i for i, e in enumerate(effects) if isinstance(e, Commit)]
        if not (self.armed and commits):
            return super()._carry_out(effects)
        super()._carry_out(effects[:commits[0] + 1])
        raise Killed


def test_a_buffer_full_when_the_coordinator_died_is_released_at_start_with_its_own_k_updates(tmp_path: Path) -> None:
    """Killed between the K-th fold's commit and its release's: the restarted coordinator releases version 1 at
    start, so an update that comes next folds into version 2, in its record too (metrics.jsonl once listed it,
    and its n_samples, in version 1's record while the buffer had folded it into version 2)."""
    samples = {"d0": 3, "d1": 5, "d2": 7}
    c = KilledAtItsNextCommit(MANIFEST, tiny_tensors(), TOPICS, Config.of(
        rounds=3, min_clients=1, round_timeout=1e6, chunk_size=64, mode="async", buffer_size=2), Store(tmp_path))
    c.start(0.0)
    register(c, samples)
    first = copy(c.model)
    assert send(c, "d0", plus(first, 0.5), 1, 3) == []
    c.armed = True
    with pytest.raises(Killed):
        send(c, "d1", plus(first, -0.25), 1, 5)
    assert not (tmp_path / METRICS_FILE).exists() or records(tmp_path) == []  # version 1 not released yet

    restarted = make(tmp_path)
    assert restarted.round.number == 2 and [r["devices"] for r in records(tmp_path)] == [["d0", "d1"]]
    register(restarted, samples)
    assert send(restarted, "d2", plus(first, 1.0), 1, 7) == []  # trained on version 1: staleness 1
    assert send(restarted, "d0", plus(copy(restarted.model), 0.1), 2, 3) == []
    version_1, version_2 = records(tmp_path)
    assert version_1["n_samples"] == 8 and version_1["buffer"]["updates"] == ["d0@1", "d1@1"]
    assert sorted(version_2["devices"]) == ["d0", "d2"] and version_2["n_samples"] == 10
    assert sorted(version_2["buffer"]["updates"]) == ["d0@2", "d2@1"] and version_2["buffer"]["staleness"] == [1, 0]


def test_a_state_directory_is_resumed_only_in_its_own_mode(tmp_path: Path) -> None:
    make(tmp_path / "sync", mode="sync")
    with pytest.raises(ValueError, match="synchronous rounds"):
        make(tmp_path / "sync")
    make(tmp_path / "async")
    with pytest.raises(ValueError, match="buffer"):
        make(tmp_path / "async", buffer_size=5)  # another K: the buffer was written with other settings


@pytest.mark.parametrize(("options", "message"), [
    ({"secure_aggregation": True, "clip_norm": 1.0, "secagg_identity_root": "root.pem"}, "trusted enclave"),
    ({"clip_norm": 1.0, "dp_noise_multiplier": 1.0, "dp_adaptive_clipping": 0.5}, "fixed --clip-norm"),
    ({"clients_per_round": 4, "over_select": 1.5}, "--over-select has no meaning"),
    ({"staleness": "exponential"}, "--staleness"),
    ({"server_lr": 0.0}, "server_lr"),
])
def test_combinations_async_cannot_make_sound_are_refused_with_the_reason(options: dict[str, Any],
                                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config.of(rounds=2, mode="async", **options)


def test_the_cli_refuses_async_with_secure_aggregation_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "root.pem"
    root.write_text("not used")
    run = subprocess.run([sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(tmp_path), "--fleet",
                          "x", "--state-dir", str(tmp_path / "s"), "--broker", "mqtt://127.0.0.1:9", "--rounds", "2",
                          "--mode", "async",
                          "--secure-aggregation", "--clip-norm", "1", "--secagg-identity-root", str(root)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "trusted enclave" in lines[0], run.stderr


# ---------------------------------------------------------------- DP per released version


def dp_manifest() -> Manifest:
    """2,040 trainable shared values (enough to measure a standard deviation) and one BatchNorm statistic."""
    spec = [("conv.weight", (40, 50), "base", True), ("conv.bias", (40,), "base", True),
            ("bn.running_var", (40,), "base", False), ("classifier.weight", (3, 40), "head", True)]
    info = ModelInfo("dp-test", kp=1, num_classes=3, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper",
                    tensors=tuple(TensorSpec(n, s, "float32", r, t, shared=r == "base") for n, s, r, t in spec))


def dp_initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"conv.weight": rng.standard_normal((40, 50)).astype(FLOAT), "conv.bias": np.zeros(40, FLOAT),
            "bn.running_var": np.ones(40, FLOAT)}


def test_dp_noise_per_release_is_server_lr_z_c_over_k_and_statistics_stay(tmp_path: Path) -> None:
    manifest = dp_manifest()
    c = make(tmp_path, manifest, dp_initial(), rounds=2, buffer_size=4, clip_norm=0.5, dp_noise_multiplier=2.0,
             server_lr=0.5)
    register(c, {f"d{i}": 10 for i in range(4)})
    before = copy(c.model)
    for i in range(4):  # deltas of 0 (only the statistic moves, to 9): the release moves by its noise alone
        assert send(c, f"d{i}", {**copy(before), "bn.running_var": np.full(40, 9.0, FLOAT)}, 1, 10) == []
    noise = np.concatenate([(c.model[n].astype(np.float64) - before[n]).ravel() for n in ("conv.weight",
                                                                                          "conv.bias")])
    expected = 0.5 * 2.0 * 0.5 / 4  # server_lr * z * C / K
    assert abs(noise.std() / expected - 1) < 0.08 and abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)
    np.testing.assert_array_equal(c.model["bn.running_var"], before["bn.running_var"])
    assert records(tmp_path)[0]["dp"]["noise_std"] == pytest.approx(expected)


def test_dp_clips_each_delta_to_c_before_its_staleness_weight(tmp_path: Path) -> None:
    manifest = dp_manifest()
    c = make(tmp_path, manifest, dp_initial(), rounds=2, buffer_size=2, clip_norm=0.5, dp_noise_multiplier=0.0)
    register(c, {"big": 10, "small": 1_000})
    before = copy(c.model)
    big = {**copy(before), "conv.bias": before["conv.bias"] + FLOAT(100.0)}  # norm 632: clipped to 0.5
    small = {**copy(before), "conv.bias": before["conv.bias"] + FLOAT(0.01)}  # norm 0.063: kept
    assert send(c, "big", big, 1, 10) == [] and send(c, "small", small, 1, 1_000) == []
    moved = c.model["conv.bias"].astype(np.float64) - before["conv.bias"]
    expected = (0.5 / np.sqrt(40) + (small["conv.bias"].astype(np.float64) - before["conv.bias"])) / 2  # uniform
    np.testing.assert_allclose(moved, expected, rtol=1e-5)


def test_dp_epsilon_per_release_is_a_gaussian_of_sensitivity_2c_composed_without_sampling(tmp_path: Path) -> None:
    """Each release: the sum of exactly K clipped deltas, one per device at most, whoever arrived; a neighbouring
    fleet (one device's data replaced) moves it by up to 2C, with noise z C, and no sampling is claimed. The
    reported epsilon after T releases lies between the exact bound of that composition (Gaussian of
    mu = sqrt(T) 2 / z, Balle & Wang 2018) and the classic RDP conversion of the same (Mironov 2017)."""
    manifest = dp_manifest()
    z, delta, releases = 3.0, 1e-5, 3
    c = make(tmp_path, manifest, dp_initial(), rounds=releases, buffer_size=2, clip_norm=0.5,
             dp_noise_multiplier=z, dp_delta=delta)
    register(c, {"a": 10, "b": 10})
    while not c.finished:
        for device in ("a", "b"):
            assert send(c, device, plus(c.model, 0.01), c.round.number, 10, blob_id=f"{device}{c.round.number}") == []
    eps = records(tmp_path)[-1]["dp"]["epsilon"]
    assert records(tmp_path)[-1]["dp"]["sampling_rate"] == 1.0
    mu = math.sqrt(releases) * 2 / z

    def exact_delta(e: float) -> float:
        return norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)

    lo, hi = 0.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_delta(mid) > delta else (lo, mid)
    classic = min(releases * alpha * (2 / z) ** 2 / 2 + math.log(1 / delta) / (alpha - 1)
                  for alpha in np.linspace(1.01, 200, 20_000))
    assert hi * 0.999 <= eps <= classic, (hi, eps, classic)
