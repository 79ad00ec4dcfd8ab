"""Differential privacy in the coordinator (--dp-noise-multiplier, docs/privacy.md): updates built by hand as
wire frames (json + struct + zlib here, not fedper's encoder) drive the engine; the released model carries
noise of std z*C/m on the trainable shared tensors and none on the BatchNorm statistics, each update moves it
by at most C/m, epsilon is reported per round (metrics.jsonl, the state message, Prometheus) and grows, a
budget stops the run or warns, and a coordinator restarted between updates releases the same model bit for
bit. The last test runs real agents (onnxruntime-training) through a real Mosquitto with DP on."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from helpers.legacy_state import rewrite_as_earlier
from helpers.processes import run_fleet
from safetensors.numpy import load_file

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import FINAL_FILE, METRICS_FILE, Store
from fedper.coordinator.strategies.mean import PARTIAL_EVERY
from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.privacy import PrivacyAccountant
from fedper.wire import Topics

FLEET = "dp"
BASE = f"fedper/v1/{FLEET}"
TRAINABLE = ("conv.weight", "conv.bias")
STATS = "bn.running_var"


def manifest() -> Manifest:
    """A base large enough to measure a standard deviation (2,040 trainable values), one BatchNorm statistic
    (shared, not trainable) and a head."""
    spec = [("conv.weight", (40, 50), "base", True), ("conv.bias", (40,), "base", True),
            (STATS, (40,), "base", False), ("classifier.weight", (3, 40), "head", True)]
    info = ModelInfo("dp-test", kp=1, num_classes=3, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper",
                    tensors=tuple(TensorSpec(n, s, "float32", r, t, shared=r == "base") for n, s, r, t in spec))


MANIFEST = manifest()


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"conv.weight": rng.standard_normal((40, 50)).astype(np.float32),
            "conv.bias": np.zeros(40, np.float32), STATS: np.ones(40, np.float32)}


# ---------------------------------------------------------------- frames by hand (docs/protocol.md)


def frame(header: dict[str, Any], body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">II", len(head), zlib.crc32(head + body)) + head + body


def safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    data, entries, offset = b"", {}, 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value, "<f4").tobytes()
        entries[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    text = json.dumps(entries).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def chunks(blob: bytes, meta: dict[str, Any], chunk_size: int = 4096) -> list[bytes]:
    count = max(1, -(-len(blob) // chunk_size))
    digest = hashlib.sha256(blob).hexdigest()
    return [frame({"v": 1, "blob_id": f"u{meta['round']}", "index": i, "count": count, "size": len(blob),
                   "chunk_size": chunk_size, "sha256": digest, "meta": meta}, blob[i * chunk_size:(i + 1) * chunk_size])
            for i in range(count)]


# ---------------------------------------------------------------- driving the engine


def make(state: Path, **config: Any) -> Coordinator:
    settings = {"rounds": 3, "min_clients": 1, "round_timeout": 1e6, "chunk_size": 4096, "clip_norm": 0.5,
                "dp_noise_multiplier": 1.0, **config}
    c = Coordinator(MANIFEST, initial(), Topics(FLEET), Config.of(**settings), Store(state))
    c.start(0.0)
    return c


def register(c: Coordinator, devices: list[str], n: int = 10) -> None:
    for device in devices:
        body = json.dumps({"v": 1, "n_samples": n, "base_digest": MANIFEST.base_digest, "software": "hand/1"})
        assert not c.handle(f"{BASE}/register/{device}", body.encode(), 0.5)


def update(c: Coordinator, device: str, tensors: dict[str, np.ndarray], n: int = 10) -> None:
    meta = {"round": c.round.number, "n_samples": n, "base_digest": MANIFEST.base_digest, "metrics": {}}
    for payload in chunks(safetensors(tensors), meta):
        out = c.handle(f"{BASE}/update/{device}", payload, 1.0)
        assert not out, [o.payload for o in out]


def moved(c: Coordinator, delta: float, seed: int, stats: float = 5.0) -> dict[str, np.ndarray]:
    """The round model plus a random direction of L2 norm `delta` over the trainable tensors; BN statistics set
    to `stats` (what a device's data would make them)."""
    rng = np.random.default_rng(seed)
    direction = {n: rng.standard_normal(c.model[n].shape) for n in TRAINABLE}
    norm = np.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    out = {n: (c.model[n] + direction[n] * (delta / norm)).astype(np.float32) for n in TRAINABLE}
    return {**out, STATS: np.full(40, stats, np.float32)}


def close(c: Coordinator, now: float = 2e6) -> None:
    c.tick(now)


def records(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / METRICS_FILE).read_text().splitlines()]


def state_message(c: Coordinator) -> dict[str, Any]:
    return json.loads(c.state_message(3e6).payload)


def trainable_delta(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([(after[n].astype(np.float64) - before[n]).ravel() for n in TRAINABLE])


# ---------------------------------------------------------------- tests


def test_the_released_model_carries_noise_of_std_z_c_over_m_and_keeps_the_batchnorm_statistics(tmp_path: Path) -> None:
    c = make(tmp_path, dp_noise_multiplier=2.0, clip_norm=0.5)
    register(c, ["a", "b", "c", "d"])
    before = {n: v.copy() for n, v in c.model.items()}
    for device in ["a", "b", "c", "d"]:
        update(c, device, {**{n: c.model[n] for n in TRAINABLE}, STATS: np.full(40, 9.0, np.float32)})
    close(c)
    noise = trainable_delta(c.model, before)  # the updates moved nothing: all of it is noise
    expected_std = 2.0 * 0.5 / 4  # z * C / m, m = the 4 registered devices
    assert abs(noise.std() / expected_std - 1) < 0.08, noise.std()  # 2,040 values: the sample std is within 2 %
    assert abs(noise.mean()) < 4 * expected_std / np.sqrt(noise.size)
    np.testing.assert_array_equal(c.model[STATS], before[STATS])  # not aggregated: the devices' 9.0 never shows
    assert records(tmp_path)[0]["dp"]["noise_std"] == pytest.approx(expected_std)


def test_each_update_moves_the_model_by_at_most_the_clip_norm_over_m(tmp_path: Path) -> None:
    c = make(tmp_path, dp_noise_multiplier=0.0, clip_norm=0.5, rounds=1)
    register(c, ["big", "small"])
    before = {n: v.copy() for n, v in c.model.items()}
    big, small = moved(c, 1000.0, seed=1), moved(c, 0.1, seed=2)
    update(c, "big", big)
    update(c, "small", small)
    close(c)
    released = trainable_delta(c.model, before)
    big_delta, small_delta = trainable_delta(big, before), trainable_delta(small, before)
    # the far-off update counts as if it were 0.5 long, the near one as it is; the sum is divided by m = 2
    expected = (big_delta * (0.5 / np.linalg.norm(big_delta)) + small_delta) / 2
    np.testing.assert_allclose(released, expected, atol=1e-6)
    assert np.linalg.norm(released) <= (0.5 + 0.1) / 2 + 1e-6
    dp = records(tmp_path)[0]["dp"]
    assert dp["unclipped"] == 1 and dp["epsilon"] is None  # no noise: no privacy (unbounded epsilon, null)
    assert c.dp_epsilon == float("inf")


def test_epsilon_is_reported_each_round_and_grows_in_metrics_the_state_message_and_prometheus(tmp_path: Path) -> None:
    c = make(tmp_path, dp_noise_multiplier=1.1, clip_norm=1.0, rounds=3, dp_delta=1e-3)
    register(c, ["a", "b"])
    assert state_message(c)["dp"]["epsilon"] == 0.0
    for _ in range(3):
        update(c, "a", moved(c, 0.3, seed=c.round.number))
        update(c, "b", moved(c, 2.0, seed=10 + c.round.number))
        close(c)
    epsilons = [r["dp"]["epsilon"] for r in records(tmp_path)]
    assert epsilons[0] > 0 and epsilons[0] < epsilons[1] < epsilons[2]
    reference = PrivacyAccountant(1e-3)  # every registered device takes part: q = 1
    for k, epsilon in enumerate(epsilons, 1):
        assert epsilon == pytest.approx(reference.projected_epsilon(1.0, 1.1, rounds=k))
    state = state_message(c)
    assert state["status"] == "finished" and state["dp"]["epsilon"] == epsilons[-1]
    assert state["dp"]["rounds_accounted"] == 3 and state["dp"]["delta"] == 1e-3

    from fedper.coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics()
    metrics.observe(c)
    assert metrics.registry.get_sample_value("fedper_dp_epsilon") == epsilons[-1]


def test_sampling_rate_is_invited_over_eligible_and_accounted_without_replacement(tmp_path: Path) -> None:
    """Issue 26: the round draws 1 of the 4 online devices (2 more are registered but offline, so they could
    not be drawn): q = 1/4, sampling without replacement, replace-one neighbours (the clipped sum moves by
    up to 2C), written out here for dp-accounting's RDP accountant."""
    c = make(tmp_path, clients_per_round=1, rounds=2)
    devices = ["a", "b", "c", "d"]
    register(c, [*devices, "e", "f"])
    for device in devices:
        c.handle(f"{BASE}/presence/{device}", b"online", 0.6)
    c.tick(0.7)  # invites one of the four
    (invited,) = c.round.invited
    update(c, invited, moved(c, 0.2, seed=3))
    close(c)
    dp = records(tmp_path)[0]["dp"]
    assert dp["sampling_rate"] == 0.25 and dp["expected_participants"] == 1.0
    library = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    library.compose(dp_accounting.SampledWithoutReplacementDpEvent(4, 1, dp_accounting.GaussianDpEvent(1.0 / 2)))
    assert dp["epsilon"] == pytest.approx(library.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("action", ["stop", "warn"])
def test_the_budget_stops_the_run_before_a_round_that_would_exceed_it_or_warns(
        tmp_path: Path, action: str, caplog: pytest.LogCaptureFixture) -> None:
    accountant = PrivacyAccountant(1e-5)
    one, two = accountant.projected_epsilon(1.0, 1.0, 1), accountant.projected_epsilon(1.0, 1.0, 2)
    c = make(tmp_path, rounds=4, dp_target_epsilon=(one + two) / 2, dp_budget_action=action)
    register(c, ["a"])
    with caplog.at_level(logging.WARNING, "fedper.coordinator"):
        update(c, "a", moved(c, 0.2, seed=1))
        close(c)
    budget_lines = [r.getMessage() for r in caplog.records if "privacy budget" in r.getMessage()]
    assert len(budget_lines) == 1 and "round 2 would bring epsilon" in budget_lines[0]
    if action == "stop":
        assert "run stopped" in budget_lines[0]
        state = state_message(c)
        assert c.finished and state["status"] == "finished" and state["dp"]["budget_stopped"]
        released = load_file(str(tmp_path / FINAL_FILE))
        for name in TRAINABLE:
            np.testing.assert_array_equal(released[name], c.model[name])
        assert len(records(tmp_path)) == 1 and records(tmp_path)[0]["dp"]["epsilon"] == pytest.approx(one)
        again = Coordinator(MANIFEST, initial(), Topics(FLEET), c.config, Store(tmp_path))
        assert again.finished and again.dp_epsilon == pytest.approx(one)  # a restart does not reopen it
    else:
        assert "going on" in budget_lines[0] and not c.finished and c.round.number == 2


def test_a_budget_that_one_round_exceeds_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one round with every device"):
        make(tmp_path, dp_target_epsilon=0.01)


@pytest.mark.parametrize(("config", "message"), [
    ({"clip_norm": None}, "needs --clip-norm"),
    ({"aggregator": "median"}, "cannot be combined"),
    ({"dp_noise_multiplier": None, "dp_target_epsilon": 1.0}, "need --dp-noise-multiplier"),
    ({"dp_noise_multiplier": None, "dp_adaptive_clipping": 0.5}, "need --dp-noise-multiplier"),
    ({"dp_adaptive_clipping": 1.5}, "target_quantile"),
    ({"dp_budget_action": "ignore"}, "stop or warn"),
])
def test_inconsistent_dp_settings_are_refused(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **config)


@pytest.mark.parametrize(("args", "message"), [
    (["--dp-noise-multiplier", "1"], "needs --clip-norm"),
    (["--dp-noise-multiplier", "1", "--clip-norm", "1", "--dp-budget-action", "maybe"], "stop or warn"),
    (["--dp-noise-multiplier", "1", "--clip-norm", "1", "--dp-target-epsilon", "0.001"], "already spends more"),
])
def test_the_cli_refuses_inconsistent_dp_flags_in_one_line(tmp_path: Path, tiny_artifacts: Path, args: list[str],
                                                           message: str) -> None:
    """On a real export: the coordinator verifies it before the engine checks the budget."""
    from typer.testing import CliRunner

    from fedper.coordinator.cli import app

    result = CliRunner().invoke(app, ["--artifacts", str(tiny_artifacts), "--fleet", FLEET, "--rounds", "1",
                                      "--state-dir", str(tmp_path / "s"), "--broker", "mqtt://x", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_state_directory_is_resumed_only_in_its_own_mode(tmp_path: Path) -> None:
    make(tmp_path / "dp")
    with pytest.raises(ValueError, match="with differential privacy"):
        make(tmp_path / "dp", dp_noise_multiplier=None)
    make(tmp_path / "plain", dp_noise_multiplier=None)
    with pytest.raises(ValueError, match="without differential privacy"):
        make(tmp_path / "plain")


@pytest.mark.parametrize(("adaptive", "earlier"), [(None, False), (0.5, False), (0.5, True)])
def test_a_restart_between_updates_releases_the_same_models_bit_for_bit(tmp_path: Path, adaptive: float | None,
                                                                        earlier: bool) -> None:
    """Two copies of one state directory (one secret): one run unbroken, the other restarted after updates 3
    and 9 (past the partial checkpoint of the float64 sums at 8) and between rounds; with adaptive clipping
    the clip norm it moved to is resumed too; `earlier`: each restart from state.json as the release before
    the versioned record wrote it."""
    devices = [f"d{i:02d}" for i in range(PARTIAL_EVERY + 3)]
    settings = {"rounds": 3, "dp_adaptive_clipping": adaptive}
    unbroken = make(tmp_path / "a", **settings)
    register(unbroken, devices)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    restarted = make(tmp_path / "b", **settings)
    register(restarted, devices)
    for _ in range(3):
        for i, device in enumerate(devices):
            update(unbroken, device, moved(unbroken, 0.1 + i / 10, seed=i))
            update(restarted, device, moved(restarted, 0.1 + i / 10, seed=i))
            if i in (2, PARTIAL_EVERY):
                if earlier:
                    rewrite_as_earlier(tmp_path / "b")
                restarted = make(tmp_path / "b", **settings)
        close(unbroken)
        close(restarted)
        if earlier:
            rewrite_as_earlier(tmp_path / "b")
        restarted = make(tmp_path / "b", **settings)
    assert unbroken.finished and restarted.finished
    a, b = load_file(str(tmp_path / "a" / FINAL_FILE)), load_file(str(tmp_path / "b" / FINAL_FILE))
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert [r["dp"] for r in records(tmp_path / "a")] == [r["dp"] for r in records(tmp_path / "b")]
    assert not np.array_equal(a["conv.bias"], initial()["conv.bias"])
    clip_norms = [r["dp"]["clip_norm"] for r in records(tmp_path / "a")]
    assert (len(set(clip_norms)) == 3) == (adaptive is not None)


@pytest.mark.parametrize(("delta", "direction"), [(0.01, "shrinks"), (50.0, "grows")])
def test_adaptive_clipping_moves_the_clip_norm_toward_the_quantile_and_splits_the_noise(
        tmp_path: Path, delta: float, direction: str) -> None:
    """Updates all within C (b = 1 > 0.5) shrink it, all beyond it (b = 0) grow it, by exp(-0.2 (b - 0.5))
    up to the count's noise; the model's noise is z_update * C / m with the paper's split of z."""
    devices = [f"d{i:02d}" for i in range(40)]
    c = make(tmp_path, rounds=2, clip_norm=1.0, dp_noise_multiplier=1.0, dp_adaptive_clipping=0.5)
    register(c, devices)
    for i, device in enumerate(devices):
        update(c, device, moved(c, delta, seed=i))
    close(c)
    dp = records(tmp_path)[0]["dp"]
    sigma_b = max(40 / 20, 1.0)
    assert dp["clip_norm"] == 1.0
    assert dp["noise_std"] == pytest.approx((1.0 - (2 * sigma_b) ** -2) ** -0.5 * 1.0 / 40)
    b = 1.0 if direction == "shrinks" else 0.0  # the noisy fraction is b + N(0, (sigma_b / m)^2): 0.05 here
    assert abs(np.log(dp["next_clip_norm"]) + 0.2 * (b - 0.5)) < 0.2 * 4 * sigma_b / 40
    assert (dp["next_clip_norm"] < 1.0) == (direction == "shrinks")
    assert state_message(c)["dp"]["clip_norm"] == dp["next_clip_norm"]
    for i, device in enumerate(devices):
        update(c, device, moved(c, delta, seed=i))
    close(c)
    assert records(tmp_path)[1]["dp"]["clip_norm"] == dp["next_clip_norm"]  # round 2 clipped with it


# ---------------------------------------------------------------- live: real agents through Mosquitto


@pytest.mark.mosquitto
def test_real_agents_train_under_dp_and_epsilon_is_reported_each_round(tmp_path: Path, tiny_artifacts: Path,
                                                                      mosquitto) -> None:
    from fedper.data import load_digits
    from fedper.edge.agent import Agent, AgentConfig

    rounds, state = 2, tmp_path / "coordinator"
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(tiny_artifacts), "--fleet", "dplive",
         "--rounds", str(rounds), "--min-clients", "2", "--round-timeout", "60", "--state-dir", str(state),
         "--broker", mosquitto.url, "--dp-noise-multiplier", "0.8", "--clip-norm", "1.0", "--dp-delta", "1e-3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    ds = load_digits(32).train
    agents, logs = [], []
    for j in range(2):
        idx = np.flatnonzero(ds.y < 4)[20 * j: 20 * (j + 1)]
        data = tmp_path / f"device{j}.npz"
        np.savez(data, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
        log: list[str] = []
        logs.append(log)
        agents.append(Agent(AgentConfig(artifacts=tiny_artifacts, data=data, broker=mosquitto.url, fleet="dplive",
                                        client_id=f"dev{j}", state_dir=tmp_path / f"dev{j}", batch_size=8, lr=0.05,
                                        reconnect_spread_s=1.0), log=log.append))
    err = run_fleet(coordinator, agents, 150, logs)
    closed = records(state)
    assert [r["participants"] for r in closed] == [2] * rounds
    epsilons = [r["dp"]["epsilon"] for r in closed]
    assert 0 < epsilons[0] < epsilons[1]
    assert epsilons == pytest.approx([PrivacyAccountant(1e-3).projected_epsilon(1.0, 0.8, k) for k in (1, 2)])
    assert "DP epsilon" in err
    assert all(agent.final_accuracy is not None for agent in agents)
